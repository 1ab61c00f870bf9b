"""Where an engine runs and how it uses its host: the device, CPU threads, the heap."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

from engine_core.config import EngineConfig, cpu_thread_count
from engine_core.cpu_kernels import CpuKernels


def spread_over_gpus(requested: str, local_rank: int, gpus: int) -> str:
    """The device of this node's engine `local_rank`: a bare "cuda" (or "auto" where
    there are GPUs) gives each local engine a GPU of its own while there are enough, as
    vLLM's data-parallel ranks each take one (more engines than GPUs share them, in
    turn); "cpu" and an explicit "cuda:N" are kept."""
    if requested == "auto":
        requested = "cuda" if gpus else "cpu"
    if requested == "cuda" and gpus:
        return f"cuda:{local_rank % gpus}"
    return requested


def select_device(requested: str, local_rank: int = 0) -> torch.device:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    requested = spread_over_gpus(requested, local_rank, gpus)
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {requested!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but no CUDA device is available")
    return device


def set_up_host(config: EngineConfig, device: torch.device) -> int:
    """Before the model loads: torch gets the engine's CPU threads and, on CPU, a heap
    that keeps freed memory. Returns the thread count."""
    cores = len(os.sched_getaffinity(0))
    threads = cpu_thread_count(config.cpu_threads, cores, config.data_parallel_size_local)
    torch.set_num_threads(threads)
    if device.type == "cpu":
        keep_freed_memory()
    return threads


def torch_threads_beside(kernels: CpuKernels | None, threads: int) -> int:
    """Give the CPU kernels (if any) the engine's threads; answers the threads torch
    keeps while the backend steps."""
    if kernels is None:
        return threads
    kernels.set_threads(threads)
    if kernels.prefer_linear and not kernels.linear_amx:
        # The kernels then run the whole forward on their own pool; torch's few
        # remaining ops are small, and a second pool's workers would spin for
        # milliseconds after each one, on the cores the kernels use (Zen 4). Where
        # oneDNN's matmuls run the forward torch keeps the threads (one thread: a
        # batch-128 decode step of the small model 15.2 ms against 10.1, AMX box), and
        # beside the kernels' AMX matmul too: SDPA's tiled attention of long prompt
        # chunks is torch's (long prompts served 688 -> 764 tok/s with two, TTFT p99
        # 416 -> 344 ms; BENCHMARKS.md §1).
        return 1
    return threads


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Stop glibc from handing a step's freed tensors back to the kernel.

    By default every allocation over 128 KiB is a fresh mmap, so each step's
    intermediates (gathered KV, activations, logits) are page-faulted in again, every
    step, and filling new pages is several times slower than reusing old ones
    (BENCHMARKS.md §2, "Figures behind the code"). Serving from the heap and never trimming it keeps the steady
    state at zero faults. Returns False where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    # 32 MiB is the largest mmap threshold glibc accepts on 64-bit.
    settings = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(param, value) == 1 for param, value in settings)


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim): the busy loop
    calls it once idle, so a burst's peak does not stay with the process for good.
    Returns False where the C library has no malloc_trim."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
