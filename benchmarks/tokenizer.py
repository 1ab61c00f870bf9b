"""The server's tokenizer, as the load generator needs it: exact token counts, no torch.

Loaded from a local `tokenizer.json` with the `tokenizers` library, the same file the
server tokenizes with, so a prompt built here has the length the server will count.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers


class BenchTokenizer:
    """Encode/decode without special tokens, plus the facts prompt building needs."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, name: str) -> None:
        self._tok = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        # The tokens the server adds around a prompt (a BOS, usually) count towards its length.
        self.num_special_tokens_to_add = len(tokenizer.encode("", add_special_tokens=True).ids)

    @classmethod
    def load(cls, path: str | Path) -> BenchTokenizer:
        """From a model folder holding tokenizer.json, or the tokenizer.json file itself."""
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json at {p}: pass --tokenizer with a local model folder "
                "(the benchmark never downloads one)"
            )
        return cls(tokenizers.Tokenizer.from_file(str(file)), str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def allowed_ids(self) -> list[int]:
        """Ids a random prompt may use: every token that is not special."""
        return [i for i in range(self.vocab_size) if i not in self.special_ids]
