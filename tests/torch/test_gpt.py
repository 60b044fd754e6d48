"""The built-in GPT: shapes, its loss at init, and split_gpt equal to the unsplit model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from executors.torch import StageRunner
from executors.torch.models.gpt import (
    GPT,
    GPTConfig,
    layers_per_stage,
    split_gpt,
    sum_tied_grads,
    tied_parameters,
)
from tests.harness import seeded_gpt, tiny_gpt
from tests.torch.helpers import run_order, schedule_order

SMALL = tiny_gpt(block_size=16, n_layer=4, n_embd=16)


def test_shapes_and_factory_from_a_config_dict():
    model = GPT(**{"vocab_size": 256, "n_layer": 2, "n_embd": 32, "n_head": 4})
    idx = torch.randint(0, 256, (3, 10))
    assert model(idx).shape == (3, 10, 256)
    assert model(idx, idx).shape == ()
    assert model.lm_head.weight is model.transformer.wte.weight
    critic = GPT(**SMALL, value_head=True)
    assert critic(idx % 64).shape == (3, 10)
    assert critic(idx % 64, torch.randn(3, 10)).shape == ()
    assert GPT(GPTConfig(n_layer=1), n_embd=8, n_head=2).config.n_embd == 8
    with pytest.raises(ValueError, match="block_size is 16"):
        GPT(**SMALL)(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=10, n_head=4)


def test_loss_at_init_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(vocab_size=256, n_layer=2, n_embd=64, n_head=4, block_size=32)
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.randint(0, 256, (4, 32))
    assert abs(model(idx, targets).item() - math.log(256)) < 0.15


@pytest.mark.parametrize(
    ("config", "stages", "expected"),
    [
        ({"n_layer": 4}, 1, [4]),
        ({"n_layer": 4}, 2, [2, 2]),
        ({"n_layer": 4}, 4, [1, 1, 1, 1]),
        ({"n_layer": 8}, 4, [2, 2, 2, 2]),  # a 256-token head is cheap next to a block
        # a 50k head costs ~28 blocks: the last stage keeps one block, the rest spread evenly
        ({"n_layer": 8, "vocab_size": 50_000}, 4, [2, 2, 3, 1]),
        ({"n_layer": 12, "vocab_size": 50_000, "n_embd": 64}, 3, [5, 6, 1]),
        ({"n_layer": 12, "vocab_size": 8192}, 4, [3, 4, 4, 1]),  # head ~4.6 blocks
    ],
)
def test_balanced_split(config, stages, expected):
    counts = layers_per_stage(GPTConfig(**config), stages)
    assert counts == expected and sum(counts) == config["n_layer"]


def test_split_needs_a_block_per_stage():
    with pytest.raises(ValueError,
                       match="a GPT of 4 layers splits into 1 to 4 pipeline stages, not"):
        split_gpt(GPT(**SMALL), 5)


def _reference(model, data):
    ref = copy.deepcopy(model)
    loss = sum(ref(x, y) for x, y in data)
    loss.backward()
    return loss.item(), ref


def _data(microbatches, vocab=64, seq=12):
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, vocab, (2, seq + 1), generator=g) for _ in range(microbatches)]
    return [(b[:, :-1], b[:, 1:]) for b in batches]  # [Note: GPT stage inputs]


@pytest.mark.parametrize(("stages", "schedule"), [(1, "1f1b"), (2, "zb-h1"), (4, "zb-h2"),
                                                  (4, "zb-v")])
def test_split_equals_unsplit_model_in_float64(stages, schedule):
    model = seeded_gpt(SMALL, dtype=torch.float64)
    data = _data(3)
    ref_loss, ref = _reference(model, data)
    parts = split_gpt(model, stages)
    names = {id(p): n for n, p in model.named_parameters()}
    loss = run_order([StageRunner(p) for p in parts], data, schedule_order(schedule, stages, 3))
    assert abs(loss - ref_loss) < 1e-10
    sum_tied_grads(parts)
    for s, part in enumerate(parts):
        for name, p in part.named_parameters():
            full = names.get(id(p), "lm_head.weight")  # the last stage's untied copy
            diff = (p.grad - ref.get_parameter(full).grad).abs().max().item()
            assert diff < 1e-10, f"stage {s} {name} ({full}): {diff}"


def test_tied_pairs_name_the_copies():
    model = GPT(**SMALL)
    assert tied_parameters(split_gpt(model, 1)) == []
    parts = split_gpt(model, 2)
    assert tied_parameters(parts) == [((0, "wte.weight"), (1, "lm_head.weight"))]
    copy_ = parts[1].get_parameter("lm_head.weight")
    assert copy_ is not parts[0].get_parameter("wte.weight")
    assert torch.equal(copy_, parts[0].get_parameter("wte.weight"))
    assert tied_parameters(split_gpt(GPT(**SMALL, value_head=True), 2)) == []


def test_value_head_split_equals_unsplit():
    model = seeded_gpt({**SMALL, "value_head": True}, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 64, (2, 8), generator=g),
             torch.randn(2, 8, generator=g, dtype=torch.float64)) for _ in range(2)]
    ref_loss, ref = _reference(model, data)
    parts = split_gpt(model, 2)
    names = {id(p): n for n, p in model.named_parameters()}
    loss = run_order([StageRunner(p) for p in parts], data, schedule_order("1f1b", 2, 2))
    assert abs(loss - ref_loss) < 1e-10
    for part in parts:
        for p in part.parameters():
            assert (p.grad - ref.get_parameter(names[id(p)]).grad).abs().max() < 1e-10


def test_split_equals_unsplit_in_float32_to_relative_1e_5():
    model = seeded_gpt(SMALL)
    data = _data(4)
    _, ref = _reference(model, data)
    parts = split_gpt(model, 4)
    names = {id(p): n for n, p in model.named_parameters()}
    run_order([StageRunner(p) for p in parts], data, schedule_order("zb-h1", 4, 4))
    sum_tied_grads(parts)
    for part in parts:
        for p in part.parameters():
            expected = ref.get_parameter(names.get(id(p), "lm_head.weight")).grad
            assert (p.grad - expected).abs().max() <= 1e-5 * expected.abs().max()
