"""`zserve bench ipc`: the engine ↔ API-server data plane without a model.

Per transport (ipc://, tcp://, tcp:// with CURVE) and message kind, a sender process
encodes and sends as fast as it can and this process receives and decodes:
- EngineCoreOutputs of 1–512 outputs, one new token each (a decode step), engine → API
  server over PUSH → PULL;
- one ADD of an EngineCoreRequest with a long prompt, API server → engine over
  ROUTER → DEALER.
Reported: µs per message and per output through the whole pipeline, MB/s, and the
in-process encode/decode cost alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import zmq

from protocol import codec, sockets
from protocol.keys import start_authenticator
from protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    SamplingParams,
    SchedulerStats,
)

TRANSPORTS = ("ipc", "tcp", "tcp-curve")
_VOCAB = 128_256  # a Llama-3-sized vocabulary: token ids of 1, 3 and 5 msgpack bytes
_WARMUP = 20


@dataclass(frozen=True)
class Case:
    """One message kind: a batch of `outputs` decode outputs, or one request of `prompt_len`."""

    outputs: int = 0
    prompt_len: int = 0

    @property
    def name(self) -> str:
        return f"outputs x{self.outputs}" if self.outputs else f"request {self.prompt_len} tok"

    def message(self) -> EngineCoreOutputs | EngineCoreRequest:
        rng = random.Random(0)
        if self.outputs:
            return EngineCoreOutputs(
                engine_index=0,
                outputs=[
                    EngineCoreOutput(
                        request_id=f"cmpl-{rng.getrandbits(128):032x}-0-{i:08x}",
                        new_token_ids=[rng.randrange(_VOCAB)],
                    )
                    for i in range(self.outputs)
                ],
                scheduler_stats=SchedulerStats(num_running=self.outputs, kv_cache_usage=0.5),
                timestamp=time.time(),
            )
        return EngineCoreRequest(
            request_id=f"cmpl-{rng.getrandbits(128):032x}-0-00000000",
            prompt_token_ids=[rng.randrange(_VOCAB) for _ in range(self.prompt_len)],
            sampling_params=SamplingParams(max_tokens=128, temperature=0.0),
            arrival_time=time.time(),
        )

    def frames(self, msg: EngineCoreOutputs | EngineCoreRequest) -> list[bytes]:
        """What goes on the wire, as the engine's output thread / the engine client send it."""
        if self.outputs:
            return [codec.encode(msg)]
        return codec.encode_request(RequestType.ADD, msg)

    def decode(self, frames: list[bytes]) -> int:
        """Decode as the receiving side does; the number of outputs (or prompt tokens)."""
        if self.outputs:
            return len(codec.decode_outputs(frames[0]).outputs)
        _, request = codec.decode_request(frames)
        return len(request.prompt_token_ids)


@dataclass(frozen=True)
class Row:
    transport: str
    message: str
    outputs_per_message: int
    bytes_per_message: int
    messages: int
    us_per_message: float
    us_per_output: float | None
    messages_per_s: float
    mb_per_s: float
    encode_us: float
    decode_us: float


def codec_cost_us(case: Case, repeat: int = 200) -> tuple[float, float]:
    """In-process µs to encode and to decode one message (no sockets)."""
    msg = case.message()
    frames = case.frames(msg)
    t = time.perf_counter()
    for _ in range(repeat):
        case.frames(msg)
    encode = (time.perf_counter() - t) / repeat
    t = time.perf_counter()
    for _ in range(repeat):
        case.decode(frames)
    decode = (time.perf_counter() - t) / repeat
    return encode * 1e6, decode * 1e6


def _keys(transport: str) -> sockets.CurveKeys | None:
    if transport != "tcp-curve":
        return None
    public, secret = zmq.curve_keypair()
    return sockets.CurveKeys(public, secret)


def _sender(address: str, case: Case, count: int, keys: sockets.CurveKeys | None, conn: Connection):
    """Child process: connect, encode and send `count` messages, report the send time."""
    ctx = zmq.Context()
    kind = zmq.PUSH if case.outputs else zmq.ROUTER
    sock = sockets.make_socket(ctx, kind, curve=keys, linger_ms=-1)
    if not case.outputs:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.connect(address)
    msg = case.message()
    identity = sockets.rank_identity(0)
    if not case.outputs:
        # A ROUTER can only address a peer once the connection is up: retry the first send.
        while True:
            try:
                sock.send_multipart([identity, *case.frames(msg)])
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                time.sleep(0.005)
        count -= 1
    start = time.perf_counter()
    for _ in range(count):
        frames = case.frames(msg)
        sock.send_multipart(frames if case.outputs else [identity, *frames])
    conn.send(time.perf_counter() - start)
    conn.recv()  # the receiver is done: the queue is drained, closing loses nothing
    sock.close()
    ctx.term()


def _address(transport: str, tmpdir: str) -> str:
    if transport == "ipc":
        return sockets.ipc_address(tmpdir, "bench-ipc")
    return sockets.tcp_address("127.0.0.1", 0)


def measure(transport: str, case: Case, count: int, tmpdir: str) -> Row:
    """Run one sender process against a receiver here; time the receiving side."""
    keys = _keys(transport)
    ctx = zmq.Context()
    auth = start_authenticator(ctx, keys) if keys else None  # as zserve's API servers do
    kind = zmq.PULL if case.outputs else zmq.DEALER
    identity = None if case.outputs else sockets.rank_identity(0)
    sock = sockets.make_socket(ctx, kind, curve=keys, curve_server=True, identity=identity)
    address = sockets.bind(sock, _address(transport, tmpdir))
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(address, case, count + _WARMUP, keys, child), daemon=True
    )
    proc.start()
    try:
        nbytes = 0
        for i in range(count + _WARMUP):
            frames = sock.recv_multipart(copy=True)
            if i == _WARMUP:
                start = time.perf_counter()
            case.decode(frames)
            nbytes += sum(len(f) for f in frames) if i >= _WARMUP else 0
        elapsed = time.perf_counter() - start
        parent.recv()
        parent.send(True)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        sock.close()
        if auth is not None:
            auth.stop()
        ctx.term()
    encode_us, decode_us = codec_cost_us(case)
    per_msg = elapsed / count
    return Row(
        transport=transport,
        message=case.name,
        outputs_per_message=case.outputs,
        bytes_per_message=nbytes // count,
        messages=count,
        us_per_message=per_msg * 1e6,
        us_per_output=per_msg * 1e6 / case.outputs if case.outputs else None,
        messages_per_s=1.0 / per_msg,
        mb_per_s=nbytes / elapsed / 1e6,
        encode_us=encode_us,
        decode_us=decode_us,
    )


def message_count(case: Case, seconds: float) -> int:
    """Messages for about `seconds` of pipeline time, from the codec's own cost."""
    encode_us, decode_us = codec_cost_us(case, repeat=20)
    per_msg_s = max(encode_us, decode_us, 5.0) * 2e-6
    return max(50, min(200_000, int(seconds / per_msg_s)))


def format_rows(rows: list[Row]) -> str:
    lines = [
        f"{'transport':<10} {'message':<20} {'bytes':>9} {'µs/msg':>9} {'µs/output':>10} "
        f"{'msg/s':>10} {'MB/s':>8} {'enc µs':>8} {'dec µs':>8}"
    ]
    for r in rows:
        per_out = f"{r.us_per_output:.3f}" if r.us_per_output is not None else "-"
        lines.append(
            f"{r.transport:<10} {r.message:<20} {r.bytes_per_message:>9} "
            f"{r.us_per_message:>9.1f} {per_out:>10} {r.messages_per_s:>10.0f} "
            f"{r.mb_per_s:>8.1f} {r.encode_us:>8.1f} {r.decode_us:>8.1f}"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "ipc",
        help="model-free encode → ZMQ → decode of engine outputs and requests",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=f"comma list of {', '.join(TRANSPORTS)}"
    )
    parser.add_argument(
        "--batch-sizes", type=_ints, default=[1, 8, 32, 128, 512], help="outputs per message"
    )
    parser.add_argument(
        "--prompt-lens", type=_ints, default=[8192], help="prompt tokens per request message"
    )
    parser.add_argument("--seconds", type=float, default=0.5, help="target time per measurement")
    parser.add_argument("--output-json", help="write the rows as JSON here")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        print(f"zserve bench ipc: unknown transport(s) {', '.join(sorted(unknown))}")
        return 2
    cases = [Case(outputs=n) for n in args.batch_sizes]
    cases += [Case(prompt_len=n) for n in args.prompt_lens]
    rows = []
    with tempfile.TemporaryDirectory(prefix="zserve-bench-ipc-") as tmpdir:
        for transport in transports:
            for case in cases:
                rows.append(measure(transport, case, message_count(case, args.seconds), tmpdir))
                print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_rows(rows))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0
