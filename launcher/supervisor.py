"""The supervisor of `zserve serve`: claims the port, starts the API servers and the
engines, runs the engine handshake, then watches every child until a signal or a
death ends the server. Shutdown order: API servers, then engines."""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections

import zmq

from engine_core.config import EngineConfig
from frontend.admission import Admission
from frontend.config import APIServerConfig, FrontendConfig
from frontend.limits import RequestLimits
from launcher import procs
from launcher.models import ModelNotFoundError, resolve_model
from launcher.port import PortBusyError, claim_port
from launcher.serve_args import openai_surface, refuse_unsupported, usable_cores
from protocol.handshake import (
    EngineHello,
    EnginePlan,
    ProtocolVersionError,
    decode_handshake,
    encode_handshake,
)
from protocol.keys import EngineKeysError, engine_keys, start_authenticator
from protocol.lifecycle import name_process
from protocol.logs import setup_logging
from protocol.messages import PROTOCOL_VERSION
from protocol.sockets import (
    bind,
    identity_rank,
    ipc_address,
    make_socket,
    needs_curve,
    tcp_address,
)

log = logging.getLogger("zserve.supervisor")

_DTYPES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: mp.Process
    pipe: object = None
    info: dict = field(default_factory=dict)


def engine_threads(args: argparse.Namespace, local_engines: int) -> int:
    """CPU threads per engine (its CPU kernels' pool, or torch's where those do not run
    the forward): the usable cores less one for each local API server after the first,
    shared by the local engines, at least one.

    The first API server shares the cores with the engine: it needs a fraction of a
    core, and the kernels' pool gives way to it (idle threads sleep after 50 us; no
    loop waits for a thread that has not started on it). On 2 cores, 1 API server and
    `vllm bench serve` beside them, two engine threads served a median 5,135 tok/s
    against one thread's 4,056 at concurrency 128 and 3,434 against 3,547 at 32, with a
    lower ITL p99 at both (3 alternating rounds, torch's OpenMP threads then;
    BENCHMARKS.md).
    """
    if args.cpu_threads is not None:
        return args.cpu_threads
    if args.engine_cpus:
        return max(1, len(args.engine_cpus) // max(local_engines, 1))
    api_servers = 0 if args.headless else (args.api_server_count or 1)
    reserved = max(0, api_servers - 1)
    return max(1, (usable_cores() - reserved) // max(local_engines, 1))


def engine_config(args: argparse.Namespace, model_dir: str, local_engines: int) -> EngineConfig:
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
        cpu_threads=engine_threads(args, local_engines),
        model_impl="native" if args.model_impl == "vllm" else args.model_impl,
        cpu_kernels=args.cpu_kernels,
        max_logprobs=args.max_logprobs,
        data_parallel_size_local=max(local_engines, 1),
    )


def frontend_config(args: argparse.Namespace, model_dir: str, tokenizer_dir: str) -> FrontendConfig:
    names = args.served_model_name or [args.model or "zserve-default"]
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    return FrontendConfig(
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        served_model_names=names,
        host=args.host,
        port=args.port,
        api_server_count=args.api_server_count,
        num_engines=args.data_parallel_size,
        engine_ready_timeout_s=args.engine_ready_timeout,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
        log_level=args.log_level,
        uvicorn_log_level=args.uvicorn_log_level,
        max_logprobs=args.max_logprobs,
        chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        force_include_usage=args.enable_force_include_usage,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_server_load_tracking=args.enable_server_load_tracking,
        disable_fastapi_docs=args.disable_fastapi_docs,
        enable_log_requests=args.enable_log_requests and not args.disable_log_requests,
        disable_log_stats=args.disable_log_stats,
        api_key=args.api_key or os.environ.get("ZSERVE_API_KEY") or None,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        root_path=args.root_path,
        middleware=args.middleware,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        sse_keep_alive_interval=args.sse_keep_alive_interval,
        stream_interval=args.stream_interval,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        metrics_prefix=args.metrics_prefix,
        scheduling_policy=args.scheduling_policy,
        shutdown_timeout=args.shutdown_timeout,
        limits=RequestLimits(
            max_body_bytes=args.max_request_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_header_count=args.max_header_count,
            header_timeout_s=args.header_read_timeout,
            body_timeout_s=args.body_read_timeout,
            max_prompt_chars=args.max_prompt_chars,
            max_prompts=args.max_prompts_per_request,
            max_sequences=args.max_sequences_per_request,
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_string_length,
            max_request_id_chars=args.max_request_id_length,
            max_messages=args.max_chat_messages,
        ),
        tokenizer_pool_size=args.tokenizer_pool_size,
        tokenize_timeout_s=args.tokenize_timeout,
        **openai_surface(args),
    )


def serve(args: argparse.Namespace) -> int:
    setup_logging("supervisor", args.log_level)
    name_process("zserve-super")
    problem = refuse_unsupported(args)
    if problem:
        log.error("%s", problem)
        return 2
    try:
        model_dir = _model_dir(args)
        tokenizer_dir = (
            resolve_model(args.tokenizer, args.revision) if args.tokenizer else model_dir
        )
    except ModelNotFoundError as e:
        log.error("%s", e)
        return 2
    if args.api_server_count is None:
        args.api_server_count = args.data_parallel_size
    local = args.data_parallel_size_local
    if local is None:
        local = args.data_parallel_size
    sup = Supervisor(args, model_dir, tokenizer_dir, local)
    return sup.run()


def _model_dir(args: argparse.Namespace) -> str:
    if args.model is not None:
        return resolve_model(args.model, args.revision)
    from launcher.tiny_model import ensure_default_model

    folder = ensure_default_model()
    log.info(
        "no MODEL given: serving the built-in default model at %s "
        "(a small Llama with RANDOM weights: its text is gibberish; pass a model folder "
        "or a cached Hugging Face id to serve a real one)",
        folder,
    )
    return str(folder)


class Supervisor:
    def __init__(self, args: argparse.Namespace, model_dir: str, tokenizer_dir: str, local: int):
        self.args = args
        self.model_dir = model_dir
        self.tokenizer_dir = tokenizer_dir
        self.num_local = local
        self.start_rank = args.data_parallel_start_rank
        self.headless = args.headless
        self.all_local = local == args.data_parallel_size and not args.headless
        self.ctx = mp.get_context("spawn")
        self.zmq = zmq.Context()
        self.runtime_dir = tempfile.mkdtemp(prefix=f"zserve-{os.getpid()}-")
        self.api_servers: list[Child] = []
        self.engines: list[Child] = []
        self.stop_signal: int | None = None
        self.holder = None
        self.handshake = None
        self.keys = None
        self.auth = None
        self.failure: tuple[int, str] | None = None
        self.restarts: list[float] = []

    # --- the whole life -----------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        raise_open_files_limit()
        try:
            if not self.all_local:
                self.keys = engine_keys(
                    self.args.engine_keys,
                    create=not self.headless,
                    wait_s=self.args.engine_ready_timeout if self.headless else 0.0,
                )
                if not self.headless:
                    self.auth = start_authenticator(self.zmq, self.keys)
            if self.headless:
                self.start_engines(self.args.data_parallel_address)
                log.info(
                    "headless: %d engine(s) (ranks %d..%d) joining %s",
                    self.num_local,
                    self.start_rank,
                    self.start_rank + self.num_local - 1,
                    self.handshake_address(),
                )
                return self.monitor()
            self.holder = claim_port(self.args.host, self.args.port)
            self.bind_handshake()
            self.start_api_servers()
            self.start_engines(None)
            self.run_handshake()
            self.wait_api_servers_serving()
            host = self.args.host or "0.0.0.0"
            log.info(
                "zserve ready on http://%s:%d (%d API server(s), %d engine(s))",
                host,
                self.args.port,
                len(self.api_servers),
                self.args.data_parallel_size,
            )
            return self.monitor()
        except (PortBusyError, EngineKeysError) as e:
            log.error("%s", e)
            return 1
        except (StartupError, ProtocolVersionError, TimeoutError) as e:
            log.error("start-up failed: %s", e)
            return 1
        except _Stop:
            return 0
        finally:
            self.shutdown()

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            log.info("%s: shutting down", signal.Signals(signum).name)
            raise _Stop()

    # --- start-up -----------------------------------------------------------------

    def handshake_address(self) -> str:
        if self.all_local:
            return ipc_address(self.runtime_dir, "handshake")
        return tcp_address(self.args.data_parallel_address, self.args.data_parallel_rpc_port)

    def data_address(self, name: str) -> str:
        if self.all_local:
            return ipc_address(self.runtime_dir, name)
        return tcp_address(self.args.data_parallel_address, 0)

    def bind_handshake(self) -> None:
        address = self.handshake_address()
        self.handshake = make_socket(
            self.zmq,
            zmq.ROUTER,
            curve=self.keys if needs_curve(address) else None,
            curve_server=True,
        )
        try:
            bind(self.handshake, address)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot bind the engine handshake socket {address}: {e}") from e

    def start_api_servers(self) -> None:
        fc = frontend_config(self.args, self.model_dir, self.tokenizer_dir)
        fc.curve = self.keys
        # prometheus_client's multiprocess mode reads this when the children import it.
        metrics_dir = os.path.join(self.runtime_dir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        self.admission_path = os.path.join(self.runtime_dir, "admission")
        Admission.create_file(self.admission_path, self.args.api_server_count)
        for index in range(self.args.api_server_count):
            cfg = APIServerConfig(
                frontend=fc,
                client_index=index,
                input_address=self.data_address(f"api{index}-in"),
                output_address=self.data_address(f"api{index}-out"),
                parent_pid=os.getpid(),
                admission_path=self.admission_path,
                cpus=self.args.api_server_cpus,
            )
            self.api_servers.append(self._spawn_api_server(cfg))
        for child in self.api_servers:
            message = self._receive(child, "addresses", timeout_s=120)
            child.info["input"], child.info["output"] = message[1], message[2]
            # A restarted API server binds exactly these endpoints again.
            child.info["config"].input_address = message[1]
            child.info["config"].output_address = message[2]
            if not self.all_local:  # ports for the firewall between the nodes
                log.info(
                    "%s binds %s (requests to engines) and %s (engine outputs)",
                    child.name,
                    message[1],
                    message[2],
                )

    def _spawn_api_server(self, cfg: APIServerConfig) -> Child:
        parent_end, child_end = self.ctx.Pipe()
        process = self.ctx.Process(
            target=procs.api_server_main, args=(cfg, child_end), name=f"api{cfg.client_index}"
        )
        process.start()
        child_end.close()
        return Child(f"API server {cfg.client_index}", process, parent_end, {"config": cfg})

    def start_engines(self, head_address: str | None) -> None:
        ec = engine_config(self.args, self.model_dir, self.num_local)
        for i in range(self.num_local):
            rank = self.start_rank + i
            cfg = procs.EngineProcConfig(
                engine=ec,
                rank=rank,
                handshake_address=self.handshake_address(),
                local=not self.headless,
                headless=self.headless,
                ready_timeout_s=self.args.engine_ready_timeout,
                log_level=self.args.log_level,
                parent_pid=os.getpid(),
                curve=self.keys,
                cpus=_share(self.args.engine_cpus, i, self.num_local),
            )
            cfg.engine.data_parallel_rank = rank
            process = self.ctx.Process(target=procs.engine_main, args=(cfg,), name=f"engine{rank}")
            process.start()
            self.engines.append(Child(f"engine {rank}", process, info={"rank": rank}))

    def run_handshake(self) -> None:
        """HELLO → PLAN for every rank, then wait for every READY."""
        plan = EnginePlan(
            PROTOCOL_VERSION,
            [c.info["input"] for c in self.api_servers],
            [c.info["output"] for c in self.api_servers],
        )
        expected = set(range(self.args.data_parallel_size))
        ready: set[int] = set()
        deadline = time.monotonic() + self.args.engine_ready_timeout
        while ready != expected:
            self._check_children(starting=True)
            if time.monotonic() > deadline:
                missing = sorted(expected - ready)
                raise TimeoutError(
                    f"engine(s) {missing} not ready within {self.args.engine_ready_timeout:.0f} s "
                    f"(--engine-ready-timeout); remote engines join at {self.handshake_address()}"
                )
            if not self.handshake.poll(200):
                continue
            identity, data = self.handshake.recv_multipart()
            rank = identity_rank(identity)
            try:
                kind, body = decode_handshake(data)
            except ProtocolVersionError as e:
                self.handshake.send_multipart(
                    [identity, encode_handshake("plan", _refusal(str(e)))]
                )
                raise ProtocolVersionError(f"engine {rank}: {e}") from None
            except ValueError as e:
                log.warning("dropped a malformed handshake message from %r: %s", identity, e)
                continue
            if kind == "hello":
                self._on_hello(identity, rank, body, expected, plan)
            elif kind == "ready" and rank in expected:
                ready.add(rank)
                log.info(
                    "engine %d ready (pid %d on %s, %s, %d KV blocks)",
                    rank,
                    body.pid,
                    body.hostname,
                    body.device,
                    body.num_kv_blocks,
                )

    def _on_hello(self, identity: bytes, rank: int, hello: EngineHello, expected, plan) -> None:
        local_ranks = range(self.start_rank, self.start_rank + self.num_local)
        problem = None
        if rank not in expected or hello.rank != rank:
            problem = f"rank {rank} is not part of this server (ranks {sorted(expected)})"
        elif (rank in local_ranks) == hello.headless:
            problem = (
                f"rank {rank} is {'local' if rank in local_ranks else 'remote'} here but the "
                f"engine says headless={hello.headless}"
            )
        if problem:
            log.warning("refused engine %d: %s", rank, problem)
            self.handshake.send_multipart([identity, encode_handshake("plan", _refusal(problem))])
            return
        log.info("engine %d said hello (pid %d on %s)", rank, hello.pid, hello.hostname)
        self.handshake.send_multipart([identity, encode_handshake("plan", plan)])

    def wait_api_servers_serving(self) -> None:
        for child in self.api_servers:
            message = self._receive(child, "serving", timeout_s=self.args.engine_ready_timeout)
            child.info["pid"] = message[1]

    def _receive(self, child: Child, kind: str, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_children(starting=True)
            if child.pipe.poll(0.2):
                try:
                    message = child.pipe.recv()
                except EOFError:
                    continue  # the death is reported by _check_children
                if message[0] == kind:
                    return message
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} did not report {kind!r} in {timeout_s:.0f} s")

    # --- watching -----------------------------------------------------------------

    def _check_children(self, starting: bool = False) -> None:
        for child in self.api_servers + self.engines:
            code = child.process.exitcode
            if code is not None:
                when = "during start-up" if starting else "unexpectedly"
                raise StartupError(
                    f"{child.name} (pid {child.process.pid}) exited {when} with code "
                    f"{_describe(code)}; see its log lines above"
                )

    def monitor(self) -> int:
        """Watch every child until a signal (→ 0) or a failure (→ 1).

        An API server that dies is restarted on the same port with the same index
        and endpoints. An engine that dies (seen here, or reported by an API server
        for engines on other nodes) fails the server: the API servers first end its
        requests with errors and answer /health 503, then everything stops, so an
        orchestrator restarts the whole server.
        """
        while True:
            waitables = {c.process.sentinel: c for c in self.api_servers + self.engines}
            waitables.update({c.pipe: c for c in self.api_servers if c.pipe is not None})
            for ready in wait_connections(list(waitables), timeout=1.0):
                child = waitables[ready]
                if ready is child.pipe:
                    self._on_api_message(child)
                elif child in self.engines:
                    child.process.join(1)  # reap it, so its exit code is known
                    return self._engine_failed(
                        child.info.get("rank", -1),
                        f"{child.name} (pid {child.process.pid}) died with exit code "
                        f"{_describe(child.process.exitcode)}",
                    )
                else:
                    self._restart_api_server(child)
            if self.failure is not None:
                return self._engine_failed(*self.failure)

    def _on_api_message(self, child: Child) -> None:
        try:
            message = child.pipe.recv()
        except (EOFError, OSError):
            child.pipe.close()
            child.pipe = None  # its death shows on the sentinel
            return
        if message[0] == "engine_dead" and self.failure is None:
            self.failure = (message[1], f"engine {message[1]}: {message[2]}")

    def _engine_failed(self, rank: int, reason: str) -> int:
        log.error("%s; failing the server", reason)
        for child in self.api_servers:
            if child.pipe is not None and rank >= 0:
                try:
                    child.pipe.send(("engine_dead", rank, reason))
                except OSError:
                    pass
        time.sleep(ENGINE_DEATH_GRACE_S)
        return 1

    def _restart_api_server(self, child: Child) -> None:
        child.process.join(0)
        index = self.api_servers.index(child)
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < 60] + [now]
        log.error(
            "%s (pid %d) died with exit code %s; restarting it (same port, index, endpoints)",
            child.name,
            child.process.pid,
            _describe(child.process.exitcode),
        )
        if len(self.restarts) > MAX_RESTARTS_PER_MINUTE:
            raise StartupError(
                f"API servers died {len(self.restarts)} times in a minute; giving up"
            )
        if child.pipe is not None:
            child.pipe.close()
        cfg = child.info["config"]
        cfg.restarts += 1
        new = self._spawn_api_server(cfg)
        self.api_servers[index] = new
        self._receive(new, "addresses", timeout_s=120)
        self._receive(new, "serving", timeout_s=self.args.engine_ready_timeout)
        log.info("%s is back (pid %d)", new.name, new.process.pid)

    # --- shutdown -----------------------------------------------------------------

    def shutdown(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        drain = self.args.shutdown_timeout if self.stop_signal is not None else 0.0
        _stop_all([c.process for c in self.api_servers], grace_s=drain + 10.0)
        _stop_all([c.process for c in self.engines], grace_s=10.0)
        for child in self.api_servers:
            if child.pipe is not None:
                child.pipe.close()
        if self.handshake is not None:
            self.handshake.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.zmq.destroy(linger=0)
        if self.holder is not None:
            self.holder.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


# After an engine dies: time for the API servers to send error events and answer
# /health 503 before the server exits.
ENGINE_DEATH_GRACE_S = 2.0
MAX_RESTARTS_PER_MINUTE = 5


def _share(cpus: list[int] | None, index: int, count: int) -> list[int] | None:
    """Engine `index` of `count`'s even share of --engine-cpus (all of them if too few)."""
    if not cpus:
        return None
    per = len(cpus) // count
    return cpus[index * per : (index + 1) * per] if per else cpus


# Open files per process: room for thousands of concurrent streams per API server, and
# a ceiling on what a flood of connections can make one process hold.
OPEN_FILES = 65_536


def raise_open_files_limit() -> None:
    """Thousands of streams need thousands of sockets: soft limit up to OPEN_FILES (or
    the hard limit, if lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)


class _Stop(Exception):
    """Raised from the signal handler to unwind whatever the supervisor is waiting on."""


def _refusal(reason: str) -> EnginePlan:
    return EnginePlan(PROTOCOL_VERSION, [], [], error=reason)


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def _stop_all(processes: list[mp.Process], grace_s: float) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL: nothing outlives the supervisor."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            log.warning("%s did not stop in %.0f s; killing it", p.name, grace_s)
            p.kill()
            p.join(5)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
