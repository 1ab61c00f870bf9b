"""Logprobs of chosen tokens (sampled or prompt) with their rank and the top-n.

From the scores the engine passes: the model's raw logits by default (before
penalties, temperature and truncation, as vLLM's default `raw_logprobs`), or the
sampler's processed ones (--logprobs-mode processed_*); with `as_logits` the values
are those logits themselves, not their log-softmax (--logprobs-mode *_logits).
"""

from __future__ import annotations

import torch

from protocol.messages import Logprobs


def _rows(
    logprobs: torch.Tensor, token_ids: torch.Tensor, max_top: int
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
    ids = token_ids[:, None]
    lps = chosen
    if max_top:
        top_lp, top_ids = logprobs.topk(max_top, dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        lps = torch.cat([lps, top_lp], dim=1)
    return ids.tolist(), lps.tolist(), ranks


def logprobs_per_row(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: list[int],
    listed: list[list[int] | None] | None = None,
    as_logits: bool = False,
) -> list[Logprobs]:
    """A single-position Logprobs for each row of fp32 `logits` [R, V]: row i keeps
    num_top[i], or, where listed[i] is given, exactly those tokens after the chosen
    one (logprob_token_ids)."""
    logprobs = logits if as_logits else torch.log_softmax(logits, dim=-1)
    if listed is None or not any(listed):
        ids, lps, ranks = _rows(logprobs, token_ids, max(num_top))
        return [
            Logprobs(token_ids=[ids[i][: n + 1]], logprobs=[lps[i][: n + 1]], ranks=[ranks[i]])
            for i, n in enumerate(num_top)
        ]
    top = max((n for n, wanted in zip(num_top, listed, strict=True) if not wanted), default=0)
    ids, lps, ranks = _rows(logprobs, token_ids, top)
    rows = []
    for i, (n, wanted) in enumerate(zip(num_top, listed, strict=True)):
        if wanted:
            row_ids = [ids[i][0], *wanted]
            values = logprobs[i, torch.tensor(row_ids, device=logits.device)].tolist()
            rows.append(Logprobs(token_ids=[row_ids], logprobs=[values], ranks=[ranks[i]]))
        else:
            rows.append(Logprobs([ids[i][: n + 1]], [lps[i][: n + 1]], [ranks[i]]))
    return rows


def logprobs_of_positions(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, as_logits: bool = False
) -> Logprobs:
    """One Logprobs covering consecutive positions (prompt logprobs of a chunk)."""
    scores = logits if as_logits else torch.log_softmax(logits, dim=-1)
    ids, lps, ranks = _rows(scores, token_ids, num_top)
    return Logprobs(token_ids=ids, logprobs=lps, ranks=ranks)


def concat_logprobs(parts: list[Logprobs]) -> Logprobs:
    return Logprobs(
        token_ids=[row for p in parts for row in p.token_ids],
        logprobs=[row for p in parts for row in p.logprobs],
        ranks=[r for p in parts for r in p.ranks],
    )
