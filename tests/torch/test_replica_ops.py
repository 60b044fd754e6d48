"""The executor side of replicas, in one process: who owns which parameter's optimizer states,
AdamW states saved by name filling the shards of another count, and a store address that is
not one."""

from __future__ import annotations

import pytest
import torch

from executors.torch.errors import StageError
from executors.torch.layout_free import fill_optimizer
from executors.torch.train.pipeline_ops import new_optimizer, trainable
from executors.torch.train.replicas import _replica_group, owned
from tests.harness import op_context, seeded_gpt, tiny_gpt


def _stepped_model():
    model = seeded_gpt(tiny_gpt(), seed=1, dtype=torch.float64)
    optimizer = new_optimizer(model, lr=1e-2)
    model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))).backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_every_parameter_has_one_owner_and_the_shares_are_balanced(size):
    params = trainable(seeded_gpt(tiny_gpt()))
    shards = [owned(params, rank, size) for rank in range(size)]
    assert sorted(id(p) for shard in shards for p in shard) == sorted(id(p) for p in params)
    sizes = [sum(p.numel() for p in shard) for shard in shards]
    assert max(sizes) - min(sizes) <= max(p.numel() for p in params)


def _by_name(model, optimizer) -> dict:
    """A resumed model's states as a checkpoint keeps them: by parameter name [Note:
    layout-free checkpoints in executors/torch/layout_free.py]."""
    states = {name: dict(optimizer.state[p]) for name, p in model.named_parameters()}
    return {"states": states, "hyper": {"decay": {"lr": 0.5}}}


def test_states_saved_by_name_fill_each_shard_of_another_count_the_same():
    model, optimizer = _stepped_model()
    params = trainable(model)
    for size in (1, 3):
        for rank in range(size):
            again = new_optimizer(model, shard=(rank, size), lr=1e-2)
            fill_optimizer(again, model, _by_name(model, optimizer))
            assert len(again.state) == len(owned(params, rank, size))
            for param in owned(params, rank, size):
                for key, value in optimizer.state[param].items():
                    assert torch.equal(again.state[param][key], value), key
            # the saved hyperparameters win, as a loaded state dict's do
            assert [g["lr"] for g in again.param_groups if g["params"][0].dim() >= 2] == [0.5]


def test_a_saved_state_of_another_shape_is_refused():
    model, optimizer = _stepped_model()
    resumed = _by_name(model, optimizer)
    name = next(iter(resumed["states"]))
    resumed["states"][name]["exp_avg"] = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(StageError, match=r"exp_avg' of parameter .* is \(3,\)"):
        fill_optimizer(new_optimizer(model), model, resumed)


@pytest.mark.parametrize("address", [None, {"host": "127.0.0.1"}, {"host": "h", "port": "80"},
                                     {"host": "", "port": 80}, {"host": "h" * 300, "port": 80},
                                     {"host": "h", "port": 70_000}])
def test_a_store_address_that_is_not_one_is_refused(address):
    with pytest.raises(StageError, match="expected the store's address"):
        _replica_group(op_context(), address, group="g", rank=1, size=2)


def _listening(port: int) -> list[str]:
    """The local addresses a TCP socket listens on at `port` (IPv4 and IPv6, from /proc)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_the_replica_store_listens_on_the_executors_peer_host_only(pool):
    """[finding 4 of issue 53] A data-parallel run's TCPStore listened on every interface
    (`*:PORT`); it binds to the host it is given, the executor's peer host: loopback here."""
    ctl, (first, second) = pool.cluster(2, kind="torch")
    store = ctl.submit("replica_store", config={"group": "listen-test", "size": 2,
                                                "host": "127.0.0.1"}, executor=first.id)
    address = store.result(timeout=60)
    assert address["host"] == "127.0.0.1"
    assert _listening(address["port"]) == ["0100007F"]  # 127.0.0.1, and nothing else
    joined = [ctl.submit("replica_group", store, config={"group": "listen-test", "rank": rank,
                                                         "size": 2}, executor=member.id)
              for rank, member in enumerate((first, second))]
    assert [f.result(timeout=60) for f in joined] == [0, 1]
