"""The run directory as the parent process writes it: one row per cell as it finishes, its samples, env.json, and
(``--profile``) each timed cell's profile and Chrome trace.

Rows are appended and fsynced one by one (:mod:`codabench.results`), so a killed run keeps what it measured and
``--resume`` skips the cells that have a row.

A run writes only into a folder that is new, empty, or a run of this layout (its marker,
:data:`codabench.results.MARKER`, which the run writes before anything else): :func:`check_run_dir` refuses any
other folder before a byte is written into it. One process at a time writes a run: :class:`RunLock` holds an
exclusive ``flock`` on the folder's ``.lock`` (which names its pid and host) for as long as the run or its report
is written, and removes the file when it lets go; the kernel lets go of the lock of a process that died, and the
next writer takes the lock over with a note.
"""
from __future__ import annotations

import fcntl
import hashlib
import math
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from codabench import results
from codabench.env import code_tree, git_sha
from codabench.matrix import Cell
from codabench.results import RunFolderError


class RunExists(RunFolderError):
    """The output directory already holds results and --resume was not given."""


class RunLocked(RunFolderError):
    """Another process writes the run directory."""


def check_run_dir(out_dir: Path, resume: bool, suite: str | None = None) -> list[str]:
    """Whether a run may write into ``out_dir`` (read-only: a refused folder is left as it was). A missing or empty
    folder (a left-over ``.lock`` aside) takes any run. Any other folder must hold a valid marker (of ``suite``, when
    given, for ``--resume``); then results.csv refuses a fresh run (:class:`RunExists`) and, for ``--resume``, must
    read as a run (:func:`codabench.results.check_run`). Returns the notes of what was tolerated (a cut-off last line
    that resuming drops); RunFolderError with one line otherwise."""
    if not out_dir.exists():
        return []
    if not out_dir.is_dir():
        raise RunFolderError(f"{out_dir}: is a file, not a directory")
    if all(p.name == results.LOCK for p in out_dir.iterdir()):
        return []
    marker = results.read_marker(out_dir)
    if marker is None:
        raise RunFolderError(f"{out_dir} holds files but no {results.MARKER}: not a run of this codabench; "
                             "nothing was written there (use a new or empty folder)")
    if not (out_dir / results.RESULTS).exists():
        return []
    if not resume:
        raise RunExists(f"{out_dir} already holds results: pass --resume to continue it, or another --out")
    if suite is not None and marker.get("suite") != suite:
        raise RunFolderError(f"--resume: {out_dir} is a run of suite {marker.get('suite')!r}, not {suite!r} "
                             "(give its --suite)")
    return results.check_run(out_dir, need_rows=False)


class RunLock:
    """The exclusive right to write ``run_dir``, held from construction to :meth:`release` (or the end of a ``with``).
    Re-entrant within a process: the command line holds it over a run and its report while the writer and the
    report take it too. A folder locked by another process: :class:`RunLocked`."""

    _held: dict[Path, list] = {}
    """Resolved folder -> [the lock file's descriptor, how many holders in this process]."""

    def __init__(self, run_dir: Path):
        self.key = run_dir.resolve()
        held = self._held.get(self.key)
        if held is not None:
            held[1] += 1
            return
        path = self.key / results.LOCK
        while True:  # the file locked must still be the one at the path (a releaser unlinks it)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "a process"
                os.close(fd)
                raise RunLocked(f"{run_dir} is being written by another codabench ({holder}); wait for it to end, or "
                                "use another --out") from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = os.read(fd, 200).decode(errors="replace").strip()
        if stale:
            print(f"codabench: {run_dir}: taking over the lock of {stale}, which no longer holds it (it ended "
                  "without letting go)", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._held[self.key] = [fd, 1]

    def release(self) -> None:
        held = self._held.get(self.key)
        if held is None:
            return
        held[1] -= 1
        if held[1]:
            return
        del self._held[self.key]
        (self.key / results.LOCK).unlink(missing_ok=True)  # while locked: no other process holds this file
        os.close(held[0])

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


CHUNK = 1 << 20
"""Bytes read at a time from a file that may be large."""


class KeptFile:
    """A file of the run that this writer alone writes, and puts back as it wrote it (:meth:`restore`) where anything
    else changed it. It knows the file by its length and a running SHA-256 of its bytes (a check reads the file once),
    and keeps the bytes themselves in ``store``, an anonymous temporary file in the run folder that the writer's kept
    files share: a long run's samples are tens of megabytes, which need not stay in this process's memory, and a file
    of no name, whose descriptor the worker process does not inherit, is out of a plugin's reach as much as this
    process's memory is. Only a restore reads them back."""

    def __init__(self, path: Path, store: BinaryIO):
        self.path, self._store = path, store
        self._spans: list[tuple[int, int]] = []
        """(offset, length) in ``store`` of each piece written, in order."""
        self._hash, self._size = hashlib.sha256(), 0

    def keep(self, data: bytes) -> None:
        """This writer appended ``data`` to the file (or wrote it whole, as the first piece)."""
        self._store.seek(0, os.SEEK_END)
        self._spans.append((self._store.tell(), len(data)))
        self._store.write(data)
        self._hash.update(data)
        self._size += len(data)

    def keep_found(self) -> None:
        """What the file holds now is this writer's (a resumed run's earlier sessions wrote it)."""
        if self.path.exists():
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    self.keep(chunk)

    def _intact(self) -> bool:
        """The file holds what this writer wrote: its length, then its hash (no file: nothing was written)."""
        try:
            if self.path.stat().st_size != self._size:
                return False
            digest = hashlib.sha256()
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    digest.update(chunk)
            return digest.digest() == self._hash.digest()
        except FileNotFoundError:
            return self._size == 0

    def restore(self) -> bool:
        """Put the file back as this writer wrote it where it holds anything else (a process that is not the run
        wrote into it, cut it or removed it, its folder too); True if it did."""
        if self._intact():
            return False
        data = bytearray()
        for offset, length in self._spans:
            self._store.seek(offset)
            data += self._store.read(length)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        results.write_atomic(self.path, bytes(data))
        return True


class JsonLines(KeptFile):
    """A JSON-lines file of the run (samples.jsonl, profiles.jsonl), appended record by record; what it held when
    the writer opened it (a cut-off last line dropped) is the writer's too."""

    def __init__(self, path: Path, store: BinaryIO):
        super().__init__(path, store)
        if path.exists():
            results._drop_partial_last_line(path)  # as the next append would
        self.keep_found()

    def append(self, record: dict[str, Any]) -> None:
        self.keep(results.append_jsonl(self.path, record))


class KeptFolder:
    """A folder of the run whose files this writer alone writes (``traces/``), each a :class:`KeptFile`, those it
    held when the writer opened it included: put back as written, and anything else that appears in it removed (what
    reads the folder, a merge or a distributed run's gathering, takes every file in it)."""

    def __init__(self, path: Path, store: BinaryIO):
        self.path, self._store = path, store
        self.files: dict[str, KeptFile] = {}
        for found in sorted(path.iterdir()) if path.is_dir() else []:
            if found.is_file():
                self.files[found.name] = KeptFile(found, store)
                self.files[found.name].keep_found()

    def write(self, name: str, text: str) -> None:
        """The file ``name`` in the folder holds ``text`` (written atomically)."""
        data = text.encode()
        self.path.mkdir(exist_ok=True)
        results.write_atomic(self.path / name, data)
        self.files[name] = KeptFile(self.path / name, self._store)
        self.files[name].keep(data)

    def restore(self) -> list[str]:
        """Put back each file this writer wrote where anything else changed it, and remove what it did not write (a
        file or a link in the folder's place too); the paths (relative to the run folder) put back or removed."""
        replaced = self.path.is_symlink() or (self.path.exists() and not self.path.is_dir())
        if replaced:
            self.path.unlink()
        fixed = [name for name, kept in self.files.items() if kept.restore()]
        others = [p for p in self.path.iterdir() if p.name not in self.files] if self.path.is_dir() else []
        for other in others:
            if other.is_dir() and not other.is_symlink():
                shutil.rmtree(other)
            else:
                other.unlink()
        paths = [f"{self.path.name}/{name}" for name in fixed + [p.name for p in others]]
        return ([self.path.name] if replaced else []) + paths


class RunWriter:
    """Opens ``out_dir`` for a run (refused as :func:`check_run_dir` says; then locked, then marked) until
    :meth:`close`."""

    def __init__(self, out_dir: Path, resume: bool, suite: str):
        self.out_dir = out_dir
        check_run_dir(out_dir, resume, suite)
        out_dir.mkdir(parents=True, exist_ok=True)
        self._lock = RunLock(out_dir)
        try:
            check_run_dir(out_dir, resume, suite)  # again, now that no other process can write there
            if results.read_marker(out_dir) is None:
                results.write_marker(out_dir, suite, code_tree(), git_sha())
            path = out_dir / results.RESULTS
            self.done = self._done_keys() if resume and path.exists() else set()
            """Keys of the cells that already have a row (resume)."""
            self._results = results.AppendWriter(path, results.RESULT_COLUMNS)
            self._errors = results.AppendWriter(out_dir / results.ERRORS, results.ERROR_COLUMNS)
            self._store = tempfile.TemporaryFile(dir=out_dir)
            """The bytes of the kept files below (:class:`KeptFile`)."""
            self._samples = JsonLines(out_dir / results.SAMPLES, self._store)
            self._profiles = JsonLines(out_dir / results.PROFILES, self._store)
            self._traces = KeptFolder(out_dir / results.TRACES, self._store)
            self._env: dict[str, Any] | None = None
            """env.json as this run wrote it (None until :meth:`write_env`)."""
            self._env_text = ""
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        """Put back what another process changed in the run's tables, samples, profiles, traces and env.json while
        the run wrote them (a plugin writing into the run folder: its rows never reach the report), say so (stderr,
        and ``run_folder_restored`` in env.json), and let go of the run directory."""
        try:
            restored = [w.path.name for w in (self._results, self._errors, self._samples, self._profiles)
                        if w.restore()]
            restored += self._traces.restore()
            self._store.close()
            if self._env is not None and self._env_changed():
                restored.append(results.ENV)
            if restored:
                print(f"codabench: {', '.join(restored)} of {self.out_dir} changed while the run wrote it (a plugin "
                      "writing into the run folder?): put back as the run wrote it", file=sys.stderr)
                self._write_env({**(self._env or {}), "run_folder_restored": restored})
        finally:
            self._lock.release()

    def _env_changed(self) -> bool:
        try:
            return (self.out_dir / results.ENV).read_text() != self._env_text
        except (OSError, UnicodeDecodeError):
            return True

    def _write_env(self, env: dict[str, Any]) -> None:
        self._env, self._env_text = env, results.json_text(env)
        results.write_atomic(self.out_dir / results.ENV, self._env_text)

    def _done_keys(self) -> set[tuple]:
        df = results.read_csv(self.out_dir / results.RESULTS, results.RESULT_COLUMNS)
        return {tuple("" if isinstance(v, float) and math.isnan(v) else str(v) for v in r)
                for r in df[results.KEY].itertuples(index=False)}

    def write(self, row: dict[str, Any], err_rows: list[dict[str, Any]] = (),
              samples: dict[str, Any] | None = None, cell: Cell | None = None) -> None:
        """One cell's row, its per-output error rows and (timed cells) its samples."""
        self._results.write([row])
        self._errors.write(err_rows)
        if samples is not None and cell is not None:
            self._samples.append({**dict(zip(results.KEY, cell.key)), **samples})

    def write_profile(self, cell: Cell, record: dict[str, Any], trace: str | None = None) -> None:
        """A timed cell's profile (:meth:`codabench.measure.Measurer.profile`'s record, or a note alone) and its Chrome
        trace (JSON text), which goes to ``traces/`` first and is named in the record (``trace``)."""
        record = {**dict(zip(results.KEY, cell.key)), **record}
        if trace is not None:
            name = results.trace_name(cell.key)
            self._traces.write(name, trace)
            record["trace"] = f"{results.TRACES}/{name}"
        self._profiles.append(record)

    def write_env(self, env: dict[str, Any], resume: bool) -> None:
        """env.json at the start of a run; a resumed run keeps the earlier sessions' records under earlier_sessions."""
        path = self.out_dir / results.ENV
        if resume and path.exists():
            old = results.read_env(self.out_dir)
            env["earlier_sessions"] = old.pop("earlier_sessions", []) + [old]
        self._write_env(env)

    def update_env(self, **fields: Any) -> None:
        """env.json as this run wrote it, with ``fields`` (never what another process wrote there meanwhile)."""
        self._write_env({**(self._env if self._env is not None else results.read_env(self.out_dir)), **fields})
