"""POST /v1/chat/completions (and /batch): inputs → prompt → sampling parameters →
submit → respond."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from frontend.chat_prompt import message_dicts, render_prompt
from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.logprobs import chat_logprobs, prompt_logprobs
from frontend.openai_models import BatchChatCompletionRequest, ChatCompletionRequest, ChatMessage
from frontend.request_inputs import read_inputs
from frontend.responses import respond
from frontend.sampling import logprob_count, sampling_params, shown_logprobs
from frontend.serving import ServingContext
from frontend.streaming_view import StreamingView
from frontend.usage import running_usage, usage


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ChatCompletionRequest)
    body = inputs.body
    check_unsupported(body)
    prompt_ids = await render_prompt(ctx, body)
    generation = _submit(ctx, inputs, [prompt_ids])
    view = ChatView(
        ctx, body, generation, f"chatcmpl-{inputs.request_id}", inputs.model, [body.messages]
    )
    return await respond(ctx, request, view)


async def create_batch_chat_completion(ctx: ServingContext, request: Request) -> Response:
    """vLLM's batch: one response choice per conversation, index i for conversation i;
    never a stream."""
    inputs = await read_inputs(
        ctx, request, BatchChatCompletionRequest, lambda body: len(body.messages), "messages"
    )
    body = inputs.body
    check_unsupported(body)
    prompts = [await render_prompt(ctx, body, messages) for messages in body.messages]
    generation = _submit(ctx, inputs, prompts)
    view = ChatView(
        ctx, body, generation, f"chatcmpl-{inputs.request_id}", inputs.model, body.messages
    )
    return await respond(ctx, request, view)


def _submit(ctx: ServingContext, inputs, prompts: list[list[int]]) -> Generation:
    body: ChatCompletionRequest = inputs.body
    params = sampling_params(
        ctx,
        body,
        prompts,
        max_tokens=body.effective_max_tokens,
        max_tokens_field="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logprobs_field="top_logprobs",
    )
    generation = ctx.submit(inputs, prompts, params)
    generation.keep_logprobs = not body.stream and body.logprobs
    return generation


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
    ):
        super().__init__(ctx, body, gen, id_, model)
        # Per conversation (prompt): the role that answers, and what echo repeats of it.
        self.roles: list[str] = []
        self.echoes: list[str] = []
        for messages in conversations:
            last = messages[-1]
            role = "assistant" if body.add_generation_prompt else last.role
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
        out = []
        if d.index not in self.started:
            self.started.add(d.index)
            prompt_index = self.gen.choices[d.index].prompt_index
            out.append(
                {
                    "index": d.index,
                    "delta": {"role": self.roles[prompt_index], "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            text = self.echoes[prompt_index] + text
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
                        "role": self.roles[c.prompt_index],
                        "content": self.echoes[c.prompt_index] + c.detok.text,
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
        one_prompt = len(self.gen.prompts) == 1  # a batch has no single prompt to show
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
            "prompt_logprobs": prompt_logprobs(
                self.ctx.renderer,
                first.prompt_ids,
                first.prompt_logprobs,
                logprob_count(body.prompt_logprobs, self.ctx.vocab_size),
            )
            if body.prompt_logprobs is not None and one_prompt
            else None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids and one_prompt else None,
        }
