"""Running `zserve serve` as a real subprocess in tests: free ports, its own process
group, readiness by polling, and a teardown that always leaves nothing behind."""

from __future__ import annotations

import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ZSERVE = [sys.executable, "-m", "launcher.cli"]


def wait_for(
    condition: Callable[[], object],
    what: str = "",
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
) -> float:
    """Poll `condition` every `interval` s until it holds, and give the seconds that took;
    after `timeout` s, an AssertionError that names `what`."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(interval)
    return time.monotonic() - t0


def new_log_path(prefix: str) -> Path:
    """A fresh log file in the run's log folder (tests/conftest.py: server_logs)."""
    folder = os.environ.get("ZSERVE_TEST_LOGS")
    return Path(tempfile.mkstemp(prefix=prefix, suffix=".log", dir=folder)[1])


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def group_pids(pgid: int) -> list[int]:
    """Every live process of a process group (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports on which any of these processes holds a listening socket."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A = LISTEN
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


class ZServe:
    """One `zserve serve` subprocess; use as a context manager."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 180.0,
        wait_ready: bool = True,
        log_path: Path | None = None,
        open_files: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.open_files = open_files  # RLIMIT_NOFILE (soft and hard) of the whole server
        self.args = [*ZSERVE, "serve", *args]
        if "--port" not in args and "--headless" not in args:
            self.args += ["--port", str(self.port)]
        if "--host" not in args and "--headless" not in args:
            self.args += ["--host", "127.0.0.1"]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.ready_timeout = ready_timeout
        self.wait_ready = wait_ready
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What a client of this server verifies its certificate with (e2e_tls.py)."""
        return True

    def http(self, **kwargs) -> httpx.Client:
        """A client of this server (a --uds server's dials its socket: test_http_door.py)."""
        return httpx.Client(base_url=self.base_url, verify=self.verify, timeout=60, **kwargs)

    def start(self) -> ZServe:
        if self.log_path is None:
            self.log_path = new_log_path("zserve-test-")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # its own process group, so teardown reaches every child
            preexec_fn=self._limit_open_files if self.open_files else None,
        )
        if self.wait_ready:
            self.wait_until_ready()
        return self

    def _limit_open_files(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def wait_until_ready(self) -> None:
        """Until /health answers 200 and the supervisor has said it is ready: the first
        API server can answer while another is still starting, and the supervisor
        judges a child's death as a failed start-up until then."""
        deadline = time.monotonic() + self.ready_timeout
        with self.http() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"zserve exited with {self.proc.returncode} before ready:\n{self.log()}"
                    )
                try:
                    healthy = http.get("/health", timeout=1.0).status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy and "zserve ready on" in self.log():
                    return
                time.sleep(0.2)
        raise TimeoutError(f"zserve not ready in {self.ready_timeout} s:\n{self.log()}")

    def log(self) -> str:
        if self._log is not None:
            self._log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def pids(self) -> list[int]:
        return group_pids(self.proc.pid) if self.proc else []

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the supervisor, then SIGKILL the whole group if anything lingers."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ZServe:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def server_info(base_url: str, headers: dict | None = None) -> dict:
    return httpx.get(base_url + "/server_info", timeout=10, headers=headers).json()
