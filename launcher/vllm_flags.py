"""The rest of `vllm serve`'s flags: a vLLM command line carrying them starts zserve.

Every flag of vLLM 0.32's `vllm serve` is known here or elsewhere in the parser. The
ones here tune machinery zserve does not have (GPU kernels, expert parallelism,
multimodal processing, Mamba layers, checkpoint downloads): any value changes nothing
zserve answers, and each one set is logged at start with the reason. Or they ask for a
feature zserve does not have: accepted at vLLM's default, any other value refused at
start with the reason, never silently ignored.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

log = logging.getLogger("zserve.supervisor")

GPU = "tunes GPU kernels, CUDA graphs or compilation, which zserve does not use"
MOE = "tunes mixture-of-experts or expert parallelism; zserve runs no MoE model"
MM = "tunes multimodal inputs; zserve takes text only (multimodal content is a 400)"
MAMBA = "tunes state-space (Mamba) layers; zserve runs none"
LOAD = "tunes how vLLM downloads or reads checkpoints; zserve reads local safetensors"
DIST = "tunes torch.distributed; each zserve engine is one process"
DP = "tunes vLLM's data-parallel supervisor; zserve's supervisor watches its engines itself"


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]
    kind: str  # bool (--x / --no-x), value, or values (one or more)
    reason: str
    # None: any value has no effect. Else the values accepted (as given on the command
    # line; () for none: the flag may only be left unset), and others are refused.
    accepted: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.names[0].removeprefix("--").replace("-", "_")


def _none(*names: str, kind: str = "value", reason: str) -> VllmFlag:
    """Any value: no effect."""
    return VllmFlag(names, kind, reason)


def _only(*names: str, kind: str = "value", accepted: tuple[str, ...] = (), reason: str):
    """Accepted at vLLM's default (`accepted`; for bool: false), refused otherwise."""
    if kind == "bool" and not accepted:
        accepted = ("false",)
    return VllmFlag(names, kind, reason, accepted)


def _many(kind: str, reason: str, *names: str) -> list[VllmFlag]:
    return [VllmFlag((n,), kind, reason) for n in names]


FLAGS: list[VllmFlag] = [
    *_many("value", GPU, "--attention-backend", "--moe-backend", "--linear-backend",
           "--sparse-indexer-topk-backend", "--gdn-prefill-backend", "--kda-prefill-backend",
           "--kda-decode-backend", "--max-cudagraph-capture-size", "--ir-op-priority",
           "--kernel-config", "--optimization-level", "--performance-mode",
           "--jit-monitor-mode"),
    _none("--attention-config", "-ac", reason=GPU),
    _none("--cudagraph-capture-sizes", kind="values", reason=GPU),
    *_many("bool", GPU, "--enable-flashinfer-autotune", "--enable-cumem-allocator",
           "--enable-nccl-comm-suspend", "--sleep-mode-offload-cudagraph",
           "--disable-custom-all-reduce", "--ray-workers-use-nsight",
           "--enable-layerwise-nvtx-tracing", "--cudagraph-metrics", "--jit-monitor-verbose",
           "--enable-trace-replay", "--use-fp64-gumbel", "--enable-shm-tensor-arena",
           "--disable-hybrid-kv-cache-manager", "--fail-on-environ-validation"),
    _none("--enable-expert-parallel", "-ep", kind="bool", reason=MOE),
    *_many("bool", MOE, "--enable-ep-weight-filter", "--enable-dbo", "--enable-eplb",
           "--enable-mixed-moe-lora-format", "--enable-moe-shared-loras", "--enable-hc-sp",
           "--enable-batch-sharded-sampling", "--disable-nccl-for-dp-synchronization"),
    *_many("value", MOE, "--all2all-backend", "--ubatch-size", "--dbo-decode-token-threshold",
           "--dbo-prefill-token-threshold", "--eplb-config", "--expert-placement-strategy",
           "--dp-sync-interval"),
    *_many("bool", MM, "--trust-request-mm-kwargs", "--interleave-mm-strings",
           "--skip-mm-profiling", "--mm-device-do-normalize", "--disable-chunked-mm-input",
           "--enable-mm-embeds", "--language-model-only", "--enable-tower-connector-lora",
           "--mm-encoder-only"),
    *_many("value", MM, "--allowed-local-media-path", "--mm-processor-cache-gb",
           "--mm-processor-cache-type", "--mm-hasher-algorithm", "--mm-shm-cache-max-object-size-mb",
           "--mm-encoder-tp-mode", "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype",
           "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-path",
           "--mm-encoder-fp8-scale-save-margin", "--video-pruning-rate", "--video-pruning-method",
           "--mm-tensor-ipc", "--mm-processor-device", "--mm-ipc-gpu-memory-gb",
           "--media-io-kwargs", "--mm-processor-kwargs", "--limit-mm-per-prompt",
           "--default-mm-loras", "--ec-manager-config"),
    _none("--allowed-media-domains", kind="values", reason=MM),
    *_many("bool", MAMBA, "--enable-mamba-cache-stochastic-rounding",
           "--enable-mamba-shared-prefix-checkpoint", "--use-replayssm", "--swa-bounded-replay"),
    *_many("value", MAMBA, "--mamba-backend", "--mamba-ssu-algorithm", "--mamba-cache-philox-rounds",
           "--mamba-cache-dtype", "--mamba-ssm-cache-dtype", "--mamba-block-size",
           "--mamba-cache-mode", "--replayssm-buffer-len", "--prefix-match-unit"),
    *_many("value", LOAD, "--hf-token", "--safetensors-load-strategy",
           "--safetensors-prefetch-num-threads", "--safetensors-prefetch-block-size",
           "--pt-load-map-location"),
    _none("--ignore-patterns", kind="values", reason=LOAD),
    _none("--use-tqdm-on-load", kind="bool", reason=LOAD),
    _none("--allow-deprecated-quantization", kind="bool", reason="zserve quantizes nothing"),
    *_many("value", DIST, "--master-addr", "--master-port", "--distributed-timeout-seconds",
           "--cpu-distributed-timeout-seconds", "--dcp-comm-backend",
           "--dcp-kv-cache-interleave-size", "--cp-kv-cache-interleave-size"),
    _none("--dcp-q-replicate", kind="bool", reason=DIST),
    _none("--numa-bind", kind="bool", reason="binds GPU workers to NUMA nodes; on the CPU, "
          "--engine-cpus pins each engine's threads"),
    *_many("values", "binds GPU workers to NUMA nodes; on the CPU, --engine-cpus pins each "
           "engine's threads", "--numa-bind-nodes", "--numa-bind-cpus"),
    *_many("value", DP, "--data-parallel-supervisor-port", "--dp-supervisor-probe-interval-s",
           "--dp-supervisor-probe-timeout-s", "--dp-supervisor-probe-failure-threshold"),
    _none("--enable-log-deltas", kind="bool",
          reason="only with logged outputs, and zserve logs no output text"),
    _none("--log-error-stack", kind="bool",
          reason="zserve logs an internal error's stack always, a client's 4xx never"),
    *_many("bool", "tunes vLLM's own logging and metrics; zserve's stay as they are",
           "--enable-logging-iteration-details", "--aggregate-engine-logging",
           "--kv-cache-metrics", "--enable-mfu-metrics"),
    *_many("value", "tunes vLLM's own logging and metrics; zserve's stay as they are",
           "--show-hidden-metrics-for-version", "--kv-cache-metrics-sample",
           "--per-request-spec-decode-metrics"),
    _none("--enable-offline-docs", kind="bool", reason="zserve's /docs page loads nothing"),
    _none("--enable-flash-late-interaction", kind="bool",
          reason="late-interaction scoring is not served"),
    _none("--cohere-is-reasoning-model", kind="bool", reason="Cohere's routes are not served"),
    _none("--cohere-format", reason="Cohere's routes are not served"),
    _none("--renderer-num-workers", reason="zserve tokenizes long texts in its own tokenizer "
          "processes and renders templates off the event loop"),
    _none("--prefix-caching-hash-algo", reason="zserve keys its prefix cache by its own hash "
          "of each block's tokens, LoRA and cache salt"),
    _none("--kv-cache-dtype-skip-layers", kind="values",
          reason="the KV cache is in the model's dtype everywhere"),
    _none("--fully-sharded-loras", kind="bool", reason="tunes tensor-parallel LoRA; zserve "
          "has no tensor parallelism"),
    _none("--specialize-active-lora", kind="bool", reason=GPU),
    _none("--max-lora-cls-labels", reason="LoRA adapters with a classifier head are refused"),
    _none("--offload-backend", reason="zserve offloads no weights"),
    _none("--kv-offloading-backend", reason="zserve offloads no KV cache"),
    # A value other than vLLM's default would ask for what zserve does not do.
    _only("--tool-server", reason="zserve runs no built-in tool servers"),
    _only("--tool-strict-level", accepted=("auto",),
          reason="tools are constrained as each request's tool_choice and strict say"),
    _only("--anthropic-disabled-thinking-effort", accepted=("auto",),
          reason="/v1/messages maps thinking as vLLM's default does"),
    _only("--enable-per-request-metrics", kind="bool",
          reason="responses carry no per-request timings"),
    _only("--grpc-port", reason="it serves the Rust frontend's gRPC beside HTTP; zserve's "
          "--grpc serves the gRPC door instead of HTTP"),
    _only("--hf-config-path", reason="the model's folder holds its config.json"),
    _only("--quantization-config", reason="zserve runs the checkpoint's own weights"),
    _only("--enable-return-routed-experts", kind="bool", reason=MOE),
    _only("--return-sampling-mask", kind="bool", reason="responses carry no sampling masks"),
    _only("--disable-sliding-window", kind="bool",
          reason="a sliding-window model attends as it was trained"),
    _only("--skip-tokenizer-init", kind="bool", reason="zserve detokenizes every output"),
    _only("--enable-prompt-embeds", kind="bool", reason="prompts are text or token ids"),
    _only("--model-class-overrides", accepted=("{}",), reason="zserve runs its own model classes"),
    _only("--sleep-preserve-parameter-names", kind="values",
          reason="sleep level 2 drops every weight"),
    _only("--logits-processors", kind="values", reason="zserve loads no custom logits processors"),
    _only("--io-processor-plugin", reason="zserve loads no IO processor plugins"),
    _only("--model-loader-extra-config", accepted=("{}",), reason=LOAD),
    _only("--reasoning-parser-plugin", accepted=("",),
          reason="zserve loads no reasoning parser plugins"),
    _only("--config-format", accepted=("auto", "hf"), reason="zserve reads config.json"),
    _only("--code-revision", reason="zserve runs no code shipped with a model"),
    _only("--nnodes", "-n", accepted=("1",), reason="each engine holds the whole model on one "
          "node; engines on other nodes join with --headless"),
    _only("--node-rank", "-r", accepted=("0",), reason="engines on other nodes join with "
          "--headless --data-parallel-start-rank"),
    _only("--device-ids", reason="engines take the devices --device names"),
    _only("--decode-context-parallel-size", "-dcp", accepted=("1",),
          reason="each engine holds the whole model (scale out with -dp)"),
    _only("--prefill-context-parallel-size", "-pcp", accepted=("1",),
          reason="each engine holds the whole model (scale out with -dp)"),
    _only("--data-parallel-rank", "-dpn", reason="external load balancing runs one zserve per "
          "engine: start each with its own --port"),
    _only("--data-parallel-hybrid-lb", "-dph", kind="bool", reason="every API server reaches "
          "every engine (internal load balancing)"),
    _only("--data-parallel-external-lb", "-dpe", kind="bool",
          reason="external load balancing runs one zserve per engine"),
    _only("--data-parallel-multi-port-external-lb", "-dpm", kind="bool",
          reason="external load balancing runs one zserve per engine"),
    _only("--enable-elastic-ep", kind="bool", reason=MOE),
    _only("--elastic-ep-max-dp-size", reason=MOE),
    _only("--worker-cls", accepted=("auto",), reason="zserve's engines run their own workers"),
    _only("--worker-extension-cls", accepted=("",),
          reason="zserve's engines load no worker extensions"),
    _only("--enable-fault-tolerance", kind="bool",
          reason="a dead engine fails its requests and the server (README: operations)"),
    _only("--fault-tolerance-config",
          reason="a dead engine fails its requests and the server (README: operations)"),
    _only("--num-gpu-blocks-override", reason="size the KV cache with --kv-cache-memory-bytes"),
    _only("--prefix-cache-retention-interval", accepted=("0",),
          reason="cached blocks are evicted least recently used first"),
    _only("--kv-sharing-fast-prefill", kind="bool", reason="every layer keeps its own KV"),
    _only("--kv-offloading-size", reason="zserve offloads no KV cache"),
    _only("--cpu-offload-gb", accepted=("0",), reason="zserve offloads no weights"),
    _only("--cpu-offload-params", kind="values", reason="zserve offloads no weights"),
    *[_only(n, accepted=(d,), reason="zserve offloads no weights")
      for n, d in (("--offload-group-size", "0"), ("--offload-num-in-group", "1"),
                   ("--offload-prefetch-step", "1"))],
    _only("--offload-params", kind="values", reason="zserve offloads no weights"),
    _only("--lora-dtype", accepted=("auto",), reason="adapters run in the model's dtype"),
    _only("--lora-target-modules", kind="values",
          reason="each adapter applies to the modules its own config names"),
    _only("--logging-config", reason="zserve's log lines have their own format (--log-level)"),
    _only("--log-config-file", reason="zserve's log lines have their own format (--log-level)"),
    _only("--custom-histogram-buckets", reason="/metrics keeps vLLM's default buckets"),
    _only("--max-num-scheduled-tokens", reason="a step schedules --max-num-batched-tokens"),
    _only("--max-num-active-seqs", reason="--max-num-seqs bounds the running requests"),
    _only("--long-prefill-token-threshold-adaptive", kind="bool",
          reason="--long-prefill-token-threshold is fixed"),
    _only("--scheduler-cls", reason="zserve's engines run their own scheduler"),
    _only("--scheduler-reserve-full-isl", kind="bool", accepted=("true",),
          reason="a request is admitted once its prompt's blocks fit"),
    _only("--watermark", accepted=("0", "0.0"), reason="the scheduler keeps no KV watermark"),
    _only("--prefill-schedule-interval", accepted=("1",),
          reason="every step schedules waiting prompts"),
    *[_only(n, reason="speculative decoding is not supported")
      for n in ("--spec-method", "--spec-model", "--spec-tokens")],
    _only("--speculative-config", "-sc", reason="speculative decoding is not supported"),
    *[_only(n, reason="that subsystem is not in zserve")
      for n in ("--watermark-config", "--kv-transfer-config", "--kv-events-config",
                "--ec-transfer-config", "--engram-config", "--reasoning-config",
                "--aux-output-config", "--weight-transfer-config")],
    _only("--diffusion-config", "-dc", reason="zserve runs no diffusion models"),
    _only("--additional-config", accepted=("{}",), reason="zserve has no platform plugins"),
]  # fmt: skip


def add_negative_forms(p: argparse.ArgumentParser) -> None:
    """vLLM's boolean flags all take a --no- form: zserve's on-switches take it too."""
    known = {o for a in p._actions for o in a.option_strings}
    for action in list(p._actions):
        if not isinstance(action, argparse._StoreTrueAction):
            continue
        names = [f"--no-{o[2:]}" for o in action.option_strings if o.startswith("--")]
        names = [n for n in names if n not in known]
        if names:
            p.add_argument(*names, dest=action.dest, action="store_false", help=argparse.SUPPRESS)


def add_vllm_flag_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "other vLLM flags",
        "vLLM's flags for machinery zserve does not have: 'no effect' ones take any value "
        "(logged at start); the others take vLLM's default only (launcher/vllm_flags.py)",
    )
    for flag in FLAGS:
        if flag.accepted is None:
            help = f"no effect: {flag.reason}"
        elif flag.kind == "bool":
            help = f"false only: {flag.reason}"
        elif flag.accepted:
            help = f"{' or '.join(repr(v) for v in flag.accepted)} only: {flag.reason}"
        else:
            help = f"unset only: {flag.reason}"
        kwargs: dict = {"dest": flag.dest, "default": None, "help": help}
        if flag.kind == "bool":
            g.add_argument(*flag.names, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            g.add_argument(*flag.names, nargs="+" if flag.kind == "values" else None, **kwargs)


def vllm_flag_refusal(args: argparse.Namespace) -> str | None:
    """Why a flag here cannot start zserve as given; None: they all can."""
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if value is None or flag.accepted is None:
            continue
        given = str(value).lower() if flag.kind == "bool" else value
        if flag.kind == "values" or given not in flag.accepted:
            return f"{_as_given(flag, value)} is not supported: {flag.reason}"
    return None


def log_no_effect(args: argparse.Namespace) -> None:
    """One line for each flag here that is set: what it means in zserve."""
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if value is None:
            continue
        if flag.accepted is None:
            log.info("%s: no effect: %s", flag.names[0], flag.reason)
        else:
            log.info(
                "%s: vLLM's default, which zserve keeps: %s", _as_given(flag, value), flag.reason
            )


def _as_given(flag: VllmFlag, value: object) -> str:
    name = flag.names[0]
    if flag.kind == "bool":
        return name if value else "--no-" + name.removeprefix("--")
    return f"{name} {' '.join(value) if isinstance(value, list) else value}"
