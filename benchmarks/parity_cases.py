"""`zserve bench parity`'s cases: the requests of issue 16's items that both servers
get, grouped in profiles by the server flags they assume (parity.py asks and compares)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Fields only vLLM sends (features zserve does not have, or null placeholders for them):
# never counted as a difference.
VLLM_ONLY = frozenset(
    {
        "routed_experts",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
        "service_tier",
        "prompt_text",
        "annotations",
        "audio",
        "function_call",
        "completion_tokens_details",
        "created_cache_tokens",
        "multimodal_tokens",
        "tool_calls",  # tools are issue 17's
        "permission",
        "input_messages",  # /v1/responses: vLLM's harmony messages, null unless asked for
        "output_messages",
        "context_management",  # /v1/messages/count_tokens: Anthropic's beta, null in vLLM
    }
)


def sent_keys(obj: Any) -> list[str]:
    return sorted(k for k in obj if k not in VLLM_ONLY) if isinstance(obj, dict) else []


Probe = Callable[[Any], Any]


@dataclass(frozen=True)
class Case:
    item: str  # issue 16's item, or "-" for a plain check
    name: str
    method: str
    path: str
    body: dict | None = None
    headers: dict = field(default_factory=dict)
    probe: Probe | None = None  # a value both servers must agree on
    auth: bool = True  # send the API key (when one is given)


# --- the cases ------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"


def _usage_counts(events: list[dict]) -> list:
    return sorted(
        (e["choices"][0]["index"] if e["choices"] else -1, *_counts(e.get("usage"))) for e in events
    )


def _counts(usage: dict | None) -> tuple:
    if usage is None:
        return (None,)
    return (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])


def _top_sizes(doc: dict) -> list:
    lp = doc["choices"][0]["logprobs"]
    if "content" in lp:
        return [len(t["top_logprobs"]) for t in lp["content"]]
    return [None if t is None else len(t) for t in lp["top_logprobs"]]


def _chosen_first(doc: dict) -> bool:
    """Each top_logprobs entry starts with the chosen token."""
    lp = doc["choices"][0]["logprobs"]
    if "content" in lp:
        return all(t["top_logprobs"][0]["token"] == t["token"] for t in lp["content"])
    return all(next(iter(top)) == tok for tok, top in zip(lp["tokens"], lp["top_logprobs"]))


def _message_has(*words: str) -> Probe:
    return lambda doc: all(w in doc["error"]["message"] for w in words)


LONG_IDS = list(range(100, 2100))  # 2000 prompt tokens of a 2048 context

DEFAULT: list[Case] = [
    Case("1", "prompt + max_tokens past the context: cut to it", "POST", C,
         {"prompt": LONG_IDS, "max_tokens": 100, "ignore_eos": True},
         probe=lambda d: (d["choices"][0]["finish_reason"], d["usage"]["completion_tokens"])),
    Case("1", "chat max_tokens past the context: cut to it", "POST", CHAT,
         {"messages": USER, "max_tokens": 2040, "ignore_eos": True},
         probe=lambda d: (d["choices"][0]["finish_reason"], d["usage"]["total_tokens"])),
    Case("1", "max_tokens above the context: 400", "POST", C,
         {"prompt": "hi", "max_tokens": 2049}),
    Case("1", "chat max_completion_tokens above the context: 400", "POST", CHAT,
         {"messages": USER, "max_completion_tokens": 3000}),
    Case("1", "a prompt that fills the context: 400", "POST", C,
         {"prompt": list(range(2048)), "max_tokens": 1}),
    Case("1", "min_tokens above what is left: 400", "POST", C,
         {"prompt": LONG_IDS, "max_tokens": 100, "min_tokens": 60}),
    Case("2", "truncation_side right keeps the first tokens", "POST", C,
         {"prompt": list(range(100, 120)), "max_tokens": 1, "truncate_prompt_tokens": 5,
          "truncation_side": "right", "return_token_ids": True},
         probe=lambda d: d["choices"][0]["prompt_token_ids"]),
    Case("2", "truncation_side left keeps the last tokens", "POST", C,
         {"prompt": list(range(100, 120)), "max_tokens": 1, "truncate_prompt_tokens": 5,
          "truncation_side": "left", "return_token_ids": True},
         probe=lambda d: d["choices"][0]["prompt_token_ids"]),
    Case("2", "chat truncation_side right", "POST", CHAT,
         {"messages": USER, "max_tokens": 1, "truncate_prompt_tokens": 4,
          "truncation_side": "right", "return_token_ids": True},
         probe=lambda d: d["prompt_token_ids"]),
    Case("2", "truncation_side middle: 400", "POST", C,
         {"prompt": "hi", "max_tokens": 1, "truncate_prompt_tokens": 1,
          "truncation_side": "middle"}),
    Case("3", "chat under the root path", "POST", "/llm" + CHAT,
         {"messages": USER, "max_tokens": 1}),
    Case("3", "models under the root path", "GET", "/llm/v1/models",
         probe=lambda d: [m["id"] for m in d["data"]]),
    Case("3", "health under the root path", "GET", "/llm/health"),
    Case("3", "models without the root path", "GET", "/v1/models"),
    Case("4", "chat continuous usage", "POST", CHAT,
         {"messages": USER, "max_tokens": 3, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         probe=_usage_counts),
    Case("4", "completions continuous usage, 2 prompts x n=2", "POST", C,
         {"prompt": ["hi", "hello there"], "n": 2, "max_tokens": 2, "ignore_eos": True,
          "stream": True,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         probe=_usage_counts),
    Case("4", "stream without usage", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "stream": True},
         probe=lambda ev: [e.get("usage") for e in ev]),
    Case("6", "cached_tokens reported, 0 included", "POST", C,
         {"prompt": list(range(3000, 3010)), "max_tokens": 1},
         probe=lambda d: sent_keys(d["usage"]["prompt_tokens_details"])),
    Case("7", "chat stream: prompt_token_ids on the role chunk", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "stream": True, "return_token_ids": True},
         probe=lambda ev: ev[0].get("prompt_token_ids")),
    Case("8", "completions logprob_token_ids", "POST", C,
         {"prompt": "hello", "max_tokens": 2, "logprobs": 1, "logprob_token_ids": [5, 7, 9]},
         probe=lambda d: (_top_sizes(d), _chosen_first(d))),
    Case("8", "chat logprob_token_ids", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "logprobs": True, "logprob_token_ids": [5, 7, 9]},
         probe=lambda d: (_top_sizes(d), _chosen_first(d))),
    Case("8", "logprob_token_ids without logprobs: 400", "POST", C,
         {"prompt": "hello", "max_tokens": 2, "logprob_token_ids": [5]}),
    Case("8", "chat logprob_token_ids without logprobs: 400", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "logprob_token_ids": [5]}),
    Case("8", "logprob_token_ids out of vocabulary: 400", "POST", C,
         {"prompt": "hello", "max_tokens": 1, "logprobs": 0, "logprob_token_ids": [99999]}),
    Case("8", "129 logprob_token_ids: 400", "POST", C,
         {"prompt": "hello", "max_tokens": 1, "logprobs": 0,
          "logprob_token_ids": list(range(129))}),
    Case("9", "logprobs -1 above --max-logprobs 20: 400", "POST", C,
         {"prompt": "hi", "max_tokens": 1, "logprobs": -1}),
    Case("9", "prompt_logprobs -1 above --max-logprobs 20: 400", "POST", C,
         {"prompt": "hi", "max_tokens": 1, "prompt_logprobs": -1}),
    Case("10", "1025 prompts: 400", "POST", C, {"prompt": ["a"] * 1025, "max_tokens": 1},
         probe=_message_has("prompt list length 1025", "maximum allowed count of 1024")),
    Case("11", "batch chat", "POST", CHAT + "/batch",
         {"messages": [USER, [{"role": "user", "content": "hello there"}]], "max_tokens": 2},
         probe=lambda d: ([c["index"] for c in d["choices"]], _counts(d["usage"])[0])),
    Case("11", "batch chat ignores stream", "POST", CHAT + "/batch",
         {"messages": [USER, USER], "max_tokens": 1, "stream": True},
         probe=lambda d: len(d["choices"])),
    Case("11", "batch chat with n=2: 400", "POST", CHAT + "/batch",
         {"messages": [USER], "max_tokens": 1, "n": 2}),
    Case("11", "batch chat without conversations: 400", "POST", CHAT + "/batch",
         {"messages": [], "max_tokens": 1}),
    Case("12", "n=1000", "POST", C, {"prompt": "a", "max_tokens": 1, "n": 1000},
         probe=lambda d: len(d["choices"])),
    Case("12", "n=16385: 400", "POST", C, {"prompt": "a", "max_tokens": 1, "n": 16385},
         probe=_message_has("n must be at most")),
    Case("14", "metrics names", "GET", "/metrics"),
    Case("15", "ORCA load report, text", "POST", C, {"prompt": "a", "max_tokens": 1},
         headers={"endpoint-load-metrics-format": "text"}),
    Case("15", "ORCA load report, json", "POST", CHAT, {"messages": USER, "max_tokens": 1},
         headers={"endpoint-load-metrics-format": "json"}),
    Case("17", "CORS preflight without --allowed-origins: 400", "OPTIONS", "/v1/models",
         headers={"Origin": "https://x.example", "Access-Control-Request-Method": "GET"}),
    Case("18", "logprobs as a string: 400", "POST", C,
         {"prompt": "a", "max_tokens": 1, "logprobs": "2"}),
    Case("18", "top_logprobs as a string: 400", "POST", CHAT,
         {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": "2"}),
    Case("18", "cache_salt empty: 400", "POST", C,
         {"prompt": "a", "max_tokens": 1, "cache_salt": ""}),
    Case("18", "chat cache_salt empty: 400", "POST", CHAT,
         {"messages": USER, "max_tokens": 1, "cache_salt": ""}),
    Case("18", "every bad logit_bias key named", "POST", C,
         {"prompt": "a", "max_tokens": 1, "logit_bias": {"a": 1, "b": 2}},
         probe=_message_has("'a'", "'b'")),
    Case("18", "every out-of-vocabulary logit_bias key named", "POST", C,
         {"prompt": "a", "max_tokens": 1, "logit_bias": {"99999": 1, "88888": 2}},
         probe=_message_has("99999", "88888")),
    Case("18", "negative prompt token id", "POST", C, {"prompt": [1, -3], "max_tokens": 1},
         probe=_message_has("greater than or equal to 0")),
    Case("18", "logprobs -2", "POST", C, {"prompt": "a", "max_tokens": 1, "logprobs": -2},
         probe=_message_has("must be a positive value or -1")),
    Case("18", "top_logprobs -2", "POST", CHAT,
         {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": -2},
         probe=_message_has("must be a positive value or -1")),
    Case("18", "seed outside int64: param body.seed", "POST", C,
         {"prompt": "a", "max_tokens": 1, "seed": 2**64}),
    Case("18", "logprobs 2.5: param body.logprobs", "POST", C,
         {"prompt": "a", "max_tokens": 1, "logprobs": 2.5}),
    Case("18", "truncate_prompt_tokens -2: param body.truncate_prompt_tokens", "POST", C,
         {"prompt": "a", "max_tokens": 1, "truncate_prompt_tokens": -2}),
    Case("19", "completions top_logprobs: the chosen token first", "POST", C,
         {"prompt": "hello", "max_tokens": 3, "logprobs": 2, "temperature": 2.0},
         probe=lambda d: (_top_sizes(d) and _chosen_first(d))),
    Case("19", "chat top_logprobs: the chosen token first", "POST", CHAT,
         {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
          "temperature": 2.0},
         probe=lambda d: (_top_sizes(d), _chosen_first(d))),
    Case("-", "plain completion", "POST", C, {"prompt": "hi", "max_tokens": 2}),
    Case("-", "plain completion stream", "POST", C,
         {"prompt": "hi", "max_tokens": 2, "stream": True}),
    Case("-", "plain chat", "POST", CHAT, {"messages": USER, "max_tokens": 2}),
    Case("-", "plain chat stream", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "stream": True}),
    Case("-", "unknown model: 404", "POST", C, {"model": "nope", "prompt": "a"}),
    Case("-", "stream_options without stream: 400", "POST", C,
         {"prompt": "a", "stream_options": {"include_usage": True}}),
    # OpenAI's Responses API and Anthropic's Messages API
    Case("-", "responses: text", "POST", RESPONSES, {"input": "hi", "max_output_tokens": 3},
         probe=lambda d: (d["status"], [i["type"] for i in d["output"]], sorted(d["usage"]))),
    Case("-", "responses: the stream's events", "POST", RESPONSES,
         {"input": "hi", "max_output_tokens": 3, "stream": True},
         probe=lambda events: list(dict.fromkeys(e["type"] for e in events))),
    Case("-", "responses: a non-function tool is a 400", "POST", RESPONSES,
         {"input": "hi", "tools": [{"type": "web_search"}]}),
    Case("-", "messages: text", "POST", MESSAGES, {"messages": USER, "max_tokens": 3},
         probe=lambda d: ([b["type"] for b in d["content"]], d["stop_reason"],
                          sorted(d["usage"]))),
    Case("-", "messages: the stream's events", "POST", MESSAGES,
         {"messages": USER, "max_tokens": 3, "stream": True},
         probe=lambda events: list(dict.fromkeys(e["type"] for e in events))),
    Case("-", "messages: count_tokens", "POST", MESSAGES + "/count_tokens",
         {"messages": USER, "system": "be brief"}, probe=lambda d: d["input_tokens"]),
    Case("-", "messages: no max_tokens is a 400", "POST", MESSAGES, {"messages": USER}),
]  # fmt: skip

FLAGS: list[Case] = [
    Case("5", "forced usage: on every chunk and at the end", "POST", C,
         {"prompt": "hi", "max_tokens": 2, "ignore_eos": True, "stream": True},
         probe=_usage_counts),
    Case("5", "forced usage even when include_usage is false", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": False}},
         probe=_usage_counts),
    Case("9", "logprobs -1: the whole vocabulary", "POST", C,
         {"prompt": "hi", "max_tokens": 2, "logprobs": -1},
         probe=lambda d: (_top_sizes(d), _chosen_first(d))),
    Case("9", "chat top_logprobs -1", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": -1},
         probe=lambda d: (_top_sizes(d), _chosen_first(d))),
    Case("9", "prompt_logprobs -1", "POST", C,
         {"prompt": "hi there", "max_tokens": 1, "prompt_logprobs": -1},
         probe=lambda d: [p and len(p) for p in d["choices"][0]["prompt_logprobs"]]),
    Case("9", "logprobs past the vocabulary: 400", "POST", C,
         {"prompt": "hi", "max_tokens": 1, "logprobs": 8193}),
    Case("16", "tokens as token ids by default", "POST", C,
         {"prompt": "hi", "max_tokens": 2, "logprobs": 1},
         probe=lambda d: all(t.startswith("token_id:") for t in d["choices"][0]["logprobs"]["tokens"])),
    Case("16", "a request may say otherwise", "POST", C,
         {"prompt": "hi", "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": False},
         probe=lambda d: any(t.startswith("token_id:") for t in d["choices"][0]["logprobs"]["tokens"])),
    Case("16", "chat tokens as token ids", "POST", CHAT,
         {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 1},
         probe=lambda d: all(t["token"].startswith("token_id:") for t in d["choices"][0]["logprobs"]["content"])),
    Case("20", "/v1/models without the key: 401", "GET", "/v1/models", auth=False),
    Case("20", "/tokenize without the key (vLLM: open)", "POST", "/tokenize",
         {"prompt": "hi"}, auth=False),
    Case("20", "/detokenize without the key (vLLM: open)", "POST", "/detokenize",
         {"tokens": [1]}, auth=False),
    Case("20", "/invocations without the key (vLLM: open)", "POST", "/invocations",
         {"prompt": "hi", "max_tokens": 1}, auth=False),
    Case("20", "/load without the key (vLLM: open)", "GET", "/load", auth=False),
    Case("20", "/health without the key", "GET", "/health", auth=False),
    Case("20", "/metrics without the key", "GET", "/metrics", auth=False),
]  # fmt: skip

GENERATE = "/inference/v1/generate"
GREEDY_IDS = {"token_ids": [1, 283, 80], "sampling_params": {"max_tokens": 3, "temperature": 0}}
GENERATED = {"request_id": "g", "choices": [{"index": 0, "token_ids": [283, 80, 323]}]}

SCALE_OUT: list[Case] = [
    Case("-", "render chat: the prompt's ids and max_tokens", "POST", CHAT + "/render",
         {"messages": USER, "max_tokens": 5},
         probe=lambda d: (d["token_ids"], d["sampling_params"]["max_tokens"])),
    Case("-", "render chat: the rest of the context", "POST", CHAT + "/render",
         {"messages": USER}, probe=lambda d: d["sampling_params"]["max_tokens"]),
    Case("-", "render completions: one request per prompt", "POST", C + "/render",
         {"prompt": ["hello", "world x"], "max_tokens": 5},
         probe=lambda d: [r["token_ids"] for r in d]),
    Case("-", "render messages", "POST", MESSAGES + "/render",
         {"messages": USER, "max_tokens": 5}, probe=lambda d: d["token_ids"]),
    Case("-", "generate: token ids", "POST", GENERATE, GREEDY_IDS,
         probe=lambda d: [len(c["token_ids"]) for c in d["choices"]]),
    Case("-", "generate: text and logprobs", "POST", GENERATE,
         {**GREEDY_IDS, "output_mode": "text", "return_token_ids": True,
          "sampling_params": {**GREEDY_IDS["sampling_params"], "logprobs": 2}},
         probe=lambda d: [len(e["top_logprobs"]) for e in d["choices"][0]["logprobs"]["content"]]),
    Case("-", "generate: a stream", "POST", GENERATE,
         {**GREEDY_IDS, "stream": True, "stream_options": {"include_usage": True}},
         probe=_usage_counts),
    Case("-", "generate: no sampling_params is a 400", "POST", GENERATE, {"token_ids": [1]}),
    Case("-", "generate: a token past the vocabulary is a 400", "POST", GENERATE,
         {"token_ids": [1, 99999], "sampling_params": {}}),
    Case("-", "generate: stop without detokenize is a 400", "POST", GENERATE,
         {"token_ids": [1], "sampling_params": {"stop": ["a"], "detokenize": False}}),
    Case("-", "derender chat", "POST", CHAT + "/derender", {"generate_response": GENERATED},
         probe=lambda d: d["choices"][0]["message"]["content"]),
    Case("-", "derender completions", "POST", C + "/derender",
         {"generate_responses": [GENERATED]}, probe=lambda d: d["choices"][0]["text"]),
]  # fmt: skip

# The pooling servers' profiles ("pooling", "classify") are in parity_pooling.py.
PROFILES = {"default": DEFAULT, "flags": FLAGS, "scale-out": SCALE_OUT}
