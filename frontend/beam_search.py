"""Beam search from the API side: vLLM's request rules, and one engine request per prompt
whose single answer fills that prompt's `n` choices.

`use_beam_search` with `n` searches `n` beams and answers the `n` best, best first;
`length_penalty` and `early_stopping` shape the search (engine_core/beam_scoring.py).
As in vLLM, the beams are ranked by the model's raw log-probabilities: temperature,
top_p/top_k/min_p, penalties, logit_bias and seed do not change them. Unlike vLLM, zserve
also finishes beams on `stop_token_ids`, keeps `min_tokens`, and cuts each answer at its
first `stop` string.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from frontend.engine_state import RequestStream
from frontend.errors import APIError
from frontend.generation import Choice, ChoiceDelta, Generation
from frontend.openai_models import SamplingFields
from protocol.messages import (
    BeamSequence,
    EarlyStopping,
    EngineCoreOutput,
    FinishReason,
    Logprobs,
    SamplingParams,
    beam_search_kv_blocks,
    engine_request_id,
    max_beam_width_message,
    now,
)

if TYPE_CHECKING:
    from frontend.request_inputs import RequestInputs
    from frontend.serving import ServingContext

# Request fields that constrain the output: a beam search would ignore them (as vLLM's
# does), so they are refused rather than answered unconstrained.
_CONSTRAINT_KEYS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def check_beam_search(body: SamplingFields, *, completions: bool) -> None:
    """A 400 for what vLLM refuses with beam search, and for output constraints."""
    extra = body.model_extra or {}
    if completions and body.stream:
        raise APIError("Streaming is not currently supported with beam search", param="stream")
    if completions and body.echo and body.logprobs is not None:
        raise APIError(
            "`echo` with `logprobs` is not supported with beam search because beam search "
            "does not compute prompt logprobs.",
            param="echo",
        )
    if getattr(body, "logprob_token_ids", None) or extra.get("logprob_token_ids"):
        raise APIError(
            "`logprob_token_ids` is not supported with beam search.", param="logprob_token_ids"
        )
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        raise APIError(
            "response_format: structured output is not supported with beam search",
            param="response_format",
        )
    for key in _CONSTRAINT_KEYS:
        if getattr(body, key, None) is not None or extra.get(key) is not None:
            raise APIError(f"{key}: not supported with beam search", param=key)


def no_step_search(inputs: RequestInputs) -> RequestInputs:
    """Completions' echo with max_tokens 0: as in vLLM, a search of no step, whose one
    beam (the prompt) is the only choice of each prompt. Other requests as they are."""
    body = inputs.body
    if body.max_tokens != 0:
        return inputs
    return dataclasses.replace(
        inputs, body=body.model_copy(update={"n": 1, "use_beam_search": False})
    )


def beam_params(
    ctx: ServingContext,
    body: SamplingFields,
    params: list[SamplingParams],
    prompts: list[list[int]],
) -> list[SamplingParams]:
    """The engine's parameters of a beam search of width `n` (one per prompt), once it
    fits the engines: its beams run in one step, and its blocks fit the KV cache at worst."""
    client = ctx.client
    width = body.n
    if client.max_beam_width and width > client.max_beam_width:
        raise APIError(max_beam_width_message(width, client.max_beam_width), param="n")
    if body.early_stopping is None or body.early_stopping == "never":
        rule = EarlyStopping.EXACT  # vLLM's answer (it runs every search to max_tokens)
    else:
        rule = EarlyStopping.FIRST if body.early_stopping else EarlyStopping.HEURISTIC
    searches = []
    for prompt, p in zip(prompts, params):
        needed = beam_search_kv_blocks(len(prompt), p.max_tokens, width, client.block_size)
        if needed > client.num_kv_blocks:
            raise APIError(
                f"beam search with n={width} and max_tokens {p.max_tokens} over "
                f"{len(prompt)} prompt tokens may need {needed} KV blocks, but this server's "
                f"cache holds {client.num_kv_blocks}; lower n or max_tokens",
                param="n",
            )
        searches.append(
            msgspec.structs.replace(
                p,
                beam_width=width,
                length_penalty=float(body.length_penalty),
                early_stopping=rule,
                prompt_logprobs=None,  # as vLLM: a beam search computes none
            )
        )
    return searches


@dataclass(slots=True)
class _Search:
    """One prompt's beam search: its engine request and the choices it answers."""

    request_id: str
    choices: list[Choice]
    stream: RequestStream | None = None


class BeamGeneration(Generation):
    """A Generation whose prompts each run one beam search (one engine request) that
    answers all `n` choices of the prompt at once, when it is over."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        n = self.params_n
        self.searches = [
            _Search(
                engine_request_id(self.request_id, p, "beams"),
                self.choices[p * n : (p + 1) * n],
            )
            for p in range(len(self.prompts))
        ]

    def start(self) -> None:
        client = self.client
        engine = client.pick_engine(self.engine_rank, prefer_lora=self.lora_name)
        self.engine = engine
        group = client.new_group() if len(self.searches) > 1 else 0
        try:
            for search in self.searches:
                first = search.choices[0]
                request = self.engine_request(
                    search.request_id, first.prompt_ids, first.params, group
                )
                search.stream = client.add_request(request, engine, self.event)
        except Exception:
            self.abort()
            raise

    def abort(self) -> None:
        ids = [s.request_id for s in self.searches if s.stream and not s.stream.finished]
        if ids:
            self.client.abort(ids)

    def _open(self) -> list[_Search]:
        """The searches still running: deltas() gives every choice of a prompt at once,
        with its whole text, when its search ends."""
        return [s for s in self.searches if not s.choices[0].finished]

    def _collect(self, search: _Search, batch: list[ChoiceDelta]) -> None:
        batch.extend(self._answer(search, search.stream.items[0]))

    def _answer(self, search: _Search, out: EngineCoreOutput) -> list[ChoiceDelta]:
        if out.finish_reason is not None:
            self._raise_failure(out)  # refused, asleep or failed: as any generation's
        if not out.beams:
            self.abort()
            raise APIError(f"the engine failed request {self.request_id}: no beams", 500)
        if len(out.beams) != len(search.choices):
            raise APIError(
                f"the engine answered {len(out.beams)} beams for request {self.request_id}, "
                f"not {len(search.choices)}",
                500,
            )
        return [self._apply_beam(c, b, out) for c, b in zip(search.choices, out.beams)]

    def _apply_beam(self, choice: Choice, beam: BeamSequence, out: EngineCoreOutput) -> ChoiceDelta:
        """One beam as its choice's whole output. As in vLLM, a final EOS or stop token is
        neither text nor (without include_stop_str_in_output) a token of the answer."""
        ids, rows = beam.token_ids, beam.logprobs
        stopped = beam.finish_reason is FinishReason.STOP
        include_stop = choice.detok.include_stop
        if stopped and not include_stop:
            ids, rows = ids[:-1], _drop_last(rows)
        text_ids = ids[:-1] if stopped and include_stop and beam.stop_reason is None else ids
        choice.first_token_time = choice.last_token_time = now()
        choice.num_cached_tokens = out.num_cached_tokens
        choice.num_generated = len(ids)
        choice.token_ids = list(ids)
        if self.observer is not None:
            self.observer.first_token(choice)
        if self.keep_logprobs and rows is not None:
            choice.logprob_rows.append(rows)
        stop_string = choice.detok.add(text_ids)
        if stop_string is not None:
            choice.finish_reason, choice.stop_reason = "stop", stop_string
        else:
            choice.finish_reason = beam.finish_reason.openai_name
            choice.stop_reason = beam.stop_reason
        return ChoiceDelta(
            index=choice.index,
            text=choice.detok.take(final=True),
            token_ids=list(ids),
            logprobs=rows,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )


def _drop_last(rows: Logprobs | None) -> Logprobs | None:
    if rows is None:
        return None
    return Logprobs(rows.token_ids[:-1], rows.logprobs[:-1], rows.ranks[:-1])
