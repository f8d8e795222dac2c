"""`python -m services.gateway.healthcheck [URL]`: exit 0 only when the gateway's
/health answers 200 (its router is SERVING). The gateway's counterpart of
`pdmesh health` (which speaks grpc.health.v1), for container healthchecks.
An https URL is verified against PDMESH_TLS_CA_FILE (the TLS variant's env)."""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def http_ready(url: str, timeout: float = 3.0, ca_file: str | None = None) -> tuple[bool, str]:
    """(answered 200, short status text); https URLs are checked against `ca_file`."""
    context = ssl.create_default_context(cafile=ca_file or None) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status == 200, str(resp.status)
    except urllib.error.HTTPError as e:
        return False, str(e.code)
    except (urllib.error.URLError, OSError) as e:
        return False, f"unreachable ({getattr(e, 'reason', e)})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    url = args[0] if args else DEFAULT_URL
    ok, status = http_ready(url, ca_file=os.environ.get("PDMESH_TLS_CA_FILE"))
    print(f"{url}: {'SERVING' if ok else 'NOT_SERVING'} ({status})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
