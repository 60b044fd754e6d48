"""@op functions that the batched-task tests run on executors (by import path, as flows do)."""

from flowkit.dsl import op


@op
def add(x: int, y: int) -> int:
    return x + y


@op
def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is not allowed")
    return x


@op
def slow_on_last(x: int) -> int:
    """Item 3 takes a while: the items before it are answered early."""
    if x == 3:
        import time

        time.sleep(0.5)
    return x
