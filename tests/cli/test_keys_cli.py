"""`flowkit keys generate`, and the --keys/--bind/--insecure options of `flowkit run`,
`flowkit executor` and `flowkit bench` [Note: authenticated transport in
flowkit/wire/auth.py]: refused with one line before anything starts, and a run with keys
beyond loopback."""

from __future__ import annotations

import textwrap

import pytest
import zmq
from click.testing import CliRunner

from flowkit.cli import main
from flowkit.wire.auth import Keys

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")

FLOW = textwrap.dedent("""
    from flowkit.dsl import Batch, Flow, Stream, collect, op

    @op
    def numbers() -> Stream[int]:
        yield from range(5)

    @op
    def double(n: int) -> int:
        return 2 * n

    @op
    def total(values: Batch[int]) -> int:
        return sum(values)

    with Flow("sums") as flow:
        total(collect(double(numbers())))
""")


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def _usage_error(*args: str) -> str:
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())  # click wraps long lines


@pytest.fixture
def flow_file(tmp_path):
    path = tmp_path / "sums.py"
    path.write_text(FLOW)
    return str(path)


def test_generate_writes_a_folder_that_loads_and_never_overwrites_it(tmp_path):
    result = _invoke("keys", "generate", str(tmp_path / "keys"))
    assert result.exit_code == 0, result.output
    assert "--keys" in result.output
    keys = Keys.load(tmp_path / "keys")
    assert keys.allowed == {keys.executor_public}
    again = _invoke("keys", "generate", str(tmp_path / "keys"))
    assert again.exit_code == 1 and "already holds keys" in again.output
    assert Keys.load(tmp_path / "keys") == keys


def test_run_refuses_a_reachable_bind_without_keys_naming_the_options(flow_file):
    output = _usage_error("run", flow_file, "--no-dashboard", "--bind", "tcp://0.0.0.0:0")
    assert "--bind" in output and "pass --keys DIR" in output and "--insecure" in output


def test_run_refuses_a_bind_that_is_not_a_zmq_address(flow_file):
    assert "tcp://HOST:PORT" in _usage_error("run", flow_file, "--bind", "10.0.0.5:5555")


def test_run_refuses_a_missing_or_incomplete_keys_folder(flow_file, tmp_path):
    output = _usage_error("run", flow_file, "--keys", str(tmp_path / "none"))
    assert "--keys" in output and "flowkit keys generate" in output
    (tmp_path / "half").mkdir()
    assert "no controller.key" in _usage_error("run", flow_file, "--keys", str(tmp_path / "half"))


@pytest.mark.slow
def test_a_run_with_keys_binds_beyond_loopback_and_runs(flow_file, tmp_path):
    _invoke("keys", "generate", str(tmp_path / "keys"))
    result = _invoke("run", flow_file, "--no-dashboard", "--bind", "tcp://0.0.0.0:0",
                     "--keys", str(tmp_path / "keys"), "--steps", "2",
                     "--metrics", str(tmp_path / "m.jsonl"))
    assert result.exit_code == 0, result.output
    assert "sums: 2 steps done" in result.output


def test_the_executor_refuses_a_reachable_data_socket_without_keys():
    output = _usage_error("executor", "--connect", "tcp://127.0.0.1:9",
                          "--peer-host", "192.0.2.1")
    assert "data socket" in output and "pass --keys DIR" in output and "--insecure" in output


def test_the_executor_refuses_a_missing_keys_folder(tmp_path):
    output = _usage_error("executor", "--connect", "tcp://127.0.0.1:9",
                          "--keys", str(tmp_path / "none"))
    assert "--keys" in output and "does not exist" in output


def test_bench_curve_is_for_dispatch_and_transfer_only():
    assert "--curve" in _usage_error("bench", "pipeline", "--curve")
