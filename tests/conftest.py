import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory):  # -> tiny_models.TinyCache
    """Tiny MoE checkpoints (tests/tiny_models.py), each built once per session."""
    from tiny_models import TinyCache

    return TinyCache(tmp_path_factory.mktemp("tiny"))
