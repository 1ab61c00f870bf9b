"""Engine logprob rows → the OpenAI shapes (legacy completions, chat) and vLLM's prompt_logprobs.

An engine row is (token_ids, logprobs, rank): column 0 is the chosen token, the
rest its top-n alternatives, best first (or the tokens of logprob_token_ids, in the
request's order). As in vLLM, every shape lists the chosen token first, then the
others without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from frontend.renderer import Renderer
from protocol.messages import Logprobs

FLOOR = -9999.0


def _clamp(value: float) -> float:
    return FLOOR if math.isinf(value) or math.isnan(value) or value < FLOOR else value


def token_namer(renderer: Renderer, as_ids: bool) -> Callable[[int], str]:
    """How a logprob entry names its token: its text, or vLLM's `token_id:N`
    (`return_tokens_as_token_ids`, for tokens whose text alone is ambiguous)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return renderer.token_text


class CompletionLogprobs:
    """Accumulates the legacy `{tokens, token_logprobs, top_logprobs, text_offset}`."""

    def __init__(
        self, renderer: Renderer, top_n: int, text_offset: int = 0, as_ids: bool = False
    ) -> None:
        self.renderer = renderer
        self.name = token_namer(renderer, as_ids)
        self.top_n = top_n
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.sent = 0  # entries already handed out by take()

    def add_prompt(self, prompt_ids: list[int], rows: Logprobs | None) -> None:
        """Echoed prompt tokens: the first has no logprob; the others come from
        prompt logprobs when the engine computed them."""
        for i, token_id in enumerate(prompt_ids):
            row = i - 1
            if rows is not None and 0 <= row < len(rows.token_ids):
                self._add(rows.token_ids[row], rows.logprobs[row], token_id)
            else:
                self._append(self.name(token_id), None, None)

    def add(self, rows: Logprobs) -> None:
        for ids, lps in zip(rows.token_ids, rows.logprobs, strict=True):
            self._add(ids, lps, ids[0])

    def _add(self, ids: list[int], lps: list[float], token_id: int) -> None:
        """vLLM's dict: the chosen token, then up to top_n others."""
        text = self.name
        chosen = text(token_id)
        top: dict[str, float] = {}
        for tid, lp in _entries(ids, lps, self.top_n + 1):
            top.setdefault(text(tid), _clamp(lp))
        self._append(chosen, _clamp(lps[0]), top)

    def _append(self, token: str, logprob: float | None, top: dict | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def take(self) -> dict:
        """The entries added since the previous take (a stream's chunk may carry
        several tokens, or none when their text is held back)."""
        start, self.sent = self.sent, len(self.tokens)
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


def _entries(ids: list[int], lps: list[float], count: int) -> list[tuple[int, float]]:
    """At most `count` (id, logprob) of a row: the chosen token (column 0), then the
    others in order, each id once."""
    out = [(ids[0], lps[0])]
    seen = {ids[0]}
    for tid, lp in zip(ids[1:], lps[1:], strict=True):
        if len(out) >= count:
            break
        if tid not in seen:
            seen.add(tid)
            out.append((tid, lp))
    return out[:count]


def chat_logprobs(
    renderer: Renderer, rows: Logprobs, top_n: int, as_ids: bool = False
) -> list[dict]:
    """`choices[].logprobs.content` entries; `top_n` top_logprobs each (vLLM's: the
    chosen token first, then the best others)."""
    text = token_namer(renderer, as_ids)
    content = []
    for ids, lps in zip(rows.token_ids, rows.logprobs, strict=True):
        token = text(ids[0])
        content.append(
            {
                "token": token,
                "logprob": _clamp(lps[0]),
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (t := text(tid)),
                        "logprob": _clamp(lp),
                        "bytes": list(t.encode("utf-8")),
                    }
                    for tid, lp in _entries(ids, lps, top_n)
                ],
            }
        )
    return content


def token_id_logprobs(rows: Logprobs, count: int, ranked: bool = True) -> list[dict]:
    """/inference/v1/generate's entries in tokens mode: token ids, no text. The chosen
    token with its rank, and `count` top entries, the chosen token first; `ranked`
    False: the others are logprob_token_ids' listed tokens, whose rank is unknown."""
    content = []
    for i, (ids, lps) in enumerate(zip(rows.token_ids, rows.logprobs, strict=True)):
        rank = rows.ranks[i] or None
        top: list[dict] = []
        seen: set[int] = set()
        for j, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
            if len(top) >= count:
                break
            if tid not in seen:
                seen.add(tid)
                top_rank = rank if j == 0 else (j if ranked else None)
                top.append({"token_id": tid, "logprob": _clamp(lp), "rank": top_rank})
        content.append(
            {"token_id": ids[0], "logprob": _clamp(lps[0]), "rank": rank, "top_logprobs": top}
        )
    return content


def prompt_logprobs(
    renderer: Renderer, prompt_ids: list[int], rows: Logprobs | None, top_n: int
) -> list | None:
    """vLLM's shape: None for the first prompt token, then {token_id: {logprob, rank,
    decoded_token}} holding the actual token and the top-n (the engine may have
    computed more, for echo)."""
    if rows is None:
        return None
    text = renderer.token_text
    result: list[dict | None] = [None]
    for i, (ids, lps) in enumerate(zip(rows.token_ids, rows.logprobs, strict=True)):
        entry = {}
        for j, (tid, lp) in enumerate(zip(ids[: top_n + 1], lps[: top_n + 1], strict=True)):
            rank = rows.ranks[i] if j == 0 else j  # column j is the j-th best token
            entry.setdefault(
                str(tid), {"logprob": _clamp(lp), "rank": rank, "decoded_token": text(tid)}
            )
        result.append(entry)
    return result[: len(prompt_ids)]
