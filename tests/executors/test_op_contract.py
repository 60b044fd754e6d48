"""The simulator and the torch executor implement the executor ops of flowkit/ops as declared:
each declared op is registered, and every keyword an implementation names is one the runtime
may send it (flowkit.ops.EXECUTOR_OPS), so the two cannot drift apart on an op's keywords."""

from __future__ import annotations

import inspect

import attrs
import pytest

from executors.kinds import op_table
from executors.torch.train import loss_terms as algos
from executors.torch.train.pipeline_ops import LOSSES as TORCH_LOSSES
from executors.torch.train.rl_loss import RLSettings
from flowkit.ops import EXECUTOR_OPS, KL_KINDS, LOSS_KNOBS, LOSSES, OFFLOAD_KEYS, SIMULATED

IMPLEMENTED = {"sim": SIMULATED, "torch": frozenset(EXECUTOR_OPS)}


def _named_keywords(fn) -> set[str]:
    """The config keys an op's function names (after ctx and its positional inputs)."""
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name for p in params if p.kind in kinds and p.default is not inspect.Parameter.empty
            or p.kind is inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("kind", sorted(IMPLEMENTED))
def test_each_kind_registers_the_ops_it_implements(kind):
    table = op_table(kind)
    assert sorted(IMPLEMENTED[kind] - set(table.names())) == []


@pytest.mark.parametrize(("kind", "op"), [(k, op) for k in sorted(IMPLEMENTED)
                                          for op in sorted(IMPLEMENTED[k])])
def test_an_op_names_only_keywords_its_declaration_has(kind, op):
    fn = op_table(kind).get(op)
    unknown = _named_keywords(fn) - EXECUTOR_OPS[op].keywords
    assert not unknown, f"{kind}'s {op!r} reads {sorted(unknown)}, which flowkit.ops does not " \
                        "declare: declare them in EXECUTOR_OPS or drop them"


@pytest.mark.parametrize(("kind", "op"), [(k, op) for k in sorted(IMPLEMENTED)
                                          for op in sorted(OFFLOAD_KEYS)])
def test_every_pipeline_op_reads_the_offload_keys(kind, op):
    """An op that let them fall into its **config would train right and offload nothing."""
    missing = set(OFFLOAD_KEYS[op]) - _named_keywords(op_table(kind).get(op))
    assert not missing, f"{kind}'s {op!r} ignores {sorted(missing)} [Note: offload in the runtime]"


def test_the_torch_executor_trains_with_every_declared_loss():
    assert set(TORCH_LOSSES) == set(LOSSES)


def test_the_torch_rl_losses_know_every_declared_knob():
    assert set(LOSS_KNOBS) == {f.name for f in attrs.fields(RLSettings)} - {"loss"}


def test_the_torch_kl_estimators_are_the_declared_kl_kinds():
    assert algos.KL_KINDS == KL_KINDS
