"""CURVE keys of one zserve deployment, and the ZAP check that enforces them.

Every node holds the same key pair in `--engine-keys DIR` (default
`$XDG_CONFIG_HOME/zserve/engine-keys`): the head generates it on first use (or an
operator does, with `zserve make-engine-keys`), workers are given a copy. Binding
sockets are CURVE servers; connecting sockets present the same pair as clients and
pin the server's public key, and a ZAP handler in every process that binds admits
only that public key. A peer without the secret key therefore cannot complete the
CURVE handshake: ZMQ drops it before one byte reaches zserve.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import tempfile
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol.sockets import ZAP_DOMAIN, CurveKeys

log = logging.getLogger("zserve.keys")

KEY_NAME = "zserve-engine"
# At most one log line per this many seconds about refused peers: a rogue client
# retries its connection every 100 ms, and the log must not become its megaphone.
REFUSAL_LOG_INTERVAL_S = 60.0


class EngineKeysError(RuntimeError):
    pass


def default_keys_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "zserve" / "engine-keys"


def secret_file(directory: Path) -> Path:
    return Path(directory) / f"{KEY_NAME}.key_secret"


def public_file(directory: Path) -> Path:
    return Path(directory) / f"{KEY_NAME}.key"


def create_keys(directory: Path, *, overwrite: bool = False) -> CurveKeys:
    """Generate the deployment's key pair, files 0600 in a 0700 folder. Without
    `overwrite`, a pair that already exists (another process won a race) is kept."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".tmp-") as tmp:
            public, secret = zmq.auth.create_certificates(tmp, KEY_NAME)
            os.chmod(public, 0o600)
            os.chmod(secret, 0o600)
            if overwrite:
                os.replace(secret, secret_file(directory))
                os.replace(public, public_file(directory))
            else:
                try:  # atomic and exclusive: of two racing creators, one pair wins whole
                    os.link(secret, secret_file(directory))
                except FileExistsError:
                    pass
                else:
                    os.replace(public, public_file(directory))
    except OSError as e:
        raise EngineKeysError(f"cannot create the engine keys in {directory}: {e}") from e
    return load_keys(directory)


def check_secret_file(path: Path) -> None:
    """Refuse a secret key others could read or replace, as ssh refuses such a key.
    Root-owned files pass (as with sshd's StrictModes): Kubernetes mounts Secrets so."""
    st = os.stat(path)
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        try:
            user = pwd.getpwuid(euid).pw_name
        except KeyError:
            user = str(euid)
        raise EngineKeysError(
            f"{path} is owned by uid {st.st_uid}, not by this user ({user}): another user "
            f"could replace the engine secret key; run `chown {user} {path}` and "
            f"`chmod 600 {path}`"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise EngineKeysError(
            f"{path} is accessible by group or others (mode {mode:04o}): the engine secret "
            f"key must be private; run `chmod 600 {path}`"
        )


def load_keys(directory: Path) -> CurveKeys:
    path = secret_file(directory)
    check_secret_file(path)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise EngineKeysError(f"cannot read the engine keys in {path}: {e}") from e
    if secret is None:
        raise EngineKeysError(f"{path} holds no secret key")
    return CurveKeys(public=public, secret=secret)


def engine_keys(directory: Path | None, *, create: bool, wait_s: float = 0.0) -> CurveKeys:
    """The head creates the keys if they are missing; a worker waits up to `wait_s`
    for them to appear (e.g. while they are being copied), then fails clearly."""
    directory = Path(directory) if directory else default_keys_dir()
    deadline = time.monotonic() + wait_s
    while not secret_file(directory).is_file():
        if create:
            return create_keys(directory)
        if time.monotonic() >= deadline:
            raise EngineKeysError(
                f"no engine keys in {directory}: engines on other nodes need the head's "
                f"keys; copy the head's --engine-keys folder here (or pass --engine-keys DIR)"
            )
        time.sleep(0.5)
    return load_keys(directory)


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """The ZAP handler of `ctx`: its CURVE server sockets admit only clients that
    present the deployment's public key. Start it before those sockets bind; stop
    it (`.stop()`) after they are closed and before the context is destroyed.

    A thread rather than pyzmq's asyncio flavour, also in the API servers: it answers
    while their event loop is busy or not running yet (their sockets bind before it
    starts), and the supervisor, which has no loop, runs the same code.
    """
    auth = ThreadAuthenticator(ctx)
    auth.configure_curve_callback(
        domain=ZAP_DOMAIN.decode(), credentials_provider=_OnlyOurKey(keys.public)
    )
    auth.start()
    return auth


class _OnlyOurKey:
    def __init__(self, public: bytes) -> None:
        self.public = public
        self.refused = 0
        self.next_log = 0.0

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.public:  # pyzmq hands the client's key z85-encoded
            return True
        self.refused += 1
        now = time.monotonic()
        if now >= self.next_log:
            log.warning(
                "refused %d engine-link connection(s) from a peer with an unknown CURVE key "
                "(latest %s…): only holders of this deployment's engine keys may connect",
                self.refused,
                key[:8].decode(errors="replace"),
            )
            self.refused = 0
            self.next_log = now + REFUSAL_LOG_INTERVAL_S
        return False
