"""A model op declares how it lowers: the planner reads the declaration, not the op's name."""

from flowkit.dsl import Batch, Flow, Model, ModelOp, Stream, collect, op
from flowkit.planner.lower import Call, lower_flow


class Trainer(ModelOp):
    lowering = "pipeline"  # named neither "backprop" nor anything the planner knows
    many_per_call = True
    inputs, outputs = {"batch": Stream[int]}, {"stats": Stream[float]}


class Update(ModelOp):
    lowering = "step"
    inputs, outputs = {"stats": Batch[float]}, {"done": Stream[int]}


def test_a_users_model_ops_lower_by_their_declared_lowering():
    numbers = op(lambda: [1, 2, 3], name="numbers", outputs={"out": Stream[int]})
    net = Model(name="net", build="pkg.net:build")
    with Flow("own-trainer") as flow:
        Update(net)(collect(Trainer(net)(numbers())))
    plans = {plan.name: plan for plan in lower_flow(flow)}
    assert (plans["trainer"].call, plans["trainer"].many) == (Call.PIPELINE, (True,))
    assert (plans["update"].call, plans["update"].many) == (Call.STEP, (False,))
