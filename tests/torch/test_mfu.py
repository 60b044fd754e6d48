"""MFU in a training step's metrics [Note: model FLOPs in executors/torch/train/flops.py]: the
FLOPs a token costs are nanoGPT's estimate_mfu's for the built-in GPT, however it is split;
the step's MFU is its trained tokens' FLOPs over its seconds and its devices' peaks, reported
where a peak is known (on a CPU, where FLOWKIT_PEAK_TFLOPS sets one)."""

from __future__ import annotations

import pytest

from executors.torch.models.gpt import GPT
from executors.torch.train.flops import non_embedding_parameters, training_flops
from flowkit.runner.mfu import mfu
from tests.harness import tiny_gpt
from tests.torch.test_pipeline_training import CORPUS

DEVICES, MICROBATCHES, SEQUENCES, SEQ_LEN = 2, 4, 8, 8
GPT_CONFIG = tiny_gpt(vocab_size=256, block_size=16, n_layer=4, n_embd=16)


def _nanogpt_flops_per_token(model: GPT) -> float:
    """nanoGPT's model.py: get_num_params() (non_embedding: without wpe), then estimate_mfu's
    flops_per_token = 6N + 12 L H Q T."""
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    cfg = model.config
    L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
    return 6 * n + 12 * L * H * Q * T


@pytest.mark.parametrize("config", [{}, GPT_CONFIG], ids=["default", "tiny"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_a_tokens_flops_are_nanogpts_however_the_model_is_split(config, stages):
    """nanoGPT counts rows of block_size tokens: one such row costs its tokens' FLOPs."""
    model = GPT(**config)
    parts = model.split(stages)
    T = model.config.block_size
    assert training_flops(parts, T, T * T) == pytest.approx(
        T * _nanogpt_flops_per_token(GPT(**config)), rel=1e-12)
    # the default GPT: 6 x 0.80M weights + 12 x 4 layers x 128 wide x 128 positions
    if not config and stages == 1:
        assert non_embedding_parameters(parts) == 4 * (12 * 128 * 128 + 13 * 128) + 2 * 128 \
            + 256 * 128


def test_the_attention_term_counts_each_rows_own_length():
    parts = GPT(**GPT_CONFIG).split(2)
    # two rows of 8 tokens: 16 tokens, each attending 8 positions
    assert training_flops(parts, 16, 2 * 8 * 8) - training_flops(parts, 16, 0) == \
        12 * 4 * 16 * 2 * 8 * 8


def test_an_untied_input_embedding_is_a_lookup_and_a_tied_one_counts_once():
    from executors.torch.models.hf import HFCausalLM

    rope = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=32, vocab_size=256,
                max_position_embeddings=32)
    for tied in (False, True):
        model = HFCausalLM(architecture="qwen2", hf_config={**rope,
                                                            "tie_word_embeddings": tied})
        every = {id(p): p.numel() for p in model.parameters()}
        embedding = 256 * 16
        for stages in (1, 2):
            counted = non_embedding_parameters(model.split(stages))
            assert counted == sum(every.values()) - (0 if tied else embedding), (tied, stages)


def test_a_model_whose_config_names_no_layers_has_no_flop_count():
    import torch

    assert training_flops([torch.nn.Linear(4, 4)], 4, 16) is None


def test_the_step_mfu_is_its_flops_over_seconds_and_each_devices_peak_once():
    one, two = (1e12, {1: 10e12, 2: 10e12}), (2e12, {2: 10e12, 3: 20e12})
    assert mfu([one, two], 2.0, {}) == pytest.approx(3e12 / 2.0 / 40e12)
    assert mfu([one, None], 1.0, {"FLOWKIT_PEAK_TFLOPS": "5"}) == pytest.approx(1e12 / 10e12)
    assert mfu([(1e12, {1: None})], 1.0, {}) is None  # a CPU: no peak of its own
    assert mfu([None], 1.0, {"FLOWKIT_PEAK_TFLOPS": "5"}) is None
    assert mfu([(1e12, {1: 1e12, 2: None})], 1.0, {}) is None
    with pytest.raises(ValueError, match="FLOWKIT_PEAK_TFLOPS='x' is not a positive number"):
        mfu([one], 1.0, {"FLOWKIT_PEAK_TFLOPS": "x"})


@pytest.fixture(scope="module")
def torch_cluster(pool):
    with pool.shared(DEVICES, kind="torch", tags=("train",)) as (ctl, _):
        yield ctl


def _step(ctl, name: str):
    from dataflows.pretrain import pretrain_flow
    from flowkit.planner.lower import lower_flow
    from flowkit.runner.flowrun import FlowRunner

    flow = pretrain_flow(corpus=CORPUS, stages=DEVICES, microbatches=MICROBATCHES,
                         schedule="1f1b", batch_size=SEQUENCES, seq_len=SEQ_LEN,
                         gpt={**GPT_CONFIG, "seed": 3}, model_name=name)
    runner = FlowRunner(ctl, lower_flow(flow))
    return runner, [runner.run_step(step) for step in range(2)]


def test_a_training_step_reports_mfu_where_a_peak_is_set(torch_cluster, monkeypatch):
    monkeypatch.setenv("FLOWKIT_PEAK_TFLOPS", "0.5")
    _, reports = _step(torch_cluster, "mfu-set")
    flops = training_flops(GPT(**GPT_CONFIG).split(DEVICES), SEQUENCES * SEQ_LEN,
                           SEQUENCES * SEQ_LEN * SEQ_LEN)
    for report in reports:  # each step's own rows: stage 0's count starts again each step
        expected = flops / report.elapsed_s / (DEVICES * 0.5e12)
        assert report.metrics["mfu"] == pytest.approx(expected, rel=1e-9)


def test_without_a_peak_a_cpu_step_reports_none_and_stops_asking(torch_cluster, monkeypatch):
    monkeypatch.delenv("FLOWKIT_PEAK_TFLOPS", raising=False)
    runner, reports = _step(torch_cluster, "mfu-unset")
    assert not any("mfu" in report.metrics for report in reports)
    assert all(training.flops_unknown for training in runner.training.values())


@pytest.mark.parametrize("value", ["fast", "0", "-3", "inf"])
def test_a_peak_setting_that_is_not_a_positive_number_is_refused_before_the_run(
        monkeypatch, value):
    from examples.sort_sft import flow
    from flowkit import RunConfig, run
    from flowkit.runner.config import RunConfigError

    monkeypatch.setenv("FLOWKIT_PEAK_TFLOPS", value)
    with pytest.raises(RunConfigError, match=rf"FLOWKIT_PEAK_TFLOPS='{value}' is not a "
                       "positive number of TFLOP/s"):
        run(flow, RunConfig(dashboard=False))
