"""Prompts for the load generator: random, ShareGPT, and shared-prefix (prefix-repetition).

Random prompts are made of tokens from the server's own tokenizer and re-encoded until
the text encodes to exactly the requested number of tokens, so "64 input tokens" means
64 tokens on the server too (counting the BOS it adds).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.tokenizer import BenchTokenizer

DATASETS = ("random", "sharegpt", "prefix-repetition")

# A random token sequence rarely survives decode → encode unchanged (merges across token
# boundaries, bytes that are not valid UTF-8); each try repairs it, and a few suffice.
_MAX_REPAIRS = 16
_MAX_REROLLS = 8

# ShareGPT filters, as vLLM's benchmark applies them (tokens).
_SHAREGPT_MIN_LEN = 4
_SHAREGPT_MAX_PROMPT = 1024
_SHAREGPT_MAX_TOTAL = 2048


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send: its text, its length as the server counts it, and max_tokens."""

    prompt: str
    prompt_len: int
    output_len: int
    extra: dict | None = None  # fields of this request's body only (structured_load.py)
    model: str | None = None  # the model name to send instead of the endpoint's (--lora-modules)


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    prefix_output_len: int = 128


def build_requests(cfg: DatasetConfig, tok: BenchTokenizer) -> list[SampleRequest]:
    rng = random.Random(cfg.seed)
    if cfg.name == "random":
        return random_requests(
            tok,
            rng,
            cfg.num_prompts,
            input_len=cfg.random_input_len,
            output_len=cfg.random_output_len,
            range_ratio=cfg.random_range_ratio,
            prefix_len=cfg.random_prefix_len,
        )
    if cfg.name == "sharegpt":
        if not cfg.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(
            tok, rng, cfg.dataset_path, cfg.num_prompts, output_len=cfg.sharegpt_output_len
        )
    if cfg.name == "prefix-repetition":
        return prefix_repetition_requests(
            tok,
            rng,
            cfg.num_prompts,
            prefix_len=cfg.prefix_len,
            suffix_len=cfg.suffix_len,
            num_prefixes=cfg.num_prefixes,
            output_len=cfg.prefix_output_len,
        )
    raise ValueError(f"unknown dataset {cfg.name!r}; choose one of {', '.join(DATASETS)}")


def exact_text(
    tok: BenchTokenizer,
    rng: random.Random,
    num_tokens: int,
    head: tuple[str, list[int]] = ("", []),
) -> tuple[str, list[int]]:
    """Random text that, appended to `head` (text, ids), encodes to head's ids followed by
    exactly `num_tokens` tokens. Returns (text, its ids)."""
    head_text, head_ids = head
    allowed = tok.allowed_ids()
    for _ in range(_MAX_REROLLS):
        ids = rng.choices(allowed, k=num_tokens)
        for _ in range(_MAX_REPAIRS):
            text = tok.decode(ids)
            got = tok.encode(head_text + text)
            if got[: len(head_ids)] != head_ids:
                # The first token merged with the end of the head: try another first token.
                ids[0] = rng.choice(allowed)
                continue
            got = got[len(head_ids) :]
            if len(got) == num_tokens:
                return text, got
            if len(got) > num_tokens:
                ids = got[:num_tokens]
            else:
                ids = got + rng.choices(allowed, k=num_tokens - len(got))
    raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens with {tok.name}")


def _length_range(mean: int, ratio: float) -> tuple[int, int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))


def random_requests(
    tok: BenchTokenizer,
    rng: random.Random,
    num: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Prompts of prefix_len shared tokens + ~input_len random ones (the server's special
    tokens included in input_len), each asking for ~output_len tokens."""
    specials = tok.num_special_tokens_to_add
    in_lo, in_hi = _length_range(max(0, input_len - specials), range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    if prefix_len + in_lo < 1:
        raise ValueError(
            f"--random-input-len {input_len} leaves no prompt token once the tokenizer's "
            f"{specials} special token(s) are counted; raise it or add --random-prefix-len"
        )
    prefix = exact_text(tok, rng, prefix_len) if prefix_len else ("", [])
    requests = []
    for _ in range(num):
        n_in = rng.randint(in_lo, in_hi)
        text, ids = exact_text(tok, rng, n_in, head=prefix) if n_in else ("", [])
        requests.append(
            SampleRequest(
                prompt=prefix[0] + text,
                prompt_len=len(prefix[1]) + len(ids) + specials,
                output_len=max(1, rng.randint(out_lo, out_hi)),
            )
        )
    return requests


def prefix_repetition_requests(
    tok: BenchTokenizer,
    rng: random.Random,
    num: int,
    *,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> list[SampleRequest]:
    """The shared-prefix workload: `num_prefixes` random prefixes, each followed by its own
    random suffix, spread evenly over `num` prompts and shuffled (prefix-cache hits)."""
    if not 1 <= num_prefixes <= num:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, {num}]")
    specials = tok.num_special_tokens_to_add
    prefixes = [exact_text(tok, rng, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num):
        head = prefixes[i % num_prefixes]
        text, ids = exact_text(tok, rng, suffix_len, head=head)
        requests.append(
            SampleRequest(
                prompt=head[0] + text,
                prompt_len=len(head[1]) + len(ids) + specials,
                output_len=output_len,
            )
        )
    rng.shuffle(requests)
    return requests


def _first_exchange(entry: object) -> tuple[str, str] | None:
    """The first (human, assistant) turn pair of one ShareGPT entry, if it has one."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations") or entry.get("conversation")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [t.get("value", t.get("content")) if isinstance(t, dict) else None for t in turns[:2]]
    if not all(isinstance(t, str) for t in texts):
        return None
    return texts[0], texts[1]


def sharegpt_requests(
    tok: BenchTokenizer,
    rng: random.Random,
    path: str | Path,
    num: int,
    *,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """First turns of a ShareGPT-format JSON file: the human turn is the prompt, the reply's
    length (or `output_len`) is max_tokens. Too short or too long pairs are skipped."""
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [p for p in map(_first_exchange, entries) if p is not None]
    rng.shuffle(pairs)
    specials = tok.num_special_tokens_to_add
    requests: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num:
            break
        prompt_len = tok.count(prompt) + specials
        out = output_len if output_len is not None else tok.count(reply)
        too_short = prompt_len < _SHAREGPT_MIN_LEN or (
            output_len is None and out < _SHAREGPT_MIN_LEN
        )
        too_long = prompt_len > _SHAREGPT_MAX_PROMPT or prompt_len + out > _SHAREGPT_MAX_TOTAL
        if not (too_short or too_long):
            requests.append(SampleRequest(prompt, prompt_len, out))
    if not requests:
        raise ValueError(f"{path}: no usable conversation (each needs two turns of 4+ tokens)")
    # Fewer usable pairs than prompts asked for: repeat them, in order.
    return [requests[i % len(requests)] for i in range(num)]
