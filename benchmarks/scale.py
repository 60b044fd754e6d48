"""Scale benchmark: what the engine costs per sample as a GRPO step grows, on simulator executors
whose model ops cost next to nothing, so the step's time is the control plane's.

Method: `grpo_flow(prompts=P, n=8, microbatches=16, max_new_tokens=32)` on 4 rollout and 2 train
simulator executors, every model cost (F, B, W, optimizer step, a decode iteration, a token of
inference) 10 µs, no per-sequence or prefill cost; `steps` steps each fused and stage by stage
(barrier), side by side on the same executors. Per size and mode, medians over the steps after
the first:

- `step_s`; `model_s`, the simulated model time of the busiest executor in the step (a step
  takes at least that long), and `engine_us_per_sample` = (step_s - model_s) / samples, the
  engine's own cost;
- `ops_per_s`: op calls (a batched task's items each count) a second of step;
- `messages_per_sample`: messages through the controller's socket, both ways;
- `controller_cpu_us_per_sample`: the controller process's CPU time (runner and IO threads);
- `first_downstream_s`: from the first finished sample to the first op downstream of
  generation starting, and `generation_s`, generation's makespan.

`lower_bound`: the same step's records (prompts, rollouts, scores, reference log-probs,
experiences) moved as one call per stage through bare pyzmq with msgpack to a peer process that
decodes and encodes them again: what a Ray-style controller that moves whole batches pays,
measured in the same run. `fused_over_barrier` and `fused_over_lower_bound` are ratios of step
times in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["run_scale_bench"]

COST_S = 1e-5  # every simulated model op and decode iteration
ROLLOUT, TRAIN = 4, 2  # executors
RESPONSE, PROMPT = 32, 10  # tokens of the lower bound's records


def run_scale_bench(*, samples: Sequence[int] = (1024, 4096, 16384), steps: int = 4) -> dict:
    """Per size (samples a step, a multiple of 8): fused and barrier figures, and the bare
    pyzmq lower bound."""
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    if steps < 2:
        raise ValueError(f"the bench measures the steps after the first: needs >= 2, got {steps}")
    costs = SimCosts(F=COST_S, B=COST_S, W=COST_S, optimizer_step=COST_S, token=COST_S,
                     token_per_seq=0.0, prefill_token=0.0, infer_token=COST_S)
    tags = [("rollout",)] * ROLLOUT + [("train",)] * TRAIN
    out: dict = {"steps": steps, "cost_s": COST_S, "executors": {"rollout": ROLLOUT,
                                                                 "train": TRAIN}}
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="sim", tags=tags):
        for count in samples:
            figures: dict[str, Any] = {}
            for mode, fuse in (("fused", True), ("barrier", False)):
                figures[mode] = _measure(ctl, count, steps, costs, fuse)
            figures["lower_bound"] = {"step_s": _bare_batches(count, steps)}
            for key, other in (("fused_over_barrier", "barrier"),
                               ("fused_over_lower_bound", "lower_bound")):
                figures[key] = figures["fused"]["step_s"] / figures[other]["step_s"]
            out[str(count)] = figures
    return out


def _measure(ctl: Any, count: int, steps: int, costs: Any, fuse: bool) -> dict:
    from benchmarks.runs import bench_run
    from dataflows.grpo import grpo_flow

    flow = grpo_flow(prompts=max(1, count // 8), n=8, microbatches=16, max_new_tokens=RESPONSE)
    calls = [0]

    def count_calls(event: str, payload: dict) -> None:
        if event == "task_done":
            calls[0] += payload["task"].items or 1

    rows = []
    ctl.add_listener(count_calls)
    try:
        with bench_run(flow, controller=ctl, steps=steps, executors="sim", sim_costs=costs,
                       fuse=fuse, step_timeout=3600) as run:
            before = _counters(ctl, calls)
            for report in run.steps():
                after = _counters(ctl, calls)
                rows.append(_step_row(report.elapsed_s, before, after, run.runner.last_run,
                                      count))
                before = _counters(ctl, calls)  # what the reporting cost is not the step's
    finally:
        ctl.remove_listener(count_calls)
    rows = rows[1:]
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def _counters(ctl: Any, calls: list) -> dict:
    simulated = [ctl.submit("simulated_seconds", executor=e.id) for e in ctl.executors()]
    return {"cpu": time.process_time(), "messages": ctl.messages_in + ctl.messages_out,
            "calls": calls[0], "simulated": [f.result(timeout=30) for f in simulated]}


def _step_row(step_s: float, before: dict, after: dict, step: Any, count: int) -> dict:
    model_s = max(b - a for a, b in zip(before["simulated"], after["simulated"], strict=True))
    generate = step.states["generate"]
    downstream = [step.states[name].first_start for name in step.wiring.consumers["generate"]
                  if step.states[name].first_start is not None]
    first_item = generate.first_item if generate.first_item is not None else generate.last_end
    return {"step_s": step_s, "model_s": model_s,
            "engine_us_per_sample": (step_s - model_s) / count * 1e6,
            "ops_per_s": (after["calls"] - before["calls"]) / step_s,
            "messages_per_sample": (after["messages"] - before["messages"]) / count,
            "controller_cpu_us_per_sample": (after["cpu"] - before["cpu"]) / count * 1e6,
            "first_downstream_s": min(downstream) - first_item,
            "generation_s": generate.last_end - generate.first_start}


def _records(count: int) -> dict[str, list]:
    """The step's records by stage, as plain msgpack maps the size of flowkit's."""
    tokens, floats = list(range(RESPONSE)), [-0.5] * RESPONSE
    prompts = [{"prompt_id": i // 8, "tokens": list(range(PROMPT)), "answer": "42"}
               for i in range(count)]
    rollouts = [{**p, "sample": i % 8, "response_tokens": tokens, "logprobs": floats,
                 "versions": [0] * RESPONSE, "finished": True} for i, p in enumerate(prompts)]
    scored = [{**r, "reward": 1.0} for r in rollouts]
    ref = [{"prompt_id": r["prompt_id"], "sample": r["sample"], "values": floats}
           for r in rollouts]
    experiences = [{**s, "ref_logprobs": floats, "advantages": floats} for s in scored]
    return {"generate": prompts, "reward": rollouts, "ref_logprobs": rollouts,
            "with_reference": scored + ref, "advantages": experiences, "train": experiences}


def _bare_batches(count: int, steps: int) -> float:
    """Median seconds to move a step's records through bare pyzmq, one call per stage."""
    import msgpack
    import zmq

    from benchmarks.peers import spawn

    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    port = client.bind_to_random_port("tcp://127.0.0.1")
    server = spawn("batch", f"tcp://127.0.0.1:{port}")
    stages = _records(count)
    try:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            for records in stages.values():
                client.send(msgpack.packb(records))
                if not client.poll(60_000):
                    raise RuntimeError(f"the batch peer did not answer (exit code "
                                       f"{server.poll()})")
                msgpack.unpackb(client.recv())
            times.append(time.perf_counter() - start)
        client.send(b"stop")
        server.wait(10)
    finally:
        if server.poll() is None:
            server.kill()
        client.close()
        context.term()
    return statistics.median(times[1:])
