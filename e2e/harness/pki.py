"""Certificates and keys for one control plane: a CA, the API server's serving cert, and the
service-account signing key pair. Made with the openssl CLI, fresh for every cluster."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path  # service-account token signing key (private)
    sa_pub: Path  # its public half, for verifying tokens


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, text=True)


def make_pki(directory: Path, service_ip: str) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )
    _openssl("genrsa", "-out", str(pki.ca_key), "2048")
    _openssl(
        "req", "-x509", "-new", "-nodes", "-key", str(pki.ca_key), "-sha256", "-days", "7",
        "-subj", "/CN=phasefleet-e2e-ca", "-out", str(pki.ca_cert),
    )  # fmt: skip
    _openssl("genrsa", "-out", str(pki.serving_key), "2048")
    csr = directory / "apiserver.csr"
    _openssl(
        "req", "-new", "-key", str(pki.serving_key), "-subj", "/CN=kube-apiserver", "-out", str(csr)
    )
    extensions = directory / "apiserver.ext"
    alt_names = [
        "IP:127.0.0.1",
        f"IP:{service_ip}",
        "DNS:localhost",
        "DNS:kubernetes",
        "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ]
    extensions.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join(alt_names)}\n"
    )
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key),
        "-CAcreateserial", "-days", "7", "-sha256", "-extfile", str(extensions),
        "-out", str(pki.serving_cert),
    )  # fmt: skip
    _openssl("genrsa", "-out", str(pki.sa_key), "2048")
    _openssl("rsa", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub))
    return pki
