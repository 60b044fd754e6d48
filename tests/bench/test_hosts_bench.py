"""`flowkit bench dispatch|transfer --hosts 2`: the benches run across two network-namespace
hosts with their bare-zmq baselines in the same run, and leave nothing behind. Figures are
checked for being measured, never for their values."""

import os

import pytest
from click.testing import CliRunner

import benchmarks.dispatch
import benchmarks.transfer
from flowkit.cli import main

needs_namespaces = pytest.mark.usefixtures("namespaces")


def _namespaces_and_links() -> set[str]:
    """This process's namespaces and links (another test process may make its own meanwhile)."""
    from flowkit.runtime.netns import _links, _namespaces

    pid = os.getpid()
    return {name for name in _namespaces() | _links()
            if name.startswith((f"fk-{pid}-", f"fk{pid}s"))}


@pytest.mark.slow
@needs_namespaces
def test_the_dispatch_bench_runs_across_hosts_against_bare_zmq_across_them():
    before = _namespaces_and_links()
    figures = benchmarks.dispatch.run_dispatch_bench(rounds=50, in_flight=200, hosts=2)
    assert figures["hosts"] == 2 and figures["transport"] == "tcp"
    for key in ("rtt_p50_us", "raw_zmq_rtt_p50_us", "ops_per_s", "raw_zmq_msgs_per_s",
                "rtt_ratio"):
        assert figures[key] > 0, key
    assert _namespaces_and_links() == before


@pytest.mark.slow
@needs_namespaces
def test_the_transfer_bench_moves_64_mib_across_hosts_against_bare_zmq_across_them():
    before = _namespaces_and_links()
    figures = benchmarks.transfer.run_transfer_bench((64,), rounds=2, warmup=1, hosts=2)
    assert figures["hosts"] == 2 and "memcpy_gbps" not in figures
    assert figures["gbps"]["64"] > 0 and figures["raw_zmq_gbps"]["64"] > 0
    ratio = figures["gbps"]["64"] / figures["raw_zmq_gbps"]["64"]
    assert figures["ratio_64"] == pytest.approx(ratio,
                                                rel=0.01)
    assert _namespaces_and_links() == before


def test_hosts_is_refused_with_the_other_benches_and_past_two():
    for args in (["pipeline", "--hosts", "2"], ["rl", "--hosts", "2"], ["dispatch", "--hosts", "3"],
                 ["transfer", "--hosts", "0"]):
        result = CliRunner().invoke(main, ["bench", *args])
        assert result.exit_code == 2, result.output  # a usage error, before any bench runs
        assert "--hosts" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["bench", "pipeline", "--hosts", "2"])
    assert "`flowkit bench dispatch|transfer` only, not 'pipeline'" in result.output


@needs_namespaces
def test_hosts_reaches_the_dispatch_and_transfer_benches(monkeypatch):
    seen = []
    for module, name in ((benchmarks.dispatch, "run_dispatch_bench"),
                         (benchmarks.transfer, "run_transfer_bench")):
        monkeypatch.setattr(module, name, lambda **kwargs: seen.append(kwargs) or {"ok": 1})
    for which in ("dispatch", "transfer"):
        result = CliRunner().invoke(main, ["bench", which, "--hosts", "2"])
        assert result.exit_code == 0, result.output
    assert seen == [{"hosts": 2}, {"hosts": 2}]
