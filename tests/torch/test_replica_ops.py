"""The executor side of replicas, in one process: who owns which parameter's optimizer states,
re-cutting AdamW states between shard counts, and a store address that is not one."""

from __future__ import annotations

import pytest
import torch

from executors.torch.errors import StageError
from executors.torch.train.pipeline_ops import new_optimizer, trainable
from executors.torch.train.replicas import _replica_group, owned
from executors.torch.train.reshard import recut
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


def test_states_cut_into_shards_and_merged_again_are_the_same():
    model, optimizer = _stepped_model()
    params = trainable(model)
    whole = optimizer.state_dict()
    shards = []
    for rank in range(3):
        fresh = new_optimizer(model, shard=(rank, 3)).state_dict()
        shards.append(((rank, 3), recut(params, [(None, whole)], (rank, 3), fresh)))
        assert len(shards[-1][1]["state"]) == len(owned(params, rank, 3))
    merged = recut(params, shards, None, new_optimizer(model).state_dict())
    again = new_optimizer(model)
    again.load_state_dict(merged)
    for param in params:
        for key, value in optimizer.state[param].items():
            assert torch.equal(again.state[param][key], value), key
    assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in optimizer.param_groups]


def test_a_saved_shard_naming_a_parameter_it_does_not_have_is_refused():
    model, optimizer = _stepped_model()
    bad = optimizer.state_dict()
    bad["param_groups"][0]["params"].append(10_000)
    with pytest.raises(StageError, match="numbers parameter 10000"):
        recut(trainable(model), [(None, bad)], None, new_optimizer(model).state_dict())


@pytest.mark.parametrize("address", [None, {"host": "127.0.0.1"}, {"host": "h", "port": "80"},
                                     {"host": "", "port": 80}, {"host": "h" * 300, "port": 80},
                                     {"host": "h", "port": 70_000}])
def test_a_store_address_that_is_not_one_is_refused(address):
    with pytest.raises(StageError, match="expected the store's address"):
        _replica_group(op_context(), address, group="g", rank=1, size=2)


@pytest.mark.parametrize("damage", [{"param_groups": 3}, {"state": []},
                                    {"param_groups": [{"lr": 1.0}]}])
def test_a_saved_shard_that_is_not_an_adamw_state_is_refused(damage):
    model, optimizer = _stepped_model()
    bad = {**optimizer.state_dict(), **damage}
    with pytest.raises(StageError, match="not an AdamW state dict"):
        recut(trainable(model), [(None, bad)], None, new_optimizer(model).state_dict())


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
