"""Items of list objects, gathered inputs, reported keys and in-order lanes, on real executors."""

import pytest

from flowkit.runtime import Gather, Item, RemoteError, wait
from flowkit.wire.protocol import ProtocolError
from flowkit.wire.refs import check_ref, object_ids, resolve


def test_wire_refs_resolve_and_name_their_objects():
    objects = {1: [10, 20, 30], 2: "x"}
    ref = {"gather": [[1, 2], 2, {"gather": [[1, 0]]}]}
    assert resolve(ref, objects) == [30, "x", [10]]
    assert list(object_ids(ref)) == [1, 2, 1]
    with pytest.raises(IndexError, match="item 5 of object 1"):
        resolve([1, 5], objects)


@pytest.mark.parametrize("bad", [[1], [1, "a"], {"gather": 3}, "7", 1.5,
                                 {"gather": [{"gather": [{"gather": [
                                     {"gather": [{"gather": []}]}]}]}]}])
def test_malformed_wire_refs_are_protocol_errors(bad):
    with pytest.raises(ProtocolError):
        check_ref(bad)


def test_items_and_gathers_move_between_executors(cluster):
    ctl, (first, second) = cluster
    items = ctl.put([{"k": 1}, {"k": 2}, {"k": 3}], executor=first.id)
    one = ctl.submit("identity", Item(items, 1), executor=second.id)
    assert one.result(timeout=5) == {"k": 2}
    group = ctl.submit("identity", Gather([Item(items, 2), Item(items, 0), 7]),
                       executor=second.id)
    assert group.result(timeout=5) == [{"k": 3}, {"k": 1}, 7]


def test_list_outputs_report_their_length_and_keys(cluster):
    ctl, _ = cluster
    source = ctl.put([{"prompt_id": 4}, {"prompt_id": 9}])
    copied = ctl.submit("identity", source, report_key="prompt_id")
    copied.result(timeout=5)
    assert copied.count == 2 and copied.keys == [4, 9]


def test_an_item_out_of_range_fails_the_task_not_the_executor(cluster):
    ctl, (first, _) = cluster
    items = ctl.put([1, 2], executor=first.id)
    with pytest.raises(RemoteError, match="item 5"):
        ctl.submit("identity", Item(items, 5), executor=first.id).result(timeout=5)
    assert ctl.submit("identity", Item(items, 1), executor=first.id).result(timeout=5) == 2


def test_a_lane_runs_in_submission_order_even_when_later_inputs_arrive_first(cluster):
    ctl, (first, second) = cluster
    slow = ctl.submit("sleep", config={"seconds": 0.3}, executor=first.id)
    # the first task of the lane waits for `slow`; the second is ready at once but must wait
    a = ctl.submit("clock", slow, executor=second.id, lane="device-1")
    b = ctl.submit("clock", executor=second.id, lane="device-1")
    free = ctl.submit("clock", executor=second.id)  # not in the lane: runs at once
    wait([a, b, free], timeout=5)
    assert free.result() < a.result() <= b.result()


def test_a_failed_task_does_not_block_its_lane(cluster):
    ctl, (first, _) = cluster
    bad = ctl.submit("fail", executor=first.id, lane="l")
    after = ctl.submit("identity", 5, executor=first.id, lane="l")
    assert after.result(timeout=5) == 5
    assert bad.exception(timeout=5) is not None


def test_a_cancelled_task_does_not_block_its_lane(cluster):
    ctl, (first, second) = cluster
    bad = ctl.submit("fail", executor=first.id)
    cancelled = ctl.submit("identity", bad, executor=second.id, lane="l")
    after = ctl.submit("identity", 6, executor=second.id, lane="l")
    assert after.result(timeout=5) == 6
    assert cancelled.exception(timeout=5) is not None


def test_cancelling_what_is_pending_frees_a_lane_held_by_an_input_that_will_not_come(cluster):
    """What a failed run leaves on a shared controller (Run's exit, the suite's pool): a task
    in a lane waiting for an input still being made holds the lane's next task; cancelled,
    both fail, naming why, and the lane serves again at once."""
    ctl, (first, second) = cluster
    endless = ctl.submit("countdown", config={"count": 10_000, "seconds": 0.05},
                         executor=first.id)
    held = ctl.submit("identity", endless, executor=second.id, lane="held")
    assert ctl.cancel_pending("the run ended") == 2
    for future in (endless, held):
        assert "the run ended" in str(future.exception(timeout=5))
    assert ctl.submit("identity", 7, executor=second.id, lane="held").result(timeout=5) == 7
    assert ctl.submit("identity", 8, executor=first.id).result(timeout=5) == 8
