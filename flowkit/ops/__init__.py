"""What flows declare and executors implement, in one place: the settings records whose
defaults all read (configs.py), the executor ops that model ops lower to (names, inputs,
config keys: executor_ops.py), the losses and their knobs (losses.py),
how a batch is cut into minibatches and microbatches (minibatches.py), the records that move
between ops (records.py) and the tokenizers of model folders that prompt sources and generation
share (tokenizers.py, transformers imported when one is loaded). No torch, no zmq.

Where an op lives, end to end: a flow declares it as a ModelOp (dataflows/model_ops.py) or an @op
function; the planner lowers it into tasks (flowkit/planner/lower.py); the runtime submits and
dispatches them (flowkit/runner/flowrun.py, controller.py, dispatch.py); an executor runs it
from its op table (executors/optable.py; executors/sim/ops.py, executors/torch/).
"""

from flowkit.ops.configs import (
    AGENT,
    AGENT_KEYS,
    AGENT_RANGES,
    MODEL_EOS,
    SAMPLING,
    SAMPLING_CHOICES,
    SAMPLING_KEYS,
    SAMPLING_RANGES,
    AgentConfig,
    SamplingConfig,
)
from flowkit.ops.environments import Conversation, Environment, EnvStep
from flowkit.ops.executor_ops import (
    EXECUTOR_OPS,
    LOWERED_OPS,
    OFFLOAD_KEYS,
    PIPELINE_OPS,
    SIMULATED,
    OpSpec,
    missing_executor_ops,
)
from flowkit.ops.losses import (
    KL_ALIASES,
    KL_KINDS,
    LOSS_AGG_MODES,
    LOSS_KNOBS,
    LOSS_SPEC,
    LOSSES,
    POLICY_LOSSES,
    PROXIMAL_LOSSES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    SUM_FORM_LOSSES,
)
from flowkit.ops.minibatches import ROUND_KNOBS, cut, epoch_order, minibatch_rounds, rounds_of
from flowkit.ops.records import STALE_SEGMENTS
from flowkit.ops.rollout_engines import ROLLOUT_ENGINES, vllm_problems

__all__ = ["AGENT", "AGENT_KEYS", "AGENT_RANGES", "EXECUTOR_OPS", "KL_ALIASES", "KL_KINDS",
           "LOSSES", "LOSS_AGG_MODES", "LOSS_KNOBS",
           "LOSS_SPEC", "POLICY_LOSSES", "ROLLOUT_IS_LEVELS", "ROLLOUT_IS_MODES",
           "LOWERED_OPS", "MODEL_EOS", "OFFLOAD_KEYS", "PIPELINE_OPS", "PROXIMAL_LOSSES",
           "ROLLOUT_ENGINES", "ROUND_KNOBS",
           "SAMPLING", "SAMPLING_CHOICES", "SAMPLING_KEYS", "SAMPLING_RANGES", "SIMULATED",
           "STALE_SEGMENTS", "SUM_FORM_LOSSES", "AgentConfig", "Conversation", "EnvStep",
           "Environment", "OpSpec", "SamplingConfig", "cut",
           "epoch_order", "minibatch_rounds", "missing_executor_ops", "rounds_of",
           "vllm_problems"]
