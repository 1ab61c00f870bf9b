"""Batched sampling: logits processors, then greedy or a seeded draw.

Greedy rows take the argmax. The others apply temperature, min_p, top_k and top_p
(top_p over the distribution left by top_k), then draw by inverse CDF: one uniform
number per row, from the request's own generator when it has a seed, so a seeded
request's tokens do not depend on what else is in the batch. One number per row
instead of a Gumbel/exponential race over the vocabulary: on CPU, drawing V
exponentials per row costs more than the rest of a decode step (BENCHMARKS.md §2,
"Figures behind the code").
"""

from __future__ import annotations

import torch

from engine_core.cpu_kernels import CpuKernels
from engine_core.logits_processors import NEG_INF, apply_processors
from engine_core.request import Request

# top_p without top_k first looks for the nucleus among this many best tokens; only
# rows whose nucleus is wider fall back to sorting the whole vocabulary (slow on CPU).
_TOP_P_HEAD = 256
# draw(): tokens per block of the two-level inverse CDF; a target scaled by this stays
# strictly below the mass it is compared with (1 - 2^-20 is exact in fp32).
_DRAW_BLOCK = 128
_BELOW_ONE = 1.0 - 2.0**-20


class Sampler:
    """`kernels`: the CPU kernels, which fuse the final softmax and draw (one pass over
    each row instead of softmax, block sums and scans in separate ops)."""

    def __init__(
        self, vocab_size: int, device: torch.device, seed: int, kernels: CpuKernels | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.kernels = kernels

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """fp32 logits [B, V] (modified in place), one row per request → token ids [B]."""
        return self.sample_keeping(logits, requests, None)[0]

    def sample_keeping(
        self, logits: torch.Tensor, requests: list[Request], keep: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """sample(), and the processed logits of the rows in `keep` (--logprobs-mode
        processed_*): what each row's draw saw, after the processors, temperature,
        min_p, top_k and top_p; for greedy rows, after the processors."""
        # Hot path: the common all-greedy, unprocessed batch is a single argmax.
        processed = [i for i, r in enumerate(requests) if r.needs_processing]
        if processed:
            apply_processors(logits, requests, processed, self.vocab_size)
        kept = logits[keep] if keep else None  # indexing copies
        random_rows = [i for i, r in enumerate(requests) if not r.is_greedy]
        if not random_rows:
            return self._argmax(logits), kept
        if len(random_rows) == len(requests):
            return self._sample_random(logits, requests, kept, keep)
        tokens = self._argmax(logits)
        idx = torch.tensor(random_rows, device=logits.device)
        # keep's rows among the random rows, as positions in each list
        where = {row: j for j, row in enumerate(random_rows)}
        pairs = [(k, where[row]) for k, row in enumerate(keep or ()) if row in where]
        final = logits.new_empty(len(pairs), logits.shape[1]) if pairs else None
        tokens[idx] = self._sample_random(
            logits[idx], [requests[i] for i in random_rows], final, [j for _, j in pairs]
        )[0]
        for n, (k, _) in enumerate(pairs):
            kept[k] = final[n]
        return tokens, kept

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and logits.device.type == "cpu":
            return self.kernels.argmax(logits)  # the same answer, several times faster
        return logits.argmax(dim=-1)

    def _sample_random(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        out: torch.Tensor | None = None,
        rows_out: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens for rows that draw; with `out`, out[i] = the final logits of row
        rows_out[i] (what the draw saw)."""
        dev = logits.device
        temps = [r.params.temperature for r in requests]
        if any(t != 1.0 for t in temps):  # x / 1.0 is x: skip a pass over [B, V]
            logits = logits.div_(torch.tensor(temps, device=dev)[:, None])
        min_p = [r.params.min_p for r in requests]
        if any(min_p):
            probs = torch.softmax(logits, dim=-1)
            floor = torch.tensor(min_p, device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
            logits.masked_fill_(probs < floor, NEG_INF)
        rows = [i for i, r in enumerate(requests) if r.params.top_k > 0 or r.params.top_p < 1]
        if rows:
            picked = [requests[i] for i in rows]
            top_k = [r.params.top_k for r in picked]
            top_p = [r.params.top_p for r in picked]
            if len(rows) == len(requests):
                logits = truncate(logits, top_k, top_p)
            else:
                idx = torch.tensor(rows, device=dev)
                logits[idx] = truncate(logits[idx], top_k, top_p)
        if out is not None and rows_out:
            out.copy_(logits[rows_out])  # before the draw, which may work in place
        u = self._uniforms(requests, dev)
        if self.kernels is not None:
            return self.kernels.softmax_draw(logits, u), out
        return draw(torch.softmax(logits, dim=-1), u), out

    def _uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """[B, 1] uniforms in [0, 1): seeded rows from their own generator."""
        u = torch.rand(len(requests), 1, generator=self.generator, device=device)
        for i, r in enumerate(requests):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator).item()
        return u


def draw(probs: torch.Tensor, u: torch.Tensor, block: int = _DRAW_BLOCK) -> torch.Tensor:
    """Inverse-CDF draw: per row, the first token whose cumulative mass passes u times
    the row's total; zero-mass tokens never qualify. probs [B, V] >= 0, u [B, 1] in [0, 1).

    Two levels instead of one cumulative sum over the whole vocabulary (a serial scan,
    slow at large batches): block sums find the block, then a scan inside that one
    block finds the token.
    """
    rows, vocab = probs.shape
    num_blocks = -(-vocab // block)
    if num_blocks * block != vocab:
        probs = torch.nn.functional.pad(probs, (0, num_blocks * block - vocab))
    blocks = probs.view(rows, num_blocks, block)
    block_cdf = blocks.sum(dim=-1).cumsum_(dim=-1)  # [B, num_blocks]
    total = block_cdf[:, -1:]
    # Strictly below the total, so rounding can never land past the last positive token.
    target = torch.minimum(u * total, total * _BELOW_ONE)
    j = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)
    before = block_cdf.gather(1, (j - 1).clamp_(min=0)).masked_fill_(j == 0, 0.0)
    inner = blocks.gather(1, j[:, :, None].expand(rows, 1, block))[:, 0].cumsum_(dim=-1)
    # The same guard inside the block: its own scan may round differently from its sum.
    rest = torch.minimum(target - before, inner[:, -1:] * _BELOW_ONE)
    k = torch.searchsorted(inner, rest, right=True).clamp_(max=block - 1)
    return (j * block + k)[:, 0].clamp_(max=vocab - 1)


def truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's top_k best tokens, then the top_p nucleus of what is left;
    the rest become -inf. top_k <= 0 (or >= V) and top_p = 1 mean no limit."""
    vocab = logits.shape[1]
    dev = logits.device
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)[:, None]
    p = torch.tensor(top_p, device=dev)[:, None]
    width = int(ks.max())
    if width == vocab:
        width = min(vocab, _TOP_P_HEAD)
    while True:
        values, order = logits.topk(width, dim=-1)  # sorted, best first
        drop = torch.arange(width, device=dev)[None] >= ks
        values = values.masked_fill(drop, NEG_INF)
        # Probabilities of the top_k-truncated distribution: renormalised over the
        # candidates when top_k cuts inside them, over the whole row otherwise.
        within = ks <= width
        total = torch.where(
            within, values.logsumexp(-1, keepdim=True), logits.logsumexp(-1, keepdim=True)
        )
        probs = (values - total).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        # The nucleus ends among the candidates once their mass reaches top_p.
        if width == vocab or bool((within | (probs.sum(-1, keepdim=True) >= p)).all()):
            break
        width = vocab
    # Drop a token once the tokens ranked above it reach top_p; the best always stays.
    drop |= mass_before >= p
    drop[:, 0] = False
    out = torch.full_like(logits, NEG_INF)
    return out.scatter_(1, order, values.masked_fill(drop, NEG_INF))
