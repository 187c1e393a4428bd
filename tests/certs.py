"""Throwaway PKI for TLS tests, made with the `openssl` command line tool."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Pki:
    ca: Path             # root certificate (PEM)
    server_cert: Path    # SAN 127.0.0.1 and localhost
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path       # a CA that signed nothing we serve (a stranger's trust root)
    other_cert: Path     # a client certificate from the stranger's CA
    other_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=d)


def make_pki(d: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate it
    signed, plus a second CA with a client certificate of its own."""
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                             "extendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "other-client", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(ca=d / "ca.pem", server_cert=d / "server.pem", server_key=d / "server.key",
               client_cert=d / "client.pem", client_key=d / "client.key",
               other_ca=d / "other-ca.pem", other_cert=d / "other-client.pem",
               other_key=d / "other-client.key")
