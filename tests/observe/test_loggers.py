"""The loggers one by one: what goes to TensorBoard and W&B (read back with their own readers),
what a resume rewinds, where a run's folder is, and the errors for a missing extra or an
unknown logger name."""

import json
import sys

import pytest

from flowkit.observe.loggers import (
    JsonLinesLogger,
    LoggerError,
    Loggers,
    TensorBoardLogger,
    WandbLogger,
    histograms,
    scalars,
)
from flowkit.observe.logsetup import RUN_FILE, LogSetup, run_folder
from tests.observe.readers import (
    tensorboard_histograms,
    tensorboard_scalars,
    wandb_history,
    wandb_offline_runs,
)

# A step record as `flowkit run` makes one: numbers, a nested histogram, a string, a list, None.
RECORD = {"time": 1.7e9, "step": 0, "loss": 2.5, "update_actor/tokens": 178,
          "staleness/versions": {"0": 30, "1": 4}, "bubble_rate": None, "restarts": 0,
          "note": "text", "lengths": [1, 2], "ok": True, "bad": float("nan")}


def _record(step: int, loss: float) -> dict:
    return {**RECORD, "step": step, "loss": loss}


def test_scalars_are_the_finite_numbers_with_nested_keys_joined_by_slashes():
    record = {**RECORD, "perf": {"x": 1, "deep": {"y": 2.0, "no": "text"}}}
    assert scalars(record) == {"loss": 2.5, "update_actor/tokens": 178.0, "restarts": 0.0,
                               "perf/x": 1.0, "perf/deep/y": 2.0}


def test_histograms_are_the_dicts_of_numbers_to_counts():
    record = {**RECORD, "perf": {"lags": {"2": 1, "-1": 3}}, "mixed": {"1": 2, "a": 1}}
    assert histograms(record) == {"staleness/versions": {0.0: 30.0, 1.0: 4.0},
                                  "perf/lags": {-1.0: 3.0, 2.0: 1.0}}
    assert scalars(record)["mixed/1"] == 2.0  # a dict with other keys is not a histogram


def test_tensorboard_holds_each_steps_scalars(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    for step, loss in enumerate([3.0, 2.0, 1.5]):
        logger.log(step, _record(step, loss))
    logger.close()
    shown = tensorboard_scalars(tmp_path)
    assert shown["loss"] == [(0, 3.0), (1, 2.0), (2, 1.5)]
    assert "note" not in shown and "step" not in shown and "time" not in shown
    [(step, histogram)] = tensorboard_histograms(tmp_path)["staleness/versions"][:1]
    assert step == 0 and histogram.num == 34 and histogram.min == 0 and histogram.max == 1
    assert (list(histogram.bucket_limit), list(histogram.bucket)) == ([0.0, 1.0], [30.0, 4.0])


def test_tensorboard_rewound_to_a_checkpoint_shows_the_resumed_steps_once(tmp_path):
    interrupted = TensorBoardLogger(tmp_path)
    for step in range(4):  # logged steps 2 and 3 past its checkpoint at 2, then died
        interrupted.log(step, _record(step, 10.0 + step))
    interrupted.close()
    resumed = TensorBoardLogger(tmp_path)
    resumed.rewind(2, [_record(0, 10.0), _record(1, 11.0)])
    for step in (2, 3, 4):
        resumed.log(step, _record(step, 20.0 + step))
    resumed.close()
    assert tensorboard_scalars(tmp_path)["loss"] == [(0, 10.0), (1, 11.0), (2, 22.0),
                                                     (3, 23.0), (4, 24.0)]


def test_a_new_run_in_a_used_folder_hides_the_old_curve(tmp_path):
    for losses in ([5.0, 4.0, 3.0], [9.0, 8.0]):
        logger = TensorBoardLogger(tmp_path)
        for step, loss in enumerate(losses):
            logger.log(step, _record(step, loss))
        logger.close()
    assert tensorboard_scalars(tmp_path)["loss"] == [(0, 9.0), (1, 8.0)]


def test_jsonl_rewound_rewrites_the_checkpoints_lines_then_appends(tmp_path):
    path = tmp_path / "m.jsonl"
    with Loggers([JsonLinesLogger(path)]) as loggers:
        loggers.log(0, _record(0, 3.0))
        loggers.rewind(1, [{"time": 1.0, "step": 0, "loss": 9.0}])
        loggers.log(1, _record(1, 2.0))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["step"], line["loss"]) for line in lines] == [(0, 9.0), (1, 2.0)]
    assert lines[0]["time"] == 1.0 and lines[1]["staleness/versions"] == {"0": 30, "1": 4}


def test_wandb_offline_run_holds_each_steps_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(tmp_path, project="flowkit-tests", name="unit")
    for step, loss in enumerate([3.0, 2.0]):
        logger.log(step, _record(step, loss))
    logger.close()
    [run_file] = wandb_offline_runs(tmp_path)
    rows = wandb_history(run_file)
    assert [(row["_step"], row["loss"]) for row in rows] == [(0, 3.0), (1, 2.0)]
    assert "note" not in rows[0]
    # W&B's row holds a histogram's fields under its key, "." between
    assert rows[0]["staleness/versions._type"] == "histogram"
    assert rows[0]["staleness/versions.values"] == [30, 4]
    assert rows[0]["staleness/versions.bins"] == [-0.5, 0.5, 1.5]  # a bin around each version


@pytest.mark.parametrize(("name", "package"), [("tensorboard", "tensorboard"),
                                               ("wandb", "wandb")])
def test_a_missing_package_names_the_extra_to_install(tmp_path, monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` does when it is absent
    with pytest.raises(LoggerError) as error:
        LogSetup(loggers=(name,), log_dir=tmp_path).open(name="flow")
    assert f"--logger {name} needs the {package} package" in str(error.value)
    assert f"pip install 'flowkit[{name}]'" in str(error.value)


def test_an_unknown_logger_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown logger 'mlflow': choose from jsonl, "
                                         "tensorboard, wandb"):
        LogSetup(loggers=("mlflow",))


def test_metrics_alone_write_nothing_in_the_log_dir(tmp_path):
    with LogSetup(metrics=tmp_path / "m.jsonl", log_dir=tmp_path / "runs").open(name="f") as lg:
        lg.log(0, _record(0, 1.0))
    assert (tmp_path / "m.jsonl").is_file() and not (tmp_path / "runs").exists()


def test_new_runs_get_their_own_folders_and_a_resumed_one_finds_its_own(tmp_path):
    runs, checkpoints = tmp_path / "runs", tmp_path / "ck"
    first, _, new = run_folder(runs, "pretrain", checkpoints=checkpoints)
    second, _, _ = run_folder(runs, "pretrain")
    assert (first.name, second.name, new) == ("pretrain", "pretrain-2", True)
    again, saved, new = run_folder(runs, "pretrain", resume=checkpoints)
    assert (again, new) == (first, False)
    assert saved["checkpoints"] == str(checkpoints.resolve())
    elsewhere, _, _ = run_folder(runs, "pretrain", resume=tmp_path / "other")
    assert elsewhere.name == "pretrain-3"
    assert json.loads((elsewhere / RUN_FILE).read_text()) == {"checkpoints": None}


def test_wandb_bins_give_each_value_its_bin_and_past_512_values_merge_them():
    from flowkit.observe.loggers import _wandb_bins

    assert _wandb_bins({3.0: 2.0, 7.0: 1.0}) == ([2.0, 1.0], [2.5, 5.0, 7.5])
    counts, edges = _wandb_bins({float(v): 1.0 for v in range(1024)})
    assert len(counts) == 512 and len(edges) == 513 and sum(counts) == 1024
    assert edges[0] == 0.0 and edges[-1] == 1023.0


def test_wandb_online_without_an_api_key_is_one_error_and_leaves_no_folder(tmp_path,
                                                                          monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login either
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    runs = tmp_path / "runs"
    with pytest.raises(LoggerError) as error:
        LogSetup(loggers=("tensorboard", "wandb"), log_dir=runs).open(name="flow")
    assert "--logger wandb: No API key configured" in str(error.value)
    assert "WANDB_MODE=offline" in str(error.value)
    assert not any(runs.iterdir())
