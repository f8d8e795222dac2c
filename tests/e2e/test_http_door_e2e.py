"""The router process's HTTP door (--http-port) as processes on loopback (tiny model):

- SIGTERM drains it: new HTTP connections are refused or answered 503 at once,
  the stream in flight runs to its end ([DONE], every token), the router exits 0
  and the decode worker's blocks are all free again;
- several router processes share one gRPC port and one HTTP port (SO_REUSEPORT),
  each with its own worker view: connections reach both, both answer; and
  `pdmesh up --routers 2` starts them that way.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdmesh.launcher import Launcher, RunningService, ServiceSpec, flags
from pdmesh.v1 import common_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2
from tests.e2e.helpers import UpProcess, wait_until
from tests.service.gateway import httpio

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# `pdmesh up`'s line per router: name, gRPC address, metrics port.
ROUTER_LINE = re.compile(r"\s+(router(?:-\d+)?)\s+(\S+:\d+)\s+SERVING\s+metrics :(\d+)")
ROUTER = flags(health_interval_s=0.2, stats_interval_s=0.2, http_port=0)


def start_decode(launcher: Launcher) -> RunningService:
    return launcher.start_ready(
        ServiceSpec(
            "decode",
            "services.decode.main",
            flags(engine_preset="tiny", engine_num_threads=1),
            ready_service="pdmesh.v1.DecodeService",
        )
    )


def router_spec(name: str, decode: RunningService, *extra: str) -> ServiceSpec:
    return ServiceSpec(
        name,
        "services.router.main",
        ROUTER + flags(decode_workers=decode.address) + extra,
        ready_service="pdmesh.v1.RouterService",
    )


def free_blocks(decode: RunningService) -> int:
    stub = decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(decode.address))
    return stub.Stats(worker_pb2.StatsRequest(), timeout=10).load.free_blocks


def router_stats(router: RunningService) -> router_pb2.RouterServiceStatsResponse:
    stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router.internal_address))
    return stub.Stats(router_pb2.RouterServiceStatsRequest(), timeout=10)


def refused_or_503(address: str) -> bool:
    try:
        return httpio.request(address, "GET", "/health")[0] == 503
    except OSError:  # the listener is closed: a load balancer takes it as down
        return True


def test_sigterm_drains_the_http_door_and_the_stream_in_flight_finishes(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        decode = start_decode(launcher)
        router = launcher.start_ready(router_spec("router", decode, *flags(drain_grace_s=120)))
        door = router.http_address
        free = free_blocks(decode)
        tokens = 400
        body = {
            "prompt": "drain me",
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        body["stream_options"] = {"include_usage": True}
        sock = httpio.open_request(door, "/v1/completions", body)
        got = httpio.read_until(sock, b'"text":')  # tokens are flowing
        router.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refused_or_503(door), what="the door to stop taking requests")
        assert router_stats(router).inflight == 1  # the stream is still running after the refusal
        sock.settimeout(120)
        while b"data: [DONE]" not in got:
            chunk = sock.recv(65536)
            assert chunk, f"the stream was cut off: {got[-300:]!r}"
            got += chunk
        sock.close()
        events = httpio.sse_events(got[got.index(b"\r\n\r\n") + 4 :].replace(b"\r\n", b"\n"))
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == tokens
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "length"
        assert router.proc.wait(60) == 0
        wait_until(lambda: free_blocks(decode) == free, what="the decode worker to free the blocks")
    finally:
        launcher.close()


def _generate_on_a_new_connection(address: str) -> str:
    with grpc.insecure_channel(address) as ch:  # a new channel is a new TCP connection
        req = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))
        msgs = list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=60))
    return msgs[-1].final.worker_id


def test_two_routers_share_the_grpc_and_http_ports(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        decode = start_decode(launcher)
        first = launcher.start_ready(router_spec("router", decode, *flags(so_reuseport=1)))
        second = launcher.start_ready(
            router_spec(
                "router-1", decode, *flags(so_reuseport=1, port=first.port, http_port=first.http_port)
            )
        )
        assert (second.port, second.http_port) == (first.port, first.http_port)
        assert second.internal_port != first.internal_port  # each its own membership and view
        # ignore_eos: the tiny model samples its EOS as one of ~260 tokens, so without it one of
        # 24 unseeded requests ended after 1 token now and then (completion_tokens == 1).
        body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        for _ in range(24):  # the kernel spreads connections by their 4-tuple: both get some
            status, _, raw = httpio.request(first.http_address, "POST", "/v1/completions", body)
            assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
        http_counts = [router_stats(r).requests_total for r in (first, second)]
        assert all(n > 0 for n in http_counts) and sum(http_counts) == 24, http_counts
        for _ in range(24):
            assert _generate_on_a_new_connection(first.address)
        grpc_counts = [
            router_stats(r).requests_total - n for r, n in zip((first, second), http_counts, strict=True)
        ]
        assert all(n > 0 for n in grpc_counts) and sum(grpc_counts) == 24, grpc_counts
    finally:
        launcher.close()


def _requests_counted(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdmesh_gateway_requests_total{")
    )


def test_pdmesh_up_routers_2_serves_both_doors_from_two_processes(tmp_path):
    up = UpProcess(
        [
            "--router-port",
            "0",
            "--http-port",
            "0",
            "--routers",
            "2",
            "--prefill",
            "0",
            "--workdir",
            str(tmp_path / "up"),
        ]
    )
    try:
        wait_until(lambda: up.found(r"serving on (\S+) \(router\)"), timeout=300, what="pdmesh up")
        routers = {
            m.group(1): (m.group(2), int(m.group(3))) for line in up.lines if (m := ROUTER_LINE.match(line))
        }
        assert set(routers) == {"router", "router-1"}, up.output
        assert routers["router"][0] == routers["router-1"][0]  # one gRPC port
        door = up.found(r"http\s+http://(\S+)/v1").group(1)
        for _ in range(24):  # new connection each: the kernel spreads them over the two processes
            status, _, _ = httpio.request(door, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 200
        counts = [_requests_counted(port) for _, port in routers.values()]
        assert all(n > 0 for n in counts) and sum(counts) == 24, counts
    finally:
        up.stop(signal.SIGINT)  # Ctrl-C: pdmesh up drains and stops every service


def test_a_router_sharing_the_ports_is_not_ready_until_it_is_ready_itself(tmp_path):
    # The cause of a clean-clone flake: the launcher checked a router's readiness on its
    # public port, which a second router shares with the first (SO_REUSEPORT), so a check
    # that the kernel handed to the first router (SERVING) called the second ready while it
    # had no decode worker yet, and its first requests got 503. Here the second router's
    # only decode worker does not exist, so it is never ready; every check on the shared
    # port opens a new connection, and each one has even odds of reaching the first router.
    launcher = Launcher(tmp_path)
    try:
        decode = start_decode(launcher)
        first = launcher.start_ready(router_spec("router", decode, *flags(so_reuseport=1)))
        shared = flags(so_reuseport=1, port=first.port, http_port=first.http_port)
        second = launcher.start(
            ServiceSpec(
                "router-1",
                "services.router.main",
                ROUTER + flags(decode_workers="127.0.0.1:1") + shared,  # nothing listens on port 1
                ready_service="pdmesh.v1.RouterService",
            )
        )
        wait_until(
            lambda: second.internal_port is not None or launcher.poll_ready(second),
            timeout=120,
            what="router-1's port file",
        )
        assert second.port == first.port
        assert not any(launcher.poll_ready(second) for _ in range(16))
    finally:
        launcher.close()
