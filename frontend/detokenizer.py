"""Incremental detokenization with stop strings, one instance per generated sequence.

UTF-8 characters split across tokens are held until complete (tokenizers'
DecodeStream). Stop strings are searched in the new text plus the tail that could
still start one; while streaming, text that might be the start of a stop string is
held back until it is known not to be.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 4


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "stream", "text", "emitted", "stop", "include_stop", "hold")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # Priming with the prompt's tail gets leading spaces right for tokenizers that
        # decode a word-initial token differently at the start of a text; skip it
        # when that tail ends inside a character.
        prime = prompt_ids[-_PRIME_TOKENS:]
        if prime and tokenizer.decode(prime, skip_special_tokens=False).endswith("\ufffd"):
            prime = []
        self.stream = DecodeStream(ids=prime or None, skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.emitted = 0
        self.stop = stop or []
        self.include_stop = include_stop
        # Characters that might begin a stop string are held back while streaming.
        self.hold = 0 if include_stop or not self.stop else max(len(s) for s in self.stop) - 1

    def add(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string they completed, if any (text is
        then truncated at it)."""
        # Appended through a local that holds the only reference, so CPython grows the
        # string in place instead of copying the whole text for each token (quadratic
        # over a long output).
        text, self.text = self.text, ""
        before = len(text)
        step = self.stream.step
        try:
            for token_id in token_ids:
                piece = step(self.tokenizer, token_id)
                if piece:
                    text += piece
        finally:
            self.text = text
        if not self.stop or len(self.text) == before:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def take(self, final: bool) -> str:
        """The text not handed out yet; while not final, minus what might begin a stop."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk
