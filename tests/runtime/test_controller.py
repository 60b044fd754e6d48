"""The controller with real executor processes: futures, data movement, failures, liveness."""

import os
import signal
import threading
import time

import pytest

from flowkit.runtime import (
    FIRST_COMPLETED,
    ExecutorLost,
    NoExecutor,
    RemoteError,
    TaskCancelled,
    wait,
)
from flowkit.wire.protocol import Msg, encode
from flowkit.wire.refs import Gather, Item
from tests.harness import dealer, executor_cluster


def test_result_of_a_task_and_of_a_put(cluster):
    ctl, _ = cluster
    assert ctl.submit("noop").result(timeout=5) is None
    assert ctl.put({"a": [1, 2]}).result(timeout=5) == {"a": [1, 2]}


def test_objects_move_executor_to_executor(cluster):
    ctl, (first, second) = cluster
    data = ctl.put(list(range(1000)), executor=first.id)
    copied = ctl.submit("identity", data, executor=second.id)
    assert copied.result(timeout=5) == list(range(1000))
    assert copied.location == second.id


def test_tags_choose_the_executor(cluster):
    ctl, (rollout, train) = cluster
    assert ctl.submit("identity", 1, tags=["train"]).result(timeout=5) == 1
    future = ctl.submit("identity", 2, tags=["train"])
    future.result(timeout=5)
    assert future.location == train.id


def test_no_executor_for_the_op_fails_the_future_with_what_is_connected(cluster):
    ctl, _ = cluster
    with pytest.raises(NoExecutor, match="no executor runs op 'generate'.*exec-0"):
        ctl.submit("generate").result(timeout=5)
    with pytest.raises(NoExecutor, match="tags \\['gpu'\\]"):
        ctl.submit("noop", tags=["gpu"]).result(timeout=5)


def test_a_task_reading_a_future_no_executor_could_make_is_cancelled_with_why(cluster):
    """As when the pipeline goes on submitting to an executor just lost: the first action fails
    with NoExecutor, and each one reading it is cancelled naming that, not refused as unknown."""
    ctl, _ = cluster
    never = ctl.submit("generate")
    for reader in (never, Item(never, 0), Gather([ctl.put(1), Item(never, 1)])):
        with pytest.raises(TaskCancelled, match="an input failed: no executor runs op 'gen"):
            ctl.submit("identity", "a value placed first", reader).result(timeout=5)
    assert ctl.submit("identity", 3).result(timeout=5) == 3


def test_callbacks_and_wait(cluster):
    ctl, _ = cluster
    seen = []
    done_event = threading.Event()
    future = ctl.submit("sleep", config={"seconds": 0.05})
    future.add_done_callback(lambda f: (seen.append(f.id), done_event.set()))
    assert done_event.wait(5) and seen == [future.id]
    late = []
    future.add_done_callback(lambda f: late.append(f.id))  # already done: runs at once
    assert late == [future.id]
    slow = ctl.submit("sleep", config={"seconds": 2.0})
    fast = ctl.submit("noop")
    done, not_done = wait([slow, fast], timeout=5, return_when=FIRST_COMPLETED)
    assert fast in done and slow in not_done
    with pytest.raises(TimeoutError):
        slow.result(timeout=0.05)


def test_answers_are_read_while_a_user_thread_keeps_the_controller_busy(cluster):
    """[Note: overdue pumps] A user thread that calls the controller without a pause (a runner
    submitting a step's thousands of calls) must not hold back the answers that come
    meanwhile: the background thread reads them within a few milliseconds, so a callback
    runs while the user thread is still busy, not once it stops."""
    ctl, _ = cluster
    answered = threading.Event()
    ctl.submit("noop").add_done_callback(lambda _: answered.set())

    def listener(event, payload):
        pass

    deadline = time.monotonic() + 10
    while not answered.is_set() and time.monotonic() < deadline:
        ctl.add_listener(listener)  # a call that takes the IO lock, and nothing else
        ctl.remove_listener(listener)
    assert answered.is_set(), "the answer waited for the busy user thread to stop"


def test_many_in_flight_all_resolve(cluster):
    ctl, _ = cluster
    futures = [ctl.submit("identity", i) for i in range(2000)]
    done, not_done = wait(futures, timeout=30)
    assert not not_done
    assert [f.result() for f in futures[:5]] == [0, 1, 2, 3, 4]


def test_an_op_error_carries_the_remote_traceback_and_fails_downstream(cluster):
    ctl, (first, second) = cluster
    bad = ctl.submit("fail", config={"message": "kaboom"}, executor=first.id)
    child = ctl.submit("identity", bad, executor=second.id)
    grandchild = ctl.submit("identity", child)
    with pytest.raises(RemoteError) as raised:
        bad.result(timeout=5)
    assert "kaboom" in str(raised.value) and "Traceback" in raised.value.remote_traceback
    assert "executors/optable.py" in raised.value.remote_traceback
    for future in (child, grandchild):
        with pytest.raises(TaskCancelled, match="kaboom"):
            future.result(timeout=5)
    # a task submitted after the failure is known fails at once, too
    with pytest.raises(TaskCancelled):
        ctl.submit("identity", bad).result(timeout=5)
    assert ctl.submit("identity", 7).result(timeout=5) == 7  # and the executors keep serving


def test_unknown_op_named_directly_fails_clearly(cluster):
    ctl, (first, _) = cluster
    with pytest.raises(NoExecutor, match="does not run op 'rm_rf'"):
        ctl.submit("rm_rf", executor=first.id).result(timeout=5)


def test_a_killed_executor_fails_its_futures_within_two_seconds(start_cluster):
    ctl, (first, second) = start_cluster(2)
    doomed = ctl.submit("sleep", config={"seconds": 30}, executor=first.id)
    downstream = ctl.submit("identity", doomed, executor=second.id)
    time.sleep(0.2)
    start = time.monotonic()
    os.kill(first.pid, signal.SIGKILL)
    with pytest.raises(ExecutorLost, match="exec-0.*was lost"):
        doomed.result(timeout=5)
    assert time.monotonic() - start < 2.0
    with pytest.raises(RemoteError):
        downstream.result(timeout=5)
    assert ctl.submit("identity", 3).result(timeout=5) == 3  # the survivor serves on
    assert [e.name for e in ctl.executors()] == ["exec-1"]


def test_a_hung_executor_is_noticed_by_heartbeat(start_cluster):
    ctl, (only,) = start_cluster(1, ping_interval=0.1, ping_timeout=0.8)
    ctl._processes.clear()  # rely on heartbeats alone, as for a remote executor
    future = ctl.submit("sleep", config={"seconds": 30})
    time.sleep(0.2)
    os.kill(only.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ExecutorLost, match="no heartbeat"):
        future.result(timeout=5)
    assert time.monotonic() - start < 2.0
    os.kill(only.pid, signal.SIGKILL)  # stopped, it would not exit when told to


def test_controller_rejects_garbage_and_unknown_types_silently_and_keeps_serving(cluster):
    """A client past the gate that said no valid HELLO hears nothing back, its messages
    counted [Note: refusals in flowkit/wire/refusals.py]."""
    ctl, _ = cluster
    refused = ctl._dispatcher.refusals.count
    client = dealer(ctl.address, secret=ctl.secret)
    client.send_multipart([b"not msgpack at all"])
    client.send_multipart(encode(Msg.DONE, {"items": []}))
    assert not client.poll(500)
    client.close()
    assert ctl.submit("noop").result(timeout=5) is None
    assert ctl._dispatcher.refusals.count == refused + 2


def test_a_fetch_asks_the_producer_not_an_executor_the_object_is_still_on_its_way_to(cluster):
    """A consumer routed to a busy executor makes it a holder before the push arrives; a fetch
    meanwhile must still find the value (on its producer)."""
    ctl, started = cluster
    first, second = sorted(started, key=lambda e: e.id)  # the holders' lowest id is asked
    value = list(range(50_000))  # fetched, not carried in the completion message
    busy = ctl.submit("sleep", config={"seconds": 1.0}, executor=first.id)
    made = ctl.submit("identity", ctl.put(value, executor=second.id), executor=second.id)
    wait([made], timeout=5)
    copy = ctl.submit("identity", made, executor=first.id)  # queued behind the sleep
    assert made.result(timeout=5) == value
    assert copy.result(timeout=5) == value and busy.result(timeout=5) is None


def test_a_ctrl_c_while_a_user_call_waits_for_the_io_lock_leaves_the_controller_usable():
    """A KeyboardInterrupt can land anywhere in the main thread: while a call waits for the IO
    lock, or just after it took it. Either way the controller still drives the calls after it
    (what `flowkit run` makes to write the weights and stop the executors)."""
    with executor_cluster(1) as (ctl, _):
        held, release = threading.Event(), threading.Event()

        def hold_the_lock():
            with ctl._driving():
                held.set()
                release.wait(5)

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        held.wait(5)
        wake = ctl._wake
        ctl._wake = lambda: (_ for _ in ()).throw(KeyboardInterrupt)  # Ctrl-C while waiting
        try:
            with pytest.raises(KeyboardInterrupt):
                ctl.submit("noop")
        finally:
            ctl._wake = wake
            release.set()
            holder.join(5)
        assert ctl._wanted == 0  # the background thread drives again
        assert ctl.submit("identity", 3).result(timeout=10) == 3
        # Ctrl-C just after the lock was taken: it stays with this thread, which drives on
        ctl._io_lock.acquire()
        assert ctl.submit("identity", 4).result(timeout=10) == 4
        ctl._io_lock.release()
        assert ctl.submit("identity", 5).result(timeout=10) == 5
