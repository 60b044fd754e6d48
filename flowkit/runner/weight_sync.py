"""How a trained model's new weights reach the executors that generate or score with it, after
each optimizer step [Note: weight sync paths].
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from flowkit.planner import Schedule
from flowkit.runner.pipeline import Lane, device_lane
from flowkit.runner.replicas import store_host
from flowkit.runner.stepstate import FlowRunError
from flowkit.runner.training_tasks import submit_exports
from flowkit.runtime.controller import Controller
from flowkit.runtime.futures import Future
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["WEIGHT_SYNC", "WeightSync", "distinct_gpus", "one_gpu", "sync_path"]

WEIGHT_SYNC = ("auto", "host", "broadcast")

# [Note: weight sync paths] Each stage's exporter sends the stage to every target (an executor
# that generates or scores with the model) one of three ways, chosen each sync by what the
# executors report (`resources["gpu"]`: host and CUDA_VISIBLE_DEVICES entry):
# - host: a copy of the stage in host memory over the data plane (shared memory on one host);
# - ipc: every one of them on one GPU: left on it, handed over by CUDA IPC [Note: weights on one
#   GPU in executors/torch/cuda_share.py];
# - broadcast: each stage's exporter and targets on GPUs of their own: a process group per
#   stage, NCCL [Note: weights by broadcast in executors/torch/weight_broadcast.py].
# `--weight-sync` (RunConfig.weight_sync): auto picks ipc, then broadcast, else host; host
# always the host; broadcast always the group's, gloo on CPUs (what the tests run).
_GROUP_IDS = itertools.count()


def one_gpu(executors: Sequence[ExecutorInfo]) -> bool:
    """Whether every one of `executors` reports the same GPU."""
    gpus = {e.resources.get("gpu") for e in executors}
    return len(gpus) == 1 and None not in gpus


def distinct_gpus(executors: Sequence[ExecutorInfo]) -> bool:
    """Whether each of `executors` reports a GPU no other of them does."""
    gpus = [e.resources.get("gpu") for e in executors]
    return None not in gpus and len(set(gpus)) == len(gpus)


def sync_path(mode: str, groups: Sequence[Sequence[ExecutorInfo]]) -> str:
    """How a sync goes [Note: weight sync paths]: "host", "ipc" or "broadcast", given the
    setting `mode` and each stage's group (its exporter, then the targets other than it).
    FlowRunError where `mode` asks for a broadcast that cannot run."""
    members = {e.id: e for group in groups for e in group}.values()
    if mode == "host":
        return "host"
    if mode == "auto" and one_gpu(list(members)):
        return "ipc"
    on_gpus = [e for e in members if e.resources.get("gpu") is not None]
    if mode == "auto":
        return "broadcast" if all(len(g) > 1 and distinct_gpus(g) for g in groups) else "host"
    if on_gpus and not all(distinct_gpus(g) for g in groups):
        shown = ", ".join(f"{e.describe()} on {e.resources.get('gpu')}" for e in members)
        raise FlowRunError(f"--weight-sync broadcast: each stage's exporter and targets need a "
                           f"GPU each (NCCL takes one rank a GPU), and here {shown}: give "
                           "--weight-sync auto (executors on one GPU hand weights over by CUDA "
                           "IPC) or host")
    return "broadcast"


class WeightSync:
    """The weight syncs of one trained model: which way each goes, and the process groups its
    broadcasts use (set up once for each set of members, left at the run's end)."""

    def __init__(self, ctl: Controller, model: str, mode: str, *,
                 trainer_lanes: tuple[Sequence[ExecutorInfo], int, Callable[[int], Lane]]
                 ) -> None:
        """`trainer_lanes`: the model's trainers (replica by replica, device by device), the
        devices of a replica, and each replica's lanes: where a trainer's weight work goes."""
        self.ctl, self.model, self.mode = ctl, model, mode
        self.trainer_lanes = trainer_lanes
        self.groups: dict[tuple[int, tuple[int, ...]], str] = {}  # (stage, member ids) -> name
        self.members: dict[str, list[ExecutorInfo]] = {}

    def submit(self, schedule: Schedule, trainers: Sequence[ExecutorInfo], spec: dict,
               version: Any, targets: Sequence[ExecutorInfo], *, lane: Lane, meta: dict,
               watch: Callable[[Future], None]) -> tuple[list[Future], list[Future]]:
        """After an optimizer step: the new weights of the model to its whole copy on each of
        `targets`. A target that trains the model unsplit holds the very weights it would load:
        skipped. Returns the exports' futures and the loads', each load resolving to the
        version; `watch` is given the groups' setup futures."""
        shared = {e.id for e in trainers} if schedule.num_stages == 1 else set()
        targets = [e for e in targets if e.id not in shared]
        if not targets:
            return [], []
        exporters = [trainers[schedule.placement.device_of(s)]
                     for s in range(schedule.num_stages)]
        groups = [[exporter, *(e for e in targets if e.id != exporter.id)]
                  for exporter in exporters]
        path = sync_path(self.mode, groups)
        extra: list[dict] = []
        after: list[tuple] = []
        if path == "broadcast":
            joined = self._groups(groups, watch)
            target_ids = {e.id for e in targets}
            extra = [{"broadcast": name, "self_load": exporter.id in target_ids}
                     for (name, _), exporter in zip(joined, exporters)]
            after = [(joins[0],) if joins else () for _, joins in joined]
        elif path == "ipc":
            extra = [{"share_with": [e.name for e in targets]}] * len(exporters)
        exports = submit_exports(self.ctl, schedule, trainers, spec, lane=lane, meta=meta,
                                 extra=extra, after=after)
        loads = [self.ctl.submit("load_weights", *exports, version,
                                 config={**spec, "stages": 1}, executor=e.id,
                                 lane=self.lane(e) if path == "broadcast" else None,
                                 meta={**meta, "device": e.id}) for e in targets]
        return exports, loads

    def lane(self, executor: ExecutorInfo) -> str:
        """Where `executor` joins the model's weight groups and, when they are broadcast,
        loads its weights: one lane, so that it joins the groups in one order and receives a
        group's broadcasts in the order they were sent. A trainer's is its training lane: its
        joins, which wait for every member, come after its step's collectives (two replicas
        waiting in a join and an all-reduce for each other would wait for ever)."""
        trainers, devices, lane_for = self.trainer_lanes
        index = next((i for i, e in enumerate(trainers) if e.id == executor.id), None)
        if index is None:
            return f"weights/{self.model}"
        return device_lane(lane_for(index // devices), index % devices)

    def _groups(self, groups: list[list[ExecutorInfo]], watch: Callable[[Future], None]
                ) -> list[tuple[str, list[Future]]]:
        """Each stage's group's name, and the futures of its exporter joining it (none when it
        joined at an earlier sync). A member joins every group it is in in its one lane, in
        stage order: joins wait for every member, so two members that joined two groups in
        opposite orders would wait for each other."""
        out = []
        for stage, members in enumerate(groups):
            key = (stage, tuple(e.id for e in members))
            name = self.groups.get(key)
            joins: list[Future] = []
            if name is None:
                name = self.groups[key] = f"{self.model}/weights/{stage}/{next(_GROUP_IDS)}"
                self.members[name] = members
                joins = self._join(name, members, watch)
            out.append((name, joins))
        return out

    def _join(self, name: str, members: list[ExecutorInfo], watch: Callable[[Future], None]
              ) -> list[Future]:
        store = self.ctl.submit("replica_store", config={"group": name, "size": len(members),
                                                         "host": store_host(members[0])},
                                executor=members[0].id, lane=self.lane(members[0]),
                                meta={"node": "weight_groups"})
        watch(store)
        joins = [self.ctl.submit("replica_group", store,
                                 config={"group": name, "rank": rank, "size": len(members),
                                         "weights": True},
                                 executor=member.id, lane=self.lane(member),
                                 meta={"node": "weight_groups"})
                 for rank, member in enumerate(members)]
        for join in joins:
            watch(join)
        return joins

    def leave(self) -> list[Future]:
        """Each member dropping the groups: a run on executors that outlive it ends."""
        by_executor: dict[int, list[str]] = {}
        for name, members in self.members.items():
            for e in members:
                by_executor.setdefault(e.id, []).append(name)
        alive = {e.id for e in self.ctl.executors() if e.alive}
        return [self.ctl.submit("leave_replica_groups", config={"groups": names},
                                executor=executor) for executor, names in by_executor.items()
                if executor in alive]
