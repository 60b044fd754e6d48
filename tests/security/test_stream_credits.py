"""Credit-based flow control [Note: stream credits in flowkit/runtime/credits.py]: a fast
streaming producer runs at most `window` items ahead of a slow consumer on another executor,
where without a window it runs away; the stream's result is the same either way."""

import pytest

from flowkit.runtime.controller import Controller
from tests.harness import executor_cluster

COUNT, CONSUMER_S = 120, 0.02


def _slow(ctl: Controller, part, executor: int, index: int):
    return ctl.submit("identity", part, config={"seconds": CONSUMER_S}, executor=executor)


def _stream_into_slow_consumer(window, consume=_slow):
    """(most items the producer was ahead of the finished consumers, the stream's result)."""
    with executor_cluster(2) as (ctl, (producer, consumer)):
        consumed, ahead = [], []

        def on_part(part):  # runs on the IO thread as each item arrives
            ahead.append(len(consumed) + 1 - sum(f.done() for f in consumed))
            consumed.append(consume(ctl, part, consumer.id, len(consumed)))

        stream = ctl.submit("countdown", config={"count": COUNT}, executor=producer.id,
                            on_part=on_part, window=window)
        result = stream.result(timeout=60)
        assert sorted(f.result(timeout=60) for f in consumed) == list(range(COUNT))
        return max(ahead), result


def test_a_window_holds_a_fast_producer_to_a_slow_consumer():
    most_ahead, result = _stream_into_slow_consumer(window=4)
    assert result == list(range(COUNT))
    assert most_ahead <= 4


def test_without_a_window_the_producer_runs_away(tmp_path):
    """No consumer can finish before the last item is out (they wait on a gate that its
    arrival opens), so the producer must run all the way ahead: a window would deadlock here."""
    gate = tmp_path / "gate"

    def gated(ctl, part, executor, index):
        if index == COUNT - 1:
            gate.touch()
        return ctl.submit("python", part, executor=executor, config={
            "target": "tests.security.gate_ops:after_gate", "config": {"gate": str(gate)}})

    most_ahead, result = _stream_into_slow_consumer(window=None, consume=gated)
    assert result == list(range(COUNT))
    assert most_ahead == COUNT


@pytest.mark.parametrize("window", [0, -1, 1 << 40])
def test_a_window_out_of_range_or_without_a_stream_is_refused_before_anything_runs(window):
    with executor_cluster(1) as (ctl, _):
        with pytest.raises(ValueError, match="window"):
            ctl.submit("countdown", on_part=print, window=window)
        with pytest.raises(ValueError, match="needs on_part"):
            ctl.submit("countdown", window=4)
