"""Structured outputs for one engine: constraints compiled off the engine thread, cached.

The scheduler asks a GrammarTicket whether a request's grammar is ready without ever
blocking: `submit()` answers at once, and compiles run on a small thread pool, each
thread handing its constraint to its own child process (grammar_process.py), so the
busy loop keeps stepping. A compile that takes longer than `compile_timeout_s` fails
its request with a clear message, and its child is killed then: an overdue compile
holds no thread and no core past its deadline. An identical constraint submitted
while one compiles shares it instead of starting another (and extends its deadline).
Queued compiles whose requests have all timed out are dropped without running. A
constraint that compiled for the whole timeout and was stopped is refused at once for
TOO_SLOW_MEMORY_S after that: a client that sends it again (retries, a load test)
costs the compiler and the requests queued behind it nothing.

Compiled grammars are cached by the constraint's key (bounded LRU); a request gets
its own matcher (RequestGrammar) over the shared compiled grammar.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from engine_core.grammar_compiler import GrammarError
from engine_core.grammar_matcher import RequestGrammar
from engine_core.grammar_process import CompileProcess, CompileTimeout
from protocol.messages import StructuredOutputs

logger = logging.getLogger(__name__)

TOO_SLOW_MEMORY_S = 600.0

__all__ = ["GrammarError", "GrammarService", "GrammarTicket", "RequestGrammar"]


class _Compile:
    """One compile in flight, shared by every ticket for the same constraint."""

    __slots__ = ("future", "deadline")

    def __init__(self, deadline: float) -> None:
        self.future: concurrent.futures.Future[xgr.CompiledGrammar] = concurrent.futures.Future()
        self.deadline = deadline  # the latest deadline of the tickets waiting on it


class GrammarTicket:
    """A request's grammar as the scheduler sees it: `ready()` never blocks; once it
    is true, `grammar()` gives the request's matcher or raises GrammarError."""

    __slots__ = ("request_id", "field", "_future", "_deadline", "_timeout_s")

    def __init__(
        self,
        request_id: str,
        field: str,
        future: concurrent.futures.Future[xgr.CompiledGrammar],
        deadline: float,
        timeout_s: float,
    ) -> None:
        self.request_id = request_id
        self.field = field
        self._future = future
        self._deadline = deadline
        self._timeout_s = timeout_s

    def ready(self) -> bool:
        """Compiled, failed or overdue."""
        return self._future.done() or time.monotonic() >= self._deadline

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ready or `timeout` seconds pass (offline use, tests); answers ready()."""
        left = self._deadline - time.monotonic()
        if timeout is not None:
            left = min(left, timeout)
        if left > 0:
            concurrent.futures.wait([self._future], timeout=left)
        return self.ready()

    def grammar(self) -> RequestGrammar:
        """The request's own matcher; GrammarError when the constraint failed or timed out."""
        if not self._future.done():
            if time.monotonic() < self._deadline:
                raise RuntimeError("grammar() called before the ticket is ready")
            raise GrammarError(
                f"{self.field}: compiling the constraint took longer than "
                f"{self._timeout_s:g} s; simplify it"
            )
        error = self._future.exception()
        if error is not None:
            if isinstance(error, GrammarError):
                raise error
            raise GrammarError(f"{self.field}: the constraint could not be compiled") from error
        return RequestGrammar(self._future.result())


class GrammarService:
    """Compiles and caches one model's structured-output constraints.

    `model_dir` holds the tokenizer (tokenizer.json); `vocab_size` is the model's
    (its lm_head rows, which may exceed the tokenizer's size: the extra ids are never
    allowed); `eos_token_ids` are the tokens that end a request, the only ones
    allowed once the constraint is complete. Special tokens are never allowed
    inside the constrained text: the detokenizer drops them, so the text would no
    longer match. Call from one thread (the engine's); the pool is internal.
    """

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        *,
        eos_token_ids: Iterable[int] = (),
        backend: str = "xgrammar",
        max_threads: int = 2,
        cache_size: int = 128,
        max_spec_bytes: int = 64 * 1024,
        compile_timeout_s: float = 30.0,
    ) -> None:
        if backend != "xgrammar":
            raise ValueError(
                f"structured output backend {backend!r} is not supported; use xgrammar"
            )
        for name, value in (("max_threads", max_threads), ("cache_size", cache_size)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1; got {value}")
        self.vocab_size = vocab_size
        self.max_spec_bytes = max_spec_bytes
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self.tokenizer_info = tokenizer_info(model_dir, vocab_size, sorted(eos_token_ids))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_threads, thread_name_prefix="grammar-compile"
        )
        self._lock = threading.Lock()  # guards the cache, the in-flight table, the children
        self._local = threading.local()  # each pool thread's CompileProcess
        self._children: list[CompileProcess] = []
        for _ in range(max_threads):  # start the children now, off the first compiles' clock
            self._pool.submit(lambda: self._child().start())
        self._cache: OrderedDict[bytes, xgr.CompiledGrammar] = OrderedDict()
        self._in_flight: dict[bytes, _Compile] = {}
        self._too_slow: OrderedDict[bytes, float] = OrderedDict()  # key -> when it was stopped
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.num_failed = 0

    def submit(self, spec: StructuredOutputs, request_id: str = "") -> GrammarTicket:
        """Start (or reuse) the compile of `spec`; never blocks, never raises for a bad spec:
        the ticket carries the error."""
        now = time.monotonic()
        deadline = now + self.compile_timeout_s
        try:
            field = spec.field  # also checks that exactly one kind is set
            self._check_size(spec, field)
        except ValueError as e:
            return self._failed(request_id, spec.param or "structured_outputs", e, deadline)
        key = spec.key()
        with self._lock:
            stopped_at = self._too_slow.get(key)
            if stopped_at is not None and now - stopped_at < TOO_SLOW_MEMORY_S:
                error = GrammarError(
                    f"{field}: this constraint took longer than {self.compile_timeout_s:g} s "
                    "to compile when it was last tried; simplify it"
                )
                return self._failed(request_id, field, error, deadline)
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(compiled)
                return GrammarTicket(request_id, field, future, deadline, self.compile_timeout_s)
            job = self._in_flight.get(key)
            if job is None:
                job = self._in_flight[key] = _Compile(deadline)
                self._pool.submit(self._run, key, spec, job)
            else:
                job.deadline = max(job.deadline, deadline)
        return GrammarTicket(request_id, field, job.future, deadline, self.compile_timeout_s)

    def compiled(self, spec: StructuredOutputs) -> xgr.CompiledGrammar | None:
        """The cached compiled grammar of `spec`, if any (no LRU touch)."""
        with self._lock:
            return self._cache.get(spec.key())

    @staticmethod
    def wait_any(tickets: Iterable[GrammarTicket], timeout: float) -> None:
        """Block until one of `tickets` is ready or `timeout` passes: for an engine loop
        that has nothing to run but requests waiting on their grammars."""
        tickets = list(tickets)
        if not tickets or any(t.ready() for t in tickets):
            return
        soonest = min(t._deadline for t in tickets) - time.monotonic()
        concurrent.futures.wait(
            {t._future for t in tickets},
            timeout=max(0.0, min(timeout, soonest)),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def close(self) -> None:
        """Drop queued compiles and stop the children (a running compile is lost)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.close()

    def _child(self) -> CompileProcess:
        """This pool thread's child process (xgrammar's own cache is off there: ours is
        keyed by the whole constraint and bounded)."""
        child = getattr(self._local, "child", None)
        if child is None:
            child = self._local.child = CompileProcess(self.tokenizer_info)
            with self._lock:
                self._children.append(child)
        return child

    def _check_size(self, spec: StructuredOutputs, field: str) -> None:
        texts = [spec.json, spec.regex, spec.grammar, spec.structural_tag, *(spec.choice or ())]
        size = sum(len(t.encode()) for t in texts if t)
        if size > self.max_spec_bytes:
            raise GrammarError(
                f"{field}: the constraint is {size} bytes; the limit is {self.max_spec_bytes}"
            )

    def _failed(
        self, request_id: str, field: str, error: Exception, deadline: float
    ) -> GrammarTicket:
        self.num_failed += 1
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(error if isinstance(error, GrammarError) else GrammarError(str(error)))
        return GrammarTicket(request_id, field, future, deadline, self.compile_timeout_s)

    def _keep(self, table: OrderedDict, key: bytes, value: object) -> None:
        """Under the lock: `key` newest in an LRU table of at most cache_size entries."""
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.cache_size:
            table.popitem(last=False)

    def _run(self, key: bytes, spec: StructuredOutputs, job: _Compile) -> None:
        """On a pool thread: compile unless every waiting request has given up."""
        try:
            if time.monotonic() >= job.deadline:
                raise GrammarError(f"{spec.field}: dropped, its requests timed out in the queue")
            start = time.perf_counter()
            compiled = self._child().compile(spec, lambda: job.deadline)
            elapsed = time.perf_counter() - start
        except BaseException as e:
            too_slow = False
            if isinstance(e, CompileTimeout):
                ran = time.perf_counter() - start
                logger.info(
                    "stopped compiling a %s constraint after %.1f s (its requests' deadline)",
                    spec.kind, ran,
                )  # fmt: skip
                too_slow = ran >= self.compile_timeout_s  # its own cost, not its queue wait
                e = GrammarError(
                    f"{spec.field}: compiling the constraint took longer than "
                    f"{self.compile_timeout_s:g} s; simplify it"
                )
            elif not isinstance(e, GrammarError):
                logger.exception("compiling a %s constraint failed unexpectedly", spec.kind)
            with self._lock:
                del self._in_flight[key]
                self.num_failed += 1
                if too_slow:
                    self._keep(self._too_slow, key, time.monotonic())
            job.future.set_exception(e)
            return
        with self._lock:
            del self._in_flight[key]
            self._keep(self._cache, key, compiled)
            self.num_compiled += 1
        if elapsed > 1.0:
            logger.info("compiling a %s constraint took %.1f s", spec.kind, elapsed)
        job.future.set_result(compiled)


def tokenizer_info(
    model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the model's vocabulary, built once per engine.

    xgrammar detects the vocabulary's encoding (byte-level, byte-fallback, raw); the
    vocabulary is then rebuilt with every special token blanked, so that no grammar
    can match one as text, and with the engine's EOS tokens as the stop tokens.
    """
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    stops = eos_token_ids or None
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops
    )
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special.update(tokenizer.all_special_ids)
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops or detected.stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )
