"""bench.traces: parsers, scaling and prompt synthesis."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.traces import (
    PromptSynthesizer,
    TraceError,
    TraceRequest,
    VocabRange,
    default_trace_path,
    load_azure,
    load_mooncake,
    load_trace,
    scale,
    scale_len,
)


def mooncake_line(ts, n_in, n_out, ids) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def write(path, lines, sep="\n"):
    path.write_text(sep.join(lines) + sep)
    return path


def test_mooncake_fixture_parses_ms_to_seconds(tmp_path):
    path = write(
        tmp_path / "m.jsonl",
        [mooncake_line(0, 600, 5, [0, 1]), mooncake_line(1500, 512, 1, [0]), mooncake_line(1500, 1, 9, [7])],
    )
    assert load_mooncake(path) == [
        TraceRequest(0.0, 600, 5, (0, 1)),
        TraceRequest(1.5, 512, 1, (0,)),
        TraceRequest(1.5, 1, 9, (7,)),
    ]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (mooncake_line(-1, 5, 5, [0]), "timestamp"),
        (mooncake_line(10, 0, 5, []), "input_length"),
        (mooncake_line(10, 5, 0, [0]), "output_length"),
        (mooncake_line(10, 5, True, [0]), "output_length"),
        (mooncake_line(10, 600, 5, [0]), "1 hash_ids for 600 tokens"),
        (mooncake_line(10, 5, 5, [-3]), "hash_ids"),
        (mooncake_line(1, 5, 5, [0]), "goes back in time"),
    ],
)
def test_mooncake_rejects_a_malformed_line_with_its_number(tmp_path, bad, reason):
    path = write(tmp_path / "m.jsonl", [mooncake_line(0, 5, 5, [0]), mooncake_line(2, 5, 5, [0]), bad])
    with pytest.raises(TraceError, match=reason) as e:
        load_mooncake(path)
    assert (e.value.path, e.value.line) == (str(path), 3)
    assert str(e.value).startswith(f"{path}:3: ")


AZURE_ROWS = [
    "TIMESTAMP,ContextTokens,GeneratedTokens",
    "2023-11-16 18:15:46.6805900,374,44",
    "2023-11-16 18:15:50.9951690,396,109",
    "2023-11-16 18:16:46.6805900,1,1",
]


def test_azure_fixture_parses_wall_clock_with_crlf(tmp_path):
    reqs = load_azure(write(tmp_path / "a.csv", AZURE_ROWS, sep="\r\n"))
    assert [(r.input_len, r.output_len, r.hash_ids) for r in reqs] == [
        (374, 44, ()),
        (396, 109, ()),
        (1, 1, ()),
    ]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 4.314579, 60.0])


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("2023-11-16 18:15:51,12", "want 3 fields"),
        ("yesterday,12,3", "bad TIMESTAMP"),
        ("2023-11-16 18:15:51,12,x", "GeneratedTokens"),
        ("2023-11-16 18:15:51,0,3", "ContextTokens"),
        ("2023-11-16 18:15:51,-4,3", "ContextTokens"),
        ("2023-11-16 18:15:40,12,3", "goes back in time"),
    ],
)
def test_azure_rejects_a_malformed_line_with_its_number(tmp_path, bad, reason):
    path = write(tmp_path / "a.csv", [*AZURE_ROWS[:3], bad])
    with pytest.raises(TraceError, match=reason) as e:
        load_azure(path)
    assert e.value.line == 4


def test_azure_rejects_a_wrong_header(tmp_path):
    with pytest.raises(TraceError, match="header") as e:
        load_azure(write(tmp_path / "a.csv", ["TIME,In,Out", AZURE_ROWS[1]]))
    assert e.value.line == 1


def test_empty_trace_is_an_error(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_mooncake(write(tmp_path / "m.jsonl", [""]))
    with pytest.raises(ValueError, match="unknown trace kind"):
        load_trace("sharegpt", tmp_path / "m.jsonl")


def _real(kind):
    try:
        return default_trace_path(kind)
    except FileNotFoundError:
        pytest.skip(f"real {kind} trace not in this checkout")


def test_real_mooncake_first_rows_and_size():
    reqs = load_trace("mooncake", _real("mooncake"))
    assert len(reqs) == 12031
    assert reqs[0] == TraceRequest(0.0, 6758, 500, tuple(range(14)))
    assert reqs[1].hash_ids[:2] == (0, 14) and reqs[1].input_len == 7322
    assert 3500 < reqs[-1].arrival_s < 3600  # about one hour


def test_real_azure_first_rows_and_size():
    reqs = load_trace("azure", _real("azure"))
    assert len(reqs) == 19366
    assert reqs[:2] == [TraceRequest(0.0, 374, 44), TraceRequest(pytest.approx(4.314579), 396, 109)]


REQS = [TraceRequest(10.0, 1000, 100, (1, 2)), TraceRequest(11.0, 3, 1), TraceRequest(14.0, 512, 33, (1,))]


def test_scale_divides_lengths_rounding_up_and_stretches_time():
    assert scale(REQS, length_factor=16, time_factor=2) == [
        TraceRequest(0.0, 63, 7, (1, 2)),  # ceil(1000/16), ceil(100/16)
        TraceRequest(2.0, 1, 1, ()),  # at least one token
        TraceRequest(8.0, 32, 3, (1,)),
    ]
    assert [r.arrival_s for r in scale(REQS, time_factor=0.5)] == [0.0, 0.5, 2.0]


def test_scale_bounds_count_and_duration():
    assert len(scale(REQS, max_requests=2)) == 2
    assert len(scale(REQS, max_duration_s=4.0)) == 2  # arrivals 0, 1, 4: 4 is not < 4
    assert len(scale(REQS, time_factor=0.5, max_duration_s=4.0)) == 3
    assert scale([], 2, 2) == []
    with pytest.raises(ValueError):
        scale(REQS, length_factor=0)
    with pytest.raises(ValueError):
        scale(REQS, time_factor=math.inf)


def test_shared_hash_ids_give_identical_prefixes_and_exact_lengths():
    a = TraceRequest(0, 1300, 1, (5, 6, 7))
    b = TraceRequest(0, 1100, 1, (5, 6, 9))  # shares two blocks with a
    c = TraceRequest(0, 700, 1, (8, 6))  # same id 6 at position 1 but a different first block
    synth = PromptSynthesizer(VocabRange(), seed=3)
    pa, pb, pc = (synth.prompt(r, i) for i, r in enumerate((a, b, c)))
    assert (len(pa), len(pb), len(pc)) == (1300, 1100, 700)
    assert pa[:1024] == pb[:1024]
    assert pa[1024:1100] != pb[1024:1100]  # ids 7 and 9 differ
    assert pc[:512] != pa[:512]
    # A block is its id's fixed sequence wherever it appears, cut to length at the end.
    assert pc[512:] == pa[512:700]
    assert synth.prompt(a, 99) == pa  # index does not matter with hash ids


def test_scaled_mooncake_blocks():
    reqs = scale([TraceRequest(0, 1300, 40, (5, 6, 7)), TraceRequest(0, 600, 40, (5, 8))], length_factor=16)
    synth = PromptSynthesizer(VocabRange(), length_factor=16)
    assert synth.block_tokens == 32
    pa, pb = (synth.prompt(r, i) for i, r in enumerate(reqs))
    assert (len(pa), len(pb)) == (82, 38)  # ceil(1300/16), ceil(600/16)
    assert pa[:32] == pb[:32] and pa[32:38] != pb[32:38]


def test_prompts_stay_in_vocab_and_avoid_special_ids():
    vocab = VocabRange(0, 8, frozenset({0, 3}))
    synth = PromptSynthesizer(vocab, seed=1)
    ids = synth.prompt(TraceRequest(0, 2000, 1, (1, 2, 3, 4)), 0) + synth.prompt(TraceRequest(0, 2000, 1), 1)
    assert set(ids) == {1, 2, 4, 5, 6, 7}
    with pytest.raises(ValueError, match="no token ids left"):
        VocabRange(0, 2, frozenset({0, 1})).allowed()


def test_random_prompts_are_unique_reproducible_and_seeded():
    reqs = [TraceRequest(0, 64, 1)] * 50
    synth = PromptSynthesizer(VocabRange(), seed=7)
    prompts = [tuple(synth.prompt(r, i)) for i, r in enumerate(reqs)]
    assert len(set(prompts)) == 50 and all(len(p) == 64 for p in prompts)
    assert [
        tuple(PromptSynthesizer(VocabRange(), seed=7).prompt(r, i)) for i, r in enumerate(reqs)
    ] == prompts
    assert tuple(PromptSynthesizer(VocabRange(), seed=8).prompt(reqs[0], 0)) != prompts[0]


def test_too_few_hash_ids_is_an_error():
    with pytest.raises(ValueError, match="need 2 blocks"):
        PromptSynthesizer(VocabRange()).prompt(TraceRequest(0, 513, 1, (1,)), 0)


@given(
    input_len=st.integers(1, 20_000),
    length_factor=st.floats(0.3, 700, allow_nan=False),
)
def test_any_scaled_row_fits_its_hash_ids(input_len, length_factor):
    ids = tuple(range(math.ceil(input_len / 512)))
    (req,) = scale([TraceRequest(0, input_len, 1, ids)], length_factor=length_factor)
    synth = PromptSynthesizer(VocabRange(), length_factor=length_factor)
    assert len(synth.prompt(req, 0)) == req.input_len == scale_len(input_len, length_factor)
