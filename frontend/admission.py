"""Admission control for the whole server, not per API process.

Each API server owns one slot of a small shared file (created by the supervisor):
the requests it has in flight and the prompt tokens of those still waiting for
their first token. A check sums every slot, so `--max-num-queued-reqs` and
`--max-num-queued-tokens` hold across processes. Slots are written without locks by
their one owner and read by everyone: the sum is approximate by at most the
requests admitted at the same instant elsewhere, as in vLLM's shared admission.
"""

from __future__ import annotations

import mmap
import os

from frontend.errors import APIError

SLOT = 16  # two int64: in-flight requests, queued prompt tokens


class Admission:
    def __init__(
        self,
        path: str | None,
        index: int,
        count: int,
        max_reqs: int | None,
        max_tokens: int | None,
    ) -> None:
        self.index = index
        self.count = count
        self.max_reqs = max_reqs
        self.max_tokens = max_tokens
        if path is None:
            self._buf = memoryview(bytearray(SLOT * count))
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, SLOT * count)
            finally:
                os.close(fd)
            self._buf = memoryview(self._mmap)
        self._slots = self._buf.cast("q")
        self.requests = 0
        self.tokens = 0
        self._write()  # a restarted API server starts from zero

    @staticmethod
    def create_file(path: str, count: int) -> None:
        with open(path, "wb") as f:
            f.write(bytes(SLOT * count))

    def _write(self) -> None:
        self._slots[2 * self.index] = self.requests
        self._slots[2 * self.index + 1] = self.tokens

    def totals(self) -> tuple[int, int]:
        slots = self._slots
        reqs = sum(slots[2 * i] for i in range(self.count))
        tokens = sum(slots[2 * i + 1] for i in range(self.count))
        return reqs, tokens

    def admit(self, requests: int, tokens: int) -> None:
        """Reserve room for a request, or raise 503 with Retry-After."""
        if self.max_reqs is not None or self.max_tokens is not None:
            reqs, queued = self.totals()
            if self.max_reqs is not None and reqs + requests > self.max_reqs:
                raise AdmissionRejected(
                    f"the server is at its limit of {self.max_reqs} queued and running "
                    f"requests (--max-num-queued-reqs); retry later",
                    "max_num_queued_reqs",
                )
            if self.max_tokens is not None and queued + tokens > self.max_tokens:
                raise AdmissionRejected(
                    f"the server is at its limit of {self.max_tokens} prompt tokens waiting "
                    f"for prefill (--max-num-queued-tokens); retry later",
                    "max_num_queued_tokens",
                )
        self.requests += requests
        self.tokens += tokens
        self._write()

    def prefilled(self, tokens: int) -> None:
        self.tokens -= tokens
        self._write()

    def release(self, requests: int, tokens: int) -> None:
        self.requests -= requests
        self.tokens -= tokens
        self._write()


class AdmissionRejected(APIError):
    """A 503 of admission control, with Retry-After: the server is full, not broken
    (gRPC tells the two apart: RESOURCE_EXHAUSTED, not UNAVAILABLE); `reason` is the
    limit that refused (vLLM's metric label)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message, 503, headers={"Retry-After": "1"})
        self.reason = reason
