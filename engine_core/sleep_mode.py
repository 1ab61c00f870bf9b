"""Sleep mode: an engine gives its KV cache (level 1), and its weights too (level 2),
back to the OS, and takes them back on wake-up (the weights read again from disk).

The step path keeps freed memory in the C heap on purpose (device.keep_freed_memory),
so releasing is explicit here: drop the tensors, collect, trim the heap, empty CUDA's
caching allocator; and every answer says what the process held before and after.
"""

from __future__ import annotations

import gc
import os

import torch

from engine_core.device import release_free_memory
from engine_core.engine import EngineCore
from engine_core.model_runner import ModelRunner
from protocol.controls import CONFLICT, SLEEP_LEVELS, WAKE_TAGS

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set (RSS), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def memory_usage(runner: ModelRunner) -> dict:
    """What the engine holds now: process RSS, KV cache bytes, and on CUDA the device
    bytes torch has allocated and reserved."""
    usage = {
        "rss_bytes": resident_bytes(),
        "kv_cache_bytes": runner.kv_cache_bytes,
        "weights_loaded": runner.backend is not None,
    }
    if runner.device.type == "cuda":
        usage["device_allocated_bytes"] = torch.cuda.memory_allocated(runner.device)
        usage["device_reserved_bytes"] = torch.cuda.memory_reserved(runner.device)
    return usage


def _return_freed_memory(device: torch.device) -> None:
    # Tensors held only by reference cycles go now, not at some later pass; those among
    # the objects frozen after loading (process.py) too.
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_free_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class SleepMode:
    """What one engine has released, and how it gets it back. Not thread-safe: the busy
    loop calls it, between steps."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.level = 0
        self.released: set[str] = set()  # of WAKE_TAGS

    @property
    def asleep(self) -> bool:
        return bool(self.released)

    def sleep(self, level: int) -> dict:
        """Release what `level` names. Running requests go back to wait (their KV cache
        is lost; they are recomputed after wake-up): the caller has already ended or
        drained the requests that must not be kept."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if self.asleep:
            return {CONFLICT: f"already asleep at level {self.level}; POST /wake_up first"}
        runner = self.engine.runner
        before = memory_usage(runner)
        preempted = self.engine.scheduler.preempt_all()
        # The cached prefix blocks' contents go with the tensors: forget them, or a
        # request after wake-up would read zeros as its prefix.
        if not self.engine.blocks.reset_prefix_cache():
            raise RuntimeError("KV blocks are still in use after every request was preempted")
        kv_cache_bytes = runner.kv_cache_bytes
        self.level = level
        runner.release_kv_cache()
        self.released.add("kv_cache")
        _return_freed_memory(runner.device)
        # What each release gave back to the OS, measured in between.
        freed = {"kv_cache": before["rss_bytes"] - resident_bytes()}
        if level == 2:
            between = resident_bytes()
            runner.release_weights()
            self.released.add("weights")
            _return_freed_memory(runner.device)
            freed["weights"] = between - resident_bytes()
        return {
            "level": level,
            "released": sorted(self.released),
            "preempted": preempted,
            "kv_cache_bytes": kv_cache_bytes,
            "rss_freed_bytes": freed,
            "memory_before": before,
            "memory_after": memory_usage(runner),
        }

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Take back what `tags` names (everything released when None); the engine is
        awake once nothing is released any more."""
        unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
        if unknown:
            raise ValueError(f"unknown wake-up tags {unknown}; known: {list(WAKE_TAGS)}")
        if not self.asleep:
            return {CONFLICT: "awake already; nothing to wake up"}
        runner = self.engine.runner
        before = memory_usage(runner)
        wanted = set(tags) if tags else set(WAKE_TAGS)
        restored = []
        for tag in WAKE_TAGS:  # weights first: the KV cache may be sized around them
            if tag in wanted and tag in self.released:
                if tag == "weights":
                    runner.reload_weights()
                else:
                    runner.restore_kv_cache()
                self.released.discard(tag)
                restored.append(tag)
        if not self.released:
            self.level = 0
        return {
            "restored": restored,
            "released": sorted(self.released),
            "is_sleeping": self.asleep,
            "memory_before": before,
            "memory_after": memory_usage(runner),
        }

    def state(self) -> dict:
        return {"level": self.level, "released": sorted(self.released)}
