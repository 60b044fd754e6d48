"""`flowkit bench codec` at a small size: every way's figures and ratios, and its usage errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from benchmarks.codec import run_codec_bench
from flowkit.cli import main


@pytest.mark.slow
def test_the_codec_bench_reports_each_way_and_the_ratios():
    figures = run_codec_bench(records=64, rounds=2)
    assert figures["records"] == 64 and figures["bytes_per_record"] > 100
    for way in ("flowkit", "nested", "plain"):
        assert figures[way]["pack_us"] > 0 and figures[way]["unpack_us"] > 0
    assert figures["collector_on"]["unpack_us"] > 0
    for key in ("unpack_flowkit_over_collector_on", "unpack_flowkit_over_nested",
                "unpack_flowkit_over_plain", "pack_flowkit_over_nested",
                "pack_flowkit_over_plain"):
        assert figures[key] > 0


def test_no_records_is_a_usage_error():
    result = CliRunner().invoke(main, ["bench", "codec", "--records", "0"])
    assert result.exit_code == 2 and "--records" in result.output
