"""vLLM flags that a vLLM command line carries, so that it starts zserve unchanged.

Each flag keeps its vLLM meaning. Some act (the sampling defaults, the response role,
the chat template's default arguments, the download folder); some name what zserve
always does, and are logged as such; a value that would ask for what zserve does not
do (an fp8 KV cache, a non-safetensors checkpoint, whole prompts without chunking) is
refused at start with the reason, never silently ignored.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from launcher.arg_types import json_object
from launcher.fingerprint import add_fingerprint_args, fingerprint_refusal
from launcher.generation_config import generation_defaults

if TYPE_CHECKING:
    from frontend.config import FrontendConfig

log = logging.getLogger("zserve.supervisor")

# flag → (accepted values, what zserve does instead of the others)
_ONLY = {
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model's dtype (--dtype)"),
    "load_format": (("auto", "safetensors"), "zserve reads safetensors checkpoints only"),
    "tokenizer_mode": (("auto", "hf"), "zserve uses the Hugging Face fast tokenizer"),
}
# flag → what zserve does that makes it hold already
_ALWAYS = {
    "enforce_eager": "zserve runs eagerly always (no CUDA graphs, no torch.compile)",
    "enable_chunked_prefill": "zserve always splits prompts into --max-num-batched-tokens chunks",
    "enable_sleep_mode": "sleep mode is always available (POST /sleep with --enable-dev-routes)",
    "async_scheduling": "zserve's engine schedules each step after the last; no effect",
    "enable_log_outputs": "zserve logs no prompt or output text (request lines: ids, counts)",
    "max_log_len": "zserve's request lines hold no prompt text to shorten",
    "compilation_config": "zserve compiles nothing at start (no torch.compile, no CUDA "
    "graphs): its CPU kernels are built ahead; no effect",
    "max_parallel_loading_workers": "each engine reads its checkpoint itself; no effect",
    "disable_cascade_attn": "zserve has no cascade attention; no effect",
}
# flag → (its one accepted value, what zserve does instead of the others); None: unset
_ONE = {
    "quantization": (None, "zserve runs the checkpoint's own weights (--dtype); no quantization"),
    "pipeline_parallel_size": (1, "each engine holds the whole model (scale out with -dp)"),
}


def add_compat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "vLLM compatibility", "vLLM's flags with vLLM's meanings (see launcher/vllm_compat.py)"
    )
    g.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        default=None,
        help="MODEL as a flag, as vLLM also takes it (the positional MODEL wins)",
    )
    g.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flags (name: value), read before the command line, which wins",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a "
        "folder holding a generation_config.json",
    )
    g.add_argument(
        "--override-generation-config",
        type=json_object,
        default={},
        help="JSON over those defaults, e.g. '{\"temperature\": 0.5}'; max_new_tokens caps "
        "every request's max_tokens",
    )
    g.add_argument(
        "--hf-overrides",
        type=json_object,
        default={},
        help="JSON over the model's config.json, e.g. '{\"max_position_embeddings\": 4096}'",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="role of chat responses when add_generation_prompt is true",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        type=_template_kwargs,
        default={},
        help="JSON object of chat template arguments under each request's "
        "chat_template_kwargs, e.g. '{\"enable_thinking\": false}'",
    )
    g.add_argument(
        "--chat-template-content-format",
        choices=["auto", "string", "openai"],
        default="auto",
        help="zserve gives templates each message's text as a string (string; auto is "
        "that too); openai is refused",
    )
    g.add_argument(
        "--download-dir",
        default=None,
        help="Hugging Face cache folder to find model ids in (nothing is downloaded)",
    )
    g.add_argument("--kv-cache-dtype", default="auto", help="auto only")
    g.add_argument("--load-format", default="auto", help="auto or safetensors")
    g.add_argument("--tokenizer-mode", default="auto", help="auto or hf")
    g.add_argument("--enforce-eager", action="store_true", help=_ALWAYS["enforce_eager"])
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_ALWAYS["enable_chunked_prefill"] + "; --no-enable-chunked-prefill is refused",
    )
    g.add_argument("--enable-sleep-mode", action="store_true", help=_ALWAYS["enable_sleep_mode"])
    g.add_argument("--enable-log-outputs", action="store_true", help=_ALWAYS["enable_log_outputs"])
    g.add_argument("--max-log-len", type=int, default=None, help=_ALWAYS["max_log_len"])
    g.add_argument("--quantization", "-q", default=None, help=_ONE["quantization"][1])
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="1 only: " + _ONE["pipeline_parallel_size"][1],
    )
    g.add_argument(
        "--distributed-executor-backend",
        default=None,
        help="mp or uni: one process per engine, as zserve always runs; ray and "
        "external_launcher are refused (zserve places engines on Ray with "
        "--data-parallel-backend ray)",
    )
    g.add_argument("--compilation-config", "-cc", default=None, help=_ALWAYS["compilation_config"])
    g.add_argument(
        "--max-parallel-loading-workers",
        type=int,
        default=None,
        help=_ALWAYS["max_parallel_loading_workers"],
    )
    g.add_argument(
        "--disable-cascade-attn", action="store_true", help=_ALWAYS["disable_cascade_attn"]
    )
    add_fingerprint_args(g)
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_ALWAYS["async_scheduling"],
    )


def take_model_flag(args: argparse.Namespace) -> None:
    """--model MODEL into args.model, unless the positional MODEL is given (vLLM's rule)."""
    flag = args.model_flag
    if flag is not None and args.model is not None and flag != args.model:
        log.warning("--model %s is not used: the positional MODEL %s is", flag, args.model)
    if args.model is None:
        args.model = flag


def compat_refusal(args: argparse.Namespace) -> str | None:
    """Why these vLLM flags cannot start zserve as asked; None: they can."""
    for name, (accepted, instead) in _ONLY.items():
        value = getattr(args, name)
        if value not in accepted:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {value} is not supported: {instead} (accepted: {', '.join(accepted)})"
    if args.enable_chunked_prefill is False:
        return (
            "--no-enable-chunked-prefill is not supported: "
            + _ALWAYS["enable_chunked_prefill"]
            + " (a larger --max-num-batched-tokens gives fewer, longer chunks)"
        )
    for name, (accepted, instead) in _ONE.items():
        value = getattr(args, name)
        if value is not None and value != accepted:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {value} is not supported: {instead}"
    backend = args.distributed_executor_backend
    if backend not in (None, "mp", "uni"):
        return (
            f"--distributed-executor-backend {backend} is not supported: each zserve engine "
            f"is one process (mp); to place engines on a Ray cluster, use "
            f"--data-parallel-backend ray"
        )
    if args.chat_template_content_format == "openai":
        return (
            "--chat-template-content-format openai is not supported: zserve gives chat "
            "templates each message's text as a string (string)"
        )
    return fingerprint_refusal(args)


def apply_compat_flags(frontend: FrontendConfig, args: argparse.Namespace) -> None:
    """What these flags set in the API servers' config; one log line for each flag that
    names what zserve does anyway. Raises GenerationConfigError."""
    defaults = generation_defaults(
        args.generation_config, frontend.model_dir, args.override_generation_config
    )
    frontend.sampling_defaults = defaults.sampling
    frontend.max_tokens_ceiling = defaults.max_tokens_ceiling
    frontend.response_role = args.response_role
    frontend.default_chat_template_kwargs = args.default_chat_template_kwargs
    for name, meaning in _ALWAYS.items():
        if getattr(args, name) not in (None, False):
            log.info("--%s: %s", name.replace("_", "-"), meaning)


def _template_kwargs(text: str) -> dict:
    value = json_object(text)
    from frontend.chat_prompt import RESERVED_TEMPLATE_KWARGS

    # The renderer's own arguments, and what a request gives through its own fields.
    reserved = sorted((RESERVED_TEMPLATE_KWARGS | {"chat_template", "tools"}) & value.keys())
    if reserved:
        raise argparse.ArgumentTypeError(
            f"{reserved[0]!r} is not a template variable; requests set it with their own field"
        )
    return value
