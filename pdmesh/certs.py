"""A development CA and per-role certificates for a TLS mesh (`pdmesh certs`).

`write_mesh_certs(out)` writes `ca.pem` (+ `ca-key.pem`, to sign more later)
and `<role>.pem` / `<role>-key.pem` for every role in `ROLES`. A service's
certificate is for TLS server and client use (a process presents the same one
both ways); the "client" one for client use only. Each carries:
  - the URI SAN `pdmesh://<role>` (or `pdmesh://<role>/<worker>` for a
    per-worker certificate): the identity MeshServer authorizes with mTLS;
  - (not "client") DNS SANs for localhost, the role's own compose/Kubernetes
    service name, any `hosts` given, and for internal roles the mesh name
    `pdmesh.internal` (peers reached by pod IP are checked against it:
    `--tls-server-name pdmesh.internal`); IP SANs for 127.0.0.1, ::1 and any IP
    in `hosts`.
Keys are ECDSA P-256, written 0600. For production use your own PKI (e.g.
cert-manager) with the same URI SANs; these are for local meshes and tests.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.call_guards import INTERNAL_ROLES
from services.common.tls import MESH_DNS_NAME, identity_uri

ROLES = ("router", "decode", "prefill", "kvtransfer", "gateway", "client")
# Names services are reached by in compose.yaml and deploy/k8s (namespace-qualified too).
SERVICE_NAMES = ("router", "decode", "prefill", "kvtransfer", "gateway")
DEFAULT_DAYS = 365


@dataclass(frozen=True)
class Issued:
    cert_file: Path
    key_file: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: a watching server never reads half a file


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def make_ca(
    common_name: str = "pdmesh dev CA", days: int = DEFAULT_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start, end = _validity(days)
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _sans(role: str, worker: str, hosts: Sequence[str]) -> list[x509.GeneralName]:
    """A role's certificate names only that role's own service (and the mesh name for
    internal roles): holding one certificate does not let a peer pose as another service."""
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri(role, worker))]
    if role == "client":  # a caller only: no server names
        return names
    dns = ["localhost"] + ([MESH_DNS_NAME] if role in INTERNAL_ROLES else [])
    if role in SERVICE_NAMES:
        dns += [role, f"{role}.default.svc", f"{role}.default.svc.cluster.local"]
    ips = ["127.0.0.1", "::1"]
    for h in hosts:
        try:
            ipaddress.ip_address(h)
            ips.append(h)
        except ValueError:
            dns.append(h)
    names += [x509.DNSName(d) for d in dict.fromkeys(dns)]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in dict.fromkeys(ips)]
    return names


def make_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    role: str,
    *,
    worker: str = "",
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server+client certificate for `role` (and `worker`), signed by the CA."""
    key = _key()
    start, end = _validity(days)
    cn = f"pdmesh-{role}" + (f"-{worker}" if worker else "")
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role != "client":
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_sans(role, worker, hosts)), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def write_ca(out: Path, common_name: str = "pdmesh dev CA", days: int = DEFAULT_DAYS) -> Issued:
    out.mkdir(parents=True, exist_ok=True)
    cert, key = make_ca(common_name, days)
    _write(out / "ca.pem", _pem(cert))
    _write(out / "ca-key.pem", _pem_key(key), private=True)
    return Issued(out / "ca.pem", out / "ca-key.pem")


def load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((out / "ca-key.pem").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def issue(
    out: Path,
    role: str,
    *,
    worker: str = "",
    hosts: Sequence[str] = (),
    name: str = "",
    days: int = DEFAULT_DAYS,
) -> Issued:
    """Sign `<name>.pem` / `<name>-key.pem` (name defaults to role[-worker]) with the CA in `out`."""
    ca_cert, ca_key = load_ca(out)
    cert, key = make_leaf(ca_cert, ca_key, role, worker=worker, hosts=hosts, days=days)
    base = name or (f"{role}-{worker}" if worker else role)
    issued = Issued(out / f"{base}.pem", out / f"{base}-key.pem")
    _write(issued.key_file, _pem_key(key), private=True)
    _write(issued.cert_file, _pem(cert))
    return issued


def write_mesh_certs(
    out: Path,
    *,
    hosts: Sequence[str] = (),
    workers: Sequence[tuple[str, str]] = (),
    days: int = DEFAULT_DAYS,
    keep_ca: bool = True,
) -> dict[str, Issued]:
    """A CA (reused when `out` has one and `keep_ca`) and one certificate per role
    (plus one per (role, worker) in `workers`); returns them by file base name."""
    out.mkdir(parents=True, exist_ok=True)
    if not (keep_ca and (out / "ca.pem").exists() and (out / "ca-key.pem").exists()):
        write_ca(out, days=days)
    issued = {role: issue(out, role, hosts=hosts, days=days) for role in ROLES}
    for role, worker in workers:
        issued[f"{role}-{worker}"] = issue(out, role, worker=worker, hosts=hosts, days=days)
    return issued
