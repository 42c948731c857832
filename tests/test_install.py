"""The install: pyproject.toml declares a range for each dependency whose version decides what the kernels compile to
and run against, constraints.txt pins what CI tests (constraints-gpu.txt what the GPU results were measured with)
within those ranges, and the README's commands and .ci/run install through constraints.txt."""
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")

ROOT = Path(__file__).parents[1]
RANGED = ("torch", "triton", "transformers", "liger-kernel", "flashinfer-python")
"""The distributions whose versions the results depend on: each has a lower and an upper bound."""


def declared() -> dict[str, Requirement]:
    """pyproject.toml's requirements by distribution, its dependencies and every extra (the extras that name
    codabench itself left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    reqs = [Requirement(s) for s in specs]
    return {canonicalize_name(r.name): r for r in reqs if canonicalize_name(r.name) != "codabench"}


def pins(name: str) -> dict[str, Version]:
    """The ``==`` pins of a constraints file by distribution; anything else in it fails the test."""
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
            assert m, f"{name}: not an exact pin: {line!r}"
            key = canonicalize_name(m[1])
            assert key not in out, f"{name}: {key} pinned twice"
            out[key] = Version(m[2])
    return out


def test_the_result_deciding_dependencies_have_bounded_ranges():
    reqs = declared()
    for name in RANGED:
        ops = {s.operator for s in reqs[name].specifier}
        assert ">=" in ops and "<" in ops, (name, str(reqs[name].specifier))


@pytest.mark.parametrize("lock, pinned", [
    ("constraints.txt", ("torch", "triton", "transformers", "liger-kernel")),
    ("constraints-gpu.txt", RANGED)])
def test_each_constraints_file_pins_within_the_declared_ranges(lock, pinned):
    """Every pin that pyproject.toml has a requirement for lies in its range (a local label such as +cpu aside), so
    pip can honour both; the result-deciding distributions the file is used for are pinned."""
    reqs, found = declared(), pins(lock)
    assert set(pinned) <= set(found), (lock, set(pinned) - set(found))
    for name, version in found.items():
        if name in reqs:
            assert reqs[name].specifier.contains(version, prereleases=True), (lock, name, str(version))


def test_the_gpu_pins_are_the_lower_bounds():
    """The oldest versions known to work (the GPU image's) are where pyproject.toml's ranges start."""
    reqs, gpu = declared(), pins("constraints-gpu.txt")
    for name in ("torch", "triton"):
        [low] = [Version(s.version) for s in reqs[name].specifier if s.operator == ">="]
        assert gpu[name].release[:len(low.release)] == low.release, (name, str(low), str(gpu[name]))


def test_ci_and_the_readme_install_through_the_lock_and_ci_runs_the_readmes_test_command_exactly():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -c constraints.txt -e ".[dev]"' in ci
    commands = [line for line in ci.splitlines() if "pytest" in line and not line.lstrip().startswith("#")]
    assert commands == ["python -m pytest -q"], commands
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("\n## ", readme.index("## Set-up"))]
    assert 'pip install -c constraints.txt -e ".[dev]" && python -m pytest -q' in setup
    assert "pip install -c constraints.txt -e . && python run_bench.py" in setup
    assert "python -m pytest -q -m slow" in setup and "download.pytorch.org/whl/cpu" in setup
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow'" in ini["addopts"] and any(m.startswith("slow:") for m in ini["markers"])
