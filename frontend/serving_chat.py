"""POST /v1/chat/completions (and /batch): inputs → prompt → sampling parameters →
submit → respond. Tools, reasoning and structured outputs ride along (chat_tools.py,
structured_outputs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.beam_search import beam_params, check_beam_search
from frontend.chat_output import ChatOutputParser, ChatOutputStream
from frontend.chat_prompt import message_dicts, render_prompt
from frontend.chat_tools import chat_tools, forced_constraint, output_parser, reasoning_end_ids
from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.logprobs import chat_logprobs
from frontend.openai_models import BatchChatCompletionRequest, ChatCompletionRequest, ChatMessage
from frontend.request_inputs import RequestInputs, read_inputs
from frontend.responses import respond
from frontend.sampling import sampling_params, shown_logprobs
from frontend.serving import ServingContext
from frontend.streaming_view import StreamingView
from frontend.structured_outputs import check_size, request_constraint
from frontend.tool_parsers.forced import chat_finish_reason
from frontend.tool_parsers.request import ToolChoice
from frontend.usage import running_usage, usage
from protocol.messages import SamplingParams, StructuredOutputs


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ChatCompletionRequest)
    generation, parser, tool_choice = await submit_chat(ctx, inputs)
    view = ChatView(
        ctx,
        inputs.body,
        generation,
        f"chatcmpl-{inputs.request_id}",
        inputs.model,
        [inputs.body.messages],
        parser,
        tool_choice,
    )
    return await respond(ctx, request, view)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """One conversation ready to submit: its prompt and engine parameters, and how its
    output is read."""

    prompt_ids: list[int]
    params: SamplingParams
    parser: ChatOutputParser | None
    tool_choice: ToolChoice


async def plan_chat(
    ctx: ServingContext, inputs: RequestInputs, max_tokens_field: str | None = None
) -> ChatPlan:
    """One conversation's prompt, with its tools, reasoning and output constraint, and
    its sampling parameters (/v1/responses, /v1/messages and the render routes too)."""
    body = inputs.body
    if body.use_beam_search:
        check_beam_search(body, completions=False)
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
    text, prompt_ids = await render_prompt(ctx, body, tools=tools.template_tools)
    parser = output_parser(parsers, body, tools, text)
    if constraint is not None:
        end_ids = reasoning_end_ids(parsers, parser, encode_plain(ctx))
        constraint = msgspec.structs.replace(constraint, reasoning_end_ids=end_ids)
    (params,) = _params(ctx, inputs, [prompt_ids], constraint, max_tokens_field)
    return ChatPlan(prompt_ids, params, parser, tools.choice)


async def submit_chat(
    ctx: ServingContext, inputs: RequestInputs, max_tokens_field: str | None = None
) -> tuple[Generation, ChatOutputParser | None, ToolChoice]:
    """One conversation planned and submitted; the parser its output is read through."""
    plan = await plan_chat(ctx, inputs, max_tokens_field)
    generation = _submit(ctx, inputs, [plan.prompt_ids], [plan.params])
    return generation, plan.parser, plan.tool_choice


async def create_batch_chat_completion(ctx: ServingContext, request: Request) -> Response:
    """vLLM's batch: one response choice per conversation, index i for conversation i;
    never a stream; no tools and no structured outputs."""
    inputs = await read_inputs(
        ctx, request, BatchChatCompletionRequest, lambda body: len(body.messages), "messages"
    )
    body = inputs.body
    for field in ("tools", "response_format"):
        if getattr(body, field) is not None:
            raise APIError(
                f"{field} is not supported by /v1/chat/completions/batch; send the "
                f"conversations to /v1/chat/completions one by one",
                param=field,
            )
    if request_constraint(body, ctx.config.structured_outputs) is not None:
        raise APIError(
            "structured outputs are not supported by /v1/chat/completions/batch",
            param="structured_outputs",
        )
    prompts = [(await render_prompt(ctx, body, messages))[1] for messages in body.messages]
    generation = _submit(ctx, inputs, prompts, _params(ctx, inputs, prompts, None))
    view = ChatView(
        ctx, body, generation, f"chatcmpl-{inputs.request_id}", inputs.model, body.messages
    )
    return await respond(ctx, request, view)


def _params(
    ctx: ServingContext,
    inputs,
    prompts: list[list[int]],
    constraint: StructuredOutputs | None,
    max_tokens_field: str | None = None,
) -> list[SamplingParams]:
    body: ChatCompletionRequest = inputs.body
    if max_tokens_field is None:
        max_tokens_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    params = sampling_params(
        ctx,
        body,
        prompts,
        max_tokens=body.effective_max_tokens,
        max_tokens_field=max_tokens_field,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logprobs_field="top_logprobs",
    )
    if constraint is not None:
        params = [msgspec.structs.replace(p, structured_outputs=constraint) for p in params]
    if body.use_beam_search:
        params = beam_params(ctx, body, params, prompts)
    return params


def _submit(
    ctx: ServingContext, inputs, prompts: list[list[int]], params: list[SamplingParams]
) -> Generation:
    body: ChatCompletionRequest = inputs.body
    generation = ctx.submit(inputs, prompts, params)
    generation.keep_logprobs = not body.stream and body.logprobs
    return generation


def encode_plain(ctx: ServingContext):
    return lambda text: ctx.renderer.encode(text, add_special_tokens=False)


class ChatView(StreamingView):
    """Shapes one chat generation into OpenAI chunks or a response."""

    body: ChatCompletionRequest

    def __init__(
        self,
        ctx: ServingContext,
        body: ChatCompletionRequest,
        gen: Generation,
        id_: str,
        model: str,
        conversations: list[list[ChatMessage]],
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
        # Per conversation (prompt): the role that answers, and what echo repeats of it.
        self.roles: list[str] = []
        self.echoes: list[str] = []
        for messages in conversations:
            last = messages[-1]
            role = ctx.config.response_role if body.add_generation_prompt else last.role
            self.roles.append(role)
            echo = body.echo and last.role == role
            self.echoes.append(message_dicts([last])[0]["content"] if echo else "")
        self.started: set[int] = set()
        # top_logprobs entries: the chosen token and the best others (vLLM's count).
        if body.logprob_token_ids is not None:
            self.top_n = shown_logprobs(None, body.logprob_token_ids, ctx.vocab_size) + 1
        else:
            self.top_n = shown_logprobs(body.top_logprobs, None, ctx.vocab_size)
        self.as_ids = ctx.tokens_as_ids(body)
        # Logprob entries and ids of tokens whose text is still held back, per choice.
        self.pending_logprobs: list[list[dict]] = [[] for _ in gen.choices]
        self.pending_ids: list[list[int]] = [[] for _ in gen.choices]

    def usage(self, stream: bool = False) -> dict:
        return usage(self.gen, self.ctx.config.enable_prompt_tokens_details, stream=stream)

    def _logprobs(self, rows) -> list[dict]:
        return chat_logprobs(self.ctx.renderer, rows, self.top_n, self.as_ids)

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

    def stream_chunk(self, d: ChoiceDelta, choice: dict, continuous: bool) -> dict:
        """A choice's first (role) chunk says 0 completion tokens and carries the
        prompt's ids (null unless return_token_ids), as vLLM's does."""
        role_chunk = "role" in choice["delta"]
        usage = None
        if continuous:
            prompt_tokens = len(self.gen.choices[d.index].prompt_ids)
            usage = running_usage(prompt_tokens, 0 if role_chunk else d.num_generated)
        chunk = self.chunk([choice], usage)
        if role_chunk:
            prompt_ids = self.gen.choices[d.index].prompt_ids
            chunk["prompt_token_ids"] = prompt_ids if self.body.return_token_ids else None
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
            text = self.echoes[self.gen.choices[d.index].prompt_index] + text
        choice = {
            "index": d.index,
            "delta": {"content": text} if text else {},
            "logprobs": {"content": pending[:]} if self.body.logprobs else None,
            "finish_reason": d.finish_reason,
        }
        pending.clear()
        if d.finish_reason:
            choice["stop_reason"] = d.stop_reason
        choice["token_ids"] = pending_ids[:] if self.body.return_token_ids else None
        pending_ids.clear()
        out.append(choice)
        return out

    def _role_chunk(self, index: int) -> dict:
        role = self.roles[self.gen.choices[index].prompt_index]
        return {
            "index": index,
            "delta": {"role": role, "content": ""},
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
            echo = self.echoes[self.gen.choices[d.index].prompt_index]
            if echo:
                deltas.insert(0, {"content": echo})
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
        last["token_ids"] = pending_ids[:] if self.body.return_token_ids else None
        pending_ids.clear()
        return out + choices

    def _message(self, prompt_index: int, text: str) -> tuple[dict, int]:
        """A finished choice's message, and how many tool calls it makes."""
        echo = self.echoes[prompt_index]
        message = {
            "role": self.roles[prompt_index],
            "content": echo + text,
            "refusal": None,
            "tool_calls": [],
            "reasoning": None,
        }
        if self.parser is None:
            return message, 0
        parsed = self.parser.parse(text)
        content = parsed.content
        if echo:
            content = echo + (content or "")
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
            message, num_calls = self._message(c.prompt_index, c.detok.text)
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
        one_prompt = len(self.gen.prompts) == 1  # a batch has no single prompt to show
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": self.ctx.config.system_fingerprint,
            "prompt_logprobs": self.prompt_logprobs(first) if one_prompt else None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids and one_prompt else None,
        }
