"""Grammar compiles in a child process (engine_core/grammar_process.py): an overdue
compile is stopped at its deadline (and the same constraint refused at once after it),
a compiler that dies fails only its request, and the child never outlives the engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_core.grammar_compiler import GrammarError
from engine_core.structured_output import GrammarService
from protocol.messages import StructuredOutputs

pytestmark = pytest.mark.timeout(90)

VOCAB = 320  # the tiny model's lm_head rows
# Optional properties multiply xgrammar's work: ~25 s to compile on this project's CPUs.
SLOW = StructuredOutputs(
    json=json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20000)}}
    )
)


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state  # dead, not yet reaped by whoever adopted it


def wait_until(check, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def waiting_on_a_pipe(pid: int) -> bool:
    """The process sleeps in a pipe read (its stdin), as the kernel names the place."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().endswith("pipe_read")
    except OSError:
        return False


def service(model: Path, **kwargs) -> GrammarService:
    svc = GrammarService(model, VOCAB, max_spec_bytes=1 << 20, max_threads=1, **kwargs)
    wait_until(lambda: svc._children and svc._children[0].pid is not None, 10)
    return svc


def test_an_overdue_compile_is_stopped_at_its_deadline(tiny_model):
    svc = service(tiny_model("llama"), compile_timeout_s=3)
    child = svc._children[0]
    pid = child.pid
    ticket = svc.submit(SLOW, "slow")
    assert ticket.wait(30)
    with pytest.raises(GrammarError, match=r"took longer than 3 s"):
        ticket.grammar()
    # Killed then, not left to finish: its process is gone within moments.
    wait_until(lambda: gone(pid) and svc.num_failed == 1, 5)
    assert svc.compiled(SLOW) is None
    # Sent again, it is refused at once: it does not take the compiler for 3 s more.
    again = svc.submit(SLOW, "again")
    assert again.ready()
    with pytest.raises(GrammarError, match=r"took longer than 3 s .* when it was last tried"):
        again.grammar()
    # The next compile runs on a fresh child (the refusal started none): started at the
    # kill, it is waiting for its vocabulary once its imports are done (on a busy box
    # that can take longer than the 3 s this compile has).
    wait_until(lambda: child.pid not in (None, pid) and waiting_on_a_pipe(child.pid), 60)
    fast = svc.submit(StructuredOutputs(regex="a+"), "fast")
    assert fast.wait(30) and fast.grammar().accept(ord("a"))
    assert child.num_started == 2 and child.pid != pid
    svc.close()
    wait_until(lambda: gone(child.pid or pid), 5)


def test_a_compiler_that_dies_fails_only_its_request(tiny_model):
    svc = service(tiny_model("llama"))
    child = svc._children[0]
    ticket = svc.submit(SLOW, "slow")
    time.sleep(0.5)  # compiling now
    os.kill(child.pid, signal.SIGKILL)
    assert ticket.wait(30)
    with pytest.raises(GrammarError, match="the compiler crashed"):
        ticket.grammar()
    fast = svc.submit(StructuredOutputs(regex="b+"), "fast")
    assert fast.wait(30) and fast.grammar().accept(ord("b"))
    svc.close()


def test_the_child_ends_with_the_process_that_started_it(tiny_model, tmp_path):
    schema = tmp_path / "slow.json"
    schema.write_text(SLOW.json)
    script = (
        "import time\n"
        "from engine_core.structured_output import GrammarService\n"
        "from protocol.messages import StructuredOutputs\n"
        f"svc = GrammarService({str(tiny_model('llama'))!r}, {VOCAB}, max_threads=1,\n"
        "                     max_spec_bytes=1 << 20)\n"
        "assert svc.submit(StructuredOutputs(regex='a+')).wait(30)\n"
        f"svc.submit(StructuredOutputs(json=open({str(schema)!r}).read()))\n"
        "time.sleep(0.5)  # compiling it now\n"
        "print(svc._children[0].pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    root = Path(__file__).resolve().parents[2]
    engine = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE)
    try:
        pid = int(engine.stdout.readline())
        assert not gone(pid)
        engine.kill()  # SIGKILL: no atexit, no close(), and the child is busy compiling
        engine.wait(10)
        wait_until(lambda: gone(pid), 3)
    finally:
        engine.kill()
        engine.wait(10)
