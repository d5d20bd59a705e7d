"""Real X.509 certificates for TLS tests, made with the ``openssl`` CLI (no extra Python package).

    pki = make_pki(tmp_path)      # two CAs; a node cert (server + client, 127.0.0.1/localhost) and a
                                  # client cert under CA "a"; a node cert under CA "b" (another CA)
    pki.ca_a, pki.node_a.cert, pki.node_a.key, pki.client_a, pki.node_b ...

``require_openssl()`` skips the calling test when the binary is missing.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SAN = "subjectAltName=IP:127.0.0.1,DNS:localhost"


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca_a: Path
    ca_b: Path
    node_a: KeyPair  # signed by CA a, serverAuth + clientAuth, SAN 127.0.0.1 and localhost
    client_a: KeyPair  # signed by CA a, clientAuth only
    node_b: KeyPair  # signed by CA b (another CA), serverAuth + clientAuth, same SAN


def require_openssl() -> str:
    binary = shutil.which("openssl")
    if binary is None:
        import pytest

        pytest.skip("the openssl CLI is needed to make test certificates (apt-get install -y openssl)")
    return binary


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {done.stderr.strip()}")


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    _new_key(key)
    _openssl("req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def make_leaf(folder: Path, name: str, ca: tuple[Path, Path], usages: str) -> KeyPair:
    key, csr, cert, ext = (folder / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    _new_key(key)
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext.write_text(f"{_SAN}\nextendedKeyUsage={usages}\nbasicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-out", str(cert),
             "-days", "2", "-set_serial", str(secrets.randbits(63)), "-extfile", str(ext))
    return KeyPair(cert, key)


def make_pki(folder: Path) -> Pki:
    require_openssl()
    folder.mkdir(parents=True, exist_ok=True)
    ca_a, ca_b = make_ca(folder, "ca-a"), make_ca(folder, "ca-b")
    return Pki(
        ca_a=ca_a[0], ca_b=ca_b[0],
        node_a=make_leaf(folder, "node-a", ca_a, "serverAuth,clientAuth"),
        client_a=make_leaf(folder, "client-a", ca_a, "clientAuth"),
        node_b=make_leaf(folder, "node-b", ca_b, "serverAuth,clientAuth"),
    )
