"""torch's profiler in one engine, between POST /start_profile and /stop_profile: each
cycle writes one Chrome/Perfetto trace named for the engine's rank (--profiler-config)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine_core.config import ProfilerConfig
from protocol.controls import CONFLICT

log = logging.getLogger("zserve.engine")


# The longest stop() is allowed before the API servers take the engine for dead: 60 s a
# second profiled, at least 5 minutes (stopping and writing took 13x the profile here).
STOP_PER_PROFILED_S = 60.0
STOP_FLOOR_S = 300.0


class EngineProfiler:
    """Runs on the busy loop's thread, the thread every step's ops run on."""

    def __init__(self, config: ProfilerConfig, rank: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self.running: profile | None = None
        self.started_at = 0.0

    def start(self) -> dict:
        if self.running is not None:
            return {CONFLICT: "the profiler is already running; POST /stop_profile first"}
        c = self.config
        os.makedirs(c.torch_profiler_dir, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        running = profile(
            activities=activities,
            record_shapes=c.torch_profiler_record_shapes,
            profile_memory=c.torch_profiler_with_memory,
            with_stack=c.torch_profiler_with_stack,
            with_flops=c.torch_profiler_with_flops,
        )
        running.start()
        self.running, self.started_at = running, time.time()
        log.info("engine %d: profiler started", self.rank)
        return {"profiling": True}

    def stop_allowance_s(self) -> float:
        """How long stop() may take: torch processes the trace holding the GIL, here 82 s
        to stop and 173 s to write 20 s of steps under load (with stacks), so the
        allowance grows with the profile's length."""
        if self.running is None:
            return 0.0
        return max(STOP_FLOOR_S, STOP_PER_PROFILED_S * (time.time() - self.started_at))

    def stop(self) -> dict:
        """Stop and write the trace; answers its path."""
        running, self.running = self.running, None
        if running is None:
            return {CONFLICT: "the profiler is not running; POST /start_profile first"}
        running.stop()
        suffix = ".pt.trace.json.gz" if self.config.torch_profiler_use_gzip else ".pt.trace.json"
        # The rank first (one file per engine), then the start in milliseconds.
        name = f"zserve-engine-rank{self.rank}.{int(self.started_at * 1000)}{suffix}"
        path = Path(self.config.torch_profiler_dir) / name
        running.export_chrome_trace(str(path))
        log.info("engine %d: profiler stopped, trace in %s", self.rank, path)
        return {"trace": str(path), "seconds": round(time.time() - self.started_at, 3)}

    def step_range(self) -> record_function:
        """A named range around one engine step in the trace."""
        return record_function("zserve.engine_step")
