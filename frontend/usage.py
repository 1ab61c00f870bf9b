"""The `usage` object of responses and chunks."""

from __future__ import annotations

from frontend.generation import Generation


def usage(
    gen: Generation, prompt_tokens_details: bool = False, count_generated: bool = True
) -> dict:
    """`count_generated` is False for completions' echo with max_tokens 0, whose one
    engine token is never shown."""
    prompt = gen.num_prompt_tokens
    completion = gen.num_generated if count_generated else 0
    result = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None,
    }
    if prompt_tokens_details and gen.num_cached_tokens:
        result["prompt_tokens_details"] = {"cached_tokens": gen.num_cached_tokens}
    return result
