"""gc_paused: no cyclic collection inside, the collector's earlier state restored after, errors or not."""

from __future__ import annotations

import gc

import pytest

from hetmoe.gc_pause import gc_paused


@pytest.fixture(autouse=True)
def _collector_back_on():
    yield
    gc.enable()


def test_the_collector_waits_inside_and_runs_again_after() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_error_inside_still_restores_it() -> None:
    gc.enable()

    @gc_paused()
    def fails() -> None:
        assert not gc.isenabled()
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        fails()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_load_model_and_convert_run_with_it_paused(monkeypatch, tmp_path) -> None:
    from hetmoe.checkpoint import convert as convert_module
    from hetmoe.models import loader

    seen = []

    def record(*args, **kwargs):
        seen.append(gc.isenabled())
        raise RuntimeError("stop here")

    monkeypatch.setattr(loader, "open_source", record)  # the first thing load_model reads
    monkeypatch.setattr(convert_module, "make_plan", record)  # and convert
    gc.enable()
    with pytest.raises(RuntimeError, match="stop here"):
        loader.load_model(tmp_path)
    with pytest.raises(RuntimeError, match="stop here"):
        convert_module.convert(tmp_path, tmp_path / "out", "int4")
    assert seen == [False, False] and gc.isenabled()


def test_load_model_leaves_a_dropped_model_collectable(tiny_cache) -> None:
    """load_model freezes nothing (a loaded model holds cycles: frozen, a dropped one would never
    go); the commands that decode until they exit freeze after their load instead."""
    import weakref

    from hetmoe.models.loader import load_model

    gc.unfreeze()
    model = load_model(tiny_cache.model("qwen3_moe"))
    assert gc.get_freeze_count() == 0
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_hetmoe_generate_freezes_after_its_load(capsys) -> None:
    from hetmoe.cli.main import main

    gc.unfreeze()
    try:
        assert main(["generate", "--max-new-tokens", "2", "--temperature", "0", "def f(x):"]) == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
