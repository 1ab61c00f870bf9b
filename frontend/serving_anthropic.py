"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the
chat pipeline (anthropic_input.py maps the request), as vLLM serves it.

The output is read through the same reasoning and tool parsers as chat and shaped as
content blocks: `thinking`, `text`, and a `tool_use` block per call (its arguments as the
`input` object). A stream sends Anthropic's events: message_start, then for each block
content_block_start, its deltas (text_delta, thinking_delta, input_json_delta) and
content_block_stop, then message_delta (the stop reason and output tokens) and
message_stop. Errors, whole or mid-stream, have Anthropic's shape:
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend import sse
from frontend.anthropic_input import CountTokensRequest, MessagesRequest, chat_request
from frontend.chat_output import ChatOutputParser
from frontend.chat_prompt import render_prompt
from frontend.chat_tools import chat_tools
from frontend.errors import APIError
from frontend.generation import Generation
from frontend.output_blocks import REASONING, TEXT, TOOL, Block, BlockStream
from frontend.request_inputs import read_inputs
from frontend.responses import respond
from frontend.serving import ServingContext
from frontend.serving_chat import submit_chat
from frontend.streaming_view import GenerationView

# Anthropic's error types by HTTP status (api_error for the rest).
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error",
}  # fmt: skip


def anthropic_error(message: str, status: int) -> dict:
    return {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message},
    }


def _anthropic_errors(handler):
    """The route's APIErrors in Anthropic's shape (the status and headers kept)."""

    async def wrapped(ctx: ServingContext, request: Request) -> Response:
        try:
            return await handler(ctx, request)
        except APIError as e:
            return JSONResponse(anthropic_error(e.message, e.status), e.status, e.headers)

    return wrapped


async def messages_chat(
    ctx: ServingContext, request: Request, model: type[MessagesRequest] = MessagesRequest
):
    """A Messages request read and checked, and the chat request it maps onto."""
    inputs = await read_inputs(ctx, request, model)
    try:
        return inputs, chat_request(inputs.body, ctx.limits)
    except ValidationError as e:
        raise APIError(f"messages: {e.errors()[0]['msg']}", param="messages") from None


@_anthropic_errors
async def create_message(ctx: ServingContext, request: Request) -> Response:
    inputs, chat = await messages_chat(ctx, request, MessagesRequest)
    generation, parser, _ = await submit_chat(
        ctx, dataclasses.replace(inputs, body=chat), "max_tokens"
    )
    view = MessagesView(
        ctx, inputs.body, generation, f"msg_{inputs.request_id}", inputs.model, parser
    )
    return await respond(ctx, request, view)


@_anthropic_errors
async def count_tokens(ctx: ServingContext, request: Request) -> Response:
    """The prompt's length as /v1/messages would render it, tools included."""
    _, chat = await messages_chat(ctx, request, CountTokensRequest)
    tools = chat_tools(ctx.chat_parsers, chat)
    _, prompt_ids = await render_prompt(ctx, chat, tools=tools.template_tools)
    return JSONResponse({"input_tokens": len(prompt_ids)})


def _stop(generation: Generation, calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the finished answer."""
    choice = generation.choices[0]
    if choice.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _block(block: Block, opened: bool = False) -> dict:
    if block.kind == TEXT:
        return {"type": "text", "text": "" if opened else block.text}
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": "" if opened else block.text, "signature": ""}
    return {
        "type": "tool_use",
        "id": block.call_id,
        "name": block.name,
        "input": {} if opened else _input(block.text),
    }


def _input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is (the parsers give JSON
    objects; anything else is kept whole under "arguments")."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


class MessagesView(BlockStream, GenerationView):
    done = b""  # message_stop ends the stream

    def __init__(
        self,
        ctx: ServingContext,
        body: MessagesRequest,
        gen: Generation,
        id_: str,
        model: str,
        parser: ChatOutputParser | None,
    ) -> None:
        super().__init__(ctx, body, gen, id_, model)
        self.start_blocks(parser)

    def _message(self, content: list[dict], stop: tuple[str | None, str | None]) -> dict:
        gen = self.gen
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": {
                "input_tokens": gen.num_prompt_tokens,
                "output_tokens": gen.num_generated,
                "cache_read_input_tokens": gen.num_cached_tokens,
                "cache_creation_input_tokens": 0,
            },
        }

    def response(self) -> dict:
        blocks = self.whole_blocks(self.gen.choices[0].detok.text)
        calls = sum(1 for b in blocks if b.kind == TOOL)
        return self._message([_block(b) for b in blocks], _stop(self.gen, calls))

    # --- the stream ------------------------------------------------------------------------

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return sse.named_event(kind, {"type": kind, **fields})

    def error_event(self, error: dict) -> bytes:
        e = error["error"]
        body = anthropic_error(e["message"], e.get("code") or 500)
        return sse.named_event("error", body)

    async def events(self) -> AsyncIterator[bytes]:
        start = self._message([], (None, None))
        start["usage"]["output_tokens"] = 0
        yield self._event("message_start", message=start)
        async for chunk in self.delta_bytes(lambda d: self.feed_pieces(self.pieces(d))):
            yield chunk
        if not self.gen.choices[0].finished:  # aborted: the client is gone
            return
        out = self.finish_blocks()
        calls = sum(1 for b in self.closed if b.kind == TOOL)
        reason, sequence = _stop(self.gen, calls)
        out.append(
            self._event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=self._message([], (None, None))["usage"],  # cumulative, as Anthropic's
            )
        )
        out.append(self._event("message_stop"))
        yield b"".join(out)

    # BlockStream: what opening, a delta and closing a content block send

    def open_events(self, block: Block) -> list[bytes]:
        return [
            self._event("content_block_start", index=block.index, content_block=_block(block, True))
        ]

    def delta_events(self, block: Block, text: str) -> list[bytes]:
        if not text:
            return []
        if block.kind == TEXT:
            delta = {"type": "text_delta", "text": text}
        elif block.kind == REASONING:
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        return [self._event("content_block_delta", index=block.index, delta=delta)]

    def close_events(self, block: Block) -> list[bytes]:
        return [self._event("content_block_stop", index=block.index)]
