"""The flow DSL: typed ports, operators, models and `Flow`, validated when built. No torch, no
zmq."""

from flowkit.dsl.errors import FlowError, Problem
from flowkit.dsl.flow import Feedback, Flow, Node, Outputs, Ref, Wire, collect, group_by
from flowkit.dsl.load import FlowLoadError, load_flow
from flowkit.dsl.metrics import Metrics
from flowkit.dsl.operators import (
    REQUIRED,
    InputPort,
    LossSpec,
    Model,
    ModelOp,
    Operator,
    Resumable,
    Workload,
    op,
)
from flowkit.dsl.types import Batch, Granularity, Grouped, PortType, Stream, Tensor, port_type

__all__ = [
    "REQUIRED",
    "Batch",
    "Feedback",
    "Flow",
    "FlowError",
    "FlowLoadError",
    "Granularity",
    "Grouped",
    "InputPort",
    "LossSpec",
    "Metrics",
    "Model",
    "ModelOp",
    "Node",
    "Operator",
    "Outputs",
    "PortType",
    "Problem",
    "Ref",
    "Resumable",
    "Stream",
    "Tensor",
    "Wire",
    "Workload",
    "collect",
    "group_by",
    "load_flow",
    "op",
    "port_type",
]
