"""POST /v1/chat/completions: inputs → prompt → sampling parameters → submit → respond."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from frontend.beam_search import beam_params, check_beam_search
from frontend.chat_prompt import message_dicts, render_prompt
from frontend.errors import APIError
from frontend.generation import ChoiceDelta, Generation
from frontend.logprobs import chat_logprobs, prompt_logprobs
from frontend.openai_models import ChatCompletionRequest
from frontend.request_inputs import read_inputs
from frontend.responses import respond
from frontend.sampling import sampling_params
from frontend.serving import ServingContext
from frontend.streaming_view import StreamingView
from frontend.usage import usage


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    inputs = await read_inputs(ctx, request, ChatCompletionRequest)
    body = inputs.body
    if body.use_beam_search:
        check_beam_search(body, completions=False)
    check_unsupported(body)
    prompt_ids = await render_prompt(ctx, body)
    params = sampling_params(
        ctx,
        body,
        [prompt_ids],
        max_tokens=body.effective_max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logprobs_field="top_logprobs",
    )
    if body.use_beam_search:
        params = beam_params(ctx, body, params, [prompt_ids])
    generation = ctx.submit(inputs, [prompt_ids], params)
    generation.keep_logprobs = not body.stream and body.logprobs
    view = ChatView(ctx, body, generation, f"chatcmpl-{inputs.request_id}", inputs.model)
    return await respond(ctx, request, view)


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
        self, ctx: ServingContext, body: ChatCompletionRequest, gen: Generation, id_, model
    ):
        super().__init__(ctx, body, gen, id_, model)
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
            "usage": self.usage(),
            "system_fingerprint": None,
            "prompt_logprobs": prompt_logprobs(
                self.ctx.renderer, first.prompt_ids, first.prompt_logprobs, body.prompt_logprobs
            )
            if body.prompt_logprobs is not None
            else None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids else None,
        }
