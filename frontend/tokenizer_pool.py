"""Long texts are tokenized in worker processes, never on the serving loop's thread.

`tokenizers` holds the GIL for a whole encode (about half a microsecond per
character here), so a thread does not help: a 5 MB prompt encoded in a thread froze
every other coroutine of the API server for seconds. Each worker is a small spawned
process holding a copy of the tokenizer; a thread of ours waits on its pipe (the wait
releases the GIL), so /health and every other stream keep running meanwhile. Work is
bounded: at most `max_pending` long texts wait, and an encode that takes longer than
`timeout_s` kills its worker (a fresh one takes its place) and fails the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import signal
import struct
from array import array
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from frontend.errors import APIError

log = logging.getLogger("zserve.tokenizer")

# Texts up to this many characters are encoded inline: a few milliseconds at most.
INLINE_CHARS = 16_384
# A worker that took an input this large is replaced by a fresh one afterwards.
RECYCLE_BYTES = 1 << 20

# Requests: op, flags, two u32 arguments, then the payload.
_HEAD = struct.Struct("<BBII")
_ENCODE, _DECODE, _TOKENIZE_JSON = range(3)
_SPECIAL, _WITH_STRS, _KEEP_FIRST = 1, 2, 4
_NO_LIMIT = 0xFFFFFFFF
_COUNT = struct.Struct("<I")
_OK, _FAILED = b"\x00", b"\x01"


class TokenizerPool:
    def __init__(
        self, tokenizer_json: str, size: int, max_pending: int = 16, timeout_s: float = 60.0
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.size = size
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self.pending = 0
        self._ctx = mp.get_context("spawn")
        self._executor = ThreadPoolExecutor(max(size, 1), thread_name_prefix="tokenizer-pool")
        self._workers = [_Worker(self._ctx, tokenizer_json) for _ in range(size)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self._replacing: set[asyncio.Future] = set()

    async def encode(
        self,
        text: str,
        add_special_tokens: bool,
        at_most: int | None,
        keep_last: int | None,
        keep_first: bool = False,
    ) -> tuple[int, list[int]]:
        """(token count, ids): the last `keep_last` ids only (the first ones with
        `keep_first`), and none at all when the count passes `at_most`, so a huge
        text's ids never become a list here."""
        flags = (_SPECIAL if add_special_tokens else 0) | (_KEEP_FIRST if keep_first else 0)
        head = _HEAD.pack(_ENCODE, flags, _NO_LIMIT if at_most is None else at_most, keep_last or 0)
        reply = await self._run(head + text.encode("utf-8"), "prompt")
        (count,) = _COUNT.unpack_from(reply)
        return count, array("i", reply[_COUNT.size :]).tolist()

    async def tokenize_json(
        self, text: str, add_special_tokens: bool, with_strs: bool
    ) -> tuple[int, bytes, bytes]:
        """/tokenize's answer made in the worker: (count, JSON list of ids, JSON list of
        token strings or b"null"), so a long text costs this loop no per-token work."""
        flags = (_SPECIAL if add_special_tokens else 0) | (_WITH_STRS if with_strs else 0)
        reply = await self._run(_HEAD.pack(_TOKENIZE_JSON, flags, 0, 0) + text.encode(), "prompt")
        (count,) = _COUNT.unpack_from(reply)
        tokens, _, strs = reply[_COUNT.size :].partition(b"\x00")
        return count, tokens, strs

    async def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        head = _HEAD.pack(_DECODE, _SPECIAL if skip_special_tokens else 0, 0, 0)
        reply = await self._run(head + array("i", ids).tobytes(), "tokens")
        return reply.decode("utf-8")

    async def _run(self, payload: bytes, field: str) -> bytes:
        if self.pending >= self.max_pending:
            raise APIError(
                f"{self.pending} long inputs are already being tokenized by this API server; "
                f"retry later",
                503,
                headers={"Retry-After": "1"},
            )
        if self._idle is None:
            self._idle = asyncio.Queue()
            for worker in self._workers:
                self._idle.put_nowait(worker)
        self.pending += 1
        try:
            worker = await self._idle.get()
            call = asyncio.get_running_loop().run_in_executor(
                self._executor, worker.call, payload, self.timeout_s
            )
            # However this coroutine ends (a client may leave), the worker is handed
            # back, or replaced, only once its call is over.
            call.add_done_callback(lambda done: self._release(worker, done, len(payload)))
            try:
                status, reply = await asyncio.shield(call)
            except TimeoutError:
                raise APIError(
                    f"{field} could not be tokenized within {self.timeout_s:g} s", param=field
                ) from None
            except (EOFError, OSError):
                raise APIError(f"{field} could not be tokenized", 500) from None
        finally:
            self.pending -= 1
        if status != _OK:
            log.warning("the tokenizer refused an input: %s", reply.decode(errors="replace"))
            raise APIError(f"{field} could not be tokenized", param=field)
        return reply

    def _release(self, worker: _Worker, call: asyncio.Future, size: int) -> None:
        error = call.exception() if not call.cancelled() else None
        if error is None and size <= RECYCLE_BYTES:
            self._idle.put_nowait(worker)
            return
        if isinstance(error, TimeoutError):
            log.warning("a tokenizer worker ran over %g s; replacing it", self.timeout_s)
        elif error is not None:
            log.warning("a tokenizer worker failed (%s); replacing it", error)
        # After a huge input its heap keeps that peak: a fresh worker takes its place,
        # so this API server's memory returns to its start-up size.
        task = asyncio.ensure_future(self._replace(worker))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replace(self, worker: _Worker) -> None:
        fresh = await asyncio.get_running_loop().run_in_executor(self._executor, worker.replace)
        self._workers[self._workers.index(worker)] = fresh
        self._idle.put_nowait(fresh)

    def close(self) -> None:
        for task in self._replacing:
            task.cancel()
        for worker in self._workers:
            worker.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Worker:
    """One worker process and our end of its pipe; used by one thread at a time."""

    def __init__(self, ctx, tokenizer_json: str) -> None:
        self.ctx = ctx
        self.tokenizer_json = tokenizer_json
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main,
            args=(tokenizer_json, child, os.getpid()),
            name="zserve-tokenizer",
            daemon=True,
        )
        self.process.start()
        child.close()

    def call(self, payload: bytes, timeout_s: float) -> tuple[bytes, bytes]:
        self.conn.send_bytes(payload)
        if not self.conn.poll(timeout_s):
            raise TimeoutError
        reply = self.conn.recv_bytes()
        return reply[:1], reply[1:]

    def replace(self) -> _Worker:
        self.stop()
        return _Worker(self.ctx, self.tokenizer_json)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(1)
        self.conn.close()


def _worker_main(tokenizer_json: str, conn: Connection, parent_pid: int) -> None:
    """The worker: bytes in, bytes out, until its pipe closes."""
    from protocol.process_life import die_with_parent, name_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when we stop
    die_with_parent(parent_pid)
    name_process("zserve-tokenize")
    # A long encode is background work: on cores shared with the serving loops and the
    # engines, they go first.
    os.nice(10)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            reply = _OK + _serve(tokenizer, message)
        except Exception as e:  # a bad input must not end the worker
            reply = _FAILED + f"{type(e).__name__}: {e}".encode()[:500]
        conn.send_bytes(reply)


def _serve(tokenizer, message: bytes) -> bytes:
    op, flags, arg1, arg2 = _HEAD.unpack_from(message)
    payload = memoryview(message)[_HEAD.size :]
    if op == _DECODE:
        ids = array("i")
        ids.frombytes(payload)
        return tokenizer.decode(ids, skip_special_tokens=bool(flags & _SPECIAL)).encode()
    text = str(payload, "utf-8")
    ids = tokenizer.encode(text, add_special_tokens=bool(flags & _SPECIAL)).ids
    count = _COUNT.pack(len(ids))
    if op == _TOKENIZE_JSON:
        tokens = ("[" + ",".join(map(str, ids)) + "]").encode()
        strs = b"null"
        if flags & _WITH_STRS:
            strs = json.dumps([tokenizer.id_to_token(i) for i in ids], ensure_ascii=False).encode()
        return count + tokens + b"\x00" + strs
    at_most, keep = arg1, arg2
    if len(ids) > at_most:
        return count
    if keep:
        ids = ids[:keep] if flags & _KEEP_FIRST else ids[-keep:]
    return count + array("i", ids).tobytes()
