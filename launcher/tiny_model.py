"""`zserve make-tiny-model`: random-weight model folders, built offline and deterministically.

Two sizes. `tiny` (~115k parameters, fp32) is for tests: a byte-level tokenizer whose token id
is the byte value (specials 256-258; embedding rows 259-319 are unused padding, as in real
checkpoints, and can still be sampled), and one variant per supported architecture. `small`
(19.7M parameters, bf16) is the benchmark model and `zserve serve`'s default: a Llama with a
byte-level BPE trained on the running interpreter's stdlib sources, the shape the peer servers
were measured on.

torch, transformers and tokenizers are imported inside functions: `launcher.cli` imports this
module only to register its parser, and API-server processes must never import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.chat_templates import CHATML_TOOLS

logger = logging.getLogger(__name__)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2")
SIZES = ("tiny", "small")
DEFAULT_MODEL_NAME = "small-llama"
_CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class _Recipe:
    """What one size is made of: tokens, template, config shape, saved dtype."""

    specials: tuple[str, ...]  # in id order (the tiny tokenizer puts them after the 256 bytes)
    bos: str | None
    eos: str
    pad: str
    stop: tuple[str, ...]  # generation_config's eos_token_id
    chat_template: str
    config: dict[str, Any]
    dtype: str


_TINY = _Recipe(
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stop=("<|im_end|>",),
    chat_template=CHATML_TOOLS,
    config=dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        # Peaked logits: top-1/top-2 margins stay far above fp32 kernel differences, so greedy
        # comparisons against transformers are robust.
        initializer_range=0.2,
    ),
    dtype="float32",
)

_SMALL = _Recipe(
    specials=("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"),
    bos="<s>",
    eos="</s>",
    pad="<pad>",
    stop=("</s>", "<|im_end|>"),
    chat_template="{{- bos_token -}}\n" + CHATML_TOOLS,
    config=dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    dtype="bfloat16",
)

# What each tiny variant adds to the shared shape: the feature the engine must get right.
_TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},  # Qwen2 attention always has QKV bias
    "qwen3": {"head_dim": 16},  # q/k RMSNorm is built in
    "mistral": {"sliding_window": 16},
    "phi3": {"original_max_position_embeddings": 1024},  # fused qkv_proj / gate_up_proj
    "gemma2": {
        "head_dim": 16,
        # Extreme on purpose: an engine that ignores the attention softcap gives other tokens.
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        # scaling = 64**-0.5, not head_dim**-0.5
        "query_pre_attn_scalar": 64,
    },
}


def build_tiny_model(
    out_dir: str | os.PathLike[str], arch: str = "llama", size: str = "tiny", *, force: bool = False
) -> Path:
    """Build a random-weight model folder at `out_dir`, offline, and return its path.

    The folder appears complete or not at all: it is built in a hidden staging folder beside
    `out_dir` and renamed into place. An existing non-empty `out_dir` is an error unless `force`.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if size == "small" and arch != "llama":
        raise ValueError("size 'small' exists only for arch 'llama'")
    out = Path(out_dir)
    if not force and is_occupied(out):
        raise FileExistsError(f"{out} already exists; use --force to replace it")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        _write_model_folder(staging, arch, size)
        os.chmod(staging, 0o755)
        move_into_place(staging, out, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def default_model_dir() -> Path:
    """Where `zserve serve` without a MODEL keeps its default model (the small llama)."""
    cache = os.environ.get("XDG_CACHE_HOME")
    root = Path(cache) if cache else Path.home() / ".cache"
    return root / "zserve" / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Return the default model's folder, building it the first time (once, under a file lock)."""
    out = default_model_dir()
    if is_occupied(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_occupied(out):  # another process may have built it while we waited
            logger.info("building the default model (random weights) into %s", out)
            build_tiny_model(out, arch="llama", size="small")
    return out


def is_occupied(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def move_into_place(staging: Path, out: Path, force: bool) -> None:
    # rename(2) replaces an empty directory atomically and refuses a non-empty one, so of two
    # concurrent builders exactly one wins, and `out` is never seen half-written.
    old = None
    if force and out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError as exc:
        if old is not None and not out.exists():
            os.rename(old, out)
            old = None
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(
                f"{out} appeared while building; use --force to replace it"
            ) from exc
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _write_model_folder(folder: Path, arch: str, size: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    recipe = _SMALL if size == "small" else _TINY
    tokenizer = _wrap_tokenizer(
        _trained_bpe(recipe) if size == "small" else _byte_tokenizer(recipe), recipe
    )
    tokenizer.save_pretrained(folder)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in recipe.specials}

    config_kwargs = recipe.config | (_TINY_VARIANTS[arch] if size == "tiny" else {})
    config = AutoConfig.for_model(
        arch,
        **config_kwargs,
        bos_token_id=ids.get(recipe.bos),
        eos_token_id=ids[recipe.eos],
        pad_token_id=ids[recipe.pad],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, recipe.dtype))
    stop = [ids[token] for token in recipe.stop]
    model.generation_config = GenerationConfig(
        bos_token_id=ids.get(recipe.bos),
        eos_token_id=stop[0] if len(stop) == 1 else stop,
        pad_token_id=ids[recipe.pad],
    )
    with progress_bars_off():
        model.save_pretrained(folder)
    _add_legacy_fields(folder, recipe)


@contextlib.contextmanager
def progress_bars_off() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _byte_to_symbol() -> list[str]:
    """The ByteLevel alphabet in byte order: printable Latin-1 bytes stand for themselves, the
    rest are shifted past 255 (GPT-2's scheme), so the symbol at index b encodes byte b."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def _byte_tokenizer(recipe: _Recipe):
    """An untrained byte-level BPE: token id = byte value, specials from 256 on."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_to_symbol())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in recipe.specials]
    )
    return tokenizer


def _stdlib_sources() -> list[str]:
    # Every CPython ships them, so training needs no download; the vocabulary therefore
    # depends on the interpreter's version (the peers' model was trained on 3.11's).
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for d in ("", "json", "email", "asyncio") for f in sorted((stdlib / d).glob("*.py"))]
    if not files:
        raise RuntimeError(f"no Python sources under {stdlib} to train the tokenizer on")
    return [str(f) for f in files]


def _trained_bpe(recipe: _Recipe):
    """A byte-level BPE trained on the stdlib sources; adds bos in front of every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.config["vocab_size"],
        min_frequency=2,
        special_tokens=list(recipe.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(_stdlib_sources(), trainer)
    bos = recipe.bos
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    return tokenizer


def _wrap_tokenizer(tokenizer, recipe: _Recipe):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=recipe.bos,
        eos_token=recipe.eos,
        pad_token=recipe.pad,
        extra_special_tokens=_CHAT_TOKENS,
        model_max_length=recipe.config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = recipe.chat_template
    return wrapped


def _add_legacy_fields(folder: Path, recipe: _Recipe) -> None:
    """Add the fields transformers < 5.20 (vLLM's CPU build) reads beside what 5.24 writes.

    5.24 writes `tokenizer_class: TokenizersBackend`, keeps the template only in
    chat_template.jinja, writes no special_tokens_map.json and nests rope_theta.
    """
    tokens = {"bos_token": recipe.bos, "eos_token": recipe.eos, "pad_token": recipe.pad}
    tokens = {key: value for key, value in tokens.items() if value is not None}
    extras = {"additional_special_tokens": _CHAT_TOKENS}
    _update_json(
        folder / "tokenizer_config.json",
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=recipe.chat_template,
        add_bos_token=recipe.bos is not None,
        add_eos_token=False,
        **extras,
    )
    _write_json(folder / "special_tokens_map.json", tokens | extras)
    config = json.loads((folder / "config.json").read_text())
    _update_json(
        folder / "config.json",
        rope_theta=config.get("rope_parameters", {}).get("rope_theta", 10000.0),
        torch_dtype=recipe.dtype,
    )


def _update_json(path: Path, **fields: Any) -> None:
    _write_json(path, json.loads(path.read_text()) | fields)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `zserve make-tiny-model DIR [--arch A] [--size S] [--force]`."""
    from launcher.tiny_lora import LORA_TARGETS

    parser = subparsers.add_parser(
        "make-tiny-model",
        help="build a random-weight model folder offline (for tests and benchmarks)",
        description="Build a random-weight model folder offline and deterministically: "
        "'tiny' (~115k parameters, any arch) for tests, 'small' (19.7M, llama) for benchmarks.",
    )
    parser.add_argument("dir", metavar="DIR", type=Path, help="folder to create")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists")
    g = parser.add_argument_group(
        "LoRA", "random adapters in PEFT's format for the model at DIR (built first if missing)"
    )
    g.add_argument(
        "--lora",
        metavar="LORA_DIR",
        type=Path,
        action="append",
        default=[],
        help="write an adapter here (repeatable: the n-th one is seeded --lora-seed + n)",
    )
    g.add_argument("--lora-rank", type=int, default=8)
    g.add_argument("--lora-alpha", type=float, default=16.0)
    g.add_argument("--lora-seed", type=int, default=0)
    g.add_argument("--lora-targets", choices=list(LORA_TARGETS), default="all")
    g.add_argument("--lora-rslora", action="store_true", help="use_rslora: alpha / sqrt(rank)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """The `make-tiny-model` command; returns the exit code."""
    from launcher.tiny_lora import build_tiny_lora

    existing = args.lora and (args.dir / "config.json").is_file() and not args.force
    try:
        if existing:
            out = args.dir
        else:
            out = build_tiny_model(args.dir, arch=args.arch, size=args.size, force=args.force)
            print(f"wrote a {args.size} {args.arch} model to {out}")
            print(
                "its weights are random: it produces gibberish, and is meant for tests and "
                "benchmarks"
            )
        for i, lora_dir in enumerate(args.lora):
            adapter = build_tiny_lora(
                out,
                lora_dir,
                seed=args.lora_seed + i,
                rank=args.lora_rank,
                alpha=args.lora_alpha,
                targets=args.lora_targets,
                use_rslora=args.lora_rslora,
                force=args.force,
            )
            print(f"wrote a rank-{args.lora_rank} LoRA adapter for {out} to {adapter}")
    except (ValueError, FileExistsError) as exc:
        print(f"zserve make-tiny-model: error: {exc}", file=sys.stderr)
        return 2
    return 0
