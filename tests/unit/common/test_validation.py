import pytest

from pdmesh.v1 import common_pb2, decode_pb2
from services.common.errors import InvalidArgument
from services.common.validation import (
    RequestLimits,
    check_enum,
    check_priority,
    check_prompt,
)
from services.model.sampling import check_sampling

LIMITS = RequestLimits(max_tokens_limit=100)


def sp(**kw):
    return common_pb2.SamplingParams(**kw)


def test_defaults_and_conversion():
    p = check_sampling(None, LIMITS, vocab_size=300)
    assert p.max_tokens == 16 and p.temperature == 0 and p.top_p == 1.0 and p.seed is None
    p = check_sampling(sp(max_tokens=5, temperature=0.7, top_k=3, stop=["x"], seed=9), LIMITS, 300)
    assert (p.max_tokens, p.top_k, p.stop, p.seed) == (5, 3, ("x",), 9)


def test_unseeded_sampling_gets_a_seed_so_workers_agree():
    p = check_sampling(sp(temperature=1.0), LIMITS, 300)
    assert p.seed is not None


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"max_tokens": -3}, "sampling.max_tokens"),
        ({"max_tokens": 101}, "sampling.max_tokens"),
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"top_k": 301}, "sampling.top_k"),
        ({"stop": [""]}, "sampling.stop"),
        ({"stop": ["s"] * 17}, "sampling.stop"),
        ({"stop": ["x" * 257]}, "sampling.stop"),
        ({"stop_token_ids": [300]}, "sampling.stop_token_ids"),
    ],
)
def test_invalid_sampling_names_the_field(kw, field):
    with pytest.raises(InvalidArgument, match=field):
        check_sampling(sp(**kw), LIMITS, vocab_size=300)


def test_prompt_checks():
    check_prompt([1, 2, 3], 4, vocab_size=10, max_model_len=64, limits=LIMITS)
    with pytest.raises(InvalidArgument, match="empty"):
        check_prompt([], 4, 10, 64, LIMITS)
    with pytest.raises(InvalidArgument, match="model context"):
        check_prompt([1] * 64, 1, 10, 64, LIMITS)
    with pytest.raises(InvalidArgument, match="max_tokens"):
        check_prompt([1] * 60, 8, 10, 64, LIMITS)
    with pytest.raises(InvalidArgument, match="token 10"):
        check_prompt([1, 10], 1, 10, 64, LIMITS)


def test_priority_and_enum_checks():
    check_priority(3, LIMITS)
    with pytest.raises(InvalidArgument, match="priority"):
        check_priority(11, LIMITS)
    check_enum(decode_pb2.DISAGG_MODE_REMOTE, decode_pb2.DisaggMode, "disagg_mode")
    with pytest.raises(InvalidArgument, match="disagg_mode: unknown value 9"):
        check_enum(9, decode_pb2.DisaggMode, "disagg_mode")


def test_kv_transfer_failures_map_to_their_status():
    import grpc

    from kvtransfer.errors import FailureKind, KvTransferFailed
    from services.common.errors import status_of

    assert status_of(KvTransferFailed(FailureKind.TIMEOUT, "x"))[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_of(KvTransferFailed(FailureKind.NOT_OWNER, "x"))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(ValueError("x")) is None


def test_messages_state_the_effective_limit():
    # max_tokens: one range, the serving one, whichever side is broken (not "[1, inf]" vs "<= 100").
    for bad in (0, 101):
        with pytest.raises(InvalidArgument) as e:
            check_sampling(sp(max_tokens=bad), LIMITS, 300, prefix="")
        assert str(e.value).startswith("max_tokens: must be in [1, 100]"), str(e.value)
    # A prompt limit of 32768 means nothing when the model context is 2,048: say 2,047.
    with pytest.raises(InvalidArgument) as e:
        check_prompt([1] * 3000, 1, 300, 2048, RequestLimits(max_prompt_tokens=32768), "prompt")
    assert "limit of 2047" in str(e.value) and "32768" not in str(e.value)
    assert str(e.value).startswith("prompt: ")
    with pytest.raises(InvalidArgument) as e:
        check_prompt([1] * 2000, 100, 300, 2048, LIMITS, "prompt", "max_tokens")
    assert str(e.value).startswith("max_tokens: ") and "at most 48 output tokens fit" in str(e.value)


def test_the_engine_and_the_services_apply_the_same_sampling_rules():
    from services.engine.api import SamplingParams as EngineSampling  # re-exported, not a copy
    from services.model.sampling import SamplingParams, sampling_problem

    assert EngineSampling is SamplingParams
    assert sampling_problem(SamplingParams(top_k=301), 300) == (
        "top_k",
        "must be in [0, 300] (0 = off; the vocabulary size), got 301",
    )
    with pytest.raises(InvalidArgument) as e:
        check_sampling(sp(top_k=301), LIMITS, 300)
    assert str(e.value) == "sampling.top_k: must be in [0, 300] (0 = off; the vocabulary size), got 301"


def test_validation_does_not_import_the_engine():
    # Layering: services/common sits below services/engine; the rules live in services/model.
    import ast
    from pathlib import Path

    import services.common.validation as v

    tree = ast.parse(Path(v.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("services.engine")], imported


@pytest.mark.parametrize("waited_s", [-0.001, float("nan"), float("inf"), 86_400.001])
def test_a_wait_brought_from_earlier_attempts_must_be_in_range(waited_s):
    from services.common.validation import check_waited

    with pytest.raises(InvalidArgument, match="waited_s"):
        check_waited(waited_s)
    check_waited(0.0)
    check_waited(86_400.0)
