"""Expert parallelism over real processes (torchrun, gloo on loopback; no mock of torch.distributed):
each MoE layer's routed experts split over 2 ranks, rank 0 running the rest of the model.

- Greedy tokens (32) are those of one process for the qwen3_moe and deepseek_v3 tiny models and
  the default model, with placement by expert id and by recorded routing load. The layer's output
  differs from one process's by the order of a float32 sum (the ranks' partial sums travel in
  float32 and are added before the one rounding to the model's dtype). Both sides run in float32,
  where that is ~1e-7 relative, far below any top-two gap these prompts meet; the test asks for
  identical tokens, as the issue does. Not in bf16: there the default model's logits after
  `def fibonacci(n):` tie to one bf16 step ('Return' 6.8125, 'M' 6.78125), and a sum order that
  moves one hidden value across a bf16 rounding boundary picks the other.
- A rank that dies makes rank 0's next MoE layer fail with RankLostError, not hang.
- Placement and expert selection against their definitions; bad requests get one clear line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import child_env

from hetmoe.formats.base import QuantizedTensor
from hetmoe.runtime.expert_parallel import ExpertPlacement, select_experts

WORKER = Path(__file__).resolve().parent / "expert_parallel_worker.py"
STEPS = 32
TIMEOUT = 300


def _expert_parallel(model_dir: Path, out: Path, *extra: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    command += [str(model_dir), str(out), str(STEPS), *extra]
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _one_process(model_dir: Path) -> list[int]:
    from expert_parallel_worker import greedy

    import hetmoe

    return greedy(hetmoe.load_model(model_dir, dtype="float32"), STEPS)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_greedy_tokens_are_one_process_tokens(tiny_cache, tmp_path, family) -> None:
    model_dir = tiny_cache.model(family)
    got = _expert_parallel(model_dir, tmp_path / "ep.json")
    assert got["tokens"] == _one_process(model_dir)
    assert "experts split over 2 processes (id placement)" in got["notes"]


def test_default_model_with_placement_by_recorded_load(tmp_path) -> None:
    from expert_parallel_worker import greedy

    import hetmoe
    from hetmoe.models.default import default_model_path

    path = default_model_path()
    stats = tmp_path / "routing.json"
    model = hetmoe.load_model(path, dtype="float32", record_routing=stats)
    want = greedy(model, STEPS)
    model.hetmoe.save_routing_stats()
    got = _expert_parallel(path, tmp_path / "ep.json", "load", str(stats))
    assert got["tokens"] == want
    assert "experts split over 2 processes (load placement)" in got["notes"]


def test_generate_with_an_explicit_rendezvous(tmp_path) -> None:
    """Without torchrun: ``hetmoe generate --expert-parallel 2 --dist-init tcp://... --dist-rank R``
    in two plain processes prints the one-process greedy text."""
    url = f"tcp://127.0.0.1:{_free_port()}"
    args = ["-m", "hetmoe", "generate", "--max-new-tokens", "16", "--temperature", "0", "--dtype", "float32"]
    one = subprocess.run([sys.executable, *args, "def f(x):"], env=child_env(), capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-2000:]
    ep = ["--expert-parallel", "2", "--dist-init", url, "--dist-rank"]
    procs = [
        subprocess.Popen(
            [sys.executable, *args, *ep, str(rank), "def f(x):"],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]
    (out1, err1), (out0, err0) = (p.communicate(timeout=TIMEOUT) for p in procs)
    assert procs[1].returncode == 0 and procs[0].returncode == 0, err0[-2000:] + err1[-2000:]
    assert out0 == one.stdout and out0.strip()
    assert out1 == ""  # the expert rank prints nothing: rank 0 reports


def test_serve_expert_parallel_answers_as_one_process(tmp_path) -> None:
    """``hetmoe serve --expert-parallel 2`` under torchrun, driven by the openai client: the greedy
    completion is the one-process server's."""
    from openai import OpenAI
    from serve_process import serve_process

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    request = {"model": "hetmoe-default", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
    answers = []
    fp32 = ["--dtype", "float32"]  # see the module's docstring
    for extra, run_with in ((fp32, None), ([*fp32, "--expert-parallel", "2"], launcher)):
        with serve_process(extra, env=child_env(), timeout=TIMEOUT, launcher=run_with) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused")
            reply = client.completions.create(**request)
            answers.append((reply.choices[0].text, reply.usage.completion_tokens))
    assert answers[0][1] == 24 and answers[1] == answers[0]


def test_serve_fails_requests_when_a_rank_dies(tmp_path) -> None:
    """The two ranks of ``hetmoe serve --expert-parallel 2`` started without an agent (as on two
    hosts); rank 1 is killed; the server answers the next requests with an error naming the lost
    rank, quickly, rather than hanging, and /health says it cannot serve."""
    import httpx
    from serve_process import serve_process

    port = str(_free_port())
    base = child_env() | {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_WORLD_SIZE": "1"}
    command = [sys.executable, "-m", "hetmoe", "serve", "--expert-parallel", "2", "--port", str(_free_port())]
    expert_rank = subprocess.Popen(command, env=base | {"RANK": "1", "LOCAL_RANK": "0"}, stderr=subprocess.PIPE)
    request = {"model": "hetmoe-default", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
    try:
        with serve_process(["--expert-parallel", "2"], env=base | {"RANK": "0", "LOCAL_RANK": "0"}) as server:
            ok = httpx.post(server.url + "/v1/completions", json=request, timeout=60)
            assert ok.status_code == 200, ok.text
            os.kill(expert_rank.pid, signal.SIGKILL)
            expert_rank.communicate()
            for _ in range(2):  # the next requests fail, each within the timeout
                failed = httpx.post(server.url + "/v1/completions", json=request, timeout=60)
                assert failed.status_code >= 500, failed.text
                assert "lost the other ranks" in failed.json()["error"]["message"], failed.text
            health = httpx.get(server.url + "/health", timeout=10)
            assert health.status_code == 503 and "lost the other ranks" in health.json()["detail"]
    finally:
        if expert_rank.poll() is None:
            expert_rank.kill()
            expert_rank.communicate()


def test_plan_states_each_ranks_share(tiny_cache) -> None:
    from hetmoe.models.planner import RAM_RESERVE, plan_memory

    path = tiny_cache.model("qwen3_moe")
    whole = plan_memory(path, ram="64GiB")
    ranks = [plan_memory(path, ram="64GiB", expert_parallel=3, rank=r) for r in range(3)]
    per = whole.expert_bytes * whole.moe_layers  # one expert of every layer
    assert [p.cpu_expert_bytes for p in ranks] == [2 * per, 3 * per, 3 * per]  # 8 experts as 2 + 3 + 3
    assert sum(p.cpu_expert_bytes for p in ranks) == whole.cpu_expert_bytes
    # rank 0 also holds the non-expert weights and the KV cache; an expert rank only its experts
    assert ranks[0].ram_need - ranks[0].cpu_expert_bytes == whole.ram_need - whole.cpu_expert_bytes
    r1 = ranks[1]
    assert r1.ram_need == r1.cpu_expert_bytes + r1.conversion_bytes + r1.reserve(r1.ram, RAM_RESERVE)
    assert whole.dense_bytes > 0 and r1.ram_need < ranks[0].ram_need
    assert "expert parallel" in dict(ranks[1].rows())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_rank_fails_rank_0_instead_of_hanging(tiny_cache, tmp_path) -> None:
    """The ranks started without torchrun's agent (as on two hosts): rank 1 is killed while rank 0
    decodes; rank 0's next MoE layer raises RankLostError."""
    model_dir = tiny_cache.model("qwen3_moe")
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = child_env() | {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        command = [sys.executable, str(WORKER), str(model_dir), str(tmp_path / "out.json"), "100000"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    time.sleep(1.0)
    deadline = time.monotonic() + TIMEOUT
    # Rank 1 serves once it has loaded its experts; give rank 0 a moment into its decode, then kill.
    while time.monotonic() < deadline and procs[0].poll() is None and not _decoding(procs[1].pid):
        time.sleep(0.1)
    time.sleep(2.0)
    assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
    os.kill(procs[1].pid, signal.SIGKILL)
    _, err = procs[0].communicate(timeout=TIMEOUT)
    procs[1].communicate()
    assert procs[0].returncode != 0
    assert "RankLostError: rank 0 of 2: lost the other ranks during layer" in err, err[-3000:]


def _decoding(pid: int) -> bool:
    """True once ``pid`` has connected to its peer (a second TCP socket besides the store's)."""
    import psutil

    try:
        return len(psutil.Process(pid).net_connections(kind="tcp")) >= 2
    except psutil.Error:
        return False


def test_placement_by_id_and_by_load() -> None:
    by_id = ExpertPlacement.by_id(7, 3)
    assert [by_id.experts_of(r) for r in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    assert by_id.local.tolist() == [0, 1, 0, 1, 0, 1, 2]
    counts = torch.tensor([100.0, 1, 1, 1, 90, 2, 3, 2])
    by_load = ExpertPlacement.by_load(counts, 2)
    shares = [by_load.experts_of(r) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(8)) and [len(s) for s in shares] == [4, 4]
    loads = [float(counts[s].sum()) for s in shares]
    assert {0, 4} & set(shares[0]) and {0, 4} & set(shares[1])  # the two heavy experts apart
    assert max(loads) - min(loads) <= float(counts.max())  # greedy balance: within one expert's load
    for r, s in enumerate(shares):
        assert by_load.owner[s].tolist() == [r] * 4 and by_load.local[s].tolist() == list(range(4))


def test_select_experts_keeps_views_for_a_run_of_ids() -> None:
    w = torch.arange(6 * 4 * 2, dtype=torch.float32).view(6, 4, 2)
    q = QuantizedTensor("bf16", (6, 4, 2), {".weight": w})
    run = select_experts(q, [2, 3, 4], "t")
    assert run.shape == (3, 4, 2) and run.tensors[".weight"].data_ptr() == w[2].data_ptr()
    picked = select_experts(q, [5, 0], "t")
    assert torch.equal(picked.tensors[".weight"], w[[5, 0]])
    bad = QuantizedTensor("x", (6, 4, 2), {".scale": torch.ones(3)})
    with pytest.raises(ValueError, match=r"t\.scale: expected 6 experts stacked on dimension 0, found \[3\]"):
        select_experts(bad, [0], "t")


def test_expert_parallel_outside_a_launcher_is_one_clear_error(tiny_cache, monkeypatch) -> None:
    import hetmoe

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"expert_parallel=2, but this process is one of WORLD_SIZE=1"):
        hetmoe.load_model(tiny_cache.model("qwen3_moe"), expert_parallel=2)
    with pytest.raises(ValueError, match=r"does not combine with gpu_experts"):
        hetmoe.load_model(tiny_cache.model("qwen3_moe"), expert_parallel=2, gpu_experts=1)
