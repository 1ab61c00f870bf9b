"""Continuous batching: which requests run this step, and how many tokens each.

One token budget per step. Running requests go first (a decode is one token, an
unfinished prefill a chunk), then waiting ones; prefill and decode share a step.
Blocks are allocated for the scheduled chunk only; when they run out, the newest
running request is preempted and recomputed later (usually from the prefix cache).
A request whose LoRA adapter cannot run yet (lora_manager.py) waits, and the ones
behind it go first. A paused scheduler (POST /pause, vLLM's pause states) admits no
waiting request (`HOLD_NEW`) or schedules nothing at all (`HOLD_ALL`); requests still
queue while it is paused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine_core.block_manager import BlockManager
from engine_core.lora_manager import LoraManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduling_policy import make_policy
from protocol.controls import HOLD_ALL, HOLD_NEW
from protocol.messages import FinishReason


@dataclass
class SchedulerOutput:
    """One step's plan: requests in batch order and their token counts."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    # Requests whose chunk reaches their last token: they sample, in this order.
    sampling: list[Request] = field(default_factory=list)
    # (request, first, end): rows at positions first..end-1 give prompt logprobs.
    prompt_logprob_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # Beam-search sequences whose chunk reaches their last token: their group picks the
    # next tokens from these rows (beam_search.py), instead of the sampler.
    beam_rows: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def has_lora(self) -> bool:
        """Whether any planned request runs with a LoRA adapter."""
        return any(r.lora is not None for r in self.requests)


# Waiting requests one step passes over because their LoRA adapter cannot run yet (not
# loaded, or --max-loras others running): a bound on the work of a step that admits none.
MAX_LORA_SKIPS = 64


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        loras: LoraManager | None = None,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1; got {value}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting = make_policy(policy)
        # Requests, and beam searches past their prompt (beam_search.BeamGroup: one entry
        # for all its beams, scheduled together).
        self.running: list = []
        self.num_beams_extra = 0  # running beams beyond one per beam search
        self.running_per_group: Counter = Counter()  # running requests per Request.group_key
        self.num_preemptions = 0
        self.loras = loras
        self.hold: str | None = None

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        """Whether a step would schedule anything (what a pause holds back does not
        count: the busy loop idles then instead of spinning)."""
        if self.hold is None:
            return bool(self.running) or len(self.waiting) > 0
        return self.hold == HOLD_NEW and bool(self.running)

    @property
    def num_running_seqs(self) -> int:
        """Running sequences: a beam search counts its width."""
        return len(self.running) + self.num_beams_extra

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.hold == HOLD_ALL:
            return out
        budget = self.max_num_batched_tokens
        if self.hold is None:
            self._share_slots()
        preempted = False
        i = 0
        blocks = self.blocks
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            group = request.is_group
            if group:  # n tokens for each of its beams, or none this step
                n = request.chunk(budget, self.chunk_cap)
                cost = n * len(request.beams)
                if not n:
                    i += 1
                    continue
            else:
                n = cost = min(
                    request.num_tokens - request.num_computed_tokens, budget, self.chunk_cap
                )
            while not (request.allocate(blocks, n) if group else blocks.allocate(request, n)):
                victim = self._pick_victim(i)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                if group:
                    for beam in request.beams:
                        self._plan(out, beam, n)
                else:
                    self._plan(out, request, n)
                budget -= cost
                i += 1
        # Admitting new work right after evicting old work would only thrash.
        skipped: list[Request] = []  # waiting for their LoRA adapter, passed over
        while (
            not preempted
            and self.hold is None
            and len(self.waiting) > 0
            and budget > 0
            and self.num_running_seqs < self.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.lora is not None and not self.loras.try_activate(request.lora):
                skipped.append(self.waiting.pop())
                if len(skipped) >= MAX_LORA_SKIPS:
                    break
                continue
            # Prompt logprobs need logits at every prompt position: no cache hits then.
            hits = self.blocks.find_cached_prefix(request) if request.prompt_logprobs_done else []
            num_hit_tokens = len(hits) * self.blocks.block_size
            n = min(request.num_tokens - num_hit_tokens, budget, self.chunk_cap)
            if not self.blocks.allocate(request, n, hits):
                if request.lora is not None:
                    self.loras.release(request.lora)
                break
            self.waiting.pop()
            if self.blocks.enable_prefix_caching:
                self.blocks.record_lookup(request.num_tokens, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.running_per_group[request.group_key] += 1
            self._plan(out, request, n)
            budget -= n
        for request in reversed(skipped):  # back in their places, at the head
            self.waiting.add_preempted(request)
        return out

    def _plan(self, out: SchedulerOutput, request: Request, n: int) -> None:
        out.requests.append(request)
        out.num_tokens.append(n)
        start = request.num_computed_tokens
        end = start + n
        if end == request.num_tokens:
            (out.sampling if request.beam is None else out.beam_rows).append(request)
        if not request.prompt_logprobs_done and start < request.prompt_len - 1:
            out.prompt_logprob_rows.append((request, start, min(end, request.prompt_len - 1)))

    def _pick_victim(self, first_unscheduled: int) -> Request:
        # Only requests not yet planned this step: their blocks are not in the batch.
        return self.waiting.pick_victim(self.running[first_unscheduled:])

    def _share_slots(self) -> None:
        """A waiting request whose API request has nothing running goes first; if every
        slot is taken, the API request holding the most slots (a fan-out of n > 1 or
        many prompts) gives its newest one back. So a newcomer starts this step instead
        of after a whole fan-out; the sequence that gave way is recomputed later, mostly
        from the prefix cache."""
        if not len(self.waiting):
            return
        newcomer = self.waiting.promote_newcomer(self.running_per_group)
        if newcomer is None or self.num_running_seqs < self.max_num_seqs:
            return
        group, count = self.running_per_group.most_common(1)[0]
        if count < 2:
            return  # every running request is alone: plain first come, first served
        victim = next(r for r in reversed(self.running) if r.group_key == group)
        self._preempt(victim, behind_head=True)

    def _preempt(self, request: Request, behind_head: bool = False) -> None:
        self._stop_running(request)
        if request.is_group:  # every beam gives its blocks back; the prompt waits again
            request = request.collapse()
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        if not request.prompt_logprobs_done:
            request.prompt_logprobs_parts.clear()
        self.waiting.add_preempted(request, behind_head)
        self.num_preemptions += 1
        request.num_preemptions += 1

    def preempt_all(self) -> int:
        """Send every running request back to wait, its blocks freed (sleep mode keeps
        requests this way while the KV cache is gone); answers how many there were."""
        running = list(self.running)
        for request in reversed(running):  # preempted ones queue at the head: keep order
            self._preempt(request)
        return len(running)

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        if request.is_group:
            request.free(self.blocks)
            self.num_beams_extra -= request.width - 1
            lora = request.root.lora
        else:
            self.blocks.free(request)
            lora = request.lora
        if lora is not None:
            self.loras.release(lora)
        left = self.running_per_group[request.group_key] - 1
        if left:
            self.running_per_group[request.group_key] = left
        else:
            del self.running_per_group[request.group_key]

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Advance every planned request; append `sampled` (one per `out.sampling`).

        Returns the requests that got a token, finished ones included (already freed).
        """
        blocks = self.blocks
        for request, n in zip(out.requests, out.num_tokens):
            request.num_computed_tokens += n
        for request, token in zip(out.sampling, sampled):
            constraint = request.constraint
            if constraint is not None and not constraint.accept(token):
                self._refuse_token(request, token)
                continue
            request.all_token_ids.append(token)
            if (constraint is not None and self._constraint_done(request)) or self._check_stop(
                request, token
            ):
                request.status = RequestStatus.FINISHED
        for request in out.requests:
            # Publish before freeing: a finished request's blocks are worth reusing too.
            blocks.cache_full_blocks(request)
            if request.status == RequestStatus.FINISHED:
                self._stop_running(request)
        return out.sampling

    def finish_prompts(self, out: SchedulerOutput) -> list[Request]:
        """A pooling step (pooler.py): every planned request advances, and each whose
        prompt is done finishes (already freed, as update() leaves them)."""
        for request in out.sampling:
            request.status = RequestStatus.FINISHED
            request.finish_reason = FinishReason.STOP
        self.update(out, [])
        return out.sampling

    def _check_stop(self, request: Request, token: int) -> bool:
        # Stop tokens win over length, so a stop at the limit still reports "stop".
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_ids:
                request.finish_reason = FinishReason.STOP
                return True
            if token in request.stop_ids:
                request.finish_reason = FinishReason.STOP
                request.stop_reason = token
                return True
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            request.finish_reason = FinishReason.LENGTH
            return True
        return False

    @staticmethod
    def _constraint_done(request: Request) -> bool:
        """The grammar took its stop token (EOS): the request ends, even under
        ignore_eos or min_tokens, since nothing else may follow."""
        if not request.constraint.is_terminated():
            return False
        request.finish_reason = FinishReason.STOP
        request.stop_reason = None
        return True

    @staticmethod
    def _refuse_token(request: Request, token: int) -> None:
        # Only when other processors (allowed_token_ids, logit_bias, min_tokens) left the
        # row nothing the constraint allows; the token is not kept.
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.REFUSED
        request.error = (
            f"structured_outputs: the constraint allows no token that the other sampling "
            f"parameters (allowed_token_ids, logit_bias, min_tokens) leave; token {token} "
            f"was drawn after {request.num_output_tokens} tokens"
        )

    def finish_aborted(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self._stop_running(self._entry(request))
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT

    # --- beam searches (beam_search.py) ----------------------------------------------------

    @staticmethod
    def _entry(request: Request):
        """The running-list entry of a running request: itself, or its beam search."""
        group = request.beam
        return group if group is not None and group.expanded else request

    def expand(self, root: Request, group) -> None:
        """A beam search's prompt is done: its beams run in the root's place."""
        self.running[self.running.index(root)] = group
        self.num_beams_extra += group.width - 1

    def finish_group(self, group) -> None:
        """A beam search is over: free every block of it."""
        self._stop_running(self._entry(group.root))
        group.root.status = RequestStatus.FINISHED

    def make_room(self, num_blocks: int, entry) -> bool:
        """Preempt running entries, the policy's victims first, until `num_blocks` blocks
        are free; False if `entry` (a beam search, or its root) had to give way itself."""
        while self.blocks.num_free_blocks < num_blocks:
            if not self.running:
                return False
            victim = self.waiting.pick_victim(self.running)
            self._preempt(victim)
            if victim is entry:
                return False
        return True
