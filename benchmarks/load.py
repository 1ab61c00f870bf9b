"""The load generator: dispatch requests at a Poisson/gamma rate under a concurrency cap."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from benchmarks.client import Endpoint, RequestResult, send_request
from benchmarks.datasets import SampleRequest


@dataclass(frozen=True)
class LoadPlan:
    """How requests arrive: all at once (rate inf) or a gamma process, at most N in flight."""

    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    request_timeout_s: float = 600.0
    progress: bool = True


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration: float


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Dispatch offsets (s) of n requests: gaps drawn from a gamma distribution of shape
    `burstiness` and mean 1/rate (burstiness 1 = Poisson; < 1 burstier, > 1 more even).
    The first request goes at 0."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    scale = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        times.append(t)
    return times


def new_session(request_timeout_s: float) -> aiohttp.ClientSession:
    """A session with no connection limit (concurrency must be real) and long timeouts."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, connect=60, sock_read=request_timeout_s),
    )


async def run_load(endpoint: Endpoint, requests: list[SampleRequest], plan: LoadPlan) -> LoadResult:
    """Send every request once; return each one's result (in order) and the wall time."""
    offsets = arrival_times(
        len(requests), plan.request_rate, plan.burstiness, random.Random(plan.seed)
    )
    limit = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    bar = tqdm(total=len(requests), disable=not plan.progress, unit="req", dynamic_ncols=True)

    async with new_session(plan.request_timeout_s) as session:

        async def one(req: SampleRequest) -> RequestResult:
            if limit is None:
                result = await send_request(session, endpoint, req, t0)
            else:
                async with limit:
                    result = await send_request(session, endpoint, req, t0)
            bar.update(1)
            return result

        t0 = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return LoadResult(list(results), duration)


async def run_one(endpoint: Endpoint, request: SampleRequest, timeout_s: float) -> RequestResult:
    """A single request on its own session: the probe before a run."""
    async with new_session(timeout_s) as session:
        return await send_request(session, endpoint, request, time.perf_counter())
