"""The /render and /derender routes (--enable-scale-out). Render: a chat, completion,
Messages or Responses request rendered, not run. The answer is the generate request (generate_input.py)
that POST /inference/v1/generate runs as the route itself would have: the prompt as
token ids after the chat template, and the engine parameters after every check and
default, output constraints (forced tool calls included) and where they start.

Nothing is submitted, so no engine is asked; the API server's checks and limits are
the routes' own. What a token-only request cannot carry is refused: beam search,
completions' echo (the prompt text) and a max_tokens of 0.

Derender: a generate response in tokens mode (with the request it was rendered from,
and the prompt's ids) becomes the chat or completion response that route answers,
through the route's own view: the text decoded as the route decodes it (stop strings
cut, EOS dropped), reasoning and tool calls parsed, logprobs named. Only whole
responses: vLLM's chunk-by-chunk derendering with client-carried state is refused.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.chat_tools import chat_tools, output_parser, reasoning_end_ids
from frontend.derender_input import (
    DerenderChatRequest,
    DerenderCompletionRequest,
    check_bounds,
    check_original,
    finished_generation,
    logprob_entries,
)
from frontend.errors import APIError
from frontend.generate_input import generate_request
from frontend.openai_models import ChatCompletionRequest, CompletionRequest
from frontend.request_inputs import (
    RequestInputs,
    json_body,
    parse_body,
    read_inputs,
    validation_error,
)
from frontend.responses import json_response
from frontend.serving import ServingContext
from frontend.serving_anthropic import messages_chat
from frontend.serving_chat import ChatView, encode_plain, plan_chat
from frontend.serving_completions import CompletionView, num_prompts, plan_completion
from frontend.serving_responses import responses_chat

M = TypeVar("M", bound=BaseModel)


def _renderable(body) -> None:
    if body.use_beam_search:
        raise APIError(
            "use_beam_search: beam search is not supported by the render endpoints",
            param="use_beam_search",
        )


async def _render_chat(
    ctx: ServingContext, inputs: RequestInputs, request_id: str, max_tokens_field: str | None
) -> dict:
    _renderable(inputs.body)
    plan = await plan_chat(ctx, inputs, max_tokens_field)
    ended = kwargs = None
    if plan.parser is not None and plan.parser.reasoning is not None:
        # True: constrain from the first token (the output starts past any reasoning).
        ended = reasoning_end_ids(ctx.chat_parsers, plan.parser, encode_plain(ctx)) is None
        kwargs = {"chat_template_kwargs": inputs.body.chat_template_kwargs or {}}
    return generate_request(
        inputs.body,
        request_id,
        inputs.model,
        inputs.priority,
        plan.prompt_ids,
        plan.params,
        reasoning_ended=ended,
        reasoning_parser_kwargs=kwargs,
    )


async def render_chat_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ChatCompletionRequest)
    return JSONResponse(await _render_chat(ctx, inputs, f"chatcmpl-{inputs.request_id}", None))


async def render_messages(ctx: ServingContext, request: Request) -> Response:
    inputs, chat = await messages_chat(ctx, request)
    inputs = dataclasses.replace(inputs, body=chat)
    return JSONResponse(
        await _render_chat(ctx, inputs, f"chatcmpl-{inputs.request_id}", "max_tokens")
    )


async def render_responses(ctx: ServingContext, request: Request) -> Response:
    inputs, chat = await responses_chat(ctx, request)
    inputs = dataclasses.replace(inputs, body=chat)
    return JSONResponse(
        await _render_chat(ctx, inputs, f"resp_{inputs.request_id}", "max_output_tokens")
    )


async def render_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, CompletionRequest, num_prompts)
    body = inputs.body
    _renderable(body)
    if body.echo:
        raise APIError(
            "echo: a rendered request carries token ids only; send echo to /v1/completions",
            param="echo",
        )
    if body.max_tokens == 0:
        raise APIError(
            "max_tokens: 0 generates nothing; a rendered request needs at least 1",
            param="max_tokens",
        )
    prompts, params = await plan_completion(ctx, body)
    base = f"cmpl-{inputs.request_id}"
    return JSONResponse(
        [
            generate_request(
                body,
                base if len(prompts) == 1 else f"{base}-{i}",
                inputs.model,
                inputs.priority,
                prompt,
                prompt_params,
            )
            for i, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True))
        ]
    )


# --- derender ----------------------------------------------------------------------------


async def _derender_body(ctx: ServingContext, request: Request, model: type[M]) -> M:
    data = await json_body(ctx, request)
    if data.get("stream") is True:
        raise APIError(
            "stream: derendering one generate chunk per call (with client-carried state) "
            "is not supported; derender the whole generate response",
            param="stream",
        )
    return await parse_body(ctx, request, model)


def _original(
    ctx: ServingContext, model: type[M], data: dict | None, field: str, default: dict
) -> M:
    """The request a render came from, checked as its route checks it."""
    try:
        original = model.model_validate(data if data is not None else default)
        check_original(original, ctx.limits)
    except ValidationError as e:
        error = validation_error(e)
        param = (error.param or "").removeprefix("body.")
        raise APIError(f"{field}.{error.message}", param=f"{field}.{param}".rstrip(".")) from None
    except APIError as e:
        raise APIError(f"{field}.{e.message}", param=f"{field}.{e.param}") from None
    return original


def _check(ctx: ServingContext, responses, prompt_ids, prompt_tokens) -> None:
    check_bounds(
        responses,
        prompt_ids,
        prompt_tokens,
        ctx.limits,
        ctx.vocab_size,
        ctx.max_model_len,
        ctx.config.max_logprobs,
    )


def _prompt_tokens(given: int | None, ids: list[int] | None, response) -> int:
    """The prompt's length: as given, else the ids' count, else the generate usage's."""
    if given is not None:
        return given
    if ids is not None:
        return len(ids)
    return (response.usage.prompt_tokens or 0) if response.usage else 0


async def derender_chat_completion(ctx: ServingContext, request: Request) -> Response:
    body = await _derender_body(ctx, request, DerenderChatRequest)
    served, _ = await ctx.resolve_target(body.model)
    response = body.generate_response
    _check(ctx, [response], [body.prompt_token_ids], [body.prompt_tokens])
    parsers = ctx.chat_parsers
    if body.chat_request is None and (
        parsers.reasoning_parser is not None or parsers.tool_parser is not None
    ):
        raise APIError(
            "chat_request: required on a server with a tool or reasoning parser (plain "
            "decoding would leave their markup in the content)",
            param="chat_request",
        )
    chat = _original(ctx, ChatCompletionRequest, body.chat_request, "chat_request", _NO_CHAT)
    if body.chat_request is None:
        _show_logprobs_given(chat, response)
    tools = chat_tools(parsers, chat)
    prompt_ids = body.prompt_token_ids or response.prompt_token_ids
    prompt = ctx.renderer.decode(prompt_ids, skip_special_tokens=False) if prompt_ids else ""
    parser = output_parser(parsers, chat, tools, prompt)  # may keep special tokens
    gen = await finished_generation(
        [response],
        [prompt_ids],
        _prompt_tokens(body.prompt_tokens, prompt_ids, response),
        chat,
        ctx.renderer.raw,
        chat.skip_special_tokens,
        ctx.eos_token_ids,
    )
    view = ChatView(
        ctx, chat, gen, response.request_id, served, [chat.messages], parser, tools.choice
    )
    result = view.response()
    result["prompt_logprobs"] = response.prompt_logprobs
    return json_response(result)


_NO_CHAT = {"messages": [{"role": "user", "content": ""}]}


def _show_logprobs_given(chat: ChatCompletionRequest, response) -> None:
    """Without the original request: logprobs as many as the response holds."""
    entries = logprob_entries([response])
    if entries:
        chat.logprobs = True
        chat.top_logprobs = len(entries[0].top_logprobs)


async def derender_completion(ctx: ServingContext, request: Request) -> Response:
    body = await _derender_body(ctx, request, DerenderCompletionRequest)
    served, _ = await ctx.resolve_target(body.model)
    responses = body.generate_responses
    prompt_ids = body.prompt_token_ids or [None] * len(responses)
    counts = body.prompt_tokens or [None] * len(responses)
    _check(ctx, responses, prompt_ids, counts)
    original = _original(
        ctx, CompletionRequest, body.completion_request, "completion_request", {"prompt": [1]}
    )
    if body.completion_request is None:
        entries = logprob_entries(responses)
        original.logprobs = max(len(entries[0].top_logprobs) - 1, 0) if entries else None
    prompt_tokens = sum(
        _prompt_tokens(count, ids if ids is not None else r.prompt_token_ids, r)
        for count, ids, r in zip(counts, prompt_ids, responses, strict=True)
    )
    gen = await finished_generation(
        responses,
        prompt_ids,
        prompt_tokens,
        original,
        ctx.renderer.raw,
        original.skip_special_tokens,
        ctx.eos_token_ids,
    )
    view = CompletionView(ctx, original, gen, responses[0].request_id, served, False, None)
    return json_response(view.response())
