"""Prompt rendering: the tokenizer, the chat template and the model facts the API needs.

Uses transformers' PreTrainedTokenizerFast (never AutoTokenizer, which imports torch)
and the raw `tokenizers.Tokenizer` underneath it for the hot paths.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("zserve.renderer")


class Renderer:
    def __init__(self, tokenizer_dir: str, chat_template: str | None = None):
        from transformers import PreTrainedTokenizerFast

        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        self.raw = self.tokenizer.backend_tokenizer
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        # What the model is (vocabulary, context, EOS) the engines announce (EngineReady);
        # its sampling defaults come with the config (launcher/generation_config.py).
        # No token stands for more characters than its longest vocabulary entry (byte-level
        # and metaspace entries spell their text; byte-fallback entries spell more), so a
        # text longer than max_model_len times this cannot fit the context.
        vocab = self.raw.get_vocab(with_added_tokens=True)
        self.max_token_chars = max((len(t) for t in vocab), default=1) or 1
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary id

    def serialized(self) -> str:
        """The tokenizer as configured here, for worker processes (tokenizer_pool.py)."""
        return self.raw.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (for logprobs; remembered, since a
        logprobs -1 response names every token of the vocabulary at each position)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.raw.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.chat_template is not None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **(template_kwargs or {}),
        )
