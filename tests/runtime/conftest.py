import pytest

from tests.harness import executor_cluster


@pytest.fixture
def cluster():
    """A controller with two local executor processes, a rollout one and a train one."""
    with executor_cluster(2, tags=[("rollout",), ("train",)]) as started:
        yield started
