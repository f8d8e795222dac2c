"""SimRunner inside the real LLMEngine: modeled pass times, deterministic tokens, KV events."""

from __future__ import annotations

import pytest

from services.engine.api import EngineRequest, SamplingParams
from services.engine.llm_engine import LLMEngine
from services.engine.sim.engine import SimEngine
from services.engine.sim.runner import SlowdownFile
from services.model.timing import load_profile
from tests.unit.engine.conftest import assert_pool_restored, prompt_of, request, tiny_config
from tests.unit.sim.conftest import FakeClock, sim_config, sim_core


def first_pass(core: LLMEngine, req):
    """Admit `req` alone, run one step, return that pass's cost."""
    core.add_request(req)
    core.step()
    return core.runner.last_pass


def resume_request(rid: str, prompt: list[int], max_tokens: int, resume: list[int]) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), resume)


def drain(core: LLMEngine) -> None:
    while core.has_unfinished_requests():
        core.step()


def test_pass_cost_is_the_profile_of_what_the_scheduler_ran(make_core):
    waits: list[float] = []
    core = make_core(waits=waits, sim_speedup=4.0, max_num_batched_tokens=4096)
    prof = core.runner.profile
    cost = first_pass(core, request("a", prompt_of(1000, 1), max_tokens=3))
    # One prompt of 1000 new tokens, nothing cached, no decode in the same pass.
    assert (cost.new_tokens, cost.context_tokens, cost.batch) == (1000, 0.0, 0)
    assert cost.prefill_ms == pytest.approx(prof.prefill_ms(1000))
    assert waits[-1] == pytest.approx(cost.ms / 1000 / 4.0)  # wall = modeled / speedup
    core.step()  # one decode step of a 1001-token context
    dec = core.runner.last_pass
    assert (dec.new_tokens, dec.batch, dec.decode_context_tokens) == (0, 1, 1001)
    assert dec.ms == pytest.approx(prof.decode_ms(1, 1001))
    drain(core)
    assert core.runner.passes == 3
    assert core.runner.modeled_s == pytest.approx(sum(waits) * 4.0)


def test_chunked_prefill_prices_each_chunk_against_its_context(make_core):
    core = make_core(profile="splitwise-h100-llama70b", max_num_batched_tokens=256)
    prof = core.runner.profile
    first = first_pass(core, request("a", prompt_of(600, 2), max_tokens=1))
    core.step()
    second = core.runner.last_pass
    assert (first.new_tokens, first.context_tokens) == (256, 0)
    assert (second.new_tokens, second.context_tokens) == (256, 256)
    assert second.prefill_ms == pytest.approx(prof.prefill_ms(256, 256))
    drain(core)


def test_prefix_cache_hit_shortens_the_modeled_prefill(make_core):
    shared = prompt_of(512, 3)
    cold_core = make_core(max_num_batched_tokens=2048)
    cold = first_pass(cold_core, request("cold", shared + prompt_of(64, 4), max_tokens=1))
    drain(cold_core)

    warm_core = make_core(max_num_batched_tokens=2048)
    warm_core.generate([request("seed", shared + prompt_of(64, 5), max_tokens=1)])
    warm = first_pass(warm_core, request("warm", shared + prompt_of(64, 4), max_tokens=1))
    drain(warm_core)
    assert cold.new_tokens == 576
    assert warm.new_tokens == 64  # 512 tokens (32 blocks) came from the prefix cache
    prof = warm_core.runner.profile
    assert warm.prefill_ms == pytest.approx(prof.prefill_ms(64, 512))
    assert warm.prefill_ms < cold.prefill_ms
    assert cold.prefill_ms == pytest.approx(prof.prefill_ms(576))
    assert warm_core.stats().prompt_tokens_cached == 512


def test_tokens_depend_only_on_prompt_seed_and_position():
    p, q = prompt_of(100, 6), prompt_of(100, 7)
    one = sim_core().generate([request("x", p, max_tokens=20), request("y", q, max_tokens=20)])
    # Another engine, another batch mix, another block size: same tokens.
    other = sim_core(block_size=32)
    two = other.generate([request("a", q, max_tokens=20), request("b", p, max_tokens=20)])
    assert one["x"] == two["b"] and one["y"] == two["a"]
    assert one["x"] != one["y"]
    assert all(0 <= t < 256 for t in one["x"] + one["y"])  # bytes, never EOS (257)
    # Migration: resuming after 7 tokens continues with exactly the same ones.
    resumed = sim_core().generate([resume_request("r", p, 20, one["x"][:7])])
    assert resumed["r"] == one["x"][7:]
    # Sampled requests: the seed picks the stream, reproducibly.
    seeded = [
        sim_core().generate([request("s", p, max_tokens=20, temperature=0.8, seed=s)])["s"] for s in (1, 1, 2)
    ]
    assert seeded[0] == seeded[1] != seeded[2]


def test_kv_events_are_the_torch_engines(make_engine):
    """Same block manager: identical stored / removed events, evictions included."""
    # Prompts only (max_tokens=1: the sampled token is never computed, so no output block is
    # cached and the two engines' different tokens cannot show up in the hashes).
    shared = prompt_of(80, 8)
    reqs = [shared + prompt_of(50 + 10 * i, 10 + i) for i in range(6)]
    torch_core = make_engine(num_blocks=24, max_num_batched_tokens=512)
    sim = sim_core(num_blocks=24, max_num_batched_tokens=512)
    for i, prompt in enumerate(reqs):
        torch_core.generate([request(f"r{i}", prompt, max_tokens=1)])
        sim.generate([request(f"r{i}", prompt, max_tokens=1)])
    want = torch_core.kv_events_since(0)
    assert [e.kind.value for e in want].count("removed") > 0  # the small pool evicted
    assert sim.kv_events_since(0) == want
    assert sim.kv_snapshot() == torch_core.kv_snapshot()


def test_sim_pool_is_tiny_but_sized_like_the_modeled_one():
    core = sim_core(num_blocks=None)
    prof = load_profile("dynamo-mocker")
    assert core.info.num_blocks == prof.num_blocks  # unset: the profile's pool
    assert core.info.layout.bytes_per_token() == 4
    assert tuple(core.kv_pool().shape) == (prof.num_blocks, *core.info.layout.block_shape)
    assert core.info.max_model_len == prof.num_blocks * 16
    assert sim_core(num_blocks=64).info.num_blocks == 64  # EngineConfig wins when set
    assert tiny_config().backend == "torch"


def test_python_work_between_passes_overlaps_the_modeled_time(make_core):
    waits: list[float] = []
    clock = FakeClock(waits)
    core = make_core(clock=clock, sim_speedup=1.0)
    core.add_request(request("a", prompt_of(40, 11), max_tokens=3))
    core.step()  # prefill
    clock.now += 0.002  # 2 ms of scheduler / queue work before the next pass
    core.step()  # a decode pass, the sequence went on running: the 2 ms count against it
    decode_wall = core.runner.last_pass.ms / 1000
    assert waits[-1] == pytest.approx(decode_wall - 0.002)
    clock.now += 1.0  # more work than a whole pass: no wait at all, counted as late
    core.step()
    assert len(waits) == 2 and core.runner.late_s == pytest.approx(1.0 - core.runner.last_pass.ms / 1000)
    assert not core.has_unfinished_requests()
    # After a pause (nothing was running), a new pass waits its full modeled time.
    clock.now += 0.002
    first_pass(core, request("b", prompt_of(40, 12), max_tokens=1))
    assert waits[-1] == pytest.approx(core.runner.last_pass.ms / 1000)


def test_a_slowdown_file_multiplies_each_pass_and_is_reread(make_core, tmp_path):
    """A degraded accelerator: the factor in the file multiplies every pass's wall time, and a
    fault study changes it while the worker runs."""
    path = tmp_path / "slowdown"
    clock, read_clock = FakeClock([]), FakeClock([])  # the runner's, and the file's rereads'
    slowdown = SlowdownFile(str(path), every_s=0.1, clock=read_clock)
    core = make_core(clock=clock, slowdown=slowdown, max_num_batched_tokens=4096)
    core.add_request(request("a", prompt_of(64, 8), max_tokens=40))
    core.step()  # no file yet: factor 1
    assert clock.waits[-1] == pytest.approx(core.runner.last_pass.ms / 1000)
    path.write_text("5\n")
    read_clock.now += 0.1
    core.step()
    assert clock.waits[-1] == pytest.approx(5 * core.runner.last_pass.ms / 1000)
    path.write_text("1")
    core.step()  # reread at most every 0.1 s: this pass still runs 5x slower ...
    assert clock.waits[-1] == pytest.approx(5 * core.runner.last_pass.ms / 1000)
    read_clock.now += 0.1
    core.step()  # ... and the next at full speed again
    assert clock.waits[-1] == pytest.approx(core.runner.last_pass.ms / 1000)
    drain(core)


@pytest.mark.parametrize("text", ["", "fast", "0", "-2", "nan", "inf"])
def test_an_unusable_slowdown_file_reads_as_no_slowdown(tmp_path, text):
    path = tmp_path / "slowdown"
    path.write_text(text)
    assert SlowdownFile(str(path))() == 1.0
    assert SlowdownFile(str(tmp_path / "missing"))() == 1.0


def test_the_sim_engine_reads_the_slowdown_file_it_is_configured_with(tmp_path):
    path = tmp_path / "slowdown"
    path.write_text("3")
    engine = SimEngine(sim_config(sim_slowdown_file=str(path)))
    runner = engine._runner_factory(engine._spec)  # what the step thread builds at start
    waits: list[float] = []
    runner._sleep = waits.append
    core = LLMEngine(engine.config, engine._spec, lambda spec: runner)
    core.add_request(request("a", prompt_of(32, 9), max_tokens=2))
    core.step()
    assert waits[-1] == pytest.approx(3 * runner.last_pass.ms / 1000, rel=0.05)
    drain(core)
    assert_pool_restored(core)
