"""EngineCore: one synchronous step — schedule, forward, sample, update — and its outputs."""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from concurrent.futures import Future

import torch

from engine_core.beam_search import BeamGroup, check_beam_request
from engine_core.block_manager import BlockManager, hash_seed
from engine_core.config import EngineConfig
from engine_core.grammar_waits import GrammarWaits
from engine_core.logprobs import concat_logprobs, logprobs_of_positions, logprobs_per_row
from engine_core.lora_adapter import LoraError
from engine_core.lora_manager import LoraManager
from engine_core.model_runner import ModelRunner
from engine_core.pooler import make_pooler
from engine_core.request import Request, RequestStatus
from engine_core.sampler import Sampler
from engine_core.scheduler import Scheduler, SchedulerOutput
from engine_core.validation import check_fits, validate_request
from protocol.messages import (
    ITERATION_TOKEN_BUCKETS,
    REQUEST_PREEMPTION_BUCKETS,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    error_output,
)

logger = logging.getLogger(__name__)

# How long an idle step waits for a LoRA load to finish before the loop goes round.
LORA_WAIT_S = 0.05


class EngineCore:
    """The engine's compute, driven by the process shell (or `LLM` in-process).

    Not thread-safe: one thread calls every method. After __init__ the READY fields
    are set: max_model_len, num_kv_blocks, block_size, dtype, device, vocab_size,
    max_request_tokens.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        config = self.config = self.runner.config
        info = self.runner.info
        self.max_model_len = self.runner.max_model_len
        self.num_kv_blocks = self.runner.num_blocks
        self.block_size = config.block_size
        self.dtype = str(self.runner.dtype).removeprefix("torch.")
        self.device = str(self.runner.device)
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.architecture = info.architecture
        self.hidden_size = int(info.hf_config.hidden_size)
        self.pooler = make_pooler(config, info)
        self.model_type = str(getattr(info.hf_config, "model_type", "") or "")
        self.bos_token_id = _token_id(getattr(info.hf_config, "bos_token_id", None))
        self.pad_token_id = _token_id(getattr(info.hf_config, "pad_token_id", None))
        # Prompt + max_tokens one request may need: the context, or less when the KV
        # cache holds less (the last sampled token is never fed back, so needs no KV).
        self.max_request_tokens = min(
            self.max_model_len, (self.num_kv_blocks - 1) * self.block_size + 1
        )
        # Its beams run in one step: at most max_num_seqs sequences and as many tokens,
        # and each offers 2 x width candidates of the vocabulary.
        self.max_beam_width = min(
            config.max_num_seqs, config.max_num_batched_tokens, self.vocab_size // 2
        )
        self.blocks = BlockManager(
            self.num_kv_blocks, self.block_size, config.enable_prefix_caching
        )
        self.loras: LoraManager | None = None
        if config.lora is not None:
            backend = self.runner.backend
            self.loras = LoraManager(config.lora, backend.lora_targets(), backend.prepare_lora)
            self.loras.load_startup()
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
            loras=self.loras,
        )
        self.sampler = Sampler(
            self.vocab_size, self.runner.device, config.seed, kernels=self.runner.kernels
        )
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarWaits(
            config, self.vocab_size, self.eos_token_ids, kernels=self.runner.kernels
        )
        self.num_aborted = 0
        self.num_steps = 0
        # Turns that ran nothing while requests waited for a grammar or a LoRA adapter:
        # progress all the same, for the API servers' hang detection.
        self.num_waits = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.step_time_s = 0.0
        self.iteration_tokens_sum = 0
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.request_preemptions_sum = 0
        self.request_preemptions_counts = [0] * (len(REQUEST_PREEMPTION_BUCKETS) + 1)
        logger.info(
            "engine ready: %s (%s) on %s (%s), %d KV blocks of %d tokens, max_model_len %d, "
            "at most %d sequences in steps of %d tokens",
            info.architecture, self.runner.model_impl, self.device, self.dtype,
            self.num_kv_blocks, self.block_size, self.max_model_len, config.max_num_seqs,
            config.max_num_batched_tokens,
        )  # fmt: skip

    def add_request(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        """Queue a request; an invalid one (or one that can never fit) is answered with ERROR."""
        try:
            if request.request_id in self.requests:
                raise ValueError(f"request id {request.request_id!r} is already running")
            validate_request(request, self.vocab_size, self.config.max_logprobs)
            check_fits(request, self.max_model_len, self.max_request_tokens, self.blocks)
            if request.sampling_params.beam_width:
                check_beam_request(request, self.max_beam_width, self.blocks)
            state = Request(request, self.eos_token_ids)
            if self.pooler is not None:
                self.pooler.admit(state)
            elif request.pooling is not None:
                raise ValueError("this engine generates: run it with --runner pooling to pool")
            if request.lora_name is not None:
                if self.loras is None:
                    raise ValueError(
                        f"The model `{request.lora_name}` does not exist (LoRA is not enabled)."
                    )
                state.lora = self.loras.lookup(request.lora_name)
            state.hash_seed = hash_seed(state.lora, request.cache_salt)
            if request.sampling_params.beam_width:
                BeamGroup(state, self.max_model_len, self.eos_token_ids)
            # A constrained request waits for its grammar outside the scheduler.
            schedulable = request.sampling_params.structured_outputs is None or (
                self.grammars.add(state)
            )
        except Exception as e:  # a bad request must never take the engine down
            logger.warning("request %s refused: %s", request.request_id, e)
            return [error_output(request.request_id, str(e), FinishReason.REFUSED)]
        self.requests[request.request_id] = state
        if schedulable:
            self.scheduler.add(state)
        return []

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                if not self.grammars.remove(request_id):
                    self.scheduler.finish_aborted(request)
                self.num_aborted += 1
                self._count_preemptions(request)

    def has_unfinished_requests(self) -> bool:
        """Requests to step, grammars compiling, or LoRA loads to take in (the loop must
        keep polling)."""
        return (
            self.scheduler.has_unfinished()
            or len(self.grammars) > 0
            or (self.loras is not None and self.loras.loading)
        )

    def reset_prefix_cache(self) -> bool:
        return self.blocks.reset_prefix_cache()

    # --- LoRA adapters (utility methods) -------------------------------------------------

    def add_lora(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> Future:
        """Load an adapter at run time: a Future answered (True, or the LoraError that
        says why not) once it is loaded, off the step thread."""
        return self._lora_manager().add(name, path, base_model_name, replace)

    def remove_lora(self, name: str) -> bool:
        return self._lora_manager().remove(name)

    def list_loras(self) -> list[list[str | None]]:
        """[name, base_model_name] of every adapter (none when LoRA is off)."""
        return [] if self.loras is None else self.loras.list()

    def _lora_manager(self) -> LoraManager:
        if self.loras is None:
            raise LoraError("LoRA is not enabled on this server (--enable-lora)")
        return self.loras

    def _take_in_loras(self, wait_s: float = 0.0) -> dict[int, list[EngineCoreOutput]]:
        """Finished LoRA loads; the waiting requests of an adapter that could not be read
        again end with an error."""
        failed = self.loras.poll(wait_s)
        if not failed:
            return {}
        grouped: dict[int, list[EngineCoreOutput]] = {}
        for request in list(self.requests.values()):
            if request.lora in failed and request.status != RequestStatus.RUNNING:
                if not self.grammars.remove(request.request_id):
                    self.scheduler.finish_aborted(request)
                del self.requests[request.request_id]
                message = f"LoRA adapter {request.lora.name!r} could not be loaded: "
                grouped.setdefault(request.client_index, []).append(
                    error_output(request.request_id, message + str(request.lora.error))
                )
        return grouped

    @torch.inference_mode()
    def step(self) -> dict[int, list[EngineCoreOutput]]:
        """One schedule → forward → sample → update; outputs grouped by client_index."""
        refused = self._admit_grammars() if self.grammars.parked else {}
        if self.loras is not None:
            for client_index, errors in self._take_in_loras().items():
                refused.setdefault(client_index, []).extend(errors)
        if not self.scheduler.has_unfinished():
            self.grammars.wait()  # nothing to run: don't spin while grammars compile
            self.num_waits += 1
            return self._wait_for_loras(refused)
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.requests:
            if self.grammars.parked or (self.loras is not None and self.loras.loading):
                self.num_waits += 1
            return self._wait_for_loras(refused)
        logits = self.runner.execute(plan)
        if self.pooler is not None:  # the rows are hidden states: nothing to sample
            return self._pool_step(plan, logits, refused, start)
        num_sampling = len(plan.sampling)
        num_beam_rows = len(plan.beam_rows)
        sample_logits = logits[:num_sampling]
        # Before anything reads the logits: logprobs are those of the masked distribution.
        self.grammars.mask(sample_logits, plan.sampling)
        wanted = [i for i, r in enumerate(plan.sampling) if r.params.logprobs is not None]
        mode = self.config.logprobs_mode
        if wanted and mode.startswith("processed"):
            tokens, scores = self.sampler.sample_keeping(sample_logits, plan.sampling, wanted)
        else:
            # Indexing copies: the raw logits survive the sampler's in-place processing.
            scores = sample_logits[wanted] if wanted else None
            tokens = self.sampler.sample(sample_logits, plan.sampling)
        as_logits = mode.endswith("logits")
        if wanted:
            self._sampled_logprobs(
                [plan.sampling[i] for i in wanted], scores, tokens[wanted], as_logits
            )
        if plan.prompt_logprob_rows:  # always from the raw logits, as vLLM's
            self._prompt_logprobs(plan, logits[num_sampling + num_beam_rows :], as_logits)
        self._count_tokens(plan)
        sampled = self.scheduler.update(plan, tokens.tolist())
        outputs = self._outputs(sampled)
        if num_beam_rows:
            self._beam_step(
                plan.beam_rows, logits[num_sampling : num_sampling + num_beam_rows], outputs
            )
        for client_index, outs in refused.items():
            outputs.setdefault(client_index, []).extend(outs)
        self.num_steps += 1
        self.step_time_s = time.perf_counter() - start
        return outputs

    def _pool_step(
        self,
        plan: SchedulerOutput,
        hidden: torch.Tensor,
        outputs: dict[int, list[EngineCoreOutput]],
        start: float,
    ) -> dict[int, list[EngineCoreOutput]]:
        """A pooling engine's step after the forward: pool, then answer and free every
        request whose prompt is done."""
        self.pooler.step(plan, hidden)
        answers = self.pooler.outputs(plan, hidden)
        self._count_tokens(plan, generated=0)
        for request, answer in zip(self.scheduler.finish_prompts(plan), answers):
            del self.requests[request.request_id]
            self._count_preemptions(request)
            outputs.setdefault(request.client_index, []).append(answer)
        self.num_steps += 1
        self.step_time_s = time.perf_counter() - start
        return outputs

    def _admit_grammars(self) -> dict[int, list[EngineCoreOutput]]:
        """Schedule the parked requests whose grammar is ready; answer those whose
        constraint failed (REFUSED: the client's 400)."""
        ready, failed = self.grammars.pop_ready()
        for request in ready:
            self.scheduler.add(request)
        refused: dict[int, list[EngineCoreOutput]] = {}
        for request in failed:
            logger.info("request %s refused: %s", request.request_id, request.error)
            del self.requests[request.request_id]
            output = error_output(request.request_id, request.error, FinishReason.REFUSED)
            refused.setdefault(request.client_index, []).append(output)
        return refused

    def _wait_for_loras(
        self, outputs: dict[int, list[EngineCoreOutput]]
    ) -> dict[int, list[EngineCoreOutput]]:
        """Nothing to run now: while a LoRA load is under way, wait a little for it
        instead of spinning the loop."""
        if self.loras is not None and self.loras.loading:
            for client_index, errors in self._take_in_loras(LORA_WAIT_S).items():
                outputs.setdefault(client_index, []).extend(errors)
        return outputs

    @staticmethod
    def _sampled_logprobs(
        requests: list[Request], scores: torch.Tensor, tokens: torch.Tensor, as_logits: bool
    ) -> None:
        rows = logprobs_per_row(
            scores,
            tokens,
            [r.params.logprobs for r in requests],
            [r.params.logprob_token_ids for r in requests],
            as_logits,
        )
        for request, logprobs in zip(requests, rows):
            request.pending_logprobs.append(logprobs)

    def _prompt_logprobs(
        self, plan: SchedulerOutput, logits: torch.Tensor, as_logits: bool
    ) -> None:
        offset = 0
        for request, first, end in plan.prompt_logprob_rows:
            n = end - first
            targets = torch.tensor(request.all_token_ids[first + 1 : end + 1], device=logits.device)
            part = logprobs_of_positions(
                logits[offset : offset + n], targets, request.params.prompt_logprobs, as_logits
            )
            request.prompt_logprobs_parts.append(part)
            offset += n

    def _count_tokens(self, plan: SchedulerOutput, generated: int | None = None) -> None:
        prompt_now = 0
        for request, n in zip(plan.requests, plan.num_tokens):
            prompt_left = request.prompt_len - request.num_computed_tokens
            if prompt_left > 0:
                prompt_now += min(n, prompt_left)
        self.prompt_tokens_computed += prompt_now
        if generated is None:
            generated = len(plan.sampling) + len(plan.beam_rows)
        self.generation_tokens += generated
        # vLLM's meaning of "iteration tokens": prompt tokens computed plus tokens generated.
        step_tokens = prompt_now + generated
        self.iteration_tokens_sum += step_tokens
        self.iteration_tokens_counts[bisect_left(ITERATION_TOKEN_BUCKETS, step_tokens)] += 1

    def _beam_step(
        self,
        rows: list[Request],
        logits: torch.Tensor,
        outputs: dict[int, list[EngineCoreOutput]],
    ) -> None:
        """Each beam search with rows this step picks its next beams; one that is over
        answers. Then the others give their beams sequences, copy-on-write."""
        by_group: dict[BeamGroup, list[int]] = {}
        for i, request in enumerate(rows):
            by_group.setdefault(request.beam, []).append(i)
        going_on = []
        for group, index in by_group.items():
            if group.advance([rows[i] for i in index], logits[index]):
                self.scheduler.finish_group(group)
                del self.requests[group.request_id]
                outputs.setdefault(group.root.client_index, []).append(group.output())
            else:
                going_on.append(group)
        # After every selection: making room for one group's forks may preempt another.
        for group in going_on:
            copies = group.materialize(self.blocks, self.scheduler)
            if copies:  # now, before another group's fork can reuse a block freed since
                self.runner.copy_blocks(copies)

    def _outputs(self, sampled: list[Request]) -> dict[int, list[EngineCoreOutput]]:
        # Hot path: one small Struct per request per step.
        grouped: dict[int, list[EngineCoreOutput]] = {}
        for request in sampled:
            if request.error is not None:  # its constraint refused the sampled token
                del self.requests[request.request_id]
                output = error_output(request.request_id, request.error, request.finish_reason)
                grouped.setdefault(request.client_index, []).append(output)
                continue
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[request.all_token_ids[-1]],
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if request.pending_logprobs:
                output.new_logprobs = concat_logprobs(request.pending_logprobs)
                request.pending_logprobs = []
            if not request.prompt_logprobs_done:
                output.prompt_logprobs = concat_logprobs(request.prompt_logprobs_parts)
                request.prompt_logprobs_parts = []
                request.prompt_logprobs_done = True
            if request.finish_reason is not None:
                del self.requests[request.request_id]
                self._count_preemptions(request)
            grouped.setdefault(request.client_index, []).append(output)
        return grouped

    def _count_preemptions(self, request: Request) -> None:
        """vLLM's request_num_preemptions: one observation per finished request."""
        n = request.num_preemptions
        self.request_preemptions_sum += n
        self.request_preemptions_counts[bisect_left(REQUEST_PREEMPTION_BUCKETS, n)] += 1

    def make_stats(self) -> SchedulerStats:
        blocks = self.blocks
        return SchedulerStats(
            num_running=self.scheduler.num_running_seqs,
            num_waiting=len(self.scheduler.waiting) + len(self.grammars),
            kv_cache_usage=blocks.usage,
            num_total_blocks=blocks.num_usable_blocks,
            num_free_blocks=blocks.num_free_blocks,
            prefix_cache_queries=blocks.prefix_cache_queries,
            prefix_cache_hits=blocks.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_aborted=self.num_aborted,
            num_steps=self.num_steps,
            num_waits=self.num_waits,
            prompt_tokens_computed=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens,
            step_time_s=self.step_time_s,
            iteration_tokens_sum=self.iteration_tokens_sum,
            iteration_tokens_counts=list(self.iteration_tokens_counts),
            request_preemptions_sum=self.request_preemptions_sum,
            request_preemptions_counts=list(self.request_preemptions_counts),
            lora_version=0 if self.loras is None else self.loras.version,
            lora_loaded=[] if self.loras is None else self.loras.loaded_names(),
        )


def _token_id(value: object) -> int | None:
    """A config's single token id (lists name their first)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None
