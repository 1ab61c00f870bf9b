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

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from frontend import sse
from frontend.chat_output import ChatOutputParser
from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.logprobs import chat_logprobs
from frontend.openai_models import ChatCompletionRequest
from frontend.output_blocks import REASONING, TEXT, TOOL, Block, BlockStream
from frontend.request_inputs import RequestInputs, read_inputs
from frontend.responses import respond
from frontend.responses_input import ResponsesRequest, chat_request
from frontend.sampling import shown_logprobs
from frontend.serving import ServingContext
from frontend.serving_chat import submit_chat
from frontend.streaming_view import GenerationView


async def create_response(ctx: ServingContext, request: Request) -> Response:
    inputs, chat = await responses_chat(ctx, request)
    generation, parser, _ = await submit_chat(
        ctx, dataclasses.replace(inputs, body=chat), "max_output_tokens"
    )
    view = ResponsesView(
        ctx, inputs.body, chat, generation, f"resp_{inputs.request_id}", inputs.model, parser
    )
    return await respond(ctx, request, view)


async def responses_chat(
    ctx: ServingContext, request: Request
) -> tuple[RequestInputs[ResponsesRequest], ChatCompletionRequest]:
    """A Responses request read and checked, and the chat request it maps onto."""
    inputs = await read_inputs(ctx, request, ResponsesRequest)
    try:
        return inputs, chat_request(inputs.body, ctx.limits)
    except ValidationError as e:
        error = e.errors()[0]
        raise APIError(f"input: {error['msg']}", param="input") from None


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


_ID_PREFIX = {TEXT: "msg", REASONING: "rs", TOOL: "fc"}


def _item(block: Block, status: str = "completed") -> dict:
    """The output item of a block: finished, or (status in_progress) just opened."""
    opened = status == "in_progress"
    if block.kind == TEXT:
        part = {
            "type": "output_text", "text": block.text, "annotations": [],
            "logprobs": block.logprobs,
        }  # fmt: skip
        content = [] if opened else [part]
        return {
            "type": "message", "id": block.id, "role": "assistant", "status": status,
            "content": content,
        }  # fmt: skip
    if block.kind == REASONING:
        content = [] if opened else [{"type": "reasoning_text", "text": block.text}]
        return {
            "type": "reasoning",
            "id": block.id,
            "summary": [],
            "content": content,
            "status": status,
        }
    return {
        "type": "function_call", "id": block.id, "call_id": block.call_id, "name": block.name,
        "arguments": "" if opened else block.text, "status": status,
    }  # fmt: skip


class ResponsesView(BlockStream, GenerationView):
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
        self.start_blocks(parser)
        self.logprobs = chat.logprobs
        self.top_n = shown_logprobs(chat.top_logprobs, None, ctx.vocab_size)
        self.as_ids = ctx.tokens_as_ids(chat)
        self.sequence = 0
        self.pending: list[dict] = []  # logprob entries not yet on a text delta

    # --- the whole response ----------------------------------------------------------------

    def response(self) -> dict:
        choice = self.gen.choices[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        logprobs = []
        if self.logprobs:
            logprobs = [e for rows in choice.logprob_rows for e in self._logprobs(rows)]
        blocks = self.whole_blocks(choice.detok.text, logprobs)
        output = []
        for block in blocks:
            block.id = _new_id(_ID_PREFIX[block.kind])
            output.append(_item(block, status if block.kind == TEXT else "completed"))
        reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
        return self._envelope(status, output, reasoning)

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
            "max_tool_calls": None,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "prompt": None,
            "frequency_penalty": params.frequency_penalty,
            "presence_penalty": params.presence_penalty,
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
        return sse.named_event(kind, payload)

    def error_event(self, error: dict) -> bytes:
        e = error["error"]
        return self._event("error", code=e.get("code"), message=e["message"], param=e.get("param"))

    async def events(self) -> AsyncIterator[bytes]:
        start = self._envelope("in_progress", [])
        yield self._event("response.created", response=start) + self._event(
            "response.in_progress", response=start
        )
        async for chunk in self.delta_bytes(self._delta_events):
            yield chunk
        choice = self.gen.choices[0]
        if not choice.finished:  # aborted: the stream just ends (the client is gone)
            return
        out = self._flush_logprobs() + self.finish_blocks()
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items = [_item(b, self._status(b)) for b in self.closed]
        reasoning = "".join(b.text for b in self.closed if b.kind == REASONING)
        final = self._envelope(status, items, reasoning)
        # response.completed whatever the status, as vLLM sends it: the SDK's stream
        # helper (get_final_response) waits for that event alone.
        out.append(self._event("response.completed", response=final))
        yield b"".join(out)

    def _status(self, block: Block) -> str:
        cut = self.gen.choices[0].finish_reason == "length"
        return "incomplete" if block.kind == TEXT and cut else "completed"

    def _flush_logprobs(self) -> list[bytes]:
        """Logprobs of tokens whose text never showed, on a last empty text delta."""
        if self.pending and self.open is not None and self.open.kind == TEXT:
            return self.append(TEXT, "")
        return []

    def _delta_events(self, d: ChoiceDelta) -> list[bytes]:
        if self.logprobs and d.logprobs is not None:
            self.pending.extend(self._logprobs(d.logprobs))
        return self.feed_pieces(self.pieces(d))

    # BlockStream: what opening, a delta and closing an item send

    def open_events(self, block: Block) -> list[bytes]:
        block.id = _new_id(_ID_PREFIX[block.kind])
        item = _item(block, "in_progress")
        out = [self._event("response.output_item.added", output_index=block.index, item=item)]
        if block.kind == TEXT:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._event("response.content_part.added", **self._where(block), part=part))
        return out

    def delta_events(self, block: Block, text: str) -> list[bytes]:
        if block.kind == TOOL:
            where = {"item_id": block.id, "output_index": block.index}
            return [self._event("response.function_call_arguments.delta", **where, delta=text)]
        if block.kind == REASONING:
            return [self._event("response.reasoning_text.delta", **self._where(block), delta=text)]
        logprobs, self.pending = self.pending, []
        block.logprobs += logprobs
        return [
            self._event(
                "response.output_text.delta", **self._where(block), delta=text, logprobs=logprobs
            )
        ]

    def close_events(self, block: Block) -> list[bytes]:
        done = _item(block, self._status(block))
        if block.kind == TEXT:
            out = [
                self._event(
                    "response.output_text.done", **self._where(block), text=block.text,
                    logprobs=block.logprobs,
                ),
                self._event("response.content_part.done", **self._where(block), part=done["content"][0]),
            ]  # fmt: skip
        elif block.kind == REASONING:
            out = [
                self._event("response.reasoning_text.done", **self._where(block), text=block.text)
            ]
        else:
            out = [
                self._event(
                    "response.function_call_arguments.done", item_id=block.id,
                    output_index=block.index, arguments=block.text, name=block.name,
                )
            ]  # fmt: skip
        out.append(self._event("response.output_item.done", output_index=block.index, item=done))
        return out

    @staticmethod
    def _where(block: Block) -> dict:
        return {"item_id": block.id, "output_index": block.index, "content_index": 0}
