"""Runs one scheduled step through the model: the KV cache, the step's shared tensors."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from engine_core.attention import AttentionMetadata, StepBatch, int_tensor
from engine_core.backends import make_backend
from engine_core.config import EngineConfig, default_max_num_seqs
from engine_core.device import select_device, set_up_host, torch_threads_beside
from engine_core.kv_cache import KVCacheSpec, PagedKVCache, gpu_num_blocks, sized_num_blocks
from engine_core.model_backend import ModelBackend
from engine_core.model_loader import inspect_model, resolve_dtype, resolve_max_model_len
from engine_core.request import Request
from engine_core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# A step of at most this many single-token rows keeps every thread (model_runner.
# threads_for), as does one with at least PREFILL_HEAVY prompt tokens. Two streams on
# two threads got 5 % more tok/s than on one but an ITL p99 of 6.7 ms against 3.7.
FEW_STREAMS = 1
PREFILL_HEAVY = 256


class ModelRunner:
    """Owns the model and its paged KV cache; turns a SchedulerOutput into logits."""

    def __init__(self, config: EngineConfig) -> None:
        self.device = select_device(config.device, config.data_parallel_local_rank)
        if config.max_num_seqs is None:
            config = replace(config, max_num_seqs=default_max_num_seqs(self.device.type))
        self.config = config  # with every default that depends on the device resolved
        self.num_threads = set_up_host(config, self.device)
        self.info = inspect_model(config.model, config.hf_overrides)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.info)
        self.dtype = resolve_dtype(config.dtype, self.info, self.device)
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.backend = self._make_backend()
        self.model_impl = type(self.backend).__name__
        self.kernels = self.backend.kernels  # the CPU kernels, if in use
        # Threads torch keeps while this runner steps (a process running several
        # runners, like the engine benchmark, sets it before each one's steps).
        self.torch_threads = torch_threads_beside(self.kernels, self.num_threads)
        torch.set_num_threads(self.torch_threads)
        # Threads of a step while the API server beside us streams to many clients:
        # one fewer where torch's OpenMP threads (oneDNN's matmuls) carry the forward,
        # as they do not give way to it; the kernels' own pool does, and where it runs
        # the matmuls two threads served more (BENCHMARKS.md §2, "Figures behind the code").
        own_pool = self.kernels is not None and self.kernels.prefer_linear
        spare = config.spare_core_for_frontend and self.device.type == "cpu" and not own_pool
        self.busy_threads = max(1, self.num_threads - 1) if spare else self.num_threads
        self.step_threads = self.num_threads  # in effect now
        self.spec = KVCacheSpec(
            self.info.num_layers,
            self.info.num_kv_heads,
            self.info.head_dim,
            config.block_size,
            self.dtype,
        )
        self.cache = PagedKVCache(self.spec, self.device, self.max_model_len)
        if self.device.type == "cuda" and config.kv_cache_memory_bytes is None:
            # Profile the biggest step on a scratch cache, then size the real one.
            self.cache.allocate(self._warmup_blocks())
            torch.cuda.reset_peak_memory_stats(self.device)
            self.warm_up(self.max_num_batched_tokens)
            self.cache.free()
            torch.cuda.empty_cache()
            self.num_blocks = gpu_num_blocks(self.spec, self.device, config.gpu_memory_utilization)
        else:
            self.num_blocks = sized_num_blocks(self.spec, config.kv_cache_memory_bytes, self.device)
        if self.num_blocks < 2:
            raise ValueError(
                f"the KV cache holds {self.num_blocks} blocks of {self.spec.block_bytes} bytes; "
                "give it more memory (kv_cache_memory_bytes / gpu_memory_utilization)"
            )
        self.cache.allocate(self.num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB; %d CPU threads",
            self.num_blocks, self.block_size, self.num_blocks * self.spec.block_bytes / 2**20,
            self.num_threads,
        )  # fmt: skip
        if self.device.type == "cpu":
            # A forward long enough for the tiled prefill attention, then every matmul
            # kernel a step can need (native_linear.row_bucket).
            usable_tokens = (self.num_blocks - 1) * self.block_size
            self.warm_up(min(256, self.max_num_batched_tokens, usable_tokens))
            warm_up_matmuls = getattr(self.backend, "warm_up_matmuls", None)
            if warm_up_matmuls is not None:
                warm_up_matmuls(self.max_num_batched_tokens, config.max_num_seqs)
                if self.busy_threads != self.num_threads:  # oneDNN builds per thread count
                    self.use_threads(self.busy_threads)
                    rows = min(self.max_num_batched_tokens, config.max_num_seqs + PREFILL_HEAVY)
                    warm_up_matmuls(rows, config.max_num_seqs)
                    self.use_threads(self.num_threads)

    # --- sleep mode (engine_core/sleep_mode.py) ------------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache tensors held now (0 while released)."""
        return self.num_blocks * self.spec.block_bytes if self.cache.layers else 0

    def release_kv_cache(self) -> None:
        """Drop the KV cache tensors (their contents are lost; every block must be free)."""
        self.cache.free()

    def restore_kv_cache(self) -> None:
        self.cache.allocate(self.num_blocks)

    def release_weights(self) -> None:
        """Drop the model (every weight tensor); reload_weights() reads them from disk."""
        self.backend = None

    def reload_weights(self) -> None:
        self.backend = self._make_backend()

    def _make_backend(self) -> ModelBackend:
        backend = make_backend(self.config, self.info, self.dtype, self.device, self.max_model_len)
        if self.config.runner == "pooling":
            backend.pool_hidden_states()
        return backend

    def _warmup_blocks(self) -> int:
        return -(-self.max_num_batched_tokens // self.block_size) + 2

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One dummy prefill of `num_tokens` in blocks 1.., which are re-zeroed after."""
        blocks = list(range(1, 1 + -(-num_tokens // self.block_size)))
        batch = StepBatch([(blocks, 0, num_tokens)], 0, torch.arange(num_tokens))
        meta = self.backend.attention_metadata(batch, self.cache)
        # The model's positions wrap at max_model_len (its RoPE tables end there): a
        # step's tokens span requests, never one long one.
        positions = (torch.arange(num_tokens) % self.max_model_len).to(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        self.backend.forward(
            ids, positions, meta, torch.tensor([num_tokens - 1], device=self.device)
        )
        for k, v in self.cache.layers:
            k[blocks] = 0
            v[blocks] = 0

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in every layer: a forked beam's own
        copy of the partial block it shares with its parent (block_manager.fork). Runs
        before the next step's forward, which writes into both."""
        dev = self.device
        src = torch.tensor([s for s, _ in pairs], device=dev)
        dst = torch.tensor([d for _, d in pairs], device=dev)
        for k, v in self.cache.layers:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def use_threads(self, threads: int) -> None:
        """Run the next steps on `threads` threads (the kernels' pool and torch's)."""
        torch.set_num_threads(torch_threads_beside(self.kernels, threads))
        self.step_threads = threads

    def threads_for(self, out: SchedulerOutput) -> int:
        """busy_threads for a step of many streams' tokens, else every thread: a step of
        a single stream, or one mostly of prefill, leaves the API server little to do.

        On 2 cores, with vllm bench serve beside it, one engine thread served 30 %
        more at 32 streams (and 13 % more at 256) than two, and 17 % less to a
        single stream (BENCHMARKS.md §1)."""
        decodes = out.num_tokens.count(1)
        if decodes <= FEW_STREAMS or sum(out.num_tokens) - decodes >= PREFILL_HEAVY:
            return self.num_threads
        return self.busy_threads

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [rows, V] fp32: one row per `out.sampling` request, one per
        `out.beam_rows` sequence, then the prompt-logprob rows of
        `out.prompt_logprob_rows` in order."""
        if self.busy_threads != self.num_threads:
            threads = self.threads_for(out)
            if threads != self.step_threads:
                self.use_threads(threads)
        input_ids, positions, meta, logits_indices = self.prepare(out)
        return self.backend.forward(input_ids, positions, meta, logits_indices)

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build every step tensor once; decodes (one token) packed first. The
        attention metadata is the backend's own form."""
        # Hot path: runs every step; per request only a few list operations.
        requests = [(r, n) for r, n in zip(out.requests, out.num_tokens) if n == 1]
        num_decodes = len(requests)
        requests += [(r, n) for r, n in zip(out.requests, out.num_tokens) if n != 1]
        lora = _lora_runs(requests, num_decodes) if out.has_lora else None
        ids: list[int] = []
        pos: list[int] = []
        sequences: list[tuple[list[int], int, int]] = []
        row_of: dict[int, int] = {}
        for request, n in requests:
            start = request.num_computed_tokens
            row_of[id(request)] = len(ids)
            sequences.append((request.block_ids, start, n))
            if n == 1:
                ids.append(request.all_token_ids[start])
                pos.append(start)
            else:
                ids.extend(request.all_token_ids[start : start + n])
                pos.extend(range(start, start + n))

        rows = [row_of[id(r)] + r.num_tokens - 1 - r.num_computed_tokens for r in out.sampling]
        if out.beam_rows:
            rows += [
                row_of[id(r)] + r.num_tokens - 1 - r.num_computed_tokens for r in out.beam_rows
            ]
        for request, first, end in out.prompt_logprob_rows:
            base = row_of[id(request)] - request.num_computed_tokens
            rows.extend(range(base + first, base + end))

        dev = self.device
        positions = int_tensor(pos)
        meta = self.backend.attention_metadata(
            StepBatch(sequences, num_decodes, positions, lora), self.cache
        )
        return int_tensor(ids).to(dev), positions.to(dev), meta, int_tensor(rows).to(dev)


def _lora_runs(
    requests: list[tuple[Request, int]], num_decodes: int
) -> list[tuple[int, int, object]] | None:
    """Order the decodes by adapter (in place), so each adapter's rows are one run; the
    runs of rows that have one: (first row, end row, packed adapter)."""
    decodes = requests[:num_decodes]
    decodes.sort(key=lambda rn: 0 if rn[0].lora is None else id(rn[0].lora))
    requests[:num_decodes] = decodes
    runs: list[tuple[int, int, object]] = []
    row = 0
    for request, n in requests:
        spec = request.lora
        if spec is not None:
            if runs and runs[-1][1] == row and runs[-1][2] is spec.adapter:
                runs[-1] = (runs[-1][0], row + n, spec.adapter)
            else:
                runs.append((row, row + n, spec.adapter))
        row += n
    return runs or None
