"""`python -m services.gateway.healthcheck [URL]`: exit 0 only when the gateway's
/health answers 200 (its router is SERVING). The gateway's counterpart of
`pdmesh health` (which speaks grpc.health.v1), for container healthchecks.
An https URL is verified against PDMESH_TLS_CA_FILE (the TLS variant's env)."""

from __future__ import annotations

import os
import sys

from services.common.http_probe import http_ready

DEFAULT_URL = "http://127.0.0.1:8000/health"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    url = args[0] if args else DEFAULT_URL
    ok, status = http_ready(url, ca_file=os.environ.get("PDMESH_TLS_CA_FILE"))
    print(f"{url}: {'SERVING' if ok else 'NOT_SERVING'} ({status})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
