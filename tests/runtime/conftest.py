import pytest

from flowkit.runtime import Controller, LocalExecutors


@pytest.fixture
def cluster():
    """A controller with two local executor processes; torn down even when a test fails."""
    controller = Controller()
    executors = LocalExecutors(controller, 2, tags=[("rollout",), ("train",)])
    infos = executors.start()
    try:
        yield controller, sorted(infos, key=lambda e: e.name)
    finally:
        controller.shutdown()
        executors.stop()
