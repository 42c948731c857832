"""The cell worker: a child process that runs cells for the parent, and the parent's handle on it.

The parent (:mod:`codabench.runner`) owns the plan, the result files, progress and the report; every call into an
implementation happens in the worker, a child Python process (:data:`WORKER_MAIN`) (a socket pair carries pickled
requests and answers; stdout and stderr stay the terminal's) that is kept alive across cells (compile, JIT and
autotuning caches stay warm) and replaced when it dies. Each request (a cell's first round, a later round, a
group's GEMMs, the environment) has a deadline (``--cell-timeout``): a worker that misses it is killed and the
request fails with "timed out after N s"; a worker that exits or is killed by a signal (``sys.exit``, ``os._exit``,
a segfault, a lost CUDA context) fails its request with the exit code or the signal's name. The next request starts a
fresh worker. The worker ignores SIGINT: Ctrl-C reaches the parent, which stops the worker and writes the report.

:class:`InlineWorker` runs the same requests in the parent process (``--inline``): for debuggers, and for tests
that patch the harness; there a crash or a hang ends the run.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from codabench import guard
from codabench.config import RunConfig
from codabench.measure import Measurer, describe_exception
from codabench.discovery import discover
from codabench.registry import Registry

DEVICE_LOST_EXIT = 75
"""Exit code of a worker whose CUDA context broke (the request that broke it has its answer)."""
POLL_S = 0.1
WORKER_MAIN = ("import sys; from codabench.bootstrap import select_device; select_device(); "
               "from multiprocessing.connection import Connection; from codabench.worker import serve; "
               "serve(Connection(int(sys.argv[1])))")
"""The worker process's program: the device selection (interpreter, quiet loggers) before anything else is imported,
then :func:`serve` on the inherited socket."""
START_TIMEOUT_S = 300.0
"""Deadline of a worker's start (imports of torch, Triton and every plugin, CUDA initialisation), when it exceeds
the cell timeout."""


@dataclass
class Failure:
    """A request that got no answer from the implementation: the reason, as the cell's error message."""

    message: str


def exit_message(code: int | None) -> str:
    """What ended a worker, for an error row."""
    if code is None:
        return "the worker process stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the worker process was killed by {name}" + (" (a crash in native code)" if name in (
            "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT") else "")
    if code == DEVICE_LOST_EXIT:
        return "the worker process left: its CUDA context is unusable"
    return f"the worker process exited with code {code} (sys.exit or os._exit in the implementation?)"


def dispatch(measurer: Measurer, method: str, args: tuple) -> Any:
    """Run one request; an exception of the harness itself, or a replaced clock or torch function, is a Failure."""
    try:
        value = getattr(measurer, method)(*args)
    except Exception as e:
        value = Failure(describe_exception(e))
    bad = guard.restore()
    return Failure(guard.tamper_message(bad)) if bad else value


def serve(conn: Connection) -> None:
    """The worker process's main loop: receive the run's config, load the implementations, then answer requests
    until told to stop, or until the parent is gone (its end of the connection closed: the worker ends quietly)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        cfg: RunConfig = conn.recv()
    except (EOFError, OSError):
        return
    guard.snapshot()
    registry = discover(cfg.plugin_files, entry_points=cfg.entry_points)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # again: a plugin's import may have set its own handler
    measurer = Measurer(cfg, registry)
    try:
        conn.send(("ready", None))
        while True:
            method, args = conn.recv()
            if method == "stop":
                return
            conn.send(("done", dispatch(measurer, method, args)))
            if measurer.device_lost:
                conn.close()
                os._exit(DEVICE_LOST_EXIT)
    except (EOFError, OSError):  # the parent closed the connection or exited
        return


class WorkerProcess:
    """The parent's handle on the worker process: requests with a deadline; a dead worker is replaced lazily."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.timeout_s = cfg.cell_timeout_s
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        """True once the running worker said it is ready."""
        self.starts = 0

    def call(self, method: str, *args: Any) -> Any:
        """The worker's answer to ``method(*args)``, or a :class:`Failure` (timeout, exit, signal, harness error)."""
        if not self._ready or self._proc.poll() is not None:
            failure = self._start()
            if failure is not None:
                return failure
        try:
            self._conn.send((method, args))
        except OSError:
            return self._dead()
        return self._receive(self.timeout_s)

    def spawn(self) -> None:
        """Start a worker process without waiting for it: it imports torch, Triton and the plugins while the caller
        goes on (the first :meth:`call` waits for it to be ready)."""
        self._kill()
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        self._proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._ready = False
        self.starts += 1
        try:
            self._conn.send(self.cfg)
        except OSError:  # the worker died at once: waiting for it (:meth:`_start`) finds out why
            pass

    def close(self) -> None:
        """Stop the worker: asked to, if it is ready; killed if it is still starting (or does not stop within 2 s)."""
        if self._proc is None:
            return
        try:
            if self._ready and self._proc.poll() is None:
                self._conn.send(("stop", ()))
                self._proc.wait(2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()

    def _start(self) -> Failure | None:
        """Wait for the spawned worker (spawn one if there is none, or it died) to be ready."""
        if self._proc is None or self._proc.poll() is not None:
            self.spawn()
        answer = self._receive(max(self.timeout_s, START_TIMEOUT_S))
        self._ready = not isinstance(answer, Failure)
        return Failure(f"starting the worker: {answer.message}") if isinstance(answer, Failure) else None

    @property
    def alive(self) -> bool:
        """A worker that is ready for a request and in step with this handle (asking any other starts a new one)."""
        return self._ready and self._proc is not None and self._proc.poll() is None

    def _receive(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._conn.poll(POLL_S):
                    try:
                        return self._conn.recv()[1]
                    except (EOFError, OSError):
                        return self._dead()
                if self._proc.poll() is not None:
                    return self._dead()
                if time.monotonic() > deadline:
                    self._kill()
                    return Failure(f"timed out after {timeout_s:g} s (the worker was stopped; the run goes on in a "
                                   "new one)")
        except BaseException:  # Ctrl-C while waiting: the answer would reach the next request, so none may follow
            self._kill()
            raise

    def _dead(self) -> Failure:
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self._kill()
        return Failure(exit_message(code))

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        self._ready = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class InlineWorker:
    """The worker's requests run in this process (``--inline``): no isolation, no timeout."""

    def __init__(self, cfg: RunConfig, registry: Registry):
        guard.snapshot()
        self.measurer = Measurer(cfg, registry)

    alive = True

    def call(self, method: str, *args: Any) -> Any:
        return dispatch(self.measurer, method, args)

    def close(self) -> None:
        pass
