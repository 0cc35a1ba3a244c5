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
