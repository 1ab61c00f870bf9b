"""The bodies of POST /v1/embeddings, /classify and /pooling (--runner pooling), and of
/score and /rerank, as vLLM takes them.

`input` is a text, texts, token ids or lists of them; or, instead, a conversation in
`messages` (or in `input`), or a list of conversations, rendered by the chat template.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from frontend.openai_models import (
    INT64_MAX,
    INT64_MIN,
    MAX_CACHE_SALT_CHARS,
    ChatMessage,
    Prompt,
    _Model,
    check_cache_salt,
)


class PoolingFields(_Model):
    """What every pooling route's body has (vLLM's pooling request fields)."""

    model: str | None = None
    user: str | None = None
    use_activation: bool | None = None  # embeddings: normalize; None: the server's default
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    default_truncation_side: ClassVar[str] = "right"  # vLLM's for pooling: the first tokens
    request_id: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)

    # What every request's admission reads (request_inputs.read_inputs, serving.submit):
    # one vector per input, nothing generated.
    n: ClassVar[int] = 1
    stop_strings: ClassVar[list[str]] = []
    include_stop_str_in_output: ClassVar[bool] = False
    skip_special_tokens: ClassVar[bool] = True

    @model_validator(mode="after")
    def _salt(self):
        check_cache_salt(self.cache_salt)
        return self


class PoolingInputs(PoolingFields):
    """The inputs of an embeddings or classification request: one answer each."""

    input: Prompt | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    add_special_tokens: bool | None = None  # None: true for input, false for messages
    # A conversation's rendering (as /v1/chat/completions', but no generation prompt).
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value):
        """One clear error for an input of no accepted shape (not the union's first)."""
        if value is None or isinstance(value, str) or _one_of_the_shapes(value):
            return value
        raise ValueError(
            "must be a text, a list of texts, a list of token ids, a list of such lists, or "
            "chat messages (or a list of conversations)"
        )

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data):
        if not isinstance(data, dict):
            return data
        if "normalize" in data:
            raise ValueError(
                "normalize: Parameter `normalize` was removed; use `use_activation` instead."
            )
        value = data.get("input")
        if "messages" not in data and isinstance(value, list) and value:
            first = value[0][0] if isinstance(value[0], list) and value[0] else value[0]
            if isinstance(first, dict):  # a conversation (or several) given as `input`
                data = {**data, "messages": value}
                del data["input"]
        return data

    @model_validator(mode="after")
    def _one_input(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("input: give exactly one of input or messages")
        if self.messages == []:
            raise ValueError("messages: may not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: Cannot set both `continue_final_message` and "
                "`add_generation_prompt` to True."
            )
        return self

    @property
    def conversations(self) -> list[list[ChatMessage]] | None:
        """The conversations to embed (None: `input` holds prompts)."""
        if self.messages is None:
            return None
        if isinstance(self.messages[0], list):
            return self.messages
        return [self.messages]


class ClassificationRequest(PoolingInputs):
    """/classify: each input's label probabilities (use_activation false: the logits)."""


class EmbeddingRequest(PoolingInputs):
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    # base64 and bytes only: the numbers' type and byte order (native: this host's).
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    dimensions: int | None = None  # Matryoshka models only (PoolingOptions)


class PoolingRequest(EmbeddingRequest):
    """/pooling: the same, for the one task a pooling server here has (its model's)."""

    task: Literal["embed", "classify"] | None = None


# --- /v2/embed: Cohere's embed API, as vLLM serves it -------------------------------------


class CohereContent(_Model):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: dict[str, str] | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError("multimodal content is not supported: this model takes text only")
        if self.text is None:
            raise ValueError("a text content needs text")
        return self


class CohereInput(_Model):
    content: list[CohereContent] = Field(..., min_length=1)


class CohereEmbedRequest(PoolingFields):
    """Texts (or inputs of text parts, rendered by the chat template) to embed; an
    input_type the model names a prompt for prefixes it (config.json's
    task_instructions, or sentence-transformers' prompts)."""

    input_type: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[CohereInput] | None = None
    output_dimension: int | None = None
    embedding_types: list[Literal["float", "binary", "ubinary", "base64"]] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_input(self):
        given = [f for f in ("texts", "images", "inputs") if getattr(self, f) is not None]
        if len(given) != 1 or not getattr(self, given[0]):
            raise ValueError(
                "texts: Exactly one of texts, images, or inputs must be provided, and it must "
                "be non-empty"
            )
        if self.images is not None:
            raise ValueError(
                "images: multimodal inputs are not supported: this model takes text only"
            )
        return self


# --- /score and /rerank: the cosine of two embeddings (vLLM's bi-encoder scoring) -------

ScoreInput = str | list[str]


class ScoringFields(PoolingFields):
    """Texts are cut to their first max_tokens_per_query / _doc tokens (0: not cut)."""

    max_tokens_per_query: int = Field(0, ge=0)
    max_tokens_per_doc: int = Field(0, ge=0)
    # A cross-encoder's template fields: an embedding model's scores take none (as vLLM's).
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _text_only(cls, value, info):
        if info.field_name in _SCORED and _has_content(value):
            raise ValueError("multimodal content is not supported: this model takes text only")
        return value


class ScoreRequest(ScoringFields):
    """/score: queries (one, or one per document) against documents, under any of
    vLLM's names for the two sides."""

    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    items: ScoreInput | None = None
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None
    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None

    @model_validator(mode="after")
    def _one_pair(self):
        pairs = self._pairs()
        given = {f for f in _SCORED if getattr(self, f, None) is not None}
        if len(pairs) != 1 or given != set(pairs[0]):
            raise ValueError(
                "queries: give one pair of sides: queries and documents (or items), data_1 "
                "and data_2, or text_1 and text_2"
            )
        return self

    def _pairs(self) -> list[tuple[str, str]]:
        return [
            (a, b)
            for a, b in _PAIRS
            if getattr(self, a) is not None and getattr(self, b) is not None
        ]

    @property
    def sides(self) -> tuple[str, str]:
        """The names of the two sides the client used."""
        return self._pairs()[0]


class RerankRequest(ScoringFields):
    query: str
    documents: ScoreInput
    top_n: int = Field(0, ge=0)  # 0: every document

    @property
    def sides(self) -> tuple[str, str]:
        return ("query", "documents")


_PAIRS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
_SCORED = ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2", "query")


def _has_content(value) -> bool:
    """vLLM's multimodal score input: {"content": [...]}, alone or in a list."""
    items = value if isinstance(value, list) else [value]
    return any(isinstance(x, dict) for x in items)


def _one_of_the_shapes(value) -> bool:
    if not isinstance(value, list) or not value:
        return isinstance(value, list)  # [] is refused later, with vLLM's words
    kinds = {_kind(x) for x in value}
    if len(kinds) != 1:
        return False
    (kind,) = kinds
    if kind == "list":
        inner = {_kind(y) for x in value for y in x}
        return inner <= {"int"}
    return kind in ("str", "int")


def _kind(x) -> str:
    if isinstance(x, bool):
        return "bool"
    for name, t in (("str", str), ("int", int), ("list", list)):
        if isinstance(x, t):
            return name
    return "other"
