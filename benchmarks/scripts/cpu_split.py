"""Where a box's CPU goes per generated token while a load runs: every process's CPU time
over a window in the middle of the load, divided by the tokens the server's /metrics
counted in that window, grouped as zserve's processes (by their names: zserve-engineN,
zserve-apiN, zserve-super, zserve-tokenize), the other processes (the load tool, by
command name) and the idle time of the box.

Start the server, start the load (`vllm bench serve` with enough prompts to outlast the
window), then:

    python benchmarks/scripts/cpu_split.py http://127.0.0.1:8000 [--window 4] [--settle 2]

It waits until the server generates tokens, lets the load settle, then measures. The
box's figure is CPUs x window / tokens: on a saturated box the groups and the idle sum
to it. Linux only (/proc). Reads the metric `<prefix>:generation_tokens_total` (zserve's
prefix or vLLM's, so it measures either server).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from collections import Counter

TICK = os.sysconf("SC_CLK_TCK")
_TOKENS = re.compile(r"^\w+:generation_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def generated_tokens(url: str) -> float:
    """The server's generated-token count (summed over its series)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in _TOKENS.findall(text))


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds so far: user + system), every process readable."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:  # gone meanwhile
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        out[int(entry)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def box_seconds() -> tuple[float, float]:
    """The box's idle (with iowait) and stolen time so far, summed over its CPUs (stolen:
    a virtual machine's CPUs waiting for the host's)."""
    with open("/proc/stat") as f:
        cpu = f.readline().split()
    return (int(cpu[4]) + int(cpu[5])) / TICK, int(cpu[8]) / TICK


def group(name: str) -> str:
    """zserve's processes by role (each engine its own); others by command name."""
    m = re.match(r"zserve-(engine|api)(\d+)$", name)
    if m:
        return f"zserve {m[1]} {m[2]}" if m[1] == "engine" else "zserve api servers"
    return f"zserve {name[7:]}" if name.startswith("zserve-") else name


def wait_busy(url: str, timeout_s: float) -> None:
    """Until the server's token count moves (the load has started)."""
    start, first = time.monotonic(), generated_tokens(url)
    while time.monotonic() - start < timeout_s:
        time.sleep(0.25)
        if generated_tokens(url) > first:
            return
    raise SystemExit(f"no tokens generated in {timeout_s:.0f} s: is the load running?")


def snapshot(url: str) -> tuple[dict[int, tuple[str, float]], tuple[float, float], float, float]:
    """Every process's CPU, the box's idle and stolen time, the token count, the clock."""
    return cpu_by_process(), box_seconds(), generated_tokens(url), time.monotonic()


def measure(url: str, window_s: float) -> tuple[float, float, Counter]:
    """(tokens, seconds, CPU-seconds by group, with "(idle)" and "(stolen)") over one
    window."""
    before, box0, tok0, t0 = snapshot(url)
    time.sleep(window_s)
    after, box1, tok1, t1 = snapshot(url)
    spent: Counter = Counter()
    for pid, (name, cpu) in after.items():
        start = before.get(pid, (name, 0.0))[1]  # a process born in the window: all of it
        if cpu > start:
            spent[group(name)] += cpu - start
    spent["(idle)"], spent["(stolen)"] = box1[0] - box0[0], box1[1] - box0[1]
    return tok1 - tok0, t1 - t0, spent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the server's base URL (its /metrics is read)")
    p.add_argument("--window", type=float, default=4.0, help="seconds measured")
    p.add_argument("--settle", type=float, default=2.0, help="seconds waited once busy")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for load")
    p.add_argument("--top", type=int, default=8, help="groups listed (the rest summed)")
    args = p.parse_args()
    wait_busy(args.url, args.timeout)
    time.sleep(args.settle)
    tokens, seconds, spent = measure(args.url, args.window)
    if tokens <= 0:
        print("no tokens generated in the window", file=sys.stderr)
        return 1
    cpus = os.cpu_count() or 1
    box = cpus * seconds
    print(f"{tokens / seconds:.0f} tok/s over {seconds:.1f} s, {cpus} CPUs")
    print(f"{'':28s} {'us/token':>9s} {'of box':>7s}")
    box_rows = [(k, spent.pop(k)) for k in ("(idle)", "(stolen)")]
    rows = spent.most_common()
    shown, rest = rows[: args.top], sum(v for _, v in rows[args.top :])
    for name, cpu in shown + [("(other processes)", rest), *box_rows]:
        if cpu > 0:
            print(f"{name[:28]:28s} {cpu * 1e6 / tokens:9.1f} {cpu / box:7.1%}")
    print(f"{'box (CPUs x window)':28s} {box * 1e6 / tokens:9.1f} {1:7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
