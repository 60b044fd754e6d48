"""The admission gate of asynchronous steps [Note: asynchronous steps in flowkit/runner/flowrun.py]:
a reader of fed-back weights may run up to max_staleness versions behind, a reader of a chained
feedback (adaptive sampling's difficulty) waits for the step just before."""

from __future__ import annotations

from dataflows.grpo import grpo_flow
from dataflows.rl.adaptive import AdaptiveSampling
from flowkit.planner.lower import lower_flow
from flowkit.runner.feedback import Feedback
from flowkit.runner.stepstate import Streams

PLAN = {node.name: node for node in lower_flow(grpo_flow(
    prompts=4, n=4, max_new_tokens=6, adaptive=AdaptiveSampling(), max_staleness=2))}


def test_the_difficulty_is_chained_and_the_weights_are_not():
    rules = {(name, rule.src_port): rule for name, node in PLAN.items()
             for rule in node.inputs if rule.feedback}
    assert {key for key, rule in rules.items() if rule.chained} == {
        ("allocate_samples", "out"), ("update_difficulty", "out")}
    assert any(not rule.chained for rule in rules.values())  # generation's weights


def _produced(gate: Feedback, step: int, reader: str) -> None:
    """Step `step` produced what `reader` reads fed back."""
    (rule,) = [rule for rule in PLAN[reader].inputs if rule.feedback]
    streams = Streams()
    streams[(rule.src, rule.src_port)].add((0,), object())
    gate.produced(step, streams, rule.src, rule.src_port)


def test_a_chained_reader_waits_for_the_step_just_before_and_a_weights_reader_does_not():
    gate = Feedback(list(PLAN.values()), staleness=2, open={})
    allocate, generate = PLAN["allocate_samples"], PLAN["generate"]
    assert gate.admits(0, allocate) and gate.admits(0, generate)  # nothing to wait for yet
    assert not gate.admits(3, generate)  # 3 versions behind the weights none made yet
    _produced(gate, 0, "allocate_samples")
    _produced(gate, 0, "generate")
    # step 2 may generate with step 0's weights (2 versions behind), not allocate by step 0's
    # difficulty: step 1's comes first
    assert gate.admits(2, generate) and not gate.admits(2, allocate)
    assert gate.admits(1, allocate)
    _produced(gate, 1, "allocate_samples")
    assert gate.admits(2, allocate)


def test_a_synchronous_run_admits_every_reader():
    gate = Feedback(list(PLAN.values()), staleness=None, open={})
    assert gate.admits(5, PLAN["allocate_samples"]) and gate.admits(5, PLAN["generate"])
