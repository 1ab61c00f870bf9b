"""Offline use: the same EngineCore in-process, token ids in, token ids out, no HTTP."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.logprobs import concat_logprobs
from protocol.messages import (
    BeamSequence,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SamplingParams,
    now,
)


@dataclass
class GenerationResult:
    """One prompt's completion."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    beams: list[BeamSequence] | None = None  # a beam search's n best sequences, best first


class LLM:
    """`LLM(model_dir, **EngineConfig overrides).generate(prompts, params)`."""

    def __init__(self, model: str, **overrides: object) -> None:
        # vLLM's offline class runs 256 sequences where its server runs 128 on the CPU.
        overrides.setdefault("max_num_seqs", 256)
        self.engine = EngineCore(EngineConfig(model=model, **overrides))
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
        lora_names: list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results in prompt order. `lora_names`: each
        prompt's LoRA adapter (None: the base model)."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        results: dict[str, GenerationResult] = {}
        logprob_parts: dict[str, list[Logprobs]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = f"offline-{next(self._ids)}"
            result = results[request_id] = GenerationResult(request_id, list(prompt))
            request = EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=list(prompt),
                sampling_params=p,
                arrival_time=now(),
                priority=priorities[i] if priorities else 0,
                lora_name=lora_names[i] if lora_names else None,
            )
            for output in self.engine.add_request(request):
                self._apply(result, output, logprob_parts)
        while self.engine.has_unfinished_requests():
            for outputs in self.engine.step().values():
                for output in outputs:
                    self._apply(results[output.request_id], output, logprob_parts)
        for request_id, parts in logprob_parts.items():
            results[request_id].logprobs = concat_logprobs(parts)
        return list(results.values())

    def add_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter now (raises LoraError when it cannot be served)."""
        done = self.engine.add_lora(name, path)
        while not done.done():
            self.engine.step()
        done.result()

    @staticmethod
    def _apply(
        result: GenerationResult,
        output: EngineCoreOutput,
        logprob_parts: dict[str, list[Logprobs]],
    ) -> None:
        result.token_ids.extend(output.new_token_ids)
        result.num_cached_tokens = output.num_cached_tokens
        if output.new_logprobs is not None:
            logprob_parts.setdefault(result.request_id, []).append(output.new_logprobs)
        if output.prompt_logprobs is not None:
            result.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            result.finish_reason = output.finish_reason
            result.stop_reason = output.stop_reason
            result.error = output.error
            result.beams = output.beams
