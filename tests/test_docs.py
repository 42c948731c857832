"""The documentation holds together: README.md stays a short page for users (at most 300 lines, with the markers of
the generated results table), and every relative link, anchor, repository path and report that README.md,
docs/*.md and benchmarks/README.md name exists in this checkout."""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
README_MAX_LINES = 300
RESULTS_MARKERS = ("<!-- results:begin -->", "<!-- results:end -->")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
TOP_LEVEL = ("benchmarks/", "codabench/", "docs/", "kernels/", "tests/", "tools/", "workloads/")
"""A code span that starts with one of these names a file or folder of the repository."""
REPORT = re.compile(r"reports/((?:h100|h200)-\d{4}-\d{2}-\d{2}[\w-]*)")
"""A committed report's name: GPU, date, what was run."""


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a ``# comment`` in a block is not a heading)."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation (backticks, brackets, dots...) dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets GitHub's -1, -2 ... suffixes."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = anchor(m[1])
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def links(page: Path) -> list[str]:
    return [target for line in prose(page) for target in LINK.findall(line)]


def test_github_anchors_are_computed_as_github_does():
    assert anchor("The training step (`--suite train`)") == "the-training-step---suite-train"
    assert anchor("Fused, split or Gluon") == "fused-split-or-gluon"
    assert anchor("FLOPs and bytes: 7B, M = 16384") == "flops-and-bytes-7b-m--16384"


def test_the_readme_is_short_and_holds_the_generated_results_table_markers():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    begin, end = RESULTS_MARKERS
    assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)
    assert "python -m codabench index" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page):
    """A link to another page, a file or a folder points to one that exists; its #anchor (or a bare #anchor on the
    page itself) is a heading there."""
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not in this checkout
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif frag and (dest.suffix != ".md" or frag not in anchors(dest)):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_repository_paths_and_reports_exist(page):
    """A code span naming a path of the repository (``benchmarks/...``, ``kernels/...``; placeholders such as
    ``<gpu>`` or ``*`` aside) and every committed report the page names are in the tree."""
    text = "\n".join(page.read_text().splitlines())
    missing = []
    for span in CODE_SPAN.findall(text):
        for word in span.split():
            word = word.strip(",;:()[]'\"").split("::")[0]
            if word.startswith(TOP_LEVEL) and not re.search(r"[<>*{}$|]", word):
                if not (ROOT / word.split(":")[0]).exists():
                    missing.append(word)
    missing += [f"reports/{name}" for name in REPORT.findall(text) if not (ROOT / "reports" / name).is_dir()]
    assert not missing, missing


def test_benchmarks_readme_lists_every_script_once():
    """benchmarks/README.md has one table row per script of benchmarks/, and names no script that is gone."""
    rows = [line for line in prose(ROOT / "benchmarks" / "README.md") if line.startswith("| `")]
    listed = [re.match(r"\| `([^`]+)`", row)[1] for row in rows]
    assert sorted(listed) == sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")), listed


def test_the_link_checker_catches_a_broken_link_and_a_missing_anchor(tmp_path, monkeypatch):
    """The checks above can fail: a page with a dangling link, a dangling anchor and a missing path."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](nowhere.md) [no anchor](#nope)\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"title"}
    assert links(page) == ["#title", "nowhere.md", "#nope"]
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="nowhere.md.*#nope"):
        test_relative_links_and_anchors_resolve(page)
    page.write_text("`benchmarks/gone.py` and reports/h100-2026-01-01-gone\n")
    with pytest.raises(AssertionError, match="benchmarks/gone.py.*h100-2026-01-01-gone"):
        test_named_repository_paths_and_reports_exist(page)


def test_the_op_example_of_writing_kernels_runs_in_the_harness_as_printed(tmp_path, capsys):
    """docs/writing-kernels.md's op, as printed (under another name, added to OPS by a plugin file, as that page
    allows), runs through the harness: its torch-eager cell calls ``reference`` the way every cell does and passes."""
    import pandas as pd

    from codabench.cli import main
    from harness_helpers import isolated_registry
    from workloads.ops import OPS

    text = (ROOT / "docs" / "writing-kernels.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class GemmBiasGelu(Op):" in b)
    name = "doc_gemm_bias_gelu"
    plugin = tmp_path / "doc_op.py"
    plugin.write_text("import torch.nn.functional as F\nfrom workloads.op import Gemm, InputMaker, Op\n"
                      f"from workloads.ops import OPS\n\n{block}\n\nclass Printed(GemmBiasGelu):\n"
                      f"    name = {name!r}\n\n\nOPS[Printed.name] = Printed()\n")
    out = tmp_path / "run"
    try:
        with isolated_registry():
            code = main(["--ops", name, "--modes", "fwd,bwd", "--impls", "torch-eager", "--plugin", str(plugin),
                         "--out", str(out), "--reps", "1", "--quiet", "--inline", "--no-entry-points"])
    finally:
        OPS.pop(name, None)
    assert code == 0, capsys.readouterr().err
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 2 and (df["status"] == "ok").all() and df["correct"].all(), df.to_dict("records")
