"""A model op declares how it lowers: the planner reads the declaration, not the op's name."""

from flowkit.dsl import Batch, Flow, Model, ModelOp, Stream, collect, op
from flowkit.planner.lower import Call, lower_flow


class Trainer(ModelOp):
    lowering = "pipeline"
    many_per_call = True
    inputs = {"batch": Stream[int]}
    outputs = {"stats": Stream[float]}


class Update(ModelOp):
    lowering = "step"
    inputs = {"stats": Batch[float]}
    outputs = {"done": Stream[int]}


@op
def numbers() -> Stream[int]:
    return [1, 2, 3]


def test_a_users_model_ops_lower_by_their_declared_lowering():
    net = Model(name="net", build="pkg.net:build")
    with Flow("own-trainer") as flow:
        Update(net)(collect(Trainer(net)(numbers())))
    plans = {plan.name: plan for plan in lower_flow(flow)}
    assert (plans["trainer"].call, plans["trainer"].many) == (Call.PIPELINE, (True,))
    assert (plans["update"].call, plans["update"].many) == (Call.STEP, (False,))
