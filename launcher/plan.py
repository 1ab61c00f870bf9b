"""`zserve serve`'s flags → one typed launch plan.

The one place where the parsed flags are read: every alias and every default that
depends on another flag is settled here, and the supervisor, the API servers and the
engines get typed configs (LaunchPlan, FrontendConfig, EngineConfig), never the
argparse namespace. The namespace itself is never changed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import logging
import os
from dataclasses import dataclass

from engine_core.config import EngineConfig, cpu_thread_count
from frontend.chat_tools import load_chat_parsers
from frontend.config import FrontendConfig
from launcher.fingerprint import system_fingerprint
from launcher.generation_config import GenerationConfigError
from launcher.http_door import apply_http_door, http_door_refusal
from launcher.limit_args import request_limits
from launcher.lora_flags import lora_config, refuse_lora, runtime_lora_updating
from launcher.models import ModelNotFoundError, resolve_model
from launcher.pooling_flags import apply_pooling, pooling_refusal
from launcher.ray_placement import RayPlan
from launcher.serve_feature_args import profiler_routes_enabled
from launcher.structured_outputs_flag import frontend_options, grammar_config
from launcher.vllm_compat import apply_compat_flags, compat_refusal, take_model_flag
from launcher.vllm_flags import log_no_effect, vllm_flag_refusal
from protocol.sockets import ipc_address, tcp_address

log = logging.getLogger("zserve.supervisor")

# vLLM's spellings of a dtype → the one each engine understands.
_DTYPES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}


class LaunchRefused(ValueError):
    """A command line zserve will not run; the message says why, naming the flag."""


@dataclass(frozen=True)
class Topology:
    """Which processes this node runs, and where the others are."""

    data_parallel_size: int  # engines in the whole server, on every node
    local_engines: int  # engines started on this node (-dpl; default: all of them)
    start_rank: int  # the first local engine's rank (-dpr)
    api_server_count: int  # API servers on this node (default: the data-parallel size)
    headless: bool  # engines only: no HTTP, they join a head node
    head_address: str | None  # --data-parallel-address: the head's, for remote engines
    rpc_port: int | None  # --data-parallel-rpc-port: the head's handshake port

    @property
    def all_local(self) -> bool:
        """Every engine runs beside the API servers: ipc:// sockets, no keys."""
        return self.local_engines == self.data_parallel_size and not self.headless

    @property
    def local_ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.local_engines)

    def handshake_address(self, runtime_dir: str) -> str:
        """Where the head's handshake socket binds and every engine connects."""
        if self.all_local:
            return ipc_address(runtime_dir, "handshake")
        return tcp_address(self.head_address, self.rpc_port)

    def data_address(self, runtime_dir: str, name: str) -> str:
        """Where an API server binds one of its data sockets (any free port over TCP)."""
        if self.all_local:
            return ipc_address(runtime_dir, name)
        return tcp_address(self.head_address, 0)


@dataclass(frozen=True)
class LaunchPlan:
    """What one `zserve serve` runs: the configs handed down, and the supervisor's own."""

    topology: Topology
    engine: EngineConfig  # every local engine's, less its rank
    frontend: FrontendConfig | None  # every API server's; None when headless
    log_level: str
    engine_ready_timeout_s: float  # every engine's READY (a worker: the head and its keys)
    engine_keys_dir: str | None  # CURVE keys for TCP engine links (None: the default folder)
    engine_cpus: list[list[int] | None]  # each local engine's pins (--engine-cpus, shared)
    api_server_cpus: list[int] | None  # pins shared by the API servers
    ray: RayPlan | None = None  # --data-parallel-backend ray: the engines are Ray actors
    engine_restart_policy: str = "never"  # or "on-failure" (launcher/engine_restarts.py)


def plan_launch(args: argparse.Namespace) -> LaunchPlan:
    """The whole plan of `zserve serve ARGS`: refusals first, then the model's folders
    (building the default model if none is named), then the configs."""
    take_model_flag(args)
    problem = (
        refuse_unsupported(args)
        or compat_refusal(args)
        or http_door_refusal(args)
        or pooling_refusal(args)
        or vllm_flag_refusal(args)
    )
    if problem:
        raise LaunchRefused(problem)
    try:
        model_dir = _model_dir(args)
        tokenizer_dir = model_dir
        if args.tokenizer or args.tokenizer_revision:
            revision = args.tokenizer_revision or args.revision
            name = args.tokenizer or args.model or model_dir
            tokenizer_dir = resolve_model(name, revision, args.download_dir)
    except ModelNotFoundError as e:
        raise LaunchRefused(str(e)) from None
    return build_plan(args, model_dir, tokenizer_dir)


def build_plan(args: argparse.Namespace, model_dir: str, tokenizer_dir: str) -> LaunchPlan:
    """The plan for model and tokenizer folders already found."""
    topology = topology_of(args)
    log_no_effect(args)
    lora = lora_config(args)
    frontend = None
    if not topology.headless:
        frontend = frontend_config(args, topology, model_dir, tokenizer_dir)
        try:  # unknown parser names fail here, before any process starts
            load_chat_parsers(frontend)
        except ValueError as e:
            raise LaunchRefused(str(e)) from None
        frontend.enable_lora = lora is not None
        frontend.lora_modules = [] if lora is None else list(lora.modules)
        frontend.enable_runtime_lora_updating = runtime_lora_updating(args)
        apply_http_door(frontend, args)
        try:
            apply_compat_flags(frontend, args)
        except GenerationConfigError as e:
            raise LaunchRefused(str(e)) from None
    engine = dataclasses.replace(engine_config(args, topology, model_dir, tokenizer_dir), lora=lora)
    try:
        engine = apply_pooling(args, engine, frontend)
    except ValueError as e:
        raise LaunchRefused(str(e)) from None
    if frontend is not None:
        frontend.system_fingerprint = system_fingerprint(args, engine, topology.data_parallel_size)
    return LaunchPlan(
        topology=topology,
        engine=engine,
        frontend=frontend,
        log_level=args.log_level,
        engine_ready_timeout_s=args.engine_ready_timeout,
        engine_keys_dir=args.engine_keys,
        engine_cpus=[
            cpu_share(args.engine_cpus, i, topology.local_engines)
            for i in range(topology.local_engines)
        ],
        api_server_cpus=args.api_server_cpus,
        ray=ray_plan(args),
        engine_restart_policy=args.engine_restart_policy,
    )


def ray_plan(args: argparse.Namespace) -> RayPlan | None:
    if args.data_parallel_backend != "ray":
        return None
    return RayPlan(
        address=args.ray_address or os.environ.get("RAY_ADDRESS") or "",
        engines=args.data_parallel_size,
        engines_on_head=args.data_parallel_size_local,
        cpus_per_engine=args.cpu_threads or 1,
        device=args.device,
        resources=args.ray_engine_resources,
        strategy=args.ray_placement_strategy,
        placement_timeout_s=args.ray_placement_timeout,
    )


def topology_of(args: argparse.Namespace) -> Topology:
    dp = args.data_parallel_size
    local = args.data_parallel_size_local
    api_servers = args.api_server_count
    on_ray = args.data_parallel_backend == "ray"
    return Topology(
        data_parallel_size=dp,
        # Ray's engines are actors, even those on this node: no engine process here.
        local_engines=0 if on_ray else dp if local is None else local,
        start_rank=args.data_parallel_start_rank,
        api_server_count=dp if api_servers is None else api_servers,
        headless=args.headless,
        head_address=args.data_parallel_address,  # Ray: None → this node's Ray address
        rpc_port=args.data_parallel_rpc_port or (0 if on_ray else None),
    )


def engine_config(
    args: argparse.Namespace, topology: Topology, model_dir: str, tokenizer_dir: str | None = None
) -> EngineConfig:
    # engine_threads reads the API-server count from the flags: give it the settled one.
    settled = copy.copy(args)
    settled.api_server_count = topology.api_server_count
    return EngineConfig(
        model=model_dir,
        dtype=_DTYPES.get(args.dtype, args.dtype),
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        cpu_threads=(
            args.cpu_threads or 1  # a Ray engine's bundle holds that many CPUs
            if args.data_parallel_backend == "ray"
            else engine_threads(settled, topology.local_engines)
        ),
        # Unless the user placed the threads, an engine leaves local API servers a core
        # while they stream (engine_threads).
        spare_core_for_frontend=args.data_parallel_backend != "ray"
        and not (args.headless or args.cpu_threads or args.engine_cpus or args.api_server_cpus),
        model_impl="native" if args.model_impl == "vllm" else args.model_impl,
        cpu_kernels=args.cpu_kernels,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        data_parallel_size_local=max(topology.local_engines, 1),
        profiler=args.profiler_config,
        tokenizer=tokenizer_dir if tokenizer_dir != model_dir else None,
        grammar=grammar_config(args.structured_outputs_config),
        hf_overrides=args.hf_overrides,
    )


def frontend_config(
    args: argparse.Namespace, topology: Topology, model_dir: str, tokenizer_dir: str
) -> FrontendConfig:
    return FrontendConfig(
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        served_model_names=args.served_model_name or [args.model or "zserve-default"],
        host=args.host,
        port=args.port,
        grpc=args.grpc,
        api_key_open_paths=args.api_key_open_paths,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        api_server_count=topology.api_server_count,
        num_engines=topology.data_parallel_size,
        engine_ready_timeout_s=args.engine_ready_timeout,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
        log_level=args.log_level,
        uvicorn_log_level=args.uvicorn_log_level,
        max_logprobs=args.max_logprobs,
        chat_template=_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_scale_out=args.enable_scale_out or args.tokens_only,
        tokens_only=args.tokens_only,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        force_include_usage=args.enable_force_include_usage,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_server_load_tracking=args.enable_server_load_tracking,
        disable_fastapi_docs=args.disable_fastapi_docs,
        # --disable-log-requests: older vLLM command lines; request lines are off by default.
        enable_log_requests=args.enable_log_requests and not args.disable_log_requests,
        disable_log_stats=args.disable_log_stats,
        # Read here, never by the parser, so --help cannot print it.
        api_key=args.api_key or os.environ.get("ZSERVE_API_KEY") or None,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        root_path=args.root_path,
        middleware=args.middleware,
        sse_keep_alive_interval=args.sse_keep_alive_interval,
        stream_interval=args.stream_interval,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        metrics_prefix=args.metrics_prefix,
        scheduling_policy=args.scheduling_policy,
        shutdown_timeout=args.shutdown_timeout,
        limits=request_limits(args),
        tokenizer_pool_size=args.tokenizer_pool_size,
        tokenize_timeout_s=args.tokenize_timeout,
        enable_dev_routes=dev_routes_enabled(args),
        enable_profiler_routes=profiler_routes_enabled(args),
        wait_while_asleep_s=args.wait_while_asleep,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        tool_parser_plugin=args.tool_parser_plugin,
        # vLLM also takes the reasoning parser inside --structured-outputs-config.
        reasoning_parser=args.reasoning_parser
        or args.structured_outputs_config.get("reasoning_parser")
        or None,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        structured_outputs=frontend_options(args.structured_outputs_config),
    )


def dev_routes_enabled(args: argparse.Namespace) -> bool:
    """--enable-dev-routes, or ZSERVE_SERVER_DEV_MODE=1 (read here, once), with the
    warning they deserve."""
    env = os.environ.get("ZSERVE_SERVER_DEV_MODE", "").strip().lower()
    if env not in ("", "0", "1", "false", "true"):
        raise LaunchRefused(f"ZSERVE_SERVER_DEV_MODE must be 0 or 1, got {env!r}")
    enabled = args.enable_dev_routes or env in ("1", "true")
    if enabled:
        log.warning(
            "SECURITY: development routes are on (%s): /sleep, /wake_up, /pause, /resume, "
            "/collective_rpc, /reset_prefix_cache and /server_info let any client%s stop the "
            "engines and read the server's internals; never expose it to untrusted clients",
            "--enable-dev-routes" if args.enable_dev_routes else "ZSERVE_SERVER_DEV_MODE=1",
            " with the API key" if (args.api_key or os.environ.get("ZSERVE_API_KEY")) else "",
        )
    return enabled


def _chat_template(flag: str | None) -> str | None:
    """--chat-template is a file, or else the template itself."""
    if flag is not None and os.path.isfile(flag):
        with open(flag) as f:
            return f.read()
    return flag


def _model_dir(args: argparse.Namespace) -> str:
    if args.model is not None:
        return resolve_model(args.model, args.revision, args.download_dir)
    from launcher.tiny_model import ensure_default_model

    folder = ensure_default_model()
    log.info(
        "no MODEL given: serving the built-in default model at %s "
        "(a small Llama with RANDOM weights: its text is gibberish; pass a model folder "
        "or a cached Hugging Face id to serve a real one)",
        folder,
    )
    return str(folder)


def engine_threads(args: argparse.Namespace, local_engines: int) -> int:
    """CPU threads per engine (engine_core.config.cpu_thread_count): --engine-cpus, or
    the usable cores less one for each local API server after the first, shared by
    the local engines.

    The first API server shares the cores with the engine, which leaves it one on steps
    of many streams' tokens (model_runner.threads_for; BENCHMARKS.md §1).
    """
    if args.engine_cpus:
        cores = len(args.engine_cpus)
    else:
        api_servers = 0 if args.headless else (args.api_server_count or 1)
        cores = usable_cores() - max(0, api_servers - 1)
    return cpu_thread_count(args.cpu_threads, cores, local_engines)


def refuse_unsupported(args: argparse.Namespace) -> str | None:
    """A clear message for flags zserve deliberately does not support."""
    if args.trust_remote_code:
        return (
            "--trust-remote-code is refused: zserve never runs code shipped with a model; "
            "it serves the architectures it supports natively"
        )
    if args.tensor_parallel_size != 1:
        return (
            f"--tensor-parallel-size {args.tensor_parallel_size} is not supported: zserve "
            f"runs one device per engine; scale out with --data-parallel-size"
        )
    if args.grpc and bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        return "--grpc with TLS needs both --ssl-certfile and --ssl-keyfile"
    local = args.data_parallel_size_local
    if local is not None and not 0 <= local <= args.data_parallel_size:
        return (
            f"--data-parallel-size-local {local} must be between 0 and "
            f"--data-parallel-size {args.data_parallel_size}"
        )
    for flag, cpus in (
        ("--engine-cpus", args.engine_cpus),
        ("--api-server-cpus", args.api_server_cpus),
    ):
        missing = sorted(set(cpus or []) - set(usable_cpus()))
        if missing:
            return f"{flag}: CPUs {missing} are not available to this process ({usable_cpus()})"
    problem = refuse_backend(args) or refuse_lora(args)
    if problem or args.data_parallel_backend == "ray":
        return problem
    if args.headless and (local is None or local < 1):
        return "--headless needs --data-parallel-size-local >= 1 (engines to start here)"
    remote = local is not None and local < args.data_parallel_size
    if (remote or args.headless) and (
        args.data_parallel_address is None or args.data_parallel_rpc_port is None
    ):
        return (
            "engines on other nodes need --data-parallel-address and --data-parallel-rpc-port "
            "(the head's address and handshake port)"
        )
    return None


def refuse_backend(args: argparse.Namespace) -> str | None:
    """What --data-parallel-backend ray and --engine-restart-policy cannot go with."""
    remote = (
        args.data_parallel_size_local is not None
        and args.data_parallel_size_local < args.data_parallel_size
    )
    if args.data_parallel_backend != "ray":
        if args.engine_restart_policy != "never" and (args.headless or remote):
            return (
                "--engine-restart-policy on-failure restarts the engines this supervisor "
                "starts: every engine on this node, or Ray actors (--data-parallel-backend "
                "ray); engines of headless workers are not restarted"
            )
        return None
    if importlib.util.find_spec("ray") is None:
        return "--data-parallel-backend ray needs the ray package (pip install ray)"
    if not (args.ray_address or os.environ.get("RAY_ADDRESS")):
        return (
            "--data-parallel-backend ray joins a running Ray cluster: pass --ray-address "
            "HOST:PORT or set RAY_ADDRESS (start one with `ray start --head`)"
        )
    for flag, value in (
        ("--headless", args.headless),
        ("--data-parallel-start-rank", args.data_parallel_start_rank),
        ("--engine-cpus", args.engine_cpus),
    ):
        if value:
            return f"{flag} does not apply to --data-parallel-backend ray: Ray places every engine"
    return None


def cpu_share(cpus: list[int] | None, index: int, count: int) -> list[int] | None:
    """Engine `index` of `count`'s even share of --engine-cpus (all of them if too few)."""
    if not cpus:
        return None
    per = len(cpus) // count
    return cpus[index * per : (index + 1) * per] if per else cpus


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return len(usable_cpus())
