"""Mutation fuzzing of hetmoe's readers, the way broken downloads and hand-edited files look.

Each target takes a seed corpus of valid inputs built from the tests' tiny checkpoints, mutates one
(bytes: flipped bits, interesting integers over header fields, truncation, zeroed runs, inserted and
duplicated chunks; JSON: deleted keys, values replaced by other types, huge or negative numbers,
NaN, deep nesting, long strings), lays it out as a user's file or directory, and runs the path a
user's command takes over it. Every case must end in one of two ways:

- accepted: it reads (a mutation can leave a valid file, or one the reader may legitimately take);
- rejected clearly: a ``ValueError`` (what the CLI prints as one line, cli/main.py) whose message is
  one line and names the file (or the case directory the file is in).

Anything else is a failure: another exception type (the user sees a traceback), a message over
several lines or one that does not say which file, or a case running past ``case_timeout`` (a hang).
A process crash (a signal) is caught by ``scripts/fuzz.py``, which runs each target in a child.

``fuzz(target, cases=..., seconds=..., seed=...)`` runs one target; ``TARGETS`` builds them.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiny_models import TinyCache, make_gguf, tiny_chat_model

# Values that break parsers: boundaries of the integer widths headers use.
INTERESTING_INTS = (0, 1, 2, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1)
INTERESTING_BYTES = (0x00, 0xFF, 0x7F, 0x80, 0x20, 0x22, 0x5C, 0x7B, 0x7D, 0x5B, 0x5D, 0x2C, 0x3A, 0x0A)
_DEEP = "\u0000deep:"  # a placeholder string dumped as deeply nested brackets (json.dumps would recurse)
INTERESTING_JSON: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 2, 3, 2**31, 2**63, 2**64, -(2**63), 10**30, 1e308, -1e308, 0.5, -0.0,
    float("nan"), float("inf"), "", "x", "\u0000", "é東", "a" * 10_000, [], {}, [1, 2], [[1]], {"a": 1},
    _DEEP + "50", _DEEP + "100000",
)  # fmt: skip


class Hang(BaseException):
    """A case ran past its time limit (a BaseException, so readers' ``except Exception`` cannot eat it)."""


def mutate_bytes(data: bytes, rng: random.Random, hot: int) -> bytes:
    """1-8 byte-level mutations, three in four inside the first ``hot`` bytes (where headers live)."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 8))):
        n = len(b)
        if n == 0:
            b.append(rng.randrange(256))
            continue
        pos = rng.randrange(min(n, max(hot, 1))) if rng.random() < 0.75 else rng.randrange(n)
        op = rng.randrange(9)
        if op == 0:
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos] = rng.choice(INTERESTING_BYTES)
        elif op == 2:  # an interesting integer over a 2-, 4- or 8-byte field
            width = rng.choice((2, 4, 8))
            value = rng.choice(INTERESTING_INTS) + rng.choice((0, 0, -1, 1))
            b[pos : pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
        elif op == 3:
            del b[pos : pos + rng.randrange(1, 64)]
        elif op == 4:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        elif op == 5:
            run = min(rng.randrange(1, 256), n - pos)
            b[pos : pos + run] = bytes(run)
        elif op == 6:
            del b[pos:]  # truncated
        elif op == 7:
            src = rng.randrange(n)
            b[pos:pos] = b[src : src + rng.randrange(1, 64)]
        else:
            b[pos] = (b[pos] + rng.choice((-1, 1))) % 256  # an off-by-one digit or length
    return bytes(b)


def _paths(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*path, i))


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _interesting(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(INTERESTING_JSON))  # a copy: later mutations must not edit the table


def mutate_json(obj: Any, rng: random.Random) -> Any:
    """1-3 structural mutations of a parsed JSON value (a copy)."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.choice((1, 1, 2, 3))):
        paths = list(_paths(obj))
        path = rng.choice(paths)
        value = _get(obj, path)
        op = rng.randrange(8)
        if op == 0:
            new = _interesting(rng)
        elif op == 1:
            new = copy.deepcopy(_get(obj, rng.choice(paths)))
        elif op == 2:
            new = [value] if rng.random() < 0.5 else {"value": value}
        elif op == 3 and isinstance(value, bool):
            new = not value
        elif op == 3 and isinstance(value, (int, float)):
            new = rng.choice((-value, value + 1, value - 1, value * 2**20, 0, value / 3, str(value)))
        elif op == 4 and isinstance(value, str):
            chars = list(value)
            if chars:
                chars[rng.randrange(len(chars))] = rng.choice("x0.-_/\\\"'{}[] \u0000é")
            new = "".join(chars) if rng.random() < 0.8 else value * rng.randrange(2, 50)
        elif op == 5 and isinstance(value, dict):
            new = dict(value)
            new[rng.choice(("extra", "num_experts", "dtype", "", "__metadata__", "format"))] = _interesting(rng)
        elif op == 6 and isinstance(value, (dict, list)) and value:
            new = copy.copy(value)
            key = rng.choice(list(new)) if isinstance(new, dict) else rng.randrange(len(new))
            del new[key]
        else:
            new = _interesting(rng)
        if path:
            _get(obj, path[:-1])[path[-1]] = new
        else:
            obj = new
    return obj


def dump_json(obj: Any, rng: random.Random) -> bytes:
    """JSON text of ``obj`` (NaN and Infinity as Python writes them); placeholders become deep nesting."""
    text = json.dumps(obj, indent=rng.choice((None, 2)))
    marker = json.dumps(_DEEP)[:-1]  # the placeholder's opening quote and escaped text
    while marker in text:
        at = text.index(marker)
        end = text.index('"', at + 1)
        depth = int(text[at + len(marker) : end])
        text = text[:at] + "[" * depth + "]" * depth + text[end + 1 :]
    return text.encode()


def mutate_json_bytes(data: bytes, rng: random.Random) -> bytes:
    """Three in four structural (when ``data`` parses), else byte mutations of the text."""
    if rng.random() < 0.75:
        try:
            return dump_json(mutate_json(json.loads(data), rng), rng)
        except ValueError:
            pass
    return mutate_bytes(data, rng, len(data))


# --- targets ---------------------------------------------------------------------------------------


@dataclass
class Seed:
    data: bytes
    base: Path | None = None  # the directory a case of this seed is laid out beside (config, manifest)
    hot: int = 1 << 30  # where byte mutations concentrate: the header's extent


@dataclass
class Target:
    name: str
    seeds: list[Seed]
    mutate: Callable[[Seed, random.Random], bytes]
    # lays a case out under the work directory; returns what the reader opens and what a message must name
    layout: Callable[[Seed, bytes, Path], tuple[Path, tuple[str, ...]]]
    read: Callable[[Path], object]


def _file_layout(suffix: str) -> Callable[[Seed, bytes, Path], tuple[Path, tuple[str, ...]]]:
    def layout(seed: Seed, data: bytes, work: Path) -> tuple[Path, tuple[str, ...]]:
        path = work / f"case{suffix}"
        path.write_bytes(data)
        return path, (str(path),)

    return layout


def _dir_layout(file_name: str) -> Callable[[Seed, bytes, Path], tuple[Path, tuple[str, ...]]]:
    """A directory of links to the seed's files, with ``file_name`` replaced by the case."""

    def layout(seed: Seed, data: bytes, work: Path) -> tuple[Path, tuple[str, ...]]:
        assert seed.base is not None
        case = work / "case"
        if case.exists():
            shutil.rmtree(case)
        case.mkdir()
        for f in seed.base.iterdir():
            if f.name != file_name and f.is_file():
                os.link(f, case / f.name)  # the tensors as they are, without copying their bytes
        (case / file_name).write_bytes(data)
        return case, (str(case),)

    return layout


def read_checkpoint(path: Path) -> None:
    """What ``hetmoe inspect`` / ``generate`` read of a checkpoint: its config, layout and every MoE layer."""
    from hetmoe.checkpoint import open_source
    from hetmoe.checkpoint.config import read_config
    from hetmoe.checkpoint.experts import read_layer_experts
    from hetmoe.checkpoint.layout import moe_layout

    source = open_source(path)
    layout = moe_layout(read_config(path), source)
    for layer in layout.moe_layers:
        read_layer_experts(source, layout, layer)


def read_safetensors(path: Path) -> None:
    from hetmoe.checkpoint.safetensors_file import SafetensorsFile

    f = SafetensorsFile(path)
    _ = dict(f.metadata)
    for name in f.keys():
        f.info(name)
        f.get(name).reshape(-1)[:16].tolist()  # touch the bytes the header points at


def read_store(path: Path) -> None:
    from hetmoe.checkpoint.store import open_store

    store = open_store(path)
    store.moe_layout()
    for layer in store.moe_layers:
        store.layer(layer)
    for name in store.keys()[:8]:
        store.info(name)
        store.get(name)


def _safetensors_seeds(work: Path) -> list[Seed]:
    import torch

    from hetmoe.checkpoint.store import PlannedTensor, write_safetensors

    gen = torch.Generator().manual_seed(0)
    sets = [
        {"a.weight": torch.randn(4, 8, generator=gen).bfloat16(), "b.bias": torch.randn(8, generator=gen)},
        {
            "codes": torch.randint(0, 255, (3, 16), dtype=torch.uint8, generator=gen),
            "scales": torch.randn(3, 2, generator=gen).to(torch.float16),
            "fp8": torch.randn(2, 16, generator=gen).to(torch.float8_e4m3fn),
            "ids": torch.arange(6, dtype=torch.int32),
            "empty": torch.zeros(0, 4),
        },
    ]
    seeds = []
    for i, tensors in enumerate(sets):
        path = work / f"seed{i}.safetensors"
        write_safetensors(path, [PlannedTensor.of(n, t) for n, t in tensors.items()], {"format": "pt", "note": "x"})
        data = path.read_bytes()
        seeds.append(Seed(data, hot=8 + int.from_bytes(data[:8], "little")))
    return seeds


def _gguf_seeds(cache: TinyCache, work: Path) -> list[Seed]:
    import gguf

    paths = [
        cache.gguf(),
        make_gguf(work / "seed-merged.gguf", merged_gate_up=True, layers=2),
        make_gguf(work / "seed-qwen.gguf", arch="qwen3moe", layers=2, dense=0,
                  types={0: ("Q4_0", "Q4_0", "Q8_0"), 1: ("Q4_K", "Q5_K", "Q6_K")}),
    ]  # fmt: skip
    seeds = []
    for p in paths:
        data_start = min(t.data_offset for t in gguf.GGUFReader(p).tensors)
        seeds.append(Seed(p.read_bytes(), hot=data_start))
    return seeds


def _json_seeds(bases: list[Path], name: str) -> list[Seed]:
    return [Seed((b / name).read_bytes(), base=b) for b in bases]


def _chat_seeds() -> list[Seed]:
    conversations = [
        [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi, how can I help?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2? Café 東京 🙂"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3"},
            {"role": "assistant", "content": "6"},
        ],
    ]
    lines = [json.dumps({"messages": c}, ensure_ascii=i % 2 == 0) for i, c in enumerate(conversations)]
    return [Seed(("\n".join(lines) + "\n").encode()), Seed((lines[1] + "\n\n" + lines[0]).encode())]


def _mutate_chat(seed: Seed, rng: random.Random) -> bytes:
    if rng.random() < 0.4:
        return mutate_bytes(seed.data, rng, len(seed.data))
    lines = seed.data.split(b"\n")
    i = rng.randrange(len(lines))
    lines[i] = mutate_json_bytes(lines[i], rng).replace(b"\n", b" ") if lines[i].strip() else lines[i]
    return b"\n".join(lines)


def build_targets(cache: TinyCache, work: Path) -> dict[str, Callable[[], Target]]:
    """Each target's constructor (seeds are built on first use, from ``cache``'s tiny checkpoints)."""
    work.mkdir(parents=True, exist_ok=True)

    def safetensors() -> Target:
        return Target("safetensors", _safetensors_seeds(work), lambda s, r: mutate_bytes(s.data, r, s.hot),
                      _file_layout(".safetensors"), read_safetensors)  # fmt: skip

    def gguf() -> Target:
        return Target("gguf", _gguf_seeds(cache, work), lambda s, r: mutate_bytes(s.data, r, s.hot),
                      _file_layout(".gguf"), read_checkpoint)  # fmt: skip

    def config() -> Target:
        bases = [cache.model("qwen3_moe"), cache.model("deepseek_v3"), cache.model("gpt_oss"), cache.fp8(),
                 cache.int4(), cache.gptq(), cache.mxfp4()]  # fmt: skip
        return Target("config", _json_seeds(bases, "config.json"), lambda s, r: mutate_json_bytes(s.data, r),
                      _dir_layout("config.json"), read_checkpoint)  # fmt: skip

    def manifest() -> Target:
        from hetmoe.checkpoint.convert import convert
        from hetmoe.checkpoint.store import MANIFEST

        stores = []
        for src, method in ((cache.int4(), "int8"), (cache.model("qwen3_moe"), "int4")):
            dst = work / f"store-{method}"
            if not (dst / MANIFEST).exists():
                convert(src, dst, method, progress=False, log=lambda _msg: None)
            stores.append(dst)
        return Target("manifest", _json_seeds(stores, MANIFEST), lambda s, r: mutate_json_bytes(s.data, r),
                      _dir_layout(MANIFEST), read_store)  # fmt: skip

    def chat() -> Target:
        from transformers import AutoTokenizer

        from hetmoe.sft.data import load_chat_dataset

        tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model(cache))
        return Target("chat", _chat_seeds(), _mutate_chat, _file_layout(".jsonl"),
                      lambda p: load_chat_dataset(p, tokenizer, max_length=64))  # fmt: skip

    return {"safetensors": safetensors, "gguf": gguf, "config": config, "manifest": manifest, "chat": chat}


# --- the loop --------------------------------------------------------------------------------------


@dataclass
class Failure:
    kind: str  # "crash" (an exception other than ValueError), "multi-line", "unnamed", "hang"
    case: int
    message: str
    saved: Path | None = None


@dataclass
class Report:
    target: str
    cases: int = 0
    accepted: int = 0
    rejected: int = 0
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)

    def line(self) -> str:
        kinds: dict[str, int] = {}
        for f in self.failures:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        bad = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "0 failures"
        rate = self.cases / max(self.seconds, 1e-9)
        return (
            f"{self.target}: {self.cases} cases in {self.seconds:.0f} s ({rate:.0f}/s): "
            f"{self.accepted} read, {self.rejected} refused with one line naming the file; {bad}"
        )


def classify(exc: BaseException | None, named: tuple[str, ...]) -> str | None:
    """None where the outcome is acceptable, else the kind of failure."""
    if exc is None:
        return None
    if isinstance(exc, Hang):
        return "hang"
    if not isinstance(exc, ValueError):
        return "crash"
    message = str(exc)
    if "\n" in message.strip():
        return "multi-line"
    if not any(n in message for n in named):
        return "unnamed"
    return None


def _on_alarm(signum: int, frame: object) -> None:
    raise Hang()


def fuzz(
    target: Target,
    work: Path,
    *,
    cases: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    case_timeout: float = 10.0,
    save: Path | None = None,
    max_failures: int = 20,
) -> Report:
    """Run ``target`` for ``cases`` cases or ``seconds`` seconds (whichever ends first)."""
    rng = random.Random(seed)
    report = Report(target.name)
    case_dir = work / f"cases-{target.name}"
    case_dir.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    start = time.perf_counter()
    try:
        while (cases is None or report.cases < cases) and (seconds is None or time.perf_counter() - start < seconds):
            s = rng.choice(target.seeds)
            data = target.mutate(s, rng)
            path, named = target.layout(s, data, case_dir)
            exc: BaseException | None = None
            signal.setitimer(signal.ITIMER_REAL, case_timeout)
            try:
                target.read(path)
            except BaseException as e:  # classified below; KeyboardInterrupt still stops the run
                if isinstance(e, KeyboardInterrupt):
                    raise
                exc = e
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            report.cases += 1
            kind = classify(exc, named)
            if kind is None:
                report.accepted += exc is None
                report.rejected += exc is not None
                continue
            text = "".join(traceback.format_exception(exc)) if exc is not None else ""
            failure = Failure(kind, report.cases, f"{type(exc).__name__}: {exc}"[:500])
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                failure.saved = save / f"{target.name}-{kind}-{report.cases}.bin"
                failure.saved.write_bytes(data)
                failure.saved.with_suffix(".txt").write_text(text)
            report.failures.append(failure)
            if len(report.failures) >= max_failures:
                break
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        report.seconds = time.perf_counter() - start
    return report
