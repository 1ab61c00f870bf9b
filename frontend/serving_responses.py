"""POST /v1/responses: OpenAI's Responses API over the chat pipeline (responses_input.py
maps the request; serving_chat.submit_chat renders, constrains and submits it).

The output is read through the same reasoning and tool parsers as chat, and shaped as
Responses items: a `reasoning` item, a `message` item with one `output_text` part, and a
`function_call` item per call. A stream sends OpenAI's events (`event: TYPE` lines, each
with a `sequence_number`): response.created and .in_progress; for each item
output_item.added, its deltas and their .done events, output_item.done; then
response.completed, whose status is "incomplete" when max_output_tokens cut it short
(vLLM's choice too; the SDK's stream helper waits for that event alone). Nothing
is stored, so GET /v1/responses/{id} and its cancel answer 404 saying so.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator

import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from frontend import sse
from frontend.chat_deltas import DeltaMessage
from frontend.chat_output import ChatOutputParser, ParsedMessage
from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.logprobs import chat_logprobs
from frontend.openai_models import ChatCompletionRequest
from frontend.request_inputs import read_inputs
from frontend.responses import respond
from frontend.responses_input import ResponsesRequest, chat_request
from frontend.sampling import shown_logprobs
from frontend.serving import ServingContext
from frontend.serving_chat import submit_chat
from frontend.streaming_view import GenerationView


async def create_response(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ResponsesRequest)
    try:
        chat = chat_request(inputs.body, ctx.limits)
    except ValidationError as e:
        error = e.errors()[0]
        raise APIError(f"input: {error['msg']}", param="input") from None
    generation, parser, _ = await submit_chat(
        ctx, dataclasses.replace(inputs, body=chat), "max_output_tokens"
    )
    view = ResponsesView(
        ctx, inputs.body, chat, generation, f"resp_{inputs.request_id}", inputs.model, parser
    )
    return await respond(ctx, request, view)


async def stored_response(ctx: ServingContext, request: Request) -> Response:
    """GET /v1/responses/{id}, POST …/cancel: there is nothing stored to find."""
    raise APIError(
        f"response {request.path_params['response_id'][:80]!r} not found: zserve stores no "
        f"responses (store is accepted and ignored, as vLLM does by default)",
        404,
        param="response_id",
    )


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item(kind: str, text: str = "", status: str = "completed", logprobs=None, **extra) -> dict:
    """A finished (or, with status in_progress, just opened) output item."""
    item_id = extra.pop("id")
    if kind == "message":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        content = [part] if status != "in_progress" else []
        return {
            "type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content,
        }  # fmt: skip
    if kind == "reasoning":
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": content,
            "status": status,
        }
    return {"type": "function_call", "id": item_id, "status": status, "arguments": text, **extra}


@dataclasses.dataclass
class _OpenItem:
    kind: str  # message | reasoning | function_call
    id: str
    index: int  # output_index
    text: str = ""  # the text so far (a call's arguments)
    extra: dict = dataclasses.field(default_factory=dict)  # a call's call_id and name
    logprobs: list = dataclasses.field(default_factory=list)


class ResponsesView(GenerationView):
    done = b""  # a Responses stream ends with response.completed, no [DONE]

    def __init__(
        self,
        ctx: ServingContext,
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        gen: Generation,
        id_: str,
        model: str,
        parser: ChatOutputParser | None,
    ) -> None:
        super().__init__(ctx, body, gen, id_, model)
        self.parser = parser
        self.stream_state = parser.stream() if parser is not None else None
        self.logprobs = chat.logprobs
        self.top_n = shown_logprobs(chat.top_logprobs, None, ctx.vocab_size)
        self.as_ids = ctx.tokens_as_ids(chat)
        self.sequence = 0
        self.items: list[dict] = []  # finished output items, in order
        self.open: _OpenItem | None = None
        self.pending: list[dict] = []  # logprob entries not yet on a text delta

    # --- the whole response ----------------------------------------------------------------

    def response(self) -> dict:
        choice = self.gen.choices[0]
        text = choice.detok.text
        parsed = self.parser.parse(text) if self.parser else ParsedMessage(content=text)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        output = []
        if parsed.reasoning:
            output.append(_item("reasoning", parsed.reasoning, id=_new_id("rs")))
        logprobs = None
        if self.logprobs:
            logprobs = [e for rows in choice.logprob_rows for e in self._logprobs(rows)]
        if parsed.content or not (output or parsed.tool_calls):
            message = _item("message", parsed.content or "", status, logprobs, id=_new_id("msg"))
            output.append(message)
        for call in parsed.tool_calls:
            output.append(
                _item(
                    "function_call",
                    call.arguments,
                    id=_new_id("fc"),
                    call_id=call.id,
                    name=call.name,
                )
            )
        return self._envelope(status, output, parsed.reasoning)

    def _envelope(self, status: str, output: list[dict], reasoning: str | None = "") -> dict:
        body: ResponsesRequest = self.body
        params = self.gen.choices[0].params
        finished = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": body.reasoning,
            "service_tier": "auto",
            "temperature": params.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0,
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": self._usage(reasoning) if finished else None,
            "user": body.user,
        }

    def _usage(self, reasoning: str | None) -> dict:
        gen = self.gen
        reasoning_tokens = len(self.ctx.renderer.encode(reasoning, False)) if reasoning else 0
        return {
            "input_tokens": gen.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.num_cached_tokens},
            "output_tokens": gen.num_generated,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": gen.num_prompt_tokens + gen.num_generated,
        }

    def _logprobs(self, rows) -> list[dict]:
        return chat_logprobs(self.ctx.renderer, rows, self.top_n, self.as_ids)

    # --- the stream ------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def error_event(self, error: dict) -> bytes:
        e = error["error"]
        return self._event("error", code=e.get("code"), message=e["message"], param=e.get("param"))

    async def events(self) -> AsyncIterator[bytes]:
        config = self.ctx.config
        start = self._envelope("in_progress", [])
        yield self._event("response.created", response=start) + self._event(
            "response.in_progress", response=start
        )
        reasoning_text: list[str] = []
        async for batch in self.gen.deltas(
            config.sse_keep_alive_interval or None, config.stream_interval
        ):
            if not batch:
                yield sse.KEEP_ALIVE
                continue
            out: list[bytes] = []
            for d in batch:
                out.extend(self._delta_events(d, reasoning_text))
            if out:
                yield b"".join(out)
        choice = self.gen.choices[0]
        if not choice.finished:  # aborted: the stream just ends (the client is gone)
            return
        out = self._close()
        if not self.items:  # nothing at all was generated: an empty message still answers
            self._open("message")
            out += self._close()
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        final = self._envelope(status, self.items, "".join(reasoning_text))
        # response.completed whatever the status, as vLLM sends it: the SDK's stream
        # helper (get_final_response) waits for that event alone.
        out.append(self._event("response.completed", response=final))
        yield b"".join(out)

    def _delta_events(self, d: ChoiceDelta, reasoning_text: list[str]) -> list[bytes]:
        if self.logprobs and d.logprobs is not None:
            self.pending.extend(self._logprobs(d.logprobs))
        if self.stream_state is None:
            pieces = [DeltaMessage(content=d.text)] if d.text else []
        else:
            pieces = self.stream_state.feed(d.text)
            if d.finish_reason:
                pieces += self.stream_state.finish()
        out: list[bytes] = []
        for piece in pieces:
            if piece.reasoning is not None:
                reasoning_text.append(piece.reasoning)
                out += self._text_delta("reasoning", piece.reasoning)
            elif piece.tool_call is not None:
                call = piece.tool_call
                if call.id is not None:  # a call's first piece
                    out += self._close()
                    out += self._open("function_call", call_id=call.id, name=call.name)
                if call.arguments:
                    self.open.text += call.arguments
                    out.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=self.open.id,
                            output_index=self.open.index,
                            delta=call.arguments,
                        )
                    )
            elif piece.content:
                out += self._text_delta("message", piece.content)
        return out

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open.kind != kind:
            out += self._close()
            out += self._open(kind)
        item = self.open
        item.text += text
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **where, delta=text))
        else:
            logprobs, self.pending = self.pending, []
            item.logprobs += logprobs
            out.append(
                self._event("response.output_text.delta", **where, delta=text, logprobs=logprobs)
            )
        return out

    def _open(self, kind: str, **extra) -> list[bytes]:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        self.open = _OpenItem(kind, _new_id(prefix), len(self.items), extra=extra)
        item = _item(kind, "", "in_progress", id=self.open.id, **extra)
        out = [self._event("response.output_item.added", output_index=self.open.index, item=item)]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=self.open.id,
                    output_index=self.open.index,
                    content_index=0,
                    part=part,
                )
            )
        return out

    def _close(self) -> list[bytes]:
        out: list[bytes] = []
        if self.pending and self.open is not None and self.open.kind == "message":
            out += self._text_delta("message", "")  # the held-back tokens' logprobs
        item, self.open = self.open, None
        if item is None:
            return out
        choice = self.gen.choices[0]
        status = (
            "incomplete"
            if item.kind == "message" and choice.finish_reason == "length"
            else "completed"
        )
        done = _item(item.kind, item.text, status, item.logprobs, id=item.id, **item.extra)
        self.items.append(done)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            out += [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=item.text,
                    logprobs=item.logprobs,
                ),
                self._event("response.content_part.done", **where, content_index=0, part=done["content"][0]),
            ]  # fmt: skip
        elif item.kind == "reasoning":
            out += [
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=item.text
                )
            ]
        else:
            out += [
                self._event(
                    "response.function_call_arguments.done", **where, arguments=item.text,
                    name=item.extra.get("name"),
                )
            ]  # fmt: skip
        out.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return out
