"""The public run API: `flowkit.run(flow, RunConfig(...))` and `Run` step by step, on real
executor processes; each wrong setting a RunConfigError naming it, before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flowkit
from flowkit import CheckpointConfig, ControllerConfig, Run, RunConfig, RunConfigError, RunError
from flowkit.dsl import load_flow
from flowkit.runtime.launch import LocalExecutors
from tests.harness import shared_run

PRETRAIN = str(Path(__file__).parents[1] / "cli" / "flows" / "tiny_pretrain.py")


def _pretrain():
    return load_flow(PRETRAIN)


@pytest.mark.slow
def test_run_trains_and_returns_every_steps_metrics_line(tmp_path):
    metrics = tmp_path / "m.jsonl"
    config = RunConfig(steps=3, executors="torch", dashboard=False,
                       logs=flowkit.LogSetup(metrics=metrics),
                       save_weights=tmp_path / "w")
    result = flowkit.run(_pretrain(), config)
    assert (result.steps, result.interrupted) == (3, False)
    assert [r["step"] for r in result.records] == [0, 1, 2]
    written = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [w["loss"] for w in written] == [r["loss"] for r in result.records]
    assert result.weights and all(Path(p).exists() for p in result.weights)
    assert torch.load(result.weights[0], weights_only=True)


@pytest.mark.slow
def test_run_step_by_step_gives_each_report_and_its_runner(tmp_path):
    with Run(_pretrain(), RunConfig(steps=2, executors="sim", dashboard=False)) as run:
        assert run.controller is not None and len(run.controller.executors()) == 2
        steps = [report.step for report in run.steps()]
    assert steps == [0, 1]
    assert run.result.steps == 2 and len(run.result.records) == 2


@pytest.mark.slow
def test_the_same_config_resumes_from_its_checkpoints(tmp_path):
    checkpoints = CheckpointConfig(root=tmp_path / "ck", every=1)
    first = flowkit.run(_pretrain(), RunConfig(steps=2, executors="torch", dashboard=False,
                                               checkpoints=checkpoints))
    assert first.checkpoint == 2
    resumed = flowkit.run(_pretrain(), RunConfig(steps=3, executors="torch", dashboard=False,
                                                 checkpoints=checkpoints,
                                                 resume=tmp_path / "ck"))
    assert resumed.steps == 3 and [r["step"] for r in resumed.records] == [0, 1, 2]


@pytest.mark.parametrize(("settings", "setting", "words"), [
    ({"schedule": "zb-h9"}, "schedule", "unknown schedule kind 'zb-h9'"),
    ({"num_executors": 2, "tags": [("train",)]}, "tags", "1 tag groups for 2 executors"),
    ({"asynchronous": False, "max_staleness": 1}, "max_staleness", "drop --sync"),
    ({"controller": ControllerConfig(bind="10.0.0.1:5555")}, "controller.bind",
     "not a zmq address"),
    ({"controller": ControllerConfig(bind="tcp://0.0.0.0:0")}, "controller.bind", "keys"),
    ({"resume": "/nonexistent/checkpoints"}, "resume", "/nonexistent/checkpoints"),
    ({"eval_every": 2}, "eval_every", "declares no evaluation"),
])
def test_a_wrong_setting_names_itself_before_any_executor_starts(monkeypatch, settings, setting,
                                                                 words):
    started = []
    monkeypatch.setattr(LocalExecutors, "start", lambda self: started.append(self))
    with pytest.raises(RunConfigError) as error:
        with Run(_pretrain(), RunConfig(executors="sim", dashboard=False, **settings)):
            pass
    assert error.value.setting == setting and words in str(error.value)
    assert started == []


@pytest.mark.parametrize(("settings", "setting"), [
    ({"steps": 0}, "steps"), ({"max_restarts": -1}, "max_restarts"),
    ({"num_executors": 0}, "num_executors"), ({"step_timeout": 0}, "step_timeout"),
    ({"eval_every": 0}, "eval_every"), ({"elastic_wait": -1}, "elastic_wait"),
])
def test_a_setting_out_of_range_is_refused_by_the_record(settings, setting):
    with pytest.raises(RunConfigError) as error:
        RunConfig(**settings)
    assert error.value.setting == setting


@pytest.mark.slow
def test_a_failing_step_is_a_run_error_of_one_line(tmp_path):
    flow = tmp_path / "failing.py"
    flow.write_text(
        "from flowkit.dsl import Flow, Stream, op\n\n"
        "@op\ndef numbers() -> Stream[int]:\n    yield 1\n\n"
        "@op\ndef breaks(x: int) -> int:\n    raise ValueError('no good')\n\n"
        "with Flow('failing') as flow:\n    breaks(numbers())\n")
    config = RunConfig(steps=1, code=[str(flow)], dashboard=False, step_timeout=60)
    with pytest.raises(RunError) as error:
        flowkit.run(load_flow(str(flow)), config)
    assert "no good" in str(error.value) and "--debug shows the traceback" in str(error.value)
    assert "\n" not in str(error.value).strip()


def test_a_failed_run_on_a_shared_controller_leaves_no_task_pending(pool):
    """`sleepy`'s calls were still running when `breaks` failed the step: the run cancels
    them, so nothing of it holds the executors (or a lane) for the next run."""
    from flowkit.dsl import Flow, collect
    from tests.runner.quota_ops import breaks, kept, numbered_prompts, sleepy

    with Flow("breaks") as flow:
        prompts = numbered_prompts(prompts=2)
        kept(collect(sleepy(prompts)))
        kept(collect(breaks(prompts)), name="kept_broken")
    config = RunConfig(steps=1, executors="base", dashboard=False)
    with pytest.raises(RunError, match="breaks"):
        with shared_run(pool, flow, config) as run:
            list(run.steps())
    assert not any(e.outstanding for e in run.controller.executors())


@pytest.mark.slow
def test_runs_side_by_side_on_a_controllers_executors_leave_them_running():
    from flowkit.runtime import Controller

    with Controller() as ctl, LocalExecutors(ctl, 2, kind="sim", tags=[("train",)] * 2):
        ids = sorted(e.id for e in ctl.executors())
        for fuse in (True, False):
            config = RunConfig(steps=2, executors="sim", fuse=fuse, dashboard=False)
            with Run(_pretrain(), config, controller=ctl) as run:
                assert [report.step for report in run.steps()] == [0, 1]
            assert run.result.steps == 2
            assert sorted(e.id for e in ctl.executors()) == ids  # the same processes, still in


def test_restarts_need_the_launcher_of_their_own_executors():
    from flowkit.runtime import Controller

    with Controller() as ctl, pytest.raises(RunConfigError) as error:
        Run(_pretrain(), RunConfig(executors="sim", max_restarts=1), controller=ctl)
    assert error.value.setting == "max_restarts"


def test_an_elastic_run_needs_checkpoints_and_its_own_executors(tmp_path):
    """[Note: elastic runs in flowkit/runner/elastic.py]: refused when the Run is made."""
    from flowkit.runner import CheckpointConfig
    from flowkit.runtime import Controller

    every = CheckpointConfig(root=tmp_path / "ck", every=1)
    for config in (RunConfig(executors="sim", elastic=True),
                   RunConfig(executors="sim", elastic=True,
                             checkpoints=CheckpointConfig(root=tmp_path / "ck"))):
        with pytest.raises(RunConfigError, match="--checkpoint-every") as error:
            Run(_pretrain(), config)
        assert error.value.setting == "elastic"
    with Controller() as ctl, pytest.raises(RunConfigError) as error:
        Run(_pretrain(), RunConfig(executors="sim", elastic=True, checkpoints=every),
            controller=ctl)
    assert error.value.setting == "elastic" and "controller" in str(error.value)


@pytest.mark.parametrize(("settings", "setting"), [
    ({"tags": ["train", "rollout"]}, "tags"), ({"code": "flow.py"}, "code"),
    ({"launcher": "slurm"}, "launcher"),
    ({"checkpoints": {"root": "ck", "every": 0}}, "checkpoints.every"),
])
def test_a_setting_of_the_wrong_shape_is_refused_naming_it(settings, setting):
    with pytest.raises(RunConfigError) as error:
        if "checkpoints" in settings:
            settings = {"checkpoints": CheckpointConfig(**settings["checkpoints"])}
        RunConfig(**settings)
    assert error.value.setting == setting


def test_an_unknown_executor_kind_is_refused_before_anything_starts():
    with pytest.raises(RunConfigError) as error:
        Run(_pretrain(), RunConfig(executors="tpu"))
    assert error.value.setting == "executors" and "sim" in str(error.value)


@pytest.mark.slow
def test_steps_called_again_after_a_break_goes_on_where_it_stopped():
    with Run(_pretrain(), RunConfig(steps=3, executors="sim", dashboard=False)) as run:
        for _ in run.steps():
            break
        assert [r.step for r in run.steps()] == [1, 2]
    assert [r["step"] for r in run.result.records] == [0, 1, 2]


@pytest.mark.slow
def test_ctrl_c_while_the_caller_works_on_a_report_checkpoints_that_step(tmp_path):
    import os
    import signal

    config = RunConfig(steps=3, executors="sim", dashboard=False,
                       checkpoints=CheckpointConfig(root=tmp_path / "ck"))
    with Run(_pretrain(), config) as run:
        for _ in run.steps():
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: finish, checkpoint, stop
    assert run.result.interrupted and run.result.steps == 1
    assert run.result.checkpoint == 1 and any((tmp_path / "ck").iterdir())
