"""The kubernetes actuator against a local stand-in for the API server.

There is no Kubernetes API server on these machines. The stand-in below speaks
the `scale` subresource as the Kubernetes API reference (apps/v1, "read scale"
and "patch scale" of a Deployment) defines it: GET and PATCH on
/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale, an
autoscaling/v1 `Scale` object in the response, PATCH bodies in one of the
patch content types, a v1 `Status` with code 404 for a missing Deployment and
401 without the bearer token. The client is the official `kubernetes` package,
unchanged.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.planner.actuators import ActuatorError, KubernetesActuator, KubernetesConfig

PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
TOKEN = "test-token"


class FakeApiServer:
    def __init__(self, deployments: dict[tuple[str, str], int]):
        self.replicas = dict(deployments)
        self.requests: list[tuple[str, str, str, object]] = []  # method, path, content type, body
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": message,
                        "reason": reason,
                        "code": code,
                    },
                )

            def _scale(self, ns: str, name: str) -> dict:
                n = api.replicas[(ns, name)]
                return {
                    "kind": "Scale",
                    "apiVersion": "autoscaling/v1",
                    "metadata": {"name": name, "namespace": ns, "resourceVersion": "1"},
                    "spec": {"replicas": n},
                    "status": {"replicas": n, "selector": f"app={name}"},
                }

            def _route(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                ctype = self.headers.get("Content-Type", "")
                api.requests.append((method, self.path, ctype, body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._status(401, "Unauthorized", "Unauthorized")
                m = PATH.match(self.path.split("?")[0])
                if not m:
                    return self._status(404, "NotFound", "the server could not find the requested resource")
                ns, name = m.groups()
                if (ns, name) not in api.replicas:
                    return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
                if method == "PATCH":
                    if ctype == "application/json-patch+json":
                        for op in body:
                            assert op["op"] == "replace" and op["path"] == "/spec/replicas"
                            api.replicas[(ns, name)] = int(op["value"])
                    elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                        api.replicas[(ns, name)] = int(body["spec"]["replicas"])
                    else:
                        return self._status(415, "UnsupportedMediaType", f"unsupported media type {ctype!r}")
                self._send(200, self._scale(ns, name))

            def do_GET(self):
                self._route("GET")

            def do_PATCH(self):
                self._route("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api():
    with FakeApiServer({("mesh", "pdmesh-prefill"): 1, ("mesh", "pdmesh-decode"): 2}) as server:
        yield server


def actuator(url: str, token: str = TOKEN, **kw) -> KubernetesActuator:
    return KubernetesActuator(KubernetesConfig(namespace="mesh", api_host=url, api_token=token, **kw))


async def test_reads_and_patches_the_scale_subresource(api):
    act = actuator(api.url)
    assert await act.replicas() == {"prefill": 1, "decode": 2}
    await act.scale("decode", 3)
    assert api.replicas[("mesh", "pdmesh-decode")] == 3
    assert api.replicas[("mesh", "pdmesh-prefill")] == 1
    method, path, ctype, body = api.requests[-1]
    assert (method, path) == ("PATCH", "/apis/apps/v1/namespaces/mesh/deployments/pdmesh-decode/scale")
    assert ctype == "application/json-patch+json"
    assert body == [{"op": "replace", "path": "/spec/replicas", "value": 3}]
    assert await act.replicas() == {"prefill": 1, "decode": 3}


async def test_a_missing_deployment_is_an_actuator_error(api):
    act = actuator(api.url, decode_deployment="nope")
    with pytest.raises(ActuatorError, match="404"):
        await act.scale("decode", 2)


async def test_a_wrong_token_is_an_actuator_error(api):
    with pytest.raises(ActuatorError, match="401"):
        await actuator(api.url, token="wrong").replicas()


async def test_an_unknown_role_is_refused_before_any_call(api):
    with pytest.raises(ValueError, match="unknown role"):
        await actuator(api.url).scale("router", 2)
    assert api.requests == []
