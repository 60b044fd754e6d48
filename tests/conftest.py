import contextlib
import os

import pytest

from flowkit.runtime.launch import preload_for
from tests.harness import ExecutorPool, executor_cluster

# What the suite's fork server imports once, so that no executor process a test starts (its own,
# or a `flowkit run` child's) imports them again: what the kinds' servers do, and the HF models
# the tests build.
_PRELOAD = (*preload_for("torch"), *preload_for("sim"), "transformers",
            "transformers.models.auto.modeling_auto", "transformers.models.qwen2.modeling_qwen2",
            "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2")


# Longest first: pytest-xdist hands out test files as workers free up, by default the
# files with the most tests first: the end-to-end examples (one test each, 1-3 minutes) came
# last, and one worker ran them alone at the end. The longest go first instead (a longest-job-
# first schedule), then every other file with a slow test, then the rest.
_LONGEST = ("tests/cli/test_hf_example.py", "tests/cli/test_calculator_example.py",
            "tests/cli/test_rl_example.py", "tests/security/test_chaos.py",
            "tests/cli/test_ray_launch.py", "tests/cli/test_restarts.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's, in its controller
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    slow_files = {item.nodeid.split("::")[0] for item in items
                  if item.get_closest_marker("slow")}

    def start_order(item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        if path in _LONGEST:
            return (0, _LONGEST.index(path))
        return (1 if path in slow_files else 2, 0)

    items.sort(key=start_order)  # stable: each file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """One fork server per xdist worker [Note: fork server in executors/forkserver.py], named
    in FLOWKIT_FORKSERVER for every launcher of this process and of the processes it starts; a
    test of the launchers' own server unsets it for its run."""
    from flowkit.runtime.forkserver import start_server

    if os.environ.get("FLOWKIT_FORKSERVER"):
        yield None
        return
    server = start_server(_PRELOAD)
    os.environ["FLOWKIT_FORKSERVER"] = server.path
    yield server
    os.environ.pop("FLOWKIT_FORKSERVER", None)
    server.close()


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
