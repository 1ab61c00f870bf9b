"""POST /v1/chat/completions: inputs → prompt → sampling parameters → submit → respond."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.chat_output import ChatOutputParser, ChatOutputStream
from frontend.chat_prompt import message_dicts, render_messages
from frontend.chat_tools import (
    chat_tools,
    forced_constraint,
    output_parser,
    reasoning_end_ids,
)
from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.logprobs import chat_logprobs, prompt_logprobs
from frontend.openai_models import ChatCompletionRequest
from frontend.request_inputs import read_inputs
from frontend.responses import respond
from frontend.sampling import sampling_params, truncation
from frontend.serving import ServingContext
from frontend.streaming_view import StreamingView
from frontend.structured_outputs import check_size, request_constraint
from frontend.tool_parsers.forced import chat_finish_reason
from frontend.tool_parsers.request import ToolChoice
from frontend.usage import usage


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ChatCompletionRequest)
    body = inputs.body
    parsers = ctx.chat_parsers
    tools = chat_tools(parsers, body)
    constraint = request_constraint(body, ctx.config.structured_outputs)
    forced = forced_constraint(tools)
    if forced is not None:
        if constraint is not None:
            raise APIError(
                f"tool_choice: {tools.choice.mode!r} constrains the output to tool calls; "
                f"drop {constraint.param.split('.')[0]}",
                param="tool_choice",
            )
        check_size(forced, ctx.config.structured_outputs)
        constraint = forced
    text = await render_messages(
        ctx,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        truncating=body.truncate_prompt_tokens is not None,
        tools=tools.template_tools,
    )
    keep = truncation(body.truncate_prompt_tokens, ctx.max_model_len)
    prompt_ids = await ctx.encode(text, body.add_special_tokens, keep)
    parser = output_parser(parsers, body, tools, text)
    params = sampling_params(
        ctx,
        body,
        [prompt_ids],
        max_tokens=body.effective_max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logprobs_field="top_logprobs",
    )
    if constraint is not None:
        end_ids = reasoning_end_ids(parsers, parser, _encode_plain(ctx))
        params.structured_outputs = msgspec.structs.replace(constraint, reasoning_end_ids=end_ids)
    generation = ctx.submit(inputs, [prompt_ids], params)
    generation.keep_logprobs = not body.stream and body.logprobs
    view = ChatView(
        ctx, body, generation, f"chatcmpl-{inputs.request_id}", inputs.model, parser, tools.choice
    )
    return await respond(ctx, request, view)


def _encode_plain(ctx: ServingContext):
    return lambda text: ctx.renderer.encode(text, add_special_tokens=False)


class ChatView(StreamingView):
    """Shapes one chat generation into OpenAI chunks or a response."""

    body: ChatCompletionRequest

    def __init__(
        self,
        ctx: ServingContext,
        body: ChatCompletionRequest,
        gen: Generation,
        id_,
        model,
        parser: ChatOutputParser | None = None,
        tool_choice: ToolChoice | None = None,
    ):
        super().__init__(ctx, body, gen, id_, model)
        # Reasoning and tool calls: read through the parser, one stream state per choice.
        self.parser = parser
        self.tool_choice = tool_choice or ToolChoice("none")
        self.streams: list[ChatOutputStream] | None = (
            [parser.stream() for _ in gen.choices] if parser is not None else None
        )
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

    def usage(self) -> dict:
        return usage(self.gen, self.ctx.config.enable_prompt_tokens_details)

    def _logprobs(self, rows) -> list[dict]:
        return chat_logprobs(
            self.ctx.renderer, rows, self.top_n, self.body.return_tokens_as_token_ids
        )

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def stream_choices(self, d: ChoiceDelta) -> list[dict]:
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
        if self.streams is not None:
            return self._parsed_choices(d, pending, pending_ids)
        out = []
        if d.index not in self.started:
            self.started.add(d.index)
            out.append(self._role_chunk(d.index))
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

    def _role_chunk(self, index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": self.role, "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def _parsed_choices(
        self, d: ChoiceDelta, pending: list[dict], pending_ids: list[int]
    ) -> list[dict]:
        """A delta read through the request's parsers: a chunk per piece (reasoning,
        content, a tool-call fragment), or one empty chunk when the parsers hold the
        text back; the first carries the logprobs, the last the finish reason."""
        stream = self.streams[d.index]
        pieces = stream.feed(d.text)
        if d.finish_reason:
            pieces += stream.finish()
        deltas = [p.to_dict() for p in pieces]
        out = []
        if d.index not in self.started:
            self.started.add(d.index)
            out.append(self._role_chunk(d.index))
            if self.echo:
                deltas.insert(0, {"content": self.echo})
        choices = [
            {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": None}
            for delta in deltas or [{}]
        ]
        if self.body.logprobs:
            choices[0]["logprobs"] = {"content": pending[:]}
        pending.clear()
        last = choices[-1]
        if d.finish_reason:
            last["finish_reason"] = chat_finish_reason(
                d.finish_reason, self.tool_choice, stream.tool_calls_sent
            )
            last["stop_reason"] = d.stop_reason
        if self.body.return_token_ids:
            last["token_ids"] = pending_ids[:]
        pending_ids.clear()
        return out + choices

    def _message(self, text: str) -> tuple[dict, int]:
        """A finished choice's message, and how many tool calls it makes."""
        message = {
            "role": self.role,
            "content": self.echo + text,
            "refusal": None,
            "tool_calls": [],
            "reasoning": None,
        }
        if self.parser is None:
            return message, 0
        parsed = self.parser.parse(text)
        content = parsed.content
        if self.echo:
            content = self.echo + (content or "")
        message["content"] = content
        message["reasoning"] = parsed.reasoning
        message["tool_calls"] = [call.to_dict() for call in parsed.tool_calls]
        return message, len(parsed.tool_calls)

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
            message, num_calls = self._message(c.detok.text)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": chat_finish_reason(
                        c.finish_reason, self.tool_choice, num_calls
                    ),
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
            "usage": self.usage(),
            "system_fingerprint": None,
            "prompt_logprobs": prompt_logprobs(
                self.ctx.renderer, first.prompt_ids, first.prompt_logprobs, body.prompt_logprobs
            )
            if body.prompt_logprobs is not None
            else None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids else None,
        }
