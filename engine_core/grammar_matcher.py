"""Per-request grammar state and the step's token bitmask.

A RequestGrammar follows one request's output token by token. Once the constraint is
complete only the stop (EOS) tokens are allowed; accepting one terminates the
grammar, and the engine ends the request there. The state lives with the request,
not the KV cache, so preemption (which recomputes KV from the kept token ids) leaves
it untouched.

StepBitmask turns the grammars of a step's sampling rows into -inf on the logits of
exactly those rows, in place, before the logprobs and the sampler read them; rows
without a grammar are untouched. The bitmask is allocated once and reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class RequestGrammar:
    """One request's matcher over a shared compiled grammar."""

    __slots__ = ("matcher", "num_accepted", "_stops", "_terminated")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        # Only a stop token can terminate the grammar: asking the matcher (a call into
        # C++, ~8 us) only then keeps is_terminated() cheap on the per-step paths.
        self._stops = frozenset(compiled.tokenizer_info.stop_token_ids)
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not
        allow it, which the step's mask prevents unless another processor (min_tokens,
        allowed_token_ids, logit_bias -inf) left the row nothing the grammar allows."""
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        if token_id in self._stops:
            self._terminated = self.matcher.is_terminated()
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False when all are allowed."""
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request is done."""
        return self._terminated

    def is_completed(self) -> bool:
        """The output so far is a whole sentence of the grammar (a stop token may follow)."""
        return self.matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (speculative decoding)."""
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens
        self._terminated = self.matcher.is_terminated()


class Constraint:
    """A request's structured output: its matcher, and where constraining starts.

    With `end_ids` (the end of reasoning as token ids) the output is free until it
    holds them, then the grammar applies from the next token on (vLLM's semantics: a
    reasoning model thinks freely, then answers in the constrained form). Only the
    last len(end_ids) tokens are kept to find them, so each token costs O(1).
    """

    __slots__ = ("grammar", "active", "_end_ids", "_tail")

    def __init__(self, grammar: RequestGrammar, end_ids: Sequence[int] | None = None) -> None:
        self.grammar = grammar
        self._end_ids = list(end_ids or ())
        self.active = not self._end_ids
        self._tail: list[int] = []

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the active grammar refuses it."""
        if self.active:
            return self.grammar.accept(token_id)
        tail = self._tail
        tail.append(token_id)
        if len(tail) > len(self._end_ids):
            del tail[0]
        if tail == self._end_ids:
            self.active = True
        return True

    def is_terminated(self) -> bool:
        return self.active and self.grammar.is_terminated()


def step_grammars(constraints: Sequence[Constraint | None]) -> list[RequestGrammar | None] | None:
    """The grammars to mask a step's rows with (None for a free row); None when no row
    is constrained, so the step skips masking."""
    # Hot path: once per step.
    grammars = [c.grammar if c is not None and c.active else None for c in constraints]
    return grammars if any(g is not None for g in grammars) else None


class StepBitmask:
    """The step's bitmask [max_rows, ceil(V/32)] int32, grown on demand, never shrunk.

    Rows are filled by xgrammar; with the CPU kernels the mask is one C pass over the
    constrained rows (csrc/apply_bitmask.c). Otherwise it is applied with torch (bitwise and, compare,
    masked_fill over row chunks, into buffers reused every step): measured 2-4x faster
    on CPU than xgrammar's own apply kernel, which sets one element at a time. A batch
    mostly constrained is masked whole (free rows made all-allowed); of a sparse one
    only the constrained rows are gathered, masked and put back. Logits on a GPU use
    xgrammar's kernel there. `threads` > 1 fills rows on xgrammar's thread pool (worth
    it only for large constrained batches on a machine with spare cores).
    """

    def __init__(
        self, vocab_size: int, max_rows: int = 256, threads: int = 1, kernels: object = None
    ) -> None:
        self.vocab_size = vocab_size
        self.kernels = kernels  # CpuKernels: one C pass over the constrained rows
        self.bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        words = self.bitmask.shape[1]
        self._bits = torch.empty(_CHUNK_ROWS, words, 32, dtype=torch.int32)
        self._masked = torch.empty(_CHUNK_ROWS, words * 32, dtype=torch.bool)
        self._batch = xgr.BatchGrammarMatcher(threads) if threads > 1 else None

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> list[int]:
        """Mask fp32 `logits` [B, V] in place (row i by grammars[i], None: untouched);
        returns the rows that were masked."""
        # Hot path: once per step; a batch without grammars costs one list scan.
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
        if not rows:
            return rows
        num_rows = logits.shape[0]
        if num_rows > self.bitmask.shape[0]:
            self.bitmask = xgr.allocate_token_bitmask(
                max(num_rows, 2 * self.bitmask.shape[0]), self.vocab_size
            )
        bitmask = self.bitmask
        if self._batch is not None and len(rows) > 1:
            matchers = [grammars[i].matcher for i in rows]
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            for i in rows:
                grammars[i].matcher.fill_next_token_bitmask(bitmask, i)
        if logits.device.type != "cpu":  # xgrammar's own GPU kernel (untested here: no GPU)
            on_device = bitmask[:num_rows].to(logits.device)
            xgr.apply_token_bitmask_inplace(
                logits, on_device, vocab_size=self.vocab_size, indices=rows
            )
        elif self.kernels is not None:
            self.kernels.apply_bitmask(logits, bitmask, rows)
        elif 2 * len(rows) >= num_rows:
            if len(rows) < num_rows:
                free = [i for i, g in enumerate(grammars) if g is None or g.is_terminated()]
                bitmask[free] = -1  # all bits set: every token allowed
            self._mask(logits, bitmask[:num_rows])
        else:
            index = torch.tensor(rows)
            part = logits.index_select(0, index)
            self._mask(part, bitmask.index_select(0, index))
            logits.index_copy_(0, index, part)
        return rows

    def _mask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """-inf where the bit of logits[r, t] in bitmask[r] is 0, _CHUNK_ROWS rows at a time."""
        vocab = self.vocab_size
        for start in range(0, logits.shape[0], _CHUNK_ROWS):
            n = min(_CHUNK_ROWS, logits.shape[0] - start)
            bits = self._bits[:n]
            torch.bitwise_and(bitmask[start : start + n, :, None], _BIT_VALUES, out=bits)
            masked = self._masked[:n]
            torch.eq(bits.view(n, -1), 0, out=masked)
            logits[start : start + n].masked_fill_(masked[:, :vocab], _NEG_INF)


_NEG_INF = float("-inf")
# Rows masked per pass: bounds the scratch buffers (32 rows of a 152k vocabulary: 24 MB).
_CHUNK_ROWS = 32
# 1 << b for b in 0..31 as int32 (bit 31 is the sign bit).
_BIT_VALUES = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)
