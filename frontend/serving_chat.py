"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import Response

from frontend import sse
from frontend.errors import APIError
from frontend.generation import Generation
from frontend.logprobs import chat_logprobs, prompt_logprobs
from frontend.openai_models import ChatCompletionRequest, ChatMessage
from frontend.sampling import build_sampling_params, check_prompt_length
from frontend.serving import ServingContext, json_response
from frontend.usage import usage


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template sees them; text parts are joined, other parts
    are refused (this server generates text from text)."""
    result = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text":
                    raise APIError(
                        f"messages[{i}].content: parts of type {part.type!r} are not "
                        f"supported; this model takes text parts only",
                        param=f"messages.{i}.content",
                    )
                texts.append(part.text or "")
            d["content"] = "\n".join(texts)
        elif m.content is None:
            d["content"] = ""
        result.append(d)
    return result


async def render_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    template = body.chat_template
    kwargs = dict(body.chat_template_kwargs or {})
    if "chat_template" in kwargs:
        template = kwargs.pop("chat_template")
    if template is not None and not ctx.config.trust_request_chat_template:
        raise APIError(
            "chat_template: request-supplied chat templates are refused; start the server "
            "with --trust-request-chat-template to allow them",
            param="chat_template",
        )
    try:
        text = await ctx.render_chat(
            messages=message_dicts(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=template,
            template_kwargs=kwargs,
        )
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise APIError(f"messages: the chat template failed: {e}", param="messages") from None
    return await ctx.encode(text, body.add_special_tokens)


def check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise APIError("tools: tool calling is not supported by this server yet", param="tools")
    if body.tool_choice not in (None, "none"):
        raise APIError(
            "tool_choice: tool calling is not supported by this server yet",
            param="tool_choice",
        )
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(
            f"response_format: type {body.response_format.type!r} is not supported yet "
            f"(structured output); only 'text' is",
            param="response_format",
        )


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    body = await ctx.parse(request, ChatCompletionRequest)
    model = ctx.resolve_model(body.model)
    check_unsupported(body)
    request_id = ctx.request_id(request, body.request_id)
    prompt_ids = await render_prompt(ctx, body)
    max_tokens = body.effective_max_tokens
    if max_tokens is None:
        max_tokens = max(1, ctx.max_model_len - len(prompt_ids))
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=top_n,
        defaults=ctx.defaults,
        vocab_size=ctx.renderer.vocab_size,
        max_logprobs=ctx.config.max_logprobs,
    )
    check_prompt_length(len(prompt_ids), max_tokens, ctx.max_model_len)
    generation = Generation(
        ctx.client,
        request_id,
        [prompt_ids],
        params,
        n=body.n,
        tokenizer=ctx.renderer.raw,
        stop=body.stop_strings,
        include_stop=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        priority=ctx.priority(request, body.priority),
        engine_rank=ctx.engine_rank(request),
    )
    generation.keep_logprobs = not body.stream and body.logprobs
    ctx.start(generation, body.n)
    headers = ctx.response_headers(generation, request_id)
    view = _ChatView(ctx, body, generation, f"chatcmpl-{request_id}", model)
    if body.stream:
        return ctx.stream(request, generation, view.events(), headers)
    await ctx.complete(request, generation)
    return json_response(view.response(), headers)


class _ChatView:
    def __init__(
        self, ctx: ServingContext, body: ChatCompletionRequest, gen: Generation, id_, model
    ):
        self.ctx = ctx
        self.body = body
        self.gen = gen
        self.id = id_
        self.model = model
        self.created = int(time.time())
        last = body.messages[-1]
        self.role = "assistant" if body.add_generation_prompt else last.role
        self.echo = ""
        if body.echo and last.role == self.role:
            self.echo = message_dicts([last])[0]["content"]
        self.started: set[int] = set()

    def _usage(self) -> dict:
        return usage(self.gen, self.ctx.config.enable_prompt_tokens_details)

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_ is not None:
            chunk["usage"] = usage_
        return chunk

    async def events(self):
        body = self.body
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        keep_alive = self.ctx.config.sse_keep_alive_interval or None
        top_n = body.top_logprobs or 0
        async for batch in self.gen.deltas(keep_alive, self.ctx.config.stream_interval):
            if not batch:
                yield sse.KEEP_ALIVE
                continue
            out = []
            for d in batch:
                text = d.text
                if d.index not in self.started:
                    if not text and not d.finish_reason:
                        continue
                    # The role chunk goes out with the first token, never before it.
                    self.started.add(d.index)
                    role = {
                        "index": d.index,
                        "delta": {"role": self.role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    out.append(
                        sse.event(self._chunk([role], self._usage() if continuous else None))
                    )
                    text = self.echo + text
                elif not text and not d.finish_reason:
                    continue
                choice = {
                    "index": d.index,
                    "delta": {"content": text} if text else {},
                    "logprobs": {"content": chat_logprobs(self.ctx.renderer, d.logprobs, top_n)}
                    if body.logprobs and d.logprobs is not None
                    else None,
                    "finish_reason": d.finish_reason,
                }
                if d.finish_reason:
                    choice["stop_reason"] = d.stop_reason
                if body.return_token_ids:
                    choice["token_ids"] = d.token_ids
                out.append(sse.event(self._chunk([choice], self._usage() if continuous else None)))
            if out:
                yield b"".join(out)
        if include_usage:
            yield sse.event(self._chunk([], self._usage()))

    def response(self) -> dict:
        body = self.body
        top_n = body.top_logprobs or 0
        choices = []
        for c in self.gen.choices:
            logprobs = None
            if body.logprobs:
                content = []
                for rows in c.logprob_rows:
                    content.extend(chat_logprobs(self.ctx.renderer, rows, top_n))
                logprobs = {"content": content}
            choices.append(
                {
                    "index": c.index,
                    "message": {
                        "role": self.role,
                        "content": self.echo + c.detok.text,
                        "refusal": None,
                        "tool_calls": [],
                        "reasoning": None,
                    },
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids if body.return_token_ids else None,
                }
            )
        first = self.gen.choices[0]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            "system_fingerprint": None,
            "prompt_logprobs": prompt_logprobs(
                self.ctx.renderer, first.prompt_ids, first.prompt_logprobs
            )
            if body.prompt_logprobs is not None
            else None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids else None,
        }
