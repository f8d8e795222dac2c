"""Small synchronous helpers for talking to a pdmesh mesh (CLI, scripts, tests)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_check(address: str, service: str = "", timeout: float = 3.0) -> tuple[str, str]:
    """grpc.health.v1 Check: ("SERVING" | "NOT_SERVING" | "SERVICE_UNKNOWN" | "UNREACHABLE" | ..., detail)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN", e.details() or ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNREACHABLE", e.details() or code.name
            return code.name, e.details() or ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), ""
