"""Writes tiny_chat.jsonl and tiny_chat_eval.jsonl: short Q&A about Python standard-library
functions, answered from their own docstrings and signatures (offline material; run with any
CPython 3.11 to regenerate; the committed files are the data the tests and examples use).

Every function gives two conversations ("what does X do?" -> the docstring's first sentence,
"how do I call X?" -> its signature); a fixed-seed shuffle puts one in six functions in the
held-out split, so evaluation asks about functions the training never saw.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from pathlib import Path

MODULES = (
    "math",
    "os.path",
    "string",
    "json",
    "textwrap",
    "shutil",
    "random",
    "statistics",
    "functools",
    "itertools",
    "operator",
    "glob",
    "fnmatch",
    "base64",
    "binascii",
    "zlib",
    "heapq",
    "bisect",
    "calendar",
    "colorsys",
    "keyword",
    "html",
    "difflib",
    "secrets",
)
SYSTEM = "You answer questions about the Python standard library in one sentence."
MAX_ANSWER = 140


def first_sentence(doc: str) -> str | None:
    text = " ".join(doc.strip().split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    s = (m.group(1) if m else text).strip()
    if not s or len(s) > MAX_ANSWER or not s.isascii() or "(" in s[:1]:
        return None
    return s


def conversations() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            if getattr(obj, "__module__", mod_name) not in (mod_name, mod.__name__, None) and mod_name != "os.path":
                continue
            answer = first_sentence(inspect.getdoc(obj) or "")
            if answer is None:
                continue
            qual = f"{mod_name}.{name}"
            convs = [
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What does {qual} do?"},
                    {"role": "assistant", "content": answer},
                ]
            ]
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = ""
            if sig and len(sig) <= MAX_ANSWER and sig.isascii():
                convs.append(
                    [
                        {"role": "user", "content": f"How do I call {qual}?"},
                        {"role": "assistant", "content": f"{qual}{sig}"},
                    ]
                )
            out[qual] = [{"messages": c} for c in convs]
    return out


def main() -> None:
    here = Path(__file__).resolve().parent
    convs = conversations()
    names = sorted(convs)
    random.Random(0).shuffle(names)
    held = set(names[: len(names) // 6])
    for fname, pick in (("tiny_chat.jsonl", lambda n: n not in held), ("tiny_chat_eval.jsonl", lambda n: n in held)):
        lines = [json.dumps(c) for n in sorted(convs) if pick(n) for c in convs[n]]
        (here / fname).write_text("\n".join(lines) + "\n")
        print(f"{fname}: {len(lines)} conversations")


if __name__ == "__main__":
    main()
