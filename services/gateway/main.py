"""`python -m services.gateway.main`: the OpenAI-compatible HTTP gateway process.

    python -m services.gateway.main --port 0 --port-file F --router-address HOST:PORT \
        [--served-model-name builtin-tiny] [--model-path DIR]

Serves /v1/completions, /v1/chat/completions, /v1/models, /health (200 when the
router reports pdmesh.v1.RouterService SERVING, else 503) and /metrics under
uvicorn on one port. The socket is bound here (so port 0 works) and the port
file (`{"port", "metrics_port", "pid"}`, like the gRPC services') is written
once uvicorn is accepting. SIGTERM: uvicorn stops accepting, lets in-flight
requests finish for up to `--drain-grace-s`, then exits. Every flag also reads
a `PDMESH_*` environment variable (`--help` lists them); logs are JSON lines.

`pdmesh up`, compose and the k8s manifests do not run this process: the router
serves the same app itself, in-process (`--http-port`, services/router/http_door.py),
which saves a process and a gRPC hop per token. This main stays for an HTTP front
in a process of its own, and for bench/front_ab.py's before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from services.common.config import ConfigError, add_arguments, build
from services.common.logging import configure_logging
from services.common.server import run
from services.common.tls import TlsConfig, https_server_context
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.protocol import http_protocol


def write_port_file(path: str, port: int) -> None:
    """Atomically write the bound port (metrics are served on the same port)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"port": port, "metrics_port": port, "pid": os.getpid()}, f)
    os.replace(tmp, path)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the parent process its port once it accepts."""

    def __init__(self, config: uvicorn.Config, port: int, port_file: str):
        super().__init__(config)
        self._port = port
        self._port_file = port_file

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # SIGTERM is the normal way to stop: drain, then exit 0 (uvicorn re-raises it, exiting -15).
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit and self._port_file:
            write_port_file(self._port_file, self._port)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def serve(config: GatewayConfig, tls: TlsConfig | None = None) -> None:
    log = configure_logging("gateway", config.log_level)
    sock = bind(config.host, config.port)
    port = sock.getsockname()[1]
    uv_config = uvicorn.Config(
        create_app(config, tls=tls),
        log_config=None,
        access_log=False,  # one structured line per request comes from the app
        lifespan="on",
        timeout_graceful_shutdown=config.drain_grace_s,
        proxy_headers=False,
        http=http_protocol(),  # stamps when a request's head was parsed (the TTFT clock)
    )
    https = tls is not None and tls.serves_tls
    if https:
        assert tls is not None
        uv_config.load()
        uv_config.ssl = https_server_context(tls)  # follows the certificate files
    log.info(
        "serving",
        service="gateway",
        address=f"{'https' if https else 'http'}://{config.host}:{port}",
        router=config.router_address,
    )
    await _Server(uv_config, port, config.port_file).serve(sockets=[sock])
    log.info("stopped", service="gateway")


CONFIGS: tuple[tuple[type, str], ...] = ((GatewayConfig, ""), (TlsConfig, "tls_"))


def make_parser() -> argparse.ArgumentParser:
    """The flags of this service, one per field of CONFIGS (docs/CONFIG.md is made from them)."""
    parser = argparse.ArgumentParser(
        prog="pdmesh-gateway", description="pdmesh OpenAI-compatible HTTP gateway"
    )
    for cls, prefix in CONFIGS:
        add_arguments(parser, cls, prefix)
    return parser


def parse(
    argv: Sequence[str] | None = None, env: dict[str, str] | None = None
) -> tuple[GatewayConfig, TlsConfig]:
    args = make_parser().parse_args(argv)
    env = dict(os.environ) if env is None else env
    return build(GatewayConfig, args, env), build(TlsConfig, args, env, "tls_")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, tls = parse(argv)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    run(lambda: serve(config, tls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
