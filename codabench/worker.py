"""The cell worker: a child process that runs cells for the parent, and the parent's handle on it.

The parent (:mod:`codabench.runner`) owns the plan, the result files, progress and the report; every call into an
implementation happens in the worker, a child Python process (:data:`WORKER_MAIN`) (a socket pair carries pickled
requests and answers; stdout and stderr stay the terminal's) that is kept alive across cells (compile, JIT and
autotuning caches stay warm) and replaced when it dies. The worker leads a session of its own (a process group):
after a request that timed out or crashed, and when the run ends, everything in that group is killed, children a
plugin spawned included, so that none of them outlives its cell and slows the next one. Each request (a cell's first
round, a later round, a group's GEMMs, the environment) has a deadline (``--cell-timeout``): a worker that misses it
is killed and the request fails with "timed out after N s"; a worker that exits or is killed by a signal
(``sys.exit``, ``os._exit``, a segfault, a lost CUDA context) fails its request with the exit code or the signal's
name. The next request starts a fresh worker. The worker ignores SIGINT: Ctrl-C reaches the parent, which stops the
worker and writes the report.

Starting, the worker reports each plugin import to the parent (:func:`codabench.discovery.discover`'s ``gate`` and
``done``). An import that takes longer than the cell timeout, that ends the worker process, that leaves a thread
running its own code (:func:`codabench.guard.own_threads`: it would run beside every timed call), or that changes
what no restore undoes (:func:`codabench.guard.lasting`) is vetoed: the worker is stopped and started again without
that plugin, which gets a load error, in this worker and every later one, and in the parent's registry
(:meth:`WorkerProcess.import_verdict` lets the parent's own discovery skip it too, so a hanging import never hangs
the command line). An import slower than :data:`SLOW_IMPORT_S` is printed and recorded in env.json
(``slow_plugin_imports``). Each plugin is checked for tampering right after its import (:mod:`codabench.discovery`):
the blame falls on that plugin's load error, in every worker, and never on a cell.

Each request is checked the same way after it (:func:`dispatch`): tampering is its cell's error row (and is undone),
and a request after which a thread runs its implementation's code, or holds it as queued work (any thread but the
worker's own: one a plugin made at import and handed work in a call too), or that left a change no restore undoes (a
kernel registered in torch's dispatcher through ``torch._C``, a backend fallback), retires the worker with its answer
(:attr:`Failure.retire`): the parent kills the worker's process group, the thread with it, and the next request
starts a fresh worker, so that no later cell runs beside the thread or with the kernel.

:class:`InlineWorker` runs the same requests in the parent process (``--inline``): for debuggers, and for tests
that patch the harness; there a crash or a hang ends the run, and so does a request that would have retired a worker,
after its cell's error row.
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
from codabench.matrix import Cell
from codabench.registry import REGISTRY, Registry

DEVICE_LOST_EXIT = 75
"""Exit code of a worker whose CUDA context broke (the request that broke it has its answer)."""
RETIRED_EXIT = 76
"""Exit code of a worker retired by its last answer (:attr:`Failure.retire`)."""
POLL_S = 0.1
WORKER_MAIN = ("import sys; from codabench.bootstrap import select_device; select_device(); "
               "from multiprocessing.connection import Connection; from codabench.worker import serve; "
               "serve(Connection(int(sys.argv[1])))")
"""The worker process's program: the device selection (interpreter, quiet loggers) before anything else is imported,
then :func:`serve` on the inherited socket."""
SLOW_IMPORT_S = 10.0
"""A plugin import slower than this is reported: every worker start pays it again."""
START_TIMEOUT_S = 300.0
"""Deadline of a worker's start (imports of torch, Triton and every plugin, CUDA initialisation), when it exceeds
the cell timeout."""


@dataclass
class Failure:
    """A request that got no answer from the implementation: the reason, as the cell's error message."""

    message: str
    retire: bool = False
    """The worker process that answered must serve no other request: the implementation left in it what only a new
    process is rid of (a thread of its own, a kernel in torch's dispatcher that no restore undoes)."""


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


def dispatch(measurer: Measurer, method: str, args: tuple, fate: str = guard.REPLACED) -> Any:
    """Run one request; an exception of the harness itself, a replaced clock or torch function, or a thread other
    than this one that runs its implementation's code after it, or holds such code as work waiting for it (new or
    old: a pool made at import and handed work by the call counts; :func:`codabench.guard.own_threads`), is a Failure,
    one that retires the worker where what the request left cannot be undone in this process (``fate``: what becomes
    of the process, for the cell's row)."""
    try:
        with measurer.request():
            value = getattr(measurer, method)(*args)
    except Exception as e:
        value = Failure(describe_exception(e))
    except KeyboardInterrupt as e:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # --inline: Ctrl-C (or SIGTERM) stops the run
            raise
        value = Failure(describe_exception(e))  # the worker ignores SIGINT: the implementation raised it
    bad = guard.restore()
    kept = guard.lasting(bad)
    started = guard.own_threads((), guard.module_files(_sources(measurer.registry, args)))
    if not bad and not started:
        return value
    reasons = [guard.tamper_message(bad, kept, fate)] if bad else []
    if started:
        reasons.append(f"{guard.threads_message(started, 'the call')}; it ends with its process, {fate}; this cell "
                       "does not count")
    return Failure("; ".join(reasons), retire=bool(kept or started))


def _cells(args: tuple) -> list[Cell]:
    """The cells a request serves (its Cell arguments, alone or in a list)."""
    return [c for a in args for c in (a if isinstance(a, list) else [a]) if isinstance(c, Cell)]


def _sources(registry: Registry, args: tuple) -> list[str]:
    """The modules of the implementations whose cells a request serves."""
    return [registry.impls[c.op, c.impl].source for c in _cells(args) if (c.op, c.impl) in registry.impls]


def serve(conn: Connection) -> None:
    """The worker process's main loop: receive the run's config and the plugins not to import (source: the reason),
    load the implementations (reporting each import), then answer requests until told to stop, or until the parent is
    gone (its end of the connection closed: the worker ends quietly)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        cfg: RunConfig = conn.recv()
        vetoed: dict[str, str] = conn.recv()
    except (EOFError, OSError):
        return
    guard.snapshot()

    def gate(source: str) -> str | None:
        if source not in vetoed:
            conn.send(("importing", source))
        return vetoed.get(source)

    try:
        registry = discover(cfg.plugin_files, entry_points=cfg.entry_points, gate=gate,
                            done=lambda source, seconds, veto: conn.send(("imported", (source, seconds, veto))))
    except OSError:  # the parent is gone
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # again: a plugin's import may have set its own handler
    measurer = Measurer(cfg, registry)
    try:
        conn.send(("ready", registry.load_errors))
        while True:
            method, args = conn.recv()
            if method == "stop":
                return
            answer = dispatch(measurer, method, args)
            conn.send(("done", answer))
            if isinstance(answer, Failure) and answer.retire:
                conn.close()
                os._exit(RETIRED_EXIT)
            if measurer.device_lost:
                conn.close()
                os._exit(DEVICE_LOST_EXIT)
    except (EOFError, OSError):  # the parent closed the connection or exited
        return


class WorkerProcess:
    """The parent's handle on the worker process: requests with a deadline; a dead worker is replaced lazily.

    ``registry``: the parent's, which gets the worker's load errors (those of vetoed imports among them)."""

    def __init__(self, cfg: RunConfig, registry: Registry = REGISTRY):
        self.cfg, self.registry = cfg, registry
        self.timeout_s = cfg.cell_timeout_s
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        """True once the running worker said it is ready."""
        self.starts = 0
        self.vetoed: dict[str, str] = {}
        """Plugins no worker imports any more (source: the load error): their import hung or ended the worker."""
        self.verdicts: dict[str, str | None] = {}
        """Each plugin import a worker finished (None) or that was vetoed (the reason)."""
        self.slow_imports: dict[str, float] = {}
        """Seconds of each plugin import slower than SLOW_IMPORT_S."""
        self._importing: tuple[str, float] | None = None
        """The plugin the starting worker is importing, and since when (time.monotonic())."""
        self._start_deadline = 0.0

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
        answer = self._receive(self.timeout_s)
        if isinstance(answer, Failure) and answer.retire:  # its threads die with its process group
            self._kill()
        if method == "env" and isinstance(answer, dict) and self.slow_imports:
            answer["slow_plugin_imports"] = {s: round(t, 1) for s, t in self.slow_imports.items()}
        return answer

    def import_verdict(self, source: str) -> str | None:
        """Wait until the starting worker has imported plugin ``source`` (None) or vetoed it (the reason: the
        caller must not import it either). None also where no worker is starting or it imports no such plugin."""
        while source not in self.verdicts and self._proc is not None and not self._ready:
            if self._starting() is not None:  # the worker failed to start: the next request tries again
                break
        return self.verdicts.get(source)

    def spawn(self) -> None:
        """Start a worker process without waiting for it: it imports torch, Triton and the plugins while the caller
        goes on (the first :meth:`call` waits for it to be ready)."""
        self._kill()
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        self._proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._ready, self._importing = False, None
        self._start_deadline = time.monotonic() + max(self.timeout_s, START_TIMEOUT_S)
        self.starts += 1
        try:
            self._conn.send(self.cfg)
            self._conn.send(dict(self.vetoed))
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
        while not self._ready:
            failure = self._starting()
            if failure is not None:
                return Failure(f"starting the worker: {failure.message}")
        return None

    def _starting(self) -> Failure | None:
        """One step of a worker's start: handle its next report, or veto the plugin whose import hangs or ended the
        worker (and start another without it); a Failure where the start itself timed out or the worker died."""
        try:
            if self._conn.poll(POLL_S):
                try:
                    kind, value = self._conn.recv()
                except (EOFError, OSError):
                    return self._died_starting()
                self._report(kind, value)
                return None
            if self._proc.poll() is not None:
                return self._died_starting()
            now = time.monotonic()
            if self._importing is not None and now - self._importing[1] > self.timeout_s:
                self._veto(self._importing[0], f"importing it took more than {self.timeout_s:g} s (the worker was "
                                               "stopped and started again without this plugin)")
            elif now > self._start_deadline:
                self._kill()
                return Failure(f"timed out after {max(self.timeout_s, START_TIMEOUT_S):g} s")
            return None
        except BaseException:  # Ctrl-C while waiting: stop the starting worker, not orphan it
            self._kill()
            raise

    def _report(self, kind: str, value: Any) -> None:
        if kind == "importing":
            self._importing = (value, time.monotonic())
        elif kind == "imported":
            source, seconds, veto = value
            self._importing = None
            if veto:  # what it left dies with this worker's process group; the next worker does not import it
                self._veto(source, f"{veto}: the worker was stopped and started again without this plugin")
                return
            self.verdicts[source] = None
            if seconds > SLOW_IMPORT_S and source not in self.slow_imports:
                self.slow_imports[source] = seconds
                print(f"codabench: plugin {source} took {seconds:.1f} s to import (every worker start pays it)",
                      file=sys.stderr)
        elif kind == "ready":
            self._ready, self._importing = True, None
            for error in value:  # the parent's own imports found the same ones, as a rule: each is listed once
                if tuple(error) not in self.registry.load_errors:
                    self.registry.load_errors.append(tuple(error))

    def _died_starting(self) -> Failure | None:
        if self._importing is None:
            return self._dead()
        source = self._importing[0]
        self._veto(source, f"importing it ended the worker process: {self._dead().message}")
        return None

    def _veto(self, source: str, reason: str) -> None:
        """Stop the worker; start another that does not import ``source``."""
        self.vetoed[source] = self.verdicts[source] = reason
        self.spawn()

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
        """Kill the worker's process group (the worker and whatever its plugins spawned) and close the connection."""
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # its own session: the group's id is its pid
            except (ProcessLookupError, PermissionError):  # the worker and all its children are gone
                pass
            self._proc.wait()
            self._proc = None
        self._ready = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None


INLINE_FATE = "which --inline does not replace: the run times nothing more"
"""What becomes of the process of an ``--inline`` run that holds what only a new process is rid of."""


class InlineWorker:
    """The worker's requests run in this process (``--inline``): no isolation, no timeout, and no worker to retire.
    A request that leaves what only a new process is rid of (a thread of its own, a kernel no restore undoes) is its
    cell's error row all the same, and the last request served: every later one is refused, and the runner stops the
    run with one line as it does for a broken CUDA context (``Measurer.device_lost``), since nothing timed beside the
    thread or with the kernel would be true. The guard records the harness's modules again as they are when it starts
    (:func:`codabench.guard.snapshot` ``refresh``): a debugger's or test's patches of the harness are not taken for a
    cell's tampering."""

    def __init__(self, cfg: RunConfig, registry: Registry):
        guard.snapshot(refresh=True)
        self.measurer = Measurer(cfg, registry)
        self.stopped: str | None = None
        """Why no request runs any more (a request left what only a new process is rid of), or None."""

    @property
    def alive(self) -> bool:
        return self.stopped is None

    def call(self, method: str, *args: Any) -> Any:
        if self.stopped is not None:
            self.measurer.device_lost = self.stopped
            return Failure(self.stopped)
        answer = dispatch(self.measurer, method, args, INLINE_FATE)
        if isinstance(answer, Failure) and answer.retire:
            cells = ", ".join(f"{c.op} {c.impl}" for c in _cells(args)) or method
            self.stopped = (f"--inline: the run stops, since {cells} left in this process what only a new one is rid "
                            "of (its error row says what), and nothing timed beside it would be true")
        return answer

    def close(self) -> None:
        pass
