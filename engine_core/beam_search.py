"""A beam search in the engine: one request, `width` sequences sharing its KV blocks.

The request's prompt runs as an ordinary sequence, its root. When the prompt is done, the
search takes the root's place in the scheduler's running list as one entry, a BeamGroup:
its live beams are scheduled together, always the same length and computed as far, so
each step every live beam reaches its last token at once and the group picks the next
beams from all of them (beam_scoring.py).

Beams share blocks copy-on-write (BlockManager.fork): a beam that continues keeps its
sequence; each further child of it gets a new sequence that shares the parent's full
blocks and copies its partial last block; a beam with no child gives its blocks back.

Preempted, a group gives back every block and becomes its root again, waiting; its
beams are kept. When the root's prompt is done again (mostly from the prefix cache),
every beam is rebuilt on it at once and recomputes its own tokens.
"""

from __future__ import annotations

import copy
import math

import torch

from engine_core.beam_scoring import Beam, expand, score_key, should_stop
from engine_core.block_manager import BlockManager
from engine_core.request import Request, RequestStatus
from protocol.messages import (
    BeamSequence,
    EarlyStopping,
    EngineCoreOutput,
    EngineCoreRequest,
    Logprobs,
    beam_search_kv_blocks,
    max_beam_width_message,
)


def check_beam_request(request: EngineCoreRequest, max_width: int, blocks: BlockManager) -> None:
    """Raise ValueError naming the limit a beam search would break (the API server
    checks the same first, frontend/beam_search.py)."""
    p = request.sampling_params
    width = p.beam_width
    if width < 1:
        raise ValueError(f"beam_width must be at least 1; got {width}")
    if width > max_width:
        raise ValueError(max_beam_width_message(width, max_width))
    if not math.isfinite(p.length_penalty):
        raise ValueError(f"length_penalty must be a finite number; got {p.length_penalty}")
    if p.structured_outputs is not None:
        raise ValueError("structured outputs are not supported with beam search")
    if p.early_stopping not in tuple(EarlyStopping):
        raise ValueError(f"early_stopping: unknown rule {p.early_stopping!r}")
    prompt_len = len(request.prompt_token_ids)
    needed = beam_search_kv_blocks(prompt_len, p.max_tokens, width, blocks.block_size)
    if needed > blocks.num_usable_blocks:
        raise ValueError(
            f"beam search with n={width} and max_tokens {p.max_tokens} may need {needed} KV "
            f"blocks but the cache has only {blocks.num_usable_blocks}; lower n or max_tokens"
        )


class BeamGroup:
    """One beam search: its root (the prompt), its beams, its `width` best finished ones."""

    is_group = True

    def __init__(self, root: Request, max_model_len: int, model_eos_ids: frozenset[int]) -> None:
        p = root.params
        self.root = root
        self.width = p.beam_width
        self.length_penalty = p.length_penalty
        self.rule = EarlyStopping(p.early_stopping)
        self.num_logprobs = p.logprobs
        self.prompt_len = root.prompt_len
        self.max_len = min(root.prompt_len + p.max_tokens, max_model_len)
        stop_ids = sorted(root.eos_ids | root.stop_ids)
        self.stop_ids = torch.tensor(stop_ids) if stop_ids else None
        self.live: list[Beam] = []  # best first; empty until the prompt is done
        self.finished: list[Beam] = []  # the `width` best, best first
        self.beams: list[Request] = []  # the live beams' sequences while the group runs
        self.expanded = False  # the group, not its root, is in the running list
        self.model_eos_ids = model_eos_ids
        # This step's selection, until materialize(): (parent index, child) and parents.
        self._children: list[tuple[int, Beam]] = []
        self._parents: list[Beam] = []
        self._ran_to_length = False
        root.beam = self
        root.prompt_logprobs_done = True  # vLLM: no prompt logprobs with beam search

    # --- what the scheduler reads of a running-list entry -------------------------------

    @property
    def request_id(self) -> str:
        return self.root.request_id

    @property
    def group_key(self):
        return self.root.group_key

    @property
    def priority(self) -> int:
        return self.root.priority

    @property
    def arrival_time(self) -> float:
        return self.root.arrival_time

    def chunk(self, budget: int, chunk_cap: int) -> int:
        """Tokens each beam computes this step (0: the budget left is too small)."""
        first = self.beams[0]
        return min(
            first.num_tokens - first.num_computed_tokens, budget // len(self.beams), chunk_cap
        )

    def allocate(self, blocks: BlockManager, n: int) -> bool:
        """Blocks for `n` more tokens of every beam, or none at all."""
        needed = sum(
            blocks.blocks_needed(b.num_computed_tokens + n) - len(b.block_ids) for b in self.beams
        )
        if needed > blocks.num_free_blocks:
            return False
        for beam in self.beams:
            blocks.allocate(beam, n)
        return True

    def free(self, blocks: BlockManager) -> None:
        for beam in self.beams:
            blocks.free(beam)

    def collapse(self) -> Request:
        """Preempted (its blocks already freed): back to the root, beams kept."""
        self.beams = []
        for beam in self.live:
            beam.request = None
        self.expanded = False
        return self.root

    # --- a step ---------------------------------------------------------------------

    def advance(self, rows: list[Request], logits: torch.Tensor) -> bool:
        """Take this step's logits (one row per sequence in `rows`); True when the
        search is over. A root row starts the search, or restarts a preempted one."""
        if rows[0] is self.root:
            if self.live:
                return False  # a preempted search: its beams are rebuilt as they were
            parents = [Beam([], 0.0, [] if self.num_logprobs is not None else None)]
        else:
            if len(rows) != len(self.beams):
                raise RuntimeError(f"beam search {self.request_id}: beams out of step")
            index = {id(b.request): i for i, b in enumerate(self.live)}
            order = [index[id(r)] for r in rows]
            parents = [self.live[i] for i in order]
        may_stop = len(parents[0].tokens) >= self.root.params.min_tokens
        step = expand(
            parents,
            logits,
            self.width,
            self.stop_ids,
            may_stop,
            self.root.eos_ids,
            self.num_logprobs,
        )
        for beam in step.finished:  # the length leaves out the EOS or stop token
            length = self.prompt_len + len(beam.tokens) - 1
            beam.key = score_key(beam.cum_logprob, length, self.length_penalty)
        finished = sorted(self.finished + step.finished, key=_by_key, reverse=True)
        self.finished = finished[: self.width]
        self._children, self._parents = step.live, parents
        self.live = [child for _, child in step.live]
        if self.live and self.prompt_len + len(self.live[0].tokens) >= self.max_len:
            self._ran_to_length = True
            return True
        return should_stop(
            self.live,
            self.finished,
            self.width,
            self.prompt_len,
            self.max_len,
            self.length_penalty,
            self.rule,
        )

    # --- after a step -----------------------------------------------------------------

    def materialize(self, blocks: BlockManager, scheduler) -> list[tuple[int, int]] | None:
        """Give the live beams their sequences, copy-on-write. Returns the KV block
        copies the runner must make now, or None when the group gave way instead (it, or
        a group before it this step, was preempted to make room)."""
        root = self.root
        if root.status != RequestStatus.RUNNING:
            return None
        if self.expanded:
            plan = self._plan_children(blocks)
        else:  # every beam grows from the prompt: a new search, or a preempted one
            plan = [(root, [(beam, beam.tokens) for beam in self.live])]
        needed = sum((len(kids) - 1) * blocks.blocks_to_fork(parent) for parent, kids in plan)
        entry = self if self.expanded else root
        if blocks.num_free_blocks < needed and not scheduler.make_room(needed, entry):
            return None
        copies = []
        for parent, kids in plan:
            for beam, suffix in kids[1:]:
                child = _clone(parent)
                pair = blocks.fork(parent, child)
                if pair is not None:
                    copies.append(pair)
                child.all_token_ids.extend(suffix)
                beam.request = child
            beam, suffix = kids[0]
            first = parent
            if parent is root:  # the root stays the bare prompt; its blocks move on
                first = _clone(root)
                first.block_ids, root.block_ids = root.block_ids, []
                first.num_cached_blocks, root.num_cached_blocks = root.num_cached_blocks, 0
            first.all_token_ids.extend(suffix)
            beam.request = first
        self.beams = [beam.request for beam in self.live]
        if not self.expanded:
            scheduler.expand(root, self)
            self.expanded = True
        return copies

    def _plan_children(self, blocks: BlockManager) -> list[tuple[Request, list]]:
        """(parent sequence, [(child beam, tokens to append)]) of this step; parents
        without a child give their blocks back now."""
        kids: dict[int, list] = {}
        for r, child in self._children:
            kids.setdefault(r, []).append((child, child.tokens[-1:]))
        plan = []
        for r, parent in enumerate(self._parents):
            if r in kids:
                plan.append((parent.request, kids[r]))
            else:
                blocks.free(parent.request)
        self.beams = [parent for parent, _ in plan]  # what a preemption now must free
        return plan

    def output(self) -> EngineCoreOutput:
        """The search's answer: its `width` best sequences, best first."""
        pool = list(self.finished)
        if self._ran_to_length:
            for beam in self.live:
                length = self.prompt_len + len(beam.tokens)
                if beam.tokens[-1] in self.model_eos_ids:  # vLLM's rule, also with ignore_eos
                    length -= 1
                beam.key = score_key(beam.cum_logprob, length, self.length_penalty)
                pool.append(beam)
        best = sorted(pool, key=_by_key, reverse=True)[: self.width]
        return EngineCoreOutput(
            request_id=self.root.request_id,
            new_token_ids=[],
            finish_reason=best[0].finish_reason,
            stop_reason=best[0].stop_reason,
            num_cached_tokens=max(self.root.num_cached_tokens, 0),
            beams=[
                BeamSequence(b.tokens, b.cum_logprob, b.finish_reason, b.stop_reason, _logprobs(b))
                for b in best
            ],
        )


def _by_key(beam: Beam) -> float:
    return beam.key


def _logprobs(beam: Beam) -> Logprobs | None:
    if beam.rows is None:
        return None
    return Logprobs(
        token_ids=[r[0] for r in beam.rows],
        logprobs=[r[1] for r in beam.rows],
        ranks=[r[2] for r in beam.rows],
    )


def _clone(parent: Request) -> Request:
    """A new sequence with the parent's tokens and progress, and no blocks yet."""
    child = copy.copy(parent)
    child.all_token_ids = parent.all_token_ids[:]
    child.block_hashes = parent.block_hashes[:]
    child.block_ids = []
    child.num_cached_blocks = 0
    child.pending_logprobs = []
    child.prompt_logprobs_parts = []
    child.status = RequestStatus.RUNNING
    return child
