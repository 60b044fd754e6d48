"""Checkpoints, resume and restarts of asynchronous runs [Note: checkpoints of asynchronous runs
in flowkit/runner/checkpoints/open_steps.py]: a checkpoint holds the open steps' rollouts with their
per-token versions and the calls carried past them; a resumed run loses no sample, trains none
twice, keeps the staleness bound, and on the simulator (where a request's tokens take the
version of the weights it was sent with, so generation under the same versions is
deterministic) gives the curve of the run never interrupted; on torch it trains the saved
samples of the open steps exactly. The resume bugs of other RL frameworks, each a test named
after it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from benchmarks.runs import bench_run
from flowkit.cli._flows import load_checked_flow
from flowkit.runner.checkpoints.format import complete_checkpoints, read_run_state
from flowkit.runner.checkpoints.state_codec import allowed_records
from flowkit.runner.config import CheckpointConfig
from tests.cli.runs import GRPO, conserved, interrupted
from tests.cli.runs import metrics_lines as _lines
from tests.cli.runs import refused as _refused
from tests.cli.runs import run_ok as _run

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

STEPS, STOP = 6, 2  # the runs' steps; the checkpoint resumed from: after STOP steps
CURVE = ("loss", "reward_mean", "response_length_mean", "update_actor/tokens",
         "staleness/versions", "rollout/samples")


def _curve(path: Path, keys: tuple = CURVE) -> list[list]:
    return [[line["step"], *(line.get(key) for key in keys)] for line in _lines(path)]


def _generated(trace: Path, first: int = 0) -> set[tuple]:
    """Every sample the run generated (or replayed) from step `first` on: (step, prompt,
    sample, first version, last version, length), from the generate spans' items."""
    events = json.loads(trace.read_text())["traceEvents"]
    return {(e["args"]["step"], *item) for e in events
            if e["ph"] == "X" and e["args"].get("node") == "generate"
            and e["args"]["step"] >= first for item in e["args"]["items"]}


def _spans(trace: Path, node: str) -> list[dict]:
    events = json.loads(trace.read_text())["traceEvents"]
    return [e for e in events if e["ph"] == "X" and e["args"].get("node") == node]


def _open_work(folder: Path):
    return read_run_state(folder, allowed_records()).open_work


def _three_runs(folder: Path, flow: str, *options: str) -> dict[str, Path]:
    """`straight`: STEPS steps; `writer`: the same with a checkpoint after every step;
    `resumed`: from the writer's checkpoint after STOP steps (steps STOP .. STOP+η-1 open
    there) up to STEPS. Metrics and a trace of each."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, extra in (("straight", ()),
                        ("writer", ("--checkpoint-dir", str(folder / "ck"),
                                    "--checkpoint-every", "1", "--keep-checkpoints", "20")),
                        ("resumed", ("--resume", str(folder / "ck" / f"step-{STOP:08d}")))):
        paths[name] = folder / f"{name}.jsonl"
        output = _run(flow, *options, "--steps", str(STEPS), "--metrics", str(paths[name]),
                      "--trace", str(folder / f"{name}.json"), *extra)
        if name == "resumed":
            # the console wraps long lines (the checkpoint's path comes first)
            assert f"(step {STOP} of {STEPS})" in " ".join(output.split())
    return paths


@pytest.fixture(scope="module", params=[1, 2], ids=["bound1", "bound2"])
def sim_runs(request, tmp_path_factory) -> tuple[int, dict[str, Path]]:
    # --no-fuse: which samples share a microbatch follows their order, not their finishing
    bound = request.param
    folder = tmp_path_factory.mktemp(f"sim{bound}")
    return bound, _three_runs(folder, GRPO, "--executors", "sim", "--no-fuse",
                              "--max-staleness", str(bound))


def test_an_async_checkpoint_holds_the_open_steps_rollouts_with_their_versions(sim_runs):
    bound, paths = sim_runs
    work = _open_work(paths["writer"].parent / "ck" / f"step-{STOP:08d}")
    assert sorted(work.calls) == list(range(STOP, STOP + bound))  # the open steps
    for step, by_node in work.calls.items():
        calls = by_node["generate"]
        assert len(calls) == 4  # a call per prompt, its n = 4 samples
        for call in calls:
            assert sorted(r.sample for r in call.items) == [0, 1, 2, 3]
            for rollout in call.items:  # each token's weights version, within the bound
                assert len(rollout.versions) == len(rollout.response_tokens)
                assert all(step - bound <= max(v, 0) <= STOP for v in rollout.versions)
    assert work.rollouts() == 16 * bound


def test_async_resume_on_the_simulator_gives_the_uninterrupted_curve(sim_runs):
    """Checkpointing (with its drains) changes nothing, and the resumed run trains at every
    step the samples the uninterrupted run trained, with the same per-token versions."""
    _, paths = sim_runs
    assert _curve(paths["writer"]) == _curve(paths["straight"])
    assert _curve(paths["resumed"]) == _curve(paths["straight"])
    straight, resumed = (paths[name].with_suffix(".json") for name in ("straight", "resumed"))
    assert _generated(resumed, STOP) == _generated(straight, STOP)


def test_async_resume_does_not_increment_the_step_twice_verl(sim_runs):
    _, paths = sim_runs
    assert [line["step"] for line in _lines(paths["resumed"])] == list(range(STEPS))
    resumed = paths["resumed"].with_suffix(".json")
    steps = {span["args"]["step"] for span in _spans(resumed, "optimizer_step")}
    assert steps == set(range(STOP, STEPS))  # trained once each, from the checkpoint's on


def test_async_no_steps_skipped_at_a_checkpoint_boundary_verl(sim_runs):
    """Every step after the boundary runs and trains a whole batch: the open steps' saved
    samples first, then fresh ones."""
    _, paths = sim_runs
    lines = _lines(paths["resumed"])[STOP:]
    assert [line["step"] for line in lines] == list(range(STOP, STEPS))
    assert all(line["rollout/samples"] == 16 for line in lines)


def test_async_resume_restores_the_prompt_source_position_openrlhf(sim_runs):
    """The dataloader state: each step after the resume draws the prompts the uninterrupted
    run's step drew (the ready-made sources derive them from the step)."""
    _, paths = sim_runs
    straight, resumed = (paths[name].with_suffix(".json") for name in ("straight", "resumed"))

    def prompts(trace: Path) -> set:
        return {(step, prompt) for step, prompt, *_ in _generated(trace, STOP)}

    assert prompts(resumed) == prompts(straight)
    assert {step for step, _ in prompts(resumed)} == set(range(STOP, STEPS))


def test_async_staleness_capacity_not_inflated_after_resume_areal(sim_runs):
    """After the resume the admission gate is the uninterrupted run's: no step's generation
    starts before the weights it may lag by η exist (step s waits for the optimizer step of
    step s-η-1), none uses older weights, and the steps opened ahead are the same."""
    bound, paths = sim_runs
    resumed = paths["resumed"].with_suffix(".json")
    ends = {span["args"]["step"]: span["ts"] + span["dur"]
            for span in _spans(resumed, "optimizer_step")}
    fresh = [span for span in _spans(resumed, "generate") if span["args"]["step"] >= STOP + bound]
    assert fresh  # generated after the resume, not replayed
    for span in fresh:
        step = span["args"]["step"]
        if step - bound - 1 in ends:
            assert span["ts"] >= ends[step - bound - 1]
        for _, _, first, _, _ in span["args"]["items"]:
            assert max(first, 0) >= step - bound
    assert all(line["staleness/max"] <= bound for line in _lines(paths["resumed"]))
    opened = {span["args"]["step"] for span in _spans(resumed, "generate")}
    assert opened == set(range(STOP, STEPS))  # nothing generated past the run's end


# -- partial rollouts: calls carried past the open steps -----------------------------------
def _oversampled(folder: Path) -> str:
    flow = folder / "partial.py"
    flow.write_text(Path(GRPO).read_text().replace(
        "source_config={\"digits\": 3})",
        "source_config={\"digits\": 3}, oversample=2.0)"))
    return str(flow)


@pytest.fixture(scope="module", params=["sim", "torch"])
def partial_runs(request, tmp_path_factory) -> tuple[str, dict[str, Path]]:
    folder = tmp_path_factory.mktemp(f"partial-{request.param}")
    paths = _three_runs(folder / "runs", _oversampled(folder), "--executors", request.param,
                        "--no-fuse", "--max-staleness", "1", "--sim-cost", "token=0.002")
    return request.param, paths


def test_async_resume_loses_no_in_flight_rollout_openrlhf(partial_runs):
    """With partial rollouts, the checkpoint holds the calls aborted and carried past the open
    step (interrupted samples with their per-token versions); the resumed run trains each
    sample once: every sample started before and after the resume is trained, dropped or
    carried at the end, and the open step trains exactly what the writer's did."""
    _, paths = partial_runs
    work = _open_work(paths["writer"].parent / "ck" / f"step-{STOP:08d}")
    assert len(work.carried) == 4 and all(c.step == STOP + 1 for c in work.carried)
    for rollout in (r for c in work.carried for r in c.items):  # cut or done, with versions
        assert len(rollout.versions) == len(rollout.response_tokens)
    lines = _lines(paths["resumed"])
    conserved(lines)
    assert [line["step"] for line in lines] == list(range(STEPS))
    assert all(line["staleness/max"] <= 1 for line in lines)
    writer = _curve(paths["writer"], CURVE + ("rollout/carried_over", "rollout/resumed"))
    resumed = _curve(paths["resumed"], CURVE + ("rollout/carried_over", "rollout/resumed"))
    assert resumed[:STOP + 1] == writer[:STOP + 1]  # the open step replayed as it ran


def test_async_cursor_does_not_run_ahead_of_in_flight_work_nemo_rl(partial_runs):
    """The prompts in flight at the checkpoint (carried, interrupted) are not skipped: each
    is generated on after the resume, in the step after the open one, from its prefix."""
    _, paths = partial_runs
    work = _open_work(paths["writer"].parent / "ck" / f"step-{STOP:08d}")
    carried = {(c.origin, r.prompt_id, r.sample, len(r.response_tokens))
               for c in work.carried for r in c.items}
    resumed = paths["resumed"].with_suffix(".json")
    continued = set()
    for span in _spans(resumed, "generate"):
        if span["args"]["step"] == STOP + 1 and span["args"].get("origin") is not None:
            continued |= {(span["args"]["origin"], prompt, sample)
                          for prompt, sample, *_ in span["args"]["items"]}
    assert {c[:3] for c in carried} <= continued


# -- torch: the open steps' samples trained exactly ----------------------------------------
def test_async_resume_on_torch_trains_the_open_steps_saved_samples(tmp_path):
    """On torch a token's version depends on when a weights load reaches the engine, so two
    uninterrupted runs may differ from step η on; the resumed run trains the open steps'
    saved samples, to the writer's loss in float64, and keeps the bound after."""
    paths = _three_runs(tmp_path, GRPO, "--executors", "torch", "--no-fuse",
                        "--max-staleness", "1")
    writer, resumed = _curve(paths["writer"]), _curve(paths["resumed"])
    assert resumed[:STOP + 1] == writer[:STOP + 1]
    assert all(line["staleness/max"] <= 1 for line in _lines(paths["resumed"]))


def test_async_resume_with_no_staleness_gives_the_uninterrupted_parameters(tmp_path):
    """η = 0 is the synchronous run operation for operation: resumed, the same parameters."""
    import torch

    folder = tmp_path / "ck"
    options = ("--executors", "torch", "--no-fuse", "--max-staleness", "0")
    _run(GRPO, *options, "--steps", "4", "--save-weights", str(tmp_path / "w1"))
    _run(GRPO, *options, "--steps", "2", "--checkpoint-dir", str(folder),
         "--checkpoint-every", "1")
    _run(GRPO, *options, "--steps", "4", "--resume", str(folder),
         "--save-weights", str(tmp_path / "w2"))
    first = torch.load(tmp_path / "w1" / "actor.pt", weights_only=True)
    second = torch.load(tmp_path / "w2" / "actor.pt", weights_only=True)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k])
                                                  for k in first)


# -- bad input ------------------------------------------------------------------------------
def test_resume_with_another_staleness_bound_names_both(sim_runs):
    bound, paths = sim_runs
    folder = str(paths["writer"].parent / "ck")
    output = _refused(GRPO, "--executors", "sim", "--max-staleness", str(bound + 1),
                      "--resume", folder)
    assert f"--max-staleness {bound}" in output and f"--max-staleness {bound + 1}" in output
    output = _refused(GRPO, "--executors", "sim", "--resume", folder)
    assert "synchronous" in output
    assert complete_checkpoints(paths["writer"].parent / "ck")


# -- restarts [Note: executor restarts in flowkit/runner/checkpoints/restarts.py] ------------
def test_async_run_with_killed_executors_ends_with_the_uninterrupted_curve_on_the_simulator(
        tmp_path):
    """Sim executors killed twice at random moments (in generation running ahead, a drain, a
    checkpoint being written): each lost one is replaced, the newest checkpoint replays its
    open steps' saved samples, and the run gives the curve of the run without faults."""
    from tests.cli.test_restarts import _clean_run, _run_with_kills

    options = ("--executors", "sim", "--no-fuse", "--max-staleness", "1",
               "--sim-cost", "token=0.004")
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    _clean_run(GRPO, clean, "--steps", "16", *options, weights=False)
    output = _run_with_kills(GRPO, faulty, 16, *options, "--max-restarts", "3", kills=2,
                             seed=5, weights=False)
    assert output.count("lost (") == 2
    assert _curve(faulty / "m.jsonl") == _curve(clean / "m.jsonl")
    assert _lines(faulty / "m.jsonl")[-1]["restarts"] == 2


def test_async_run_on_torch_survives_killed_executors_within_the_bound(tmp_path):
    """On torch, where the versions depend on timing, what holds after restarts: every step
    once, each training a whole batch, no token older than the bound allows."""
    from tests.cli.test_restarts import _run_with_kills

    faulty = tmp_path / "faulty"
    _run_with_kills(GRPO, faulty, 10, "--max-staleness", "1", "--max-restarts", "3",
                    kills=2, seed=1)
    lines = _lines(faulty / "m.jsonl")
    assert [line["step"] for line in lines] == list(range(10))
    assert all(line["rollout/samples"] == 16 and line["staleness/max"] <= 1 for line in lines)
    assert lines[-1]["restarts"] == 2


# -- Ctrl-C ---------------------------------------------------------------------------------
def test_ctrl_c_of_an_async_run_checkpoints_the_open_step_and_the_resume_goes_on(tmp_path):
    """The first Ctrl-C finishes the running step; its checkpoint holds the next step's
    generation (drained), and the resumed run trains those samples to the loss the
    interrupted run would have had at that step: float64, the same weights and samples."""
    metrics, checkpoints = tmp_path / "m.jsonl", tmp_path / "ck"
    output, done = interrupted(GRPO, "--executors", "torch", "--no-fuse", "--max-staleness",
                               "1", "--checkpoint-dir", str(checkpoints), metrics=metrics)
    assert f"interrupted at step {done}" in output
    (folder,) = complete_checkpoints(checkpoints)
    assert folder.name == f"step-{done:08d}"
    work = _open_work(folder)
    assert sorted(work.calls) == [done] and work.rollouts() == 16
    _run(GRPO, "--executors", "torch", "--no-fuse", "--max-staleness", "1", "--steps",
         str(done + 2), "--metrics", str(metrics), "--resume", str(checkpoints))
    lines = _lines(metrics)
    assert [line["step"] for line in lines] == list(range(done + 2))
    saved = sorted((r.prompt_id, r.sample, tuple(r.versions)) for c in work.calls[done][
        "generate"] for r in c.items)
    assert lines[done]["staleness/versions"] == _histogram(saved)


def _histogram(samples: list[tuple]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for *_, versions in samples:
        for version in versions:
            key = str(max(version, 0))
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def test_partial_rollouts_survive_killed_executors_with_every_sample_trained_once(tmp_path):
    """Restarts with calls carried between steps: the replay resubmits requests a surviving
    engine saw aborted before the loss; their names carry the runner's attempt, so none is cut
    at once, and every sample started is trained once, dropped or carried at the end."""
    from tests.cli.test_restarts import _run_with_kills

    faulty = tmp_path / "faulty"
    faulty.mkdir()
    _run_with_kills(_oversampled(tmp_path), faulty, 14, "--executors", "sim",
                    "--max-staleness", "1", "--sim-cost", "token=0.004", "--max-restarts", "3",
                    kills=2, seed=3, weights=False)
    lines = _lines(faulty / "m.jsonl")
    assert [line["step"] for line in lines] == list(range(14))
    conserved(lines)
    assert all(line["generate/taken_groups"] == 4 for line in lines)
    # a replayed request cut as it arrived would train samples without a token
    assert all(line["response_length_mean"] >= 1 for line in lines)
    assert all(line["staleness/max"] <= 1 for line in lines)


def test_an_async_checkpoint_does_not_stop_generation(tmp_path):
    """[Note: checkpoints that do not drain in flowkit/runner/checkpoints/writer.py]: with a
    checkpoint after every step, a step trains while the steps open at its boundary still generate
    (a drained checkpoint let their generation end first), and every checkpoint is written."""
    trace, checkpoints = tmp_path / "t.json", tmp_path / "ck"
    _run(GRPO, "--executors", "sim", "--max-staleness", "2", "--steps", str(STEPS),
         "--sim-cost", "token=0.04", "--checkpoint-dir", str(checkpoints),
         "--checkpoint-every", "1", "--keep-checkpoints", "20", "--trace", str(trace))
    trained, generated = {}, {}
    for span in _spans(trace, "update_actor"):
        step = span["args"]["step"]
        trained[step] = min(trained.get(step, span["ts"]), span["ts"])
    for span in _spans(trace, "generate"):
        step = span["args"]["step"]
        generated[step] = max(generated.get(step, 0), span["ts"] + span["dur"])
    assert any(trained[step] < generated[step + 1] for step in range(1, STEPS - 1))
    folders = complete_checkpoints(checkpoints)
    assert [int(folder.name.split("-")[1]) for folder in folders] == list(range(1, STEPS + 1))
    assert not list(checkpoints.glob(".step-*"))  # no unfinished folder left


def test_a_ctrl_c_right_after_a_begun_checkpoint_writes_that_step_once(tmp_path):
    """The checkpoint of the step a Ctrl-C stops after was begun at its boundary already: the
    stop finishes it rather than writing it a second time (each executor saves once)."""
    trace, root = tmp_path / "t.json", tmp_path / "ck"
    with bench_run(load_checked_flow(GRPO), executors="sim", steps=6, asynchronous=True,
                   max_staleness=2, trace=trace, code=[GRPO],
                   checkpoints=CheckpointConfig(root=root, every=1, keep=10)) as run:
        for report in run.steps():
            if report.step == 1:  # the first Ctrl-C: finish this step, checkpoint, stop
                os.kill(os.getpid(), signal.SIGINT)
        executors = len(run.executors)
    assert run.result.interrupted and run.result.steps == 2
    assert len([s for s in _spans(trace, "checkpoint") if s["args"]["step"] == 2]) == executors
    assert [int(f.name.split("-")[1]) for f in complete_checkpoints(root)] == [1, 2]
