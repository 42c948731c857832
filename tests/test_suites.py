"""Suite definitions, as the issue specifies them."""
from workloads.models import PRESETS
from workloads.op import DTYPES, MODES
from workloads.suites import SUITES, get_suite


def test_suites():
    smoke, quick, full = get_suite("smoke"), get_suite("quick"), get_suite("full")
    assert (smoke.models, smoke.modes, smoke.dtypes, smoke.ops, smoke.impls, smoke.needs_gpu) == \
        (("tiny",), MODES, ("fp32",), None, None, False)
    assert (quick.models, quick.modes, quick.dtypes, quick.needs_gpu) == (("llama-7b",), MODES, ("bf16",), True)
    assert (full.models, full.modes, full.dtypes) == (("llama-1b", "llama-7b", "llama-70b"), MODES, ("bf16", "fp8"))
    for s in SUITES.values():
        assert set(s.models) <= set(PRESETS) and set(s.dtypes) <= set(DTYPES)
    assert PRESETS["llama-7b"].tokens == 16384 and PRESETS["llama-7b"].vocab == 32768
