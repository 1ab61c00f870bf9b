"""The API server's configuration: parsed once by the launcher, passed down as is."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from frontend.limits import RequestLimits
from frontend.structured_outputs import StructuredOutputOptions
from protocol.messages import LoraModule
from protocol.sockets import CurveKeys


@dataclass(frozen=True)
class PoolingOptions:
    """--runner pooling: the server answers embeddings or classifications
    (serving_pooling.py), not generations; what a request leaves unset, and what the
    model admits."""

    pooling_type: str = "LAST"  # the engines' pooler: LAST | MEAN | CLS
    normalize: bool = True  # use_activation's default (sentence-transformers' Normalize)
    # Matryoshka models (config.json's is_matryoshka / matryoshka_dimensions) take
    # `dimensions`; None: any in 1..hidden_size, else only those listed.
    matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    # classify: a sequence-classification model (/classify; /score and /rerank when it
    # has one label, pairs tokenized as a pair when use_sep_token, else as one text).
    task: str = "embed"  # embed | classify
    labels: list[str | None] | None = None  # classify: each label's name, by index
    use_sep_token: bool = True
    # embed: /v2/embed's input_type → the prompt put before each text (config.json's
    # task_instructions, or config_sentence_transformers.json's prompts).
    task_instructions: dict[str, str] | None = None


@dataclass
class FrontendConfig:
    model_dir: str
    tokenizer_dir: str
    served_model_names: list[str]
    host: str | None = "0.0.0.0"
    port: int = 8000
    grpc: bool = False  # serve the VllmEngine gRPC service (grpc_server.py), not HTTP
    api_server_count: int = 1
    num_engines: int = 1
    engine_ready_timeout_s: float = 600.0
    engine_heartbeat_timeout_s: float = 30.0
    curve: CurveKeys | None = None
    log_level: str = "INFO"
    # OpenAI surface
    max_logprobs: int = 20
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_request_id_headers: bool = False
    enable_scale_out: bool = False  # the /render and /inference/v1 routes
    tokens_only: bool = False  # --tokens-only: those, /abort_requests, and no detokenizing
    system_fingerprint: str | None = None  # --fingerprint-mode's (launcher/fingerprint.py)
    enable_prompt_tokens_details: bool = False
    force_include_usage: bool = False  # a usage chunk ends every stream
    enable_tokenizer_info_endpoint: bool = False
    enable_server_load_tracking: bool = False
    disable_fastapi_docs: bool = False
    enable_log_requests: bool = False
    disable_log_stats: bool = False
    api_key: str | None = None
    # Routes answered without the API key besides the probes; "vllm": those vLLM opens.
    api_key_open_paths: list[str] = field(default_factory=list)
    return_tokens_as_token_ids: bool = False  # the default of the request field
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""
    middleware: list[str] = field(default_factory=list)
    # The HTTP door (launcher/http_door.py): TLS, --uds and the access log.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED
    ssl_ciphers: str | None = None
    ssl_refresh: bool = False  # reload the files above when they change
    uds: str | None = None  # serve on this Unix socket, not host:port
    access_log: bool = True
    access_log_skip: list[str] = field(default_factory=list)  # paths without a line
    otlp_traces_endpoint: str | None = None  # a span per request (frontend/tracing.py)
    sse_keep_alive_interval: float = 0.0
    stream_interval: int = 1
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    metrics_prefix: str = "zserve"
    scheduling_policy: str = "fcfs"
    shutdown_timeout: float = 0.0
    uvicorn_log_level: str = "info"
    # Hardening: what one client may send, and where long texts are tokenized.
    limits: RequestLimits = field(default_factory=RequestLimits)
    tokenizer_pool_size: int = 1  # worker processes per API server; 0: a thread instead
    tokenize_timeout_s: float = 60.0
    # Development and profiler routes (frontend/serving_dev.py), off by default.
    enable_dev_routes: bool = False  # --enable-dev-routes or ZSERVE_SERVER_DEV_MODE=1
    enable_profiler_routes: bool = False  # --profiler-config
    wait_while_asleep_s: float = 0.0  # a request arriving while asleep: 503 at once (0)
    # Tool calling, reasoning and structured outputs (chat_tools.py, structured_outputs.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    structured_outputs: StructuredOutputOptions = field(default_factory=StructuredOutputOptions)
    # LoRA: the adapters of --lora-modules (the engines hold the live list) and whether
    # clients may load and unload adapters (/v1/load_lora_adapter).
    enable_lora: bool = False
    lora_modules: list[LoraModule] = field(default_factory=list)
    enable_runtime_lora_updating: bool = False
    # vLLM's --generation-config / --override-generation-config (launcher/generation_config.py):
    # request fields' defaults, and the cap on every request's max_tokens.
    sampling_defaults: dict = field(default_factory=dict)
    max_tokens_ceiling: int | None = None
    response_role: str = "assistant"  # --response-role
    default_chat_template_kwargs: dict = field(default_factory=dict)
    pooling: PoolingOptions | None = None  # --runner pooling (None: the server generates)


@dataclass
class APIServerConfig:
    """One API-server process: the shared frontend config plus its own place in the mesh."""

    frontend: FrontendConfig
    client_index: int
    input_address: str
    output_address: str
    parent_pid: int | None = None
    admission_path: str | None = None  # the shared admission file (see admission.py)
    restarts: int = 0  # how often the supervisor has restarted this API server
    cpus: list[int] | None = None  # CPU affinity (--api-server-cpus)
    # --uds: the supervisor's listener, which every API server accepts on (a socket
    # travels to a spawned child as a duplicated descriptor).
    listener: socket.socket | None = None
