"""The futures' callbacks are drained outside the IO lock, by whichever threads finish a call:
several threads draining at once must run each callback exactly once and never fail."""

import threading
import time
from collections import deque

from tests.harness import bare_dispatcher


class _SlowToAnswerDeque(deque):
    """Widens the window between "is anything left?" and taking it, which the GIL otherwise
    opens only rarely (CI hit it once: the controller's IO thread died of an IndexError)."""

    def __bool__(self) -> bool:
        nonempty = len(self) > 0
        time.sleep(0.001)  # another drainer runs here
        return nonempty


def test_threads_draining_at_once_run_each_callback_once():
    state = bare_dispatcher(())
    state._callbacks = _SlowToAnswerDeque()
    ran: list[int] = []
    errors: list[BaseException] = []
    rounds, threads = 20, 3
    start = threading.Barrier(threads + 1)
    finish = threading.Barrier(threads + 1)

    def drain() -> None:
        for _ in range(rounds):
            start.wait()
            try:
                state.run_callbacks()
            except Exception as error:  # noqa: BLE001 - the failure under test
                errors.append(error)
            finish.wait()

    drainers = [threading.Thread(target=drain) for _ in range(threads)]
    for thread in drainers:
        thread.start()
    for round_ in range(rounds):
        state._callbacks.append((lambda future, i=round_: ran.append(i), None))
        start.wait()
        finish.wait()
    for thread in drainers:
        thread.join()
    assert errors == []
    assert sorted(ran) == list(range(rounds))
