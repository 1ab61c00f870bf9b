"""`zserve make-engine-keys [DIR]`: create a deployment's CURVE key pair ahead of time,
for operators who ship the keys (a Kubernetes Secret, a copy on every worker) before
any node starts; otherwise the head creates them on first use."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from protocol.keys import (
    EngineKeysError,
    create_keys,
    default_keys_dir,
    public_file,
    secret_file,
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `zserve make-engine-keys [DIR] [--force]`."""
    parser = subparsers.add_parser(
        "make-engine-keys",
        help="create the CURVE key pair that secures engine links between nodes",
        description="Create the key pair every node of a multi-node deployment shares "
        "(`zserve serve --engine-keys DIR`): the secret file mode 0600 in a 0700 folder.",
    )
    parser.add_argument(
        "dir",
        metavar="DIR",
        type=Path,
        nargs="?",
        default=None,
        help=f"folder for the keys (default: {default_keys_dir()})",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace existing keys (every node then needs the new ones)",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """The `make-engine-keys` command; returns the exit code."""
    directory = args.dir or default_keys_dir()
    existing = [f for f in (secret_file(directory), public_file(directory)) if f.exists()]
    if existing and not args.force:
        print(
            f"zserve make-engine-keys: error: {existing[0]} exists; pass --force to replace "
            f"the keys (every node then needs the new ones)",
            file=sys.stderr,
        )
        return 1
    try:
        keys = create_keys(directory, overwrite=True)
    except (OSError, EngineKeysError) as e:
        print(f"zserve make-engine-keys: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote the engine key pair to {directory} (public key {keys.public.decode()})")
    print(
        f"give every node a copy of {secret_file(directory).name} (mode 0600) and pass "
        f"--engine-keys {directory}"
    )
    return 0
