"""vLLM's derender requests (--enable-scale-out): a generate response in tokens mode,
with the request it came from, turned back into the chat or completion response that
route would have answered. Here: the bodies, their limits, and the finished
generation a generate response stands for, which the chat and completion views then
shape as they shape their own.

Every list a client sends is bounded before anything is decoded: at most
--max-sequences-per-request choices (and --max-prompts-per-request responses), token
ids within the vocabulary and at most max_model_len of them, at most --max-logprobs
top entries (and one more, the chosen token's).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from frontend.detokenizer import IncrementalDetokenizer
from frontend.errors import APIError
from frontend.generation import Choice
from frontend.limits import RequestLimits, check_prompt_count, check_stop_strings
from frontend.openai_models import INT64_MAX, SamplingFields, _Model
from frontend.sampling import check_token_ids
from protocol.messages import Logprobs, SamplingParams

DECODE_SLICE = 4096  # tokens decoded between two yields to the event loop


class TopLogprob(_Model):
    token_id: int
    logprob: float
    rank: int | None = None


class LogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Model):
    content: list[LogprobEntry] | None = None


# A stop token id, echoed in the response: a 64-bit integer at most.
StopTokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class GeneratedChoice(_Model):
    index: int = Field(ge=0)
    finish_reason: str | None = "stop"
    stop_reason: StopTokenId | str | None = None
    token_ids: list[int] = Field(min_length=1)
    logprobs: ChoiceLogprobs | None = None


class GeneratedUsage(_Model):
    prompt_tokens: int | None = None  # the one count derender reads (check_bounds)


class GenerateResponse(_Model):
    """What /inference/v1/generate answered, in tokens mode."""

    request_id: str
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GeneratedChoice] = Field(min_length=1)  # a generate answers one at least
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Any] | None = None
    usage: GeneratedUsage | None = None


class DerenderChatRequest(_Model):
    stream: Literal[False] = False
    model: str | None = None
    generate_response: GenerateResponse
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: dict[str, Any] | None = None


class DerenderCompletionRequest(_Model):
    stream: Literal[False] = False
    model: str | None = None
    generate_responses: list[GenerateResponse] = Field(min_length=1)
    prompt_tokens: list[int | None] | None = None
    prompt_token_ids: list[list[int] | None] | None = None
    completion_request: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _parallel(self):
        n = len(self.generate_responses)
        for name in ("prompt_tokens", "prompt_token_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"{name}: {len(value)} entries for {n} generate_responses; give one each"
                )
        return self


@dataclass
class FinishedGeneration:
    """A generation that ran elsewhere: its choices, as the views read them."""

    prompts: list[list[int]]
    choices: list[Choice]
    prompt_tokens: int
    num_cached_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens

    @property
    def num_generated(self) -> int:
        return sum(c.num_generated for c in self.choices)


def check_bounds(
    responses: list[GenerateResponse],
    prompt_ids: list[list[int] | None],
    prompt_tokens: list[int | None],
    limits: RequestLimits,
    vocab_size: int,
    max_model_len: int,
    max_logprobs: int,
) -> None:
    """Every list of the responses within the server's limits, before any decoding."""
    check_prompt_count(len(responses), limits, "generate_responses")
    choices = sum(len(r.choices) for r in responses)
    if choices > limits.max_sequences:
        raise APIError(
            f"generate_responses hold {choices} choices; at most {limits.max_sequences} "
            f"are allowed (--max-sequences-per-request)",
            param="choices",
        )
    counts = [*prompt_tokens, *(r.usage.prompt_tokens for r in responses if r.usage)]
    for count in counts:
        if count is not None and not 0 <= count <= max_model_len:
            raise APIError(
                f"prompt_tokens: {count} is not a prompt's length on this server (0 to "
                f"max_model_len, {max_model_len})",
                param="prompt_tokens",
            )
    top_limit = vocab_size if max_logprobs == -1 else max_logprobs + 1
    for ids in [*prompt_ids, *(c.token_ids for r in responses for c in r.choices)]:
        if ids is not None and len(ids) > max_model_len:
            raise APIError(
                f"token_ids: {len(ids)} ids; at most max_model_len ({max_model_len})",
                param="token_ids",
            )
        if ids is not None:
            check_token_ids(ids, vocab_size, "token_ids")
    for r in responses:
        for c in r.choices:
            entries = (c.logprobs.content or []) if c.logprobs is not None else []
            if len(entries) > len(c.token_ids):
                raise APIError(
                    f"logprobs.content: {len(entries)} entries for {len(c.token_ids)} tokens",
                    param="logprobs",
                )
            for entry in entries:
                if len(entry.top_logprobs) > top_limit:
                    raise APIError(
                        f"top_logprobs: {len(entry.top_logprobs)} entries; at most "
                        f"{top_limit} (--max-logprobs {max_logprobs}, and the chosen token)",
                        param="top_logprobs",
                    )
                check_token_ids(
                    [e.token_id for e in entry.top_logprobs], vocab_size, "top_logprobs"
                )


def check_original(body: SamplingFields, limits: RequestLimits) -> None:
    """The original request's own limits that derendering meets: its stop strings,
    which every choice's text is matched against."""
    check_stop_strings(body.stop_strings, limits)


async def finished_generation(
    responses: list[GenerateResponse],
    prompt_ids: list[list[int] | None],
    prompt_tokens: int,
    body: SamplingFields,
    tokenizer,
    skip_special_tokens: bool,
    eos_token_ids: list[int],
) -> FinishedGeneration:
    """The choices of these responses (one per prompt) as a finished generation whose
    text is decoded as the route decodes it: EOS and stop tokens are no text, and a
    stop string ends the text unless include_stop_str_in_output. Decoding yields to
    the event loop every DECODE_SLICE tokens: a maximal body (a million tokens, about
    a second of decoding) must not hold up the API server's other requests."""
    choices: list[Choice] = []
    decoded = 0
    for p, (response, ids) in enumerate(zip(responses, prompt_ids, strict=True)):
        seed = ids if ids is not None else response.prompt_token_ids or []
        for generated in response.choices:
            choice = Choice(
                index=len(choices),
                prompt_index=p,
                prompt_ids=seed,
                params=SamplingParams(),
                engine_request_id=response.request_id,
                detok=IncrementalDetokenizer(
                    tokenizer,
                    seed,
                    skip_special_tokens=skip_special_tokens,
                    stop=body.stop_strings if isinstance(generated.stop_reason, str) else [],
                    include_stop=body.include_stop_str_in_output,
                ),
            )
            _fill(choice, generated, eos_token_ids)
            choices.append(choice)
            decoded += len(generated.token_ids)
            if decoded >= DECODE_SLICE:
                decoded = 0
                await asyncio.sleep(0)
    prompts = [
        ids or r.prompt_token_ids or [] for r, ids in zip(responses, prompt_ids, strict=True)
    ]
    return FinishedGeneration(prompts, choices, prompt_tokens)


def logprob_entries(responses: list[GenerateResponse]) -> list[LogprobEntry]:
    """Every logprob entry of the responses' choices, in order."""
    return [e for r in responses for c in r.choices if c.logprobs for e in c.logprobs.content or []]


def _fill(choice: Choice, generated: GeneratedChoice, eos_token_ids: list[int]) -> None:
    ids = generated.token_ids
    text_ids = ids
    stop = generated.stop_reason
    stopped_by = {*eos_token_ids, stop} if isinstance(stop, int) else set(eos_token_ids)
    ended_by_token = generated.finish_reason == "stop" and ids[-1] in stopped_by
    if ended_by_token and not choice.detok.include_stop:
        text_ids = ids[:-1]  # EOS or a stop token id: no text, as the route decodes it
    choice.detok.add(text_ids)
    choice.detok.take(final=True)
    choice.token_ids = list(ids)
    choice.num_generated = len(ids)
    choice.finish_reason = generated.finish_reason or "stop"
    choice.stop_reason = generated.stop_reason
    entries = (generated.logprobs.content or []) if generated.logprobs is not None else []
    if entries:
        rows = [[e.token_id, *(t.token_id for t in e.top_logprobs)] for e in entries]
        lps = [[e.logprob, *(t.logprob for t in e.top_logprobs)] for e in entries]
        choice.logprob_rows = [Logprobs(rows, lps, [e.rank or 0 for e in entries])]
