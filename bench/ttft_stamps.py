"""Where the client's TTFT goes, pdmesh and Dynamo on the same load (issue 16).

The side by side (bench/peers/dynamo/run.py) reads each front's own TTFT metric, but the
two fronts start their clocks at different points (pdmesh's HTTP door once uvicorn has
parsed the request's head), so "front to client" gaps do not compare. This runs
bench/profile_front_dynamo.py's load (500 Mooncake requests at x4, kv_aware, 4 sim
workers / 4 Dynamo mockers, as run.py deploys them) against one system at a time, the
client stamping: connect (asyncio.open_connection), request written, response headers
parsed, first token chunk. It prints each segment's mean / p50 / p90 per system and the
client TTFT ratio (Dynamo / pdmesh, as run.py's).

Run: `python bench/ttft_stamps.py [--requests 500]` (needs bench/peers/dynamo/setup.sh).
Last line: `ttft_stamps ttft_mean_ratio=.. ttft_p50_ratio=.. connect_ms_pdmesh=.. connect_ms_dynamo=..`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

import h11

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import run_load
from bench.peers.dynamo import run as D
from bench.profile_front import cpu_model
from bench.profile_front_dynamo import side_by_side_load

SEGMENTS = ("connect", "write", "to headers", "headers -> first token", "client TTFT")
FRONT_TTFT = {
    "pdmesh": "pdmesh_gateway_ttft_seconds",
    "dynamo": "dynamo_frontend_time_to_first_token_seconds",
}


class StampedClient(D.HttpClient):
    """run.py's client, with the time of each step of a request's exchange kept."""

    def __init__(self, base_url: str, model: str):
        super().__init__(base_url, model)
        self.stamps: list[tuple[dict[str, float], object]] = []

    async def _exchange(self, rec, item, clock) -> None:
        st = {"send": rec.send_s}
        conn = h11.Connection(h11.CLIENT)
        request = self._request(conn, item)
        reader, writer = await asyncio.open_connection(self.host, self.port)
        st["connected"] = clock()
        try:
            writer.write(request)
            await writer.drain()
            st["written"] = clock()
            next_event = conn.next_event

            def stamped():
                event = next_event()
                if isinstance(event, h11.Response) and "headers" not in st:
                    st["headers"] = clock()
                return event

            conn.next_event = stamped
            await self._read_response(conn, reader, rec, clock)
            self.stamps.append((st, rec))
        finally:
            writer.close()


def metric_mean_ms(url: str, name: str) -> float:
    total = count = None
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(name + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count = float(line.split()[-1])
    return total / count * 1e3 if total is not None and count else float("nan")


def one_system(system: str, requests: int, dynamo_python: Path) -> dict[str, list[float]]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-stamps-{system}-"))
    folder = tmp / "model"
    D.write_folder(folder, D.DEFAULT_VOCAB)
    setup = D.Setup(4, 16, 16384, 1.0, 256, 8192, folder, dynamo_python)
    dep = D.start_pdmesh(setup, "kv", tmp) if system == "pdmesh" else D.start_dynamo(setup, "kv", tmp)
    try:
        items = side_by_side_load(requests)
        client = StampedClient(dep.url, D.MODEL_NAME)
        span = items[-1].arrival_s
        recs = asyncio.run(
            run_load(items, client, max_requests=len(items), max_duration_s=span + 1.0, timeout_s=60)
        )
        front = metric_mean_ms(
            dep.metrics_urls[0] if dep.metrics_urls else dep.metrics_url, FRONT_TTFT[system]
        )
    finally:
        dep.stop()
    segs: dict[str, list[float]] = {k: [] for k in SEGMENTS}
    for st, rec in client.stamps:
        if not rec.ok or not rec.token_times_s:
            continue
        first = rec.token_times_s[0]
        segs["connect"].append(st["connected"] - st["send"])
        segs["write"].append(st["written"] - st["connected"])
        segs["to headers"].append(st["headers"] - st["written"])
        segs["headers -> first token"].append(first - st["headers"])
        segs["client TTFT"].append(first - st["send"])
    print(
        f"{system}: ok {sum(r.ok for r in recs)}/{len(recs)}; the front's own TTFT metric, mean {front:.2f} ms"
    )
    for k, v in segs.items():
        v = sorted(v)
        print(
            f"  {k:24s} mean {statistics.mean(v) * 1e3:8.2f}  p50 {pct(v, 0.5) * 1e3:8.2f}  p90 {pct(v, 0.9) * 1e3:8.2f} ms"
        )
    return segs


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(int(len(sorted_values) * q), len(sorted_values) - 1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--dynamo-venv", type=Path, default=Path(__file__).parent / "peers" / "dynamo" / ".venv")
    a = p.parse_args(argv)
    dynamo_python = a.dynamo_venv.absolute() / "bin" / "python"
    if not dynamo_python.exists():
        print(f"no Dynamo venv at {a.dynamo_venv}: run bench/peers/dynamo/setup.sh first", file=sys.stderr)
        return 2
    print(f"cpu: {cpu_model()} x{os.cpu_count()}; load avg {os.getloadavg()[0]:.1f}")
    got = {s: one_system(s, a.requests, dynamo_python) for s in ("pdmesh", "dynamo")}
    pd, dy = got["pdmesh"]["client TTFT"], got["dynamo"]["client TTFT"]
    mean_ratio = statistics.mean(dy) / statistics.mean(pd)
    p50_ratio = pct(sorted(dy), 0.5) / pct(sorted(pd), 0.5)
    print(
        f"client TTFT, Dynamo / pdmesh: mean {mean_ratio:.2f}, p50 {p50_ratio:.2f}; load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"ttft_stamps ttft_mean_ratio={mean_ratio:.2f} ttft_p50_ratio={p50_ratio:.2f} "
        f"connect_ms_pdmesh={statistics.mean(got['pdmesh']['connect']) * 1e3:.2f} "
        f"connect_ms_dynamo={statistics.mean(got['dynamo']['connect']) * 1e3:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
