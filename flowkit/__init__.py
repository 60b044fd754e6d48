"""flowkit: declare RL and pipeline-parallel training steps as typed dataflows, plan them, run them."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flowkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
