"""The gradient all-reduce started inside a stage's last W [Note: all-reduce in the last W in
executors/torch/train/replicas.py], in one process: buckets start while the W still computes
the later ones' gradients, in bucket order, and the sums come back as all_reduce_grads leaves
them; inside a fused BW's plain backward pass, last bucket first, as the pass makes the last
layers' gradients first. On real replicas (gloo, 2 and 4 processes):
tests/torch/test_data_parallel.py."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from executors.torch import StageRunner
from executors.torch.train.pipeline_ops import trainable
from executors.torch.train.replicas import BucketsInFlight, all_reduce_grads
from tests.torch.helpers import KINDS, make_data, make_stages


class _Watched:
    """A real gloo group that notes, at each all-reduce it starts, the bucket's size and which
    of the stage's parameters had a gradient yet."""

    def __init__(self, group, params):
        self.group, self.params, self.starts = group, params, []

    def allreduce(self, tensors):
        self.starts.append((tensors[0].numel(), [p.grad is not None for p in self.params]))
        return self.group.allreduce(tensors)


@pytest.fixture()
def gloo():
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, options)


def _after_b(kind: str = "linear"):
    """A one-stage runner whose only microbatch has run F and B: W is next."""
    (stage,) = make_stages(kind, 1)
    runner = StageRunner(stage)
    (x, y), = make_data(kind, 1)
    runner.forward(0, x, y)
    runner.backward_input(0)
    return stage, runner


def test_buckets_start_inside_the_w_before_it_made_the_last_gradients(gloo):
    stage, runner = _after_b()
    params = trainable(stage)
    watched = _Watched(gloo, params)
    buckets = BucketsInFlight(watched, params, bucket_bytes=1)  # a bucket a parameter
    runner.backward_weight(0, buckets)
    assert buckets.started == len(params) > 2  # all in flight as the W returns
    sizes = [numel for numel, _ in watched.starts]
    assert sizes == [p.numel() for p in params]  # in bucket order, as all_reduce_grads
    first_had = watched.starts[0][1]
    assert first_had[0] and not first_had[-1]  # the last gradients were not made yet
    buckets.finish()
    buckets.wait()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bucket_bytes", [1, 1024, 25 << 20])
def test_the_sums_equal_all_reduce_grads_after_the_w(gloo, kind, bucket_bytes):
    """Over one process the sum is the gradient itself: what comes back is the W's own
    gradients, bit for bit, as all_reduce_grads after the W leaves them. A bucket started
    before a parameter's last addition (one used twice: "shared"; a generic consumer's:
    "embed_conv") would copy back a partial gradient."""
    early_stage, early = _after_b(kind)
    later_stage, later = _after_b(kind)
    buckets = BucketsInFlight(gloo, trainable(early_stage), bucket_bytes=bucket_bytes)
    early.backward_weight(0, buckets)
    buckets.finish()
    buckets.wait()
    later.backward_weight(0)
    all_reduce_grads(gloo, trainable(later_stage), bucket_bytes=bucket_bytes)
    for p, q in zip(trainable(early_stage), trainable(later_stage), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_bucket_waits_for_every_bucket_before_it(gloo):
    """A parameter no call of this W touches (its gradient final from earlier microbatches, or
    none: zeros) is final at once; a bucket behind one still to come waits."""
    (stage,) = make_stages("linear", 1)
    params = trainable(stage)
    buckets = BucketsInFlight(gloo, params, bucket_bytes=1)
    buckets.final_except(params[:1])  # only the first is still to come
    assert buckets.started == 0
    buckets.mark_final(params[:1])
    assert buckets.started == len(params)
    buckets.wait()  # no gradient anywhere: each takes part with zeros, as in all_reduce_grads
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)


def test_waiting_before_every_bucket_started_is_an_error(gloo):
    stage, _ = _after_b()
    buckets = BucketsInFlight(gloo, trainable(stage))
    with pytest.raises(Exception, match="never started"):
        buckets.wait()


def _after_f(kind: str = "linear"):
    """A one-stage runner whose only microbatch has run an unsplit F: BW is next."""
    (stage,) = make_stages(kind, 1)
    runner = StageRunner(stage)
    (x, y), = make_data(kind, 1)
    runner.forward(0, x, y, split=False)
    return stage, runner


def test_buckets_start_inside_a_plain_backward_last_bucket_first(gloo):
    stage, runner = _after_f()
    params = trainable(stage)
    watched = _Watched(gloo, params)
    buckets = BucketsInFlight(watched, params, bucket_bytes=1, reverse=True)
    runner.backward(0, grads_final=buckets)
    assert buckets.started == len(params) > 2  # all in flight as the BW returns
    assert [numel for numel, _ in watched.starts] == [p.numel() for p in reversed(params)]
    first_had = watched.starts[0][1]
    assert first_had[-1] and not first_had[0]  # the first layers' gradients were not made yet
    buckets.finish()
    buckets.wait()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bucket_bytes", [1, 1024, 25 << 20])
def test_the_sums_equal_all_reduce_grads_after_a_plain_backward(gloo, kind, bucket_bytes):
    """The gradients a hook added during the pass, the rest after it: the plain BW's own
    gradients, bit for bit, as all_reduce_grads after it leaves them (a parameter used twice,
    "shared", gets its whole gradient once)."""
    early_stage, early = _after_f(kind)
    later_stage, later = _after_f(kind)
    buckets = BucketsInFlight(gloo, trainable(early_stage), bucket_bytes=bucket_bytes,
                              reverse=True)
    early.backward(0, grads_final=buckets)
    buckets.finish()
    buckets.wait()
    later.backward(0)
    all_reduce_grads(gloo, trainable(later_stage), bucket_bytes=bucket_bytes, reverse=True)
    for p, q in zip(trainable(early_stage), trainable(later_stage), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_later_backprop_of_the_step_makes_the_started_buckets_stale(gloo):
    """Two backprops of one stage before its reduce_grads, only the first's W told to start
    the all-reduce: the second's W lets those buckets go, and reduce_grads sums both
    backprops' gradients, as with no early start."""
    from executors.optable import OpContext
    from executors.torch.train import pipeline_ops as po
    from tests.harness import gpt_spec, tiny_gpt

    def two_backprops(early: bool) -> list[torch.Tensor]:
        ctx = OpContext(name="exec0", device="cpu", tags=())
        ctx.state["replica_groups"] = {"g": gloo}
        spec = {**gpt_spec("m", tiny_gpt(), seed=0), "stage": 0, "stages": 1}
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
        for first in (True, False):
            stats = po._forward(ctx, tokens, microbatch=0, **spec)
            po._backward_input(ctx, stats, microbatch=0, **spec)
            told = {"reduce_group": "g"} if early and first else {}
            po._backward_weight(ctx, microbatch=0, **spec, **told)
        po._reduce_grads(ctx, replica_group="g", **spec)
        module = po.held_stage(ctx, spec).module
        return [p.grad.clone() for p in trainable(module)]

    for got, want in zip(two_backprops(early=True), two_backprops(early=False), strict=True):
        assert torch.equal(got, want)
