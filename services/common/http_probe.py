"""`http_ready`: one HTTP readiness probe (GET, 200 = ready) for whoever waits on an HTTP door.

The launcher waits on the HTTP door with it, the gateway's container
healthcheck (`python -m services.gateway.healthcheck`) runs it, tests poll with
it; it imports nothing of ours.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request


def http_ready(url: str, timeout: float = 3.0, ca_file: str | None = None) -> tuple[bool, str]:
    """(answered 200, short status text: the code, and on an error the first line of the
    body, e.g. "503 no_progress: ..."); https URLs are checked against `ca_file`."""
    context = ssl.create_default_context(cafile=ca_file or None) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status == 200, str(resp.status)
    except urllib.error.HTTPError as e:
        # A worker's /readyz says why it is not ready in its body ("no_progress: ...").
        try:
            reason = e.read(256).decode("utf-8", "replace").strip()
        except OSError:
            reason = ""
        return False, f"{e.code} {reason}" if reason else str(e.code)
    except (urllib.error.URLError, OSError) as e:
        return False, f"unreachable ({getattr(e, 'reason', e)})"
