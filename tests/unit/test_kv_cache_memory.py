"""The CPU KV cache's memory: zeros on 2 MB boundaries, taken at allocation, given back
when the tensors go."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine_core.kv_cache import HUGE_PAGE_BYTES, KVCacheSpec, cpu_zeros

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


def smaps_kib(field: str) -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(text.split(f"\n{field}:")[1].split()[0])


def test_cpu_layers_are_aligned_and_resident_until_freed():
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16
    )
    num_blocks = 1024  # 4 MiB a tensor: 2 huge pages each
    total = 4 * num_blocks * spec.block_bytes // (2 * spec.num_layers)
    gc.collect()
    before, huge_before = smaps_kib("Rss"), smaps_kib("AnonHugePages")
    layers = spec.allocate(num_blocks, torch.device("cpu"))
    allocated = smaps_kib("Rss")  # before anything else allocates
    huge = smaps_kib("AnonHugePages") - huge_before
    shapes = {(tuple(t.shape), t.dtype, t.is_contiguous()) for pair in layers for t in pair}
    assert shapes == {((num_blocks, 2, 16, 64), torch.bfloat16, True)}
    assert all(t.data_ptr() % HUGE_PAGE_BYTES == 0 for pair in layers for t in pair)
    print(f"RSS +{(allocated - before) / 1024:.1f} MiB, huge pages +{huge / 1024:.1f} MiB")
    # Taken now, as torch.zeros takes it: not block by block as requests first write.
    assert (allocated - before) * 1024 >= 0.9 * total
    del layers
    gc.collect()
    assert (allocated - smaps_kib("Rss")) * 1024 >= 0.9 * total  # the mappings went too


def test_cpu_layers_are_zeros_and_each_its_own_memory():
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16
    )
    tensors = [t for pair in spec.allocate(1024, torch.device("cpu")) for t in pair]
    assert not any(t.any() for t in tensors)
    tensors[1][7, 1, 3].fill_(1.5)
    assert float(tensors[1].sum()) == 1.5 * 64
    assert not tensors[0].any() and not tensors[2].any() and not tensors[3].any()


def test_small_or_odd_sizes_still_get_plain_zeros():
    small = cpu_zeros((3, 5), torch.float32)
    assert small.shape == (3, 5) and not small.any()
    odd = cpu_zeros((HUGE_PAGE_BYTES // 2 + 7,), torch.bfloat16)  # just over a huge page
    assert odd.numel() == HUGE_PAGE_BYTES // 2 + 7 and not odd.any()
    odd[-1] = 3.0
    assert float(odd[-1]) == 3.0
