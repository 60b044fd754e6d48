"""RL step benchmark: a GRPO and a PPO run on simulator executors with long-tailed response
lengths, in three modes on the same samples, side by side:

- `barrier`: the flow stage by stage, a barrier between stages (`--no-fuse`);
- `fused`: sample-level (scoring, reference and value inference start per sample, GRPO
  groups as their n samples are in, training microbatches as groups finish);
- `async`: fused, and steps k+1 .. k+η generate while step k trains, with weights at most
  η versions stale (`--max-staleness η`) [Note: asynchronous steps in
  flowkit/runner/flowrun.py];
- `partial`: async, with partial rollouts: each step generates 1.5 x its prompts, takes the
  first groups to finish and carries the rest over ([Note: partial rollouts] in
  flowkit/runner/partial.py); a carried group too stale for the next step is dropped, so a
  step's own prompts all start at once (`stale_segments`, [Note: own prompts first]);
- `multiplexed`: async, the train executors also carrying the rollout tag, so that generation
  fills their idle time (`flowkit run --placement multiplexed`);
- `colocated`: async, every executor both (`--placement colocated`).

In async mode a step's time overlaps its neighbours', so every mode is measured alike by
throughput: the wall-clock from the end of the first step (which profiles, warms up and learns
the batch size) to the end of the last, over the steps in between; every mode trains the same
steps of the same prompts x n samples.

Generation runs on `rollout` executors and training on `train` ones, as in a disaggregated RL
system; a sample's response length is log-normal (most short, a few at the token budget),
so a step's generation ends with a long tail during which, fused, training already runs and,
asynchronously, the next steps' generation too.
Then the real thing at toy scale: the digit-sorting GRPO step on torch executors on this CPU.

Every run is a `flowkit.Run` (benchmarks/runs.py); the simulated ones share one set of executors.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import attrs

__all__ = ["MODES", "Mode", "RLSetup", "modes_named", "placement_groups", "run_rl_bench"]

# slowest first: each mode's ratio to those before it
MODES = ("barrier", "fused", "async", "partial", "multiplexed", "colocated")
OVERSAMPLE = 1.5  # the partial mode's generated prompts per trained prompt (APRIL's 1.5-2x)


@attrs.frozen
class Mode:
    """How a run's steps meet, as RunConfig's settings (`oversample` is the flow's): one field
    per setting, so a further one is a field here and a name in `modes_named`."""

    name: str
    fuse: bool = True
    staleness: int | None = None  # None: synchronous
    oversample: float = 1.0  # > 1: partial rollouts
    placement: str = "disaggregated"  # flowkit run --placement's: which executor runs what

    def run_settings(self, steps: int) -> dict[str, Any]:
        """RunConfig's settings for `steps` steps in this mode."""
        return {"steps": steps, "fuse": self.fuse,
                "asynchronous": self.staleness is not None, "max_staleness": self.staleness}


def modes_named(names: tuple[str, ...] | list[str], *, max_staleness: int) -> list[Mode]:
    """The modes called `names`, in MODES' order (so ratios read later / earlier)."""
    unknown = sorted(set(names) - set(MODES))
    if unknown:
        raise ValueError(f"unknown bench modes {unknown}: choose from {list(MODES)}")
    table = {"barrier": Mode("barrier", fuse=False), "fused": Mode("fused"),
             "async": Mode("async", staleness=max_staleness),
             "partial": Mode("partial", staleness=max(1, max_staleness), oversample=OVERSAMPLE),
             "multiplexed": Mode("multiplexed", staleness=max_staleness, placement="multiplexed"),
             "colocated": Mode("colocated", staleness=max_staleness, placement="colocated")}
    return [table[name] for name in MODES if name in names]


@attrs.frozen
class RLSetup:
    prompts: int = 32
    n: int = 8  # samples per prompt (GRPO); PPO samples each prompt n times too
    max_new_tokens: int = 512
    length_sigma: float = 1.0  # log-normal response lengths, median max_new_tokens / 8
    rollout_executors: int = 8  # 4 prompts each: most of the batch decodes at once, as on GPUs
    train_executors: int = 2  # = pipeline stages
    microbatches: int = 16
    schedule: str = "1f1b"
    # the first is a warm-up in every mode (a barrier step: it learns the batch size); the
    # others are measured. An asynchronous run fills its pipeline over the first η steps and
    # drains it over the last, so it needs a few
    steps: int = 8
    # seconds: a decode iteration's fixed cost, a token of inference, one F / B / W of one
    # microbatch on one stage (before `train_scale`). Every executor's 32 sequences decode
    # together on its rollout engine (executors/sim/engine.py): with a 2 ms iteration and the
    # training side at a quarter of these, generation is about three quarters of the step
    # stage by stage, as the RL systems report (70-90 %)
    token: float = 0.002
    infer_token: float = 0.00002
    F: float = 0.012
    B: float = 0.012
    W: float = 0.008
    optimizer_step: float = 0.01
    # the training side's costs (F, B, W, the optimizer step, a token of inference) times this:
    # at 0.25 the async modes are bound by generation's long tail, as in the RL systems; at 1 by
    # the train executors (the reference log-probs and the backprop keep them busy), where no
    # way of generating can raise the throughput
    train_scale: float = 0.25
    # the partial mode's carried groups too stale for the next step (flowkit.ops.SamplingConfig)
    stale_segments: str = "drop"

    def tags(self, placement: str) -> list[tuple[str, ...]]:
        """The executors' tags: rollout ones, then train ones, as `placement` lends them."""
        rollout, train = placement_groups(placement)
        return [rollout] * self.rollout_executors + [train] * self.train_executors

    def sim_costs(self) -> Any:
        from flowkit.planner.simcosts import SimCosts

        scale = self.train_scale
        return SimCosts(F=self.F * scale, B=self.B * scale, W=self.W * scale,
                        optimizer_step=self.optimizer_step * scale, token=self.token,
                        infer_token=self.infer_token * scale, length_sigma=self.length_sigma)


def placement_groups(placement: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tags of a rollout executor and of a train executor under `placement`
    (`flowkit run --placement`'s, for the benches' executors given by hand)."""
    both = ("rollout", "train")
    rollout = both if placement == "colocated" else ("rollout",)
    train = ("train",) if placement == "disaggregated" else both
    return rollout, train


def run_rl_bench(setup: RLSetup | None = None, *, modes: tuple[str, ...] = MODES,
                 max_staleness: int = 2, torch_steps: int = 6) -> dict:
    """Per algorithm and mode: steps/s over the same steps, the ratios between modes, and the
    staleness of the trained tokens (0 but asynchronously); then the same for the GRPO
    digit-sorting example's step on torch executors on this machine's CPU (`torch_steps`
    steps each, 0 to skip). `max_staleness`: the async mode's bound η."""
    setup = setup or RLSetup()
    for steps in (setup.steps, torch_steps or 2):
        if steps < 2:
            raise ValueError(f"the RL bench measures the steps after the first: needs >= 2, "
                             f"got {steps}")
    chosen = modes_named(modes, max_staleness=max_staleness)
    costs = setup.sim_costs()
    trim = max(mode.staleness or 0 for mode in chosen)
    figures: dict[str, Any] = {"setup": attrs.asdict(setup), "modes": [m.name for m in chosen],
                               "max_staleness": max_staleness,
                               "samples_per_step": setup.prompts * setup.n,
                               "measured_steps": setup.steps - 1}
    # one set of simulator executors per placement for every run, each a Run on their
    # controller (its `controller=`): starting ten processes costs more on this machine than a
    # run's measured steps, and a run leaves nothing behind (its last step ends with nothing
    # open; weights versions are each runner's own: a run's staleness reads as on fresh
    # executors)
    runs: dict[str, dict[str, dict]] = {"grpo": {}, "ppo": {}}
    for placement in dict.fromkeys(mode.placement for mode in chosen):
        with _executors("sim", setup.tags(placement)) as ctl:
            for algo in runs:
                for mode in (m for m in chosen if m.placement == placement):
                    runs[algo][mode.name] = _measured(
                        _flow(setup, algo, mode.oversample, setup.stale_segments),
                        setup.steps, mode, trim,
                        controller=ctl, executors="sim", sim_costs=costs)
    for algo, by_mode in runs.items():  # in MODES' order
        figures[algo] = _compared({mode.name: by_mode[mode.name] for mode in chosen})
    if torch_steps:
        torch_runs = {}
        for mode in chosen:  # each run starts its own executors: it trains from random weights
            tags = _torch_tags(mode.placement)
            torch_runs[mode.name] = _measured(
                _sorting_flow(mode.oversample, setup.stale_segments), torch_steps, mode, trim,
                executors="torch", num_executors=len(tags), tags=tags)
        figures["torch_cpu_grpo"] = {**_compared(torch_runs), "executors": 3,
                                     "measured_steps": torch_steps - 1,
                                     "flow": "examples/grpo_sort.py from random weights"}
    return figures


def _torch_tags(placement: str) -> list[tuple[str, ...]]:
    """The torch part's 1 rollout and 2 train executors, as `placement` lends them."""
    return RLSetup(rollout_executors=1, train_executors=2).tags(placement)


def _compared(runs: dict[str, dict]) -> dict:
    """The runs by mode, and each mode's throughput over every mode before it in MODES."""
    return {**runs, "speedup": _ratios(runs, "steps_per_s"),
            "steady_speedup": _ratios(runs, "steady_steps_per_s")}


def _ratios(runs: dict[str, dict], figure: str) -> dict[str, float]:
    names = [name for name in runs if figure in runs[name]]
    return {f"{later}/{earlier}": runs[later][figure] / runs[earlier][figure]
            for i, later in enumerate(names) for earlier in names[:i]}


@contextlib.contextmanager
def _executors(kind: str, tags: list) -> Iterator[Any]:
    """Executors that the runs compared use in turn (each Run's `controller=`)."""
    from flowkit.runtime import Controller, LocalExecutors

    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind=kind, tags=tags):
        yield ctl


def _measured(flow: Any, steps: int, mode: Mode, trim: int, **settings: Any) -> dict:
    """`steps` steps of a run with RunConfig `settings` (benchmarks/runs.py): steps/s from the
    end of the first (which profiles, warms up and, fused, learns the batch size) to the end of
    the last, the staleness of the tokens trained on in those, steps/s over a window that ends
    `trim` steps before the last (`_steady`), and, synchronously, the median share of
    generation in a step (asynchronously, generation and training overlap across steps: no
    such share)."""
    from benchmarks.runs import bench_run

    ends, reports = [], []
    with bench_run(flow, **settings, **mode.run_settings(steps)) as run:
        for report in run.steps():  # each as its step ends
            reports.append(report)
            ends.append(time.perf_counter())
    reports, wall = reports[1:], ends[-1] - ends[0]
    figures = {"steps_per_s": len(reports) / wall, "step_s": wall / len(reports),
               **_steady(ends, trim), **_staleness(reports)}
    if mode.staleness is None:
        figures["generation_share"] = statistics.median(
            r.timing_s.get("generate", 0.0) / r.elapsed_s for r in reports)
    return figures


def _steady(ends: list[float], trim: int) -> dict:
    """Steps/s from the end of the first step to the end of the η-th before the last: an
    asynchronous run enters that window with steps generating ahead and, unlike at the end of
    the last step, leaves it so too; the headline figure credits it the head start but also
    charges it the drain. `trim`: η of the async mode, so that every mode's window has the
    same steps."""
    last = len(ends) - 1 - trim
    if last < 1:
        return {}
    return {"steady_steps_per_s": last / (ends[last] - ends[0])}


def _staleness(reports: list) -> dict:
    """Max and mean over the steps of the rollout metrics' staleness of trained tokens, in
    weights versions (flows without those metrics: none)."""
    maxima = [r.metrics["staleness/max"] for r in reports if "staleness/max" in r.metrics]
    means = [r.metrics["staleness/mean"] for r in reports if "staleness/mean" in r.metrics]
    if not maxima:
        return {}
    carried = [r.metrics["rollout/carried_over"] for r in reports
               if "rollout/carried_over" in r.metrics]
    return {"staleness_max": max(maxima), "staleness_mean": statistics.fmean(means),
            **({"carried_over_mean": statistics.fmean(carried)} if carried else {})}


def _sorting_flow(oversample: float = 1.0, stale_segments: str = "drop") -> Any:
    from dataflows.grpo import grpo_flow
    from dataflows.rl.tasks import SORT_GPT, sort_prompts, sort_reward

    return grpo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
                     max_new_tokens=8, gpt=SORT_GPT, prompt_source=sort_prompts,
                     reward=sort_reward, source_config={"digits": 3},
                     **_partial(oversample, stale_segments))


def _partial(oversample: float, stale_segments: str) -> dict:
    """The flow settings of partial rollouts (none at oversample 1)."""
    return ({"oversample": oversample, "stale_segments": stale_segments} if oversample > 1
            else {})


def _flow(setup: RLSetup, algo: str, oversample: float = 1.0,
          stale_segments: str = "drop") -> Any:
    train = dict(stages=setup.train_executors, schedule=setup.schedule,
                 microbatches=setup.microbatches, max_new_tokens=setup.max_new_tokens,
                 **_partial(oversample, stale_segments))
    if algo == "grpo":
        from dataflows.grpo import grpo_flow

        return grpo_flow(prompts=setup.prompts, n=setup.n, **train)
    from dataflows.ppo import ppo_flow

    return ppo_flow(prompts=setup.prompts, n=setup.n, **train)
