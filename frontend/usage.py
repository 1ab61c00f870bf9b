"""The `usage` object of responses and chunks."""

from __future__ import annotations

from frontend.generation import Generation


def usage(gen: Generation, prompt_tokens_details: bool = False) -> dict:
    prompt = gen.num_prompt_tokens
    completion = gen.num_generated
    result = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None,
    }
    if prompt_tokens_details and gen.num_cached_tokens:
        result["prompt_tokens_details"] = {"cached_tokens": gen.num_cached_tokens}
    return result
