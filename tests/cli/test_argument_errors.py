"""Argument errors of issue 27's commands, each one error line and a non-zero exit, nothing
started: a flow file that exits at import, `flowkit executor` given a bad address, level or
code file, `--num-executors` past its maximum, `keys generate` into a folder whose allowed/
still lets old clients in."""

from __future__ import annotations

import pytest
import zmq
from click.testing import CliRunner

from executors.serve import executor
from flowkit.cli import main
from flowkit.runner.config import MAX_EXECUTORS, RunConfig, RunConfigError
from tests.cli.runs import PRETRAIN


def _error_lines(result) -> list[str]:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    return [line for line in result.output.splitlines() if line.lower().startswith("error")]


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_flow_file_that_exits_at_import_is_an_error(tmp_path, command):
    flow = tmp_path / "exits.py"
    flow.write_text("import sys\nsys.exit(0)\n")
    result = CliRunner().invoke(main, [command, str(flow)])
    (line,) = _error_lines(result)
    assert result.exit_code == 1
    assert f"{flow} called sys.exit(0) while it was imported" in line


@pytest.mark.parametrize(("args", "expected"), [
    (["--connect", "garbage"], "'garbage' is not a controller address"),
    (["--connect", "tcp://127.0.0.1:70000"], "is not a controller address"),
    (["--connect", "tcp://127.0.0.1:5", "--log-level", "loud"], "'loud' is not one of"),
])
def test_bad_executor_arguments_are_one_line(args, expected):
    (line,) = _error_lines(CliRunner().invoke(executor, args))
    assert expected in line


def test_an_executor_code_file_that_fails_is_one_line(tmp_path):
    code = tmp_path / "broken.py"
    code.write_text("raise SystemExit(3)\n")
    result = CliRunner().invoke(executor, ["--connect", "tcp://127.0.0.1:5", "--code", str(code)])
    (line,) = _error_lines(result)
    assert str(code) in line and "FlowExitError" in line


def test_num_executors_has_a_maximum():
    result = CliRunner().invoke(main, ["run", PRETRAIN, "--no-dashboard", "-n", "100000"])
    (line,) = _error_lines(result)
    assert f"100000 is not in the range 1<=x<={MAX_EXECUTORS}" in line
    with pytest.raises(RunConfigError, match=f"num_executors=100000: it must be at most "
                                             f"{MAX_EXECUTORS}"):
        RunConfig(num_executors=100000)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_keys_generate_refuses_a_non_empty_allowed_folder_unless_forced(tmp_path):
    folder = tmp_path / "keys"
    (folder / "allowed").mkdir(parents=True)
    (folder / "allowed" / "old-client.key").write_text("an old client's public key")
    result = CliRunner().invoke(main, ["keys", "generate", str(folder)])
    (line,) = _error_lines(result)
    assert "allowed is not empty (old-client.key)" in line and "--force" in line
    assert not (folder / "controller.key").exists()
    result = CliRunner().invoke(main, ["keys", "generate", str(folder), "--force"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (folder / "allowed").iterdir()) == ["executor.key"]


@pytest.mark.parametrize("args", [
    ["executor", "--connect", "garbage"],
    ["run", "--num-executors", str(MAX_EXECUTORS + 1), PRETRAIN],
    ["no-such-command"],
    ["run"],
])
def test_through_flowkit_every_argument_error_is_exactly_one_line(args):
    result = CliRunner().invoke(main, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and "--help`" in lines[0]


def test_a_token_budget_under_one_sequence_is_one_line_before_the_run(tmp_path):
    flow = tmp_path / "grpo_budget.py"
    flow.write_text("from dataflows.grpo import grpo_flow\n"
                    "flow = grpo_flow(prompts=4, n=2, max_new_tokens=12)\n")
    result = CliRunner().invoke(main, ["run", str(flow), "--microbatch-tokens", "8"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "Invalid value for --microbatch-tokens: 'update_actor': microbatch_tokens=8 is " \
           "smaller than one sequence: a response of up to 12 tokens" in lines[0]
