"""FSDP within a stage, in one process [Note: FSDP within a stage in
executors/torch/train/fsdp.py]: two gloo ranks on threads cut a stage, gather it whole again
and reduce its gradients to each rank's rows; the shares join into the whole state; settings
that cannot work are refused in one line."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from executors.torch.errors import StageError
from executors.torch.train.fsdp import (
    full_stage_state,
    gather,
    reduce_and_release,
    shard_rows,
    shard_stage,
    shards_of,
)
from flowkit.dsl import Model
from tests.harness import seeded_gpt, tiny_gpt


def _on_two_ranks(work) -> list:
    """`work(group)` on two gloo ranks, each on its own thread; their results by rank."""
    store = dist.HashStore()
    results: list = [None, None]
    errors: list = []

    def rank(r: int) -> None:
        try:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            options._timeout = datetime.timedelta(seconds=60)
            group = dist.ProcessGroupGloo(dist.PrefixStore("fsdp", store), r, 2, options)
            results[r] = work(group)
        except Exception as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("rows", [7, 8, 1])
def test_rows_cut_as_torch_chunk_cuts_them(rows):
    tensor = torch.arange(rows * 3).reshape(rows, 3)
    cut = [shard_rows(tensor, r, 2) for r in range(2)]
    assert torch.equal(torch.cat(cut), tensor)
    assert [c.size(0) for c in cut] == [len(c) for c in torch.chunk(tensor, 2)] + \
        [0] * (2 - len(torch.chunk(tensor, 2)))


def test_a_stage_cut_gathers_whole_and_keeps_its_rows_of_the_summed_gradients():
    # built here: torch's seed is one for every thread
    models = [seeded_gpt(tiny_gpt(), seed=1, dtype=torch.float64) for _ in range(2)]
    expected = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    ids = [torch.randint(0, 64, (2, 8)) for _ in range(2)]
    grads = []
    for model, rows in zip(models, ids):
        model(rows, rows).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    def work(group):
        model = models[group.rank()]
        shards = shard_stage(group, model, (), "test stage")
        reduce_and_release(shards)
        assert all(s.param.numel() == 0 for s in shards.sharded)  # freed between steps
        kept = {s.name: s.rows.grad for s in shards.sharded}
        share = shards_of(shards, None)
        gather(shards)
        return kept, {n: p.detach().clone() for n, p in model.named_parameters()}, share

    results = _on_two_ranks(work)
    for rank, (kept, gathered, _) in enumerate(results):
        for name, value in expected.items():
            assert torch.equal(gathered[name], value), name
        for name, grad in kept.items():
            summed = grads[0][name] + grads[1][name]
            torch.testing.assert_close(grad, shard_rows(summed, rank, 2), rtol=0, atol=1e-15)
    params, _ = full_stage_state([results[1][2], results[0][2]])
    for name, value in expected.items():
        assert torch.equal(params[name], value), name


def test_a_stage_with_nothing_to_shard_is_refused_in_one_line():
    """One parameter of a single row: no replica but the first would hold any of it."""
    def work(group):
        stage = torch.nn.Module()
        stage.scale = torch.nn.Parameter(torch.ones(1, 4))
        with pytest.raises(StageError) as raised:
            shard_stage(group, stage, (), "model 'tiny' stage 1")
        return str(raised.value)

    message = _on_two_ranks(work)[0]
    assert "no parameter to shard" in message and "shard='fsdp'" in message
    assert "\n" not in message


def test_shares_of_missing_ranks_are_refused():
    share = {"rank": 1, "size": 2, "params": {}, "optimizer": {}, "whole": []}
    with pytest.raises(ValueError, match="every rank's share"):
        full_stage_state([share])


@pytest.mark.parametrize(("settings", "says"), [
    ({"shard": "zero3"}, "shard must be one of fsdp"),
    ({"shard": "fsdp", "shard_optimizer": True}, "leave shard_optimizer"),
])
def test_model_sharding_that_cannot_work_is_refused(settings, says):
    with pytest.raises(ValueError, match=says):
        Model(name="m", build="executors.torch.models.gpt:GPT", replicas=2, **settings)


def test_rows_that_do_not_divide_evenly_gather_and_reduce_exactly():
    """A 5 × 3 weight and a bias of 5 over 2 ranks: 3 rows and 2, the short chunk padded."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 5, dtype=torch.float64) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    expected = {n: p.detach().clone() for n, p in layers[0].named_parameters()}
    for rank, layer in enumerate(layers):
        layer(torch.full((4, 3), float(rank + 1), dtype=torch.float64)).pow(2).sum().backward()
    summed = {n: layers[0].get_parameter(n).grad + layers[1].get_parameter(n).grad
              for n in expected}

    def work(group):
        shards = shard_stage(group, layers[group.rank()], (), "test stage")
        reduce_and_release(shards)
        kept = {s.name: s.rows.grad for s in shards.sharded}
        gather(shards)
        return kept, {n: p.detach().clone() for n, p in layers[group.rank()].named_parameters()}

    for rank, (kept, gathered) in enumerate(_on_two_ranks(work)):
        assert {n: g.size(0) for n, g in kept.items()} == {"weight": 3 - rank, "bias": 3 - rank}
        for name, grad in kept.items():
            assert torch.equal(grad, shard_rows(summed[name], rank, 2)), name
        for name, value in expected.items():
            assert torch.equal(gathered[name], value), name


def test_a_checkpoints_fsdp_rows_join_only_when_they_tile_the_parameter():
    """[Note: FSDP checkpoints] in executors/torch/fsdp_rows.py: rows by their first row, in
    any order, join into the parameter; a gap or an overlap is refused, as is a name whose
    rows are not a number; a scalar state (AdamW's step) is one replica's."""
    from executors.torch.errors import StageError
    from executors.torch.fsdp_rows import joined_rows, split_rows_name

    whole = torch.arange(15.0).reshape(5, 3)
    assert torch.equal(joined_rows("w", {3: whole[3:], 0: whole[:3]}), whole)
    assert joined_rows("step", {0: torch.tensor(4.0), 3: torch.tensor(4.0)}).item() == 4.0
    for pieces in ({0: whole[:2], 3: whole[3:]}, {0: whole[:3], 2: whole[2:]}):
        with pytest.raises(StageError, match="do not tile it"):
            joined_rows("w", pieces)
    assert split_rows_name("h.0.w@rows=3") == ("h.0.w", 3)
    assert split_rows_name("h.0.w") == ("h.0.w", None)
    with pytest.raises(StageError, match="differ in shape or dtype"):
        joined_rows("w", {0: whole[:3], 3: whole[3:, :2]})
    with pytest.raises(StageError, match="rows must start at a row number"):
        split_rows_name("h.0.w@rows=x")
