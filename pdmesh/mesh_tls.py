"""`pdmesh up --tls-dir DIR`: give every service of the local mesh its own certificate.

DIR is what `pdmesh certs --out DIR --worker decode/decode-0 ...` wrote: the CA,
one certificate per role and one per worker. Each service gets the flags for its
own certificate (a worker its per-worker one, `pdmesh://decode/decode-0`, so the
router and prefill workers know exactly which worker calls), mTLS on, and the
mesh name `pdmesh.internal` to check peers against (they are reached by IP).
Flags, not `PDMESH_TLS_*` variables: those would give every child the same
certificate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdmesh.launcher import flags
from services.common.tls import MESH_DNS_NAME, TlsConfig


class MissingCertificates(ValueError):
    """DIR lacks a certificate the mesh needs; the message says how to make it."""


@dataclass(frozen=True)
class MeshTls:
    dir: Path

    def cert_base(self, role: str, worker: str = "") -> str:
        return f"{role}-{worker}" if worker else role

    def check(self, needed: list[tuple[str, str]]) -> None:
        """Raise MissingCertificates unless DIR holds the CA and every (role, worker) certificate."""
        files = ["ca", *(self.cert_base(role, worker) for role, worker in needed)]
        missing = [f"{f}.pem" for f in files if not (self.dir / f"{f}.pem").is_file()]
        if missing:
            workers = " ".join(f"--worker {r}/{w}" for r, w in needed if w)
            raise MissingCertificates(
                f"--tls-dir {self.dir}: no {', '.join(missing)}; "
                f"make them with: pdmesh certs --out {self.dir} {workers}".rstrip()
            )

    def config(self, role: str, worker: str = "") -> TlsConfig:
        base = self.cert_base(role, worker)
        return TlsConfig(
            cert_file=str(self.dir / f"{base}.pem"),
            key_file=str(self.dir / f"{base}-key.pem"),
            ca_file=str(self.dir / "ca.pem"),
            require_client_cert=True,
            server_name=MESH_DNS_NAME,
        )

    def flags(self, role: str, worker: str = "") -> tuple[str, ...]:
        c = self.config(role, worker)
        return flags(
            tls_cert_file=c.cert_file,
            tls_key_file=c.key_file,
            tls_ca_file=c.ca_file,
            tls_require_client_cert=1,
            tls_server_name=c.server_name,
        )
