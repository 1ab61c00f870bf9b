"""A generation as the VllmEngine service answers it: token ids out, never text.

Streaming (the gateway's usual mode): one GenerateStreamChunk per engine output of a
choice, its new token ids and logprobs (the prompt's logprobs ride on a choice's first
chunk), then a GenerateComplete when that choice finishes. Not streaming: one
GenerateComplete per choice once all are done. A Complete carries every output id of
its choice, the counts, the finish reason and the stop that matched (vLLM's
stop_reason: a stop token id or a stop string); the gateway detokenizes and trims a
matched stop string from the text itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from frontend.generation import Choice, Generation
from protocol.messages import Logprobs


async def stream_responses(
    generation: Generation, stream_interval: int = 1
) -> AsyncIterator[pb.GenerateResponse]:
    """Hot path: one chunk per engine output of each choice (per --stream-interval
    tokens), and each choice's Complete as soon as it finishes."""
    choices = generation.choices
    top_n = choices[0].params.logprobs
    prompt_top_n = choices[0].params.prompt_logprobs
    started: set[int] = set()
    async for batch in generation.deltas(None, stream_interval):
        for d in batch:
            choice = choices[d.index]
            first = d.index not in started
            if d.token_ids or (first and prompt_top_n is not None):
                started.add(d.index)
                yield pb.GenerateResponse(
                    chunk=pb.GenerateStreamChunk(
                        token_ids=d.token_ids,
                        prompt_tokens=len(choice.prompt_ids),
                        completion_tokens=len(d.token_ids),
                        cached_tokens=choice.num_cached_tokens,
                        output_logprobs=output_logprobs(d.logprobs, top_n),
                        input_logprobs=(input_logprobs(choice, prompt_top_n) if first else None),
                        index=d.index,
                    )
                )
            if d.finish_reason is not None:
                yield complete(choice, top_n=None, prompt_top_n=None)


def final_responses(generation: Generation) -> list[pb.GenerateResponse]:
    """A finished generation's answer when not streaming: one Complete per choice."""
    choices = generation.choices
    top_n = choices[0].params.logprobs
    prompt_top_n = choices[0].params.prompt_logprobs
    return [complete(c, top_n, prompt_top_n) for c in choices]


def complete(choice: Choice, top_n: int | None, prompt_top_n: int | None) -> pb.GenerateResponse:
    """A finished choice. `top_n` / `prompt_top_n` None: no logprobs in it (a stream
    sent them in its chunks)."""
    stop = choice.stop_reason
    matched = {}
    if isinstance(stop, str):
        matched["matched_stop_str"] = stop
    elif stop is not None:
        matched["matched_token_id"] = stop
    rows = _joined(choice.logprob_rows) if top_n is not None else None
    return pb.GenerateResponse(
        complete=pb.GenerateComplete(
            output_ids=choice.token_ids,
            finish_reason=choice.finish_reason or "abort",
            prompt_tokens=len(choice.prompt_ids),
            completion_tokens=choice.num_generated,
            cached_tokens=choice.num_cached_tokens,
            output_logprobs=output_logprobs(rows, top_n),
            input_logprobs=input_logprobs(choice, prompt_top_n),
            index=choice.index,
            **matched,
        )
    )


def output_logprobs(rows: Logprobs | None, top_n: int | None) -> pb.OutputLogProbs | None:
    """Engine rows (column 0: the sampled token, then the top-n best first) → the
    proto's sampled logprobs and, when asked for, the top-n alternatives."""
    if rows is None or top_n is None:
        return None
    out = pb.OutputLogProbs(
        token_logprobs=[lps[0] for lps in rows.logprobs],
        token_ids=[ids[0] for ids in rows.token_ids],
    )
    if top_n:
        out.top_logprobs.extend(
            pb.TopLogProbs(values=lps[1 : top_n + 1], token_ids=ids[1 : top_n + 1])
            for ids, lps in zip(rows.token_ids, rows.logprobs, strict=True)
        )
    return out


def input_logprobs(choice: Choice, top_n: int | None) -> pb.InputLogProbs | None:
    """One entry per prompt token; the first has no logprob (nothing precedes it)."""
    rows = choice.prompt_logprobs
    if rows is None or top_n is None:
        return None
    out = pb.InputLogProbs(token_ids=choice.prompt_ids)
    out.token_logprobs.add()
    if top_n:
        out.top_logprobs.add()
    count = len(choice.prompt_ids) - 1  # the engine may have computed a row more
    for ids, lps in zip(rows.token_ids[:count], rows.logprobs[:count], strict=True):
        out.token_logprobs.add(value=lps[0])
        if top_n:
            out.top_logprobs.add(values=lps[1 : top_n + 1], token_ids=ids[1 : top_n + 1])
    return out


def _joined(rows: list[Logprobs]) -> Logprobs | None:
    if not rows:
        return None
    if len(rows) == 1:
        return rows[0]
    return Logprobs(
        [i for r in rows for i in r.token_ids],
        [v for r in rows for v in r.logprobs],
        [k for r in rows for k in r.ranks],
    )
