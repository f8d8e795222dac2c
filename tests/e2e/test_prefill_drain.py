"""A prefill worker told to stop (the planner's scale-down) waits for the KV it handed out (issue 20 item 3).

Dynamo's planner documents the gap: on scale-down, decodes still waiting on KV
from the removed prefill worker fail. Here the KV-transfer service and the
prefill worker are real processes; this test process is the decode worker
(a real NIXL agent registered at the KV-transfer service, the real gRPC and
NIXL transports): it gets a handle from Prefill, the prefill worker gets
SIGTERM, and only then is the KV pulled. The pull must succeed byte-exact
(the transports check the holder's block digests), the draining worker must
refuse new Prefill calls meanwhile, stay up until the handle is released,
then exit 0 with its block pool back to its free count (its drain logs
`drain_settled` only when the lease table holds no block: every held block
was given back to the engine's pool).
"""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.agents import AgentDirectory
from kvtransfer.grpc_transport import GrpcTransport
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import PoolView
from kvtransfer.testing import BlockPool
from kvtransfer.transport import BlockHandle
from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import kvtransfer_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2
from services.engine.config import EngineConfig
from services.engine.engine_spec import EngineSpec
from tests.e2e.helpers import TINY
from tests.support.poll import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

N = 64  # blocks in the receiving pool
ME = "dec-drain"


def health(address: str, service: str) -> str:
    with grpc.insecure_channel(address) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError as e:
            return e.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)


@pytest.mark.parametrize("kind", ["grpc", "nixl"])
async def test_sigterm_waits_until_the_handed_out_kv_is_pulled(tmp_path, kind):
    launcher = Launcher(tmp_path)
    channel = None
    transports = []
    try:
        kv = launcher.start_ready(
            ServiceSpec("kvtransfer", "services.kvtransfer.main", ready_service="pdmesh.v1.KvTransferService")
        )
        prefill = launcher.start_ready(
            ServiceSpec(
                "prefill",
                "services.prefill.main",
                flags(worker_id="prefill-0", kvtransfer_address=kv.address, kv_transport=kind) + TINY,
                ready_service="pdmesh.v1.PrefillService",
            )
        )
        stub = prefill_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(prefill.address))
        free0 = stub.Stats(worker_pb2.StatsRequest(), timeout=10).load.free_blocks
        # The decode side first, registered under the requester agent the lease will name (a
        # requester the directory does not know is dead, and its leases end at once).
        agent = f"{ME}-{os.getpid()}-{kind}"
        layout = EngineSpec.resolve(EngineConfig(preset="tiny")).layout  # the worker's (TINY) KV shape
        channel = grpc.aio.insecure_channel(kv.address)
        directory = AgentDirectory(kvtransfer_pb2_grpc.KvTransferServiceStub(channel), max_age_s=3600)
        pool = PoolView(layout.allocate_pool(N), layout)
        nixl = NixlTransport(agent, pool, directory, worker_id=ME)
        transports.append(nixl)
        await nixl.start()
        transport = nixl
        if kind == "grpc":
            transport = GrpcTransport(agent, pool, worker_id=ME)
            transports.append(transport)

        req = prefill_pb2.PrefillRequest(
            request_id="held-1",
            prompt_token_ids=[(7 * i + 3) % 250 for i in range(70)],  # several blocks
            requester_id=ME,
            requester_agent=agent,
        )
        req.sampling.max_tokens = 8
        resp = stub.Prefill(req, timeout=60)
        handle = BlockHandle.from_proto(resp.handle)
        assert handle.block_ids, "the prefill holds KV under a lease"
        held = stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        assert held.leases.held == 1 and held.load.free_blocks == free0 - len(handle.block_ids)

        prefill.proc.send_signal(signal.SIGTERM)  # the planner's scale-down of this worker
        wait_until(
            lambda: health(prefill.address, "pdmesh.v1.PrefillService") == "NOT_SERVING",
            what="the prefill worker to start draining",
        )
        with pytest.raises(grpc.RpcError) as refused:  # the drain takes no new prompts
            stub.Prefill(
                prefill_pb2.PrefillRequest(request_id="late", prompt_token_ids=[1, 2, 3]), timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert prefill.proc.poll() is None, "the worker stopped with a handle still out"

        blocks = BlockPool(N)
        dst = blocks.alloc(len(handle.block_ids))
        stats = await transport.pull(
            handle, list(handle.block_ids), dst, deadline_s=20.0, on_failure=lambda: blocks.free(dst)
        )
        assert stats.blocks == len(handle.block_ids)  # and the digests matched (else it raised)
        blocks.free(dst)
        assert blocks.num_free == N

        # Pulled -> released (gRPC: release_after on the read; NIXL: the done notification):
        # only now does the drain finish, and the worker exits cleanly.
        wait_until(lambda: prefill.proc.poll() is not None, timeout=60, what="the drained worker to exit")
        assert prefill.proc.returncode == 0, prefill.log_tail()
        log = prefill.log_path.read_text()
        assert "drain_waits_for_leases" in log and "drain_settled" in log, prefill.log_tail()
        assert "drain_settle_expired" not in log  # settled = every held block back in the pool
    finally:
        for t in transports:
            await t.close()
        if channel is not None:
            await channel.close()
        launcher.close()
