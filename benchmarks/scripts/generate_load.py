"""Load for /inference/v1/generate, which `vllm bench serve` does not drive: N requests
of 64 random prompt ids and 64 output tokens (ignore_eos), streamed in tokens mode, at
concurrency C, against any server with vLLM's scale-out routes. Prints output tok/s,
TTFT p99 and ITL p99 (gaps between chunks), after a warm-up of 16 requests.

    python benchmarks/scripts/generate_load.py http://127.0.0.1:8000 200 32
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import httpx

PROMPT_TOKENS, OUTPUT_TOKENS, WARM_UP = 64, 64, 16


async def one(client: httpx.AsyncClient, prompt: list[int], ttft: list, itl: list) -> int:
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "temperature": 1.0},
        "stream": True,
    }
    start = time.perf_counter()
    last = None
    tokens = 0
    async with client.stream("POST", "/inference/v1/generate", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            for choice in json.loads(line[len("data: ") :])["choices"]:
                tokens += len(choice["token_ids"])
            if last is None:
                ttft.append(now - start)
            else:
                itl.append(now - last)
            last = now
    return tokens


def p99_ms(values: list[float]) -> float:
    return round(sorted(values)[int(0.99 * (len(values) - 1))] * 1000, 1)


async def main(url: str, num_requests: int, concurrency: int) -> None:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(300, 8000) for _ in range(PROMPT_TOKENS)] for _ in range(num_requests)
    ]
    ttft: list[float] = []
    itl: list[float] = []
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def limited(prompt: list[int]) -> int:
            async with slots:
                return await one(client, prompt, ttft, itl)

        await asyncio.gather(*(limited(p) for p in prompts[:WARM_UP]))
        ttft.clear()
        itl.clear()
        start = time.perf_counter()
        total = sum(await asyncio.gather(*(limited(p) for p in prompts)))
        wall = time.perf_counter() - start
    result = {"tok_s": round(total / wall), "tokens": total}
    print(json.dumps(result | {"ttft_p99_ms": p99_ms(ttft), "itl_p99_ms": p99_ms(itl)}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
