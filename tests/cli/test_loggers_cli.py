"""`flowkit run --logger tensorboard --logger wandb`: real runs whose TensorBoard events and
offline W&B run hold the JSON lines' values, a resumed run that continues both without
duplicated steps, and the errors for an unknown logger or a missing extra."""

import sys

import pytest
from click.testing import CliRunner

from flowkit.cli import main
from tests.cli.runs import PRETRAIN, metrics_lines, run_ok
from tests.observe.readers import tensorboard_scalars, wandb_history, wandb_offline_runs


@pytest.fixture(autouse=True)
def _wandb_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))  # never the user's folders
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # CliRunner owns stdout


def _losses(lines: list[dict]) -> list[tuple[int, float]]:
    return [(line["step"], line["loss"]) for line in lines]


@pytest.mark.slow
def test_tensorboard_and_wandb_hold_the_json_lines_losses_of_a_torch_run(tmp_path):
    runs, metrics = tmp_path / "runs", tmp_path / "m.jsonl"
    run_ok(PRETRAIN, "--executors", "torch", "--steps", "3", "--metrics", str(metrics),
           "--logger", "tensorboard", "--logger", "wandb", "--log-dir", str(runs))
    lines = metrics_lines(metrics)
    assert [step for step, _ in _losses(lines)] == [0, 1, 2]
    [folder] = runs.iterdir()  # named after the flow
    shown = tensorboard_scalars(folder)
    # TensorBoard keeps float32 scalars
    assert shown["loss"] == [(step, pytest.approx(loss, rel=1e-6)) for step, loss in
                             _losses(lines)]
    assert [step for step, _ in shown["step_s"]] == [0, 1, 2]
    [run_file] = wandb_offline_runs(folder)
    rows = wandb_history(run_file)
    assert [(row["_step"], row["loss"]) for row in rows] == _losses(lines)
    assert [row["backprop/tokens"] for row in rows] == [line["backprop/tokens"]
                                                        for line in lines]


@pytest.mark.slow
def test_a_resumed_run_continues_its_curves_without_duplicated_steps(tmp_path):
    """The first run logs step 3 past its checkpoint at 3 steps; the resumed run logs steps
    3 and 4 again: TensorBoard shows each step once, and the W&B run goes on under its id."""
    runs, metrics, checkpoints = tmp_path / "runs", tmp_path / "m.jsonl", tmp_path / "ck"
    options = ("--executors", "sim", "--metrics", str(metrics), "--logger", "tensorboard",
               "--logger", "wandb", "--log-dir", str(runs))
    run_ok(PRETRAIN, *options, "--steps", "4", "--checkpoint-dir", str(checkpoints),
           "--checkpoint-every", "3")
    run_ok(PRETRAIN, *options, "--steps", "5", "--resume", str(checkpoints))
    lines = metrics_lines(metrics)
    assert [step for step, _ in _losses(lines)] == [0, 1, 2, 3, 4]
    [folder] = runs.iterdir()  # the resumed run found its own folder
    shown = tensorboard_scalars(folder)
    assert shown["loss"] == [(step, pytest.approx(loss, rel=1e-6)) for step, loss in
                             _losses(lines)]
    first, resumed = wandb_offline_runs(folder)
    assert first.name == resumed.name  # run-<id>.wandb: the same W&B run
    assert [row["_step"] for row in wandb_history(first)] == [0, 1, 2, 3]
    assert [(row["_step"], row["loss"]) for row in wandb_history(resumed)] == _losses(lines)[3:]


@pytest.mark.slow
def test_jsonl_logger_alone_writes_the_metrics_in_the_runs_folder(tmp_path):
    run_ok(PRETRAIN, "--executors", "sim", "--steps", "2", "--logger", "jsonl",
           "--log-dir", str(tmp_path))
    lines = metrics_lines(tmp_path / "pretrain" / "metrics.jsonl")
    assert [line["step"] for line in lines] == [0, 1]


@pytest.mark.slow
def test_run_name_names_the_runs_folder_and_a_second_run_gets_its_own(tmp_path):
    for _ in range(2):
        run_ok(PRETRAIN, "--executors", "sim", "--steps", "1", "--logger", "jsonl",
               "--log-dir", str(tmp_path), "--run-name", "lr-3e-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr-3e-4", "lr-3e-4-2"]
    assert metrics_lines(tmp_path / "lr-3e-4-2" / "metrics.jsonl")[0]["step"] == 0


@pytest.mark.parametrize("name", ["a/b", "..", ""])
def test_a_run_name_that_is_no_folder_name_is_a_usage_error(tmp_path, name):
    result = CliRunner().invoke(main, ["run", PRETRAIN, "--executors", "sim", "--logger",
                                       "jsonl", "--log-dir", str(tmp_path), "--run-name", name])
    assert result.exit_code == 2, result.output
    assert "--run-name" in result.output and "a folder name" in result.output
    assert not any(tmp_path.iterdir())


def test_an_unknown_logger_is_a_usage_error():
    result = CliRunner().invoke(main, ["run", PRETRAIN, "--logger", "mlflow"])
    assert result.exit_code == 2
    assert "'mlflow' is not one of 'jsonl', 'tensorboard', 'wandb'" in result.output


@pytest.mark.slow
def test_the_logger_env_var_chooses_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWKIT_LOGGER", "jsonl tensorboard")
    run_ok(PRETRAIN, "--executors", "sim", "--steps", "1", "--log-dir", str(tmp_path))
    folder = tmp_path / "pretrain"
    assert (folder / "metrics.jsonl").is_file() and "loss" in tensorboard_scalars(folder)


def test_a_missing_extra_is_one_error_naming_it_before_any_executor_starts(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` does when absent

    def no_executors(*args, **kwargs):
        raise AssertionError("executors started before the loggers were checked")

    monkeypatch.setattr("flowkit.runtime.launch.ProcessExecutors.start", no_executors)
    result = CliRunner().invoke(main, ["run", PRETRAIN, "--executors", "sim", "--no-dashboard",
                                       "--logger", "wandb", "--log-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "AssertionError" not in result.output
    assert "--logger wandb needs the wandb package" in result.output
    assert "pip install 'flowkit[wandb]'" in result.output
    assert not any(tmp_path.iterdir())  # no run folder either


def test_a_log_dir_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    result = CliRunner().invoke(main, ["run", PRETRAIN, "--executors", "sim", "--no-dashboard",
                                       "--logger", "tensorboard",
                                       "--log-dir", str(tmp_path / "file" / "runs")])
    assert result.exit_code == 1, result.output
    assert f"cannot write {tmp_path / 'file' / 'runs'}" in result.output
    assert "Traceback" not in result.output
