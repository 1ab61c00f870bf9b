"""How one generation becomes OpenAI chunks or a response: the part completions and
chat share, and the hooks each endpoint fills in."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from frontend import sse
from frontend.generation import ChoiceDelta, Generation
from frontend.openai_models import SamplingFields

if TYPE_CHECKING:
    from frontend.serving import ServingContext


class StreamingView(ABC):
    """The SSE loop of a generation, and the four things an endpoint must say."""

    def __init__(
        self, ctx: ServingContext, body: SamplingFields, gen: Generation, id_: str, model: str
    ) -> None:
        self.ctx = ctx
        self.body = body
        self.gen = gen
        self.id = id_
        self.model = model
        self.created = int(time.time())

    @abstractmethod
    def stream_choices(self, delta: ChoiceDelta) -> list[dict]:
        """The chunk choices one delta makes (none when it carries nothing to show)."""

    @abstractmethod
    def chunk(self, choices: list[dict], usage: dict | None) -> dict:
        """One SSE chunk around these choices."""

    @abstractmethod
    def usage(self) -> dict:
        """The usage object so far."""

    @abstractmethod
    def response(self) -> dict:
        """The whole non-streaming response, once the generation is done."""

    async def events(self) -> AsyncIterator[bytes]:
        """Hot path: one chunk per token (per --stream-interval tokens)."""
        config = self.ctx.config
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage) or config.force_include_usage
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        async for batch in self.gen.deltas(
            config.sse_keep_alive_interval or None, config.stream_interval
        ):
            if not batch:
                yield sse.KEEP_ALIVE
                continue
            out = []
            for d in batch:
                for choice in self.stream_choices(d):
                    usage = self.usage() if continuous else None
                    out.append(sse.event(self.chunk([choice], usage)))
            if out:
                yield b"".join(out)
        if include_usage:
            yield sse.event(self.chunk([], self.usage()))
