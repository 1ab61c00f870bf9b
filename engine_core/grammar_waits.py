"""Constrained requests in one engine: parked until their grammar is ready, then masked.

A request with `structured_outputs` does not enter the scheduler until its grammar is
compiled (GrammarService compiles off the step thread, so the batch never waits for
it); meanwhile it is parked here and counted as waiting. A constraint that cannot be
served ends its request with REFUSED: a 400 whose message names the request field.

xgrammar is imported with the first constrained request, so an engine that never
sees one never pays for it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import torch

from engine_core.config import EngineConfig
from engine_core.request import Request

if TYPE_CHECKING:
    from engine_core.grammar_matcher import StepBitmask
    from engine_core.structured_output import GrammarService, GrammarTicket

logger = logging.getLogger(__name__)

# How long a step with nothing to run but parked requests waits for a grammar: short,
# since new inputs are only read between steps.
IDLE_WAIT_S = 0.005


class GrammarWaits:
    """The parked requests, the grammar service and the step's bitmask of one engine."""

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        kernels: object = None,
    ):
        self.config = config.grammar
        self.kernels = kernels  # the CPU kernels, when the forward runs them
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer_dir = config.tokenizer or config.model
        self.max_rows = min(config.max_num_seqs, 256)
        self.parked: dict[str, tuple[GrammarTicket, Request]] = {}
        self._service: GrammarService | None = None
        self._bitmask: StepBitmask | None = None

    def __len__(self) -> int:
        return len(self.parked)

    @property
    def service(self) -> GrammarService:
        if self._service is None:
            from engine_core.structured_output import GrammarService

            cfg = self.config
            try:
                self._service = GrammarService(
                    self.tokenizer_dir,
                    self.vocab_size,
                    eos_token_ids=self.eos_token_ids,
                    backend="xgrammar" if cfg.backend == "auto" else cfg.backend,
                    max_threads=cfg.compile_threads,
                    cache_size=cfg.cache_size,
                    max_spec_bytes=cfg.max_spec_bytes,
                    compile_timeout_s=cfg.compile_timeout_s,
                )
            except Exception as e:
                logger.exception("structured outputs are unavailable on this engine")
                raise ValueError(
                    f"structured_outputs: this server cannot serve constraints ({e})"
                ) from None
        return self._service

    def add(self, request: Request) -> bool:
        """Start the request's compile; True when its constraint is ready at once (a
        cached grammar): it may be scheduled now. Raises GrammarError (a ValueError)
        for a constraint refused before compiling."""
        spec = request.params.structured_outputs
        if self.config.disable_any_whitespace and not spec.disable_any_whitespace:
            spec = msgspec.structs.replace(spec, disable_any_whitespace=True)
        ticket = self.service.submit(spec, request.request_id)
        if ticket.ready():
            self._attach(ticket, request)
            return True
        self.parked[request.request_id] = (ticket, request)
        return False

    def pop_ready(self) -> tuple[list[Request], list[Request]]:
        """The parked requests whose grammar is ready (their constraint attached), and
        those whose constraint failed (their `error` set)."""
        ready: list[Request] = []
        failed: list[Request] = []
        for request_id, (ticket, request) in list(self.parked.items()):
            if not ticket.ready():
                continue
            del self.parked[request_id]
            try:
                self._attach(ticket, request)
                ready.append(request)
            except ValueError as e:
                request.error = str(e)
                failed.append(request)
        return ready, failed

    def remove(self, request_id: str) -> bool:
        return self.parked.pop(request_id, None) is not None

    def wait(self, timeout: float = IDLE_WAIT_S) -> None:
        """Block until a parked grammar is ready or `timeout` passes."""
        if self.parked:
            self.service.wait_any([t for t, _ in self.parked.values()], timeout)

    def mask(self, logits: torch.Tensor, sampling: list[Request]) -> None:
        """-inf on every token the constraint of each sampling row forbids (in place)."""
        if self._service is None:
            return  # no request of this engine ever had a constraint
        from engine_core.grammar_matcher import StepBitmask, step_grammars

        grammars = step_grammars([r.constraint for r in sampling])
        if grammars is None:
            return
        if self._bitmask is None:
            self._bitmask = StepBitmask(self.vocab_size, self.max_rows, kernels=self.kernels)
        self._bitmask.apply(logits, grammars)

    def close(self) -> None:
        if self._service is not None:
            self._service.close()

    @staticmethod
    def _attach(ticket: GrammarTicket, request: Request) -> None:
        from engine_core.grammar_matcher import Constraint

        end_ids = request.params.structured_outputs.reasoning_end_ids
        request.constraint = Constraint(ticket.grammar(), end_ids)
