"""flowkit: declare RL and pipeline-parallel training steps as typed dataflows, plan them, run them.

An op's way through, one place each: declared with the DSL (flowkit.dsl: `@op` functions and
ModelOp classes, whose executor ops flowkit.ops names), lowered into task rules by the planner
(flowkit.planner.lower), submitted and dispatched by the runtime (flowkit.runtime: flowrun.py,
controller.py, dispatch.py), executed by an executor process from its op table (executors/).
The layers are import contracts in pyproject.toml: cli > bench > observe > runtime > planner >
ops > dsl, and neither executors/ nor dataflows/ is imported by the engine.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flowkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
