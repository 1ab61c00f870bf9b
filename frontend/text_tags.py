"""Finding marker tags (`<tool_call>`, `</think>`, ...) in text that is still growing."""

from __future__ import annotations


def held_suffix(text: str, tags: tuple[str, ...], start: int = 0) -> int:
    """How many trailing characters of `text[start:]` could be the beginning of one of `tags`.

    A stream must hold those back: they are either a tag in the making or plain text,
    and the next characters decide which.
    """
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text) - start), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


def find_first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The earliest occurrence of any of `tags` at or after `start`: (index, tag), or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        at = text.find(tag, start, len(text) if best < 0 else best + len(tag))
        if at >= 0 and (best < 0 or at < best):
            best, found = at, tag
    return best, found
