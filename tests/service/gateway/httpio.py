"""Tiny blocking HTTP helpers for gateway tests (stdlib only): whole requests, SSE
parsing, and a raw socket for a client that disconnects mid-answer."""

from __future__ import annotations

import http.client
import json
import re
import socket
from typing import Any


def request(
    address: str,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
):
    """(status, headers with lower-case names, body bytes)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def sse_events(body: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final "[DONE]".

    Lines end at CRLF, LF or CR only (the SSE grammar): `str.splitlines` also breaks at
    U+2028, U+0085 and other separators, which a token's text may hold unescaped in JSON."""
    out: list[Any] = []
    for line in re.split(r"\r\n|\r|\n", body.decode()):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def open_request(address: str, path: str, body: Any, rcvbuf: int | None = None) -> socket.socket:
    """Send a POST on a raw socket and return it unread (the caller hangs up when it likes).
    `rcvbuf`: the socket's receive buffer, set before connecting (so the window stays small)."""
    host, port = address.rsplit(":", 1)
    if rcvbuf is None:
        sock = socket.create_connection((host, int(port)), timeout=60)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(60)
        sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before {marker!r}; got {buf[-300:]!r}")
        buf += chunk
    return buf


def hang_up(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
