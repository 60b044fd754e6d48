"""`flowkit bench dispatch|transfer --curve`: every side (flowkit and bare zmq, plain and
CURVE) is measured in one run, and the keys made for it are gone after. Figures are checked for
being measured, never for their values."""

import glob
import tempfile

import pytest
import zmq
from click.testing import CliRunner

from benchmarks.curve import run_dispatch_curve, run_transfer_curve
from flowkit.cli import main
from flowkit.runtime.netns import unavailable

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
SIDES = {"plain", "curve", "raw_zmq_plain", "raw_zmq_curve"}


def _keys_folders() -> set[str]:
    return set(glob.glob(f"{tempfile.gettempdir()}/flowkit-bench-keys-*"))


def _measured(figures: dict, size: str | None = None) -> None:
    for name in ("cost", "ratio"):
        block = figures[name] if size is None else figures[name][size]
        assert all(value > 0 for value in block.values()), (name, block)
    assert set(figures["cost"] if size is None else figures["cost"][size]) == {"flowkit",
                                                                               "raw_zmq"}


def test_the_dispatch_bench_measures_all_four_sides():
    before = _keys_folders()
    figures = run_dispatch_curve(rounds=30, warmup=5)
    assert set(figures["rtt_p50_us"]) == SIDES and min(figures["rtt_p50_us"].values()) > 0
    _measured(figures)
    assert _keys_folders() == before


@pytest.mark.slow
def test_the_transfer_bench_moves_frames_on_all_four_sides():
    figures = run_transfer_curve((2,), rounds=2, warmup=1)
    assert set(figures["gbps"]["2"]) == SIDES and min(figures["gbps"]["2"].values()) > 0
    _measured(figures, "2")


@pytest.mark.slow
def test_the_cli_runs_the_curve_bench_and_writes_its_figures(tmp_path):
    out = tmp_path / "d.json"
    result = CliRunner().invoke(main, ["bench", "dispatch", "--curve", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert '"raw_zmq_curve"' in out.read_text()


@pytest.mark.slow
def test_the_transfer_bench_across_namespace_hosts():
    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    figures = run_transfer_curve((2,), rounds=2, warmup=1, hosts=2)
    assert set(figures["gbps"]["2"]) == SIDES and min(figures["gbps"]["2"].values()) > 0
    _measured(figures, "2")
