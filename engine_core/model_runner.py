"""Runs one scheduled step through the model: device, threads, KV cache, step tensors."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

from engine_core.attention import AttentionMetadata, PagedRows, PrefillChunk
from engine_core.config import EngineConfig
from engine_core.hf_backend import ModelBackend, TransformersBackend
from engine_core.kv_cache import KVCacheSpec, cpu_num_blocks, gpu_num_blocks
from engine_core.model_loader import (
    ModelInfo,
    inspect_model,
    load_model,
    resolve_dtype,
    resolve_max_model_len,
)
from engine_core.native_llama import (
    NATIVE_ARCHITECTURES,
    NativeLlamaBackend,
    native_unsupported_reason,
)
from engine_core.request import Request
from engine_core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def select_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {requested!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but no CUDA device is available")
    return device


def cpu_thread_count(config: EngineConfig) -> int:
    """Usable cores split between the local engines, so two engines never oversubscribe."""
    if config.cpu_threads is not None:
        if config.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {config.cpu_threads}")
        return config.cpu_threads
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, config.data_parallel_size_local))


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Stop glibc from handing a step's freed tensors back to the kernel.

    By default every allocation over 128 KiB is a fresh mmap, so each step's
    intermediates (gathered KV, activations, logits) are page-faulted in again:
    ~570 faults a step at batch 128 here, and a KV gather ran 5x slower into new
    pages than into reused ones. Serving from the heap and never trimming it keeps
    the steady state at zero faults. Returns False where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    # 32 MiB is the largest mmap threshold glibc accepts on 64-bit.
    settings = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(param, value) == 1 for param, value in settings)


def _make_backend(
    config: EngineConfig, info: ModelInfo, dtype: torch.dtype, device, max_model_len: int
) -> ModelBackend:
    """auto: the native forward where the architecture has one, else transformers."""
    impl = config.model_impl
    if config.cpu_kernels not in ("auto", "off"):
        raise ValueError(f"cpu_kernels must be auto or off; got {config.cpu_kernels!r}")
    if impl not in ("auto", "native", "transformers"):
        raise ValueError(f"model_impl must be auto, native or transformers; got {impl!r}")
    if impl != "transformers":
        reason = native_unsupported_reason(info)
        if reason is None:
            return NativeLlamaBackend(info, dtype, device, max_model_len, config.cpu_kernels)
        if impl == "native":
            raise ValueError(
                f"model_impl='native' is not available for this model ({reason}); native "
                f"architectures: {', '.join(NATIVE_ARCHITECTURES)}"
            )
    return TransformersBackend(load_model(info, dtype, device))


class ModelRunner:
    """Owns the model and its paged KV cache; turns a SchedulerOutput into logits."""

    def __init__(self, config: EngineConfig) -> None:
        self.device = select_device(config.device)
        self.num_threads = cpu_thread_count(config)
        torch.set_num_threads(self.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.info = inspect_model(config.model)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.info)
        self.dtype = resolve_dtype(config.dtype, self.info, self.device)
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.backend = _make_backend(config, self.info, self.dtype, self.device, self.max_model_len)
        self.model_impl = type(self.backend).__name__
        self.kernels = self.backend.kernels  # the CPU kernels, if in use
        # Threads torch keeps while this runner steps (a process running several
        # runners, like the engine benchmark, sets it before each one's steps).
        self.torch_threads = self.num_threads
        if self.kernels is not None:
            self.kernels.set_threads(self.num_threads)
            if self.kernels.has_linear:
                # The kernels then run the whole forward on their own pool; torch's
                # few remaining ops are small, and a second pool's workers would
                # spin for milliseconds after each one, on the cores the kernels use.
                self.torch_threads = 1
        torch.set_num_threads(self.torch_threads)
        self.spec = KVCacheSpec(
            self.info.num_layers,
            self.info.num_kv_heads,
            self.info.head_dim,
            config.block_size,
            self.dtype,
        )
        self._head_offsets = torch.arange(self.spec.num_kv_heads)
        key_positions = torch.arange(self.max_model_len + self.block_size, device=self.device)
        self._key_positions = key_positions[None]
        if self.device.type == "cuda":
            # Profile the biggest step on a scratch cache, then size the real one.
            self.kv_caches = self.spec.allocate(self._warmup_blocks(), self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.warm_up(self.max_num_batched_tokens)
            del self.kv_caches
            torch.cuda.empty_cache()
            self.num_blocks = gpu_num_blocks(self.spec, self.device, config.gpu_memory_utilization)
        else:
            self.num_blocks = cpu_num_blocks(self.spec, config.kv_cache_memory_bytes)
        if self.num_blocks < 2:
            raise ValueError(
                f"the KV cache holds {self.num_blocks} blocks of {self.spec.block_bytes} bytes; "
                "give it more memory (kv_cache_memory_bytes / gpu_memory_utilization)"
            )
        self.kv_caches = self.spec.allocate(self.num_blocks, self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB; %d CPU threads",
            self.num_blocks, self.block_size, self.num_blocks * self.spec.block_bytes / 2**20,
            self.num_threads,
        )  # fmt: skip
        if self.device.type == "cpu":
            usable_tokens = (self.num_blocks - 1) * self.block_size
            self.warm_up(min(64, self.max_num_batched_tokens, usable_tokens))

    def _warmup_blocks(self) -> int:
        return -(-self.max_num_batched_tokens // self.block_size) + 2

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One dummy prefill of `num_tokens` in blocks 1.., which are re-zeroed after."""
        bs = self.block_size
        blocks = list(range(1, 1 + -(-num_tokens // bs)))
        # Positions wrap at max_model_len: a step's tokens span requests, never one long one.
        positions = torch.arange(num_tokens) % self.max_model_len
        slots = torch.arange(num_tokens)
        token_blocks = torch.tensor(blocks)[slots // bs]
        if self.backend.kernels is not None:
            rows = PagedRows(
                slots=token_blocks * bs + slots % bs,
                tables=torch.tensor([blocks], dtype=torch.int32),
                row_table=torch.zeros(num_tokens, dtype=torch.int32),
                row_len=(positions + 1).to(torch.int32),
                max_len=int(positions.max()) + 1,
            )
            meta = AttentionMetadata(kv_caches=self.kv_caches, rows=rows)
        else:
            meta = AttentionMetadata(
                kv_caches=self.kv_caches,
                write_index=self._write_index(token_blocks, slots % bs).to(self.device),
                prefills=[PrefillChunk(0, num_tokens, 0, self._gather_index(blocks))],
            )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = positions.to(self.device)
        self.backend.forward(
            ids, positions, meta, torch.tensor([num_tokens - 1], device=self.device)
        )
        for k, v in self.kv_caches:
            k[blocks] = 0
            v[blocks] = 0

    def _write_index(self, token_blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Cache rows of N new tokens, ordered [Hkv, N] like the model's K/V."""
        bs, heads = self.block_size, self.spec.num_kv_heads
        base = token_blocks * (heads * bs) + offsets
        return (base[None, :] + self._head_offsets[:, None] * bs).flatten()

    def _gather_index(self, block_ids: list[int]) -> torch.Tensor:
        """(block, head) rows of one sequence's blocks, head-major: gathers [Hkv, L, D]."""
        blocks = torch.tensor(block_ids)
        index = blocks[None, :] * self.spec.num_kv_heads + self._head_offsets[:, None]
        return index.flatten().to(self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [rows, V] fp32: one row per `out.sampling` request, then the
        prompt-logprob rows of `out.prompt_logprob_rows` in order."""
        input_ids, positions, meta, logits_indices = self.prepare(out)
        return self.backend.forward(input_ids, positions, meta, logits_indices)

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build every step tensor once; decodes (one token) packed first."""
        # Hot path: runs every step; per request only a few list operations.
        requests = [(r, n) for r, n in zip(out.requests, out.num_tokens) if n == 1]
        num_decodes = len(requests)
        requests += [(r, n) for r, n in zip(out.requests, out.num_tokens) if n != 1]
        ids: list[int] = []
        pos: list[int] = []
        row_of: dict[int, int] = {}
        for request, n in requests:
            start = request.num_computed_tokens
            row_of[id(request)] = len(ids)
            if n == 1:
                ids.append(request.all_token_ids[start])
                pos.append(start)
            else:
                ids.extend(request.all_token_ids[start : start + n])
                pos.extend(range(start, start + n))

        rows = [row_of[id(r)] + r.num_tokens - 1 - r.num_computed_tokens for r in out.sampling]
        for request, first, end in out.prompt_logprob_rows:
            base = row_of[id(request)] - request.num_computed_tokens
            rows.extend(range(base + first, base + end))

        dev = self.device
        positions = torch.tensor(pos)
        if self.backend.kernels is not None:
            meta = self._paged_rows_meta(requests, positions)
        else:
            meta = self._torch_meta(requests, num_decodes, positions)
        return (
            torch.tensor(ids, device=dev),
            positions.to(dev),
            meta,
            torch.tensor(rows, dtype=torch.long, device=dev),
        )

    def _paged_rows_meta(
        self, requests: list[tuple[Request, int]], positions: torch.Tensor
    ) -> AttentionMetadata:
        """The CPU kernels' metadata: one block table per sequence, one entry per row."""
        # Hot path: plain lists, one tensor each at the end (repeat_interleave and
        # fancy indexing cost more than the lists at these sizes).
        bs = self.block_size
        tables: list[list[int]] = []
        row_table: list[int] = []
        slots: list[int] = []
        for i, (request, n) in enumerate(requests):
            start = request.num_computed_tokens
            blocks = request.block_ids
            tables.append(blocks[: -(-(start + n) // bs)])
            if n == 1:
                row_table.append(i)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                row_table.extend([i] * n)
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        width = max(len(t) for t in tables)
        rows = PagedRows(
            slots=torch.tensor(slots),
            tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            row_table=torch.tensor(row_table, dtype=torch.int32),
            row_len=(positions + 1).to(torch.int32),
            max_len=int(positions.max()) + 1,
        )
        return AttentionMetadata(kv_caches=self.kv_caches, rows=rows)

    def _torch_meta(
        self, requests: list[tuple[Request, int]], num_decodes: int, positions: torch.Tensor
    ) -> AttentionMetadata:
        """Gather indices and masks for attention in torch ops (decodes first)."""
        bs = self.block_size
        dev = self.device
        decodes = [r for r, _ in requests[:num_decodes]]
        decode_index = decode_pos = key_pos = None
        token_blocks = [r.block_ids[r.num_computed_tokens // bs] for r in decodes]
        if decodes:
            tables = [r.block_ids for r in decodes]
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            heads = self.spec.num_kv_heads
            decode_index = (table[:, None, :] * heads + self._head_offsets[None, :, None]).flatten()
            decode_pos = positions[:num_decodes, None]
            key_pos = self._key_positions[:, : width * bs]

        chunks = []
        block_parts = [torch.tensor(token_blocks, dtype=torch.long)]
        first = num_decodes
        for request, n in requests[num_decodes:]:
            start = request.num_computed_tokens
            block_ids = request.block_ids[: -(-(start + n) // bs)]
            chunk_pos = torch.arange(start, start + n)
            block_parts.append(torch.tensor(block_ids)[chunk_pos // bs])
            chunks.append(PrefillChunk(first, first + n, start, self._gather_index(block_ids)))
            first += n
        blocks = torch.cat(block_parts) if chunks else block_parts[0]
        return AttentionMetadata(
            kv_caches=self.kv_caches,
            write_index=self._write_index(blocks, positions % bs).to(dev),
            num_decodes=num_decodes,
            decode_gather_index=None if decode_index is None else decode_index.to(dev),
            decode_positions=None if decode_pos is None else decode_pos.to(dev),
            decode_key_positions=key_pos,
            prefills=chunks,
        )
