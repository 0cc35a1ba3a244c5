"""From generated token ids to the text a client receives: incremental detokenization and stop strings.

``IncrementalDetokenizer`` turns one token at a time into text without ever emitting half of a
UTF-8 sequence: byte-level BPE tokens can end inside a multi-byte character, which decodes to
U+FFFD until the next token completes it, so text ending in U+FFFD is held back. It decodes a short
window (the tokens since the last emitted text plus a few before it, starting from the prompt's
last tokens so SentencePiece's leading spaces come out right) rather than the whole output, so each
token costs the same however long the answer grows (the method vLLM and TGI use).

``StopMatcher`` finds stop strings across token boundaries: it holds back the longest tail of the
text that could still become a stop string, so a client never sees part of one, and cuts the text
where the earliest stop string begins. ``OutputText`` chains the two for one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix = 0  # start of the decoding window
        self.read = len(self.ids)  # tokens up to here have been turned into emitted text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or it ends inside a character the next token may complete
        self.prefix, self.read = self.read, len(self.ids)
        return new_text[len(prefix_text) :]

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes (often empty)."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held (an incomplete character decodes as U+FFFD): the end of the output."""
        return self._advance(final=True)


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.pending = ""  # text held back: the longest tail that could begin a stop string

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text safe to emit, stopped)``; after a stop, the text beyond it is dropped."""
        if not self.stops:
            return text, False
        # Emitted text never ends with the start of a stop string, so a match can only begin in pending.
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = self._held_tail(buf)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class OutputText:
    """One request's generated text, token by token: ``push`` until stopped, then ``finish``."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_ids: Sequence[int] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.matcher = StopMatcher(stops)
        self.stopped = False

    def push(self, token_id: int) -> tuple[str, bool]:
        """``(new text for the client, a stop string was reached)``."""
        if self.stopped:
            raise RuntimeError("push after a stop string ended the output")
        text, self.stopped = self.matcher.feed(self.detok.push(token_id))
        return text, self.stopped

    def finish(self) -> tuple[str, bool]:
        """The held-back rest at the end of generation (the flushed tail may still reach a stop string)."""
        if self.stopped:
            return "", True
        text, self.stopped = self.matcher.feed(self.detok.flush())
        if not self.stopped:
            text += self.matcher.flush()
        return text, self.stopped
