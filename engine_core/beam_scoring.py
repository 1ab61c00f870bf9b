"""Beam search's arithmetic: candidates, scores and when a search may stop.

vLLM's rules, so that a search answers what vLLM's OpenAI server answers:

- every step, each live beam offers its 2 x width most likely next tokens (raw
  log-probabilities: no temperature, penalties or truncation);
- an offered EOS or stop token finishes that beam; the other offers compete on
  cumulative log-probability, and the best `width` of them are the live beams;
- a sequence's score is cumulative_logprob / length ** length_penalty, where the
  length counts the prompt and the generated tokens but not a final EOS or stop token;
- the answer is the `width` best scores among the finished beams and, when the search
  ran to max_tokens, the live ones.

vLLM runs every search to max_tokens. Here a search stops as soon as no live beam can
reach a better score than the worst of `width` finished ones (EarlyStopping.EXACT): the
same answer, sooner. `early_stopping` true or false asks for transformers' (and vLLM's
former) earlier, approximate stops instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol.messages import EarlyStopping, FinishReason

LogprobRow = tuple[list[int], list[float], int]  # chosen token first, then the top-n; rank


@dataclass(slots=True)
class Beam:
    """One hypothesis: its generated tokens, their summed log-probability and, while it
    runs, the sequence holding its KV cache."""

    tokens: list[int]
    cum_logprob: float
    rows: list[LogprobRow] | None = None  # per token, when the request asked for logprobs
    request: object | None = None  # its engine_core.request.Request while it runs
    finish_reason: FinishReason = FinishReason.LENGTH
    stop_reason: int | None = None
    key: float = 0.0  # score_key, once finished


def score_key(cum_logprob: float, length: int, length_penalty: float) -> float:
    """A number that orders sequences as cum_logprob / length ** length_penalty does,
    without its overflow: log-space, since every score is <= 0."""
    if cum_logprob >= 0.0:
        return math.inf
    return length_penalty * math.log(max(length, 1)) - math.log(-cum_logprob)


@dataclass(slots=True)
class Step:
    """One step's outcome: the new live beams (best first, each with its parent's index)
    and the beams that finished on an EOS or stop token."""

    live: list[tuple[int, Beam]]
    finished: list[Beam]


def expand(
    parents: list[Beam],
    logits: torch.Tensor,
    width: int,
    stop_ids: torch.Tensor | None,
    may_stop: bool,
    eos_ids: frozenset[int],
    num_logprobs: int | None,
) -> Step:
    """The next step of a search from fp32 `logits` [len(parents), V], one row per parent.

    `stop_ids`: the tokens that finish a beam (EOS unless ignore_eos, stop_token_ids), or
    None. Offers of them never live on: they finish the beam, or while `may_stop` is
    false (min_tokens) they are dropped, as if the model could not say them.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    k = min(2 * width, logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(max(k, num_logprobs or 0), dim=-1)
    top_lp, top_ids = top_lp.cpu(), top_ids.cpu()  # the rest is a few numbers per beam
    cands = top_lp[:, :k].double()
    cands += torch.tensor([p.cum_logprob for p in parents], dtype=torch.float64)[:, None]
    finished: list[Beam] = []
    if stop_ids is not None:
        stops = torch.isin(top_ids[:, :k], stop_ids)
        for r, j in stops.nonzero().tolist() if may_stop else ():
            token = int(top_ids[r, j])
            beam = _child(
                parents[r], token, float(cands[r, j]), top_lp[r], top_ids[r], j, num_logprobs
            )
            beam.finish_reason = FinishReason.STOP
            beam.stop_reason = None if token in eos_ids else token
            finished.append(beam)
        cands.masked_fill_(stops, -math.inf)
    values, flat = cands.flatten().topk(min(width, cands.numel()))
    live = []
    for value, index in zip(values.tolist(), flat.tolist()):
        if value == -math.inf:
            break  # fewer offers than beams that may live on
        r, j = divmod(index, k)
        token = int(top_ids[r, j])
        live.append((r, _child(parents[r], token, value, top_lp[r], top_ids[r], j, num_logprobs)))
    return Step(live, finished)


def _child(
    parent: Beam,
    token: int,
    cum_logprob: float,
    row_lp: torch.Tensor,
    row_ids: torch.Tensor,
    j: int,
    num_logprobs: int | None,
) -> Beam:
    rows = None
    if num_logprobs is not None:
        lps = row_lp.tolist()
        lp = lps[j]
        top = num_logprobs
        # Rank in the full distribution: the row is sorted, so the first equal value
        # sits right after every better one.
        rows = parent.rows + [
            ([token, *row_ids[:top].tolist()], [lp, *lps[:top]], lps.index(lp) + 1)
        ]
    return Beam(parent.tokens + [token], cum_logprob, rows)


def should_stop(
    live: list[Beam],
    finished: list[Beam],
    width: int,
    prompt_len: int,
    max_len: int,
    length_penalty: float,
    rule: EarlyStopping,
) -> bool:
    """Whether the search is over before max_tokens. `live` best first, `finished` the
    `width` best so far, best first; `max_len` the longest a sequence may grow."""
    if not live:
        return True
    if len(finished) < width:
        return False
    if rule == EarlyStopping.FIRST:
        return True
    length = prompt_len + len(live[0].tokens)
    if rule == EarlyStopping.EXACT and length_penalty > 0.0:
        length = max_len  # the longer, the better the score could still get
    # Log-probabilities only fall: no descendant of the best live beam beats this.
    return finished[-1].key >= score_key(live[0].cum_logprob, length, length_penalty)
