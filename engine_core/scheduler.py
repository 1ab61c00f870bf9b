"""Continuous batching: which requests run this step, and how many tokens each.

One token budget per step. Running requests go first (a decode is one token, an
unfinished prefill a chunk), then waiting ones; prefill and decode share a step.
Blocks are allocated for the scheduled chunk only; when they run out, the newest
running request is preempted and recomputed later (usually from the prefix cache).
A request whose LoRA adapter cannot run yet (lora_manager.py) waits, and the ones
behind it go first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine_core.block_manager import BlockManager
from engine_core.lora_manager import LoraManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduling_policy import make_policy
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
        self.running: list[Request] = []
        self.running_per_group: Counter = Counter()  # running requests per Request.group_key
        self.num_preemptions = 0
        self.loras = loras

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._share_slots()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget, self.chunk_cap)
            while not self.blocks.allocate(request, n):
                victim = self._pick_victim(i)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._plan(out, request, n)
                budget -= n
                i += 1
        # Admitting new work right after evicting old work would only thrash.
        skipped: list[Request] = []  # waiting for their LoRA adapter, passed over
        while (
            not preempted
            and len(self.waiting) > 0
            and budget > 0
            and len(self.running) < self.max_num_seqs
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
            out.sampling.append(request)
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
        if newcomer is None or len(self.running) < self.max_num_seqs:
            return
        group, count = self.running_per_group.most_common(1)[0]
        if count < 2:
            return  # every running request is alone: plain first come, first served
        victim = next(r for r in reversed(self.running) if r.group_key == group)
        self._preempt(victim, behind_head=True)

    def _preempt(self, request: Request, behind_head: bool = False) -> None:
        self._stop_running(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        if not request.prompt_logprobs_done:
            request.prompt_logprobs_parts.clear()
        self.waiting.add_preempted(request, behind_head)
        self.num_preemptions += 1

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request)
        if request.lora is not None:
            self.loras.release(request.lora)
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
            request.all_token_ids.append(token)
            if self._check_stop(request, token):
                request.status = RequestStatus.FINISHED
        for request in out.requests:
            # Publish before freeing: a finished request's blocks are worth reusing too.
            blocks.cache_full_blocks(request)
            if request.status == RequestStatus.FINISHED:
                self._stop_running(request)
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

    def finish_aborted(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self._stop_running(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT
