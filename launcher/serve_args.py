"""`zserve serve`'s flags: vLLM's names and meanings, each value checked as it is parsed.

launcher/plan.py turns the parsed flags into the typed launch plan; nothing else
reads them.
"""

from __future__ import annotations

import argparse

from launcher.arg_types import (
    cpu_list,
    fraction,
    logprob_limit,
    metrics_prefix,
    non_negative,
    open_paths,
    parse_bytes,
    positive_int,
    str_list,
)
from launcher.http_door import add_http_door_args
from launcher.limit_args import add_limit_args
from launcher.pooling_flags import add_pooling_args
from launcher.serve_feature_args import (
    add_chat_feature_args,
    add_dev_args,
    add_lora_args,
    add_ray_args,
    add_tracing_args,
)
from launcher.vllm_compat import add_compat_args
from launcher.vllm_flags import add_negative_forms, add_vllm_flag_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a Hugging Face decoder model (a local folder, or an id already in the "
            "local Hugging Face cache; nothing is downloaded). Without MODEL, a small "
            "random-weight Llama is built once into the user cache and served."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="model folder or cached HF id")
    p.set_defaults(run=_run)

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default=None, help="address to listen on (default: all IPv4)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model names the API accepts; the first is the one responses report",
    )
    g.add_argument(
        "--uvicorn-log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        default="info",
        help="level of uvicorn's own lines and of the access log (info and below)",
    )
    g.add_argument(
        "--grpc",
        action="store_true",
        help="serve gRPC on --port instead of HTTP: the VllmEngine service of smg-grpc-proto "
        "(token ids in and out), for model gateways such as SMG",
    )

    g = p.add_argument_group("model")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: MODEL)")
    g.add_argument("--revision", default=None, help="revision of a cached HF model id")
    g.add_argument(
        "--tokenizer-revision",
        default=None,
        help="revision of a cached HF tokenizer id (default: --revision)",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context length (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float", "bf16"],
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="refused: zserve runs only architectures it knows",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="only 1 is supported")

    g = p.add_argument_group("engine")
    g.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda | cuda:N; with cuda (or auto on a GPU host) each local engine "
        "takes a GPU of its own, in turn where there are more engines than GPUs",
    )
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help="most sequences an engine runs at once; default as vLLM's server: 128 on the "
        "CPU, 256 on a GPU",
    )
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="cap on one request's prefill chunk per step (0: no cap)",
    )
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=parse_bytes,
        default=None,
        help="KV cache size per engine, e.g. 2GiB (default on CPU: 1GiB; on a GPU it replaces "
        "the sizing by --gpu-memory-utilization)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        "--device-memory-utilization",
        type=fraction,
        default=0.9,
        help="share of a GPU's memory an engine fills: weights, its largest step and the KV "
        "cache in what is left (ignored on CPU and where --kv-cache-memory-bytes is given)",
    )
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument(
        "--cpu-threads",
        type=positive_int,
        default=None,
        help="CPU threads per engine, for its CPU kernels' pool or torch's ops (default: the "
        "usable cores minus one for each local API server after the first, shared by the "
        "local engines, at least 1; where torch's threads run the matmuls, a step of many "
        "streams' tokens leaves one of them to the API servers, unless this flag, "
        "--engine-cpus or --api-server-cpus places the threads)",
    )
    g.add_argument(
        "--engine-cpus",
        type=cpu_list,
        default=None,
        help="pin the local engines to these CPUs (e.g. 1 or 2-7), split evenly between "
        "them (default: no pinning)",
    )
    g.add_argument(
        "--api-server-cpus",
        type=cpu_list,
        default=None,
        help="pin the API servers to these CPUs (e.g. 0), so they never take the engines' "
        "cores (default: no pinning)",
    )
    g.add_argument(
        "--model-impl", default="auto", choices=["auto", "native", "vllm", "transformers"]
    )
    g.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=["auto", "off"],
        help="auto: the native bf16 forward on CPU runs zserve's C kernels (fused norms, "
        "RoPE, SiLU, paged attention, greedy's argmax and the matmuls, on AMX tiles or "
        "AVX512-BF16; compiled once per machine with gcc), falling back to torch's ops "
        "where they cannot build; off: torch's ops always",
    )

    add_lora_args(p)
    add_pooling_args(p)

    g = p.add_argument_group("OpenAI API")
    g.add_argument(
        "--max-logprobs",
        type=logprob_limit,
        default=20,
        help="most logprobs / top_logprobs / prompt_logprobs a request may ask for "
        "(-1: the whole vocabulary)",
    )
    g.add_argument(
        "--logprobs-mode",
        choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
        default="raw_logprobs",
        help="what logprobs hold: the model's own distribution (raw) or the one sampled from "
        "(processed: after penalties, logit_bias, temperature, min_p, top_k and top_p; for "
        "greedy requests after penalties and bias), as logprobs or as logits; prompt "
        "logprobs are always raw",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="chat template (a file, or the template itself) overriding the model's",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests supply their own chat_template",
    )
    g.add_argument(
        "--enable-request-id-headers", action="store_true", help="echo X-Request-Id on responses"
    )
    g.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve vLLM's scale-out routes: /v1/chat/completions/render, "
        "/v1/completions/render, /v1/messages/render and /v1/responses/render (a request "
        "as token ids and engine parameters, not run), POST /inference/v1/generate (run "
        "one), /v1/chat/completions/derender and /v1/completions/derender (its answer "
        "as the route's response) and POST /inference/v1/abort_requests (end requests "
        "by id, on any API server); without it they answer 403",
    )
    g.add_argument(
        "--tokens-only",
        action="store_true",
        help="a generate server of vLLM's disaggregated setups: --enable-scale-out, and "
        "POST /abort_requests too; /inference/v1/generate decodes no text, so it refuses "
        "stop strings and output_mode text (stop at stop_token_ids; derender elsewhere)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, as if stream_options.include_usage were set",
    )
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true")
    g.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count in-flight requests for GET /load",
    )
    g.add_argument("--disable-fastapi-docs", action="store_true", help="do not serve /openapi.json")
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log a line per request (off by default, as in vLLM since 0.10)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for older vLLM command lines: request lines are off by default",
    )
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic engine stats line")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but the probes (/health, "
        "/live, /ping, /version) and /metrics (without this flag: the ZSERVE_API_KEY "
        "environment variable, if set). Unlike vLLM, whose key guards /v1 only, this also "
        "guards /tokenize, /detokenize, /invocations, /load, /tokenizer_info and "
        "/server_info; see --api-key-open-paths",
    )
    g.add_argument(
        "--api-key-open-paths",
        type=open_paths,
        default=[],
        help="routes answered without the API key besides the probes, as JSON or a,b "
        "(e.g. /tokenize,/load); 'vllm' opens every route vLLM leaves open (/tokenize, "
        "/detokenize, /invocations, /load, /tokenizer_info), for vLLM's exact behaviour",
    )
    g.add_argument(
        "--allowed-origins",
        type=str_list,
        default=[],
        help="CORS origins, as JSON ('[\"https://a.example\"]') or a,b (default: none)",
    )
    g.add_argument("--allowed-methods", type=str_list, default=["*"])
    g.add_argument("--allowed-headers", type=str_list, default=["*"])
    g.add_argument("--allow-credentials", action="store_true")
    g.add_argument(
        "--root-path",
        default="",
        help="path prefix when behind a proxy: every route is served with and without it",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="name logprob tokens 'token_id:N' unless a request's return_tokens_as_token_ids "
        "says otherwise",
    )
    g.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="module.path.Name of an ASGI middleware class or HTTP middleware "
        "function (repeatable)",
    )
    g.add_argument(
        "--sse-keep-alive-interval",
        type=non_negative,
        default=0.0,
        help="seconds between ': keep-alive' comments while a stream waits (0: off)",
    )
    g.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="tokens per SSE event of a stream (1: every token its own event)",
    )
    g.add_argument(
        "--max-num-queued-reqs",
        type=positive_int,
        default=None,
        help="503 when the server already holds this many requests",
    )
    g.add_argument(
        "--max-num-queued-tokens",
        type=positive_int,
        default=None,
        help="503 when this many prompt tokens already wait for prefill",
    )
    g.add_argument(
        "--metrics-prefix",
        type=metrics_prefix,
        default="zserve",
        help="prefix of /metrics names (vllm: vLLM's names for its dashboards)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="seconds in-flight requests may finish after SIGTERM (0: abort at once)",
    )

    add_http_door_args(p)

    add_chat_feature_args(p)

    add_limit_args(p)

    add_dev_args(p)

    add_tracing_args(p)

    g = p.add_argument_group("processes")
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=positive_int,
        default=None,
        help="API-server processes (default: the data-parallel size)",
    )
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1)
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None)
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0)
    g.add_argument("--data-parallel-address", "-dpa", default=None)
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None)
    g.add_argument(
        "--headless",
        action="store_true",
        help="start only engine cores, which join a head node over TCP",
    )
    g.add_argument(
        "--engine-ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every engine's READY (and, on a worker, for the head "
        "and its keys)",
    )
    g.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=30.0,
        help="an engine silent this long, or with work but not stepping this long, is "
        "declared dead (the server then exits non-zero); an engine on the CPU whose CPU time "
        "keeps rising is in a long step, not hung, for up to 10 times this",
    )
    g.add_argument(
        "--engine-keys",
        default=None,
        help="folder with the CURVE keys that secure engine links over TCP; the head creates "
        "them if missing, workers need a copy (default: $XDG_CONFIG_HOME/zserve/engine-keys)",
    )
    g.add_argument(
        "--data-parallel-backend",
        "-dpb",
        choices=["mp", "ray"],
        default="mp",
        help="mp: engines are processes of this node (or headless workers on others); ray: "
        "engines are actors of a running Ray cluster (see the Ray group)",
    )
    g.add_argument(
        "--engine-restart-policy",
        choices=["never", "on-failure"],
        default="never",
        help="never: an engine's death fails the server; on-failure: the supervisor starts "
        "that engine again (a Ray actor on another node if its node is gone) and it "
        "re-joins the running API servers (its in-flight requests still fail)",
    )
    g.add_argument("--log-level", default="INFO")

    add_ray_args(p)

    add_compat_args(p)
    add_vllm_flag_args(p)
    add_negative_forms(p)


def _run(args: argparse.Namespace) -> int:
    from launcher.serve import serve

    return serve(args)
