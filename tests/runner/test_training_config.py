"""What the runtime tells a model's pipeline ops: the loss, its knobs and the loss scale
(flowkit/runner/training_tasks.py); the torch side is tested in tests/torch/test_rl_loss.py."""

from __future__ import annotations

import pytest

from flowkit.ops import LOSS_KNOBS, LOSS_SPEC, SUM_FORM_LOSSES
from flowkit.planner import Action, Kind
from flowkit.runner.training_tasks import pipeline_config

LOSS_KEYS = ("loss", *LOSS_KNOBS)  # the Backprop config keys the stage ops read

SPEC = {"model": "actor", "build": "x:y", "stages": 2, "seed": 0, "dtype": "float32",
        "model_config": {}}
KNOBS = {"kl_coef": 0.1, "kl_kind": "k2", "clip_ratio": 0.1, "clip_ratio_c": 2.0,
         "clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "loss_agg_mode": "seq-mean-token-sum",
         "loss_scale_factor": 8, "policy_loss": "gspo", "entropy_coeff": 0.01,
         "mask_truncated": True, "temperature": 0.7, "cliprange_value": 0.3,
         "decoupled": True, "behav_cap": 2.0, "rollout_is": "sequence",
         "rollout_is_mode": "mask", "rollout_is_threshold": 3.0,
         "rollout_is_threshold_lower": 0.2, "rollout_is_veto_threshold": 1e-3}


def _configs(extra: dict, sizes=(1, 3)) -> dict[Action, dict]:
    config_for = pipeline_config(lambda action: {"seconds": 1.0}, SPEC, list(sizes), extra,
                                 LOSS_SPEC)
    actions = [Action(s, kind, mb) for s in range(2) for kind in (Kind.F, Kind.B, Kind.W)
               for mb in range(len(sizes))]
    return {a: config_for(a) for a in actions}


def test_the_lm_loss_is_scaled_by_the_microbatchs_share_of_the_batch():
    configs = _configs({"loss": "lm", "schedule": "1f1b", "microbatches": 2})
    assert configs[Action(1, Kind.F, 0)]["loss_scale"] == 0.25
    assert configs[Action(1, Kind.F, 1)]["loss_scale"] == 0.75
    assert all("loss_scale" not in c for a, c in configs.items()
               if a.kind is not Kind.F or a.stage == 0)
    assert all("schedule" not in c and c["loss"] == "lm" for c in configs.values())


@pytest.mark.parametrize("loss", SUM_FORM_LOSSES)
def test_a_summed_loss_gets_scale_one_and_every_knob(loss):
    configs = _configs({"loss": loss, **KNOBS, "lr": 1e-3, "microbatches": 2})
    assert [configs[Action(1, Kind.F, mb)]["loss_scale"] for mb in range(2)] == [1.0, 1.0]
    for config in configs.values():
        assert {k: config[k] for k in KNOBS} == KNOBS and config["loss"] == loss
        assert "lr" not in config and "microbatches" not in config
    assert set(KNOBS) | {"loss"} == set(LOSS_KEYS)
