"""The `usage` object of responses and chunks."""

from __future__ import annotations

from frontend.generation import Generation


def usage(
    gen: Generation,
    prompt_tokens_details: bool = False,
    count_generated: bool = True,
    stream: bool = False,
) -> dict:
    """The whole request's usage. With --enable-prompt-tokens-details its details say
    how many prompt tokens the prefix cache served, 0 included; without it a response
    says null and a stream's usage chunk leaves the key out, as vLLM's do.
    `count_generated` is False for completions' echo with max_tokens 0, whose one
    engine token is never shown."""
    prompt = gen.num_prompt_tokens
    completion = gen.num_generated if count_generated else 0
    result = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if prompt_tokens_details:
        result["prompt_tokens_details"] = {"cached_tokens": gen.num_cached_tokens}
    elif not stream:
        result["prompt_tokens_details"] = None
    return result


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """continuous_usage_stats: one choice's counts as of its chunk (vLLM's meaning)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
