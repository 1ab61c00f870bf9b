"""`zserve bench frontend`: how many SSE tokens/s zserve's API servers deliver when the
engine costs almost nothing, beside a bare Starlette SSE server (the stack's limit).

The engine serves a tiny (~115k-parameter) model, so a step costs about a
millisecond and the API servers, not the forward, set the pace. The load generator
runs on the same machine; both servers face the same client, so the ratio is the
figure to read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.client import Endpoint
from benchmarks.datasets import SampleRequest
from benchmarks.load import LoadPlan, run_load
from benchmarks.serve import run_async
from benchmarks.serve_args import int_list
from benchmarks.stats import compute_metrics


@dataclass
class Row:
    server: str
    api_servers: int
    concurrency: int
    completed: int
    failed: int
    output_tok_s: float
    per_api_server_tok_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    ttft_p50_ms: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A server subprocess in its own process group."""

    def __init__(self, command: list[str], ready_path: str, port: int) -> None:
        self.port = port
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read()[-2000:].decode()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server not ready in 300 s")
            time.sleep(0.3)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


def _requests(n: int, output_len: int) -> list[SampleRequest]:
    """Eight ASCII characters: eight tokens with the tiny byte-level tokenizer."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [
        SampleRequest(
            prompt="".join(letters[(i + j) % 26] for j in range(8)),
            prompt_len=8,
            output_len=output_len,
        )
        for i in range(n)
    ]


def _measure(
    name: str, api_servers: int, port: int, model: str, concurrency: int, args: argparse.Namespace
) -> Row:
    requests = _requests(max(concurrency * args.rounds, 64), args.output_len)
    endpoint = Endpoint(
        api_url=f"http://127.0.0.1:{port}/v1/completions",
        model=model,
        chat=False,
        headers={"Content-Type": "application/json"},
        ignore_eos=True,
        temperature=None,
        extra_body={},
    )
    plan = LoadPlan(max_concurrency=concurrency, progress=False, request_timeout_s=600)
    load = run_async(run_load(endpoint, requests[: min(64, len(requests))], plan))  # warm-up
    load = run_async(run_load(endpoint, requests, plan))
    m = compute_metrics(load.results, load.duration, [50, 99], {})
    return Row(
        name,
        api_servers,
        concurrency,
        m.completed,
        m.failed,
        round(m.output_throughput, 1),
        round(m.output_throughput / api_servers, 1),
        round(m.itl.percentiles[50], 2),
        round(m.itl.percentiles[99], 2),
        round(m.ttft.percentiles[50], 2),
    )


def _tiny_model(path: str | None) -> str:
    if path:
        return path
    out = Path(tempfile.gettempdir()) / "zserve-bench-frontend-tiny"
    if not (out / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "launcher.cli", "make-tiny-model", str(out), "--force"],
            check=True,
            capture_output=True,
        )
    return str(out)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "frontend",
        help="SSE tokens/s per API server with a near-free engine, beside bare Starlette",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--model", help="tiny model folder (default: built once in the temp dir)")
    p.add_argument("--api-server-counts", type=int_list, default=[1, 2, 4])
    p.add_argument("--concurrency", type=int_list, default=[64, 256, 1000, 2000])
    p.add_argument("--output-len", type=int, default=64, help="tokens per stream")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream slot")
    p.add_argument("--skip-bare", action="store_true", help="do not measure bare Starlette")
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    model_dir = _tiny_model(args.model)
    rows: list[Row] = []
    if not args.skip_bare:
        port = _free_port()
        server = _Server(
            [sys.executable, "-m", "benchmarks.bare_sse", "--port", str(port)], "/v1/models", port
        )
        try:
            for c in args.concurrency:
                rows.append(_measure("bare-starlette", 1, port, "bare-sse", c, args))
                print(_format([rows[-1]], header=len(rows) == 1), flush=True)
        finally:
            server.stop()
    for n in args.api_server_counts:
        port = _free_port()
        server = _Server(
            [
                sys.executable,
                "-m",
                "launcher.cli",
                "serve",
                model_dir,
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--served-model-name",
                "tiny",
                "--api-server-count",
                str(n),
                "--max-num-seqs",
                str(max(args.concurrency)),
                "--max-num-batched-tokens",
                "32768",
                "--kv-cache-memory-bytes",
                "512MiB",
                "--disable-log-requests",
                "--disable-log-stats",
            ],
            "/health",
            port,
        )
        try:
            for c in args.concurrency:
                rows.append(_measure("zserve", n, port, "tiny", c, args))
                print(_format([rows[-1]], header=len(rows) == 1), flush=True)
        finally:
            server.stop()
    print()
    print(_format(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


def _format(rows: list[Row], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(
            f"{'server':<15} {'API':>3} {'conc':>5} {'ok':>6} {'fail':>4} "
            f"{'tok/s':>9} {'tok/s/API':>10} {'ITL p50':>8} {'ITL p99':>8} "
            f"{'TTFT p50':>9}"
        )
    for r in rows:
        lines.append(
            f"{r.server:<15} {r.api_servers:>3} {r.concurrency:>5} {r.completed:>6} "
            f"{r.failed:>4} {r.output_tok_s:>9.0f} {r.per_api_server_tok_s:>10.0f} "
            f"{r.itl_p50_ms:>8.1f} {r.itl_p99_ms:>8.1f} {r.ttft_p50_ms:>9.1f}"
        )
    return "\n".join(lines)
