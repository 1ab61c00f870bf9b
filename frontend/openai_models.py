"""OpenAI-compatible request models (pydantic), with vLLM's extra sampling fields.

Unknown keys are accepted and ignored, as vLLM does. Field-level ranges live here;
rules that need the model or the server's flags (vocab size, max_model_len,
--max-logprobs) live in `sampling.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from frontend.errors import listing
from protocol.messages import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS, MAX_TEMPERATURE

INT64_MIN = -(2**63)
MAX_CACHE_SALT_CHARS = 1024  # hashed once per sequence into its prefix-cache chain
INT64_MAX = 2**63 - 1

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Model(BaseModel):
    """Unknown keys are accepted and ignored (as vLLM does); no float may be NaN or
    infinite, whatever spelling the client uses ("NaN", "inf", 1e999)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(_Model):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1)  # at most --max-sequences-per-request (limits.py)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None  # None: the default below
    default_truncation_side: ClassVar[str] = "left"  # vLLM's for generations
    use_beam_search: bool = False  # n beams, the n best answered (frontend/beam_search.py)
    length_penalty: float = 1.0  # beam search: score = logprob / length ** length_penalty
    # Beam search's early stop (vLLM's former and transformers' meanings); unset: "never".
    early_stopping: bool | Literal["never"] | None = None
    request_id: str | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: --return-tokens-as-token-ids
    logprob_token_ids: list[int] | None = None  # at most MAX_LOGPROB_TOKEN_IDS
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator(
        "n",
        "stream",
        "echo",
        "logprobs",
        "add_generation_prompt",
        "max_tokens",
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _null_is_default(cls, value, info):
        """vLLM declares these Optional: an explicit null means the default."""
        if value is None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("early_stopping", mode="before")
    @classmethod
    def _early_stopping(cls, value):
        if value is None or isinstance(value, bool) or value == "never":
            return value
        raise ValueError(f'must be true, false or "never"; got {value!r}')

    @model_validator(mode="before")
    @classmethod
    def _logprob_counts_are_numbers(cls, data):
        """vLLM refuses a logprob count sent as a string ("2"), which pydantic would take."""
        if isinstance(data, dict):
            for name in cls.COUNT_FIELDS:
                value = data.get(name)
                if value is not None and not isinstance(value, (int, float)):
                    raise ValueError(f"{name}: `{name}` must be an integer.")
        return data

    COUNT_FIELDS: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    @model_validator(mode="after")
    def _check_shared(self):
        opts = self.stream_options
        if opts is not None and not self.stream and (opts.model_fields_set or opts.model_extra):
            raise ValueError("stream_options: only allowed when stream is true")
        if isinstance(self.stop, list) and any(s == "" for s in self.stop):
            raise ValueError("stop: may not contain an empty string")
        if self.stop == "":
            raise ValueError("stop: may not be an empty string")
        if self.prompt_logprobs is not None:
            check_count_or_all("prompt_logprobs", self.prompt_logprobs)
            if self.stream and self.prompt_logprobs != 0:
                raise ValueError("prompt_logprobs: not available when stream is true")
        check_cache_salt(self.cache_salt)
        if self.logit_bias:
            bad = [key for key in self.logit_bias if not _is_int_text(key)]
            if bad:
                raise ValueError(
                    f"logit_bias: keys must be token ids; these are not: {listing(bad)}"
                )
        if self.logprob_token_ids == []:
            self.logprob_token_ids = None  # as in vLLM: an empty list asks for nothing
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def check_one_answer(body: SamplingFields, route: str) -> None:
    """The APIs whose reply is one answer (/v1/responses, /v1/messages): no n, no beams."""
    if body.n != 1:
        raise ValueError(f"n: {route} gives one answer; send n requests instead")
    if body.use_beam_search:
        raise ValueError(f"use_beam_search: not supported by {route}")


def check_cache_salt(value: str | None) -> None:
    """vLLM's rule: a salt, when given, is a non-empty string."""
    if value is not None and not value:
        raise ValueError(
            "cache_salt: Parameter 'cache_salt' must be a non-empty string if provided."
        )


def check_count_or_all(field: str, value: int) -> None:
    """A logprob count: n >= 0, or -1 for the whole vocabulary (vLLM's wording)."""
    if value < -1:
        raise ValueError(f"{field}: `{field}` must be a positive value or -1.")


def _is_int_text(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


Prompt = str | list[str] | list[int] | list[list[int]]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None


def _token_ids(prompt: list):
    """Every token id of a token-id prompt or list of them (nothing for texts)."""
    for p in prompt:
        if isinstance(p, list):
            yield from p
        elif not isinstance(p, str):
            yield p


class CompletionRequest(SamplingFields):
    prompt: Prompt | None = None
    max_tokens: int = Field(16, ge=0)  # null: this default too
    echo: bool = False
    logprobs: int | None = None  # -1: the whole vocabulary
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    response_format: ResponseFormat | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and (
            all(isinstance(p, str) for p in value)
            or all(_is_int(p) for p in value)
            or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in value)
        ):
            if any(t < 0 for t in _token_ids(value)):
                raise ValueError("token ids must be greater than or equal to 0")
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )

    COUNT_FIELDS: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "logprobs")

    @model_validator(mode="after")
    def _check_completion(self):
        if self.logprobs is not None:
            check_count_or_all("logprobs", self.logprobs)
        if self.logprob_token_ids is not None:
            if self.logprobs is None:
                raise ValueError(
                    "logprob_token_ids: when using `logprob_token_ids`, `logprobs` must be set."
                )
            if self.echo and self.max_tokens == 0:
                raise ValueError(
                    "logprob_token_ids: not supported with echo and max_tokens 0: no token "
                    "is generated"
                )
        if self.suffix is not None:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported (use n)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo), got 0")
        return self


class TextPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None  # -1: the whole vocabulary
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True

    COUNT_FIELDS: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "top_logprobs")

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None:
            check_count_or_all("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise ValueError(
                "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true."
            )
        if self.logprob_token_ids is not None and not self.logprobs:
            raise ValueError(
                "logprob_token_ids: when using `logprob_token_ids`, `logprobs` must be set to true."
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be true together with add_generation_prompt"
            )
        if self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise ValueError("response_format: type json_schema requires a json_schema")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch: a list of conversations sharing the other
    fields; one choice per conversation. As in vLLM: no n > 1, no beam search, and
    `stream` is ignored (the answer is one JSON response)."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(..., min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _batch_mode(cls, data):
        if not isinstance(data, dict):
            return data
        if data.get("use_beam_search"):
            raise ValueError(
                "use_beam_search: Batch chat completions do not support beam search. "
                "Please set `use_beam_search` to False."
            )
        n = data.get("n", 1)
        if n is not None and n != 1:
            raise ValueError(
                "n: Batch chat completions do not support `n > 1`. Please set `n` to 1."
            )
        return {k: v for k, v in data.items() if k not in ("stream", "stream_options")}


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Model):
    """POST /v1/load_lora_adapter (vLLM's body; with --enable-runtime-lora-updating)."""

    lora_name: str = Field(max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(max_length=MAX_LORA_PATH_CHARS)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Model):
    """POST /v1/unload_lora_adapter; lora_int_id is accepted and ignored, as the name
    alone names an adapter here."""

    lora_name: str = Field(max_length=MAX_LORA_NAME_CHARS)
    lora_int_id: int | None = None
