"""The timed simulator executor: every model op keeps the executor busy for the time its cost
says and returns outputs of the right kind and size, so any plan runs on real processes, with
real dispatch and real data movement, on a machine without a GPU.

The planner's lowering puts each task's cost in its config (`seconds`, or `seconds_per_token` for
ops whose time depends on what they produce); this module only obeys it. Sampled lengths and
values come from a generator seeded by the task's identity, so a run is reproducible.
`generate` is a deferred op: the executor's rollout engine (executors/sim/engine.py) decodes
every live request together, one timed iteration at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from typing import Any

import attrs

from executors.optable import OpContext, OpTable
from executors.sim.engine import EngineCosts, engine_of
from flowkit.ops.configs import SAMPLING, AgentConfig, SamplingConfig
from flowkit.ops.records import (
    MicrobatchStats,
    Prompt,
    Rollout,
    TokenScores,
    WeightsVersion,
    resumable,
    sample_indices,
    samples_of,
    step_report,
)
from flowkit.wire.files import FileRefused, read_regular

__all__ = ["busy_for", "register", "sample_rollout"]

_SPIN_S = 0.0002


_SIMULATED = [0.0]  # seconds of model work this executor has stood in for


def busy_for(seconds: float) -> None:
    """Occupy this executor for `seconds`: sleep most of it (other executors share the cores),
    then spin briefly so the op ends on time rather than when the scheduler wakes us."""
    _SIMULATED[0] += max(0.0, float(seconds))
    deadline = time.perf_counter() + max(0.0, float(seconds))
    if seconds > _SPIN_S:
        time.sleep(seconds - _SPIN_S)
    while time.perf_counter() < deadline:
        pass


def _activation(nbytes: int) -> Any:
    """`nbytes` of stand-in activations, sent out of band as a tensor's bytes are: a numpy
    array, not a torch tensor, so that a simulator executor imports torch only when its flow
    sends it tensors (an RL flow's records are lists): torch's import costs 1.2 s of a core,
    numpy's a tenth of that."""
    import numpy

    return numpy.empty(max(0, int(nbytes)), dtype=numpy.uint8)


# -- offload copies and activation memory ------------------------------------------------------
# [Note: simulated copy engines] As the planner's simulator models them (flowkit/planner/
# simulate.py, [Note: offload] in flowkit/planner/offload.py): each executor has one copy engine
# a direction beside its compute, each copying in the order it was given copies. An offloading
# F's copy out starts when the F ends and its engine is free; a prefetch starts when the op
# that carries it starts, its engine is free and its copy out has ended; the backward of an
# offloaded microbatch waits for its prefetch (or, given none, copies it back itself). The
# copies are times on the clock, not sleeps: compute goes on beside them. Activation memory is
# counted in the planner's units (microbatch stashes): each pipeline op adds its `memory` (an
# addition as it starts, a release as it ends), an offload takes the F's addition off when its
# copy ends and a prefetch puts it back when its copy starts; `activation_memory` reads the
# peak [Note: activation memory reports in flowkit/runner/device_reports.py].
@attrs.define
class _Copies:
    out_free: float = 0.0  # when each engine is free
    in_free: float = 0.0
    offloaded: dict = attrs.field(factory=dict)  # key -> (copy out's end, stash, seconds)
    ready: dict = attrs.field(factory=dict)  # key -> prefetch's end
    level: float = 0.0
    peak: float = 0.0
    events: list = attrs.field(factory=list)  # (time, is addition, delta): copies to come

    def settle(self, now: float) -> None:
        """Apply the copies' memory changes up to `now`, in time order, releases first."""
        due = sorted(e for e in self.events if e[0] <= now)
        self.events = [e for e in self.events if e[0] > now]
        for _, _, delta in due:
            self.change(delta)

    def change(self, delta: float) -> None:
        self.level += delta
        self.peak = max(self.peak, self.level)

    def offload(self, key: tuple, seconds: float, stash: float) -> None:
        now = time.perf_counter()
        end = max(now, self.out_free) + max(0.0, float(seconds))
        self.out_free = end
        self.offloaded[key] = (end, stash, float(seconds))
        self.events.append((end, False, -stash))

    def prefetch(self, key: tuple, seconds: float | None = None) -> None:
        """Start copying `key` back (its copy out's time if `seconds` is None)."""
        if key not in self.offloaded or key in self.ready:
            return
        out_end, stash, out_seconds = self.offloaded[key]
        start = max(time.perf_counter(), self.in_free, out_end)
        took = out_seconds if seconds is None else float(seconds)
        self.in_free = self.ready[key] = start + max(0.0, took)
        self.events.append((start, True, stash))

    def wait(self, key: tuple, seconds: float | None) -> None:
        """Before a backward: its microbatch back on the device."""
        if key not in self.offloaded:
            return
        self.prefetch(key, seconds)  # none came: copy it back now
        self.offloaded.pop(key)
        ready = self.ready.pop(key)
        while time.perf_counter() < ready:
            time.sleep(max(0.0, min(ready - time.perf_counter() - _SPIN_S, 0.05)))
        self.settle(ready)


def _copies(ctx: OpContext) -> _Copies:
    return ctx.state.setdefault("sim_copies", _Copies())


def _stage_op(ctx: OpContext, meta: dict, memory: float, prefetch: Any,
              work: Any) -> Any:
    """Run a pipeline op's `work` as the copy engines and memory accounting see it: its
    prefetches issued as it starts, its memory added as it starts or released as it ends."""
    copies = _copies(ctx)
    copies.settle(time.perf_counter())
    for entry in prefetch or ():
        if (int(entry[0]), int(entry[1])) != (meta.get("stage"), meta.get("microbatch")):
            copies.prefetch(_key(meta, entry[0], entry[1]),
                            float(entry[2]) if len(entry) > 2 else None)
    if memory > 0:
        copies.change(memory)
    out = work()
    copies.settle(time.perf_counter())
    if memory < 0:
        copies.change(memory)
    return out


def _key(meta: dict, stage: Any, microbatch: Any) -> tuple:
    return (meta.get("model"), int(stage), int(microbatch))


def _activation_memory(ctx: OpContext, *_: Any, model: str = "", reset: bool = True) -> dict:
    """This executor's activation memory in microbatch stashes: its peak since the last reset
    and now [Note: simulated copy engines]."""
    copies = _copies(ctx)
    copies.settle(time.perf_counter())
    peak, now = copies.peak, copies.level
    if reset:
        copies.peak = copies.level
    return {"peak": peak, "now": now, "unit": "microbatches"}


# -- pipeline stage ops: F, B, W, BW -----------------------------------------------------------
def _forward(ctx: OpContext, *inputs: Any, seconds: float = 0.0, out_bytes: int = 0,
             last: bool = False, tokens: int = 0, offload: bool = False,
             copy_seconds: float = 0.0, prefetch: Any = (), memory: float = 0.0,
             seconds_per_token: float = 0.0, **meta: Any) -> Any:
    """An activation for the next stage (with the microbatch's token count), or on the last
    stage this microbatch's loss stats. `offload`: its stash's copy out follows it, and a
    prefetch of its own microbatch after that [Note: simulated copy engines].
    `seconds_per_token`: each of its tokens costs that on top [Note: per-token costs]."""
    out = _stage_op(ctx, meta, memory, prefetch,
                    lambda: _forward_work(ctx, inputs,
                                          (float(seconds), float(seconds_per_token)), out_bytes,
                                          last, tokens, meta))
    if offload:
        key = _key(meta, meta.get("stage", 0), meta.get("microbatch", 0))
        copies = _copies(ctx)
        copies.offload(key, copy_seconds, max(0.0, float(memory)))
        for entry in prefetch or ():
            if (int(entry[0]), int(entry[1])) == key[1:]:
                copies.prefetch(key, entry[2] if len(entry) > 2 else copy_seconds)
    return out


# [Note: per-token costs] With SimCosts.F_token, B_token and W_token a pipeline op costs its
# microbatch's seconds plus that much per token of the microbatch, as a real stage's matmuls
# do: the F counts its tokens (stage 0 from the records, later stages from what the activation
# carries) and keeps them for the same microbatch's B and W on this executor. So microbatches
# of unequal tokens cost unequally, which token-budget microbatches even out
# (flowkit/runner/token_microbatches.py; `flowkit bench train --microbatch-tokens`).
def _forward_work(ctx: OpContext, inputs: tuple, seconds: tuple[float, float], out_bytes: int,
                  last: bool, tokens: int, meta: dict) -> Any:
    # the microbatch's token count rides with its activations, as real stages pass metadata on
    carried = [v["tokens"] for v in inputs if isinstance(v, dict) and "tokens" in v]
    count = int(tokens) or (carried[0] if carried else _tokens(inputs))
    _microbatch_tokens(ctx)[_key(meta, meta.get("stage", 0), meta.get("microbatch", 0))] = count
    busy_for(seconds[0] + seconds[1] * count)
    if last:
        rng = random.Random(_seed(ctx, meta))
        return MicrobatchStats(loss=2.0 + rng.random(), tokens=count)
    return {"activation": _activation(out_bytes), "tokens": count}


def _tokens(inputs: tuple) -> int:
    """Tokens in a microbatch as it reached the first stage: records or token tensors."""
    count = 0
    for value in inputs:
        for item in value if isinstance(value, list) else [value]:
            if hasattr(item, "response_tokens"):
                count += len(item.prompt_tokens) + len(item.response_tokens)
            elif hasattr(item, "numel"):
                count += int(item.numel())
    return count


def _microbatch_tokens(ctx: OpContext) -> dict:
    """(model, stage, microbatch) -> the tokens its F counted [Note: per-token costs]."""
    return ctx.state.setdefault("sim_microbatch_tokens", {})


def _backward_input(ctx: OpContext, *inputs: Any, seconds: float = 0.0, out_bytes: int = 0,
                    first: bool = False, prefetch: Any = (), memory: float = 0.0,
                    seconds_per_token: float = 0.0, **meta: Any) -> Any:
    """The gradient for the previous stage's output (nothing on the first stage), once an
    offloaded microbatch is back [Note: simulated copy engines]."""
    def work() -> Any:
        key = _key(meta, meta.get("stage", 0), meta.get("microbatch", 0))
        _copies(ctx).wait(key, _copy_seconds(prefetch, key))
        busy_for(float(seconds) + float(seconds_per_token) * _microbatch_tokens(ctx).get(key, 0))
        return None if first else _activation(out_bytes)

    return _stage_op(ctx, meta, memory, prefetch, work)


def _copy_seconds(prefetch: Any, key: tuple) -> float | None:
    """A prefetch's seconds, for a backward that must copy its microbatch back itself: the
    copy this op carries of it, else (None) its copy out's."""
    for entry in prefetch or ():
        if (int(entry[0]), int(entry[1])) == key[1:] and len(entry) > 2:
            return float(entry[2])
    return None


def _backward_weight(ctx: OpContext, *inputs: Any, seconds: float = 0.0, prefetch: Any = (),
                     memory: float = 0.0, seconds_per_token: float = 0.0, **meta: Any) -> None:
    key = _key(meta, meta.get("stage", 0), meta.get("microbatch", 0))
    tokens = _microbatch_tokens(ctx).get(key, 0)
    _stage_op(ctx, meta, memory, prefetch,
              lambda: busy_for(float(seconds) + float(seconds_per_token) * tokens))


def _grad_stats(ctx: OpContext, *inputs: Any, stage: int = 0, **config: Any) -> tuple:
    """A stage's gradient stats for the step across stages: no gradients here."""
    return {"stage": int(stage), "sqnorm": 0.0}, {}


def _reduce_grads(ctx: OpContext, *inputs: Any, allreduce_seconds: float = 0.0,
                  **config: Any) -> None:
    """A stage's all-reduce over its replicas: it starts once every replica's last action of
    the stage is done (its inputs) and takes the modelled time (SimCosts.allreduce_s)."""
    busy_for(allreduce_seconds)


def _optimizer_step(ctx: OpContext, *inputs: Any, seconds: float = 0.0, model: str = "",
                    step: int = 0, report: bool = False, **config: Any) -> Any:
    """One stage's optimizer step. The stage that `report`s reads every microbatch's stats and
    returns the step's metrics and the new weights' version."""
    busy_for(seconds)
    if not report:
        return None
    return step_report(inputs, model=model, step=step, grad_norm=1.0)


# -- generation and inference ------------------------------------------------------------------
def _generate(ctx: OpContext, prompt: Any, *weights: Any, seconds_per_token: float = 0.0,
              seconds_per_seq: float = 0.0, seconds_per_prefill_token: float = 0.0,
              token_budget: int = 2048, max_batch: int = 256, min_new_tokens: int = 1,
              length_sigma: float = 0.0, prompt_sigma: float = 0.0, step: int = 0,
              request: str | None = None, min_version: int | None = None,
              first_sample: int = 0, **config: Any) -> Any:
    """n rollouts of a prompt (numbered from `first_sample`: records.sample_indices), decoded
    by the executor's rollout engine together with every other live request [Note: simulated
    rollout engine in executors/sim/engine.py]; each sample leaves the moment its last token
    is decoded (streamed when the task streams). Given a
    carried group (a list of Rollouts, [Note: partial rollouts] in flowkit/runner/partial.py)
    instead, its interrupted samples decode the rest of the lengths they were drawn with (by
    their origin `step`) and its finished ones pass through; stale ones as the torch op does.
    The sampling settings are the task's (flowkit.ops.SamplingConfig); the lengths drawn only
    read n and max_new_tokens."""
    sampling, config = SamplingConfig.split(config)
    if AgentConfig.split(config)[0].environment is not None:
        raise ValueError("simulator executors sample no multi-turn trajectories: a generate "
                         "with an environment runs on torch executors (--executor torch)")
    if sampling.branching:
        raise ValueError("simulator executors sample no tree rollouts: a generate with "
                         "branch_at and branches runs on torch executors (--executor torch)")
    n, max_new_tokens = sampling.n, sampling.max_new_tokens
    version = _newest_version(weights)
    draw = {"step": step, "min_new_tokens": min_new_tokens, "max_new_tokens": max_new_tokens,
            "length_sigma": length_sigma, "prompt_sigma": prompt_sigma, "version": version}
    if isinstance(prompt, list):
        items = resumable(prompt, min_version, sampling.stale_segments)
        if not items:
            return []
        rollouts, lengths = zip(*[_continued(item, draw) for item in items])
        prefix = max(len(r.prompt_tokens) + len(r.response_tokens) - n for r, n in
                     zip(rollouts, lengths))
    else:
        prompt_id = getattr(prompt, "prompt_id", prompt)
        if isinstance(first_sample, bool) or not isinstance(first_sample, int) \
                or first_sample < 0:
            raise ValueError(f"first_sample must be a whole number >= 0 (the index of a later "
                             f"round's first sample), got {first_sample!r}")
        _check_counts(prompt_id, n=n if first_sample else samples_of(prompt, n),
                      max_new_tokens=max_new_tokens)
        samples = sample_indices(prompt, n, first_sample)
        rollouts = [sample_rollout(prompt, sample, **draw) for sample in samples]
        lengths = [len(r.response_tokens) for r in rollouts]
        prefix = len(getattr(prompt, "tokens", ()))
    costs = EngineCosts(token=seconds_per_token, per_seq=seconds_per_seq,
                        prefill_token=seconds_per_prefill_token, token_budget=int(token_budget),
                        max_batch=int(max_batch))
    return engine_of(ctx.background).submit(list(rollouts), list(lengths), prompt_tokens=prefix,
                                            costs=costs, stream=ctx.emit is not None,
                                            key=request)


def _continued(item: Rollout, draw: dict) -> tuple[Rollout, int]:
    """A carried sample as it will end, and the tokens still to decode: a finished one as it
    is (0), an interrupted one the rest of the sample its origin step drew, the new tokens
    of the current version."""
    if not item.interrupted:
        return item, 0
    prompt = Prompt(prompt_id=item.prompt_id, tokens=list(item.prompt_tokens),
                    answer=item.answer, text=item.prompt_text)
    whole = sample_rollout(prompt, item.sample, **draw)
    rest = max(1, len(whole.response_tokens) - len(item.response_tokens))
    versions = list(item.versions)[:len(whole.response_tokens) - rest]
    return attrs.evolve(whole, versions=versions + [draw["version"]] * rest), rest


def _newest_version(weights: tuple) -> int:
    """The newest WeightsVersion among a request's weights inputs (lists of them included)."""
    flat = [w for value in weights for w in (value if isinstance(value, list) else [value])]
    return max([int(w.version) for w in flat if isinstance(w, WeightsVersion)] or [-1])


def _generation(ctx: OpContext, *_: Any, action: str, model: str | None = None,
                requests: list | None = None) -> Any:
    """Pause, resume or abort this executor's rollout engine, as the torch executor's op does;
    abort returns how many samples came back interrupted, or with `requests` (generate's
    `request` names) cuts only those and returns [samples, tokens] cut."""
    if action not in ("pause", "resume", "abort"):
        raise ValueError(f"generation action {action!r} is not one of pause, resume, abort")
    if requests is not None and action != "abort":
        raise ValueError(f"generation names requests to abort them, not to {action}")
    if requests is not None:  # also before the engine or the request exists: it remembers
        return list(engine_of(ctx.background).abort({str(r) for r in requests}))
    engine = ctx.background.get("generate")
    if engine is None:
        return 0
    if action == "abort":
        return engine.abort()[0]
    engine.pause(action == "pause")
    return 0


def _check_counts(prompt_id: Any, **counts: Any) -> None:
    """A bad request fails alone, naming its prompt, before it reaches the engine."""
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"generate for prompt {prompt_id!r}: {key} must be a whole number "
                             f">= 1, got {value!r}")


def sample_rollout(prompt: Any, sample: int, *, step: int, min_new_tokens: int = 1,
                   max_new_tokens: int = SAMPLING.max_new_tokens, length_sigma: float = 0.0,
                   prompt_sigma: float = 0.0, version: int = -1) -> Rollout:
    """Sample `sample` of `prompt` at `step`: its length has the long tail real sampling has
    (most stop early, a few run to max_new_tokens: exponential lengths, or log-normal ones with
    `length_sigma` > 0), scaled by its prompt's own factor (`prompt_sigma`). Seeded by (prompt,
    sample, step) alone, so it is the same whatever else decodes beside it. Every token records
    `version`, the weights version the request was given (-1: none yet), as a real engine's
    tokens do (the simulator loads no weights, so a request never changes version)."""
    prompt_id = getattr(prompt, "prompt_id", prompt)
    draws = _draws(f"{prompt_id}/{sample}/{step}")
    scale = math.exp(prompt_sigma * _normal(_draws(f"prompt/{prompt_id}").digest(16))) \
        if prompt_sigma > 0 else 1.0
    length = _sampled_length(draws.digest(16), max(1, min_new_tokens), max_new_tokens,
                             length_sigma, scale)
    drawn = draws.digest(16 + 2 * length)  # the same first 16 bytes, then a byte a token each
    tokens = [32 + byte % 95 for byte in drawn[16:16 + length]]
    logprobs = [byte * (-3 / 255) for byte in drawn[16 + length:]]
    return Rollout(prompt_id=getattr(prompt, "prompt_id", 0), sample=sample,
                   prompt_tokens=list(getattr(prompt, "tokens", [])), response_tokens=tokens,
                   logprobs=logprobs, versions=[version] * length,
                   finished=length < max_new_tokens, answer=getattr(prompt, "answer", None),
                   prompt_text=getattr(prompt, "text", None))


# [Note: simulator draws] What the simulator makes up for a sample (its length, tokens and
# log-probabilities, a reference's scores) is a function of the sample's identity alone, so a run
# is reproducible whatever decodes beside it, on any machine. It is read from SHAKE-128 of that
# identity, an extendable hash whose first bytes do not depend on how many are asked for: a
# microsecond a sample, where seeding a Mersenne Twister from a string took five, and the
# simulator's own CPU is not the engine's (`flowkit bench scale` counts every CPU second beside
# the simulated model time as the engine's). Lengths are drawn from 53-bit uniforms; a token's
# log-probability or score is one byte, on a grid of 256 values from 0 to -3.
def _draws(key: str) -> Any:
    """The draws of `key`: `.digest(n)` gives their first n bytes."""
    return hashlib.shake_128(key.encode())


_TWO_TO_MINUS_53 = 2.0 ** -53


def _uniform(drawn: bytes, at: int = 0) -> float:
    """A uniform draw in [0, 1) from the 8 bytes at `at`: 53 bits, as random.random's."""
    return (int.from_bytes(drawn[at:at + 8], "little") >> 11) * _TWO_TO_MINUS_53


def _normal(drawn: bytes) -> float:
    """A standard normal draw from 16 bytes (Box-Muller)."""
    radius = math.sqrt(-2.0 * math.log(1.0 - _uniform(drawn, 0)))
    return radius * math.cos(2.0 * math.pi * _uniform(drawn, 8))


def _sampled_length(drawn: bytes, low: int, high: int, sigma: float = 0.0,
                    scale: float = 1.0) -> int:
    """A response's length from 16 drawn bytes."""
    if sigma > 0:  # log-normal with its median at an eighth of the budget (times scale), clipped
        median = max(1, high) / 8 * scale
        return max(low, min(high, int(median * math.exp(sigma * _normal(drawn)))))
    # exponential around a quarter of the budget (times scale), clipped: a long tail at the top
    mean = max(1, high) * scale / 4.0
    return max(low, min(high, int(-math.log(1.0 - _uniform(drawn)) * mean) + 1))


def _token_scores(ctx: OpContext, rollout: Any, *_: Any, seconds_per_token: float = 0.0,
                  **config: Any) -> Any:
    """Per-token log-probabilities or values of one response."""
    tokens = len(getattr(rollout, "response_tokens", ()))
    busy_for(seconds_per_token * (tokens + len(getattr(rollout, "prompt_tokens", ()))))
    prompt_id, sample = getattr(rollout, "prompt_id", 0), getattr(rollout, "sample", 0)
    drawn = _draws(f"scores/{prompt_id}/{sample}").digest(tokens)
    return TokenScores(prompt_id=prompt_id, sample=sample,
                       values=[byte * (-3 / 255) for byte in drawn])


def _token_scores_batched(ctx: OpContext, rollouts: list, *_: Any,
                          seconds_per_token: float = 0.0, **config: Any) -> list:
    """Many responses in one call [Note: batched forms in executors/optable.py]: each scored as
    alone, the simulated time that of them all (as one forward of the batch)."""
    tokens = sum(len(getattr(r, "response_tokens", ())) + len(getattr(r, "prompt_tokens", ()))
                 for r in rollouts)
    busy_for(seconds_per_token * tokens)
    return [_token_scores(ctx, rollout) for rollout in rollouts]


def _reward_model(ctx: OpContext, rollout: Any, *, seconds_per_token: float = 0.0,
                  **config: Any) -> float:
    tokens = len(getattr(rollout, "response_tokens", ()))
    busy_for(seconds_per_token * tokens)
    return _uniform(_draws(f"reward/{getattr(rollout, 'prompt_id', 0)}").digest(8))


def _simulated_seconds(ctx: OpContext) -> float:
    """The model time this executor has simulated so far (what the scale bench takes off a
    step's time to leave the engine's)."""
    return _SIMULATED[0]


def _seed(ctx: OpContext, meta: dict) -> str:
    # what the op computes, not where: the same plan gives the same numbers on any executor
    return f"{meta.get('model')}/{meta.get('stage')}/{meta.get('microbatch')}/{meta.get('step')}"


# -- run checkpoints [Note: run checkpoints in flowkit/runner/checkpoints/format.py] ---------
def _save_state(ctx: OpContext, *_: Any, path: str) -> dict:
    """The simulator holds no weights: its part of a checkpoint says so, and how many ops it ran
    (each op's outputs are seeded by its identity, not by what ran before). Returns its bytes
    and SHA-256 [Note: checkpoint checksums in flowkit/runner/checkpoints/writer.py]."""
    data = json.dumps({"format": "flowkit.sim_state/1", "executor": ctx.name}).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a checkpoint's files are its owner's alone, whatever the umask
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _load_state(ctx: OpContext, *_: Any, path: str | None = None, files: list | None = None,
                models: dict | None = None, trains: list | None = None,
                checksums: dict | None = None) -> int:
    """Nothing to build (`files`, `models` and `trains` are for executors that hold
    weights); the file, where this executor saved one, must be a simulator's state, a regular
    file of its SHA-256 in `checksums` [Note: contained files in flowkit/wire/files.py]."""
    if path is None:
        return 0
    try:
        data = read_regular(path, limit=1 << 16)
        if checksums is not None and checksums.get(path) != hashlib.sha256(data).hexdigest():
            raise FileRefused(f"{path} does not match its SHA-256 in manifest.json: it "
                              "changed after it was written")
        state = json.loads(data)
    except ValueError as exc:  # FileRefused too
        raise ValueError(f"cannot read simulator state: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != "flowkit.sim_state/1":
        raise ValueError(f"{path} is not a simulator executor's state")
    return 0


def register(table: OpTable) -> None:
    # torch is imported by the first op that makes an activation, not here: a simulator that
    # only generates or scores never needs it (1.5 s of CPU a process); benchmarks time the
    # steps after a warm-up one
    table.register("F", _forward)
    table.register("B", _backward_input)
    table.register("W", _backward_weight)
    table.register("BW", _backward_input)  # one op doing both: its cost says how long
    table.register("activation_memory", _activation_memory)
    table.register("grad_stats", _grad_stats)
    table.register("reduce_grads", _reduce_grads)
    table.register("optimizer_step", _optimizer_step)
    table.register("generate", _generate)
    table.register("generation", _generation)
    table.register("logprobs", _token_scores, batched=_token_scores_batched)
    table.register("values", _token_scores, batched=_token_scores_batched)
    table.register("reward_model", _reward_model)
    table.register("simulated_seconds", _simulated_seconds)
    table.register("save_state", _save_state)
    table.register("load_state", _load_state)
