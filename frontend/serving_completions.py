"""POST /v1/completions: inputs → prompts → sampling parameters → submit → respond."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.beam_search import beam_params, check_beam_search, no_step_search
from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.logprobs import CompletionLogprobs
from frontend.openai_models import CompletionRequest, Prompt
from frontend.request_inputs import read_inputs
from frontend.responses import respond
from frontend.sampling import (
    check_token_ids,
    context_length_error,
    sampling_params,
    shown_logprobs,
    truncation,
)
from frontend.serving import ServingContext
from frontend.streaming_view import StreamingView
from frontend.structured_outputs import request_constraint
from frontend.usage import usage
from protocol.messages import SamplingParams

if TYPE_CHECKING:
    from frontend.pooling_input import PoolingInputs


async def tokenize_prompts(ctx: ServingContext, body: CompletionRequest) -> list[list[int]]:
    """The prompts as token ids, each cut to truncate_prompt_tokens (truncation_side)."""
    prompt = body.prompt
    if prompt is None or prompt == "" or prompt == []:
        raise APIError(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    return await prompt_token_ids(ctx, prompt, body, "prompt")


async def prompt_token_ids(
    ctx: ServingContext,
    prompt: Prompt,
    body: CompletionRequest | PoolingInputs,
    field: str,
    room: int = 1,
) -> list[list[int]]:
    """Prompts given as texts or token ids, as token ids: each cut to the body's
    truncate_prompt_tokens (truncation_side), else refused unless it leaves `room`
    tokens of the context (0: an input to pool)."""
    cut = truncation(body, ctx.max_model_len)
    add_special = body.add_special_tokens is not False
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else prompt
        for text in texts:
            ctx.check_text_length(text, field, truncating=cut is not None)
        return [await ctx.encode(text, add_special, cut, room) for text in texts]
    prompts = [list(prompt)] if isinstance(prompt[0], int) else [list(p) for p in prompt]
    for p in prompts:
        if not p:
            raise APIError(f"{field}: a token-id prompt may not be empty", param=field)
        check_token_ids(p, ctx.vocab_size, field)
    prompts = [cut.apply(p) for p in prompts] if cut else prompts
    for p in prompts:
        if len(p) > ctx.max_model_len - room:
            raise context_length_error(len(p), ctx.max_model_len, room)
    return prompts


def num_prompts(body: CompletionRequest) -> int:
    """How many prompts the request holds (at most --max-prompts-per-request)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def prompt_texts(body: CompletionRequest) -> list[str | None]:
    """The prompts as the client wrote them, for echo (None: token ids, decoded then)."""
    if isinstance(body.prompt, str):
        return [body.prompt]
    return [p if isinstance(p, str) else None for p in body.prompt]


async def plan_completion(
    ctx: ServingContext, body: CompletionRequest
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The request's prompts as token ids, and each one's engine parameters, its output
    constraint and beam search included (the render route too)."""
    constraint = request_constraint(body, ctx.config.structured_outputs)
    prompts = await tokenize_prompts(ctx, body)
    params = sampling_params(
        ctx,
        body,
        prompts,
        max_tokens=max(body.max_tokens, 1),
        logprobs=body.logprobs,
        echo_logprobs=body.logprobs if body.echo else None,
    )
    if body.use_beam_search:
        params = beam_params(ctx, body, params, prompts)
    if constraint is not None:
        params = [msgspec.structs.replace(p, structured_outputs=constraint) for p in params]
    return prompts, params


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, CompletionRequest, num_prompts)
    body = inputs.body
    if body.use_beam_search:
        check_beam_search(body, completions=True)
        inputs = no_step_search(inputs)
        body = inputs.body
    # vLLM's echo with max_tokens 0: just the prompt. The engine still samples one
    # token (it computes the prompt logprobs on the way); the view drops it.
    echo_only = body.max_tokens == 0
    prompts, params = await plan_completion(ctx, body)
    generation = ctx.submit(inputs, prompts, params)
    generation.keep_logprobs = not body.stream and body.logprobs is not None
    # Echo shows a text prompt as written, unless it was cut to its last tokens.
    texts = prompt_texts(body) if body.truncate_prompt_tokens is None else None
    view = CompletionView(
        ctx, body, generation, f"cmpl-{inputs.request_id}", inputs.model, echo_only, texts
    )
    return await respond(ctx, request, view)


class CompletionView(StreamingView):
    """Shapes one completion generation into OpenAI chunks or a response."""

    body: CompletionRequest

    def __init__(
        self,
        ctx: ServingContext,
        body: CompletionRequest,
        gen: Generation,
        id_: str,
        model: str,
        echo_only: bool,
        prompt_texts: list[str | None] | None,
    ) -> None:
        super().__init__(ctx, body, gen, id_, model)
        self.echo_only = echo_only
        self.prompt_texts = prompt_texts  # per prompt; None: decode the prompt ids
        self.started: set[int] = set()  # choices whose prompt prefix was handled
        self.shown: set[int] = set()  # choices with a chunk sent
        # Token ids of text still held back (a partial character, a possible stop).
        self.pending_ids: list[list[int]] = [[] for _ in gen.choices]
        self.logprobs = None
        if body.logprobs is not None:
            top_n = shown_logprobs(body.logprobs, body.logprob_token_ids, ctx.vocab_size)
            as_ids = ctx.tokens_as_ids(body)
            self.logprobs = [
                CompletionLogprobs(ctx.renderer, top_n, as_ids=as_ids) for _ in gen.choices
            ]

    def _prefix(self, index: int) -> str:
        """Echo: the prompt text (and its logprob entries) before a choice's own text."""
        if not self.body.echo:
            return ""
        choice = self.gen.choices[index]
        text = self.prompt_texts[choice.prompt_index] if self.prompt_texts else None
        if text is None:
            text = self.ctx.renderer.decode(choice.prompt_ids, skip_special_tokens=False)
        if self.logprobs is not None:
            rec = self.logprobs[index]
            rec.add_prompt(choice.prompt_ids, choice.prompt_logprobs)
            rec.offset = len(text)
        return text

    def usage(self, stream: bool = False) -> dict:
        return usage(
            self.gen,
            self.ctx.config.enable_prompt_tokens_details,
            count_generated=not self.echo_only,
            stream=stream,
        )

    def chunk(self, choices: list[dict], usage: dict | None) -> dict:
        chunk = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:  # a stream's chunk without usage has no such key (vLLM)
            chunk["usage"] = usage
        return chunk

    def stream_choices(self, d: ChoiceDelta) -> list[dict]:
        """One delta as a chunk's choice: one event per token, as vLLM streams, even
        when its text is still held back (a partial character, a possible stop
        string); nothing only when the delta carries nothing at all."""
        first = d.index not in self.started
        self.started.add(d.index)
        text = self._prefix(d.index) if first else ""
        pending_ids = self.pending_ids[d.index]
        if not self.echo_only:
            text += d.text
            pending_ids.extend(d.token_ids)
            if self.logprobs is not None and d.logprobs is not None:
                self.logprobs[d.index].add(d.logprobs)
        if not text and not d.finish_reason and not pending_ids:
            return []
        choice = {
            "index": d.index,
            "text": text,
            "logprobs": self.logprobs[d.index].take() if self.logprobs is not None else None,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
            "prompt_token_ids": None,  # every key in every chunk, as vLLM's chunks
            "token_ids": None,
        }
        if self.body.return_token_ids:
            if d.index not in self.shown:
                choice["prompt_token_ids"] = self.gen.choices[d.index].prompt_ids
            choice["token_ids"] = pending_ids[:]
        self.shown.add(d.index)
        pending_ids.clear()
        return [choice]

    def response(self) -> dict:
        body = self.body
        choices = []
        for c in self.gen.choices:
            text = self._prefix(c.index)
            if not self.echo_only:
                text += c.detok.text
            lp = None
            if self.logprobs is not None:
                rec = self.logprobs[c.index]
                if not self.echo_only:
                    for rows in c.logprob_rows:
                        rec.add(rows)
                lp = rec.take()
            choices.append(
                {
                    "index": c.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": self.prompt_logprobs(c),
                    "prompt_token_ids": c.prompt_ids if body.return_token_ids else None,
                    "token_ids": (
                        ([] if self.echo_only else c.token_ids) if body.return_token_ids else None
                    ),
                }
            )
        result = self.chunk(choices, self.usage())
        result["system_fingerprint"] = self.ctx.config.system_fingerprint
        return result
