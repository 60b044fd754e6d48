import contextlib

import pytest

from tests.harness import ExecutorPool, executor_cluster


@pytest.fixture(scope="module")
def cluster():
    """A controller with two local executor processes, a rollout one and a train one, shared by
    a module's tests (a test that kills or stops an executor takes `start_cluster`)."""
    with executor_cluster(2, tags=[("rollout",), ("train",)]) as started:
        yield started


@pytest.fixture(scope="session")
def pool():
    """The session's (each xdist worker's) executor pool: `pool.cluster(count, kind=...,
    tags=..., code=...)` hands out a cluster started once for those settings and reset
    between tests (tests.harness.ExecutorPool); a run shares one through
    `Run(flow, config, controller=ctl)`."""
    shared = ExecutorPool()
    yield shared
    shared.close()


@pytest.fixture
def start_cluster():
    """`ctl, infos = start_cluster(count, kind=..., tags=...)`: a cluster of executor processes
    (see harness.executor_cluster) for this test alone, torn down after it."""
    with contextlib.ExitStack() as stack:
        yield lambda *args, **options: stack.enter_context(executor_cluster(*args, **options))


@pytest.fixture(scope="module")
def namespaces():
    """Skips, saying why, where network namespaces cannot be made (found by trying)."""
    from flowkit.runtime.netns import unavailable

    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
