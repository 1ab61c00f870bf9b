"""A conversation as a prompt: messages through the chat template, then token ids.
The template is the model's own (or a trusted request's); whatever it fails on is
the request's fault, a 400."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from frontend.errors import APIError
from frontend.limits import check_message_count
from frontend.openai_models import ChatCompletionRequest, ChatMessage
from frontend.sampling import truncation
from frontend.tool_parsers.messages import template_messages
from frontend.tool_parsers.request import ToolRequestError

if TYPE_CHECKING:
    from frontend.serving import ServingContext

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
    tools: list[dict] | None = None,
) -> str:
    """The conversation as prompt text, through the model's (or a trusted request's)
    chat template, with `tools` (validated) as transformers' templates take them; any
    failure of the template is the request's fault: a 400."""
    kwargs = template_kwargs(ctx, chat_template_kwargs)
    if "chat_template" in kwargs:
        chat_template = kwargs.pop("chat_template")
    if chat_template is not None and not ctx.config.trust_request_chat_template:
        raise APIError(
            "chat_template: request-supplied chat templates are refused; start the server "
            "with --trust-request-chat-template to allow them",
            param="chat_template",
        )
    if chat_template is None and not ctx.renderer.has_chat_template:
        raise APIError(
            "messages: this model has no chat template; start the server with "
            "--chat-template or use /v1/completions",
            param="messages",
        )
    check_message_count(len(messages), ctx.limits)
    try:  # tool calls' JSON arguments as the dicts templates expect
        dicts = template_messages(message_dicts(messages))
    except ToolRequestError as e:
        raise APIError(e.message, param=e.param) from None
    if tools is not None:
        kwargs["tools"] = tools
    # The template copies every message's text into the prompt: refuse a conversation
    # that cannot fit before rendering it, and the rendered text before tokenizing it.
    ctx.check_text_length("".join(d["content"] for d in dicts), "messages", truncating)
    return await render_template(
        ctx,
        dicts,
        "messages",
        truncating,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        template_kwargs=kwargs,
    )


def template_kwargs(ctx: ServingContext, request_kwargs: dict | None) -> dict:
    """The template variables: --default-chat-template-kwargs under the request's own
    (checked at start); the renderer's own arguments are refused, named."""
    kwargs = {**ctx.config.default_chat_template_kwargs, **(request_kwargs or {})}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(
            f"chat_template_kwargs: {reserved[0]!r} is not a template variable; use the "
            f"request field of that name",
            param="chat_template_kwargs",
        )
    return kwargs


async def render_template(
    ctx: ServingContext, dicts: list[dict], field: str, truncating: bool, **how
) -> str:
    """Message dicts through the chat template (`how`: Renderer.render_chat's keywords),
    off the event loop; a failure is the request's 400, and the text must fit (`field`
    names what made it)."""
    try:
        text = await asyncio.to_thread(ctx.renderer.render_chat, messages=dicts, **how)
    except Exception as e:  # a template only fails on what the request put into it
        raise template_error(e) from None
    if not isinstance(text, str):
        raise APIError("chat_template_kwargs: the chat template did not render text")
    ctx.check_text_length(text, field, truncating)
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


RESERVED_TEMPLATE_KWARGS = frozenset(
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


async def render_prompt(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    messages: list[ChatMessage] | None = None,
    tools: list[dict] | None = None,
) -> tuple[str, list[int]]:
    """The prompt of one conversation (`messages`, or the request's own) with `tools`:
    its text (the output parsers read how it ends) and its token ids."""
    text = await render_messages(
        ctx,
        body.messages if messages is None else messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        truncating=body.truncate_prompt_tokens is not None,
        tools=tools,
    )
    ids = await ctx.encode(text, body.add_special_tokens, truncation(body, ctx.max_model_len))
    return text, ids
