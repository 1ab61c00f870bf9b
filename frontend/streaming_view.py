"""How one generation becomes OpenAI chunks or a response: the part completions and
chat share, and the hooks each endpoint fills in."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from frontend import sse
from frontend.generation import Choice, ChoiceDelta, Generation
from frontend.logprobs import prompt_logprobs
from frontend.openai_models import SamplingFields, StreamOptions
from frontend.sampling import logprob_count
from frontend.usage import running_usage

if TYPE_CHECKING:
    from frontend.config import FrontendConfig
    from frontend.serving import ServingContext


class GenerationView(ABC):
    """What respond() (responses.py) needs of an endpoint: its stream's events, its
    whole response, and how its stream ends and reports an error."""

    done: bytes = sse.DONE  # the stream's last event, after every other

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
    def events(self) -> AsyncIterator[bytes]:
        """The stream's SSE bytes, batch by batch."""

    @abstractmethod
    def response(self) -> dict:
        """The whole non-streaming response, once the generation is done."""

    def error_event(self, error: dict) -> bytes:
        """An error after the HTTP 200 (`error`: the error body)."""
        return sse.event(error)

    def prompt_logprobs(self, choice: Choice) -> list | None:
        """A choice's prompt_logprobs in vLLM's shape; None when not asked for."""
        count = self.body.prompt_logprobs
        if count is None:
            return None
        return prompt_logprobs(
            self.ctx.renderer,
            choice.prompt_ids,
            choice.prompt_logprobs,
            logprob_count(count, self.ctx.vocab_size),
        )

    async def delta_bytes(
        self, render: Callable[[ChoiceDelta], list[bytes]]
    ) -> AsyncIterator[bytes]:
        """Hot path: each batch of the generation's deltas as the events `render` makes
        of them, joined (one write); a keep-alive comment while nothing comes."""
        config = self.ctx.config
        async for batch in self.gen.deltas(
            config.sse_keep_alive_interval or None, config.stream_interval
        ):
            if not batch:
                yield sse.KEEP_ALIVE
                continue
            out = [event for d in batch for event in render(d)]
            if out:
                yield b"".join(out)


class StreamingView(GenerationView):
    """The chunk SSE loop of completions and chat, and the three things each must say."""

    @abstractmethod
    def stream_choices(self, delta: ChoiceDelta) -> list[dict]:
        """The chunk choices one delta makes (none when it carries nothing to show)."""

    @abstractmethod
    def chunk(self, choices: list[dict], usage: dict | None) -> dict:
        """One SSE chunk around these choices."""

    @abstractmethod
    def usage(self, stream: bool = False) -> dict:
        """The whole request's usage (`stream`: for a stream's usage chunk)."""

    def stream_chunk(self, d: ChoiceDelta, choice: dict, continuous: bool) -> dict:
        """The chunk of one choice; `continuous`: with that choice's running usage."""
        if not continuous:
            return self.chunk([choice], None)
        prompt_tokens = len(self.gen.choices[d.index].prompt_ids)
        return self.chunk([choice], running_usage(prompt_tokens, d.num_generated))

    fingerprinted = True  # the last chunk names the server (vLLM's system_fingerprint)

    async def events(self) -> AsyncIterator[bytes]:
        """Hot path: one chunk per token (per --stream-interval tokens)."""
        include_usage, continuous = stream_usage(self.body.stream_options, self.ctx.config)
        fingerprint = self.ctx.config.system_fingerprint if self.fingerprinted else None
        # As vLLM: on each choice's finishing chunk, or on the usage chunk when one ends it.
        on_finish = None if include_usage else fingerprint

        def render(d: ChoiceDelta) -> list[bytes]:
            chunks = [self.stream_chunk(d, c, continuous) for c in self.stream_choices(d)]
            if on_finish is not None and d.finish_reason and chunks:
                chunks[-1]["system_fingerprint"] = on_finish
            return [sse.event(chunk) for chunk in chunks]

        async for chunk in self.delta_bytes(render):
            yield chunk
        if include_usage:
            chunk = self.chunk([], self.usage(stream=True))
            if fingerprint is not None:
                chunk["system_fingerprint"] = fingerprint
            yield sse.event(chunk)


def stream_usage(opts: StreamOptions | None, config: FrontendConfig) -> tuple[bool, bool]:
    """(a usage chunk ends the stream, every chunk carries its choice's running usage):
    vLLM's rule, where --enable-force-include-usage means both."""
    if config.force_include_usage:
        return True, True
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts and opts.continuous_usage_stats)
