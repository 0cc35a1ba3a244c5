"""Chat-format JSONL for fine-tuning: one ``{"messages": [{"role": ..., "content": ...}, ...]}`` a line.

Each conversation is rendered with the tokenizer's own chat template and tokenized once; the loss
covers the assistant turns only (their content and the template's end-of-turn marker), every other
token is labelled -100. An assistant turn's span is found in characters -- the text up to the turn
with the generation prompt, and the text including the turn, must both be prefixes of the whole
conversation's text (true of ChatML and similar templates; a template that rewrites earlier turns
is refused) -- and mapped to tokens through the fast tokenizer's offsets.

Every problem is a ValueError naming the file and line: invalid JSON, a missing or malformed
``messages`` list, an unknown role, a conversation without an assistant turn, an empty file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROLES = ("system", "user", "assistant", "tool")
IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def target_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)

    @property
    def predicted_tokens(self) -> int:
        """Targets the causal LM loss counts: the labels after the first (a model predicts token i+1 at i)."""
        return sum(1 for t in self.labels[1:] if t != IGNORE)


def read_chat_jsonl(path: str | Path) -> list[list[dict[str, str]]]:
    """The conversations of ``path``, validated line by line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such data file")
    out: list[list[dict[str, str]]] = []
    with p.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            where = f"{p}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not UTF-8 text (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise ValueError(f"{where}: JSON nested too deeply to be a conversation") from None
            out.append(_messages(record, where))
    if not out:
        raise ValueError(f"{p}: no conversations (expected one JSON object a line)")
    return out


def _messages(record: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(record, dict) or "messages" not in record:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f'{where}: expected an object with a "messages" list, found {found}')
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages": expected a non-empty list, found {type(messages).__name__}')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'{where}: messages[{i}]: expected {{"role": str, "content": str}}, found {m!r:.80}')
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: messages[{i}].role: expected one of {list(ROLES)}, found {m['role']!r}")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise ValueError(f"{where}: no assistant turn with content (nothing to learn from this conversation)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], max_length: int, where: str = "") -> Example:
    """Token ids and assistant-only labels of one conversation (truncated to ``max_length``)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: the tokenizer has no chat template (expected one in tokenizer_config.json)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{where}: a fast tokenizer (tokenizer.json) is needed for the assistant-token offsets")
    full = _render(tokenizer, messages, False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(
                f"{where}: the chat template renders turn {i} differently once later turns follow (it is not "
                "prefix-stable), so assistant tokens cannot be located"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = [
        tok if any(s <= start < e for s, e in spans) else IGNORE for tok, (start, _) in zip(ids, offsets, strict=True)
    ]
    ids, labels = ids[:max_length], labels[:max_length]
    return Example(ids, labels)


def load_chat_dataset(path: str | Path, tokenizer: Any, max_length: int = 512) -> list[Example]:
    examples = []
    for n, messages in enumerate(read_chat_jsonl(path), 1):
        ex = encode_chat(tokenizer, messages, max_length, f"{path}: conversation {n}")
        if ex.target_tokens:
            examples.append(ex)
    if not examples:
        raise ValueError(f"{path}: no assistant tokens within the first {max_length} tokens of any conversation")
    return examples


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
