"""Suite definitions, as the issue specifies them."""
from workloads.models import PRESETS
from workloads.op import DTYPES, MODES
from workloads.ops import OPS
from workloads.suites import KERNEL_SUITE_OPS, SUITES, get_suite


def test_suites():
    smoke, quick, full = get_suite("smoke"), get_suite("quick"), get_suite("full")
    assert (smoke.models, smoke.modes, smoke.dtypes, smoke.ops, smoke.impls, smoke.needs_gpu) == \
        (("tiny",), MODES, ("fp32",), None, None, False)
    assert (quick.models, quick.modes, quick.dtypes, quick.needs_gpu) == (("llama-7b",), MODES, ("bf16",), True)
    assert (full.models, full.modes, full.dtypes) == (("llama-1b", "llama-7b", "llama-70b"), MODES, ("bf16", "fp8"))
    for s in SUITES.values():
        assert set(s.models) <= set(PRESETS) and set(s.dtypes) <= set(DTYPES)
        assert s.ops is None or set(s.ops) <= set(OPS)
    assert PRESETS["llama-7b"].tokens == 16384 and PRESETS["llama-7b"].vocab == 32768


def test_the_kernels_suite_holds_the_kernel_level_and_quick_and_full_do_not():
    kernels = get_suite("kernels")
    assert (kernels.models, kernels.dtypes, kernels.impls, kernels.needs_gpu) == \
        (("llama-1b", "llama-7b", "llama-70b"), ("bf16",), ("torch-eager", "torch-compile", "coda-triton"), True)
    assert (kernels.check_tokens, kernels.reps) == (2048, None)  # sampled until resolved, as every suite
    level = {name: op.level for name, op in OPS.items()}
    assert set(level.values()) == {"pattern", "kernel", "model"}
    kernel_level = {n for n, lv in level.items() if lv == "kernel"}
    assert kernels.ops == KERNEL_SUITE_OPS and len(set(KERNEL_SUITE_OPS)) == 16
    assert set(KERNEL_SUITE_OPS) == kernel_level | {"rmsnorm_dgrad", "swiglu_dgrad"}
    pattern = get_suite("quick").op_names()
    for name in ("quick", "full"):
        assert get_suite(name).op_names() == pattern and not set(pattern) & kernel_level
    assert {"rmsnorm_dgrad", "swiglu_dgrad", "block", "gemm_out"} <= set(pattern)
    assert get_suite("smoke").op_names() == tuple(OPS)  # every op, the kernel level included
