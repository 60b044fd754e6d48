"""@op functions that the stream-credit tests run on executors (by import path, as flows do)."""

from flowkit.dsl import op


@op
def after_gate(x: int, gate: str) -> int:
    """`x` once the file `gate` exists: consumers that cannot finish until the test opens it."""
    import os
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.005)
    return x
