"""Every message that crosses the API-server ↔ engine-core boundary.

Structs are array-like: field order *is* the wire format. New fields are appended
at the end with a default, so an older reader ignores them and a newer reader
fills them in. Never reorder or remove a field without bumping PROTOCOL_VERSION.
"""

from __future__ import annotations

import enum
import hashlib
import re
import secrets
import time
from typing import Any

import msgspec

PROTOCOL_VERSION = 2


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire struct: positional, compact, out of the cyclic GC."""


class RequestType(bytes, enum.Enum):
    """First frame of every API server → engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3  # the engine failed while serving the request
    REFUSED = 4  # the engine would not take the request (its `error` says why): a 400
    # The engine cannot serve it now (asleep, or put to sleep while it ran): a 503,
    # worth retrying once the engine is awake.
    UNAVAILABLE = 5

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort", "error", "error", "error")[self]


class EarlyStopping(enum.IntEnum):
    """When a beam search may end before max_tokens (`early_stopping`, as in vLLM's
    earlier engine and transformers). Whatever the rule, the answer is the `n` best of
    the finished beams (and, at max_tokens, of the live ones)."""

    EXACT = 0  # not given: only once no live beam can still beat the n finished ones
    HEURISTIC = 1  # false: once the best live beam, as it is now, does not beat them
    FIRST = 2  # true: as soon as n beams have finished


# temperature's range, 0 (greedy) to this: both sides check it (the frontend's 400, the
# engine's own refusal).
MAX_TEMPERATURE = 100.0


# The constraint kinds of StructuredOutputs, in field order: exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputs(_Wire):
    """One output constraint, vLLM's `structured_outputs`: exactly one kind is set.

    `json` is a JSON schema and `structural_tag` an xgrammar structural tag, both as
    JSON text (object key order is kept: it is the order properties are generated
    in); `grammar` is GBNF/EBNF, or Lark when no line defines a rule with `::=`.
    `param` names the request field the constraint came from, for error messages
    (`response_format.json_schema`, `guided_regex`, ...); it is not part of the key.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    param: str = ""
    # Constrain only once the output holds these ids (the end of reasoning, as the
    # reasoning parser tokenizes it); None: from the first token. Not part of the key.
    reasoning_end_ids: list[int] | None = None

    @property
    def kind(self) -> str:
        """The one constraint kind set; ValueError when none or several are."""
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            found = ", ".join(kinds) or "none"
            raise ValueError(
                f"{self.param or 'structured_outputs'}: set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {found}"
            )
        return kinds[0]

    @property
    def field(self) -> str:
        """The request field to name in an error about this constraint."""
        return self.param or f"structured_outputs.{self.kind}"

    def key(self) -> bytes:
        """A stable cache key: equal for constraints that compile to the same grammar."""
        constraint = (
            self.json,
            self.regex,
            self.choice,
            self.grammar,
            self.json_object,
            self.structural_tag,
            self.disable_any_whitespace,
            self.disable_additional_properties,
        )
        return hashlib.blake2b(_KEY_ENCODER.encode(constraint), digest_size=16).digest()


_KEY_ENCODER = msgspec.msgpack.Encoder()


class SamplingParams(_Wire):
    """What the engine's sampler and stop checks need for one request.

    The frontend validates every field (4xx on bad values) before it builds this;
    the engine re-checks cheaply and answers an ERROR output instead of crashing.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top-n per sampled token; 0 = only the sampled one
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputs | None = None
    # Logprobs of exactly these tokens (after the sampled one) instead of the top-n.
    logprob_token_ids: list[int] | None = None
    # Beam search (engine_core/beam_search.py): 0 = off; else the beam width (the
    # request's `n`), and the score's length penalty and the early-stopping rule.
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = EarlyStopping.EXACT


def engine_request_id(request_id: str, prompt: int, sample: int | str) -> str:
    """The id of one engine request of API request `request_id` (its prompt's index,
    and its sample's index or "beams"): client ids may repeat, the random suffix keeps
    engine ids unique."""
    return f"{request_id}-{prompt}-{sample}-{secrets.token_hex(4)}"


def api_request_id(engine_request_id: str) -> str:
    """The API request an engine request belongs to (engine_request_id's inverse)."""
    return engine_request_id.rsplit("-", 3)[0]


# LoRA adapters: what a name and a path may be, and how many one server registers.
# The launcher, the API servers and the engines all check them (check_lora_name).
MAX_LORA_NAME_CHARS = 128
MAX_LORA_PATH_CHARS = 4096
MAX_LORA_ADAPTERS = 1024
_LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]*")


def check_lora_name(name: object) -> str | None:
    """Why `name` cannot name a LoRA adapter (None: it can)."""
    if not isinstance(name, str) or not name:
        return "an adapter name must be a non-empty string"
    if len(name) > MAX_LORA_NAME_CHARS:
        return f"an adapter name may be at most {MAX_LORA_NAME_CHARS} characters long"
    if not _LORA_NAME.fullmatch(name):
        return (
            f"adapter name {name!r} must start with a letter or digit and hold only letters, "
            "digits and . _ : @ + / -"
        )
    return None


def check_lora_path(path: object) -> str | None:
    """Why `path` cannot be an adapter's folder, before the file system is asked."""
    if not isinstance(path, str) or not path:
        return "an adapter path must be a non-empty string"
    if len(path) > MAX_LORA_PATH_CHARS:
        return f"an adapter path may be at most {MAX_LORA_PATH_CHARS} characters long"
    if "\0" in path:
        return "an adapter path may not hold a NUL character"
    return None


class LoraModule(_Wire):
    """One adapter to serve: `--lora-modules NAME=PATH`, or its JSON form."""

    name: str
    path: str  # a local folder with adapter_config.json and adapter_model.safetensors
    base_model_name: str | None = None  # /v1/models' `parent` (None: the served model)


class LoraConfig(_Wire):
    """`--enable-lora` and its limits: the same for every engine of a server (the head
    hands them to headless engines in its plan)."""

    max_loras: int = 1  # distinct adapters in one step (and running at once)
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # adapters kept loaded in memory (>= max_loras)
    modules: list[LoraModule] = []  # loaded at start-up


class PoolingParams(_Wire):
    """A pooling request (--runner pooling): its prompt's final hidden states pooled
    into one vector (engine_core/pooler.py) instead of a generation."""

    use_activation: bool = True  # an embedding normalized; a classifier's activation run
    dimensions: int | None = None  # the first N only (Matryoshka), before normalizing


class EngineCoreRequest(_Wire):
    """ADD: one sequence to generate. `request_id` is the frontend's internal id."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    client_index: int = 0
    priority: int = 0
    data_parallel_rank: int | None = None
    # The sequences of one API request (n > 1, several prompts) share a nonzero group,
    # numbered by their API server (client_index): the engine takes turns between groups.
    group: int = 0
    lora_name: str | None = None  # the LoRA adapter to generate with (None: the base model)
    # Prefix-cache isolation: only requests with the same salt (and adapter) share KV.
    cache_salt: str | None = None
    pooling: PoolingParams | None = None  # a pooling request (a pooling engine takes no other)

    @property
    def num_sequences(self) -> int:
        """Sequences this request runs at once (a beam search: its width): its weight in
        the load each API server balances by."""
        return max(1, self.sampling_params.beam_width)


class Logprobs(_Wire):
    """Logprobs of consecutive positions; row i: column 0 is the chosen token, then top-n."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token in the full distribution (1 = best)


class SchedulerStats(_Wire):
    """An engine's state after a step. Counters are cumulative since start-up, so
    any API server may read the latest value without summing deltas it never saw."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    step_time_s: float = 0.0
    # Tokens per step as a cumulative histogram: counts per ITERATION_TOKEN_BUCKETS
    # upper bound, then one for larger steps.
    iteration_tokens_sum: int = 0
    iteration_tokens_counts: list[int] = []
    # Unfinished requests per API server (by client_index): a server balancing load
    # counts its own requests itself, instantly, and takes only the others' from here.
    num_requests_by_client: list[int] = []
    # Preemptions per finished request as a cumulative histogram: counts per
    # REQUEST_PREEMPTION_BUCKETS upper bound, then one for more.
    request_preemptions_sum: int = 0
    request_preemptions_counts: list[int] = []
    # Sleep mode (engine_core/sleep_mode.py): 0 awake, else the level it sleeps at (1:
    # KV cache released, 2: weights too), from when it stops stepping until it is back.
    sleep_level: int = 0
    # Refusing new requests: asleep, or draining its own before it sleeps (mode=wait).
    paused: bool = False
    # LoRA: bumped by every adapter load or unload (an API server then re-reads the
    # list), and the adapters loaded in memory now (a balancer may prefer them).
    lora_version: int = 0
    lora_loaded: list[str] = []
    # Paused (POST /pause; requests still come in and queue): "" not paused, else
    # protocol/controls.py's HOLD_NEW (no waiting request starts) or HOLD_ALL (nothing steps).
    generation_hold: str = ""
    # Loop turns that ran no step while requests waited for their grammar's compile or
    # their LoRA adapter's load: with num_steps, what the hang detection takes as
    # progress (such a wait can outlast --engine-heartbeat-timeout and is no hang).
    num_waits: int = 0
    # The busy loop is about to block for at most this long in a known operation
    # (stopping torch's profiler, which holds the GIL while it processes the trace): the
    # API servers take neither its silence nor its lack of steps for death meanwhile.
    blocked_s: float = 0.0
    # An engine on the CPU: the CPU seconds its process has used. A step longer than
    # --engine-heartbeat-timeout keeps it rising; a hung engine's does not.
    cpu_s: float = 0.0


def others_requests(by_client: list[int], client_index: int) -> int:
    """The unfinished requests of every API server but this one, from
    `num_requests_by_client`: what a server balancing load takes from an engine (it
    counts its own), and what the engine checks each server has heard."""
    mine = by_client[client_index] if 0 <= client_index < len(by_client) else 0
    return sum(by_client) - mine


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's


def max_beam_width_message(width: int, max_width: int) -> str:
    return (
        f"beam search with n={width} runs {width} sequences in each step; this server runs "
        f"at most {max_width} (the least of --max-num-seqs, --max-num-batched-tokens and "
        f"half the vocabulary); lower n"
    )


def beam_search_kv_blocks(prompt_len: int, max_tokens: int, width: int, block_size: int) -> int:
    """KV blocks a beam search may hold at once, at worst: its beams share only the
    prompt's full blocks; each has its own copy of the prompt's partial block and its own
    tokens (the last sampled token needs no KV). Both sides refuse a search that cannot
    fit the cache alone, so one always can run to its end."""
    own_tokens = prompt_len % block_size + max_tokens - 1
    return prompt_len // block_size + width * -(-own_tokens // block_size)


class BeamSequence(_Wire):
    """One of the n best sequences of a finished beam search, best first.

    `token_ids` end with the EOS or stop token when one finished it; `logprobs` (when
    asked for) has one row per token."""

    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason
    stop_reason: int | None = None
    logprobs: Logprobs | None = None


class EngineCoreOutput(_Wire):
    """New tokens of one request since the previous output of that request.

    A beam search has one output, at its end: no new tokens, its sequences in `beams`."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time_s: float = 0.0  # on a request's first output: seconds it waited to be scheduled
    beams: list[BeamSequence] | None = None
    pooled: bytes | None = None  # a pooling request's vector, little-endian float32

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def error_output(
    request_id: str, message: str, reason: FinishReason = FinishReason.ERROR
) -> EngineCoreOutput:
    """The last output of a request the engine could not serve (or refused)."""
    return EngineCoreOutput(request_id, [], finish_reason=reason, error=message)


class UtilityCall(_Wire):
    """UTILITY: call a named engine method; the answer rides back on EngineCoreOutputs."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(_Wire):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(_Wire):
    """Everything one engine sends one API server after a step (or as a heartbeat)."""

    engine_index: int
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_result: UtilityResult | None = None


class EngineReady(_Wire):
    """The first message an engine sends on each of its DEALER sockets (and in READY):
    a ROUTER can only address peers it has heard from."""

    protocol_version: int
    rank: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    device: str
    vocab_size: int = 0
    pid: int = 0
    hostname: str = ""
    # Prompt + max_tokens one request may need: max_model_len, or less when the KV
    # cache is smaller (the last sampled token needs no KV). The engine refuses more.
    max_request_tokens: int = 0
    eos_token_ids: list[int] = []  # what ends a sequence (unless ignore_eos)
    # What the model is, for the API's model descriptions (gRPC's GetModelInfo).
    architecture: str = ""
    model_type: str = ""
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # Which start of this rank this is (0 first; the supervisor's count of restarts):
    # an API server takes a higher one as the rank re-joining after a death.
    incarnation: int = 0
    node_id: str = ""  # the Ray node the engine runs on (--data-parallel-backend ray)
    # The widest beam search it runs (its sequences in one step; 0: unknown).
    max_beam_width: int = 0
    hidden_size: int = 0  # the width of the vectors a pooling engine answers


# First frame of [ENGINE_CORE_DEAD, rank] an engine sends every API server when it dies
# of an error (output messages are single-frame, so the two never mix).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


def now() -> float:
    """Wall-clock seconds, the clock of `arrival_time` and `timestamp`."""
    return time.time()
