"""One API call's generation: its engine requests (prompts × n) and their merged output.

The serving modules shape what this yields into OpenAI chunks or responses; this
module owns ids, ADD / ABORT, detokenization and stop strings.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from frontend.detokenizer import IncrementalDetokenizer
from frontend.engine_client import EngineClient
from frontend.engine_state import EngineState, RequestStream, Wakeup
from frontend.errors import APIError, asleep_error
from protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    PoolingParams,
    SamplingParams,
    engine_request_id,
    now,
)


class GenerationObserver(Protocol):
    """Who wants to know about a generation's progress (metrics, admission)."""

    def first_token(self, choice: Choice) -> None: ...

    def token_gap(self, seconds: float) -> None: ...


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained from one engine output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_generated: int = 0  # the choice's tokens so far, this delta's included


@dataclass(slots=True)
class Choice:
    """One engine request: one prompt, one sample."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    engine_request_id: str
    detok: IncrementalDetokenizer
    stream: RequestStream | None = None
    num_generated: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: Logprobs | None = None
    pooled: bytes | None = None  # a pooling request's vector (float32, little-endian)
    token_ids: list[int] = field(default_factory=list)
    logprob_rows: list[Logprobs] = field(default_factory=list)  # non-streaming only
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    queue_time_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Generation:
    """Choices of one request; `start()` sends every ADD, `deltas()` merges outputs."""

    def __init__(
        self,
        client: EngineClient,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        n: int,
        tokenizer,
        stop: list[str],
        include_stop: bool,
        skip_special_tokens: bool,
        priority: int = 0,
        engine_rank: int | None = None,
        observer: GenerationObserver | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.client = client
        self.observer = observer
        self.request_id = request_id
        self.priority = priority
        self.engine_rank = engine_rank
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.pooling = pooling  # each prompt pooled into a vector (nothing generated)
        self.event = Wakeup()
        self.arrival_time = now()
        self.keep_logprobs = False  # non-streaming responses collect every logprob row
        self.detokenize = True  # False: token ids only (no text, no stop strings)
        self.trace_headers: dict[str, str] | None = None  # the caller's trace context
        self.done = False  # set once the serving context has recorded it
        self.params_n = n
        self.engine: EngineState | None = None
        self.choices: list[Choice] = []
        for p, (prompt_ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            for s in range(n):
                sample_params = prompt_params
                if prompt_params.seed is not None and s:
                    sample_params = _with_seed(prompt_params, prompt_params.seed + s)
                self.choices.append(
                    Choice(
                        index=p * n + s,
                        prompt_index=p,
                        prompt_ids=prompt_ids,
                        params=sample_params,
                        engine_request_id=engine_request_id(request_id, p, s),
                        detok=IncrementalDetokenizer(
                            tokenizer,
                            prompt_ids,
                            skip_special_tokens=skip_special_tokens,
                            stop=stop,
                            include_stop=include_stop,
                        ),
                    )
                )
        self.prompts = prompts

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_generated(self) -> int:
        return sum(c.num_generated for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        return sum(c.num_cached_tokens for c in self.choices)

    @property
    def finished(self) -> bool:
        """Hot path (once per chunk streamed): the choices' own fields in a plain loop,
        not all() over a generator of their properties."""
        for c in self.choices:
            if c.finish_reason is None:
                return False
        return True

    def start(self) -> None:
        client = self.client
        engine = client.pick_engine(self.engine_rank, prefer_lora=self.lora_name)
        self.engine = engine
        group = client.new_group() if len(self.choices) > 1 else 0
        try:
            for choice in self.choices:
                request = self.engine_request(
                    choice.engine_request_id, choice.prompt_ids, choice.params, group
                )
                choice.stream = client.add_request(request, engine, self.event)
        except Exception:
            self.abort()
            raise

    def engine_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, group: int
    ) -> EngineCoreRequest:
        """One engine request of this generation, with what all of them share."""
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=self.arrival_time,
            priority=self.priority,
            data_parallel_rank=self.engine_rank,
            group=group,
            lora_name=self.lora_name,
            cache_salt=self.cache_salt,
            pooling=self.pooling,
        )

    def abort(self) -> None:
        """Free every unfinished choice in the engine (idempotent)."""
        ids = [c.engine_request_id for c in self.choices if c.stream and not c.stream.finished]
        if ids:
            self.client.abort(ids)

    def cancel(self) -> None:
        """End every unfinished choice as aborted (a client's Abort): free them in the
        engine, and let whoever streams this generation see them finish."""
        self.abort()
        for choice in self.choices:
            if choice.stream is not None and not choice.finished:
                choice.stream.put(
                    EngineCoreOutput(choice.engine_request_id, [], FinishReason.ABORT)
                )

    async def deltas(self, keep_alive_s: float | None = None, stream_interval: int = 1):
        """Yield lists of ChoiceDelta as outputs arrive, one delta per engine output;
        an empty list means `keep_alive_s` passed without output. Raises APIError on
        an engine error."""
        pending = self._open()
        while pending:
            batch: list[ChoiceDelta] = []
            for unit in pending:
                stream = unit.stream
                if stream.error is not None and not stream.items:
                    if isinstance(stream.error, APIError):
                        raise stream.error
                    raise APIError(str(stream.error), 500)
                if stream.items:
                    self._collect(unit, batch)
            if batch:
                pending = self._open()
                yield merge_deltas(batch, stream_interval) if stream_interval > 1 else batch
                continue
            self.event.clear()
            if keep_alive_s:
                try:
                    await asyncio.wait_for(self.event.wait(), keep_alive_s)
                except asyncio.TimeoutError:  # not the builtin one before Python 3.11
                    yield []
            else:
                await self.event.wait()

    def _open(self) -> list:
        """What deltas() waits on: the unfinished choices (BeamGeneration: searches)."""
        return [c for c in self.choices if c.finish_reason is None]

    def _collect(self, choice: Choice, batch: list[ChoiceDelta]) -> None:
        """Hot path: a choice's waiting outputs as deltas onto `batch`, none past its
        finish (BeamGeneration: a search's answer, all its choices at once)."""
        stream = choice.stream
        items, stream.items = stream.items, []
        for out in items:
            batch.append(self._apply(choice, out))
            if choice.finish_reason is not None:  # choice.finished, without its call
                break

    async def drain(self) -> None:
        """Run to the end without streaming (a non-streaming response)."""
        async for _ in self.deltas():
            pass

    def _apply(self, choice: Choice, out) -> ChoiceDelta:
        """Hot path: one engine output of one choice → its delta. (An enum member costs
        a lookup each time it is named: only a request's last output names any.)"""
        reason = out.finish_reason
        if reason is not None:
            self._raise_failure(out)
        ids = out.new_token_ids
        if ids or out.pooled is not None:  # a pooled vector: its request's only output
            t = now()
            if not choice.num_generated:
                choice.first_token_time = t
                choice.num_cached_tokens = out.num_cached_tokens
                choice.queue_time_s = out.queue_time_s
                if self.observer is not None:
                    self.observer.first_token(choice)
            elif self.observer is not None:
                self.observer.token_gap(t - choice.last_token_time)
            choice.last_token_time = t
        choice.num_generated += len(ids)
        choice.token_ids.extend(ids)
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if out.pooled is not None:
            choice.pooled = out.pooled
        if self.keep_logprobs and out.new_logprobs is not None:
            choice.logprob_rows.append(out.new_logprobs)
        stop_string = None
        if self.detokenize:
            text_ids = ids
            if (
                reason is not None
                and reason is FinishReason.STOP
                and ids
                and not choice.detok.include_stop
            ):
                text_ids = ids[:-1]  # as in vLLM: a stop token (EOS, stop_token_ids) is no text
            stop_string = choice.detok.add(text_ids)
        finish_reason = stop_reason = None
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
            if not out.finished:
                self.client.abort([choice.engine_request_id])
        elif reason is not None:
            finish_reason, stop_reason = reason.openai_name, out.stop_reason
        choice.finish_reason = finish_reason
        choice.stop_reason = stop_reason
        return ChoiceDelta(
            index=choice.index,
            text=choice.detok.take(final=finish_reason is not None),
            token_ids=ids,
            logprobs=out.new_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_generated=choice.num_generated,
        )

    def _raise_failure(self, out) -> None:
        """An engine output that ends its request in failure, as the API's error."""
        reason = out.finish_reason
        if reason is FinishReason.REFUSED:
            self.abort()
            gone = f"The model `{self.lora_name}` does not exist."
            if self.lora_name is not None and out.error == gone:  # unloaded meanwhile
                raise APIError(gone, 404, param="model")
            message = out.error or "the engine refused this request"
            raise APIError(message, param=refused_field(message))
        if reason is FinishReason.UNAVAILABLE:  # asleep, or put to sleep
            self.abort()
            raise asleep_error(out.error or "the engine is asleep")
        if reason is FinishReason.ERROR:
            self.abort()
            raise APIError(
                f"the engine failed request {self.request_id}: {out.error or 'unknown error'}",
                500,
            )


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def refused_field(message: str) -> str | None:
    """The request field an engine refusal names first ("structured_outputs.regex: ..."),
    for the 400's `param`."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def merge_deltas(batch: list[ChoiceDelta], max_tokens: int) -> list[ChoiceDelta]:
    """--stream-interval N: consecutive deltas of one choice that arrived together go
    out as one, up to N tokens each."""
    merged: list[ChoiceDelta] = []
    last: dict[int, ChoiceDelta] = {}
    for d in batch:
        prev = last.get(d.index)
        if (
            prev is not None
            and prev.finish_reason is None
            and (len(prev.token_ids) + len(d.token_ids) <= max_tokens)
        ):
            prev.text += d.text
            prev.token_ids = prev.token_ids + d.token_ids
            prev.finish_reason, prev.stop_reason = d.finish_reason, d.stop_reason
            prev.num_generated = d.num_generated
            if d.logprobs is not None:
                prev.logprobs = (
                    d.logprobs
                    if prev.logprobs is None
                    else Logprobs(
                        prev.logprobs.token_ids + d.logprobs.token_ids,
                        prev.logprobs.logprobs + d.logprobs.logprobs,
                        prev.logprobs.ranks + d.logprobs.ranks,
                    )
                )
            continue
        last[d.index] = d
        merged.append(d)
    return merged


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(params, seed=seed)
