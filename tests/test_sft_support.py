"""Helpers shared by the tests/test_sft_*.py files (no tests here).

- ``runnable(tiny_cache, model_type)``: a tiny checkpoint transformers itself can run (DeepSeek-V3's
  tiny config gets head_dim = qk_rope_head_dim, as tests/test_hybrid.py does);
- ``chat_tokenizer(dir, texts)``: a tiny character-level BPE tokenizer with a ChatML chat template,
  built offline with the ``tokenizers`` library, whose vocabulary fits the tiny models' 128;
- ``chat_model(tiny_cache, dir)``: a tiny Qwen3-MoE checkpoint plus that tokenizer, ready for
  ``hetmoe sft train``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def runnable(tiny_cache, model_type: str) -> Path:  # tiny_cache: tiny_models.TinyCache
    src = tiny_cache.model(model_type)
    config = json.loads((src / "config.json").read_text())
    rope = config.get("qk_rope_head_dim")
    if rope is None or config.get("head_dim") == rope:
        return src
    dst = src.parent / f"{src.name}-runnable"
    if not dst.exists():
        tiny_cache.copy(src, dst)
        config["head_dim"] = rope
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def chat_tokenizer(directory: Path, texts: list[str], vocab_size: int = 128) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one character at a time: no spaces lost
    tok.decoder = decoders.Fuse()
    alphabet = sorted({c for t in texts for c in t})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet[: vocab_size - len(SPECIALS)]
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(directory))
    return directory


def chat_texts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out += [m["content"] for m in json.loads(line)["messages"]]
    return [*out, "system", "user", "assistant", "\n"]


def chat_model(tiny_cache, directory: Path, data: Path) -> Path:
    """A tiny Qwen3-MoE checkpoint directory with a chat tokenizer trained on ``data``'s text."""
    directory = Path(directory)
    if not directory.exists():
        shutil.copytree(tiny_cache.model("qwen3_moe"), directory)
        chat_tokenizer(directory, chat_texts(data))
        config = json.loads((directory / "config.json").read_text())
        assert config["vocab_size"] >= 128
    return directory
