"""Where a 2-CPU box idles under load: each CPU's idle time, split by what the engine's
two threads were doing meanwhile, and how long woken threads waited to run.

Record the scheduler's events during a load, then read them here with the engine's
main thread id (= its pid), its kernel-pool worker's thread id, the API server's pid
and the load generator's main thread id:

    perf sched record -o sched.data -- sleep 2
    python benchmarks/scripts/idle_by_state.py sched.data MAIN WORKER API GEN

A thread's state at each instant is R (running), W (woken or preempted, waiting for a
CPU) or S (asleep). "main=R worker=W other=main" is idle time while the worker, woken,
waited behind the main thread on the other CPU. Wake latencies are split by whether
the CPU the kernel chose for the woken thread was idle or busy at the wake.
"""

import collections
import re
import subprocess
import sys

EVENT = re.compile(r"\s*\S.*?\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)")


def events(path: str):
    out = subprocess.run(["perf", "script", "-i", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = EVENT.match(line)
        if m:
            yield int(m[2]), float(m[3]), m[4], m[5]


def main() -> None:
    path, main_tid, worker_tid, api, gen = sys.argv[1], *map(int, sys.argv[2:6])
    names = {main_tid: "main", worker_tid: "worker", api: "api", gen: "gen"}
    running: dict[int, int] = {}  # cpu -> tid (0: idle)
    state: dict[int, str] = collections.defaultdict(lambda: "S")
    idle = collections.Counter()
    total = 0.0
    woken: dict[int, tuple[float, bool]] = {}  # tid -> (when, its target CPU was idle)
    waits = collections.defaultdict(list)
    last = None
    for cpu, t, event, rest in events(path):
        if last is not None and len(running) == 2:
            total += 2 * (t - last)
            for c, tid in running.items():
                if tid == 0:
                    other = running.get(1 - c, -1)
                    where = "idle" if other == 0 else names.get(other, "other")
                    key = f"main={state[main_tid]} worker={state[worker_tid]} other={where}"
                    idle[key] += t - last
        last = t
        if event == "sched_switch":
            m = re.search(r"prev_pid=(\d+) .*prev_state=(\S+) ==> .*next_pid=(\d+)", rest)
            prev, prev_state, nxt = int(m[1]), m[2], int(m[3])
            state[prev] = "W" if prev_state.startswith("R") else "S"
            state[nxt] = "R"
            running[cpu] = nxt
            if nxt in woken:
                when, to_idle = woken.pop(nxt)
                waits[(names[nxt], "an idle" if to_idle else "a busy")].append(t - when)
        elif event == "sched_waking":
            tid = int(re.search(r" pid=(\d+)", rest)[1])
            target = int(re.search(r"target_cpu=(\d+)", rest)[1])
            if state[tid] == "S":
                state[tid] = "W"
            if tid in names:
                woken[tid] = (t, running.get(target) == 0)
    spent = sum(idle.values())
    print(f"idle: {100 * spent / total:.1f} % of the CPUs' time over {total / 2:.2f} s")
    for key, s in idle.most_common(12):
        print(f"  {100 * s / spent:5.1f} % of it  {key}")
    print("woken -> running (us):")
    for (who, target), w in sorted(waits.items()):
        w.sort()
        print(
            f"  {who:6s} onto {target:7s} CPU: n={len(w):5d}  p50 {w[len(w) // 2] * 1e6:7.0f}  "
            f"p90 {w[int(len(w) * 0.9)] * 1e6:7.0f}  total {sum(w) * 1e3:7.1f} ms"
        )


if __name__ == "__main__":
    main()
