"""TLS and mutual TLS for every gRPC server and client of the mesh.

`TlsConfig` is one frozen dataclass every service (and the CLI) takes with the
`tls_` prefix: `--tls-cert-file` / `PDMESH_TLS_CERT_FILE`, ... With nothing set
everything stays plaintext, as before. A process uses one certificate both as
its server certificate and as its client certificate towards its peers, so the
certificates `pdmesh certs` writes carry both the serverAuth and clientAuth uses.

- Server side (`server_credentials`): TLS when `cert_file` and `key_file` are
  set; with `require_client_cert` (mTLS) a caller must present a certificate the
  `ca_file` CA signed or the handshake fails. The files are read again when they
  change (grpc asks `_CertWatcher.fetch` on every new handshake; a stat of three
  files), so a rotated certificate is served to new connections without a
  restart. A half-written rotation (key and certificate do not match, a file
  that does not parse) is ignored until it is complete.
- Client side (`ClientTls`): channels verify the server against `ca_file` and
  present `cert_file`/`key_file` when set. `server_name` overrides the name
  checked in the server's certificate (workers are reached by pod IP in
  Kubernetes; every certificate `pdmesh certs` writes names `MESH_DNS_NAME`).
  New channels pick up changed files; `ChannelCache` replaces a cached channel
  whose credentials changed.
- Identity: a mesh certificate names its role in a URI SAN, `pdmesh://<role>`,
  optionally with a worker, `pdmesh://<role>/<worker_id>`; `peer_identity`
  reads it from a call's auth context (see `services/common/mesh_authz.py`).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from services.common.config import require, setting

log = structlog.get_logger()

URI_SCHEME = "pdmesh://"
# A DNS name every `pdmesh certs` certificate carries, for --tls-server-name.
MESH_DNS_NAME = "pdmesh.internal"


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str = setting("", "PEM certificate (chain) of this process: its server and client certificate")
    key_file: str = setting("", "PEM private key of cert_file")
    ca_file: str = setting("", "PEM CA bundle that peers' certificates must chain to ('' = system roots)")
    require_client_cert: bool = setting(
        False, "mTLS: accept only callers whose certificate ca_file signed; internal RPCs need a mesh role"
    )
    server_name: str = setting(
        "", f"name checked in servers' certificates instead of the host (e.g. {MESH_DNS_NAME})"
    )

    def __post_init__(self) -> None:
        require(bool(self.cert_file) == bool(self.key_file), "tls cert_file and key_file go together")
        require(
            not self.require_client_cert or (self.ca_file and self.cert_file),
            "tls require_client_cert needs ca_file (to check callers) and cert_file/key_file",
        )
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            require(not path or os.path.isfile(path), f"tls {name}: no such file {path!r}")

    @property
    def enabled(self) -> bool:
        """Whether this process speaks TLS (as a client at least)."""
        return bool(self.cert_file or self.ca_file)

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert_file)


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


Signature = tuple[tuple[int, int, int], ...]


def _signature(paths: Sequence[str]) -> Signature:
    """What changes when any of `paths` is rewritten or swapped (a Secret update)."""
    out = []
    for p in paths:
        if not p:
            out.append((0, 0, 0))
            continue
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((-1, -1, -1))
    return tuple(out)


def check_key_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """ValueError unless `key_pem` is the private key of the first certificate in `cert_pem`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        raise ValueError("the private key does not belong to the certificate")


class _CertWatcher:
    """Server certificate configuration, re-read when its files change."""

    def __init__(self, config: TlsConfig):
        self.config = config
        self._paths = (config.cert_file, config.key_file, config.ca_file)
        self._sig = _signature(self._paths)
        self.current = self._load()
        self.reloads = 0

    def _load(self) -> Any:
        cert, key = _read(self.config.cert_file), _read(self.config.key_file)
        assert cert is not None and key is not None
        check_key_pair(cert, key)
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=_read(self.config.ca_file)
        )

    def fetch(self) -> Any:
        """grpc's fetcher: a new configuration when the files changed, else None (keep)."""
        sig = _signature(self._paths)
        if sig == self._sig:
            return None
        try:
            conf = self._load()
        except (OSError, ValueError) as e:  # mid-rotation: keep serving the old one
            log.warning("tls_reload_skipped", cert_file=self.config.cert_file, error=str(e))
            return None
        self._sig, self.current = sig, conf
        self.reloads += 1
        log.info("tls_reloaded", cert_file=self.config.cert_file)
        return conf


def server_credentials(config: TlsConfig) -> tuple[grpc.ServerCredentials, _CertWatcher]:
    """Credentials for `add_secure_port` that follow changes of the files."""
    watcher = _CertWatcher(config)
    creds = grpc.dynamic_ssl_server_credentials(
        watcher.current, watcher.fetch, require_client_authentication=config.require_client_cert
    )
    return creds, watcher


class ClientTls:
    """Channel credentials from a `TlsConfig`, rebuilt when the files change."""

    def __init__(self, config: TlsConfig):
        self.config = config
        self._paths = (config.cert_file, config.key_file, config.ca_file)
        self._sig: Signature | None = None
        self._creds: grpc.ChannelCredentials | None = None

    def credentials(self) -> tuple[grpc.ChannelCredentials, Signature]:
        """(credentials, version): the version changes whenever a file did."""
        sig = _signature(self._paths)
        if sig != self._sig or self._creds is None:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.config.ca_file),
                private_key=_read(self.config.key_file),
                certificate_chain=_read(self.config.cert_file),
            )
            self._sig = sig
        return self._creds, sig

    def version(self) -> Signature:
        return _signature(self._paths)

    def options(self) -> list[tuple[str, Any]]:
        if self.config.server_name:
            return [("grpc.ssl_target_name_override", self.config.server_name)]
        return []


def client_tls(config: TlsConfig | None) -> ClientTls | None:
    return ClientTls(config) if config is not None and config.enabled else None


def aio_channel(
    address: str,
    tls: ClientTls | None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel: TLS when `tls` is given, plaintext otherwise; `interceptors`
    (tracing's, when on) see every call."""
    chain = list(interceptors) or None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=chain)
    creds, _ = tls.credentials()
    return grpc.aio.secure_channel(address, creds, options=[*options, *tls.options()], interceptors=chain)


def sync_channel(
    address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel (CLI, launcher), TLS when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    creds, _ = tls.credentials()
    return grpc.secure_channel(address, creds, options=[*options, *tls.options()])


@dataclass(frozen=True)
class MeshIdentity:
    """Who called, from the verified client certificate: `pdmesh://<role>[/<name>]`."""

    role: str
    name: str = ""  # a worker id when the certificate names one


def parse_identity(uri: str) -> MeshIdentity | None:
    if not uri.startswith(URI_SCHEME):
        return None
    role, _, name = uri[len(URI_SCHEME) :].partition("/")
    return MeshIdentity(role, name) if role else None


def identity_uri(role: str, name: str = "") -> str:
    return f"{URI_SCHEME}{role}/{name}" if name else f"{URI_SCHEME}{role}"


def peer_identity(context: Any) -> MeshIdentity | None:
    """The caller's mesh identity, or None (plaintext, no client certificate, no pdmesh URI)."""
    auth = context.auth_context() or {}
    for raw in auth.get("peer_uri", ()):
        ident = parse_identity(raw.decode(errors="replace"))
        if ident is not None:
            return ident
    return None


def is_tls_call(context: Any) -> bool:
    auth = context.auth_context() or {}
    return b"ssl" in auth.get("transport_security_type", ())


def certified_worker(context: Any) -> str:
    """The worker id the caller's certificate names (`pdmesh://<role>/<id>`), else ""."""
    ident = peer_identity(context)
    return ident.name if ident is not None else ""


class _HttpsWatcher:
    """An ssl.SSLContext for an HTTPS server whose certificate follows its files:
    the SNI callback runs on every handshake (with or without SNI), stats the
    files and hands the connection a context made from the new ones."""

    def __init__(self, config: TlsConfig, client_ca: str = ""):
        """`client_ca`: require a client certificate that this CA bundle signed ('' = none)."""
        self.config = config
        self.client_ca = client_ca
        self._paths = (config.cert_file, config.key_file, client_ca)
        self._sig = _signature(self._paths)
        self.context = self._make()

    def _make(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.config.cert_file, self.config.key_file)
        if self.client_ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.client_ca)
        ctx.sni_callback = self._on_hello
        return ctx

    def _on_hello(self, conn: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        sig = _signature(self._paths)
        if sig != self._sig:
            try:
                self.context = self._make()
                self._sig = sig
                log.info("tls_reloaded", cert_file=self.config.cert_file)
            except (OSError, ssl.SSLError) as e:  # mid-rotation: keep the old one
                log.warning("tls_reload_skipped", cert_file=self.config.cert_file, error=str(e))
        if self.context is not ctx:
            conn.context = self.context


def https_server_context(config: TlsConfig) -> ssl.SSLContext:
    """The server-side SSLContext of an HTTPS listener (the gateway), reloaded on change."""
    return _HttpsWatcher(config).context
