"""Bubble filling [Note: bubble filling in flowkit/runner/bubble_fill.py]: the reference log-probs
of a GRPO step, placed beside the engines, also run on the training executors inside their
pipeline's bubbles, sized to fit; without --fill-bubbles they never do; the step's samples and
tokens are the same either way. The lending itself (which bubbles, how much of them, when again) is
checked without processes."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest

from dataflows.grpo import grpo_flow
from flowkit.planner import Action, Costs, Kind, action_key
from flowkit.planner.lower import lower_flow
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.bubble_fill import BubbleFill
from flowkit.runner.flowrun import FlowRunner

# scoring (0.2 ms a token of about 30) outweighs generation, so its items wait for the two
# rollout executors; 4 training executors in a 1F1B pipeline of 10 ms ops
SIM = SimCosts(F=0.01, B=0.01, W=0.01, optimizer_step=0.005, token=0.0005, token_per_seq=0.0,
               prefill_token=0.0, infer_token=0.0002)


@pytest.fixture(scope="module")
def cluster(pool):
    tags = [("rollout",)] * 2 + [("train",)] * 4
    with pool.shared(6, kind="sim", tags=tags) as (ctl, infos):
        yield ctl, {e.id for e in infos if "train" in e.tags}


def _steps(ctl, fill: bool, steps: int = 3):
    flow = grpo_flow(prompts=16, n=8, stages=4, microbatches=8, schedule="1f1b",
                     max_new_tokens=64, reference_tags=("rollout",))
    scored_on = []

    def listen(event, payload):
        task = payload.get("task")
        if event == "task_submitted" and (task.meta or {}).get("node") == "ref_logprobs":
            scored_on.append((task.meta["step"], payload["executor"].id, task.items or 1))

    ctl.add_listener(listen)
    try:
        runner = FlowRunner(ctl, lower_flow(flow), sim_costs=SIM, fill_bubbles=fill)
        reports = [runner.run_step(step) for step in range(steps)]
    finally:
        ctl.remove_listener(listen)
    return reports, scored_on


def test_scoring_fills_the_trainers_bubbles_only_when_asked_and_changes_no_sample(cluster):
    ctl, trainers = cluster
    plain, plain_on = _steps(ctl, fill=False)
    filled, filled_on = _steps(ctl, fill=True)
    assert not any(executor in trainers for _, executor, _ in plain_on)
    assert "ref_logprobs/bubble_items" not in plain[-1].metrics
    # step 0 learns the cost of an item; the later ones lend the trainers' bubbles
    lent = [sum(n for step, e, n in filled_on if step == s and e in trainers) for s in range(3)]
    assert lent[0] == 0 and lent[1] > 0 and lent[2] > 0
    assert [r.metrics["ref_logprobs/bubble_items"] for r in filled] == lent
    for before, after in zip(plain, filled):  # where scoring ran changes nothing it made
        for key in ("rollout/samples", "response_length_mean", "update_actor/tokens"):
            assert before.metrics[key] == after.metrics[key], key
    for _, _, items in filled_on:
        assert items <= 256


class _Ending:
    """A task's ending future, as far as the lending reads it."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, fn) -> None:
        self.callbacks.append(fn)

    def end(self) -> None:
        for fn in self.callbacks:
            fn(self)


class _Fills:
    """The runner's side of a BubbleFill: what each lending asked for; the first gets a task."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, float]] = []
        self.ending = _Ending()

    def __call__(self, executor: int, seconds: float) -> list:
        self.asked.append((executor, seconds))
        return [self.ending] if len(self.asked) == 1 else []


def _drain(events: queue.SimpleQueue) -> None:
    while not events.empty():
        events.get_nowait()()


def test_the_warm_up_is_lent_until_the_pipeline_starts_and_actions_open_the_rest():
    """1F1B, p = 4, m = 8, unit costs: devices 1-3 wait 1, 2 and 3 before their first forward,
    lent while the pipeline has not started: at once, again when items come to wait where
    nothing was lent, again when a filler ends; device 0 has no warm-up. The bubble after 0F3
    (6 long) opens when 0F3 ends."""
    events, fills = queue.SimpleQueue(), _Fills()
    lending = BubbleFill(events, fills)
    costs = Costs.uniform(4)
    schedule = build_schedule("1f1b", devices=4, microbatches=8, costs=costs)
    executors = [SimpleNamespace(id=10 + d) for d in range(4)]
    started, ready = [False], set()
    opened_by = lending.plan(schedule, costs, executors, lambda: started[0],
                             lambda action: str(action) in ready)
    assert opened_by[action_key(0, Kind.F, 3)][:2] == (10, 6.0)
    _drain(events)
    assert sorted(fills.asked) == [(11, 1.0), (12, 2.0), (13, 3.0)]
    first = fills.asked[0][0]
    assert lending.lent == {first}  # it got a task; the others got none
    lending.waiting_items()
    _drain(events)
    assert sorted(fills.asked[3:]) == sorted(e for e in fills.asked[:3] if e[0] != first)
    fills.ending.end()  # the filler ended: lent again, the pipeline not started
    _drain(events)
    assert fills.asked[-1] == fills.asked[0] and lending.lent == set()
    started[0] = True
    lending.waiting_items()
    _drain(events)
    assert len(fills.asked) == 6 and lending.warm_ups == {}
    # 0F3 ends: its bubble (6 long, up to 0BW0) is lent what is left of it, unless 0BW0 can
    # start already (a late microbatch closed the bubble)
    for closed in (True, False):
        ready.clear()
        if closed:
            ready.add(str(opened_by[action_key(0, Kind.F, 3)][2]))
        ended = SimpleNamespace(exception=lambda: None, timing=(0.0, time.time()))
        lending.watch(opened_by, Action(0, Kind.F, 3), _Ending())
        lending._ended(*opened_by[action_key(0, Kind.F, 3)], ended)
        _drain(events)
        assert len(fills.asked) == (6 if closed else 7)
    executor, seconds = fills.asked[-1]
    assert executor == 10 and 5.9 < seconds <= 6.0


def test_an_items_cost_is_learned_and_sizes_what_fits():
    """One item's cost from one-item tasks, each further item's from batches: a forward's
    fixed cost is paid once a task."""
    lending = BubbleFill(queue.SimpleQueue(), lambda executor, seconds: [])
    assert lending.items_for("ref", 1.0) == 0  # not known: nothing lent
    lending.learn("ref", 0.5, 10)  # a batch alone: 0.05 an item, the first too
    assert lending.items_for("ref", 0.26) == 5
    lending.learn("ref", 0.1, 10)  # the newest batch weighs half
    assert lending.item_seconds["ref"] == pytest.approx(0.03)
    lending.learn("ref", 0.2, 1)  # one item alone takes 0.2 (a forward's fixed cost)
    assert lending.items_for("ref", 0.19) == 0
    assert lending.items_for("ref", 0.27) == 3  # 0.2, then 0.03 each
    assert lending.predicted("ref", 3) == pytest.approx(0.26)


def test_only_scoring_with_a_model_the_flow_does_not_train_is_lent():
    """PPO's reference may take a trainer's bubble; its critic's values may not (the copy there
    would get none of the critic's syncs). A flow with nothing to lend is refused before
    anything starts, saying so."""
    from dataflows.ppo import ppo_flow
    from flowkit.runner import Run, RunConfig
    from flowkit.runner.bubble_fill import bubble_scorers
    from flowkit.runner.config import RunConfigError

    assert bubble_scorers(lower_flow(ppo_flow(prompts=4, stages=2))) == {"ref_logprobs"}
    with pytest.raises(RunConfigError, match="--fill-bubbles: the flow scores nothing with a "
                                             "model it does not train"):
        Run(grpo_flow(prompts=4, n=2, kl_coef=0.0), RunConfig(executors="sim",
                                                               fill_bubbles=True))
