"""What a method costs in model quality: perplexity and KL divergence to the bf16 model, on real text.

The text is tokenized once (no special tokens added) and cut into non-overlapping windows of
``context`` tokens; every window is scored on its own, each position predicting the next token of
the window, so a window of n tokens gives n - 1 predictions (a last, shorter window is kept when it
has at least two tokens). For each method the model is loaded with ``load_model(path, method=m)``
(experts converted to m while loading) and run over the same windows as the reference (the bf16
model); per position we accumulate the method's negative log-likelihood of the true next token,
KL(reference || method) of the two next-token distributions, and whether their top-1 tokens agree.

The reference is kept loaded and run again beside each method rather than caching its
distributions: caching costs windows x context x vocab floats (gigabytes for a 150k vocabulary),
running it again costs one more forward per window. Only two models are in memory at a time.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.atomic import write_atomic, write_text_atomic
from ..formats.registry import UnknownMethodError, get_codec
from ..formats.registry import methods as known_methods
from ..models.loader import load_model

REFERENCE_METHOD = "bf16"
DEFAULT_METHODS = ("bf16", "fp8", "int8", "int4")


@dataclass
class MethodQuality:
    """One method's row: perplexity, its ratio to the reference's, mean KL and top-1 agreement."""

    method: str
    perplexity: float | None = None
    mean_nll: float | None = None
    kl_mean: float | None = None  # nats per predicted token, KL(reference || method)
    top1_agreement: float | None = None  # fraction of positions whose argmax matches the reference
    ppl_ratio: float | None = None  # perplexity / reference perplexity
    expert_mib: float | None = None  # routed experts' bytes in CPU memory
    seconds: float | None = None  # this method's forward passes (not the reference's, not loading)
    error: str | None = None  # why the method could not run on this model


@dataclass
class QualityReport:
    model: str
    text: str
    context: int
    windows: int
    predictions: int
    reference: str = REFERENCE_METHOD
    dtype: str = ""
    rows: list[MethodQuality] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "rows"}, "rows": [asdict(r) for r in self.rows]}


def text_windows(token_ids: list[int], context: int) -> list[torch.Tensor]:
    """Non-overlapping windows of ``context`` tokens; a last partial window if it has >= 2 tokens."""
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens, got {context}")
    windows = [
        torch.tensor(token_ids[i : i + context], dtype=torch.long)
        for i in range(0, len(token_ids), context)
        if len(token_ids[i : i + context]) >= 2
    ]
    if not windows:
        raise ValueError(f"text: expected at least 2 tokens to score, found {len(token_ids)}")
    return windows


def _batches(windows: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Equal-length windows stacked ``batch_size`` at a time; a shorter last window alone."""
    full = [w for w in windows if len(w) == len(windows[0])]
    for i in range(0, len(full), batch_size):
        yield torch.stack(full[i : i + batch_size])
    for w in windows[len(full) :]:
        yield w.unsqueeze(0)


def _log_probs(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities in fp32 for positions 0..n-2 of each window."""
    with torch.inference_mode():
        logits = model(input_ids=batch).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def _kl_sum(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Summed KL(ref || got) over positions, in float64: near-identical distributions (int8 against
    bf16) differ by ~1e-6 nats, below what fp32 sums over a vocabulary resolve. Chunked so the
    float64 copies stay near 32 MiB whatever the vocabulary."""
    ref, got = ref.flatten(0, -2), got.flatten(0, -2)
    rows = max(1, 2**22 // ref.shape[-1])
    total = 0.0
    for i in range(0, ref.shape[0], rows):
        a, b = ref[i : i + rows].double(), got[i : i + rows].double()
        total += float((a.exp() * (a - b)).sum())
    return total


def _group_size_for(method: str, group_size: int | None) -> int | None:
    """``group_size`` for methods that have one (int4, int4-asym, gptq); None for the rest (bf16, int8,
    fp8, mxfp4's fixed 32, GGUF's fixed blocks), so one option serves a mixed list of methods."""
    if group_size is None:
        return None
    try:
        get_codec(method, group_size=group_size)
    except UnknownMethodError:  # no such parameter (or no such method: load_model then says so)
        return None
    return group_size


def _expert_mib(model: Any) -> float | None:
    runtime = getattr(model, "hetmoe", None)
    total = getattr(runtime, "cpu_expert_bytes", None) if runtime is not None else None
    return round(total / 2**20, 3) if isinstance(total, int) else None


def evaluate_methods(
    model_path: str | Path,
    text: str,
    methods: tuple[str, ...] | list[str] = DEFAULT_METHODS,
    context: int = 256,
    *,
    batch_size: int = 8,
    max_windows: int | None = None,
    dtype: str | None = None,
    cpu_threads: int | None = None,
    group_size: int | None = None,
    tokenizer: Any = None,
    text_name: str = "",
    progress: Callable[[str], None] | None = None,
) -> QualityReport:
    """Perplexity and KL to the bf16 reference for each method (see the module docstring).

    A method that cannot run on this model (e.g. a GGUF K-quant whose 256-wide blocks do not divide
    the experts' input size) gets a row with ``error`` set instead of stopping the evaluation.
    """
    methods = list(methods)
    if not methods:
        raise ValueError("methods: expected at least one method, found none")
    known = set(known_methods())
    unknown = [m for m in methods if m not in known]
    if unknown:  # a typo should stop before minutes of evaluation, not end as a row
        raise ValueError(f"methods: unknown {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if tokenizer is None:
        from ..models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_path, "evaluation")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    windows = text_windows(list(ids), context)
    if max_windows is not None:
        if max_windows < 1:
            raise ValueError(f"max_windows must be >= 1, got {max_windows}")
        windows = windows[:max_windows]
    options = {"device": "cpu", "dtype": dtype, "cpu_threads": cpu_threads}
    reference = load_model(model_path, method=REFERENCE_METHOD, **options)
    report = QualityReport(
        model=str(model_path),
        text=text_name,
        context=context,
        windows=len(windows),
        predictions=sum(len(w) - 1 for w in windows),
        dtype=str(reference.dtype).replace("torch.", ""),
    )
    for method in methods:
        row = MethodQuality(method)
        try:
            model = load_model(model_path, method=method, group_size=_group_size_for(method, group_size), **options)
        except ValueError as exc:  # FormatError / CheckpointError: this method does not fit this model
            row.error = str(exc).splitlines()[0]
            report.rows.append(row)
            if progress:
                progress(f"{method}: unavailable ({row.error})")
            continue
        nll = kl = agree = 0.0
        seconds = 0.0
        for batch in _batches(windows, batch_size):
            ref = _log_probs(reference, batch)
            start = time.perf_counter()
            got = _log_probs(model, batch)
            seconds += time.perf_counter() - start
            target = batch[:, 1:]
            nll -= float(got.gather(-1, target.unsqueeze(-1)).sum())
            kl += _kl_sum(ref, got)
            agree += float((ref.argmax(-1) == got.argmax(-1)).sum())
        n = report.predictions
        row.mean_nll = nll / n
        row.perplexity = math.exp(row.mean_nll)
        row.kl_mean = kl / n
        row.top1_agreement = agree / n
        row.expert_mib = _expert_mib(model)
        row.seconds = round(seconds, 3)
        report.rows.append(row)
        del model
        if progress:
            progress(f"{method}: perplexity {row.perplexity:.4f}, KL {row.kl_mean:.3g}")
    ref_row = next((r for r in report.rows if r.method == REFERENCE_METHOD and r.perplexity), None)
    for row in report.rows:
        if ref_row is not None and row.perplexity is not None and ref_row.perplexity:
            row.ppl_ratio = row.perplexity / ref_row.perplexity
    return report


def format_table(report: QualityReport) -> str:
    """A fixed-width table: one row per method."""
    head = f"{'method':<12} {'perplexity':>11} {'vs bf16':>8} {'KL (nats)':>10} {'top-1 agree':>11} {'experts MiB':>11}"
    lines = [
        f"{report.model}: {report.windows} windows of <= {report.context} tokens, "
        f"{report.predictions} predictions, reference {report.reference} ({report.dtype})",
        head,
        "-" * len(head),
    ]
    for r in report.rows:
        if r.error is not None:
            lines.append(f"{r.method:<12} unavailable: {r.error}")
            continue
        ratio = f"{100 * (r.ppl_ratio - 1):+.2f}%" if r.ppl_ratio is not None else "-"
        mib = f"{r.expert_mib:.2f}" if r.expert_mib is not None else "-"
        lines.append(
            f"{r.method:<12} {r.perplexity:>11.4f} {ratio:>8} {r.kl_mean:>10.2e} {100 * r.top1_agreement:>10.2f}% "
            f"{mib:>11}"
        )
    return "\n".join(lines)


def write_json(report: QualityReport, path: str | Path) -> None:
    write_text_atomic(path, json.dumps(report.to_dict(), indent=2) + "\n")


def plot_quality(report: QualityReport, path: str | Path) -> None:
    """Perplexity (bars) and KL to the reference (line, log scale) per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    rows = [r for r in report.rows if r.error is None]
    if not rows:
        raise ValueError("plot: no method produced a result")
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 2), 4))
    names = [r.method for r in rows]
    ax.bar(names, [r.perplexity for r in rows], color="#4c72b0")
    ax.set_ylabel("perplexity")
    low = min(r.perplexity for r in rows)
    ax.set_ylim(low * 0.97, max(r.perplexity for r in rows) * 1.01)
    ax.set_title(f"{Path(report.model).name}: {report.predictions} held-out predictions")
    kl_rows = [(r.method, r.kl_mean) for r in rows if r.kl_mean and r.kl_mean > 0]
    if kl_rows:
        ax2 = ax.twinx()
        ax2.plot([n for n, _ in kl_rows], [k for _, k in kl_rows], "o", color="#dd8452")
        ax2.set_yscale("log")
        ax2.set_ylabel("KL to bf16 (nats/token)")
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
