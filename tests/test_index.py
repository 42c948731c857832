"""``python -m codabench index``: reports/README.md lists the committed reports, the README's results block holds the
newest full-suite report of each GPU, ``--check`` tells a stale file, bad input ends in one line."""
import shutil

import pandas as pd
import pytest

from codabench import results as tables
from codabench.cli import main
from codabench.report.index import BEGIN, END, HEADLINE, committed_runs
from codabench.report.summary import cells, verdict_counts
from codabench.results import load_run
from codabench.stats import read_timed, speed_figures
from synthetic_runs import planted_run

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
WIN, SAME, LOSS = (1.30, 0.003), (1.0, 0.003), (0.80, 0.003)
PLANTS = {("gemm_out", "llama-1b", "fwd", "bf16"): WIN, ("gemm_out", "llama-7b", "fwd", "bf16"): SAME,
          ("gemm_out", "llama-1b", "fwd", "fp8"): LOSS, ("gemm_down", "llama-1b", "bwd", "bf16"): (1.0, 0.15)}
"""Per run: a win, a tie within the margin, a loss in fp8 and an unresolved cell (15% noise)."""
RUNS = {  # name: (GPU, suite, timestamp)
    "h100-old-full": (H100, "full", "2026-11-20T10:00:00+00:00"),
    "h100-new-full": (H100, "full", "2026-11-26T10:00:00+00:00"),
    "h200-full": (H200, "full", "2026-11-25T10:00:00+00:00"),
    "h200-quick": (H200, "quick", "2026-11-27T10:00:00+00:00"),
    "local-run": (H200, "full", "2026-11-28T10:00:00+00:00")}
README = "# codabench\n\nIntro text.\n\n{BEGIN}\nold table\n{END}\n\n## Later section\n\nMore text.\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A repository's root: reports/ with five runs, a .gitignore that commits all but local-run, a README with the
    markers."""
    root = tmp_path_factory.mktemp("repo")
    for k, (name, (gpu, suite, ts)) in enumerate(RUNS.items()):
        planted_run(root / "reports" / name, PLANTS, env={"gpu": {"name": gpu}, "suite": suite, "timestamp": ts},
                    seed=k)
    (root / ".gitignore").write_text("__pycache__/\n/reports/*\n!/reports/README.md\n"
                                     + "".join(f"!/reports/{n}/\n" for n in RUNS if n != "local-run"))
    (root / "README.md").write_text(README.format(BEGIN=BEGIN, END=END))
    return root


@pytest.fixture
def indexed(repo, tmp_path):
    """A copy of ``repo`` after ``index``."""
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    assert main(["index", str(copy / "reports")]) == 0
    return copy


def counts(run):
    df, _, env = load_run(run)
    mine = cells(speed_figures(df, read_timed(run, env)))
    return {d: verdict_counts(g) for d, g in mine[mine["impl"] == "coda-triton"].groupby("dtype")}


def test_the_index_lists_each_committed_report_newest_first(indexed):
    assert [p.name for p in committed_runs(indexed / "reports")] == sorted(n for n in RUNS if n != "local-run")
    text = (indexed / "reports" / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert [r.split("]")[0][3:] for r in rows] == ["h200-quick", "h100-new-full", "h200-full", "h100-old-full"]
    run = indexed / "reports" / "h100-new-full"
    n = counts(run)
    assert n["bf16"] == {"faster": 1, "same": 1, "slower": 0, "unresolved": 1, "n/a": 0}  # what was planted
    assert n["fp8"] == {"faster": 0, "same": 0, "slower": 1, "unresolved": 0, "n/a": 0}
    assert rows[1].startswith(f"| [h100-new-full](h100-new-full/) | 2026-11-26 | {H100} | full | 8 | coda-triton bf16: "
                              "1 faster, 1 same, 0 slower, 1 unresolved of 3; fp8: 0 faster, 0 same, 1 slower, "
                              "0 unresolved of 1; median vs_best half-width ")
    assert "local-run" not in text  # not committed


def test_the_readme_block_holds_the_newest_full_report_of_each_gpu(indexed):
    readme = (indexed / "README.md").read_text()
    before, rest = readme.split(BEGIN)
    block, after = rest.split(END)
    assert before == "# codabench\n\nIntro text.\n\n" and after == "\n\n## Later section\n\nMore text.\n"
    assert "(reports/h100-new-full/)" in block and "(reports/h200-full/)" in block
    assert "h100-old-full" not in block and "h200-quick" not in block and "local-run" not in block
    assert len(block.strip().splitlines()) <= 40
    lines = block.splitlines()
    assert "| op | mode | dtype | H100 llama-1b | H100 llama-7b | H200 llama-1b | H200 llama-7b |" in lines
    df = speed_figures(*load_run(indexed / "reports" / "h200-full")[:1],
                       read_timed(indexed / "reports" / "h200-full", {}))
    win = df[(df["impl"] == "coda-triton") & (df["op"] == "gemm_out") & (df["model"] == "llama-1b")
             & (df["dtype"] == "bf16")].iloc[0]
    row = next(line for line in lines if line.startswith("| gemm_out | fwd | bf16 |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[5] == f"**{win['vs_best']:.2f}** [{win['vs_best_lo']:.2f}, {win['vs_best_hi']:.2f}] ▲"  # H200 1b
    assert cols[4].endswith("=") and cols[3].startswith("**1.3")  # H100: 7b level, 1b a win
    fp8 = next(line for line in lines if line.startswith("| gemm_out | fwd | fp8 |"))
    assert fp8.split("|")[4].strip().endswith("▼") and fp8.split("|")[5].strip() == ""  # no 7b fp8 cell
    unresolved = next(line for line in lines if line.startswith("| gemm_down | bwd | bf16 |"))
    assert unresolved.split("|")[4].strip()[-1] == "?"
    assert f"{H200}: bf16 1 faster, 1 same, 1 unresolved of 3; fp8 1 slower of 1; median half-width" in block


def test_a_run_with_its_own_headline_shows_it_instead_of_the_verdict_counts(repo, tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    (copy / "reports" / "h200-quick" / HEADLINE).write_text("resolving power: 0%: 20 same\nmore lines\n")
    assert main(["index", str(copy / "reports")]) == 0
    rows = [line for line in (copy / "reports" / "README.md").read_text().splitlines() if line.startswith("| [")]
    assert rows[0].endswith("| quick | 8 | resolving power: 0%: 20 same |")
    assert "coda-triton bf16" in rows[1]  # the others keep the verdict counts


def test_check_tells_a_stale_index_and_writes_nothing(indexed, capsys):
    reports = indexed / "reports"
    assert main(["index", str(reports), "--check"]) == 0
    shutil.rmtree(reports / "h200-quick")  # a report dropped: both files are stale
    before = {p: p.read_text() for p in (indexed / "README.md", reports / "README.md")}
    capsys.readouterr()
    assert main(["index", str(reports), "--check"]) == 1
    err = capsys.readouterr().err
    assert f"stale {reports / 'README.md'}" in err and "run 'python -m codabench index'" in err
    assert {p: p.read_text() for p in before} == before
    assert main(["index", str(reports)]) == 0 and main(["index", str(reports), "--check"]) == 0
    assert "h200-quick" not in (reports / "README.md").read_text()


def test_retired_verdicts_in_an_old_csv_are_recomputed(indexed):
    """A committed CSV from before 'tie' was retired: the index shows today's verdicts."""
    reports = indexed / "reports"
    path = reports / "h100-old-full" / tables.RESULTS
    df = pd.read_csv(path)
    df["verdict"] = "tie"
    df.to_csv(path, index=False)
    assert main(["index", str(reports)]) == 0
    text = (reports / "README.md").read_text()
    assert "tie" not in text
    n = counts(reports / "h100-old-full")["bf16"]
    assert f"coda-triton bf16: {n['faster']} faster, {n['same']} same, {n['slower']} slower" in text


def test_only_a_readme_with_the_markers_beside_the_folder_is_written(indexed):
    """A folder of runs elsewhere (``index ~/runs``) gets its own README.md, and no file beside it is created or
    changed unless a README there holds the markers."""
    (indexed / "README.md").write_text("# codabench\n\nNo markers yet.\n")
    assert main(["index", str(indexed / "reports")]) == 0
    assert (indexed / "README.md").read_text() == "# codabench\n\nNo markers yet.\n"
    assert (indexed / "reports" / "README.md").is_file()
    (indexed / "README.md").unlink()
    assert main(["index", str(indexed / "reports")]) == 0 and not (indexed / "README.md").exists()
    assert main(["index", str(indexed / "reports"), "--check"]) == 0  # stable once written


def test_an_unreadable_run_gets_a_row_and_one_line(indexed, capsys):
    reports = indexed / "reports"
    (reports / "h200-quick" / tables.RESULTS).write_text("not,a,codabench\nfile,at,all\n")
    capsys.readouterr()
    assert main(["index", str(reports)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "h200-quick" in err[0] and "listed as unreadable" in err[0]
    row = next(line for line in (reports / "README.md").read_text().splitlines() if "[h200-quick]" in line)
    assert "not a readable run" in row


def test_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert main(["index", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such directory" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_committed_index_and_readme_are_current():
    """reports/README.md and the README's results block match the committed reports (else: python -m codabench
    index, and commit)."""
    from codabench.env import REPO_ROOT
    from codabench.report.index import build_index

    assert build_index(REPO_ROOT / "reports", check=True) == []
