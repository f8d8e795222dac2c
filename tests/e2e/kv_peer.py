"""A KV holder in its own OS process, for the cross-process tests and the benchmark.

    python -m tests.e2e.kv_peer --kv-service HOST:PORT --name AGENT --port-file F [...]

It allocates a pool in the given layout, fills every block with deterministic
bytes for `--seed` (see kvtransfer.testing), registers a NIXL agent with the
KV-transfer service, serves KvSource on port 0 and writes {port, pid, agent,
incarnation} to the port file. It then answers JSON-line commands on stdin
with JSON lines on stdout (one reply per command, in order):

  {"op": "export", "handle_id", "block_ids", "issued_to", "requester_agent", "ttl_s"}
        -> {"handle": base64 KvHandle, "checksum": sha256 of the blocks}
  {"op": "state"}                       -> {"free": n, "counters": {...}}
  {"op": "wait_free", "free": n, "timeout_s": t} -> {"ok": bool, "free": n}
  {"op": "release", "handle_id"}        -> {"released": bool}
  {"op": "quit"}                        -> {"bye": true}, then exits

Test-only faults: `--stall-grpc-after-first-chunk` makes every ReadBlocks stream
stop after its first chunk (and print {"event": "stalled"}); `--stall-nixl`
runs NIXL over TCP and never progresses its worker (no progress thread, no
notification loop), so a READ from this process stays in flight until the
process dies.

`Peer` (below) is the parent's handle on such a process.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.poll import eventually, wait_until

REPO = Path(__file__).resolve().parents[2]


def parse_layout(text: str):
    from kvtransfer.layout import KvLayout

    # "layers,heads,dim,dtype,block[,quant]" (quant: kvtransfer.layout.KV_QUANT, default none)
    layers, heads, dim, dtype, block, *quant = text.split(",")
    return KvLayout(int(layers), int(heads), int(dim), dtype, int(block), *quant)


_control = sys.stdout  # replaced in main() by a private copy of fd 1


def _emit(obj: dict) -> None:
    _control.write(json.dumps(obj) + "\n")
    _control.flush()


async def _serve(args: argparse.Namespace) -> None:
    import grpc

    from kvtransfer.agents import AgentDirectory
    from kvtransfer.grpc_transport import KvSourceServicer, add_kv_source
    from kvtransfer.leases import LeaseKeeper, LeaseManager
    from kvtransfer.nixl_transport import NixlConfig, NixlTransport
    from kvtransfer.pool import PoolView
    from kvtransfer.testing import BlockPool, checksum, fill_blocks
    from kvtransfer.transport import BlockHandle
    from pdmesh.v1 import kvtransfer_pb2_grpc
    from services.common.server import MeshServer, ServerConfig

    layout = parse_layout(args.layout)
    view = PoolView(layout.allocate_pool(args.num_blocks), layout)
    fill_blocks(view, args.seed)
    blocks = BlockPool(args.num_blocks)
    changed = asyncio.Event()
    leases = LeaseManager(default_ttl_s=args.lease_ttl_s)
    channel = grpc.aio.insecure_channel(args.kv_service)
    directory = AgentDirectory(
        kvtransfer_pb2_grpc.KvTransferServiceStub(channel), lease_ms=args.agent_lease_ms
    )

    never = asyncio.Event()

    async def stall_after_first_chunk(sent_bytes: int) -> None:
        _emit({"event": "stalled", "sent_bytes": sent_bytes})
        await never.wait()  # until the test kills this process

    server = MeshServer(ServerConfig(port=0, max_message_bytes=64 * 1024 * 1024), "pdmesh.v1.KvSourceService")
    source = KvSourceServicer(
        view,
        leases,
        default_chunk_bytes=args.chunk_bytes,
        on_chunk=stall_after_first_chunk if args.stall_grpc_after_first_chunk else None,
    )
    add_kv_source(server.server, source)
    await server.start()
    transport = NixlTransport(
        args.name,
        view,
        directory,
        worker_id=args.worker_id,
        config=NixlConfig(progress_thread=args.progress_thread),
    )
    await transport.start(kv_source_address=server.address)
    if not args.stall_nixl:  # the notification loop is also what progresses our NIXL worker
        transport.attach_source(leases)
    keeper = LeaseKeeper(leases, directory, interval_s=0.05, liveness_interval_s=0.2)
    keeper.start()
    info = {
        "port": server.port,
        "pid": os.getpid(),
        "agent": args.name,
        "incarnation": directory.own.incarnation,
    }
    tmp = args.port_file + ".tmp"
    Path(tmp).write_text(json.dumps(info))
    os.replace(tmp, args.port_file)

    def freer(ids: list[int]):
        def free() -> None:
            blocks.free(ids)
            changed.set()

        return free

    async def handle(cmd: dict) -> dict:
        op = cmd["op"]
        if op == "export":
            ids = blocks.take(cmd["block_ids"])
            lease = leases.issue(
                cmd["handle_id"],
                ids,
                cmd.get("issued_to", ""),
                cmd.get("requester_agent", ""),
                cmd.get("ttl_s"),
                on_free=freer(ids),
            )
            h = BlockHandle(
                handle_id=cmd["handle_id"],
                agent_name=args.name,
                layout=layout,
                block_ids=tuple(ids),
                num_tokens=len(ids) * layout.block_size,
                kv_source_address=server.address,
                issued_to=lease.issued_to,
                lease_expires_unix_ms=lease.expires_unix_ms,
            )
            wire = h.to_proto(model_id="test").SerializeToString()
            return {"handle": base64.b64encode(wire).decode(), "checksum": checksum(view, ids)}
        if op == "state":
            return {"free": blocks.num_free, "counters": leases.counters.__dict__}
        if op == "wait_free":
            deadline = time.monotonic() + cmd.get("timeout_s", 10.0)
            while blocks.num_free != cmd["free"] and time.monotonic() < deadline:
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
            return {"ok": blocks.num_free == cmd["free"], "free": blocks.num_free}
        if op == "release":
            return {"released": leases.release(cmd["handle_id"])}
        if op == "quit":
            return {"bye": True}
        return {"error": f"unknown op {op!r}"}

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        try:
            reply = await handle(cmd)
        except Exception as e:  # report to the parent instead of dying silently
            reply = {"error": f"{type(e).__name__}: {e}"}
        _emit(reply)
        if cmd["op"] == "quit":
            break
    await keeper.stop()
    leases.close()
    await transport.close()
    await server.stop()
    await channel.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="KV holder process for tests and benchmarks")
    p.add_argument("--kv-service", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--worker-id", default="holder")
    p.add_argument("--port-file", required=True)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--layout", default="2,2,16,float32,4", help="layers,kv_heads,head_dim,dtype,block_size")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lease-ttl-s", type=float, default=30.0)
    p.add_argument("--agent-lease-ms", type=int, default=2000)
    p.add_argument("--chunk-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--stall-grpc-after-first-chunk", action="store_true")
    p.add_argument("--stall-nixl", action="store_true")
    p.add_argument("--progress-thread", action="store_true", help="NIXL progress thread (busy core)")
    args = p.parse_args(argv)
    # Replies own stdout; NIXL/UCX and anything else that prints goes to stderr.
    global _control
    _control = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if args.stall_nixl:
        # TCP needs the holder's own progress to serve a READ; with no progress
        # thread and no polling, a READ from us can only end when we die.
        os.environ["UCX_TLS"] = "tcp"
    from services.common.logging import configure_logging

    configure_logging("kv_peer", "warning")
    import uvloop

    uvloop.run(_serve(args))


class Peer:
    """Parent side: start a kv_peer process, send commands, kill it."""

    def __init__(self, tmp: Path, kv_service: str, name: str, *extra: str, seed: int = 1, **opts: object):
        self.name = name
        self.port_file = tmp / f"{name}-{time.monotonic_ns()}.json"
        cmd = [sys.executable, "-m", "tests.e2e.kv_peer", "--kv-service", kv_service, "--name", name]
        cmd += ["--port-file", str(self.port_file), "--seed", str(seed)]
        for k, v in opts.items():
            cmd += ["--" + k.replace("_", "-"), str(v)]
        cmd += list(extra)
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.info: dict = {}

    def _started_or_exited(self) -> bool:
        return self.port_file.exists() or self.proc.poll() is not None

    def _read_info(self) -> dict:
        if not self.port_file.exists():
            raise RuntimeError(f"kv_peer {self.name} exited with {self.proc.returncode}")
        self.info = json.loads(self.port_file.read_text())
        return self.info

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        wait_until(self._started_or_exited, timeout=timeout_s, what=f"kv_peer {self.name}'s port file")
        return self._read_info()

    async def ready(self, timeout_s: float = 60.0) -> dict:
        """`wait_ready` for async callers: the event loop (heartbeats!) keeps running."""
        await eventually(self._started_or_exited, timeout=timeout_s, what=f"kv_peer {self.name}'s port file")
        return self._read_info()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.info['port']}"

    def _send(self, cmd: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kv_peer {self.name} closed its stdout (exit {self.proc.poll()})")
        return json.loads(line)

    async def request(self, **cmd: object) -> dict:
        """Send a command and await its reply without blocking the event loop."""
        self._send(cmd)
        reply = await asyncio.to_thread(self._read)
        if "error" in reply:
            raise RuntimeError(f"kv_peer {self.name}: {reply['error']}")
        return reply

    async def next_event(self) -> dict:
        return await asyncio.to_thread(self._read)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.wait(timeout=15)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


if __name__ == "__main__":
    main()
