"""Grammar compiles in a child process, so that an overdue one can be stopped.

xgrammar cannot be interrupted and Python cannot stop a thread: a constraint that
compiles for minutes (a 12 KB regex, "(a|a)*" 2,000 times, takes about 2.5 min at an
8k vocabulary) would hold its compile thread and a core long after its request was
refused, and a client could send one such constraint after another. So each compile
thread of GrammarService owns a CompileProcess: a child (`python -m
engine_core.grammar_process`, no multiprocessing, so no re-import of the caller's
main module) with its own xgrammar compiler over the engine's TokenizerInfo. The
thread sends it one constraint at a time and waits until the constraint's deadline;
at the deadline it kills the child and starts the next one at once (its start-up,
~1.4 s of importing xgrammar and torch, then passes before the next compile). The
compiled grammar comes back as xgrammar's JSON serialization (a typical schema at an
8k vocabulary: ~100 KB, 3 ms out and 1.3 ms in, beside its 2 ms compile). A crash
inside xgrammar ends only the child (and the request it compiled for); the child ends
with the thread that started it (PR_SET_PDEATHSIG), so with the engine.

The pipe's frames: a 4-byte little-endian length, then the payload. Parent → child:
the TokenizerInfo's JSON once, then msgpack-encoded StructuredOutputs. Child → parent:
b"+" and the compiled grammar's JSON, or b"-" and the client's error message.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import xgrammar as xgr

from engine_core.grammar_compiler import GrammarError, compile_constraint
from protocol.messages import StructuredOutputs
from protocol.process_life import die_with_parent, name_process

logger = logging.getLogger(__name__)

_POLL_S = 0.25  # how often a wait looks again at a deadline that may have moved
_LEN = struct.Struct("<I")
_ROOT = str(Path(__file__).resolve().parent.parent)  # where engine_core and protocol live


class CompileTimeout(Exception):
    """The deadline passed before the child answered; the child was killed."""


class CompileProcess:
    """One compile thread's child. One owner thread, one compile at a time."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        self._info = tokenizer_info
        self._info_json = tokenizer_info.serialize_json().encode()
        self._proc: subprocess.Popen | None = None
        self._fresh = False  # started, but not yet sent the vocabulary
        self.num_started = 0

    @property
    def pid(self) -> int | None:
        """The running child's, if one runs."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the child now if none runs (its start-up, ~1.4 s, is then off the first
        compile's clock). Returns at once: the vocabulary goes with the first compile."""
        if self._proc is not None:
            return
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p
        ))  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_core.grammar_process", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # select() then sees every byte the child sent
            env=env,
            close_fds=True,
        )
        self._proc = proc
        self._fresh = True
        self.num_started += 1

    def compile(
        self, spec: StructuredOutputs, deadline: Callable[[], float]
    ) -> xgr.CompiledGrammar:
        """`spec` compiled by the child; GrammarError when it is invalid or the child
        died on it; CompileTimeout once time.monotonic() passes deadline() (which may
        move later while it waits), the child then killed."""
        try:
            self.start()
            if self._fresh:  # blocks until the child has imported xgrammar and reads it
                _write(self._proc.stdin, self._info_json)
                self._fresh = False
            _write(self._proc.stdin, msgspec.msgpack.encode(spec))
            out = self._proc.stdout
            while not select.select([out], [], [], _wait(deadline))[0]:
                if time.monotonic() >= deadline():
                    self.restart()
                    raise CompileTimeout
            reply = _read(out)
        except OSError:
            reply = None
        if not reply:  # the child is gone (crashed, or killed from outside)
            self.restart()
            raise GrammarError(
                f"{spec.field}: the constraint could not be compiled (the compiler crashed)"
            )
        if reply[:1] == b"-":
            raise GrammarError(reply[1:].decode())
        return xgr.CompiledGrammar.deserialize_json(reply[1:].decode(), self._info)

    def restart(self) -> None:
        """Kill the child and start the next one now, so that its start-up does not
        count against the next compile's deadline."""
        self.close()
        try:
            self.start()
        except OSError:
            logger.exception("could not start a grammar compile process")

    def close(self) -> None:
        """Kill the child (a compile it runs is lost) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(5)
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _wait(deadline: Callable[[], float]) -> float:
    return min(_POLL_S, max(0.0, deadline() - time.monotonic()))


def _write(pipe, payload: bytes) -> None:
    data = memoryview(_LEN.pack(len(payload)) + payload)
    while data:
        data = data[pipe.write(data) or 0 :]  # a raw pipe may take part of it
    pipe.flush()


def _read(pipe) -> bytes | None:
    """One frame, or None at the end of the stream."""
    head = _read_exactly(pipe, _LEN.size)
    return None if head is None else _read_exactly(pipe, _LEN.unpack(head)[0])


def _read_exactly(pipe, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        part = pipe.read(left)  # the parent's pipe is unbuffered: reads may come short
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _child_main(parent_pid: int) -> None:
    """Compile what comes on stdin, answer on stdout, until stdin closes."""
    die_with_parent(parent_pid)
    name_process("zserve-grammar")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the engine decides
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # whatever else prints must not corrupt the frames
    info_json = _read(stdin)
    if info_json is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(info_json.decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    decoder = msgspec.msgpack.Decoder(StructuredOutputs)
    while (frame := _read(stdin)) is not None:
        spec = decoder.decode(frame)
        try:
            reply = b"+" + compile_constraint(compiler, info, spec).serialize_json().encode()
        except GrammarError as e:
            reply = b"-" + str(e).encode()
        except Exception as e:  # compile_constraint already words xgrammar's own errors
            reply = (
                b"-" + f"{spec.field}: the constraint could not be compiled ({e!r:.200})".encode()
            )
        _write(stdout, reply)


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
