"""TLS for the e2e tests: a throwaway certificate authority (the openssl command line,
offline), and a ZServe whose readiness polls over https with the test's own context."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import time
from pathlib import Path

from zserve_proc import ZServe


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str | Path) -> None:
    subprocess.run(
        ["openssl", *map(str, args)], check=True, capture_output=True, timeout=60
    )  # fmt: skip


class CertificateAuthority:
    """A CA in `folder` that issues EC certificates for 127.0.0.1 (servers) or for a
    name (clients), each with a fresh key."""

    def __init__(self, folder: Path, name: str = "ca") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.key, self.cert = folder / f"{name}.key", folder / f"{name}.pem"
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-keyout", self.key, "-out", self.cert,
            "-subj", f"/CN=zserve test {name}",
        )  # fmt: skip

    def issue(self, name: str, server: bool) -> tuple[Path, Path]:
        """(key, certificate) for CN=name, signed by this CA."""
        key, csr, cert = (self.folder / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
        ext = self.folder / f"{name}.ext"
        usage = "serverAuth\nsubjectAltName=IP:127.0.0.1" if server else "clientAuth"
        ext.write_text(f"extendedKeyUsage={usage}\n")
        _openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key,
            "-set_serial", str(time.time_ns()), "-days", "1", "-out", cert, "-extfile", ext,
        )  # fmt: skip
        return key, cert


def client_context(ca: Path, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """Trusts `ca`; presents the (key, certificate) pair if given."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert[1]), str(cert[0]))
    return context


class TLSServer(ZServe):
    """ZServe over https when given a context (readiness polls with the test's own
    certificate), plain http otherwise."""

    def __init__(self, *args, context: ssl.SSLContext | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.context = context

    @property
    def base_url(self) -> str:
        return f"{'https' if self.context else 'http'}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        return self.context or True
