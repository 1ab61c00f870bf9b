"""A periodic log line per engine while there is traffic (API server 0 writes it:
engine stats are the same wherever they are read)."""

from __future__ import annotations

import asyncio
import logging
import time

from frontend.engine_client import EngineClient
from protocol.messages import SchedulerStats

log = logging.getLogger("zserve.stats")


async def log_stats_forever(client: EngineClient, interval_s: float = 10.0) -> None:
    last = {e.rank: (e.stats, time.monotonic()) for e in client.engines}
    while True:
        await asyncio.sleep(interval_s)
        for engine in client.engines:
            s = engine.stats
            prev, t0 = last[engine.rank]
            now = time.monotonic()
            last[engine.rank] = (s, now)
            if not engine.alive:
                continue
            if s.num_steps < prev.num_steps:  # a restarted engine counts from zero again
                prev = SchedulerStats()
            active = s.num_running or s.num_waiting or s.num_steps != prev.num_steps
            if not active:
                continue
            dt = max(now - t0, 1e-9)
            queries = s.prefix_cache_queries - prev.prefix_cache_queries
            hits = s.prefix_cache_hits - prev.prefix_cache_hits
            log.info(
                "engine %d: running %d, waiting %d, prompt %.1f tok/s, generation %.1f tok/s, "
                "KV cache %.1f%%, prefix-cache hit rate %.1f%%, preemptions %d",
                engine.rank,
                s.num_running,
                s.num_waiting,
                (s.prompt_tokens_computed - prev.prompt_tokens_computed) / dt,
                (s.generation_tokens - prev.generation_tokens) / dt,
                100 * s.kv_cache_usage,
                100 * hits / queries if queries else 0.0,
                s.num_preemptions,
            )
