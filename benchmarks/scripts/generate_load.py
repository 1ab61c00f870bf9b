"""Load for /inference/v1/generate, which `vllm bench serve` does not drive: N requests
of 64 random prompt ids and 64 output tokens (ignore_eos), streamed in tokens mode, at
concurrency C, against any server with vLLM's scale-out routes. Prints output tok/s,
TTFT p99 and ITL p99 (gaps between chunks).

    python benchmarks/scripts/generate_load.py http://127.0.0.1:8000 200 32
"""

import asyncio, json, random, sys, time, httpx

URL, N, C = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(0)
prompts = [[random.randrange(300, 8000) for _ in range(64)] for _ in range(N)]


async def one(c, prompt, ttft, itl):
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 64, "ignore_eos": True, "temperature": 1.0},
        "stream": True,
    }
    t0 = time.perf_counter()
    last = None
    n = 0
    async with c.stream("POST", "/inference/v1/generate", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            n += (
                len(json.loads(line[6:])["choices"][0]["token_ids"])
                if '"choices":[{' in line
                else 0
            )
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last = now
    return n


async def main():
    ttft, itl = [], []
    sem = asyncio.Semaphore(C)
    async with httpx.AsyncClient(
        base_url=URL, timeout=600, limits=httpx.Limits(max_connections=C + 8)
    ) as c:

        async def guarded(p):
            async with sem:
                return await one(c, p, ttft, itl)

        await asyncio.gather(*(guarded(p) for p in prompts[:16]))  # warm
        ttft.clear()
        itl.clear()
        t = time.perf_counter()
        total = sum(await asyncio.gather(*(guarded(p) for p in prompts)))
        wall = time.perf_counter() - t
    q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))] * 1000
    print(
        json.dumps(
            {
                "tok_s": round(total / wall),
                "tokens": total,
                "ttft_p99_ms": round(q(ttft, 0.99), 1),
                "itl_p99_ms": round(q(itl, 0.99), 1),
            }
        )
    )


asyncio.run(main())
