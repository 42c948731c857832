"""Run folders that cannot be damaged: the marker, the one-writer lock, unsafe --out paths, the validation of what
report/compare/merge read, atomic writes and a second Ctrl-C while the report is written."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import codabench.cli as cli
from codabench import results as tables
from codabench.cli import main
from codabench.matrix import Cell
from codabench.measure import Measurer
from codabench.results import LOCK, MARKER, SCHEMA, RunFolderError, check_run, write_atomic
from codabench.writer import RunLock, RunLocked, RunWriter
from harness_helpers import isolated_registry, make_runner

ROOT = Path(__file__).resolve().parents[1]
LEGACY = [ROOT / "reports" / "h100-2026-11-26-train-f32", ROOT / "reports" / "h100-2026-11-26-train-nosync"]
"""Committed runs from before the marker."""
RUN = ["--suite", "smoke", "--ops", "gemm_out", "--modes", "fwd", "--impls", "torch-eager", "--reps", "1", "--inline",
       "--quiet", "--no-entry-points"]
"""One cell, in this process (Measurer can be patched), of the smoke suite on any device."""


@pytest.fixture
def registry():
    with isolated_registry() as reg:
        yield reg


@pytest.fixture(autouse=True)
def compile_cache(tmp_path, monkeypatch):
    """The command line points torch.compile's cache beside --out unless it is set: keep it set, and undone after."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(capsys, argv, code=2) -> str:
    """Run the command line: exit ``code`` and exactly one line on stderr (the CPU note aside), no traceback."""
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's refusals
        got = e.code
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Triton interpreter" not in line]
    assert got == code and len(err) == 1 and "Traceback" not in err[0], (got, err)
    return err[0]


def own_run(folder: Path) -> Path:
    """A run folder as a run leaves it: marker, env.json, a row, its sample."""
    folder.mkdir(parents=True)
    tables.write_marker(folder, "smoke", None, None)
    tables.AppendWriter(folder / tables.RESULTS, tables.RESULT_COLUMNS).write([{
        "op": "gemm_out", "impl": "torch-eager", "model": "tiny", "mode": "fwd", "dtype": "fp32", "status": "ok",
        "median_ms": 1.5, "timing": "cpu-wall", "correct": True}])
    tables.append_jsonl(folder / tables.SAMPLES, {"op": "gemm_out", "model": "tiny", "mode": "fwd", "dtype": "fp32",
                                                  "impl": "torch-eager", "timing": "cpu-wall", "samples_ms": [1.5]})
    tables.write_json(folder / tables.ENV, {"device": "cpu", "suite": "smoke"})
    return folder


# ---- 1. the marker ---------------------------------------------------------------------------------------------

def test_a_run_writes_its_marker_first(registry, tmp_path, monkeypatch):
    seen = []
    original = Measurer.first
    monkeypatch.setattr(Measurer, "first", lambda self, c: (seen.append(sorted(os.listdir(tmp_path / "r"))),
                                                            original(self, c))[1])
    make_runner(tmp_path / "r", modes=("fwd",), isolate=False, suite="smoke").run()
    assert MARKER in seen[0]
    marker = json.loads((tmp_path / "r" / MARKER).read_text())
    assert marker["schema"] == SCHEMA and marker["suite"] == "smoke" and marker["created_at"]
    assert marker["code_tree"] == tables.read_env(tmp_path / "r")["code_tree"]
    assert not (tmp_path / "r" / LOCK).exists()


def test_resume_refuses_a_foreign_folder_and_leaves_it_byte_for_byte(registry, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.csv").write_text("name,score\nalice,3\n")
    (foreign / "env.json").write_text("{\"mine\": true}\n")
    (foreign / "notes.txt").write_text("not a run\n")
    before = snapshot(foreign)
    for resume in (["--resume"], []):
        line = one_line(capsys, RUN + ["--out", str(foreign)] + resume)
        assert line.startswith(f"codabench: --out {foreign} holds files but no {MARKER}"), line
        assert snapshot(foreign) == before


def test_resume_refuses_another_schema_and_another_suite(registry, tmp_path, capsys):
    run = own_run(tmp_path / "run")
    (run / MARKER).write_text(json.dumps({"schema": SCHEMA + 1, "suite": "smoke"}))
    line = one_line(capsys, RUN + ["--out", str(run), "--resume"])
    assert f"a run of schema {SCHEMA + 1}; this codabench reads schema {SCHEMA}" in line
    (run / MARKER).write_text("{\"suite\": \"smoke\"}")
    assert "not a codabench run marker" in one_line(capsys, RUN + ["--out", str(run), "--resume"])
    tables.write_marker(run, "full", None, None)
    before = snapshot(run)
    assert "is a run of suite 'full', not 'smoke'" in one_line(capsys, RUN + ["--out", str(run), "--resume"])
    assert snapshot(run) == before


def test_a_fresh_run_refuses_a_run_with_results_and_takes_an_empty_folder(registry, tmp_path, capsys):
    run = own_run(tmp_path / "run")
    assert "already holds results: pass --resume" in one_line(capsys, RUN + ["--out", str(run)])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(RUN + ["--out", str(empty)]) == 0
    assert (empty / MARKER).exists() and len(pd.read_csv(empty / "results.csv")) == 1


# ---- 2. one writer -------------------------------------------------------------------------------------------

HOLD = ("import sys; from pathlib import Path; from codabench.writer import RunLock; "
        "lock = RunLock(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.readline(); lock.release()")


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(registry, tmp_path, capsys, monkeypatch):
    run = own_run(tmp_path / "run")
    before = snapshot(run)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        ran = []
        monkeypatch.setattr(Measurer, "first", lambda self, c: ran.append(c))
        line = one_line(capsys, RUN + ["--out", str(run), "--resume"])
        assert f"is being written by another codabench (pid {holder.pid} on " in line, line
        assert ran == []  # refused before any cell ran
        with pytest.raises(RunLocked):
            RunWriter(run, True, "smoke")
        assert "being written by another codabench" in one_line(capsys, ["report", str(run)])
        after = snapshot(run)
        assert after.pop(LOCK).startswith(f"pid {holder.pid} on ".encode()) and after == before
    finally:
        holder.communicate("\n", timeout=60)
    assert not (run / LOCK).exists()  # the holder let go, and removed the file
    with RunLock(run), RunLock(run):  # re-entrant in one process
        assert (run / LOCK).read_text().startswith(f"pid {os.getpid()} ")
    assert not (run / LOCK).exists()


def test_a_stale_lock_is_taken_over_with_a_note(registry, tmp_path, capsys):
    run = own_run(tmp_path / "run")
    (run / LOCK).write_text("pid 999999 on elsewhere\n")  # its process died: the file stays, its flock is gone
    assert main(RUN + ["--out", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "taking over the lock of pid 999999 on elsewhere" in err
    assert not (run / LOCK).exists()


def test_the_lock_is_released_on_error_and_interrupt(registry, tmp_path, capsys, monkeypatch):
    def interrupted(self, cell):
        raise KeyboardInterrupt

    monkeypatch.setattr(Measurer, "first", interrupted)
    assert main(RUN + ["--out", str(tmp_path / "a")]) == cli.EXIT_INTERRUPTED
    assert "interrupted; finished cells are saved" in capsys.readouterr().err
    assert not (tmp_path / "a" / LOCK).exists() and (tmp_path / "a" / "report.html").exists()

    def broken(self, *args):
        raise OSError("disk gone")

    monkeypatch.undo()
    monkeypatch.setattr(RunWriter, "write", broken)
    with pytest.raises(OSError):
        make_runner(tmp_path / "b", modes=("fwd",), isolate=False).run()
    assert not (tmp_path / "b" / LOCK).exists()
    RunLock(tmp_path / "b").release()  # nothing left held in this process either


# ---- 3. unsafe --out -------------------------------------------------------------------------------------------

def test_unsafe_out_paths_are_refused_with_one_line(registry, tmp_path, capsys, monkeypatch):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)  # not the repository's root
    assert one_line(capsys, RUN + ["--out", ""]) == \
        "run_bench.py: argument --out: expected a run directory, got '' (see --help)"
    for out, what in ((".", "the current directory"), ("/", "the file system's root"),
                      (str(home), "the home directory"), (str(ROOT), "the repository's root")):
        assert one_line(capsys, RUN + ["--out", out]) == \
            f"codabench: --out {out}: is {what}; name a run directory of its own (e.g. reports/NAME)"
    (tmp_path / "a-file").write_text("x")
    assert "is a file, not a directory" in one_line(capsys, RUN + ["--out", str(tmp_path / "a-file")])
    before = snapshot(tmp_path)
    assert "holds files but no" in one_line(capsys, RUN + ["--out", str(tmp_path)])  # holds home/, a-file ...
    assert snapshot(tmp_path) == before


# ---- 4. what report, compare and merge read ---------------------------------------------------------------------

def test_legacy_runs_without_a_marker_are_still_read(tmp_path, capsys):
    copies = []
    for legacy in LEGACY:
        copies.append(tmp_path / legacy.name)
        shutil.copytree(legacy, copies[-1])
        assert check_run(copies[-1]) == []
    assert main(["compare", str(copies[0]), str(copies[1])]) == 0
    assert main(["report", str(copies[0])]) == 0
    assert not (copies[0] / LOCK).exists() and not (copies[0] / MARKER).exists()
    assert main(["merge", str(tmp_path / "m"), *map(str, copies)]) == 0
    assert json.loads((tmp_path / "m" / MARKER).read_text())["schema"] == SCHEMA


def _garbage(run: Path, name: str, data: bytes) -> Path:
    (run / name).write_bytes(data)
    return run


@pytest.mark.parametrize("name, data, says", [
    ("results.csv", b"", "results.csv: empty"),
    ("results.csv", b"op,impl,mo", "results.csv: its header is cut off"),
    ("results.csv", b"name,score\nalice,3\n", "results.csv: not codabench's columns (missing: op, model, mode, dtype, "
                                             "impl ...; unknown: name, score)"),
    ("results.csv", b"op,impl,model,mode,dtype,status\n", "results.csv: no rows"),
    ("results.csv", b"op,impl,model,mode,dtype,status\ngemm_out,x,tiny,fwd,fp32,ok\nabc\ngemm_out,y,tiny,fwd,fp32,ok\n",
     "results.csv, line 3: 1 fields where the header has 6"),
    ("results.csv", b"op,impl,model,mode,dtype,status,median_ms\ngemm_out,x,tiny,fwd,fp32,ok,fast\n",
     "line 2: median_ms is 'fast', not a number"),
    ("results.csv", b"\xff\xfe\x00binary", "results.csv: not text"),
    ("errors.csv", b"op,impl\n", "errors.csv: not codabench's columns"),
    ("samples.jsonl", b'{"op": "gemm_out"}\n', "samples.jsonl, line 1: not a sample record"),
    ("samples.jsonl", b'garbage\n{"op": 1}\n', "samples.jsonl, line 1: not a sample record"),
    ("env.json", b"{not json", "env.json: not a JSON object"),
    (MARKER, b'{"schema": 99}', f"a run of schema 99; this codabench reads schema {SCHEMA}"),
])
def test_report_compare_and_merge_refuse_garbage_with_one_line(tmp_path, capsys, name, data, says):
    good = own_run(tmp_path / "good")
    bad = _garbage(own_run(tmp_path / "bad"), name, data)
    for argv in (["report", str(bad)], ["compare", str(good), str(bad)], ["merge", str(tmp_path / "m"), str(bad)]):
        line = one_line(capsys, argv)
        assert says in line and line.endswith("(see --help)"), (argv, line)
    assert not (tmp_path / "m").exists() and not (bad / "report.html").exists()


def test_foreign_folders_are_refused(tmp_path, capsys):
    empty, csv_only = tmp_path / "empty", tmp_path / "csv-only"
    empty.mkdir()
    shutil.copytree(own_run(tmp_path / "run"), csv_only)
    (csv_only / MARKER).unlink()
    (csv_only / "env.json").unlink()
    assert "not a run directory (no results.csv)" in one_line(capsys, ["report", str(empty)])
    assert f"not a codabench run (neither {MARKER} nor env.json beside results.csv)" in \
        one_line(capsys, ["compare", str(csv_only), str(csv_only)])
    assert "no such directory" in one_line(capsys, ["merge", str(tmp_path / "m"), str(tmp_path / "nope")])


def test_a_cut_off_last_line_is_read_with_a_note(tmp_path, capsys):
    run = own_run(tmp_path / "run")
    with open(run / "results.csv", "a") as f:
        f.write("gemm_out,torch-compile,ti")
    with open(run / "samples.jsonl", "a") as f:
        f.write('{"op": "gemm_out", "mo')
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"note: {run / 'results.csv'}: its last line is cut off" in err
    assert f"note: {run / 'samples.jsonl'}: its last line is cut off" in err
    assert len(pd.read_csv(run / "results.csv")) == 1


# ---- 5. atomic writes, a second Ctrl-C ---------------------------------------------------------------------------

def test_an_interrupted_atomic_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "report.html"
    path.write_text("old report")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new report " * 1000)
    assert path.read_text() == "old report" and os.listdir(tmp_path) == ["report.html"]
    monkeypatch.undo()
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["report.html"]


def test_the_report_is_old_or_new_when_its_writing_is_interrupted(tmp_path, monkeypatch):
    from codabench.report import finalize

    run = own_run(tmp_path / "run")
    finalize(run)
    png = run / "plots" / "median_ms_fp32.png"
    before = snapshot(run)
    fsync = os.fsync
    for target in (png, run / "report.html"):
        def interrupted(fd, target=target):  # Ctrl-C once the new content of ``target`` is written, before its rename
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(target.parent / f".{target.name}.")):
                raise KeyboardInterrupt
            fsync(fd)

        with monkeypatch.context() as m:
            m.setattr(os, "fsync", interrupted)
            (run / "plots" / "stale.png").write_bytes(b"a plot an earlier report drew")
            with pytest.raises(KeyboardInterrupt):
                finalize(run)
        assert target.read_bytes() == before[str(target.relative_to(run))]
        assert not [p for p in run.rglob("*.tmp")] and not (run / LOCK).exists()
        # an earlier report's plot is removed only once the new plots are written
        assert (run / "plots" / "stale.png").exists() == (target == png)
    finalize(run)
    assert not (run / "plots" / "stale.png").exists() and png.exists()


def test_a_second_ctrl_c_while_the_report_is_written_ends_with_one_line(registry, tmp_path, capsys, monkeypatch):
    write = RunWriter.write

    def interrupted_after_the_row(self, *args):
        write(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunWriter, "write", interrupted_after_the_row)

    def interrupted_report(run_dir):
        (Path(run_dir) / "report.html").write_text("half")  # what a report that is not atomic would leave
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "finalize", interrupted_report)
    out = tmp_path / "run"
    assert main(RUN + ["--out", str(out)]) == cli.EXIT_INTERRUPTED
    err = [line for line in capsys.readouterr().err.splitlines() if "Triton interpreter" not in line]
    assert "Traceback" not in "\n".join(err)
    assert err[-2] == "codabench: interrupted; finished cells are saved, rerun with --resume to go on"
    assert err[-1] == (f"codabench: interrupted again while the report was written; the measured rows are saved in "
                       f"{out} (python -m codabench report {out} writes the report)")
    assert not (out / LOCK).exists() and (out / "report.html").read_text() == "half"
    assert check_run(out) == [] and len(pd.read_csv(out / "results.csv")) == 1


def test_a_ctrl_c_in_a_subcommand_ends_with_one_line(tmp_path, capsys, monkeypatch):
    run = own_run(tmp_path / "run")

    def interrupted(run_dir, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "finalize", interrupted)
    assert "codabench report: interrupted" in one_line(capsys, ["report", str(run)], code=cli.EXIT_INTERRUPTED)


def test_the_writer_refuses_what_the_command_line_refuses(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("y")
    with pytest.raises(RunFolderError, match="holds files but no"):
        RunWriter(foreign, True, "smoke")
    assert os.listdir(foreign) == ["x"]


def test_an_earlier_column_list_is_rewritten_whole_before_rows_are_appended(tmp_path):
    path = tmp_path / "results.csv"
    old = [c for c in tables.RESULT_COLUMNS if c not in ("check_s", "setup_s")]  # a run from before those columns
    path.write_text(",".join(old) + "\n" + ",".join("gemm_out" if c == "op" else "" for c in old) + "\ngemm_d")
    writer = tables.AppendWriter(path, tables.RESULT_COLUMNS)
    writer.write([{"op": "gemm_down", "check_s": 2.5}])
    df = pd.read_csv(path)
    assert list(df.columns) == tables.RESULT_COLUMNS and list(df["op"]) == ["gemm_out", "gemm_down"]
    assert df["check_s"].isna().tolist() == [True, False]


def test_what_a_plugin_writes_into_the_run_folder_does_not_survive_the_run(registry, tmp_path, monkeypatch, capsys):
    """A plugin whose calls (in the worker process) append forged rows to results.csv and errors.csv and replace
    env.json: the run puts back what it wrote, says so, and the forged rows never reach the tables it reports from."""
    from codabench.discovery import load_plugin_file
    from harness_helpers import PLUGINS

    monkeypatch.setenv("CODABENCH_TEST_RUN_DIR", str(tmp_path))
    load_plugin_file(PLUGINS / "adv_writes_run_folder.py")
    make_runner(tmp_path, modes=("fwd",), impls=["torch-eager", "adv-writes-run-folder"]).run()
    df, err, env = tables.load_run(tmp_path)
    assert sorted(df["impl"]) == ["adv-writes-run-folder", "torch-eager"]
    assert "adv-forged" not in set(err["impl"])
    assert "forged" not in env and set(env["run_folder_restored"]) >= {"results.csv", "errors.csv"}
    assert "put back as the run wrote it" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["cut short", "appended to", "rewritten", "removed"])
def test_the_samples_and_profiles_are_put_back_as_the_run_wrote_them(tmp_path, capsys, damage):
    """samples.jsonl and profiles.jsonl (a resumed run's earlier records included) changed by another process while
    the run writes them: the run puts back the bytes it wrote, and says so; untouched, they are left alone."""
    run = own_run(tmp_path / "run")
    earlier = (run / tables.SAMPLES).read_bytes()
    cell = Cell("gemm_out", "tiny", "fwd", "fp32", "torch-eager")
    writer = RunWriter(run, True, "smoke")
    writer.write_env({"device": "cpu"}, resume=True)
    for i in range(3):
        writer.write({"op": "gemm_out", "impl": "torch-eager", "status": "ok"}, samples={"samples_ms": [i, 1.5]},
                     cell=cell)
        writer.write_profile(cell, {"kernels": [{"name": f"k{i}"}]})
    wrote = {name: (run / name).read_bytes() for name in (tables.SAMPLES, tables.PROFILES)}
    assert wrote[tables.SAMPLES].startswith(earlier) and wrote[tables.SAMPLES].count(b"\n") == 4
    for name in wrote:
        path = run / name
        if damage == "cut short":
            os.truncate(path, len(wrote[name]) // 2)
        elif damage == "appended to":
            path.write_bytes(wrote[name] + b'{"impl": "forged"}\n')
        elif damage == "rewritten":
            path.write_bytes(wrote[name][::-1])  # the same length
        else:
            path.unlink()
    writer.close()
    assert {name: (run / name).read_bytes() for name in wrote} == wrote
    assert set(tables.read_env(run)["run_folder_restored"]) == set(wrote)
    assert "put back as the run wrote it" in capsys.readouterr().err
    writer = RunWriter(run, True, "smoke")
    writer.close()
    assert {name: (run / name).read_bytes() for name in wrote} == wrote and capsys.readouterr().err == ""


def test_what_a_plugin_does_to_the_samples_and_profiles_does_not_survive_the_run(registry, tmp_path, monkeypatch,
                                                                                  capsys):
    """A plugin whose calls (in the worker process) cut samples.jsonl short and append a forged record to
    profiles.jsonl, over two groups (fp32, then bf16) profiled: each timed cell keeps its one record in each."""
    from codabench.discovery import load_plugin_file
    from harness_helpers import PLUGINS

    monkeypatch.setenv("CODABENCH_TEST_RUN_DIR", str(tmp_path))
    load_plugin_file(PLUGINS / "adv_damages_run_logs.py")
    make_runner(tmp_path, modes=("fwd",), dtypes=("fp32", "bf16"), impls=["torch-eager", "adv-damages-run-logs"],
                profile=True).run()
    df, _, env = tables.load_run(tmp_path)
    timed = sorted(tuple(r) for r in df[df["status"] == "ok"][list(tables.KEY)].itertuples(index=False))
    assert len(timed) == 4, df[["impl", "mode", "status", "message"]]
    for name in (tables.SAMPLES, tables.PROFILES):
        records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert sorted(tuple(r[k] for k in tables.KEY) for r in records) == timed, (name, records)
    assert set(env["run_folder_restored"]) >= {tables.SAMPLES, tables.PROFILES}
    assert "put back as the run wrote it" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["rewritten", "removed", "forged beside", "folder removed", "folder replaced"])
def test_the_traces_are_put_back_as_the_run_wrote_them(tmp_path, capsys, damage):
    """traces/ (--profile-trace: a resumed run's earlier traces included) changed by another process while the run
    writes it: each trace is put back as the run wrote it, a file it did not write is removed (a merge takes every
    file there), and the run says so; untouched, the folder is left alone."""
    run = own_run(tmp_path / "run")
    earlier = Cell("gemm_out", "tiny", "fwd", "fp32", "torch-eager")
    (run / tables.TRACES).mkdir()
    write_atomic(run / tables.TRACES / tables.trace_name(earlier.key), '{"traceEvents": ["earlier"]}')
    writer = RunWriter(run, True, "smoke")
    writer.write_env({"device": "cpu"}, resume=True)
    for impl in ("test-a", "test-b"):
        writer.write_profile(Cell("gemm_out", "tiny", "fwd", "fp32", impl), {"kernels": []},
                             trace=json.dumps({"traceEvents": [impl]}))
    wrote = snapshot(run / tables.TRACES)
    assert len(wrote) == 3, wrote
    first, second = sorted(wrote)[:2]
    if damage == "rewritten":
        (run / tables.TRACES / first).write_text('{"traceEvents": []}')
    elif damage == "removed":
        (run / tables.TRACES / second).unlink()
    elif damage == "forged beside":
        (run / tables.TRACES / "gemm_out-tiny-fwd-fp32-adv-forged.json").write_text('{"traceEvents": ["forged"]}')
    else:
        shutil.rmtree(run / tables.TRACES)
        if damage == "folder replaced":
            (run / tables.TRACES).symlink_to(tmp_path)
    writer.close()
    assert snapshot(run / tables.TRACES) == wrote and not (run / tables.TRACES).is_symlink()
    assert tables.read_env(run)["run_folder_restored"], tables.read_env(run)
    assert "put back as the run wrote it" in capsys.readouterr().err
    writer = RunWriter(run, True, "smoke")
    writer.close()
    assert snapshot(run / tables.TRACES) == wrote and capsys.readouterr().err == ""
