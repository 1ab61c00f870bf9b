"""The supervisor's runtime folder (ipc:// sockets, the admission file, the metrics
shards): made at start, removed at shutdown, and swept by the next server on this
node when a supervisor could not remove its own (SIGKILL, the OOM killer).

A live supervisor holds an exclusive flock on the folder's `lock` file for its whole
life; the kernel drops it when the process dies, however it dies. So a folder whose
lock can be taken belongs to nobody, in any PID namespace that shares the folder."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("zserve.supervisor")

PREFIX = "zserve-"
LOCK = "lock"


class RuntimeDir:
    """This supervisor's folder, locked until close()."""

    def __init__(self, parent: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)
        # Locked before it takes its name, so a sweep never finds it unlocked. O_CLOEXEC
        # (Python's default): spawned children do not hold it, so the lock ends with
        # the supervisor even while they shut down.
        staging = os.path.join(self.path, f".{LOCK}")
        self._fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(staging, os.path.join(self.path, LOCK))

    def close(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = -1


def sweep_stale(parent: str | None = None) -> list[str]:
    """Remove the runtime folders of dead supervisors (ours: same owner, a lock file
    nobody holds); the paths removed. Folders without a lock file are left alone."""
    root = Path(parent or tempfile.gettempdir())
    removed = []
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return removed
    uid = os.getuid()
    for folder in candidates:
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != uid:
                continue
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock file: not ours to judge, or gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live supervisor holds it
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d runtime folder(s) left by killed servers", len(removed))
    return removed
