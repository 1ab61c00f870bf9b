"""OpenAI-compatible request models (pydantic), with vLLM's extra sampling fields.

Unknown keys are accepted and ignored, as vLLM does. Field-level ranges live here;
rules that need the model or the server's flags (vocab size, max_model_len,
--max-logprobs) live in `sampling.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.messages import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS, MAX_TEMPERATURE

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

# vLLM's structured-output fields (current and legacy names): refused, never ignored,
# since ignoring them would return unconstrained text as if it were constrained.
_STRUCTURED_OUTPUT_KEYS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
)


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
    use_beam_search: bool = False
    request_id: str | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
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

    @model_validator(mode="after")
    def _check_shared(self):
        if self.use_beam_search:
            raise ValueError("use_beam_search: beam search is not supported by this server")
        for key in _STRUCTURED_OUTPUT_KEYS:
            if (self.model_extra or {}).get(key) is not None:
                raise ValueError(f"{key}: structured output is not supported by this server yet")
        opts = self.stream_options
        if opts is not None and not self.stream and (opts.model_fields_set or opts.model_extra):
            raise ValueError("stream_options: only allowed when stream is true")
        if isinstance(self.stop, list) and any(s == "" for s in self.stop):
            raise ValueError("stop: may not contain an empty string")
        if self.stop == "":
            raise ValueError("stop: may not be an empty string")
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < 0:
                raise ValueError(f"prompt_logprobs: must be >= 0, got {self.prompt_logprobs}")
            if self.stream:
                raise ValueError("prompt_logprobs: not available when stream is true")
        if self.logit_bias:
            for key in self.logit_bias:
                try:
                    int(key)
                except ValueError:
                    raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


Prompt = str | list[str] | list[int] | list[list[int]]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionRequest(SamplingFields):
    prompt: Prompt | None = None
    max_tokens: int = Field(16, ge=0)  # null: this default too
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

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
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )

    @model_validator(mode="after")
    def _check_completion(self):
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


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
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

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
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
