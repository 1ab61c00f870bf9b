"""Shared pieces of the engine tests: prompts, transformers' own greedy output, requests."""

from __future__ import annotations

import random
from pathlib import Path

import hf_generate
import torch

from protocol.messages import EngineCoreRequest, SamplingParams

# Byte ids only: the tiny tokenizer's pad id (256) must stay out of prompts, or
# generate() would mask those positions out (the oracle trap of pitfall 9).
PROMPT_LENGTHS = (5, 17, 33, 40, 64, 1, 90, 16)
NUM_NEW = 16
SHARED_PREFIX_LEN = 40
# Tiny engines need little cache: 1 MiB is 128 blocks of the tiny models' 8 KiB.
SMALL_KV = 1 << 20


def make_prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(num: int = 3, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(SHARED_PREFIX_LEN)]
    return [prefix + [rng.randrange(256) for _ in range(5 + 3 * i)] for i in range(num)]


def greedy(num_new: int = NUM_NEW, **overrides: object) -> SamplingParams:
    return SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, **overrides)


def hf_greedy(model_dir: Path, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[list[int]]:
    """transformers' generate(), one prompt at a time, fp32: the correctness oracle."""
    return hf_generate.hf_greedy(model_dir, prompts, num_new)


def hf_log_softmax(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """log_softmax of a full fp32 forward over `tokens`: row i predicts token i + 1."""
    model = hf_generate.reference_model(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def request(request_id: str, prompt: list[int], params: SamplingParams, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        arrival_time=0.0,
        **kw,
    )
