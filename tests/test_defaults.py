"""Each setting's default is defined once, in its record (flowkit.ops.SamplingConfig, the RL
records of dataflows/rl/config.py): the op declarations, the flows, the executors and the CLI
either take it from there or have none of their own. Everything is read by introspection, so
a second default written anywhere shows up here as a difference."""

from __future__ import annotations

import inspect

import attrs
import click
import pytest

from dataflows.grpo import grpo_flow
from dataflows.model_ops import Backprop, Generate, LogProbs, OptimizerStep
from dataflows.ppo import ppo_flow
from dataflows.reinforce_pp import reinforce_pp_flow
from dataflows.rl.advantages import reinforce_pp_advantages
from dataflows.rl.config import (
    GroupRLConfig,
    PPOConfig,
    ReinforcePPConfig,
    RLConfig,
    shortcuts_of,
)
from dataflows.rloo import rloo_flow
from flowkit.cli import main
from flowkit.ops import (
    AGENT,
    AGENT_KEYS,
    AGENT_RANGES,
    EXECUTOR_OPS,
    LOSS_KNOBS,
    ROUND_KNOBS,
    SAMPLING,
    SAMPLING_CHOICES,
    SAMPLING_KEYS,
    SAMPLING_RANGES,
    SamplingConfig,
)

FLOWS = {grpo_flow: GroupRLConfig, rloo_flow: GroupRLConfig, ppo_flow: PPOConfig,
         reinforce_pp_flow: ReinforcePPConfig}

# The values an algorithm's record sets apart from the common one: its own choices, each
# written once, in its record (dataflows/rl/config.py says why)
ALGORITHM_VALUES = {GroupRLConfig: {"sampling.n"}, PPOConfig: {"prompts", "kl_coef"},
                    ReinforcePPConfig: {"prompts"}}

# RL settings that are another op's: the record's default must be that op's
OP_SETTINGS = [(RLConfig, "microbatches", Backprop.config["microbatches"]),
               (RLConfig, "lr", OptimizerStep.config["lr"]),
               (PPOConfig, "ppo_epochs", ROUND_KNOBS["epochs"]),
               (PPOConfig, "minibatches", ROUND_KNOBS["minibatches"]),
               (ReinforcePPConfig, "gamma", reinforce_pp_advantages.config["gamma"])]

# (command, option, record, field): CLI options that set a record's field on the flow. Their
# default is None (the flow's, i.e. the record's) or the record's own
CLI_OPTIONS = [("run", "--stages", RLConfig, "stages"),
               ("run", "--microbatches", RLConfig, "microbatches"),
               ("run", "--schedule", RLConfig, "schedule"),
               ("run", "--max-staleness", RLConfig, "max_staleness")]


def _defaults(record: type) -> dict:
    return {field.name: field.default for field in attrs.fields(record)}


def _flat(config: RLConfig) -> dict:
    """The record's settings, its sampling's as "sampling.NAME"."""
    values = attrs.asdict(config, recurse=False)
    sampling = values.pop("sampling")
    return {**values, **{f"sampling.{k}": v for k, v in sampling.as_config().items()}}


# -- the op declarations ----------------------------------------------------------------------
def test_generate_declares_the_sampling_records_settings_defaults_ranges_and_choices():
    assert Generate.config == {**SAMPLING.as_config(), **AGENT.as_config()}
    assert Generate.ranges == {**SAMPLING_RANGES, **AGENT_RANGES}
    assert Generate.choices == SAMPLING_CHOICES
    assert set(SAMPLING_RANGES) | set(SAMPLING_CHOICES) <= set(SAMPLING_KEYS)
    assert set(AGENT_RANGES) <= set(AGENT_KEYS)


def test_the_samplers_temperature_has_the_records_default_wherever_it_is_read():
    assert LogProbs.config["temperature"] == LOSS_KNOBS["temperature"] == SAMPLING.temperature


def test_the_generate_op_spec_lists_every_setting_an_executor_gets():
    # take is the runner's: it never reaches an executor (flowkit/runner/flowrun.py)
    assert set(SAMPLING_KEYS) - {"take"} <= EXECUTOR_OPS["generate"].keywords
    assert set(AGENT_KEYS) <= EXECUTOR_OPS["generate"].keywords


# -- the executors ----------------------------------------------------------------------------
def _executor_functions() -> list:
    pytest.importorskip("torch")
    from executors.sim import ops as sim
    from executors.torch.rollout import engine, generate, infer

    return [sim._generate, sim.sample_rollout, generate._generate, infer._logprobs,
            engine.Sampling]


@pytest.mark.parametrize("fn", _executor_functions(), ids=lambda fn: fn.__qualname__)
def test_an_executor_has_no_sampling_default_of_its_own(fn):
    if attrs.has(fn):  # the engine's request settings: a record
        own = {f.name: f.default for f in attrs.fields(fn) if f.default is not attrs.NOTHING}
    else:
        own = {name: p.default for name, p in inspect.signature(fn).parameters.items()
               if p.default is not inspect.Parameter.empty}
    # the engine's eos and seed are resolved values (stop tokens, the seed drawn from), set by
    # the generate op from the task's eos and sample_seed: no default of the settings
    resolved = {"eos", "seed"} if attrs.has(fn) else set()
    shared = {name: value for name, value in own.items()
              if name in SAMPLING_KEYS and name not in resolved}
    assert shared == {name: getattr(SAMPLING, name) for name in shared}


def test_a_task_without_a_setting_gets_the_records_default():
    sampling, rest = SamplingConfig.split({"model": "m", "n": 2, "request": "r"})
    assert sampling == attrs.evolve(SAMPLING, n=2) and rest == {"model": "m", "request": "r"}


# -- the RL flows -----------------------------------------------------------------------------
@pytest.mark.parametrize("record", sorted(ALGORITHM_VALUES, key=lambda r: r.__name__))
def test_an_algorithms_record_changes_only_its_own_values(record):
    common, own = _flat(RLConfig()), _flat(record())
    changed = {name for name in common if own[name] != common[name]}
    assert changed == ALGORITHM_VALUES[record]


def test_the_common_record_samples_with_the_sampling_records_defaults():
    assert RLConfig().sampling == SAMPLING


@pytest.mark.parametrize(("record", "field", "value"), OP_SETTINGS,
                         ids=[f"{r.__name__}.{f}" for r, f, _ in OP_SETTINGS])
def test_a_setting_of_another_op_defaults_to_that_ops_default(record, field, value):
    assert _defaults(record)[field] == value


@pytest.mark.parametrize("flow", FLOWS, ids=lambda fn: fn.__name__)
def test_a_flows_shortcuts_are_its_records_settings_and_default_to_none(flow):
    params = inspect.signature(flow).parameters
    shortcuts = shortcuts_of(FLOWS[flow])
    assert len(set(shortcuts)) == len(shortcuts)  # no setting shadows another
    assert set(shortcuts) <= set(params)
    assert all(params[name].default is None for name in [*shortcuts, "config"])


@pytest.mark.parametrize("flow", FLOWS, ids=lambda fn: fn.__name__)
def test_a_flow_built_without_settings_has_its_records(flow):
    record = FLOWS[flow]()
    built = flow().validate()
    nodes = {node.label: node.config for node in built.nodes.values()}
    assert nodes["generate"] == {**record.sampling.as_config(), **AGENT.as_config()}
    assert nodes["ref_logprobs"]["temperature"] == record.sampling.temperature
    backprop = nodes["update_actor"]
    assert (backprop["schedule"], backprop["microbatches"]) == (record.schedule,
                                                                 record.microbatches)
    assert backprop["temperature"] == record.sampling.temperature
    (actor_step,) = [node.config for node in built.nodes.values()
                     if isinstance(node.operator, OptimizerStep) and node.operator.model == "actor"]
    assert actor_step["lr"] == record.lr
    assert built.max_staleness == record.max_staleness


def test_a_shortcut_overrides_the_records_field_and_none_keeps_it():
    config = GroupRLConfig(prompts=4, sampling=SamplingConfig(n=3, max_new_tokens=5))
    built = grpo_flow(config, max_new_tokens=7, temperature=None).validate()
    generate = next(n.config for n in built.nodes.values() if n.label == "generate")
    assert (generate["n"], generate["max_new_tokens"]) == (3, 7)
    assert generate["temperature"] == SAMPLING.temperature


# -- the CLI ----------------------------------------------------------------------------------
def _option(command: str, flag: str) -> click.Option:
    cmd = main.get_command(click.Context(main), command)
    return next(p for p in cmd.params if isinstance(p, click.Option) and flag in p.opts)


@pytest.mark.parametrize(("command", "flag", "record", "field"), CLI_OPTIONS,
                         ids=[f"{c} {f}" for c, f, _, _ in CLI_OPTIONS])
def test_a_cli_option_defaults_to_the_flows_record(command, flag, record, field):
    default = _option(command, flag).default
    assert default is None or default == _defaults(record)[field]
