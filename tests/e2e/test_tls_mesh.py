"""A whole mesh as real processes with mTLS everywhere and tenant API keys.

kvtransfer, a prefill worker, a decode worker (with a per-worker certificate,
pdmesh://decode/decode-0) and a router, each with its own certificate from
`pdmesh certs`, the gRPC KV transport (so the KV bytes go over the TLS channels),
and the router's keys file from `pdmesh keys add`. Requests must take the remote
prefill path (Prefill, ReadBlocks and Release between the workers over mTLS), and
answer the same as locally; the router serves a "client" certificate with a key and
refuses one without; outsiders are refused by the workers; with per-worker
certificates another decode worker can neither take, read nor release a handle.
"""

from __future__ import annotations

import grpc
import pytest

from kvtransfer.grpc_transport import READ_BLOCKS
from pdmesh.cli import main as cli
from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)
from services.common.tls import TlsConfig, client_tls, sync_channel
from services.router.auth import append_entry, new_key
from tests.e2e.helpers import TINY, generate, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def tls_env(certs, name: str, mtls: bool = True) -> dict[str, str]:
    env = {
        "PDMESH_TLS_CERT_FILE": str(certs / f"{name}.pem"),
        "PDMESH_TLS_KEY_FILE": str(certs / f"{name}-key.pem"),
        "PDMESH_TLS_CA_FILE": str(certs / "ca.pem"),
    }
    if mtls:
        env["PDMESH_TLS_REQUIRE_CLIENT_CERT"] = "1"
    return env


def role_tls(certs, name: str) -> TlsConfig:
    return TlsConfig(
        cert_file=str(certs / f"{name}.pem"),
        key_file=str(certs / f"{name}-key.pem"),
        ca_file=str(certs / "ca.pem"),
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls-mesh")
    certs = root / "certs"
    assert (
        cli(["certs", "--out", str(certs), "--worker", "decode/decode-0", "--worker", "decode/decode-1"]) == 0
    )
    keys = certs / "api-keys.jsonl"
    key = new_key()
    append_entry(str(keys), "acme", key, max_priority=0)
    launcher = Launcher(root / "run", tls=role_tls(certs, "client"))
    try:
        kv = launcher.start_ready(
            ServiceSpec(
                "kvtransfer",
                "services.kvtransfer.main",
                env=tls_env(certs, "kvtransfer"),
                ready_service="pdmesh.v1.KvTransferService",
            )
        )
        common = flags(kvtransfer_address=kv.address, kv_transport="grpc") + TINY
        prefill = launcher.start_ready(
            ServiceSpec(
                "prefill-0",
                "services.prefill.main",
                flags(worker_id="prefill-0") + common,
                env=tls_env(certs, "prefill"),
                ready_service="pdmesh.v1.PrefillService",
            )
        )
        decode = launcher.start_ready(
            ServiceSpec(
                "decode-0",
                "services.decode.main",
                flags(worker_id="decode-0", prefill_workers=[prefill.address]) + common,
                env=tls_env(certs, "decode-decode-0"),
                ready_service="pdmesh.v1.DecodeService",
            )
        )
        router = launcher.start_ready(
            ServiceSpec(
                "router",
                "services.router.main",
                flags(
                    decode_workers=[decode.address],
                    prefill_workers=[prefill.address],
                    api_keys_file=str(keys),
                    health_interval_s=0.2,
                    stats_interval_s=0.2,
                ),
                env=tls_env(certs, "router"),
                ready_service="pdmesh.v1.RouterService",
            )
        )
        yield certs, key, kv, prefill, decode, router
    finally:
        launcher.close()


def test_remote_prefill_over_mtls_equals_local(mesh):
    certs, _, _, prefill, decode, _ = mesh
    with sync_channel(decode.address, client_tls(role_tls(certs, "router"))) as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        prompt = list(range(40, 100))
        local, lf = generate(stub, prompt, request_id="local", mode=decode_pb2.DISAGG_MODE_LOCAL)
        remote, rf = generate(
            stub, [*prompt[:-1], 7], request_id="remote", mode=decode_pb2.DISAGG_MODE_REMOTE
        )
        again, af = generate(stub, prompt, request_id="remote-2", mode=decode_pb2.DISAGG_MODE_REMOTE)
    assert (lf.prefill_path, rf.prefill_path, af.prefill_path) == ("local", "remote", "remote")
    assert again == local and len(remote) == 16
    with sync_channel(prefill.address, client_tls(role_tls(certs, "router"))) as ch:
        # Every handle was issued, pulled and given back over mTLS (Release may trail the answer).
        leases = wait_until(lambda: (s := prefill_stats(ch).leases).held == 0 and s, what="leases released")
    assert leases.issued == 2 and leases.pulled == 2


def prefill_stats(channel) -> worker_pb2.StatsResponse:
    return prefill_pb2_grpc.PrefillServiceStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)


def test_router_serves_a_client_certificate_with_an_api_key(mesh):
    certs, key, *_, router = mesh
    with sync_channel(router.address, client_tls(role_tls(certs, "client"))) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        req = router_pb2.GenerateRequest(
            text="hello over mtls", sampling=common_pb2.SamplingParams(max_tokens=8), priority=5
        )
        msgs = list(stub.Generate(req, timeout=60, metadata=(("authorization", f"Bearer {key}"),)))
        assert msgs[-1].final.usage.completion_tokens == 8
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:  # membership is not served on the public port
            stub.RegisterWorker(router_pb2.RegisterWorkerRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_workers_refuse_outsiders_and_public_certificates(mesh):
    certs, _, _, prefill, decode, _ = mesh
    stats = worker_pb2.StatsRequest()
    no_cert = client_tls(TlsConfig(ca_file=str(certs / "ca.pem")))
    with sync_channel(decode.address, no_cert) as ch, pytest.raises(grpc.RpcError) as e:
        decode_pb2_grpc.DecodeServiceStub(ch).Stats(stats, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with sync_channel(decode.address, None) as ch, pytest.raises(grpc.RpcError) as e:
        decode_pb2_grpc.DecodeServiceStub(ch).Stats(stats, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with (
        sync_channel(prefill.address, client_tls(role_tls(certs, "client"))) as ch,
        pytest.raises(grpc.RpcError) as e,
    ):
        prefill_stats(ch)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_kv_handle_is_usable_only_by_the_worker_its_certificate_names(mesh):
    """Per-worker certificates: decode-1 can neither take, read nor release decode-0's handle."""
    certs, _, _, prefill, decode, _ = mesh
    as_0 = client_tls(role_tls(certs, "decode-decode-0"))
    as_1 = client_tls(role_tls(certs, "decode-decode-1"))
    with sync_channel(decode.address, client_tls(role_tls(certs, "router"))) as ch:
        agent = decode_pb2_grpc.DecodeServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10).info
    req = prefill_pb2.PrefillRequest(
        request_id="owned",
        prompt_token_ids=list(range(50, 90)),
        sampling=common_pb2.SamplingParams(max_tokens=4),
        requester_id="decode-0",
        requester_agent=agent.kv_agent_name,  # required since issue 13: its death ends the lease
    )
    with sync_channel(prefill.address, as_1) as ch, pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(req, timeout=60)  # asking in decode-0's name
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "decode-1" in e.value.details()
    with sync_channel(prefill.address, as_0) as ch:
        handle = prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(req, timeout=60).handle
    assert handle.issued_to == "decode-0"
    read = kvtransfer_pb2.ReadBlocksRequest(handle_id=handle.handle_id, requester_id="decode-0")
    release = prefill_pb2.ReleaseRequest(handle_id=handle.handle_id)
    with sync_channel(prefill.address, as_1) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(ch.unary_stream(READ_BLOCKS, request_serializer=read.SerializeToString)(read, timeout=30))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillServiceStub(ch).Release(release, timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with sync_channel(prefill.address, as_0) as ch:
        assert prefill_pb2_grpc.PrefillServiceStub(ch).Release(release, timeout=10).released
