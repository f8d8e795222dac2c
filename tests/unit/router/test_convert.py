"""WorkerInfo between the wire and the router (services/router/convert.py)."""

from __future__ import annotations

import math

from pdmesh.v1 import common_pb2
from services.router.convert import info_from_proto, info_to_proto


def test_the_hardware_description_survives_a_round_trip():
    msg = common_pb2.WorkerInfo(
        worker_id="w",
        address="127.0.0.1:1",
        role=common_pb2.WORKER_ROLE_DECODE,
        model_id="m",
        block_size=16,
        accelerator=common_pb2.ACCELERATOR_KIND_CUDA,
        accelerator_generation="a100",
        memory_headroom_bytes=3 << 30,
        warm_models=["m", "m2"],
        model_load_s=12.5,
    )
    info = info_from_proto(msg)
    assert (info.accelerator, info.accelerator_generation) == ("cuda", "a100")
    assert info.warm_models == ("m", "m2") and info.model_load_s == 12.5
    assert info_to_proto(info) == msg


def test_a_load_time_that_is_no_number_is_unknown():
    for bad in (math.nan, math.inf, -1.0):
        assert info_from_proto(common_pb2.WorkerInfo(worker_id="w", model_load_s=bad)).model_load_s == 0.0


def test_a_measured_link_survives_a_round_trip_and_no_number_is_unmeasured():
    from services.router.convert import load_from_proto, load_to_proto

    msg = common_pb2.WorkerLoad(tokens_waiting=7, link_ms_per_block=0.25, link_latency_ms=3.0)
    load = load_from_proto(msg)
    assert (load.link_ms_per_block, load.link_latency_ms) == (0.25, 3.0)
    assert load_to_proto(load) == msg
    for bad in (math.nan, math.inf, -1.0):
        bad_load = load_from_proto(common_pb2.WorkerLoad(link_ms_per_block=bad, link_latency_ms=bad))
        assert (bad_load.link_ms_per_block, bad_load.link_latency_ms) == (0.0, 0.0)
