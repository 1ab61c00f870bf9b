"""--enable-ssl-refresh: the HTTP door's TLS files reloaded into its live context when
they change on disk (a certificate rotated by cert-manager, say), with no restart.

New connections get the new certificate; open ones keep theirs. Each change is loaded
into a scratch context first, so a half-written or mismatched pair is logged and the
files already in use stay in use (loading them straight into the live context could
leave a new certificate beside the old key). A changed CA file adds its certificates to
those trusted: OpenSSL offers no way to drop one from a live context, so removing a CA
takes a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

log = logging.getLogger("zserve.api")

POLL_INTERVAL_S = 1.0


def _stamp(path: str | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)  # follows links: a Kubernetes secret swaps a symlink
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class TLSRefresher:
    def __init__(
        self,
        context: ssl.SSLContext,
        certfile: str,
        keyfile: str | None,
        ca_certs: str | None,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.context = context
        self.certfile, self.keyfile, self.ca_certs = certfile, keyfile, ca_certs
        self.interval_s = interval_s
        self.loaded = self.stamps()  # what the live context holds
        self.refused: tuple | None = None  # files already found unusable (logged once)

    def stamps(self) -> tuple:
        return tuple(_stamp(p) for p in (self.certfile, self.keyfile, self.ca_certs))

    async def run(self) -> None:
        log.info("TLS files watched for changes: %s", self.describe())
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()

    def check(self) -> bool:
        """Reload if the files changed since the last load; True if it did."""
        now = self.stamps()
        if now == self.loaded or now == self.refused:
            return False
        chain_changed = now[:2] != self.loaded[:2]
        try:
            if chain_changed:
                scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                scratch.load_cert_chain(self.certfile, self.keyfile)
            if self.ca_certs and now[2] != self.loaded[2]:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(self.ca_certs)
                self.context.load_verify_locations(self.ca_certs)
            if chain_changed:
                self.context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as e:
            self.refused = now
            log.warning("TLS files changed but cannot be used (%s); the loaded ones stay", e)
            return False
        self.loaded, self.refused = now, None
        log.info("TLS files reloaded: %s", self.describe())
        return True

    def describe(self) -> str:
        return ", ".join(p for p in (self.certfile, self.keyfile, self.ca_certs) if p)
