"""An offline engine with structured outputs, wired from the outside of EngineCore.

It shows the integration the engine will get, on the real engine pieces: a request
with a constraint waits (outside the scheduler) until its grammar is compiled, or is
answered with the compile error; each step masks the logits of constrained rows
between the forward and everything that reads them (logprobs included), and feeds
the sampled tokens to the requests' matchers before the scheduler's stop checks.
"""

from __future__ import annotations

from engine_core.grammar_matcher import RequestGrammar, StepBitmask
from engine_core.llm import LLM, GenerationResult
from engine_core.logprobs import concat_logprobs
from engine_core.scheduler import SchedulerOutput
from engine_core.structured_output import GrammarError, GrammarService, GrammarTicket
from protocol.messages import (
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SamplingParams,
    error_output,
    now,
)


class StructuredLLM(LLM):
    """`LLM` whose requests may carry `SamplingParams.structured_outputs`."""

    def __init__(self, model: str, service_options: dict | None = None, **overrides: object):
        super().__init__(model, **overrides)
        engine = self.engine
        self.service = GrammarService(
            model, engine.vocab_size, eos_token_ids=engine.eos_token_ids, **(service_options or {})
        )
        self.bitmask = StepBitmask(engine.vocab_size, max_rows=4)
        self.grammars: dict[str, RequestGrammar] = {}
        self.rejected: list[tuple[str, int]] = []  # (request id, token) a grammar refused
        self.finished_grammars: dict[str, RequestGrammar] = {}
        self.masked_rows = 0
        self._execute = engine.runner.execute
        self._update = engine.scheduler.update
        engine.runner.execute = self._masked_execute
        engine.scheduler.update = self._accepting_update

    def _masked_execute(self, plan: SchedulerOutput):
        # Hook 1: right after the forward; the engine copies logprob rows after this.
        logits = self._execute(plan)
        rows = [self.grammars.get(r.request_id) for r in plan.sampling]
        self.masked_rows += len(self.bitmask.apply(logits[: len(plan.sampling)], rows))
        return logits

    def _accepting_update(self, plan: SchedulerOutput, tokens: list[int]):
        # Hook 2: the sampled tokens advance the matchers before the stop checks.
        for request, token in zip(plan.sampling, tokens):
            grammar = self.grammars.get(request.request_id)
            if grammar is not None and not grammar.accept(token):
                self.rejected.append((request.request_id, token))
        sampled = self._update(plan, tokens)
        for request in sampled:
            if request.finish_reason is not None:
                grammar = self.grammars.pop(request.request_id, None)
                if grammar is not None:
                    self.finished_grammars[request.request_id] = grammar
        return sampled

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[GenerationResult]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        results: dict[str, GenerationResult] = {}
        parts: dict[str, list[Logprobs]] = {}
        waiting: list[tuple[GrammarTicket, EngineCoreRequest]] = []
        for prompt, p in zip(prompts, params):
            request_id = f"offline-{next(self._ids)}"
            results[request_id] = GenerationResult(request_id, list(prompt))
            request = EngineCoreRequest(request_id, list(prompt), p, arrival_time=now())
            if p.structured_outputs is not None:
                # Hook 0: compile off the engine thread; the request waits outside the scheduler.
                waiting.append((self.service.submit(p.structured_outputs, request_id), request))
            else:
                self._add(request, results, parts)
        while waiting or self.engine.has_unfinished_requests():
            waiting = self._admit_ready(waiting, results, parts)
            if not self.engine.has_unfinished_requests():
                GrammarService.wait_any([t for t, _ in waiting], timeout=1.0)
                continue
            for outputs in self.engine.step().values():
                for output in outputs:
                    self._apply(results[output.request_id], output, parts)
        for request_id, rows in parts.items():
            results[request_id].logprobs = concat_logprobs(rows)
        return list(results.values())

    def _admit_ready(self, waiting, results, parts):
        still = []
        for ticket, request in waiting:
            if not ticket.ready():
                still.append((ticket, request))
                continue
            try:
                grammar = ticket.grammar()
            except GrammarError as e:
                self._apply(
                    results[request.request_id], error_output(request.request_id, str(e)), parts
                )
                continue
            self.grammars[request.request_id] = grammar
            self._add(request, results, parts)
        return still

    def _add(self, request, results, parts) -> None:
        for output in self.engine.add_request(request):
            self._apply(results[request.request_id], output, parts)
            if output.finish_reason == FinishReason.ERROR:
                self.grammars.pop(request.request_id, None)
