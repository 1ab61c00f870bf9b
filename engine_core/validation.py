"""The engine's own checks of a request, so a bad one is answered, never run."""

from __future__ import annotations

import math

from engine_core.block_manager import BlockManager
from protocol.messages import MAX_TEMPERATURE, EngineCoreRequest

MAX_LOGIT_BIAS = 100.0
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's limit
# The frontend allows 256 characters of a client's id plus its own suffix; an id past
# this is never a frontend's, and would be copied into every output of the request.
MAX_REQUEST_ID_CHARS = 512


def _token_range(field: str, ids: object, vocab_size: int) -> None:
    for t in ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{field} must hold token ids in 0..{vocab_size - 1}; got {t!r}")


def _between(field: str, value: float, low: float, high: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{field} must be between {low} and {high}; got {value!r}")


def validate_request(request: EngineCoreRequest, vocab_size: int, max_logprobs: int = 20) -> None:
    """Raise ValueError naming the field and its limit (max_logprobs -1: the vocabulary)."""
    if max_logprobs < 0:
        max_logprobs = vocab_size
    p = request.sampling_params
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id may be at most {MAX_REQUEST_ID_CHARS} characters long")
    if not request.prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    _token_range("prompt_token_ids", request.prompt_token_ids, vocab_size)
    if p.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1; got {p.max_tokens}")
    _between("temperature", p.temperature, 0.0, MAX_TEMPERATURE)
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1]; got {p.top_p}")
    if p.top_k < -1:
        raise ValueError(f"top_k must be -1, 0 (off) or a positive count; got {p.top_k}")
    _between("min_p", p.min_p, 0.0, 1.0)
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be > 0; got {p.repetition_penalty}")
    _between("presence_penalty", p.presence_penalty, -2.0, 2.0)
    _between("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    if not 0 <= p.min_tokens <= p.max_tokens:
        raise ValueError(
            f"min_tokens must be in 0..max_tokens ({p.max_tokens}); got {p.min_tokens}"
        )
    if p.seed is not None and not -(2**63) <= p.seed < 2**64:
        raise ValueError(f"seed must fit in 64 bits; got {p.seed}")
    _token_range("stop_token_ids", p.stop_token_ids, vocab_size)
    if p.logit_bias:
        _token_range("logit_bias", p.logit_bias.keys(), vocab_size)
        for value in p.logit_bias.values():
            _between("logit_bias values", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    for field, n in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if n is not None and not 0 <= n <= max_logprobs:
            raise ValueError(f"{field} must be in 0..{max_logprobs} (--max-logprobs); got {n}")
    if p.logprob_token_ids is not None:
        if len(p.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids may hold at most {MAX_LOGPROB_TOKEN_IDS} ids")
        _token_range("logprob_token_ids", p.logprob_token_ids, vocab_size)
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty when given")
        _token_range("allowed_token_ids", p.allowed_token_ids, vocab_size)


def check_fits(
    request: EngineCoreRequest, max_model_len: int, max_request_tokens: int, blocks: BlockManager
) -> None:
    """Refuse a request that can never run, naming the limit that binds: the context,
    or the KV cache (a generation's last token needs no KV; a pooled prompt's every
    token does)."""
    prompt_len = len(request.prompt_token_ids)
    if request.pooling is not None:
        if prompt_len > max_model_len:
            raise ValueError(
                f"the input ({prompt_len} tokens) exceeds max_model_len ({max_model_len})"
            )
        _check_blocks(blocks, blocks.blocks_needed(prompt_len), "the input", "")
        return
    max_tokens = request.sampling_params.max_tokens
    total = prompt_len + max_tokens
    if total <= max_request_tokens:
        return
    if total > max_model_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len ({max_model_len})"
        )
    needed = blocks.blocks_needed(total - 1)
    _check_blocks(blocks, needed, "prompt + max_tokens", "lower max_tokens or ")


def _check_blocks(blocks: BlockManager, needed: int, what: str, advice: str) -> None:
    if needed > blocks.num_usable_blocks:
        raise ValueError(
            f"{what} needs {needed} KV blocks but the cache has only "
            f"{blocks.num_usable_blocks}; {advice}give the KV cache more memory"
        )
