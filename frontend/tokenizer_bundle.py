"""The tokenizer's files as one zip archive, for a gateway that tokenizes for us
(gRPC GetTokenizer): built once, off the event loop, then served from memory."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

# What a tokenizer needs, and the model files that say how it is used (special tokens,
# EOS ids, the chat template). Nothing else of the model's folder leaves the server.
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
)
CHUNK_BYTES = 64 * 1024


class TokenizerBundle:
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self._archive: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    async def archive(self) -> tuple[bytes, str]:
        """The zip's bytes and their SHA-256 (hex); raises OSError when no file is there."""
        async with self._lock:  # concurrent first callers share one build
            if self._archive is None:
                self._archive = await asyncio.to_thread(self._build)
        return self._archive

    def _build(self) -> tuple[bytes, str]:
        buf = io.BytesIO()
        found = 0
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in FILES:
                path = self.folder / name
                if path.is_file():
                    zf.write(path, name)
                    found += 1
        if not found:
            raise FileNotFoundError(f"no tokenizer file in {self.folder}")
        data = buf.getvalue()
        return data, hashlib.sha256(data).hexdigest()

    @staticmethod
    def chunks(data: bytes) -> Iterator[tuple[bytes, bool]]:
        """The archive in pieces a gRPC message carries easily, each with whether it
        is the last."""
        for start in range(0, len(data), CHUNK_BYTES):
            end = start + CHUNK_BYTES
            yield data[start:end], end >= len(data)
