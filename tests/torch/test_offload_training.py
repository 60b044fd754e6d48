"""A flow trained under an offloading schedule on torch executor processes [Note: offload in the
runtime in flowkit/ops/executor_ops.py]: the same parameters as the run without offload, bit for
bit, and a lower peak of activation memory by the executors' own accounting [Note: activation
memory reports in flowkit/runner/device_reports.py]."""

from __future__ import annotations

import pytest
import torch

from dataflows.pretrain import pretrain_flow
from flowkit.planner import Kind
from flowkit.runner.setup import with_training_options
from tests.harness import per_stage, tiny_gpt
from tests.torch.test_pipeline_training import CORPUS

DEVICES, MICROBATCHES, SEQUENCES, SEQ_LEN, STEPS = 4, 8, 8, 8, 2
GPT_CONFIG = tiny_gpt(vocab_size=256, block_size=16, n_layer=4, n_embd=16)


@pytest.fixture(scope="module")
def torch_cluster(pool):
    with pool.shared(DEVICES, kind="torch", tags=("train",)) as (ctl, _):
        yield ctl


def _train(ctl, schedule: str, offload: str, name: str,
           devices: int = DEVICES) -> tuple[dict, list[dict], object]:
    from flowkit.planner.lower import lower_flow
    from flowkit.runner.flowrun import FlowRunner

    flow = pretrain_flow(corpus=CORPUS, stages=devices, microbatches=MICROBATCHES,
                         schedule=schedule, batch_size=SEQUENCES, seq_len=SEQ_LEN,
                         gpt={**GPT_CONFIG, "dtype": "float64", "seed": 3}, model_name=name,
                         lr=1e-2, clip_grad_norm=0.5)
    with_training_options(flow, stages=None, microbatches=None, schedule=None, offload=offload)
    runner = FlowRunner(ctl, lower_flow(flow))
    metrics = [runner.run_step(step).metrics for step in range(STEPS)]
    return per_stage(ctl, runner, name, "stage_parameters"), metrics, runner.trained[name][0]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2"])
def test_offloaded_training_gives_the_parameters_of_the_plain_run_with_less_memory(
        torch_cluster, schedule):
    base, base_metrics, plain = _train(torch_cluster, schedule, "none", f"off-none-{schedule}")
    assert not any(a.kind.is_copy for ops in plain.device_ops for a in ops)
    peaks = {}
    for which in ("half", "all"):
        name = f"off-{which}-{schedule}"
        params, metrics, sched = _train(torch_cluster, schedule, which, name)
        assert any(a.kind is Kind.O for ops in sched.device_ops for a in ops)
        for stage, named in base.items():
            for key, value in named.items():
                assert torch.equal(params[stage][key], value), f"{which}: stage {stage} {key}"
        assert [m["backprop/loss"] for m in metrics] == \
            [m["backprop/loss"] for m in base_metrics]
        peaks[which] = [m[f"{name}/peak_activation_bytes/device0"] for m in metrics]
    plain_peaks = [m[f"off-none-{schedule}/peak_activation_bytes/device0"]
                   for m in base_metrics]
    for step, plain_peak in enumerate(plain_peaks):
        assert 0 < peaks["all"][step] < peaks["half"][step] < plain_peak, (peaks, plain_peaks)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_two_stages_a_device_offload_too(torch_cluster, schedule):
    """Interleaved and V placements (2 devices, 4 stages): the parameters of the plain run, and
    less memory on device 0. Bit for bit under the interleaved schedule, which the costs do not
    change; ZB-V's order is searched with each run's own profiled costs, so its W's may sum in
    another order (to float64 rounding), and its peak is another order's: only the interleaved
    run's peaks compare."""
    base, plain_metrics, plain = _train(torch_cluster, schedule, "none", f"v-none-{schedule}",
                                        devices=2)
    params, metrics, sched = _train(torch_cluster, schedule, "all", f"v-all-{schedule}",
                                    devices=2)
    assert sched.placement.chunks == plain.placement.chunks == 2
    assert any(a.kind is Kind.O for ops in sched.device_ops for a in ops)
    tolerance = 0.0 if schedule == "interleaved-1f1b" else 1e-10
    for stage, named in base.items():
        for key, value in named.items():
            torch.testing.assert_close(params[stage][key], value, rtol=0, atol=tolerance)
    peak = [m[f"v-all-{schedule}/peak_activation_bytes/device0"] for m in metrics]
    plain_peak = [m[f"v-none-{schedule}/peak_activation_bytes/device0"] for m in plain_metrics]
    if schedule == "interleaved-1f1b":
        assert all(0 < p < q for p, q in zip(peak, plain_peak)), (peak, plain_peak)
    assert all(p > 0 for p in peak)
