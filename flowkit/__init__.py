"""flowkit: declare RL and pipeline-parallel training steps as typed dataflows, plan them, run them.

    import flowkit
    result = flowkit.run(flow, flowkit.RunConfig(steps=3, executors="sim"))

An op's way through, one place each: declared with the DSL (flowkit.dsl: `@op` functions and
ModelOp classes, whose executor ops flowkit.ops names), lowered into task rules by the planner
(flowkit.planner.lower), run step by step by the runner (flowkit.runner), submitted and
dispatched by the runtime (flowkit.runtime) over the wire (flowkit.wire), executed by an executor
process from its op table (executors/). The layers are import contracts in pyproject.toml, and
neither executors/ nor dataflows/ is imported by the engine.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flowkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

# The run API, imported on first use: `import flowkit` stays light (no zmq, no torch).
_RUN_API = ("CheckpointConfig", "ControllerConfig", "LogSetup", "Run", "RunConfig",
            "RunConfigError", "RunError", "RunResult", "run")

__all__ = ["__version__", *_RUN_API]


def __getattr__(name: str):
    if name in _RUN_API:
        import flowkit.runner as runner

        return getattr(runner, name)
    raise AttributeError(f"module 'flowkit' has no attribute {name!r}")
