"""The paged KV cache tensors and how many blocks fit in the memory we may use."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
HUGE_PAGE_BYTES = 2 << 20

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """K and V of one block across every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate(self, num_blocks: int, device: torch.device) -> KVCache:
        # Zeroed, not empty: masked-out slots are still multiplied by zero in attention,
        # and 0 * NaN from never-written memory would poison the whole row.
        shape = (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        if device.type == "cpu":
            return [(cpu_zeros(shape, self.dtype), cpu_zeros(shape, self.dtype))
                    for _ in range(self.num_layers)]  # fmt: skip
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]


def cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous mapping advised onto transparent huge pages (2 MB), where
    the kernel grants them: a sequence's blocks scatter over a GB of 4 KB pages, and
    decode attention walks them with a TLB miss at nearly every block (a batch-128
    step ~1.2 % faster, BENCHMARKS.md §2). Written through once here, so the memory is
    taken now (as torch.zeros takes it), not as blocks are first used; the tensor holds
    the mapping until freed. torch.zeros where the system has no such advice."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # Private (a shared mapping is shmem, which the advice does not cover), and one huge
    # page more than needed, so the tensor can start on a 2 MB boundary.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=flags)
    try:
        mapping.madvise(advise)
    except OSError:  # a kernel without transparent huge pages: plain pages serve
        pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + nbytes].zero_().view(dtype).view(shape)


class PagedKVCache:
    """A runner's KV cache tensors, with the index tensors each step's attention
    metadata reuses (attention.torch_metadata)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device, max_model_len: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.device = device
        self.layers: KVCache = []
        self.head_offsets = torch.arange(spec.num_kv_heads)
        # Every position a sequence's keys can reach, for the decode masks.
        self.key_positions = torch.arange(max_model_len + spec.block_size, device=device)[None]

    def allocate(self, num_blocks: int) -> None:
        self.layers = self.spec.allocate(num_blocks, self.device)

    def free(self) -> None:
        self.layers = []


def sized_num_blocks(
    spec: KVCacheSpec, kv_cache_memory_bytes: int | None, device: torch.device
) -> int:
    """Blocks in the bytes given (on CPU, 1 GiB where none are). On a GPU the bytes
    replace gpu_memory_utilization's sizing, as in vLLM, and must be free now."""
    budget = kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if budget > free:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is more than the {free} bytes free on {device}"
            )
    return budget // spec.block_bytes


def gpu_num_blocks(spec: KVCacheSpec, device: torch.device, utilization: float) -> int:
    """Blocks that fit in `utilization` of the device once the weights and the
    warm-up's activation peak (measured by the caller just before) are accounted for."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_everyone = total - free
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = int(total * utilization) - used_by_everyone - activation_peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache "
            f"({used_by_everyone / 2**30:.1f} GiB of {total / 2**30:.1f} GiB already in use)"
        )
    return budget // spec.block_bytes
