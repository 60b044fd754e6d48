"""Which loggers a run writes to and where: one folder per run under the log dir, found again
when the run is resumed.

A run's TensorBoard events, W&B run and (without `--metrics`) JSON lines live in
`LOG_DIR/NAME`, NAME the run's name or else the flow's (`NAME-2`, `NAME-3`, ... when taken, so
a new run never mixes its curves with an earlier one's). The folder's `flowkit-run.json` remembers
the run's
checkpoint folder and its W&B run id: a run resumed from those checkpoints finds its folder by
them and continues the same TensorBoard curve and W&B run [Note: loggers on resume].
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import attrs

from flowkit.observe.loggers import (
    LOGGERS,
    JsonLinesLogger,
    Loggers,
    TensorBoardLogger,
    WandbLogger,
    check_extras,
)

__all__ = ["RUN_FILE", "LogSetup", "check_run_name", "run_folder"]

RUN_FILE = "flowkit-run.json"


def _names(_: object, attribute: attrs.Attribute, names: tuple[str, ...]) -> None:
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ValueError(f"unknown logger {unknown[0]!r}: choose from {', '.join(LOGGERS)}")


def check_run_name(name: str) -> str:
    """`name`, if it can be a run's folder under the log dir; else a ValueError saying why."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a folder name: a run's name is its folder under "
                         "the log dir, so no slashes, not empty, not '.' or '..'")
    return name


def _run_name(_: object, attribute: attrs.Attribute, name: str | None) -> None:
    if name is not None:
        check_run_name(name)


@attrs.frozen(kw_only=True)
class LogSetup:
    """Where a run's step metrics go: `flowkit run`'s --logger, --log-dir, --metrics,
    --wandb-project and --run-name."""

    loggers: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_names)
    """Loggers by name (`LOGGERS`); `jsonl` writes to `metrics` when given."""
    log_dir: Path = attrs.field(default=Path("runs"), converter=Path)
    """The folder of the runs' folders (TensorBoard's --logdir)."""
    metrics: Path | None = attrs.field(default=None)
    """The JSON-lines file; given, it is a `jsonl` logger whatever `loggers` says."""
    wandb_project: str = "flowkit"
    """The W&B project of the run."""
    wandb_mode: str | None = None
    """`online` or `offline`; None: W&B's own setting (WANDB_MODE, else online)."""
    run_name: str | None = attrs.field(default=None, validator=_run_name)
    """The run's folder and W&B run name (`-2`, `-3`, ... when taken); None: the flow's."""

    def chosen(self) -> tuple[str, ...]:
        """The loggers to open, each once, in `LOGGERS` order."""
        wanted = set(self.loggers) | ({"jsonl"} if self.metrics is not None else set())
        return tuple(name for name in LOGGERS if name in wanted)

    def open(self, *, name: str, checkpoints: Path | None = None,
             resume: Path | None = None) -> Loggers:
        """The run's loggers, opened: a missing package or a W&B refusal raises LoggerError
        here, before anything starts. `checkpoints` is the folder this run checkpoints to,
        `resume` the one it resumes from (whose run folder it continues)."""
        chosen = self.chosen()
        loggers, made = Loggers(), None
        try:
            if self.metrics is not None:
                loggers.loggers.append(JsonLinesLogger(self.metrics))
            in_folder = [n for n in chosen if n != "jsonl" or self.metrics is None]
            if not in_folder:
                return loggers
            check_extras(in_folder)  # before the run's folder is made
            folder, saved, new = run_folder(self.log_dir, self.run_name or name,
                                            checkpoints=checkpoints,
                                            resume=resume)
            made = folder if new else None
            if "jsonl" in in_folder:
                loggers.loggers.append(JsonLinesLogger(folder / "metrics.jsonl"))
            if "tensorboard" in in_folder:
                loggers.loggers.append(TensorBoardLogger(folder))
            if "wandb" in in_folder:
                wandb = WandbLogger(folder, project=self.wandb_project, name=folder.name,
                                    run_id=saved.get("wandb_id"), mode=self.wandb_mode)
                loggers.loggers.append(wandb)
                _save(folder, {**saved, "wandb_id": wandb.run_id})
        except BaseException:
            loggers.close()
            if made is not None:  # a refused run leaves no folder to take the next one's name
                shutil.rmtree(made, ignore_errors=True)
            raise
        return loggers


def run_folder(log_dir: Path, name: str, *, checkpoints: Path | None = None,
               resume: Path | None = None) -> tuple[Path, dict, bool]:
    """The run's folder under `log_dir`, what its `RUN_FILE` saved, and whether it is new:
    with `resume`, the newest folder of a run that checkpointed there; else a new folder,
    `name` or the first free `name-N`."""
    log_dir = Path(log_dir)
    if resume is not None:
        resume = str(Path(resume).resolve())
        saved = sorted(log_dir.glob(f"*/{RUN_FILE}"), key=lambda p: p.stat().st_mtime)
        for path in reversed(saved):
            data = json.loads(path.read_text())
            if data.get("checkpoints") == resume:
                if checkpoints is not None:
                    data["checkpoints"] = str(Path(checkpoints).resolve())
                    _save(path.parent, data)
                return path.parent, data, False
    folder, number = log_dir / name, 1
    while True:
        try:
            folder.mkdir(parents=True)
            break
        except FileExistsError:  # taken, maybe by a run starting beside this one
            number += 1
            folder = log_dir / f"{name}-{number}"
    data = {"checkpoints": None if checkpoints is None else str(Path(checkpoints).resolve())}
    _save(folder, data)
    return folder, data, True


def _save(folder: Path, data: dict) -> None:
    temp = folder / f".{RUN_FILE}.{os.getpid()}"
    temp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(temp, folder / RUN_FILE)  # a reader never sees half a file
