"""`flowkit executor --connect`: an executor started by hand, as on another host."""

import os
import subprocess
import sys

from flowkit.runtime import Controller


def test_a_hand_started_executor_joins_serves_and_exits_with_its_controller():
    ctl = Controller()
    env = {**os.environ, "FLOWKIT_CONTROLLER": ctl.address}  # --connect from the environment
    process = subprocess.Popen(
        [sys.executable, "-m", "flowkit", "executor", "--tags", "gpu,train", "--kind", "sim",
         "--name", "by-hand"], env=env, stdin=subprocess.DEVNULL)
    try:
        (info,) = ctl.wait_for_executors(1, timeout=60)
        assert (info.name, info.tags) == ("by-hand", ("gpu", "train"))
        assert {"F", "B", "W", "generate", "noop"} <= info.ops
        stats = ctl.submit("F", config={"seconds": 0.001, "last": True, "tokens": 5},
                           tags=["gpu"])
        assert stats.result(timeout=10).tokens == 5
    finally:
        ctl.shutdown()
        assert process.wait(timeout=10) == 0


def test_executor_without_a_controller_address_is_a_usage_error():
    env = {k: v for k, v in os.environ.items() if k != "FLOWKIT_CONTROLLER"}
    result = subprocess.run([sys.executable, "-m", "flowkit", "executor"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--connect" in result.stderr
