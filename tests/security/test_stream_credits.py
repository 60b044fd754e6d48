"""Credit-based flow control [Note: stream credits in flowkit/runtime/credits.py]: a fast
streaming producer runs at most `window` items ahead of a slow consumer on another executor,
where without a window it runs away; the stream's result is the same either way."""

import time

import pytest

from tests.harness import executor_cluster

COUNT, CONSUMER_S = 120, 0.02


def _handed_all(consumed: list, count: int, timeout: float = 10.0) -> None:
    """Wait until on_part has run for every item: the IO thread runs the callbacks after it
    handled the message, so the stream's result may wake its waiter before the last one ran
    (CI saw 39 of 40)."""
    deadline = time.monotonic() + timeout
    while len(consumed) < count and time.monotonic() < deadline:
        time.sleep(0.001)


def _stream_into_slow_consumer(window, *, count=COUNT, part_s=0.0):
    """(most items the producer was ahead of the finished consumers, the stream's result).
    A consumer counts as finished when the controller's books say so (its task_done event,
    emitted where its item is credited), not when its future is: futures resolve in callbacks
    that any thread may run, and one may still be pending when a later item's on_part runs."""
    with executor_cluster(2) as (ctl, (producer, consumer)):
        consumed, ahead, finished = [], [], []

        def on_event(event, payload):  # under the controller's IO lock
            if event == "task_done" and payload["executor"].id == consumer.id:
                finished.append(payload["task"].id)

        def on_part(part):  # runs on a thread that drives IO, as each item arrives
            time.sleep(part_s)  # a caller slow to submit the item's consumer
            ahead.append(len(consumed) + 1 - len(finished))
            consumed.append(ctl.submit("identity", part, config={"seconds": CONSUMER_S},
                                       executor=consumer.id))

        ctl.add_listener(on_event)

        stream = ctl.submit("countdown", config={"count": count}, executor=producer.id,
                            on_part=on_part, window=window)
        result = stream.result(timeout=60)
        _handed_all(consumed, count)
        assert sorted(f.result(timeout=60) for f in consumed) == list(range(count))
        return max(ahead), result


def test_a_window_holds_a_fast_producer_to_a_slow_consumer():
    most_ahead, result = _stream_into_slow_consumer(window=4)
    assert result == list(range(COUNT))
    assert most_ahead <= 4


def test_a_caller_slow_in_on_part_still_holds_the_producer_to_its_window():
    """An item is credited once its on_part has run: the check comes in the same callback, as
    several threads may drain the callbacks at once (one beside an on_part still to submit its
    consumer found none and credited the item: 17 ahead with a window of 4)."""
    most_ahead, result = _stream_into_slow_consumer(window=4, count=40, part_s=0.02)
    assert result == list(range(40))
    assert most_ahead <= 4


def test_without_a_window_the_producer_runs_away():
    """The stream ends while most of its slow consumers have yet to finish: nothing holds the
    producer back. With a window of 4 it could end only once all but 4 had. (Counted at the
    stream's end, not timed: a loaded machine once paced the items' arrivals.)"""
    count = 40
    with executor_cluster(2) as (ctl, (producer, consumer)):
        consumed = []

        def on_part(part):
            consumed.append(ctl.submit("identity", part, config={"seconds": 2.0},
                                       executor=consumer.id))

        stream = ctl.submit("countdown", config={"count": count}, executor=producer.id,
                            on_part=on_part)
        assert stream.result(timeout=60) == list(range(count))  # its parts came before its end
        _handed_all(consumed, count)
        finished = sum(f.done() for f in consumed)
        assert len(consumed) == count
    assert finished < count - 4


@pytest.mark.parametrize("window", [0, -1, 1 << 40])
def test_a_window_out_of_range_or_without_a_stream_is_refused_before_anything_runs(window):
    with executor_cluster(1) as (ctl, _):
        with pytest.raises(ValueError, match="window"):
            ctl.submit("countdown", on_part=print, window=window)
        with pytest.raises(ValueError, match="needs on_part"):
            ctl.submit("countdown", window=4)
