"""A backprop's microbatches as its step feeds them: a pipeline schedule fed microbatch by
microbatch as items arrive (`Feeding`, [Note: streamed microbatches in model_training.py]), or every
minibatch round at once (`MinibatchRounds`, [Note: minibatch rounds in
flowkit/ops/minibatches.py]).
"""

from __future__ import annotations

from typing import Any

import attrs

from flowkit.ops import cut, minibatch_rounds, rounds_of
from flowkit.planner import Action, Costs, Schedule, action_key, simulate
from flowkit.planner.lower import NodePlan
from flowkit.planner.simulate import dependencies
from flowkit.runner.pipeline import PipelineRun
from flowkit.runner.replicas import ReplicatedSchedule
from flowkit.runner.stepstate import FlowRunError, Inputs, sorted_lineages
from flowkit.runner.token_microbatches import TokenSlots, fill_one
from flowkit.wire.refs import Gather

__all__ = ["Feeding", "MinibatchRounds", "chunk", "form_microbatches", "inputs_made",
           "token_bins", "train_rounds"]


@attrs.define
class Feeding:
    """A backprop's schedule being fed microbatches [Note: streamed microbatches], one run per
    replica [Note: replicas in flowkit/runner/replicas.py]."""

    submitter: ReplicatedSchedule
    sizes: list[int]  # planned items per microbatch
    streamed: bool  # microbatches form as items arrive, not after the inputs close
    next_mb: int = 0
    taken: set = attrs.field(factory=set)  # lineages already in a microbatch
    # what arrived, kept as it comes so each event looks only at the new items
    seen: int = 0  # the first input's arrivals looked at
    waiting: list = attrs.field(factory=list)  # arrived there, not yet on every other input
    pool: list = attrs.field(factory=list)  # on every input, in no microbatch yet

    counted: bool = False  # its item count is the next step's plan (once all is submitted)
    # microbatch_tokens: the budget, the global microbatches left by replica, the tokens
    # formed so far [Note: token-budget microbatches in token_microbatches.py]
    budget: int | None = None
    slots: TokenSlots | None = None
    tokens_taken: int = 0

    optimizer_steps = 1

    @property
    def runs(self) -> list[PipelineRun]:
        """Each replica's run."""
        return self.submitter.runs

    @property
    def submitted(self) -> bool:
        """Whether every action of its schedule is submitted."""
        return self.submitter.done


@attrs.define
class MinibatchRounds:
    """A backprop's minibatch rounds, every one submitted once the items are in: each round's
    schedule, then its optimizer step in the same lanes, so that the next round's ops run on the
    weights it made [Note: minibatch rounds in flowkit/ops/minibatches.py]."""

    rounds: list[list[PipelineRun]]  # per round, each replica's run
    reports: list  # the StepMetrics futures of every round's step but the last's
    streamed: bool = False  # rounds cut the whole batch: a barrier

    @property
    def runs(self) -> list[PipelineRun]:
        return [run for runs in self.rounds for run in runs]

    @property
    def optimizer_steps(self) -> int:
        return len(self.rounds)

    @property
    def submitted(self) -> bool:
        """Every round is submitted at once."""
        return True


def form_microbatches(feeding: Feeding, inputs: Inputs, closed: bool) -> None:
    """Feed the next microbatches that the items in let form: each its planned size, the last
    (or, once the inputs close, every one left) from what remains; by tokens with a budget."""
    _take_arrivals(feeding, inputs)
    if feeding.budget is not None:
        _form_by_tokens(feeding, inputs, closed)
        return
    pool = feeding.pool
    if not feeding.streamed:
        pool[:] = sorted_lineages(pool)  # a barrier cuts the items in their lineages' order
    while feeding.next_mb < len(feeding.sizes):
        mb, left = feeding.next_mb, len(feeding.sizes) - feeding.next_mb
        if closed:  # the rest, spread over the microbatches still to form
            size = len(pool) // left + (1 if len(pool) % left else 0)
        elif mb == len(feeding.sizes) - 1 or len(pool) < feeding.sizes[mb]:
            break  # the last microbatch takes whatever is left when the inputs close
        else:
            size = feeding.sizes[mb]
        chosen, pool = pool[:size], pool[size:]
        feeding.taken.update(chosen)
        feeding.submitter.feed(mb, inputs.gathered(chosen))
        feeding.next_mb += 1
    feeding.pool = pool


def _form_by_tokens(feeding: Feeding, inputs: Inputs, closed: bool) -> None:
    """[Note: token-budget microbatches in token_microbatches.py]: one microbatch each time the
    items in fill the budget, keeping the last slot for the close; at the close every slot."""
    pool = feeding.pool if feeding.streamed else sorted_lineages(feeding.pool)
    tokens = inputs.tokens(pool)
    slots, budget = feeding.slots, feeding.budget
    if closed:
        for microbatch, chosen in token_bins(pool, tokens, slots):
            _feed_tokens(feeding, inputs, microbatch, chosen, tokens)
        feeding.pool = []
        return
    while slots.spare and sum(tokens[lin] for lin in pool) >= budget:
        chosen = fill_one(pool, tokens, budget)
        _feed_tokens(feeding, inputs, slots.take(sum(tokens[lin] for lin in chosen),
                                                 keep_last=True), chosen, tokens)
        taken = set(chosen)
        pool = [lin for lin in pool if lin not in taken]
    feeding.pool = pool


def token_bins(lineages: list, tokens: dict, slots: TokenSlots) -> list[tuple[int, list]]:
    """(global microbatch, its lineages) of every slot left, the heaviest first: `lineages`
    placed to even out the replicas' tokens (TokenSlots.place) [Note: token-budget
    microbatches in token_microbatches.py]."""
    return slots.place(lineages, tokens)


def _feed_tokens(feeding: Feeding, inputs: Inputs, microbatch: int, chosen: list,
                 tokens: dict) -> None:
    feeding.taken.update(chosen)
    feeding.tokens_taken += sum(tokens[lin] for lin in chosen)
    feeding.submitter.feed(microbatch, inputs.gathered(chosen))
    feeding.next_mb += 1


def _take_arrivals(feeding: Feeding, inputs: Inputs) -> None:
    """Move the lineages every input now has into the pool, looking only at new arrivals of
    the first input and those still waiting for a partner."""
    arrivals = inputs.lead_arrivals
    feeding.waiting += arrivals[feeding.seen:]
    feeding.seen = len(arrivals)
    others, still = inputs.others(), []
    for lin in feeding.waiting:
        (feeding.pool if all(lin in items for items in others) else still).append(lin)
    feeding.waiting = still


def chunk(items: list, count: int, index: int) -> list:
    """The index-th of `count` contiguous, near-equal slices of `items`."""
    base, extra = divmod(len(items), count)
    start = index * base + min(index, extra)
    return items[start:start + base + (1 if index < extra else 0)]


def inputs_made(run: PipelineRun, action: Action) -> bool:
    """Whether what `action` reads is made, so the bubble before it is gone: the actions it
    depends on are done, or for a first stage's forward, its microbatch came (it went out)."""
    needs = dependencies(action, run.schedule.num_stages)
    if not needs:
        return action in run.futures
    done = {a.key for a, future in run.futures.items() if future.done()}
    return all(action_key(*dep) in done for dep in needs)


# -- minibatch rounds [Note: minibatch rounds in flowkit/ops/minibatches.py] ---------------
# Every round is submitted at once, the control plane running ahead of the data: a round's
# optimizer step runs in each device's lane after that device's F/B/W of the round, and the
# next round's ops after it, so no round reads weights its predecessor has not stepped.
def train_rounds(training: Any, plan: NodePlan, inputs: Inputs,
                 watch: Any) -> MinibatchRounds:
    """`training`'s (a model_training.ModelTraining's) backprop `plan` in minibatch rounds: shuffle
    and cut the batch into the rounds' minibatches, run each under one schedule (as many
    microbatches as the smallest minibatch allows, up to the configured number) and step after
    each but the last, whose step is the optimizer-step node's."""
    step_plan = _step_plan(training, plan)
    ordered = sorted_lineages(inputs.complete())
    config = plan.config
    try:
        rounds = minibatch_rounds(len(ordered), epochs=config["epochs"],
                                  minibatches=config["minibatches"],
                                  seed=config.get("shuffle_seed") or 0, step=training.step)
    except ValueError as exc:
        raise FlowRunError(f"step {training.step}: {plan.name!r}: {exc}") from None
    count = max(training.replicas, min(int(config.get("microbatches") or 1),
                                       *map(len, rounds)))
    cuts = [cut([ordered[i] for i in indices], count) for indices in rounds]
    stage_costs, schedules = training.planning.replicas(
        plan, config.get("schedule") or "1f1b", count, lambda: inputs.first(cuts[0][0]))
    training.predicted_bubble[plan.name] = simulate(schedules[0], stage_costs).bubble_rate
    training.item_counts[plan.name] = len(ordered)
    runs, reports = [], []
    for index, microbatches in enumerate(cuts):
        runs.append(_submit_round(training, plan, index, microbatches, schedules,
                                  stage_costs, inputs, watch))
        if index < len(cuts) - 1:
            losses = [f for run in runs[-1] for f in run.losses]
            report = training.submit_step(step_plan, [Gather(losses)], watch, outputs=2,
                                          round_index=index)
            watch((), report, register=False)
            reports.append(report[0])  # the round's StepMetrics, for the last one's report
    return MinibatchRounds(rounds=runs, reports=reports)


def _submit_round(training: Any, plan: NodePlan, index: int, microbatches: list[list],
                  schedules: list[Schedule], stage_costs: Costs, inputs: Inputs,
                  watch: Any) -> list[PipelineRun]:
    """One round's schedules, its microbatches fed at once; the last stage's forwards are
    the backprop's stats, by (round, global microbatch). Each replica's run."""
    submitter = training.replicated(plan, schedules, stage_costs,
                                    [len(m) for m in microbatches], watch,
                                    lineage=lambda mb: (index, mb),
                                    meta={"node": plan.name, "step": training.step,
                                          "round": index})
    for mb, chosen in enumerate(microbatches):
        submitter.feed(mb, inputs.gathered(chosen))
    submitter.advance()
    return submitter.runs


def _step_plan(training: Any, plan: NodePlan) -> NodePlan:
    """The optimizer-step node that `plan`'s stats feed: its config steps every round."""
    for step in training.steps:
        if any(rule.src == plan.name and not rule.feedback for rule in step.inputs):
            return step
    raise FlowRunError(f"step {training.step}: {plan.name!r} trains model "
                       f"{training.model.name!r} in {rounds_of(plan.config)} minibatch rounds "
                       "(epochs x minibatches), each followed by an optimizer step configured "
                       "by the OptimizerStep its stats feed, but its stats feed none")
