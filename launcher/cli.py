"""The `zserve` command: `serve`, `make-tiny-model`, `make-engine-keys`, `bench …`.

Each subcommand lives in its own module, which adds its parser with
`add_parser(subparsers)` and is imported lazily: `zserve serve` must not pay for
(or drag into its API-server children) what `zserve bench` imports.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.cli import add_parser as add_bench
    from launcher.make_engine_keys import add_parser as add_keys
    from launcher.serve_args import add_parser as add_serve
    from launcher.tiny_model import add_parser as add_tiny

    parser = argparse.ArgumentParser(
        prog="zserve",
        description="An OpenAI-compatible LLM server: N API servers and M engine cores over ZMQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve(sub)
    add_tiny(sub)
    add_keys(sub)
    add_bench(sub)
    parser.subcommands = sub.choices  # name → its parser
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":  # vLLM's --config FILE.yaml
        from launcher.config_file import ConfigFileError, expand_config_file

        serve = parser.subcommands["serve"]
        try:
            argv = ["serve", *expand_config_file(argv[1:], serve)]
        except ConfigFileError as e:
            serve.error(str(e))
    args = parser.parse_args(argv)
    code = args.run(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
