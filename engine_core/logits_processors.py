"""Per-request logits processors: allowed_token_ids, logit_bias, min_tokens, penalties.

They run before the choice (greedy or random) and only on the rows that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from protocol.messages import SamplingParams

if TYPE_CHECKING:
    from engine_core.request import Request

# The value that masks a logit (or an attention score) out: softmax gives it no weight.
NEG_INF = float("-inf")


def has_penalties(params: SamplingParams) -> bool:
    """Whether the repetition, presence or frequency penalty applies."""
    return bool(
        params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    )


def needs_processing(params: SamplingParams) -> bool:
    """Whether a processor here changes this request's logits before the choice (the
    sampler skips the rest)."""
    return bool(
        params.logit_bias or params.allowed_token_ids or params.min_tokens
    ) or has_penalties(params)


class LogitsState:
    """Per-request tensors the processors reuse across steps, built lazily."""

    __slots__ = ("allowed_mask", "prompt_mask", "output_counts", "num_counted")

    def __init__(self, request: Request, vocab_size: int, device: torch.device) -> None:
        params = request.params
        self.allowed_mask = None
        if params.allowed_token_ids:
            self.allowed_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.allowed_mask[params.allowed_token_ids] = True
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.prompt_mask[request.all_token_ids[: request.prompt_len]] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.num_counted = 0

    def counts(self, request: Request) -> torch.Tensor:
        """Occurrences of each token in the output so far."""
        new = request.all_token_ids[request.prompt_len + self.num_counted :]
        if new:
            idx = torch.tensor(new, device=self.output_counts.device)
            self.output_counts.index_add_(0, idx, torch.ones(len(new), device=idx.device))
            self.num_counted += len(new)
        return self.output_counts


def apply_processors(
    logits: torch.Tensor, requests: list[Request], rows: list[int], vocab_size: int
) -> None:
    """Apply each listed row's processors to fp32 `logits` [B, V] in place."""
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    penalized: list[int] = []
    for i in rows:
        request = requests[i]
        params = request.params
        state = request.sampler_state
        if state is None:
            state = request.sampler_state = LogitsState(request, vocab_size, logits.device)
        if state.allowed_mask is not None:
            logits[i].masked_fill_(~state.allowed_mask, NEG_INF)
        if params.logit_bias:
            bias_rows += [i] * len(params.logit_bias)
            bias_cols += params.logit_bias.keys()
            bias_vals += params.logit_bias.values()
        # A constraint whose text is whole allows only EOS: it wins over min_tokens' ban.
        if request.num_output_tokens < params.min_tokens and not request.constraint_complete():
            stops = request.eos_ids | request.stop_ids
            ban_rows += [i] * len(stops)
            ban_cols += stops
        if has_penalties(params):
            penalized.append(i)
    dev = logits.device
    if bias_rows:
        index = (torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev))
        logits.index_put_(index, torch.tensor(bias_vals, device=dev), accumulate=True)
    if ban_rows:
        logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = NEG_INF
    if penalized:
        _apply_penalties(logits, [requests[i] for i in penalized], penalized)


def _apply_penalties(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    sub = logits[idx]
    counts = torch.stack([r.sampler_state.counts(r) for r in requests])
    seen = torch.stack([r.sampler_state.prompt_mask for r in requests]) | (counts > 0)
    rep = torch.tensor([r.params.repetition_penalty for r in requests], device=dev)[:, None]
    # HF's multiplicative rule over prompt + output: shrink positive, grow negative.
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    # OpenAI's additive rules over the output only.
    freq = torch.tensor([r.params.frequency_penalty for r in requests], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in requests], device=dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0)
    logits[idx] = sub
