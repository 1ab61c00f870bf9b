"""POST /v1/chat/completions."""

from __future__ import annotations

import logging
import time

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import Response

from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.limits import check_message_count
from frontend.logprobs import chat_logprobs, prompt_logprobs
from frontend.openai_models import ChatCompletionRequest, ChatMessage
from frontend.sampling import build_sampling_params, check_prompt_length, truncation
from frontend.serving import ServingContext, StreamingView
from frontend.usage import usage

log = logging.getLogger("zserve.api")


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


async def render_messages(
    ctx: ServingContext,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    truncating: bool = False,
) -> str:
    """The conversation as prompt text, through the model's (or a trusted request's)
    chat template; any failure of the template is the request's fault: a 400."""
    kwargs = dict(chat_template_kwargs or {})
    if "chat_template" in kwargs:
        chat_template = kwargs.pop("chat_template")
    if chat_template is not None and not ctx.config.trust_request_chat_template:
        raise APIError(
            "chat_template: request-supplied chat templates are refused; start the server "
            "with --trust-request-chat-template to allow them",
            param="chat_template",
        )
    # These are the renderer's own arguments, not template variables.
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(
            f"chat_template_kwargs: {reserved[0]!r} is not a template variable; use the "
            f"request field of that name",
            param="chat_template_kwargs",
        )
    if chat_template is None and not ctx.renderer.has_chat_template:
        raise APIError(
            "messages: this model has no chat template; start the server with "
            "--chat-template or use /v1/completions",
            param="messages",
        )
    check_message_count(len(messages), ctx.limits)
    dicts = message_dicts(messages)
    # The template copies every message's text into the prompt: refuse a conversation
    # that cannot fit before rendering it, and the rendered text before tokenizing it.
    ctx.check_text_length("".join(d["content"] for d in dicts), "messages", truncating)
    try:
        text = await ctx.render_chat(
            messages=dicts,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            template_kwargs=kwargs,
        )
    except Exception as e:  # a template only fails on what the request put into it
        raise template_error(e) from None
    if not isinstance(text, str):
        raise APIError("chat_template_kwargs: the chat template did not render text")
    ctx.check_text_length(text, "messages", truncating)
    return text


def template_error(e: Exception) -> APIError:
    """A failed chat template as a 400. A template's own `raise_exception(...)` message
    speaks to the client (e.g. "roles must alternate"); the text of any other failure
    comes from third-party code and only reaches the log."""
    if type(e) is TemplateError and e.message:
        return APIError(f"messages: {e.message[:300]}", param="messages")
    log.warning("the chat template failed: %s: %s", type(e).__name__, e)
    return APIError(
        "messages: the chat template could not render this conversation (check the roles, "
        "order and fields of the messages, and chat_template_kwargs)",
        param="messages",
    )


_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "add_generation_prompt",
        "continue_final_message",
    }
)


async def render_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    text = await render_messages(
        ctx,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        truncating=body.truncate_prompt_tokens is not None,
    )
    keep = truncation(body.truncate_prompt_tokens, ctx.max_model_len)
    return await ctx.encode(text, body.add_special_tokens, keep)


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
    ctx.check_limits(body, 1)
    request_id = ctx.request_id(request, body.request_id)
    prompt_ids = await render_prompt(ctx, body)
    max_tokens = body.effective_max_tokens
    if max_tokens is None:
        max_tokens = max(1, ctx.max_request_tokens - len(prompt_ids))
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=top_n,
        defaults=ctx.defaults,
        vocab_size=ctx.renderer.vocab_size,
        max_logprobs=ctx.config.max_logprobs,
        logprobs_field="top_logprobs",
    )
    check_prompt_length(len(prompt_ids), max_tokens, ctx.max_model_len, ctx.max_request_tokens)
    generation = ctx.generation(request, body, request_id, [prompt_ids], params)
    generation.keep_logprobs = not body.stream and body.logprobs
    ctx.start(generation, body.n)
    headers = ctx.response_headers(generation, request_id)
    view = _ChatView(ctx, body, generation, f"chatcmpl-{request_id}", model)
    return await ctx.respond(request, generation, view, headers)


class _ChatView(StreamingView):
    """Shapes one chat generation into OpenAI chunks or a response."""

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
        self.top_n = body.top_logprobs or 0
        # Logprob entries and ids of tokens whose text is still held back, per choice.
        self.pending_logprobs: list[list[dict]] = [[] for _ in gen.choices]
        self.pending_ids: list[list[int]] = [[] for _ in gen.choices]

    def _usage(self) -> dict:
        return usage(self.gen, self.ctx.config.enable_prompt_tokens_details)

    def _logprobs(self, rows) -> list[dict]:
        return chat_logprobs(
            self.ctx.renderer, rows, self.top_n, self.body.return_tokens_as_token_ids
        )

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

    def _stream_choices(self, d: ChoiceDelta) -> list[dict]:
        """One delta as chunk choices: the role chunk first for a new choice (with its
        first token, never before), then one content chunk per token, as vLLM streams,
        even when the token's text is still held back."""
        pending = self.pending_logprobs[d.index]
        pending_ids = self.pending_ids[d.index]
        pending_ids.extend(d.token_ids)
        if self.body.logprobs and d.logprobs is not None:
            pending.extend(self._logprobs(d.logprobs))
        text = d.text
        if not text and not d.finish_reason and not pending_ids:
            return []
        out = []
        if d.index not in self.started:
            self.started.add(d.index)
            out.append(
                {
                    "index": d.index,
                    "delta": {"role": self.role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            text = self.echo + text
        choice = {
            "index": d.index,
            "delta": {"content": text} if text else {},
            "logprobs": {"content": pending[:]} if self.body.logprobs else None,
            "finish_reason": d.finish_reason,
        }
        pending.clear()
        if d.finish_reason:
            choice["stop_reason"] = d.stop_reason
        if self.body.return_token_ids:
            choice["token_ids"] = pending_ids[:]
        pending_ids.clear()
        out.append(choice)
        return out

    def response(self) -> dict:
        body = self.body
        choices = []
        for c in self.gen.choices:
            logprobs = None
            if body.logprobs:
                content = []
                for rows in c.logprob_rows:
                    content.extend(self._logprobs(rows))
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
                self.ctx.renderer, first.prompt_ids, first.prompt_logprobs, body.prompt_logprobs
            )
            if body.prompt_logprobs is not None
            else None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids else None,
        }
