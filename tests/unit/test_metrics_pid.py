"""In multiprocess mode the metrics' per-observation fork check asks no system call, and
a forked child still writes its values to a file of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = """
import os, sys
import frontend.metrics  # installs the value class before any metric exists
from prometheus_client import Counter, Histogram

hist = Histogram("probe_gap_seconds", "gap", buckets=[0.01, 0.1])
count = Counter("probe_events", "events")
calls = []
sys.setprofile(lambda frame, event, arg: calls.append(arg) if event == "c_call" else None)
hist.observe(0.05)
count.inc()
sys.setprofile(None)
if os.getpid in calls:
    sys.exit("os.getpid called on an observation")
child = os.fork()
if child == 0:
    count.inc(5)  # must land in the child's own file
    os._exit(0)
os.waitpid(child, 0)
count.inc()
print(os.getpid(), child)
"""


def test_observations_make_no_getpid_call_and_a_fork_gets_its_own_file(tmp_path):
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.registry import CollectorRegistry

    env = os.environ | {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=50
    )
    assert run.returncode == 0, run.stderr
    parent, child = run.stdout.split()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert f"counter_{parent}.db" in files and f"counter_{child}.db" in files, files
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("probe_events_total") == 7.0
    assert registry.get_sample_value("probe_gap_seconds_count") == 1.0
