"""Each run setting's default is written once, in its record: `flowkit run`'s flags take theirs
from RunConfig, LogSetup, CheckpointConfig and RaySettings, and say so in --help."""

from __future__ import annotations

from pathlib import Path

import attrs
import click
import pytest

from flowkit.cli.run import run as run_command
from flowkit.observe.logsetup import LogSetup
from flowkit.runner.config import CheckpointConfig, ControllerConfig, RunConfig
from flowkit.runtime.raylaunch import RaySettings

# the flag's parameter -> (record, field) whose default it must show
FLAGS = {
    "kind": (RunConfig, "executors"), "num_executors": (RunConfig, "num_executors"),
    "placement": (RunConfig, "placement"),
    "device": (RunConfig, "device"), "steps": (RunConfig, "steps"),
    "executor_threads": (RunConfig, "executor_threads"),
    "stages": (RunConfig, "stages"), "replicas": (RunConfig, "replicas"),
    "shard_optimizer": (RunConfig, "shard_optimizer"), "fsdp": (RunConfig, "fsdp"),
    "precision": (RunConfig, "precision"),
    "microbatches": (RunConfig, "microbatches"), "packing": (RunConfig, "packing"),
    "microbatch_tokens": (RunConfig, "microbatch_tokens"),
    "schedule": (RunConfig, "schedule"), "offload": (RunConfig, "offload"),
    "memory_limit": (RunConfig, "memory_limit"), "rollout_engine": (RunConfig, "rollout_engine"),
    "weight_sync": (RunConfig, "weight_sync"),
    "fuse": (RunConfig, "fuse"), "fill_bubbles": (RunConfig, "fill_bubbles"),
    "asynchronous": (RunConfig, "asynchronous"), "max_staleness": (RunConfig, "max_staleness"),
    "trace": (RunConfig, "trace"), "save_weights": (RunConfig, "save_weights"),
    "eval_every": (RunConfig, "eval_every"),
    "resume": (RunConfig, "resume"), "max_restarts": (RunConfig, "max_restarts"),
    "elastic": (RunConfig, "elastic"), "elastic_wait": (RunConfig, "elastic_wait"),
    "dashboard": (RunConfig, "dashboard"), "debug": (RunConfig, "debug"),
    "launcher": (RunConfig, "launcher"),
    "metrics": (LogSetup, "metrics"), "log_dir": (LogSetup, "log_dir"),
    "wandb_project": (LogSetup, "wandb_project"), "run_name": (LogSetup, "run_name"),
    "checkpoint_every": (CheckpointConfig, "every"), "keep_checkpoints": (CheckpointConfig, "keep"),
    "bind": (ControllerConfig, "bind"), "keys_dir": (ControllerConfig, "keys"),
    "insecure": (ControllerConfig, "insecure"), "secret_file": (ControllerConfig, "secret_file"),
    "max_frame_mib": (ControllerConfig, "max_frame_mib"),
    "ray_address": (RaySettings, "address"), "ray_strategy": (RaySettings, "strategy"),
    "ray_cpus": (RaySettings, "cpus"),
}


def _record_default(record: type, name: str):
    default = attrs.fields_dict(record)[name].default
    return default.factory() if isinstance(default, attrs.Factory) else default


@pytest.mark.parametrize("param", [p for p in run_command.params if p.name in FLAGS],
                         ids=lambda p: p.name)
def test_a_flags_default_is_its_records(param):
    record, field = FLAGS[param.name]
    shown = param.get_default(click.Context(run_command))
    if shown is not None and param.type.name == "path":
        shown = Path(shown)
    assert shown == _record_default(record, field), f"--{param.name}: {shown!r}"


def test_every_option_of_flowkit_run_is_a_setting_of_a_record():
    unmapped = {p.name for p in run_command.params} - set(FLAGS) - {
        "flow_spec",  # the flow itself
        "tag_spec",  # RunConfig.tags, spelled 'a,b;c' on the command line
        "sim_cost",  # RunConfig.sim_costs, spelled NAME=SECONDS,...
        "loggers",  # LogSetup.loggers, repeated
        "checkpoint_dir",  # CheckpointConfig.root, which has no default
    }
    assert unmapped == set()
