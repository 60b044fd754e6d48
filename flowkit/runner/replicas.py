"""Data parallel × pipeline parallel: a model trained by D replicas of its P-device pipeline.

[Note: replicas] A model with `replicas=D` is placed on D × P executors, replica r on
executors[r*P:(r+1)*P]; no executor holds two replicas of one stage. A step's microbatches are
numbered once, globally, as the backprop forms them, and microbatch g runs on replica g % D as
its microbatch g // D, so the first to form start every replica at once. Each replica runs the
schedule built for its own count, in lanes of its own; a mean loss is scaled by its
microbatch's share of the global batch, so the replicas' gradients add up to the global batch's.
After a device's last action of the step its lane runs `reduce_grads` per stage, summing over
the replica group through torch.distributed [Note: replica groups in
executors/torch/train/replicas.py], never the controller, and waiting for every replica's last
action of the stage (the simulator sleeps SimCosts.allreduce_s then; flowkit/planner/replicas.py
times it); the stage's last W started its buckets already where it could (`early_reduce`).
Every replica clips by the same global norm and takes the same AdamW step, so they stay equal;
replica 0 stands for the model. In full: docs/training.md, "Data parallel × pipeline parallel".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flowkit.dsl import Model
from flowkit.planner import Action, Kind, Schedule
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.pipeline import PipelineRun, StreamedSchedule, device_lane
from flowkit.runtime.controller import Controller
from flowkit.runtime.futures import Future
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["ReplicatedSchedule", "Replicas", "agreed_devices", "finish_order", "last_actions",
           "reduce_orders", "replica_counts", "replica_lane", "setup_replica_groups",
           "state_sources", "store_host"]

_GROUP_IDS = itertools.count()
_WEIGHTS = (Kind.W, Kind.BW)  # the ops that make a stage's weight gradients final


def replica_counts(microbatches: int, replicas: int) -> list[int]:
    """How many of a step's `microbatches` each replica runs: global microbatch g on replica
    g % replicas."""
    return [len(range(r, microbatches, replicas)) for r in range(replicas)]


def replica_lane(model: str, replica: int) -> str:
    """The lane prefix of a replica's tasks: replica 0's is the model's own, as without
    replicas; a device's lane is this plus '/device'."""
    return model if replica == 0 else f"{model}@{replica}"


class ReplicatedSchedule:
    """One StreamedSchedule per replica, fed by global microbatch index [Note: replicas]."""

    def __init__(self, submitters: Sequence[StreamedSchedule]) -> None:
        self.submitters = list(submitters)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.submitters)

    @property
    def runs(self) -> list[PipelineRun]:
        """Each replica's run, replica 0's first."""
        return [s.run for s in self.submitters]

    def feed(self, microbatch: int, inputs: Any) -> None:
        """Global microbatch `microbatch`'s inputs, to the replica that runs it."""
        count = len(self.submitters)
        self.submitters[microbatch % count].feed(microbatch // count, inputs)

    def advance(self) -> None:
        for submitter in self.submitters:
            submitter.advance()


def last_actions(schedule: Schedule) -> dict[int, Action]:
    """Each stage's last action in its device's order: after it, the stage's gradients are
    final."""
    last: dict[int, Action] = {}
    for ops in schedule.device_ops:
        for action in ops:
            last[action.stage] = action
    return last


def finish_order(schedule: Schedule, device: int) -> tuple[int, ...]:
    """The stages `device` holds, in the order of their last actions in the schedule."""
    ops = schedule.device_ops[device]
    return tuple(reversed(dict.fromkeys(a.stage for a in reversed(ops))))


def agreed_devices(schedules: Sequence[Schedule]) -> set[int]:
    """The devices whose stages every replica that runs on them finishes in one order (always
    where a device holds one stage): there the stages' last W can start their all-reduces over
    the device's one replica group, every replica starting the same collectives in the same
    order, and `reduce_grads` in that order on a replica with no microbatch (the optimizer
    step submits them so: flowkit/runner/training_tasks.py)."""
    found: dict[int, set[tuple[int, ...]]] = {}
    for schedule in schedules:
        for device, ops in enumerate(schedule.device_ops):
            if ops:
                found.setdefault(device, set()).add(finish_order(schedule, device))
    return {device for device, orders in found.items() if len(orders) == 1}


def reduce_orders(schedules: Sequence[Schedule]) -> dict[int, str]:
    """Each stage's gradient buckets' start order, one for every replica of the step
    [Note: all-reduce in the last W in executors/torch/train/replicas.py]: "reverse" (the last
    bucket first) where every replica's last action of the stage is a fused BW, whose backward
    pass makes the last layers' gradients first; else "forward", as the W's deferred calls
    finish them."""
    kinds: dict[int, set[Kind]] = {}
    for schedule in schedules:
        for stage, action in last_actions(schedule).items():
            kinds.setdefault(stage, set()).add(action.kind)
    return {stage: "reverse" if found == {Kind.BW} else "forward"
            for stage, found in kinds.items()}


def store_host(executor: ExecutorInfo) -> str:
    """Where a process group whose rank 0 is `executor` has its store listen: the host of its
    data socket (the address its peers already reach)."""
    return executor.peer_address.removeprefix("tcp://").rpartition(":")[0].strip("[]") \
        or "127.0.0.1"


def setup_replica_groups(ctl: Controller, executors: Sequence[ExecutorInfo], *, model: str,
                         devices: int, replicas: int,
                         watch: Callable[[Future], None]) -> list[str]:
    """Submit the process group of each device slot [Note: replica groups in
    executors/torch/train/replicas.py], in the lanes the replicas' first ops will follow; returns
    the groups' names by device. `watch` is given every future, for its failure to end the
    step."""
    names = []
    serial = next(_GROUP_IDS)
    for device in range(devices):
        name = f"{model}/{devices}x{replicas}/{device}/{serial}"
        first = executors[device]
        store = ctl.submit("replica_store", config={"group": name, "size": replicas,
                                                    "host": store_host(first)},
                           executor=first.id, lane=f"{replica_lane(model, 0)}/{device}",
                           meta={"node": "replica_groups", "device": device})
        watch(store)
        for replica in range(replicas):
            member = executors[replica * devices + device]
            watch(ctl.submit("replica_group", store,
                             config={"group": name, "rank": replica, "size": replicas},
                             executor=member.id,
                             lane=f"{replica_lane(model, replica)}/{device}",
                             meta={"node": "replica_groups", "device": device,
                                   "replica": replica}))
        names.append(name)
    return names


class Replicas:
    """A trained model's replicas [Note: replicas]: their executors, their process groups, and
    what each replica's optimizer step adds for them."""

    def __init__(self, ctl: Controller, model: Model, executors: Sequence[ExecutorInfo],
                 sim_costs: SimCosts) -> None:
        self.ctl, self.model, self.executors = ctl, model, list(executors)
        self.count = model.replicas
        self.devices = len(self.executors) // self.count  # of one replica's pipeline
        self.sim_costs = sim_costs
        self.groups: list[str] | None = None  # by device, once set up ([] on the simulator)
        self.sharding_checked = False
        self.current: list[PipelineRun] = []  # each replica's latest run: its step follows

    def of(self, replica: int) -> list[ExecutorInfo]:
        """The executors of `replica`, by device."""
        return self.executors[replica * self.devices:(replica + 1) * self.devices]

    def set_up(self, watch: Callable[[Future], None]) -> None:
        """Once, before the model's first ops, on executors that reduce through
        torch.distributed (the simulator models the all-reduce instead)."""
        if self.count == 1 or self.groups is not None:
            return
        if not all("replica_group" in e.ops for e in self.executors):
            self.groups = []
            return
        self.groups = setup_replica_groups(self.ctl, self.executors, model=self.model.name,
                                           devices=self.devices, replicas=self.count,
                                           watch=watch)

    def leave(self) -> list[Future]:
        """Each executor dropping the groups: a run on executors that outlive it ends."""
        if not self.groups:
            return []
        return [self.ctl.submit("leave_replica_groups", config={"groups": self.groups},
                                executor=e.id) for e in self.executors if e.alive]

    def reduction(self, schedule: Schedule) -> Callable[[int], tuple[list, dict]] | None:
        """What each stage's reduce_grads reads and is told: every replica's last action of
        the stage, and the group to sum over (torch) or the all-reduce's modelled seconds
        (simulator); None with one replica."""
        if self.count == 1:
            return None
        ends = [(run.futures, last_actions(run.schedule)) for run in self.current]
        orders = reduce_orders([run.schedule for run in self.current])
        seconds = self.sim_costs.allreduce_s(self.count, self.devices)
        groups = self.groups
        # FSDP: the reduce cuts the stage and keeps this replica's rows [Note: FSDP within a
        # stage in executors/torch/train/fsdp.py]
        sharding = {"shard": self.model.shard} if self.model.shard else {}

        def reduce(stage: int) -> tuple[list, dict]:
            after = [futures[last[stage]] for futures, last in ends if stage in last]
            if groups:
                return after, {"replica_group": groups[schedule.placement.device_of(stage)],
                               "reduce_order": orders.get(stage, "forward"), **sharding}
            return after, {"allreduce_seconds": seconds}

        return reduce

    def early_reduce(self, schedule: Schedule, config_for: Callable[[Action], dict],
                     schedules: Sequence[Schedule]) -> Callable[[Action], dict]:
        """`config_for`, with each stage's last W (or BW) of a replica's `schedule` told to start
        the stage's all-reduce, in the order `reduce_orders` gives over every replica's
        `schedules` [Note: all-reduce in the last W in executors/torch/train/replicas.py]:
        torch replicas (an FSDP stage's reduce-scatter from its second step on: its first
        reduce_grads cuts it), and only on the devices whose stages every replica finishes in
        one order (`agreed_devices`), whose group then sees the same collectives in the same
        order on every replica."""
        groups, placement = self.groups, schedule.placement
        if not groups:
            return config_for
        orders, agreed = reduce_orders(schedules), agreed_devices(schedules)
        sharding = {"shard": "fsdp"} if self.model.shard == "fsdp" else {}
        last = {action: {"reduce_group": groups[placement.device_of(stage)],
                         "reduce_order": orders[stage], **sharding}
                for stage, action in last_actions(schedule).items()
                if action.kind in _WEIGHTS and placement.device_of(stage) in agreed}
        if not last:
            return config_for

        def config(action: Action) -> dict:
            found = last.get(action)
            return config_for(action) if found is None else {**config_for(action), **found}

        return config

    def check_sharding(self, schedule: Schedule, spec: dict, lane_for: Callable[[int], Any],
                       watch: Callable[[Future], None]) -> None:
        """Under FSDP, once, before the model's first ops: replica 0's executors refuse a stage
        with nothing to shard (every replica's stage has the same shapes)."""
        if self.model.shard != "fsdp" or not self.groups or self.sharding_checked:
            return
        self.sharding_checked = True
        placement = schedule.placement
        for stage in range(schedule.num_stages):
            device = placement.device_of(stage)
            watch(self.ctl.submit("fsdp_check", config={**spec, "stage": stage,
                                                        "replicas": self.count},
                                  executor=self.of(0)[device].id,
                                  lane=device_lane(lane_for(0), device),
                                  meta={"node": "replica_groups", "stage": stage}))

    def gather_whole(self, schedule: Schedule, spec: dict, lane_for: Callable[[int], Any],
                     meta: dict) -> list[Future]:
        """Under FSDP, every replica makes each stage whole in its device's lanes, for replica 0
        to export it next (the next step's F finds it whole) [Note: FSDP within a stage in
        executors/torch/train/fsdp.py]; nothing otherwise."""
        if self.model.shard != "fsdp" or not self.groups:
            return []
        placement = schedule.placement
        return [self.ctl.submit("fsdp_gather", config={**spec, "stage": stage},
                                executor=self.of(replica)[placement.device_of(stage)].id,
                                lane=device_lane(lane_for(replica), placement.device_of(stage)),
                                meta={**meta, "stage": stage, "replica": replica})
                for replica in range(self.count) for stage in range(schedule.num_stages)]

    def sharding(self, schedule: Schedule) -> Callable[[int], dict] | None:
        """A sharded optimizer's group for each stage's optimizer step (torch replicas only)
        [Note: sharded optimizer states in executors/torch/train/replicas.py]."""
        if not (self.model.shard_optimizer and self.groups):
            return None
        groups = self.groups
        return lambda stage: {"replica_group": groups[schedule.placement.device_of(stage)],
                              "shard_optimizer": True}


# [Note: resuming at another replica count] Every replica of a model holds the same weights and,
# once merged, the same optimizer states; a checkpoint keeps them under layout-free names
# [Note: layout-free checkpoints in executors/torch/layout_free.py], so a run resumes at another
# replica count, --stages or sharding: each executor that trains a model sets it from all the
# checkpoint's files. What else an executor saved (its random generators, the copies generation
# holds) it loads itself; an executor the checkpointed run did not have, that holds a replica of
# a model placed as before, takes its counterpart's in replica 0 (`state_sources`).
def state_sources(saved: Mapping[str, list], placement: Mapping[str, list],
                  devices: Mapping[str, int]) -> dict[str, str]:
    """Which checkpointed executor's own state each executor of this run loads, where not its
    own [Note: resuming at another replica count]: none where a model's stages moved."""
    sources: dict[str, str] = {}
    held_before = {name for names in saved.values() for name in names}
    for model in sorted(set(saved) & set(placement)):
        was, now, per = saved[model], placement[model], devices.get(model)
        if was == now or not per or len(was) % per or now[:len(was)] != was[:len(now)]:
            continue
        for index in range(len(was), len(now)):
            if now[index] not in held_before:
                sources.setdefault(now[index], was[index % per])
    return sources
