"""What the controller knows about executors, tasks and objects. Owned by its IO thread."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["ExecutorInfo", "ObjectRecord", "TaskRecord"]


@attrs.define(eq=False)
class ExecutorInfo:
    id: int
    name: str
    tags: tuple[str, ...]
    ops: frozenset[str]
    pid: int
    host: str
    device: str
    peer_address: str
    identity: bytes = attrs.field(repr=False)
    resources: dict[str, Any] = attrs.field(factory=dict)
    host_id: str = ""  # which executors share memory [Note: hosts] in flowkit/wire/shm.py
    last_seen: float = 0.0
    alive: bool = True
    outstanding: int = 0  # tasks sent and not yet completed
    # their expected seconds [Note: placement by load in flowkit/runtime/dispatch.py]
    expected_s: float = 0.0
    # task id -> when it was submitted (monotonic), oldest first: who may be stuck in a long op.
    # Ordered, not a dict: tasks leave from the front, and a dict walks every entry removed
    # from its front to find its first until it resizes (1.5 us a look with 20k in flight).
    inflight: OrderedDict[int, float] = attrs.field(factory=OrderedDict, repr=False)
    completed: int = 0
    busy_s: float = 0.0  # summed op time, for utilization
    bytes_out: int = 0  # bytes of objects it produced
    lost_reason: str = ""
    ping_token: str = attrs.field(default="", repr=False)  # what its pings carry (WELCOME)
    # {id}: the holders of most objects, made once rather than once an object
    alone: frozenset[int] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.alone = frozenset((self.id,))

    def runs(self, op: str, tags: frozenset[str]) -> bool:
        return self.alive and op in self.ops and (not tags or tags.issubset(self.tags))

    def describe(self) -> str:
        return f"{self.name} (id {self.id}, pid {self.pid}, tags {','.join(self.tags) or '-'})"


@attrs.define(eq=False)
class TaskRecord:
    id: int
    op: str
    executor: int
    inputs: Sequence[int]
    outputs: Sequence[int]
    config: dict[str, Any]
    meta: dict[str, Any]  # stage, microbatch, ... for traces; never sent to the executor
    state: str = "pending"  # pending | done | failed
    start: float = 0.0  # wall-clock seconds (time.time()) on the executor, set on completion
    end: float = 0.0
    nbytes_out: int = 0  # bytes of the outputs it produced
    on_part: Any = None  # streaming: called with each item's future as the task yields it
    parts: int = 0  # items streamed so far
    items: int | None = None  # a batched task: how many items [Note: batched tasks]
    on_items: Any = None  # a batched task: called with (first, count) of its early items
    answered: int = 0  # a batched task: outputs answered before it completed
    window: int | None = None  # streaming: items it may run ahead [Note: stream credits]
    credited: int = 0  # streaming with a window: items credited back to it
    handled_by_caller: bool = False  # its items count as handled when the caller says so
    kind: tuple = ()  # (op, node), what its span teaches; () a stream's (it teaches none)
    expect: float = 0.0  # the seconds its executor's expected_s counts for it


@attrs.define(eq=False)
class ObjectRecord:
    id: int
    location: int  # the executor that produces (or produced) it
    producer: int | None = None  # task id; None for objects put by the user
    produced: bool = False
    # empty until needed: each set or list an object carries is one more for the cycle collector
    holders: frozenset[int] = frozenset()  # executors holding (or about to) a copy
    consumers: list[int] | tuple[()] = ()  # tasks that read it
    pending: int = 0  # consumers not yet finished
    user_released: bool = False  # the user's Future was garbage-collected
    error: BaseException | None = None
    nbytes: int = 0
    credit_of: int = 0  # a windowed stream's item: the task its consumers' end credits
