import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest


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
