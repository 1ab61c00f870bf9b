"""Request fields → the engine's SamplingParams, with the checks that need the model
or the server's flags. Every failure is an APIError naming the field and the limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from frontend.errors import APIError, listing
from frontend.openai_models import SamplingFields
from protocol.messages import SamplingParams

if TYPE_CHECKING:
    from frontend.serving import ServingContext

# The most ids of logprob_token_ids (vLLM's limit).
MAX_LOGPROB_TOKEN_IDS = 128


def context_length_error(num_prompt_tokens: int, max_model_len: int, room: int = 1) -> APIError:
    """A prompt too long for the context, which must leave `room` tokens to generate
    (0: an input to pool, which may fill it)."""
    must = "be shorter than" if room else "not exceed"
    return APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt has {num_prompt_tokens} tokens; the prompt must {must} the context length.",
        param="input_tokens",
    )


@dataclass(frozen=True, slots=True)
class Truncation:
    """truncate_prompt_tokens with truncation_side: keep `count` tokens of the prompt,
    its last ones (left, the default, as in vLLM) or its first ones (right)."""

    count: int
    left: bool = True

    def apply(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.count:
            return ids
        return ids[-self.count :] if self.left else ids[: self.count]


def truncation(req: SamplingFields, max_model_len: int) -> Truncation | None:
    """The request's truncation (truncate_prompt_tokens -1: max_model_len); None: none."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return None
    if keep == -1:
        keep = max_model_len
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
    return Truncation(keep, (req.truncation_side or req.default_truncation_side) == "left")


def check_token_ids(ids, vocab_size: int, field: str) -> None:
    """Every id of `ids` must be in the vocabulary; the error lists the ones that are not."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            f"{field} contains token ids out of vocabulary: {listing(bad)} (the vocabulary "
            f"has {vocab_size} tokens: ids 0..{vocab_size - 1})",
            param=field,
        )


def logprob_count(value: int | None, vocab_size: int) -> int | None:
    """A requested logprob count; -1 means the whole vocabulary (vLLM)."""
    return vocab_size if value == -1 else value


def shown_logprobs(count: int | None, listed: list[int] | None, vocab_size: int) -> int:
    """How many tokens besides the chosen one a logprob entry shows: the listed ones
    (logprob_token_ids), else the requested count (-1: every token)."""
    if listed is not None:
        return len(listed)
    return logprob_count(count, vocab_size) or 0


def check_logprobs(value: int | None, field: str, max_logprobs: int, vocab_size: int) -> None:
    """At most --max-logprobs (-1 there: the whole vocabulary); the model refused
    counts below -1 already."""
    if value is None:
        return
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    if logprob_count(value, vocab_size) > limit:
        asked = f"-1 (the whole vocabulary, {vocab_size})" if value == -1 else str(value)
        raise APIError(
            f"{field} is {asked}, more than this server allows (--max-logprobs {max_logprobs})",
            param=field,
        )


def check_logprob_token_ids(ids: list[int] | None, vocab_size: int) -> None:
    if ids is None:
        return
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise APIError(
            f"logprob_token_ids has {len(ids)} ids; at most {MAX_LOGPROB_TOKEN_IDS} are allowed",
            param="logprob_token_ids",
        )
    check_token_ids(ids, vocab_size, "logprob_token_ids")


def fit_max_tokens(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, kv_limit: int
) -> int:
    """max_tokens for one prompt: what is left of the context (or of what the KV cache
    holds for one request, `kv_limit`) when less was left than asked for, so the
    generation stops there with finish_reason "length", as in vLLM."""
    if num_prompt_tokens == 0:
        raise APIError(
            "the prompt is empty after tokenization; send at least one token",
            param="prompt",
        )
    if num_prompt_tokens >= max_model_len:
        raise context_length_error(num_prompt_tokens, max_model_len)
    if num_prompt_tokens >= kv_limit:
        raise APIError(
            f"This server's KV cache holds at most {kv_limit} tokens per request. However, "
            f"your prompt has {num_prompt_tokens} tokens, which leaves no room to generate. "
            f"Please reduce the prompt.",
            param="input_tokens",
        )
    return min(max_tokens, kv_limit - num_prompt_tokens)


def sampling_params(
    ctx: ServingContext,
    req: SamplingFields,
    prompts: list[list[int]],
    *,
    max_tokens: int | None,
    max_tokens_field: str = "max_tokens",
    logprobs: int | None,
    logprobs_field: str = "logprobs",
    echo_logprobs: int | None = None,
) -> list[SamplingParams]:
    """The engine's sampling parameters of a request, one per prompt, and the rules
    that need the model or the server: the prompt lengths, max_tokens, logprob counts,
    token ids.

    `max_tokens` None: what is left of the context (chat's default, as in vLLM); a
    max_tokens larger than what is left after a prompt is cut to it. `logprobs_field`
    names the field `logprobs` came from (chat's top_logprobs); -1 means the whole
    vocabulary. `echo_logprobs`: prompt logprobs the response needs although the
    request did not ask for them (completions' echo with logprobs)."""
    max_model_len = ctx.max_model_len
    if max_tokens is not None and max_tokens > max_model_len:
        raise APIError(
            f"{max_tokens_field}={max_tokens} cannot be greater than max_model_len="
            f"{max_model_len}. Please request fewer output tokens.",
            param=max_tokens_field,
        )
    vocab_size = ctx.vocab_size
    max_logprobs = ctx.config.max_logprobs
    check_logprobs(logprobs, logprobs_field, max_logprobs, vocab_size)
    check_logprobs(req.prompt_logprobs, "prompt_logprobs", max_logprobs, vocab_size)
    check_logprob_token_ids(req.logprob_token_ids, vocab_size)
    prompt_logprobs = logprob_count(req.prompt_logprobs, vocab_size)
    if echo_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprob_count(echo_logprobs, vocab_size))
    if req.logprob_token_ids is not None:
        logprobs = 0  # the sampled token, then exactly the listed ones
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
    if max_tokens is None:  # chat's unset max_tokens: --generation-config's, else the context
        max_tokens = defaults.get("max_tokens")
    ceiling = ctx.config.max_tokens_ceiling  # max_new_tokens of --override-generation-config
    if ceiling is not None and (max_tokens is None or max_tokens > ceiling):
        max_tokens = ceiling

    def pick(name: str, fallback):
        value = getattr(req, name)
        if value is None:
            value = defaults.get(name, fallback)
        return value

    top_k = pick("top_k", 0)
    params = SamplingParams(
        max_tokens=max_model_len if max_tokens is None else max_tokens,
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        # top_k at or above the vocabulary keeps every token: the same as off.
        top_k=0 if top_k in (None, -1) or top_k >= vocab_size else int(top_k),
        min_p=float(pick("min_p", 0.0)),
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        presence_penalty=float(pick("presence_penalty", 0.0)),
        frequency_penalty=float(pick("frequency_penalty", 0.0)),
        seed=req.seed,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logit_bias=logit_bias,
        logprobs=logprob_count(logprobs, vocab_size),
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=req.allowed_token_ids,
        logprob_token_ids=req.logprob_token_ids,
    )
    return [_fit(params, len(prompt), ctx.max_request_tokens, max_model_len) for prompt in prompts]


def _fit(params: SamplingParams, prompt_len: int, kv_limit: int, max_model_len: int):
    max_tokens = fit_max_tokens(prompt_len, params.max_tokens, max_model_len, kv_limit)
    if params.min_tokens > max_tokens:
        raise APIError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
            f"{params.min_tokens}.",
            param="min_tokens",
        )
    if max_tokens == params.max_tokens:
        return params
    return msgspec.structs.replace(params, max_tokens=max_tokens)
