"""Layerwise prefill (hetmoe/runtime/layerwise.py) on tiny models, device "cpu" standing in for the GPU.

What is compared (``rel(a, b) = max|a - b| / max|b|`` over all logits):

- fp32 models: layerwise against the hybrid path of the same checkpoint. bf16 experts are exact
  in fp32 on both sides, so only the summation order differs: 1e-5 (measured: about 2.5e-7).
  int4 experts: the streamed weights are the codec's exact dequantization while the engine
  quantizes activations to int16 blocks, as in test_hybrid's engine-vs-fallback check: 1e-4
  (measured: at most 7e-6).
- bf16 models: the layerwise path computes like transformers' eager experts (each projection
  rounded to bf16) while the engine rounds once, so the two differ by a few bf16 ulps (measured
  rel 4e-3 to 7e-3): as in test_hybrid, the distance to the fp32 reference must be at most
  transformers' own bf16 distance x 1.25 plus one bf16 ulp.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import devices
from tiny_models import logits, rel, tokens
from transformers import AutoModelForCausalLM

from hetmoe import load_model
from hetmoe.runtime import layerwise

ARCHS = ("qwen3_moe", "deepseek_v3", "gpt_oss")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_cache, tmp_path_factory):
    """A tiny checkpoint transformers itself can run (DeepSeek-V3's head_dim set to its rotary
    dimension, as test_hybrid's fixture explains)."""
    root = tmp_path_factory.mktemp("layerwise")

    def get(model_type: str) -> Path:
        src = tiny_cache.model(model_type)
        config = json.loads((src / "config.json").read_text())
        rope = config.get("qk_rope_head_dim")
        if rope is None or config.get("head_dim") == rope:
            return src
        dst = root / model_type
        if not dst.exists():
            tiny_cache.copy(src, dst)
            config["head_dim"] = rope
            (dst / "config.json").write_text(json.dumps(config))
        return dst

    return get


def assert_each_pair_once(model: torch.nn.Module, fixed_placement: bool = True) -> None:
    """Every routed (token, expert) pair computed exactly once: on the device from resident or
    streamed weights, never on the CPU (the routing recorded independently of either path). With a
    fixed placement, resident experts only ever ran from resident weights and the others streamed."""
    routing = model.hetmoe.stats.routing
    for layer, hybrid in model.hetmoe.layers.items():
        resident = torch.zeros(hybrid.cpu.experts, dtype=torch.bool)
        resident[hybrid.device_ids] = True
        dev, streamed = hybrid.device_experts.counts.cpu(), hybrid.streamed_counts.cpu()
        assert not hybrid.cpu_counts.any(), layer
        if fixed_placement:
            assert not dev[~resident].any() and not streamed[resident].any(), layer
        assert torch.equal(dev + streamed, routing[layer].cpu()), layer


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["bf16", "int4"])
@pytest.mark.parametrize("model_type", ARCHS)
def test_layerwise_equals_hybrid_path(model_type: str, method: str, device: str, tiny) -> None:
    """Threshold below the prompt, two resident experts a layer, one expert a chunk (so each layer
    streams six chunks): the same logits as the hybrid path, each pair computed once."""
    path = tiny(model_type)
    ids = tokens()
    want = logits(load_model(path, method=method, dtype=torch.float32, gpu_experts=2, device=device), ids)
    model = load_model(
        path,
        method=method,
        dtype=torch.float32,
        gpu_experts=2,
        prefill_threshold=8,
        prefill_chunk_bytes=1,
        device=device,
    )
    model.hetmoe.set_record_routing(True)
    got = logits(model, ids)
    assert rel(got, want) <= (1e-5 if method == "bf16" else 1e-4), rel(got, want)
    assert_each_pair_once(model)
    lw = model.hetmoe.layerwise
    n_layers = len(model.hetmoe.layers)
    assert lw.stats.layers == n_layers and lw.stats.chunks == 6 * n_layers
    # The streamed bytes are the stored ones (int4: about a quarter of bf16), dequantized on the device.
    per_expert = layerwise.expert_bytes(next(iter(model.hetmoe.layers.values())))
    assert lw.stats.device_bytes == 6 * n_layers * per_expert
    assert lw.stats.stored_bytes < (0.5 if method == "int4" else 0.6) * lw.stats.device_bytes
    # The working set: never more than two one-expert chunks alive.
    assert 0 < lw.stats.peak_live_bytes <= lw.working_set_bytes() == 2 * per_expert


def test_stored_quantized_experts_stream_as_stored(tiny_cache, tmp_path: Path) -> None:
    """DeepSeek fp8 (block scales) and gpt-oss mxfp4 checkpoints: the chunks are their stored bytes,
    dequantized by the codec on the device; the logits are the hybrid path's (1e-4, as int4)."""
    for method, src in {"fp8": tiny_cache.fp8(), "mxfp4": tiny_cache.mxfp4()}.items():
        path = tiny_cache.copy(src, tmp_path / method)
        config = json.loads((path / "config.json").read_text())
        if "qk_rope_head_dim" in config:
            config["head_dim"] = config["qk_rope_head_dim"]  # see the tiny fixture
            (path / "config.json").write_text(json.dumps(config))
        ids = tokens(5)
        want = logits(load_model(path, dtype=torch.float32), ids)
        model = load_model(path, dtype=torch.float32, prefill_threshold=4)
        model.hetmoe.set_record_routing(True)
        assert next(iter(model.hetmoe.layers.values())).cpu.gate.method == method
        assert rel(logits(model, ids), want) <= 1e-4, method
        assert_each_pair_once(model)
        assert model.hetmoe.layerwise.stats.stored_bytes < 0.6 * model.hetmoe.layerwise.stats.device_bytes


@pytest.mark.parametrize("device", devices())
def test_layerwise_bf16_model_is_as_close_as_transformers_bf16(device: str, tiny) -> None:
    """The bf16 bound of the module docstring, with transformers' bf16 model on the same device."""
    for model_type in ARCHS:
        path = tiny(model_type)
        ids = tokens(3)
        want32 = logits(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), ids)
        theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval().to(device)
        theirs16 = rel(logits(theirs, ids), want32)
        ours = load_model(path, method="bf16", prefill_threshold=1, gpu_experts=1, device=device)
        ours16 = rel(logits(ours, ids), want32)
        assert ours16 <= 1.25 * theirs16 + 2**-8, (model_type, ours16, theirs16)


def test_decode_steps_take_the_hybrid_path(tiny) -> None:
    """generate: the prompt (9 tokens > threshold 8) is streamed, every 1-token decode step runs on
    the CPU engine; the greedy tokens are the hybrid path's. The last layer's MLP sees only the
    prompt's kept row (the prompt tail: generate keeps 1 row's logits), which is under the
    threshold, so it runs on the CPU engine rather than streaming that layer's experts."""
    path = tiny("qwen3_moe")
    prompt = tokens(1, (1, 9))
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    want = load_model(path, dtype=torch.float32).generate(prompt, **kw)
    model = load_model(path, dtype=torch.float32, prefill_threshold=8)
    got = model.generate(prompt, **kw)
    assert torch.equal(got, want)
    runtime = model.hetmoe
    order = sorted(runtime.layers)
    assert runtime.layerwise.stats.layers == len(order) - 1  # one streamed forward: the prompt, all but the last
    for index in order[:-1]:
        hybrid = runtime.layers[index]
        assert int(hybrid.streamed_counts.sum()) == 9 * 2  # the prompt's tokens, top-2
        assert int(hybrid.cpu_counts.sum()) == 5 * 2  # 5 decode steps (the 6th token needs none)
    last = runtime.layers[order[-1]]
    assert int(last.streamed_counts.sum()) == 0
    assert int(last.cpu_counts.sum()) == (1 + 5) * 2  # the prompt's kept row, then the 5 decode steps


def test_next_layer_is_prepared_while_this_layer_computes(tiny, monkeypatch) -> None:
    """Ordering, not time: while a layer computes its last chunk, the compute waits (up to 10 s)
    for the producer to start preparing the next layer's first chunk. A producer that only started
    a layer when the forward asked for it would never do so: the wait would time out."""
    path = tiny("deepseek_v3")
    model = load_model(path, method="int4", dtype=torch.float32, prefill_threshold=4, prefill_chunk_bytes=1 << 20)
    lw = model.hetmoe.layerwise
    order = sorted(model.hetmoe.layers)
    seen: dict[int, bool] = {}
    original = layerwise.run_experts

    def slow_compute(*args, **kwargs):
        what, layer, chunk, count = lw.events[-1]
        assert what == "compute_start"
        if chunk == count - 1 and layer != order[-1]:
            nxt = order[order.index(layer) + 1]
            seen[layer] = _wait_for(lambda: ("prepare_start", nxt, 0) in {e[:3] for e in list(lw.events)})
        return original(*args, **kwargs)

    monkeypatch.setattr(layerwise, "run_experts", slow_compute)
    logits(model, tokens(2))
    assert seen == {layer: True for layer in order[:-1]}
    events = [e[:3] for e in lw.events]
    for layer, nxt in itertools.pairwise(order):
        last_compute = max(i for i, e in enumerate(events) if e[:2] == ("compute_end", layer))
        assert events.index(("prepare_start", nxt, 0)) < last_compute, (layer, events)


def _wait_for(cond, timeout: float = 10.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        done.wait(0.01)
    return False


@pytest.mark.parametrize("device", devices())
def test_placement_and_replacement_keep_working(device: str, tiny) -> None:
    """Dynamic re-placement every call: the resident set changes between forwards, the logits stay
    the hybrid path's, and each pair is still computed once."""
    path = tiny("qwen3_moe")
    model = load_model(path, dtype=torch.float32, gpu_experts=2, replace_every=1, prefill_threshold=4, device=device)
    plain = load_model(path, dtype=torch.float32)
    model.hetmoe.set_record_routing(True)
    placements = []
    for seed in range(3):
        ids = tokens(10 + seed, (2, 16))
        assert rel(logits(model, ids), logits(plain, ids)) <= 1e-5
        placements.append(model.hetmoe.placement)
    assert_each_pair_once(model, fixed_placement=False)
    assert len({str(p) for p in placements}) > 1
    assert sum(h.replacements for h in model.hetmoe.layers.values()) > 0


def test_producer_failure_is_raised_and_the_next_forward_recovers(tiny, monkeypatch) -> None:
    path = tiny("qwen3_moe")
    model = load_model(path, dtype=torch.float32, prefill_threshold=4)
    ids = tokens(4)
    want = logits(load_model(path, dtype=torch.float32), ids)
    original = layerwise.prepare_chunk
    calls = {"n": 0}

    def failing(src, experts):
        calls["n"] += 1
        if calls["n"] == 2:  # the second layer's chunk
            raise RuntimeError("simulated copy failure")
        return original(src, experts)

    monkeypatch.setattr(layerwise, "prepare_chunk", failing)
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        logits(model, ids)
    assert rel(logits(model, ids), want) <= 1e-5  # a fresh pass from the first layer


def test_bad_settings_are_clear_errors(tiny) -> None:
    path = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="prefill_threshold: expected None or an int >= 0"):
        load_model(path, prefill_threshold=-1)
    with pytest.raises(ValueError, match="prefill_chunk_bytes"):
        load_model(path, prefill_threshold=4, prefill_chunk_bytes=0)
    model = load_model(path)
    with pytest.raises(ValueError, match="prefill_threshold"):
        model.hetmoe.set_prefill_threshold("many")  # type: ignore[arg-type]
    model.hetmoe.set_prefill_threshold(4)
    assert "layerwise prefill above 4 tokens" in model.hetmoe.summary()
    model.hetmoe.set_prefill_threshold(None)
    assert all(h.layerwise is None for h in model.hetmoe.layers.values())
