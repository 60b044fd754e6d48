"""The simulator's rollout engine [Note: simulated rollout engine in executors/sim/engine.py]:
continuous batching on a fake clock, so the iteration costs show exactly in when each sample
finishes; then on a simulator executor process."""

from __future__ import annotations

import attrs
import pytest

from executors.optable import Deferred
from executors.sim.engine import EngineCosts, SimEngine
from executors.sim.ops import _generate, sample_rollout
from flowkit.ops.records import Prompt, Rollout, WeightsVersion
from tests.harness import op_context


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Sink:
    """A task's side of a Deferred: what it emitted and its result, with the fake time."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.emitted, self.result, self.error = clock, [], None, None

    def emit(self, item) -> None:
        self.emitted.append((item, self.clock.now))

    def done(self, result) -> None:
        self.result = (result, self.clock.now)

    def fail(self, error) -> None:
        self.error = error


def _engine() -> tuple[SimEngine, _Clock]:
    clock = _Clock()
    return SimEngine(clock=clock, sleep=clock.sleep), clock


def _request(engine: SimEngine, clock: _Clock, lengths: list[int], *, name: str = "r",
             prompt_tokens: int = 0, stream: bool = True, **costs) -> _Sink:
    defaults = {"token": 1.0, "per_seq": 0.0, "prefill_token": 0.0}
    deferred = engine.submit([f"{name}{i}" for i in range(len(lengths))], lengths,
                             prompt_tokens=prompt_tokens, stream=stream,
                             costs=EngineCosts(**{**defaults, **costs}))
    sink = _Sink(clock)
    deferred.bind(sink)
    return sink


def _run(engine: SimEngine, steps: int | None = None) -> None:
    while engine.busy() and (steps is None or steps > 0):
        engine.step()
        steps = None if steps is None else steps - 1


def test_a_shorter_request_joining_mid_flight_finishes_before_the_running_one():
    engine, clock = _engine()
    long = _request(engine, clock, [10], name="long")
    _run(engine, steps=3)
    short = _request(engine, clock, [2], name="short")
    _run(engine)
    assert short.result == (["short0"], 5.0)  # joined the batch at iteration 4: no waiting
    assert long.result == (["long0"], 10.0)  # and never slowed down by it (per_seq 0)


def test_an_iteration_costs_token_plus_per_seq_times_the_live_batch():
    engine, clock = _engine()
    sink = _request(engine, clock, [1, 2, 3], token=1.0, per_seq=0.1)
    _run(engine)
    # 3 live sequences, then 2, then 1: t(3), + t(2), + t(1)
    assert [t for _, t in sink.emitted] == pytest.approx([1.3, 2.5, 3.6])


def test_each_sample_streams_the_moment_it_finishes_and_the_result_follows_in_that_order():
    engine, clock = _engine()
    sink = _request(engine, clock, [3, 1, 2])
    _run(engine)
    assert sink.emitted == [("r1", 1.0), ("r2", 2.0), ("r0", 3.0)]
    assert sink.result == (["r1", "r2", "r0"], 3.0)


def test_a_task_that_does_not_stream_gets_its_samples_at_the_end():
    engine, clock = _engine()
    sink = _request(engine, clock, [3, 1], stream=False)
    _run(engine)
    assert sink.emitted == [] and sink.result == (["r1", "r0"], 3.0)


def test_max_batch_slots_go_to_waiting_samples_as_sequences_finish():
    engine, clock = _engine()
    first = _request(engine, clock, [3, 1], name="a", max_batch=2)
    second = _request(engine, clock, [2], name="b", max_batch=2)
    _run(engine)
    # b0 waits for a1's slot (free after iteration 1), then decodes iterations 2 and 3
    assert first.emitted == [("a1", 1.0), ("a0", 3.0)] and second.emitted == [("b0", 3.0)]


def test_prefill_takes_what_decodes_leave_of_the_budget_and_never_stalls_them():
    engine, clock = _engine()
    running = _request(engine, clock, [8], name="run", token_budget=4, prefill_token=0.01)
    _run(engine, steps=2)
    joining = _request(engine, clock, [1], name="new", prompt_tokens=10, token_budget=4,
                       prefill_token=0.01)
    _run(engine)
    # 10 prompt tokens at 3 an iteration (one of the 4 is the running decode's): chunks of
    # 3, 3, 3, 1, the last one also giving the new sample its (only) token
    assert joining.emitted == [("new0", pytest.approx(2 + 4 + 0.10))]
    assert running.emitted == [("run0", pytest.approx(8 + 0.10))]  # a token every iteration


def test_a_cancelled_request_gives_its_slots_back():
    engine, clock = _engine()
    dropped = _request(engine, clock, [5, 5], name="x", max_batch=2)
    kept = _request(engine, clock, [1], name="y", max_batch=2)
    _run(engine, steps=1)
    dropped_deferred = engine.requests[0].deferred
    dropped_deferred.cancel()
    _run(engine)
    assert dropped.result is None and kept.result == (["y0"], 2.0)


# -- the generate op: what comes out, and bad requests -----------------------------------------
_PROMPTS = [Prompt(prompt_id=i, tokens=[1] * (3 + i)) for i in range(6)]
_SIM = {"max_new_tokens": 40, "length_sigma": 1.0, "prompt_sigma": 0.5, "step": 3}


def _generated(order: list[int], *, max_batch: int, n: int = 3) -> dict:
    """Every sample of `order`'s prompts, by (prompt, sample), through one engine."""
    ctx, clock = op_context(), _Clock()
    ctx.background["generate"] = SimEngine(clock=clock, sleep=clock.sleep)
    sinks = []
    for index in order:
        deferred = _generate(ctx, _PROMPTS[index], n=n, max_batch=max_batch, token_budget=8,
                             **_SIM)
        sinks.append(_Sink(clock))
        deferred.bind(sinks[-1])
    _run(ctx.background["generate"])
    return {(r.prompt_id, r.sample): r for sink in sinks for r in sink.result[0]}


def test_the_same_rollouts_come_out_whatever_the_arrival_order_and_batch():
    reference = _generated([0, 1, 2, 3, 4, 5], max_batch=256)
    assert _generated([5, 3, 1, 0, 2, 4], max_batch=2) == reference
    assert _generated([2, 4, 0, 5, 1, 3], max_batch=7) == reference
    # and a sample does not depend on how many its prompt has
    assert sample_rollout(_PROMPTS[1], 2, step=3, max_new_tokens=40, length_sigma=1.0,
                          prompt_sigma=0.5) == reference[(1, 2)]
    assert len({len(r.response_tokens) for r in reference.values()}) > 3  # lengths do vary


@pytest.mark.parametrize(("key", "value"), [("n", 0), ("max_new_tokens", 0), ("n", 1.5)])
def test_a_bad_request_fails_alone_naming_its_prompt_and_key(key, value):
    ctx = op_context()
    good = _generate(ctx, _PROMPTS[0], n=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=f"prompt 4: {key} must be a whole number >= 1"):
        _generate(ctx, _PROMPTS[4], **{"n": 2, "max_new_tokens": 4, key: value})
    assert isinstance(good, Deferred)
    results = []
    good.bind(type("Sink", (), {"emit": lambda s, x: None, "done": lambda s, r: results.append(r),
                                "fail": lambda s, e: None})())
    _run(ctx.background["generate"])
    assert [len(r) for r in results] == [2]


# -- on a simulator executor process -----------------------------------------------------------
@pytest.fixture(scope="module")
def sim(pool):
    with pool.shared(1, kind="sim") as (ctl, (executor,)):
        yield ctl, executor


def _config(**extra) -> dict:
    return {"seconds_per_token": 0.01, "max_new_tokens": 64, **extra}


def test_on_an_executor_requests_decode_together_and_stream_each_sample(sim):
    ctl, executor = sim
    long_prompt = next(p for p in (Prompt(prompt_id=i, tokens=[1]) for i in range(50))
                       if len(sample_rollout(p, 0, step=0, max_new_tokens=64).response_tokens)
                       >= 40)
    parts = []
    long = ctl.submit("generate", long_prompt, config=_config(n=1), executor=executor.id)
    short = ctl.submit("generate", Prompt(prompt_id=999, tokens=[1]),
                       config=_config(n=3, max_new_tokens=4), executor=executor.id,
                       on_part=parts.append)
    assert [len(r.response_tokens) <= 4 for r in short.result(timeout=10)] == [True] * 3
    assert not long.done()  # the short request joined the long one's batch and left first
    assert len(parts) == 3 and all(isinstance(p.result(timeout=5), Rollout) for p in parts)
    assert [p.timing[1] for p in parts] == sorted(p.timing[1] for p in parts)
    assert len(long.result(timeout=10)[0].response_tokens) >= 40


def test_on_an_executor_a_bad_request_fails_and_the_others_go_on(sim):
    ctl, executor = sim
    good = ctl.submit("generate", Prompt(prompt_id=1, tokens=[1]), config=_config(n=2),
                      executor=executor.id)
    bad = ctl.submit("generate", Prompt(prompt_id=7, tokens=[1]), config=_config(n=0),
                     executor=executor.id)
    with pytest.raises(Exception, match="prompt 7: n must be a whole number >= 1, got 0"):
        bad.result(timeout=10)
    assert len(good.result(timeout=10)) == 2


def test_pause_holds_the_engine_and_abort_cuts_every_sample_where_it_got():
    engine, clock = _engine()
    rollouts = [sample_rollout(Prompt(prompt_id=0, tokens=[1, 2]), k, step=0,
                               max_new_tokens=64, min_new_tokens=10) for k in range(3)]
    deferred = engine.submit(rollouts, [len(r.response_tokens) for r in rollouts],
                             prompt_tokens=0, stream=True,
                             costs=EngineCosts(token=1.0, per_seq=0.0, prefill_token=0.0))
    sink = _Sink(clock)
    deferred.bind(sink)
    _run(engine, steps=4)
    engine.pause()
    assert not engine.busy() and clock.now == 4.0
    engine.pause(False)
    _run(engine, steps=2)
    assert engine.abort() == (3, 18) and not engine.busy()
    result, _ = sink.result
    assert [len(r.response_tokens) for r in result] == [6, 6, 6]  # 6 iterations decoded
    assert all(r.interrupted and not r.finished for r in result)
    assert [r.response_tokens for r in result] == [r.response_tokens[:6] for r in rollouts]


def test_the_generation_op_on_an_idle_simulator_does_nothing_and_names_bad_actions():
    from executors.sim.ops import _generation

    ctx = op_context()
    assert _generation(ctx, action="abort") == 0
    with pytest.raises(ValueError, match="'halt' is not one of pause, resume, abort"):
        _generation(ctx, action="halt")


def test_an_abort_by_name_cuts_only_that_request_and_counts_its_tokens():
    engine, clock = _engine()
    cut = _request_named(engine, clock, [5, 5], "a")
    kept = _request_named(engine, clock, [5], "b")
    _run(engine, steps=2)
    assert engine.abort({"a"}) == (2, 4)  # 2 samples, 2 tokens decoded each
    _run(engine)
    assert cut.result[0] == ["a0", "a1"]  # plain items come back as they are
    assert kept.result is not None and kept.error is None


def _request_named(engine: SimEngine, clock: _Clock, lengths: list[int], name: str) -> _Sink:
    deferred = engine.submit([f"{name}{i}" for i in range(len(lengths))], lengths,
                             prompt_tokens=0, stream=True, key=name,
                             costs=EngineCosts(token=1.0, per_seq=0.0, prefill_token=0.0))
    sink = _Sink(clock)
    deferred.bind(sink)
    return sink


def test_a_carried_group_continues_its_cut_samples_and_passes_finished_ones_through():
    """[Note: partial rollouts]: on the simulator, a cut sample decodes the rest of the length
    its origin step drew, new tokens at the request's version; a finished one passes."""
    prompt = Prompt(prompt_id=3, tokens=[1, 2])
    whole = [sample_rollout(prompt, k, step=2, max_new_tokens=64, min_new_tokens=10,
                            version=1) for k in range(2)]
    carried = [whole[0], attrs.evolve(whole[1], response_tokens=whole[1].response_tokens[:4],
                                      logprobs=whole[1].logprobs[:4], versions=[1] * 4,
                                      finished=False, interrupted=True)]
    ctx = op_context()
    deferred = _generate(ctx, carried, WeightsVersion(model="m", version=3), step=2,
                         max_new_tokens=64, min_new_tokens=10, min_version=1)
    clock = _Clock()
    ctx.background["generate"].clock, ctx.background["generate"].sleep = clock, clock.sleep
    sink = _Sink(clock)
    deferred.bind(sink)
    _run(ctx.background["generate"])
    out = {r.sample: r for r in sink.result[0]}
    assert out[0] == whole[0]
    assert out[1].response_tokens == whole[1].response_tokens
    assert out[1].versions == [1] * 4 + [3] * (len(whole[1].response_tokens) - 4)


def test_a_carried_sample_older_than_the_bound_is_recomputed_or_its_group_dropped():
    prompt = Prompt(prompt_id=3, tokens=[1, 2])
    old = sample_rollout(prompt, 0, step=0, max_new_tokens=8, version=0)
    assert _generate(op_context(), [old], step=0, max_new_tokens=8, min_version=1,
                     stale_segments="drop") == []
    ctx = op_context()
    deferred = _generate(ctx, [old], WeightsVersion(model="m", version=2), step=0,
                         max_new_tokens=8, min_version=1)
    sink = _Sink(_Clock())
    deferred.bind(sink)
    _run(ctx.background["generate"])
    (again,) = sink.result[0]
    assert again.response_tokens == old.response_tokens and set(again.versions) == {2}


def test_a_continued_sample_aborted_again_keeps_the_tokens_it_came_with():
    engine, clock = _engine()
    whole = sample_rollout(Prompt(prompt_id=0, tokens=[1]), 0, step=0, max_new_tokens=64,
                           min_new_tokens=30)
    deferred = engine.submit([whole], [len(whole.response_tokens) - 10], prompt_tokens=0,
                             stream=True, key="c",
                             costs=EngineCosts(token=1.0, per_seq=0.0, prefill_token=0.0))
    sink = _Sink(clock)
    deferred.bind(sink)
    _run(engine, steps=5)
    assert engine.abort({"c"}) == (1, 5)  # 5 tokens decoded here, 10 it came with
    (cut,) = sink.result[0]
    assert cut.response_tokens == whole.response_tokens[:15] and cut.interrupted


def test_an_abort_that_comes_before_its_request_ends_the_request_at_once():
    engine, clock = _engine()
    assert engine.abort({"late"}) == (0, 0)
    late = _request_named(engine, clock, [5, 5], "late")
    _run(engine)
    assert late.result[0] == ["late0", "late1"] and late.result[1] == 0.0  # nothing decoded
