"""uvicorn's HTTP/1.1 protocol, with the moment a request's head was parsed.

A request's clock should start when the server has the request, not when its handler
first runs: on a busy event loop the task uvicorn creates for a request waits its turn
behind the loop's other work, and a clock started in the handler hides that wait from
the TTFT metric (BENCHMARKS.md, session 17: under the side by side's load, several
milliseconds per request). `RequestClockProtocol` stamps ``scope[RECEIVED_AT]``
(``time.monotonic()``) as the head is parsed; the app starts its clock there and counts
the wait in `pdmesh_gateway_queue_seconds`. Without httptools (uvicorn's h11 fallback)
there is no stamp and the app's clock starts in the handler, as before.
"""

from __future__ import annotations

import time
from typing import Any

RECEIVED_AT = "pdmesh.received_at"  # ASGI scope key: monotonic seconds at the parsed head

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn serves with h11 and nothing stamps the scope
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


if HttpToolsProtocol is not None:

    class RequestClockProtocol(HttpToolsProtocol):  # type: ignore[valid-type,misc]
        def on_headers_complete(self) -> None:
            # The scope exists since on_message_begin; uvicorn builds the request's task
            # from it in the call below, so the stamp is there before any app code runs.
            self.scope[RECEIVED_AT] = time.monotonic()  # type: ignore[literal-required]
            super().on_headers_complete()


def http_protocol() -> Any:
    """The `http=` setting for `uvicorn.Config`: the stamping protocol, or uvicorn's choice."""
    return RequestClockProtocol if HttpToolsProtocol is not None else "auto"
