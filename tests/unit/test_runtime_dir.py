"""The supervisor's runtime folder: a killed supervisor's is swept by the next server,
a live one's never (launcher/runtime_dir.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from launcher.runtime_dir import RuntimeDir, sweep_stale

pytestmark = pytest.mark.timeout(60)

HOLDER = """
import sys
from launcher.runtime_dir import RuntimeDir
d = RuntimeDir(sys.argv[1])
print(d.path, flush=True)
sys.stdin.read()
"""


def test_a_folder_is_swept_once_its_supervisor_is_killed_and_not_before(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        path = holder.stdout.readline().strip()
        assert os.path.isdir(path) and os.path.basename(path).startswith(f"zserve-{holder.pid}-")
        assert sweep_stale(str(tmp_path)) == []
        assert os.path.isdir(path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert os.path.isdir(path)  # nothing of its own removed it
        assert sweep_stale(str(tmp_path)) == [path]
        assert not os.path.exists(path)
    finally:
        holder.kill()
        holder.wait(10)


def test_what_is_not_a_dead_supervisors_folder_is_left_alone(tmp_path):
    unlocked = tmp_path / "zserve-1-old"  # an older server's: no lock file to judge by
    unlocked.mkdir()
    (unlocked / "api0-in").write_text("")
    (tmp_path / "zserve-2-file").write_text("")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "lock").write_text("")
    (tmp_path / "zserve-3-link").symlink_to(target)
    other = tmp_path / "not-zserve-4"
    other.mkdir()
    (other / "lock").write_text("")
    assert sweep_stale(str(tmp_path)) == []
    assert unlocked.is_dir() and target.is_dir() and other.is_dir()


def test_a_sweep_never_takes_a_folder_that_is_being_made(tmp_path):
    """The lock is taken before the lock file has its name, so a sweep racing a start
    finds either no lock file or a held one."""
    made: list[RuntimeDir] = []
    stop = threading.Event()
    swept: list[str] = []

    def sweep_forever() -> None:
        while not stop.is_set():
            swept.extend(sweep_stale(str(tmp_path)))

    sweeper = threading.Thread(target=sweep_forever)
    sweeper.start()
    try:
        for _ in range(1000):
            made.append(RuntimeDir(str(tmp_path)))
    finally:
        stop.set()
        sweeper.join()
    assert swept == []
    assert all(os.path.exists(os.path.join(d.path, "lock")) for d in made)
    for d in made:
        d.close()
    assert list(tmp_path.iterdir()) == []
