"""The collector policy a run's processes work under [Note: garbage collection]."""

from __future__ import annotations

import gc
import threading
import weakref

from flowkit.wire.collection import YOUNG_COLLECTION, fewer_collections


def test_a_run_freezes_what_exists_and_collects_young_objects_rarely() -> None:
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with fewer_collections():
        assert gc.get_threshold() == (YOUNG_COLLECTION, *before[1:])
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_runs_inside_one_another_restore_the_policy_only_when_the_last_ends() -> None:
    before = gc.get_threshold()
    with fewer_collections():
        with fewer_collections():
            pass
        assert gc.get_threshold()[0] == YOUNG_COLLECTION  # the outer run still works under it
    assert gc.get_threshold() == before


def test_runs_on_threads_that_end_in_any_order_restore_the_policy() -> None:
    before = gc.get_threshold()
    entered, release = threading.Barrier(3), threading.Event()

    def run() -> None:
        with fewer_collections():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    entered.wait()
    assert gc.get_threshold()[0] == YOUNG_COLLECTION
    release.set()
    for thread in threads:
        thread.join()
    assert gc.get_threshold() == before


def test_cycles_are_still_collected_under_the_policy() -> None:
    class Node:
        pass

    with fewer_collections():
        node = Node()
        node.me = node
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
