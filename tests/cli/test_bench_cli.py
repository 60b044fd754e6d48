"""`flowkit bench`'s rl-only options: passed into the rl bench, refused with the others."""

from click.testing import CliRunner

import benchmarks.rl
from flowkit.cli import main


def _refused(*args: str) -> str:
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2, result.output  # click's usage error, before any bench runs
    assert "Traceback" not in result.output
    return result.output


def test_the_rl_options_are_refused_with_another_bench():
    for option, value in [("--mode", "async"), ("--max-staleness", "2"),
                          ("--length-sigma", "0.5"), ("--max-new-tokens", "64")]:
        output = _refused("dispatch", option, value)
        assert f"{option}: `flowkit bench rl` only, not 'dispatch'" in output


def test_a_staleness_bound_is_refused_with_a_synchronous_mode():
    assert "async mode's" in _refused("rl", "--mode", "fused", "--max-staleness", "1")


def test_bad_values_are_refused():
    _refused("rl", "--mode", "overlapped")
    _refused("rl", "--max-staleness", "-1")
    _refused("rl", "--max-new-tokens", "0")


def test_the_rl_options_reach_the_bench(monkeypatch):
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return {"ok": True}

    monkeypatch.setattr(benchmarks.rl, "run_rl_bench", fake)
    result = CliRunner().invoke(main, ["bench", "rl", "--mode", "async", "--max-staleness", "4",
                                       "--length-sigma", "1.5", "--max-new-tokens", "256",
                                       "--stale-segments", "recompute"])
    assert result.exit_code == 0, result.output
    assert seen["modes"] == ("async",) and seen["max_staleness"] == 4
    assert seen["setup"].length_sigma == 1.5 and seen["setup"].max_new_tokens == 256
    assert seen["setup"].stale_segments == "recompute"
    seen.clear()
    result = CliRunner().invoke(main, ["bench", "rl"])
    assert result.exit_code == 0, result.output
    assert seen == {"setup": benchmarks.rl.RLSetup(), "modes": benchmarks.rl.MODES}
