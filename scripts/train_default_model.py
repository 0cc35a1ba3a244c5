#!/usr/bin/env python
"""Train hetmoe's embedded default model: a small Qwen3-MoE that writes Python-standard-library text.

Everything comes from this machine, offline: the training text is the Python standard library's own
sources (found with ``sysconfig.get_paths()["stdlib"]``, files in sorted order, test packages and
huge generated files skipped) plus synthetic ChatML conversations built from them ("What does
`json.dumps` do?" answered with the docstring's first paragraph; "Write a Python function named
`x`" answered with its source); the standard library's own test suite adds code to the language
model's stream only. A byte-level BPE tokenizer is trained on the library and chat text. A fixed
slice of modules (chosen by a hash of the module name, so it never depends on the seed) is held
out: its loss gives the reported perplexity and its first 64 KB become ``heldout.txt``.

Two stages: stage 1 samples random windows of the code stream (Recipe.steps); stage 2, the polish
(Recipe.polish_steps), continues from stage 1's bf16-rounded weights with a fresh optimizer at a low
learning rate, 8 of each batch's 12 code rows starting at a top-level ``def``/``class``, which teaches
the model what follows a bare signature at column 0. ``--stage1 DIR`` takes stage 1 from an earlier
run's output (checked to be this recipe and seed) and runs stage 2 alone, bit for bit as a whole run.

The run is deterministic for a given ``--seed`` on a given machine (same Python stdlib, same torch
thread count): data order, initialisation and batch sampling all derive from the seed.

Output (``--out``, default ``hetmoe/assets/default_model``) is built in a temporary directory beside
the target and renamed into place only when complete: config.json, generation_config.json
(SAMPLING_DEFAULTS: how `hetmoe generate` and `hetmoe chat` sample from it), model.safetensors
(bf16), tokenizer.json, tokenizer_config.json (with the ChatML chat template), training_report.json
and heldout.txt.

examples:
  python scripts/train_default_model.py                       # the shipped model (~2 h on a 2-core box)
  python scripts/train_default_model.py --polish-steps 0 --out /tmp/s1   # stage 1 only, then stage 2 alone:
  python scripts/train_default_model.py --stage1 /tmp/s1 --out /tmp/m
  python scripts/train_default_model.py --seed 1 --steps 300 --out /tmp/m
  python scripts/train_default_model.py --smoke --out /tmp/smoke   # seconds: a tiny model, for tests
"""

from __future__ import annotations

import argparse
import ast
import bisect
import hashlib
import inspect
import json
import math
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "hetmoe" / "assets" / "default_model"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Directories whose modules are tests, not library code; files above MAX_FILE_BYTES are generated
# tables (pydoc_data/topics.py, the encodings' charmaps are skipped by directory).
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "encodings", "turtledemo"}
# The standard library's own test suite (Lib/test, idlelib/idle_test: 15 MB, more than the library
# itself) is Python of the same kind and licence. It feeds only the language-model stream: the
# tokenizer, the chat examples and the held-out split stay those of the library modules, so the
# held-out perplexity is measured on the same modules with the same tokenizer as before.
TEST_DIRS = ("test", "idlelib/idle_test")
MAX_FILE_BYTES = 200_000
# How `hetmoe generate` and `hetmoe chat` sample from this model unless told otherwise, written into
# generation_config.json: llama.cpp's top-k 40, top-p 0.95 and min-p 0.05, a repetition penalty, and
# transformers' n-gram ban, without which a model this small loops on a phrase ("Line Line Line ...":
# a penalty divides a looping token's score once, which does not stop it). Picked on the README's
# prompt over 30 seeded runs each of the shipped model in int4 and bf16 (docs/quality.md): with
# the penalty alone (1.1), 7 and 5 of 30 repeated a word 3-gram more than twice; with the 4-gram ban, 0.
SAMPLING_DEFAULTS = {
    "do_sample": True,
    "temperature": 0.9,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "no_repeat_ngram_size": 4,
}
HELDOUT_BUCKETS = 20  # 1 in 20 modules is held out
HELDOUT_TXT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Recipe:
    """Model shape and training schedule; ``--smoke`` swaps in a tiny one."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 96
    seq_len: int = 256
    batch_size: int = 16
    chat_rows: int = 4  # rows of each batch that start at a chat example
    steps: int = 5600
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.1
    router_aux_loss_coef: float = 0.01
    max_files: int = 0  # 0 = every file
    eval_windows: int = 160
    stdlib_tests: bool = True  # add TEST_DIRS to the training code stream
    # Stage 2, "polish": from stage 1's bf16-rounded weights, a fresh optimizer and a short schedule
    # in which some code rows start at a top-level `def`/`class` of a library module. Random windows
    # almost never start there, so after stage 1 the model often indented a top-level function's body
    # as a method's (12 spaces): a prompt that is a bare signature is exactly such a start.
    polish_steps: int = 1500
    polish_lr: float = 3e-4
    polish_warmup: int = 20
    polish_def_rows: int = 8  # of the batch's code rows


SMOKE = Recipe(
    vocab_size=400,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    num_experts=4,
    moe_intermediate_size=32,
    seq_len=64,
    batch_size=4,
    chat_rows=1,
    steps=4,
    warmup=2,
    max_files=12,
    eval_windows=4,
    stdlib_tests=False,
    polish_steps=2,
    polish_warmup=1,
    polish_def_rows=1,
)
STAGE1_FIELDS = tuple(f for f in asdict(Recipe()) if not f.startswith("polish_"))


# ---------------------------------------------------------------- data


@dataclass
class Module:
    name: str
    text: str


def stdlib_tests() -> list[Module]:
    """The standard library's test modules (TEST_DIRS), sorted by path, oversized files skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tests: list[Module] = []
    for top in TEST_DIRS:
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" in path.parts or path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                tests.append(Module(".".join(path.relative_to(root).with_suffix("").parts), text))
    return tests


def stdlib_modules(max_files: int = 0) -> list[Module]:
    """The standard library's Python sources, sorted by path, tests and generated files skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules: list[Module] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or not text.strip():
            continue
        modules.append(Module(".".join(parts), text))
        if max_files and len(modules) >= max_files:
            break
    if not modules:
        raise SystemExit(f"no Python sources found under {root}")
    return modules


def top_level_offsets(text: str) -> list[int]:
    """Character offsets of the lines that open a top-level function or class (its first decorator)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    line_starts = [0]
    for line in text.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append(line_starts[first - 1])
    return out


def is_heldout(name: str) -> bool:
    """A fixed, seed-independent 1-in-20 split by module name."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HELDOUT_BUCKETS == 0


def _first_paragraph(doc: str, limit: int = 700) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0].strip()
    return para if len(para) <= limit else para[:limit].rsplit(" ", 1)[0] + " ..."


def chat_examples(module: Module) -> list[list[dict[str, str]]]:
    """Question/answer conversations from one module's public functions, classes and methods."""
    try:
        tree = ast.parse(module.text)
    except SyntaxError:
        return []
    out: list[list[dict[str, str]]] = []

    def visit(nodes: list[ast.stmt], prefix: str) -> None:
        for node in nodes:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue
            qual = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node)
            if doc and len(doc.strip()) > 20:
                out.append(
                    [
                        {"role": "user", "content": f"What does `{qual}` do?"},
                        {"role": "assistant", "content": _first_paragraph(doc)},
                    ]
                )
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                source = ast.get_source_segment(module.text, node)
                if source and 80 <= len(source) <= 1500:
                    source = inspect.cleandoc("\n" + source) if source.startswith(" ") else source
                    ask = f"Write a Python function named `{node.name}`"
                    ask += f" that does this: {_first_paragraph(doc, 200)}" if doc else "."
                    out.append([{"role": "user", "content": ask}, {"role": "assistant", "content": source}])
            if isinstance(node, ast.ClassDef):
                visit(node.body, qual)

    visit(tree.body, module.name)
    return out


def render_chat(messages: list[dict[str, str]]) -> str:
    """The ChatML text CHAT_TEMPLATE produces for ``messages`` (kept in step by a test)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config() -> dict[str, Any]:
    specials = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": specials,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------- model


def build_model(recipe: Recipe, ids: dict[str, int]) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=4 * recipe.hidden_size,  # unused: every layer is sparse
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=1024,
        num_experts=recipe.num_experts,
        num_experts_per_tok=recipe.top_k,
        moe_intermediate_size=recipe.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=True,
        router_aux_loss_coef=recipe.router_aux_loss_coef,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    return Qwen3MoeForCausalLM(config)


def warmup_cosine(step: int, peak: float, warmup: int, steps: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to a tenth of it (both stages' schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def batches(
    code: Any, chat: Any, chat_starts: Any, recipe: Recipe, gen: Any, def_starts: Any = (), def_rows: int = 0
) -> Iterator[Any]:  # tensors; torch imported lazily
    """Rows of seq_len + 1 tokens: ``def_rows`` code rows from ``def_starts`` (stage 2's top-level
    definitions), the other code rows at random, then ``chat_rows`` from the starts of chat examples."""
    import torch

    n = recipe.seq_len + 1
    def_rows = def_rows if len(def_starts) else 0  # a smoke run's few files may define nothing
    code_rows = recipe.batch_size - recipe.chat_rows - def_rows
    while True:
        rows = []
        if def_rows:  # stage 1 draws nothing here, so its batches are those of a run without stage 2
            picks = torch.randint(0, len(def_starts), (def_rows,), generator=gen)
            for p in picks.tolist():
                s = min(int(def_starts[p]), len(code) - n)
                rows.append(code[s : s + n])
        starts = torch.randint(0, len(code) - n, (code_rows,), generator=gen)
        rows += [code[s : s + n] for s in starts.tolist()]
        picks = torch.randint(0, len(chat_starts), (recipe.chat_rows,), generator=gen)
        for p in picks.tolist():
            s = min(int(chat_starts[p]), len(chat) - n)
            rows.append(chat[s : s + n])
        yield torch.stack(rows)


def token_stream(texts: list[str], tok: Any, eot: int, definitions_in: int = 0) -> tuple[Any, list[int], list[int]]:
    """``texts`` as one token stream, each ended by ``eot``; the positions where each text starts; and
    those of the top-level definitions of the first ``definitions_in`` texts (stage 2's row starts)."""
    import torch

    flat: list[int] = []
    starts: list[int] = []
    def_starts: list[int] = []
    for i, (text, enc) in enumerate(zip(texts, tok.encode_batch(texts), strict=True)):
        starts.append(len(flat))
        if i < definitions_in:
            token_starts = [a for a, _ in enc.offsets]
            for offset in top_level_offsets(text):
                j = bisect.bisect_left(token_starts, offset)
                if j < len(token_starts) and token_starts[j] == offset:
                    def_starts.append(len(flat) + j)
        flat += [*enc.ids, eot]
    return torch.tensor(flat, dtype=torch.long), starts, def_starts


def new_optimizer(model: Any, recipe: Recipe) -> Any:
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )


@dataclass
class StageResult:
    tokens_seen: int
    seconds: float
    loss_last50: float


def train_stage(
    model: Any, data: Iterator[Any], steps: int, lr: Callable[[int], float], recipe: Recipe, label: str
) -> StageResult:
    """``steps`` optimizer steps of next-token loss plus the router's balance loss, with progress."""
    import torch

    opt = new_optimizer(model, recipe)
    start = time.perf_counter()
    tokens_seen = 0
    recent: list[float] = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr(step)
        batch = next(data)
        out = model(input_ids=batch[:, :-1], output_router_logits=True)
        logits = out.logits.float()
        lm = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss = lm + recipe.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += batch[:, 1:].numel()
        recent.append(float(lm.detach()))
        recent = recent[-50:]
        if step % 25 == 0 or step == steps - 1:
            el = time.perf_counter() - start
            print(
                f"{label} step {step + 1}/{steps} loss {float(lm.detach()):.3f} "
                f"(avg50 {sum(recent) / len(recent):.3f}) lr {lr(step):.2e} "
                f"{tokens_seen / el:,.0f} tokens/s elapsed {el:.0f} s",
                flush=True,
            )
    return StageResult(tokens_seen, time.perf_counter() - start, sum(recent) / max(1, len(recent)))


def load_stage1(directory: Path, seed: int, recipe: Recipe, tokenizer_json: str, model: Any) -> dict[str, Any]:
    """Stage 1's weights from an earlier run's output, after checking it is this recipe's stage 1."""
    import torch
    from tokenizers import Tokenizer

    try:
        report = json.loads((directory / "training_report.json").read_text())
        saved = type(model).from_pretrained(str(directory), dtype=torch.float32)  # bf16 widens exactly
        saved_tok = Tokenizer.from_file(str(directory / "tokenizer.json")).to_str()
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--stage1 {directory}: cannot read its model, tokenizer or report ({exc})") from None
    if report.get("polish", {}).get("steps", 0):
        raise SystemExit(
            f"--stage1 {directory}: it holds a polished model (stage 2 ran {report['polish']['steps']} steps); "
            "give it the output of a run with --polish-steps 0"
        )
    report = report.get("stage1", report)
    want = {f: asdict(recipe)[f] for f in STAGE1_FIELDS}
    got = {f: report.get("recipe", {}).get(f) for f in STAGE1_FIELDS}
    if report.get("seed") != seed or got != want:
        diff = {f: (got[f], want[f]) for f in STAGE1_FIELDS if got[f] != want[f]}
        raise SystemExit(
            f"--stage1 {directory}: not stage 1 of this run (seed {report.get('seed')} vs {seed}, "
            f"recipe fields found vs expected: {diff})"
        )
    if saved_tok != tokenizer_json:
        raise SystemExit(f"--stage1 {directory}: its tokenizer.json differs from the one this run trained")
    model.load_state_dict(saved.state_dict())
    keep = ("seed", "steps", "tokens_seen", "train_seconds", "wall_seconds", "torch_threads", "train_loss_last50")
    return {
        **{k: report[k] for k in keep if k in report},
        "heldout_loss": report.get("heldout_loss"),
        "heldout_perplexity": report.get("heldout_perplexity"),
        "recipe": got,
    }


def round_to_bf16(model: Any) -> None:
    """Round the parameters to what ships (bf16), kept in fp32. Not ``model.to(bfloat16)``: that
    rounds the rotary frequencies too, a buffer that is not saved and that a loaded model computes exact."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def heldout_loss(model: Any, tokens: Any, recipe: Recipe) -> tuple[float, int]:
    """Mean next-token loss over non-overlapping seq_len windows of the held-out token stream."""
    import torch

    n = recipe.seq_len
    windows = min(recipe.eval_windows, (len(tokens) - 1) // n)
    total, count = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for i in range(0, windows, 8):
            chunk = torch.stack([tokens[j * n : (j + 1) * n + 1] for j in range(i, min(windows, i + 8))])
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
            total += float(nll)
            count += chunk[:, 1:].numel()
    model.train()
    return total / max(1, count), count


# ---------------------------------------------------------------- output


def heldout_text(modules: list[Module]) -> str:
    """Whole held-out modules in name order, then lines of the next one, up to 64 KB."""
    out: list[str] = []
    size = 0
    for m in modules:
        for line in m.text.splitlines(keepends=True):
            b = len(line.encode())
            if size + b > HELDOUT_TXT_BYTES:
                return "".join(out)
            out.append(line)
            size += b
    return "".join(out)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("examples:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=0, help="seeds initialisation, data order and batches (default 0)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2; the bits depend on it)")
    p.add_argument("--polish-steps", type=int, default=None, help="stage 2 steps (default: the recipe's)")
    p.add_argument(
        "--stage1",
        type=Path,
        default=None,
        metavar="DIR",
        help="take stage 1's weights from DIR (an earlier run of this recipe and seed) and run stage 2 only",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model, few files, few steps: a check, not a model")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    recipe = SMOKE if args.smoke else Recipe()
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit(f"--steps must be >= 1, got {args.steps}")
        recipe = Recipe(**{**asdict(recipe), "steps": args.steps})
    if args.polish_steps is not None:
        if args.polish_steps < 0:
            raise SystemExit(f"--polish-steps must be >= 0, got {args.polish_steps}")
        recipe = Recipe(**{**asdict(recipe), "polish_steps": args.polish_steps})
    t0 = time.perf_counter()

    modules = stdlib_modules(recipe.max_files)
    train = [m for m in modules if not is_heldout(m.name)]
    held = [m for m in modules if is_heldout(m.name)]
    if args.smoke and not held:  # a dozen files may contain no held-out module: use the last one
        held, train = train[-1:], train[:-1]
    rng = random.Random(args.seed)
    convs = [c for m in train for c in chat_examples(m)]
    rng.shuffle(convs)
    chat_texts = [render_chat(c) for c in convs]
    order = list(train)
    rng.shuffle(order)
    tests = stdlib_tests() if recipe.stdlib_tests else []
    rng.shuffle(tests)
    print(
        f"data: {len(train)} training modules ({sum(len(m.text) for m in train) / 1e6:.1f} MB), "
        f"{len(tests)} test modules ({sum(len(m.text) for m in tests) / 1e6:.1f} MB, code stream only), "
        f"{len(held)} held out, {len(chat_texts)} chat examples",
        flush=True,
    )

    tok = train_tokenizer([m.text for m in order] + chat_texts, recipe.vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eot = ids["<|endoftext|>"]

    code, _, def_starts = token_stream([m.text for m in order + tests], tok, eot, definitions_in=len(order))
    chat, chat_starts, _ = token_stream(chat_texts, tok, eot)
    held_tokens, _, _ = token_stream([m.text for m in held], tok, eot)
    print(
        f"tokens: code {len(code):,} ({len(def_starts):,} top-level definitions), chat {len(chat):,}, "
        f"held-out {len(held_tokens):,} (vocab {tok.get_vocab_size()}, {time.perf_counter() - t0:.1f} s)",
        flush=True,
    )

    torch.manual_seed(args.seed)
    model = build_model(recipe, ids)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.2f} M parameters, {recipe.steps} + {recipe.polish_steps} steps of "
        f"{recipe.batch_size}x{recipe.seq_len}",
        flush=True,
    )
    if args.stage1 is not None:
        stage1 = load_stage1(args.stage1, args.seed, recipe, tok.to_str(), model)
        print(f"stage 1: weights of {args.stage1} (held-out perplexity {stage1['heldout_perplexity']})", flush=True)
    else:
        gen = torch.Generator().manual_seed(args.seed)
        first = train_stage(
            model,
            batches(code, chat, chat_starts, recipe, gen),
            recipe.steps,
            lambda i: warmup_cosine(i, recipe.lr, recipe.warmup, recipe.steps),
            recipe,
            "stage 1",
        )
        # Stage 2 starts from what stage 1 would ship, so a run from --stage1 continues bit for bit.
        round_to_bf16(model)
        held_loss, held_count = heldout_loss(model, held_tokens, recipe)
        stage1 = {
            "seed": args.seed,
            "steps": recipe.steps,
            "tokens_seen": first.tokens_seen,
            "train_seconds": round(first.seconds, 1),
            "wall_seconds": round(time.perf_counter() - t0, 1),
            "torch_threads": args.threads,
            "train_loss_last50": round(first.loss_last50, 4),
            "heldout_loss": round(held_loss, 4),
            "heldout_perplexity": round(math.exp(held_loss), 3),
            "recipe": {f: asdict(recipe)[f] for f in STAGE1_FIELDS},
        }
        print(f"stage 1 held-out: loss {held_loss:.4f}, perplexity {math.exp(held_loss):.2f}", flush=True)
    model.train()
    gen = torch.Generator().manual_seed(args.seed + 1_000_003)  # independent of stage 1's draws
    second = train_stage(
        model,
        batches(code, chat, chat_starts, recipe, gen, def_starts, recipe.polish_def_rows),
        recipe.polish_steps,
        lambda i: warmup_cosine(i, recipe.polish_lr, recipe.polish_warmup, recipe.polish_steps),  # fresh optimizer
        recipe,
        "stage 2",
    )
    tokens_seen = stage1["tokens_seen"] + second.tokens_seen
    train_seconds = stage1["train_seconds"] + second.seconds

    # Evaluate what ships: the bf16-rounded weights, computed in fp32.
    round_to_bf16(model)
    held_loss, held_count = heldout_loss(model, held_tokens, recipe)
    print(f"held-out: loss {held_loss:.4f}, perplexity {math.exp(held_loss):.2f} over {held_count:,} tokens")
    report = {
        "seed": args.seed,
        "smoke": args.smoke,
        "steps": recipe.steps,
        "tokens_seen": tokens_seen,
        "train_seconds": round(train_seconds, 1),
        # This run's wall time; with --stage1 it ran stage 2 only (stage 1's own is in "stage1").
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "stage1_from": str(args.stage1) if args.stage1 is not None else None,
        "torch_threads": args.threads,
        "parameters": params,
        "train_loss_last50": round(second.loss_last50 if recipe.polish_steps else stage1["train_loss_last50"], 4),
        "heldout_loss": round(held_loss, 4),
        "heldout_perplexity": round(math.exp(held_loss), 3),
        "heldout_tokens": held_count,
        "recipe": asdict(recipe),
        "stage1": stage1,
        "polish": {
            "steps": recipe.polish_steps,
            "tokens_seen": second.tokens_seen,
            "train_seconds": round(second.seconds, 1),
            "rows": f"{recipe.polish_def_rows} of {recipe.batch_size} start at a top-level def/class",
        },
        "data": {
            "source": f"Python {sys.version.split()[0]} standard library sources (sysconfig stdlib path)",
            "skipped": f"directories {sorted(SKIP_DIRS)}, config-*, _sysconfigdata*, files > {MAX_FILE_BYTES} bytes"
            + (f" (the test directories {list(TEST_DIRS)} feed the code stream only)" if recipe.stdlib_tests else ""),
            "heldout_rule": f"sha256(module name) % {HELDOUT_BUCKETS} == 0",
            "train_modules": len(train),
            "test_modules_code_only": len(tests),
            "heldout_modules": [m.name for m in held],
            "chat_examples": len(chat_texts),
            "chat_recipe": "What does `mod.name` do? -> docstring's first paragraph; "
            "Write a Python function named `name` [that does this: summary] -> its source",
            "tokens": {"code": len(code), "chat": len(chat), "heldout": len(held_tokens)},
            "top_level_definitions": len(def_starts),
        },
    }

    from transformers import GenerationConfig

    from hetmoe.checkpoint.atomic import atomic_dir

    # Built beside the output and swapped in whole: an interrupted run never leaves half a model.
    with atomic_dir(args.out) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        GenerationConfig(
            eos_token_id=[ids["<|im_end|>"], eot], pad_token_id=eot, max_new_tokens=128, **SAMPLING_DEFAULTS
        ).save_pretrained(tmp)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
        (tmp / "heldout.txt").write_text(heldout_text(held))
        (tmp / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)  # package data: readable by all whatever the umask
    sizes = {f.name: f.stat().st_size for f in sorted(args.out.iterdir())}
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))
    print(f"total {sum(sizes.values()) / 1e6:.2f} MB, wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
