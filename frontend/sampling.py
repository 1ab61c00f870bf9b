"""Request fields → the engine's SamplingParams, with the checks that need the model
or the server's flags. Every failure is an APIError naming the field and the limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from frontend.errors import APIError
from frontend.openai_models import SamplingFields
from protocol.messages import SamplingParams

if TYPE_CHECKING:
    from frontend.serving import ServingContext

# generation_config.json keys that act as server-side defaults (request values win).
_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config: dict) -> dict:
    """vLLM's rule: the model's generation_config supplies defaults for sampling fields."""
    return {k: generation_config[k] for k in _DEFAULT_KEYS if k in generation_config}


def context_length_error(num_prompt_tokens: int, max_model_len: int) -> APIError:
    return APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt has {num_prompt_tokens} tokens; the prompt must be shorter than the "
        f"context length.",
        param="input_tokens",
    )


def check_prompt_length(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, kv_limit: int | None = None
) -> None:
    """The prompt must leave room for max_tokens in the context and in the KV cache
    (`kv_limit`: prompt + max_tokens one request may need, see ServingContext)."""
    if num_prompt_tokens == 0:
        raise APIError(
            "the prompt is empty after tokenization; send at least one token",
            param="prompt",
        )
    if num_prompt_tokens >= max_model_len:
        raise context_length_error(num_prompt_tokens, max_model_len)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    if kv_limit is not None and num_prompt_tokens + max_tokens > kv_limit:
        raise APIError(
            f"This server's KV cache holds at most {kv_limit} tokens per request. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )


def truncation(keep: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens as a count of last tokens to keep (-1:
    max_model_len); None: no truncation."""
    if keep is None:
        return None
    if keep == -1:
        return max_model_len
    if keep > max_model_len:
        raise APIError(
            f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
            f"({max_model_len}); send a smaller value",
            param="truncate_prompt_tokens",
        )
    if keep == 0:
        raise APIError(
            "truncate_prompt_tokens 0 would leave an empty prompt; send -1 or a positive count",
            param="truncate_prompt_tokens",
        )
    return keep


def check_token_ids(ids, vocab_size: int, field: str) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise APIError(
                f"{field} contains token id {token_id}, which is out of vocabulary "
                f"(the vocabulary has {vocab_size} tokens: ids 0..{vocab_size - 1})",
                param=field,
            )


def check_logprobs(value: int | None, field: str, max_logprobs: int) -> None:
    if value is None:
        return
    if value < 0:
        raise APIError(f"{field} must be >= 0, got {value}", param=field)
    if 0 <= max_logprobs < value:  # -1: the whole vocabulary
        raise APIError(
            f"{field} is {value}, more than this server allows (--max-logprobs {max_logprobs})",
            param=field,
        )


def sampling_params(
    ctx: ServingContext,
    req: SamplingFields,
    prompts: list[list[int]],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    logprobs_field: str = "logprobs",
    echo_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's sampling parameters of a request, and the rules that need the model
    or the server: the prompt lengths, max_tokens, logprob counts, token ids.

    `max_tokens` None: what is left of the context after the longest prompt (chat's
    default, as in vLLM). `logprobs_field` names the field `logprobs` came from (chat's
    top_logprobs). `echo_logprobs`: prompt logprobs the response needs although the
    request did not ask for them (completions' echo with logprobs)."""
    if max_tokens is None:
        max_tokens = max(1, ctx.max_request_tokens - max(len(p) for p in prompts))
    max_logprobs = ctx.config.max_logprobs
    check_logprobs(logprobs, logprobs_field, max_logprobs)
    check_logprobs(req.prompt_logprobs, "prompt_logprobs", max_logprobs)
    if req.min_tokens > max_tokens:
        raise APIError(
            f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})",
            param="min_tokens",
        )
    prompt_logprobs = req.prompt_logprobs
    if echo_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, echo_logprobs)
    vocab_size = ctx.vocab_size
    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise APIError("allowed_token_ids may not be empty", param="allowed_token_ids")
        check_token_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids")
    logit_bias = None
    if req.logit_bias:
        logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in req.logit_bias.items()}
        check_token_ids(logit_bias, vocab_size, "logit_bias")
    defaults = ctx.defaults

    def pick(name: str, fallback):
        value = getattr(req, name)
        if value is None:
            value = defaults.get(name, fallback)
        return value

    top_k = pick("top_k", 0)
    for prompt in prompts:
        check_prompt_length(len(prompt), max_tokens, ctx.max_model_len, ctx.max_request_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        # top_k at or above the vocabulary keeps every token: the same as off.
        top_k=0 if top_k in (None, -1) or top_k >= vocab_size else int(top_k),
        min_p=float(pick("min_p", 0.0)),
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        seed=req.seed,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logit_bias=logit_bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=req.allowed_token_ids,
    )
