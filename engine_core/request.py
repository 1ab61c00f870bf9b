"""One request's whole life inside the engine: tokens, progress, blocks, sampling state."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from engine_core.logits_processors import needs_processing
from protocol.messages import EngineCoreRequest, FinishReason, Logprobs, SamplingParams

if TYPE_CHECKING:
    from engine_core.beam_search import BeamGroup
    from engine_core.grammar_matcher import Constraint
    from engine_core.lora_manager import LoraSpec

# Temperatures below this are greedy (as in vLLM): dividing by them would overflow.
GREEDY_EPS = 1e-5


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    """All per-request state lives here; the scheduler and runner only read and advance it."""

    __slots__ = (
        "request_id",
        "client_index",
        "group_key",
        "priority",
        "arrival_time",
        "params",
        "prompt_len",
        "all_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_ids",
        "block_hashes",
        "num_cached_blocks",
        "status",
        "finish_reason",
        "stop_reason",
        "eos_ids",
        "stop_ids",
        "is_greedy",
        "needs_processing",
        "generator",
        "pending_logprobs",
        "prompt_logprobs_parts",
        "prompt_logprobs_done",
        "sampler_state",
        "num_preemptions",
        "constraint",
        "error",
        "beam",
        "lora",
        "hash_seed",
        "pooling",
    )

    # A running-list entry of the scheduler is a Request or a beam group (beam_search.py).
    is_group = False

    def __init__(self, request: EngineCoreRequest, eos_ids: frozenset[int]) -> None:
        params = request.sampling_params
        request_id = self.request_id = request.request_id
        self.client_index = request.client_index
        # Sequences of one API request are scheduled as a group (scheduling_policy.py).
        self.group_key = (request.client_index, request.group) if request.group else request_id
        self.priority = request.priority
        self.arrival_time = request.arrival_time
        self.params: SamplingParams = params
        self.prompt_len = len(request.prompt_token_ids)
        self.all_token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache at first admission
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.num_cached_blocks = 0  # leading blocks already published to the prefix cache
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.stop_ids = frozenset(params.stop_token_ids)
        self.is_greedy = params.temperature < GREEDY_EPS
        self.needs_processing = needs_processing(params)
        self.generator: torch.Generator | None = None
        if params.seed is not None and not self.is_greedy:
            self.generator = torch.Generator().manual_seed(params.seed % (1 << 64))
        self.pending_logprobs: list[Logprobs] = []
        # What the prompt's rows gave so far: Logprobs, or a pooling request's partial
        # pools (pooler.py); cleared when the request is preempted.
        self.prompt_logprobs_parts: list[Logprobs] = []
        self.prompt_logprobs_done = params.prompt_logprobs is None
        self.sampler_state: object | None = None  # owned by the sampler
        self.num_preemptions = 0
        # Structured outputs (grammar_matcher.Constraint), set once its grammar is ready.
        self.constraint: Constraint | None = None
        self.error: str | None = None  # why a REFUSED or ERROR finish happened
        self.beam: BeamGroup | None = None  # the beam search this sequence belongs to
        self.lora: LoraSpec | None = None  # its LoRA adapter (None: the base model)
        # Starts its prefix-cache hash chain: the adapter's digest and the cache salt.
        self.hash_seed = b""
        self.pooling = request.pooling  # a pooling request's parameters (pooler.py)

    def constraint_complete(self) -> bool:
        """The constraint has started and its text is whole (only EOS may follow)."""
        c = self.constraint
        return c is not None and c.active and c.grammar.is_completed()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.prompt_len

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower `priority` first, then earlier arrival."""
        return (self.priority, self.arrival_time)
