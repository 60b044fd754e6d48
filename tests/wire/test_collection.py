"""The collector policy a run's processes work under [Note: garbage collection]."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import pytest

from flowkit.wire.collection import (
    YOUNG_COLLECTION,
    fewer_collections,
    fewer_collections_for_good,
    promote_new_imports,
)


@pytest.fixture(autouse=True)
def _restored():
    """Each test starts and ends with the process's own policy, nothing frozen."""
    before = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_a_run_freezes_what_exists_and_collects_young_objects_rarely() -> None:
    before = gc.get_threshold()
    with fewer_collections():
        assert gc.get_threshold() == (YOUNG_COLLECTION, *before[1:])
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_what_others_froze_stays_frozen() -> None:
    gc.freeze()  # a host application's own freeze: CPython unfreezes all or nothing
    frozen = gc.get_freeze_count()
    with fewer_collections():
        pass
    # an unfreeze would leave none; a few frozen objects may be freed meanwhile by other threads
    # of this process (the suite's pools, its fork server's reader)
    assert gc.get_freeze_count() >= 0.9 * frozen


def test_an_executor_works_under_the_policy_for_the_rest_of_its_life() -> None:
    """An executor's process sets the policy once (the fixture restores this one's)."""
    before = gc.get_threshold()
    fewer_collections_for_good()
    assert gc.get_threshold() == (YOUNG_COLLECTION, *before[1:])
    assert gc.get_freeze_count() > 0
    with fewer_collections():  # a run inside it leaves it as it was
        pass
    assert gc.get_threshold() == (YOUNG_COLLECTION, *before[1:])


def test_what_an_import_made_leaves_the_young_generation_once(tmp_path, monkeypatch) -> None:
    """[Note: imports promoted]: a new module's objects are collected once, after the op that
    imported it, and then skipped by young collections; no new module, no collection."""
    fewer_collections_for_good()
    assert not promote_new_imports()
    (tmp_path / "fresh_module_for_promotion.py").write_text(
        "TABLES = [{'row': [i]} for i in range(2000)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fresh_module_for_promotion

    young = {id(o) for o in gc.get_objects(generation=0)}
    assert id(fresh_module_for_promotion.TABLES) in young
    assert promote_new_imports()
    young = {id(o) for o in gc.get_objects(generation=0)}
    assert id(fresh_module_for_promotion.TABLES) not in young
    assert not young & {id(t) for t in fresh_module_for_promotion.TABLES}
    assert not promote_new_imports()
    monkeypatch.delitem(sys.modules, "fresh_module_for_promotion")


def test_a_threshold_set_during_the_run_is_kept() -> None:
    with fewer_collections():
        gc.set_threshold(1234, 5, 6)
    assert gc.get_threshold() == (1234, 5, 6)


def test_runs_inside_one_another_restore_the_policy_only_when_the_last_ends() -> None:
    before = gc.get_threshold()
    with fewer_collections():
        with fewer_collections():
            pass
        assert gc.get_threshold()[0] == YOUNG_COLLECTION  # the outer run still works under it
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_run_that_raises_restores_the_policy() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("the run failed")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_the_first_of_two_runs_on_threads_to_end_leaves_the_policy_to_the_other() -> None:
    before = gc.get_threshold()
    steps = {name: (threading.Event(), threading.Event()) for name in ("first", "second")}

    def run(name: str) -> None:
        entered, leave = steps[name]
        with fewer_collections():
            entered.set()
            leave.wait()

    threads = {name: threading.Thread(target=run, args=(name,)) for name in steps}
    threads["first"].start()
    steps["first"][0].wait()
    threads["second"].start()
    steps["second"][0].wait()
    steps["first"][1].set()
    threads["first"].join()
    assert gc.get_threshold()[0] == YOUNG_COLLECTION  # the second still runs
    steps["second"][1].set()
    threads["second"].join()
    assert gc.get_threshold() == before


def test_a_run_entered_on_one_thread_may_end_on_another() -> None:
    before = gc.get_threshold()
    policy = fewer_collections()
    policy.__enter__()
    ender = threading.Thread(target=policy.__exit__, args=(None, None, None))
    ender.start()
    ender.join()
    assert gc.get_threshold() == before


def test_cycles_are_still_collected_without_being_asked() -> None:
    class Node:
        pass

    generations: list[int] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "stop":
            generations.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        with fewer_collections():
            node = Node()
            node.me = node
            alive = weakref.ref(node)
            del node
            held = [[] for _ in range(YOUNG_COLLECTION // 2)]
            assert alive() is not None  # not yet: young collections are rarer
            held += [[] for _ in range(YOUNG_COLLECTION)]
            assert alive() is None and 0 in generations
            del held
    finally:
        gc.callbacks.remove(watch)
