"""The router's channels to workers: options whose meaning is not what their names say."""

from services.router.worker_pool import CHANNEL_OPTIONS


def test_min_reconnect_backoff_is_a_connect_timeout_long_enough_for_a_starved_worker():
    # gRPC core takes min_reconnect_backoff_ms as the minimum connect timeout: at 100 ms a
    # handshake with a worker starved of CPU failed ("tcp handshaker shutdown") and the
    # call with it. The chaos harness's clients use 5 s for the same reason.
    opts = dict(CHANNEL_OPTIONS)
    assert opts["grpc.min_reconnect_backoff_ms"] >= 5000
    # ... while the retry backoff itself stays short: a restarted worker is found again soon.
    assert opts["grpc.initial_reconnect_backoff_ms"] <= 100
    assert opts["grpc.max_reconnect_backoff_ms"] <= 2000
