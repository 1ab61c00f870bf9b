"""vLLM's tokens-in, tokens-out door (--enable-scale-out): POST /inference/v1/generate
runs a request whose prompt is already token ids (what the /render routes make of a
chat or completion request, serving_render.py), and POST /inference/v1/abort_requests
ends requests by id, on whichever API server and engine they run.

A generate request is the completion pipeline's (generate_input.py maps it), so its
limits, admission, LoRA, priority and structured outputs are the completion route's.
Its answer is vLLM's: `output_mode` "tokens" gives token ids (and logprobs by id) and
skips detokenization unless stop strings need it; "text" adds the text and chat-shaped
logprobs.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend import engine_actions
from frontend.errors import APIError
from frontend.generate_input import AbortRequests, GenerateBody, in_sampling_params, renamed
from frontend.generation import ChoiceDelta, Generation
from frontend.limits import check_request_id
from frontend.logprobs import chat_logprobs, token_id_logprobs
from frontend.reasoning import Mode, reasoning_boundary
from frontend.request_inputs import parse_body, read_inputs
from frontend.responses import respond
from frontend.sampling import check_token_ids, logprob_count, sampling_params
from frontend.serving import ServingContext
from frontend.streaming_view import StreamingView
from frontend.structured_outputs import request_constraint
from frontend.usage import usage
from protocol.messages import Logprobs, StructuredOutputs

# The message vLLM answers on these routes without --enable-scale-out (a 403).
SCALE_OUT_OFF = (
    "Scale-out endpoints are disabled. Restart zserve serve with --enable-scale-out to enable them."
)
# vLLM's prefixes of the ids its responses carry; an abort may name either form.
_ID_PREFIXES = ("generate-tokens-", "chatcmpl-", "cmpl-")


def scale_out_enabled(config) -> bool:
    return config.enable_scale_out


def tokens_only(config) -> bool:
    return config.tokens_only


async def scale_out_off(ctx: ServingContext, request: Request) -> Response:
    raise APIError(SCALE_OUT_OFF, 403, type_="PermissionDeniedError")


async def create_generate(ctx: ServingContext, request: Request) -> Response:
    try:
        inputs = await read_inputs(ctx, request, GenerateBody)
        body: GenerateBody = inputs.body
        if ctx.config.tokens_only:
            _needs_no_text(body, "a --tokens-only server decodes none")
        elif not body.detokenize:
            _needs_no_text(body, "sampling_params.detokenize is false")
        prompt = body.token_ids
        check_token_ids(prompt, ctx.vocab_size, "token_ids")
        constraint = request_constraint(body, ctx.config.structured_outputs)
        params = sampling_params(
            ctx,
            body,
            [prompt],
            max_tokens=body.max_tokens if body.max_tokens_given else None,
            logprobs=body.logprobs,
        )
    except APIError as e:
        raise in_sampling_params(e) from None
    if constraint is not None:
        constraint = _gate(ctx, body, constraint)
        params = [msgspec.structs.replace(p, structured_outputs=constraint) for p in params]
    generation = ctx.submit(inputs, [prompt], params)
    generation.keep_logprobs = not body.stream and body.logprobs is not None
    # Token ids alone need no text, unless stop strings are matched against it.
    generation.detokenize = body.output_mode == "text" or bool(body.stop_strings)
    view = GenerateView(ctx, body, generation, f"generate-tokens-{inputs.request_id}", inputs.model)
    try:
        return await respond(ctx, request, view)
    except APIError as e:  # the engine's refusal (a constraint that does not compile)
        raise in_sampling_params(e) from None


def _needs_no_text(body: GenerateBody, why: str) -> None:
    """No text will be decoded (`why`): what needs it is refused, as vLLM refuses it."""
    if body.stop_strings:
        raise APIError(
            f"a stop string needs the output's text, and {why}; use stop_token_ids",
            param="stop",
        )
    if body.output_mode != "tokens":
        raise APIError(
            f"output_mode={body.output_mode!r} needs the output's text, and {why}; use "
            f"output_mode 'tokens'",
            param="output_mode",
        )


def _gate(ctx: ServingContext, body: GenerateBody, spec: StructuredOutputs) -> StructuredOutputs:
    """Where the constraint starts: after the reasoning, with --reasoning-parser, unless
    the request says the reasoning has ended (`reasoning_ended` true, as /render
    resolves it); not said, the prompt tells, as for chat."""
    parsers = ctx.chat_parsers
    if parsers.reasoning_parser is None or parsers.constrain_reasoning or body.reasoning_ended:
        return spec
    reasoning = parsers.reasoning_parser(body.chat_template_kwargs)
    if body.reasoning_ended is None:
        mode = reasoning.mode_after(ctx.renderer.decode(body.token_ids, skip_special_tokens=False))
    else:
        mode = Mode.REASONING
    boundary = reasoning_boundary(
        reasoning, mode, lambda text: ctx.renderer.encode(text, add_special_tokens=False)
    )
    if not boundary.in_reasoning or not boundary.end_ids:
        return spec
    return msgspec.structs.replace(spec, reasoning_end_ids=list(boundary.end_ids))


async def abort_requests(ctx: ServingContext, request: Request) -> Response:
    """End the named requests wherever they run; answers which of the ids named a
    running request."""
    ids = (await parse_body(ctx, request, AbortRequests)).request_ids
    forms = {rid: _id_forms(rid) for rid in ids}
    for rid in ids:
        check_request_id(rid, "request_ids", ctx.limits)
    wanted = sorted({form for rid_forms in forms.values() for form in rid_forms})
    found = set(await engine_actions.abort_requests(ctx.client, wanted))
    return JSONResponse({"aborted": [rid for rid in ids if found.intersection(forms[rid])]})


def _id_forms(rid: str) -> set[str]:
    """The API request ids an abort's id may name: itself, or the id within a
    response's id (generate-tokens-ID, chatcmpl-ID, cmpl-ID)."""
    return {rid, *(rid[len(p) :] for p in _ID_PREFIXES if rid.startswith(p))}


class GenerateView(StreamingView):
    """Shapes a generate request's output as vLLM's GenerateResponse and its chunks."""

    body: GenerateBody
    fingerprinted = False  # vLLM's generate answers carry none

    def __init__(
        self, ctx: ServingContext, body: GenerateBody, gen: Generation, id_: str, model: str
    ) -> None:
        super().__init__(ctx, body, gen, id_, model)
        self.text_mode = body.output_mode == "text"
        self.prompt_sent = not body.return_token_ids  # a stream's first chunk carries it
        listed = body.logprob_token_ids
        self.ranked = listed is None
        self.top_n = 0
        if body.logprobs is not None:
            k = len(listed) + 1 if listed is not None else body.logprobs
            self.top_n = max(logprob_count(k, ctx.vocab_size), 1)
        self.as_ids = ctx.tokens_as_ids(body)

    def error_event(self, error: dict) -> bytes:
        inner = error["error"]
        inner["message"], inner["param"] = renamed(inner["message"], inner["param"])
        return super().error_event(error)

    def _logprobs(self, rows: Logprobs | None) -> dict | None:
        if self.body.logprobs is None:
            return None
        if rows is None:
            return {"content": []}
        if self.text_mode:
            return {"content": chat_logprobs(self.ctx.renderer, rows, self.top_n, self.as_ids)}
        return {"content": token_id_logprobs(rows, self.top_n, self.ranked)}

    def usage(self, stream: bool = False) -> dict:
        return usage(self.gen, self.ctx.config.enable_prompt_tokens_details, stream=stream)

    def chunk(self, choices: list[dict], usage: dict | None) -> dict:
        chunk = {"request_id": self.id, "usage": usage}
        if not self.prompt_sent and choices:
            self.prompt_sent = True
            chunk["prompt_token_ids"] = self.gen.choices[0].prompt_ids
        chunk["output_mode"] = self.body.output_mode
        chunk["choices"] = choices
        return chunk

    def _choice(self, index: int, finish_reason, stop_reason, token_ids: list[int]) -> dict:
        return {
            "index": index,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "token_ids": token_ids,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,  # zserve does not version its weights
        }

    def stream_choices(self, d: ChoiceDelta) -> list[dict]:
        if not (d.token_ids or d.finish_reason or (self.text_mode and d.text)):
            return []
        choice = self._choice(d.index, d.finish_reason, d.stop_reason, d.token_ids)
        if self.text_mode:
            choice["text"] = d.text
        choice["logprobs"] = self._logprobs(d.logprobs)
        return [choice]

    def response(self) -> dict:
        body = self.body
        choices = []
        for c in self.gen.choices:
            choice = self._choice(c.index, c.finish_reason or "stop", c.stop_reason, c.token_ids)
            if self.text_mode:
                choice["text"] = c.detok.text
            rows = None
            if c.logprob_rows:
                rows = Logprobs(
                    [r for part in c.logprob_rows for r in part.token_ids],
                    [r for part in c.logprob_rows for r in part.logprobs],
                    [r for part in c.logprob_rows for r in part.ranks],
                )
            choice["logprobs"] = self._logprobs(rows)
            choices.append(choice)
        first = self.gen.choices[0]
        return {
            "request_id": self.id,
            "model": self.model,
            "created": self.created,
            "usage": self.usage(),
            "prompt_logprobs": self.prompt_logprobs(first),
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": body.output_mode,
            "choices": choices,
        }
