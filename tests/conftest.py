import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The suite runs on the built-in defaults, the same on every machine; tests/test_tuning.py runs the
# tuner itself.
os.environ["HETMOE_TUNE"] = "0"


import pytest


@pytest.fixture(scope="session", autouse=True)
def subprocess_tmpdir(tmp_path_factory: pytest.TempPathFactory):
    """The processes tests start keep their temporary files in pytest's own temporary tree, which
    pytest prunes: torchrun leaves a torchelastic_* directory in the temporary directory at each
    launch (tests/test_sft_distributed.py, test_sft_zero3.py, test_expert_parallel.py)."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("subprocess-tmp"))
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory):  # -> tiny_models.TinyCache
    """Tiny MoE checkpoints (tests/tiny_models.py), each built once per session."""
    from tiny_models import TinyCache

    return TinyCache(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from torch's intra-op threads, and on a small busy machine OpenMP's
    workers fight the engine's pool for the cores. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A GEMM on AMX tiles (csrc/kernels_amx.cpp) splits each fp32 operand into bf16 hi + lo and sums
# w_hi x_hi + w_hi x_lo + w_lo x_hi: the dropped w_lo x_lo and the bf16 rounding of the two lo terms
# are each at most 2^-18 of a product, so one GEMM's relative error stays below 3 * 2^-18 (1.1e-5)
# where an fp32 GEMM's is ~1e-7; a MoE layer chains two (gate/up, then down).
TILE_GEMM_BOUND = 3 * 2.0**-18
TILE_ISAS = ("amx", "amx-emu")


def engine_isas(variants: tuple[str, ...] = ("avx2", "avx512", "amx", "amx-emu")) -> list[str]:
    """The kernel variants of ``variants`` this CPU runs: the AMX unit where the CPU has AMX, and its
    tile emulator ("amx-emu") wherever the AVX-512 unit runs."""
    from hetmoe.kernels.dispatch import engine_module

    feats = engine_module().cpu_features()
    return [isa for isa in variants if feats[f"can_{isa}"]]


def child_env() -> dict[str, str]:
    """The environment for the child processes of the multi-process tests (torchrun, ranks started
    by hand, and the one-process runs they are compared with): this one's, offline, one torch thread
    each, without the rank variables a parent launched under torchrun would pass on (a child would
    take its parent's rank)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def devices() -> list:
    """Where a test of a device path (device experts, layerwise prefill, serving with a device) runs:
    "cpu" standing in for the GPU on every machine, and "cuda" (marked ``cuda``, skipped without a
    device) so that the same test runs on a GPU where there is one; scripts/gpu_check.sh runs
    ``pytest -m cuda``."""
    import torch

    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    return ["cpu", pytest.param("cuda", marks=(pytest.mark.cuda, no_gpu))]


def vector_isa() -> str:
    """The engine's widest vector variant here, AVX-512 where the CPU has it, else AVX2: one arithmetic
    for prompts and decode alike (its GEMMs give each row what its GEMVs give, in another order)."""
    return "avx512" if engine_isas(("avx512",)) else "avx2"


@pytest.fixture
def keep_isa():
    """Puts back the variant selected before the test (HETMOE_ISA's, or the best): a test that selects
    one never changes the variant of the tests after it."""
    from hetmoe.kernels import select_isa
    from hetmoe.kernels.dispatch import selected_isa

    before = selected_isa()
    yield
    select_isa(before)


@pytest.fixture
def vector_arithmetic(keep_isa: None) -> None:
    """Selects vector_isa() for a test whose bound or equality assumes one arithmetic for any number
    of tokens. On AMX a prompt's rows run on tiles in another arithmetic (bf16 splits, int8 digits of
    a row-wide grid: kernels_amx.cpp), whose own bounds tests/test_amx.py and tests/test_engine.py
    hold; a test that compares a path against itself at another token count, or a seeded sample,
    would otherwise compare the two arithmetics."""
    from hetmoe.kernels import select_isa

    select_isa(vector_isa())
