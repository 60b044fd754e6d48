"""`flowkit check` and `flowkit graph` through click's CliRunner: exit codes and output."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowkit import __version__
from flowkit.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def _write(tmp_path: Path, body: str, name: str = "flow.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_version_and_help(runner):
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output
    result = runner.invoke(main, ["-h"])
    assert result.exit_code == 0
    for command in ("check", "graph", "schedule"):
        assert command in result.output


@pytest.mark.parametrize("example", ["ppo.py", "grpo.py", "pretrain_pp.py", "rloo_sort.py",
                                     "reinforce_pp_sort.py", "reverse_task.py",
                                     "reverse_task.py:warmup"])  # docs/your-own-task.md's
def test_every_example_flow_checks(runner, example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the RL examples start from the warm-up's weights, written
    (tmp_path / "checkpoints").mkdir()  # by examples/sort_sft.py: a missing one is an error
    (tmp_path / "checkpoints" / "actor.pt").touch()
    result = runner.invoke(main, ["check", str(EXAMPLES / example)])
    assert result.exit_code == 0, result.output
    assert "is valid" in result.output


def test_broken_example_lists_every_error_and_exits_1(runner):
    result = runner.invoke(main, ["check", str(EXAMPLES / "broken_flow.py")])
    assert result.exit_code == 1
    assert "flow 'broken' has 5 errors" in result.output
    for rule in ("unknown-config", "unknown-model", "type-mismatch", "missing-group-by",
                 "missing-collect"):
        assert rule in result.output


def test_the_dsl_pages_sample_error_is_the_real_one(runner):
    """docs/dsl.md shows the start of `flowkit check examples/broken_flow.py`: each line it
    shows is a line the command prints (a key the executors learn lengthens the real one)."""
    page = (EXAMPLES.parent / "docs" / "dsl.md").read_text(encoding="utf-8")
    sample = page.split("$ flowkit check examples/broken_flow.py\n", 1)[1].split("```", 1)[0]
    shown = [line for line in sample.splitlines() if line.strip() not in ("", "...")]
    result = runner.invoke(main, ["check", str(EXAMPLES / "broken_flow.py")])
    printed = result.output.splitlines()
    assert shown == printed[:len(shown)], "regenerate docs/dsl.md's sample from the command"


_HEAD = textwrap.dedent("""
    import attrs
    from flowkit.dsl import Batch, Flow, Stream, collect, op

    @attrs.frozen
    class Sample:
        text: str

    @op
    def source() -> Stream[Sample]:
        yield Sample("a")

    @op
    def upper(sample: Sample) -> Sample:
        return Sample(sample.text.upper())

    @op
    def gather(samples: Batch[Sample]) -> int:
        return len(samples)
""")

BROKEN = {
    "unbound input": ("flow.add(upper)", ("unbound-input", "'upper'", "'sample'")),
    "stream into batch": ("gather(upper(source()))", ("missing-collect", "'gather'", "'samples'")),
    "duplicate name": ("upper(source()); upper(source(name='s2'))",
                       ("duplicate-name", "'upper'", None)),
    "cycle": ("flow.add(upper, name='a'); flow.add(upper, name='b'); "
              "flow.connect('a.out', 'b.sample'); flow.connect('b.out', 'a.sample')",
              ("cycle", None, None)),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_flows_exit_1_naming_op_and_port(runner, tmp_path, case):
    body, (rule, op_name, port) = BROKEN[case]
    path = _write(tmp_path, _HEAD + f"\nwith Flow('f') as flow:\n    {body}\n")
    result = runner.invoke(main, ["check", str(path)])
    assert result.exit_code == 1, result.output
    assert rule in result.output
    for fragment in (op_name, port):
        if fragment:
            assert fragment in result.output


def test_type_mismatch_across_records(runner, tmp_path):
    path = _write(tmp_path, _HEAD + textwrap.dedent("""
    @attrs.frozen
    class Other:
        n: int

    @op
    def count(other: Other) -> int:
        return other.n

    with Flow('f') as flow:
        count(upper(source()))
    """))
    result = runner.invoke(main, ["check", str(path)])
    assert result.exit_code == 1
    assert "type-mismatch" in result.output and "op 'count', port 'other'" in result.output
    assert "Sample is not Other" in result.output


def test_a_flow_by_name_or_by_builder_function(runner, tmp_path):
    path = _write(tmp_path, _HEAD + textwrap.dedent("""
    def build():
        with Flow('built') as flow:
            gather(collect(upper(source())))
        return flow

    other = build()
    """))
    result = runner.invoke(main, ["check", f"{path}:build"])
    assert result.exit_code == 0 and "'built'" in result.output
    result = runner.invoke(main, ["check", f"{path}:other"])
    assert result.exit_code == 0


def test_bad_flow_specs_are_usage_errors(runner, tmp_path):
    result = runner.invoke(main, ["check", str(tmp_path / "missing.py")])
    assert result.exit_code == 2 and "no such file" in result.output
    path = _write(tmp_path, _HEAD + "\nnot_a_flow = 3\n")
    result = runner.invoke(main, ["check", str(path)])
    assert result.exit_code == 2 and "defines no 'flow'" in result.output
    result = runner.invoke(main, ["check", f"{path}:not_a_flow"])
    assert result.exit_code == 2 and "not a flowkit Flow" in result.output
    result = runner.invoke(main, ["check", "flow.txt"])
    assert result.exit_code == 2


def test_a_file_that_raises_exits_1_with_its_traceback(runner, tmp_path):
    path = _write(tmp_path, "raise ValueError('boom in user code')\n")
    result = runner.invoke(main, ["check", str(path)])
    assert result.exit_code == 1
    assert "boom in user code" in result.output and "Traceback" in result.output


def test_a_traceback_shows_only_the_users_own_frames(runner, tmp_path):
    _write(tmp_path, "import json\n\ndef load():\n    return json.loads('{bad')\n", "helper.py")
    path = _write(tmp_path, "import helper\n\nhelper.load()\n")
    result = runner.invoke(main, ["check", str(path)])
    assert result.exit_code == 1
    frames = [line for line in result.stderr.splitlines() if line.startswith("  File ")]
    assert frames == [f'  File "{path}", line 3, in <module>',
                      f'  File "{tmp_path / "helper.py"}", line 4, in load']
    assert "JSONDecodeError: Expecting property name" in result.stderr
    assert "importlib" not in result.stderr and "flowkit" not in result.stderr


def test_a_syntax_error_shows_file_line_and_the_offending_code(runner, tmp_path):
    path = _write(tmp_path, "from flowkit.dsl import Flow\nflow = = Flow('f')\n")
    result = runner.invoke(main, ["check", str(path)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"error: {path}:2: invalid syntax", "    flow = = Flow('f')", "           ^"]


def test_graph_to_a_missing_folder_exits_1_without_a_traceback(runner, tmp_path):
    out = tmp_path / "nodir" / "p.dot"
    result = runner.invoke(main, ["graph", str(EXAMPLES / "ppo.py"), "-o", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert f"cannot write {out}: the folder {out.parent} does not exist" in result.stderr


def test_graph_writes_dot(runner, tmp_path):
    out = tmp_path / "ppo.dot"
    result = runner.invoke(main, ["graph", str(EXAMPLES / "ppo.py"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith('digraph "ppo"')


def test_graph_svg_renders_or_says_graphviz_is_missing(runner, tmp_path, monkeypatch):
    out = tmp_path / "ppo.svg"
    if shutil.which("dot"):
        result = runner.invoke(main, ["graph", str(EXAMPLES / "ppo.py"), "-o", str(out)])
        assert result.exit_code == 0 and out.read_text().lstrip().startswith("<")
    monkeypatch.setenv("PATH", str(tmp_path))  # hide any installed Graphviz
    result = runner.invoke(main, ["graph", str(EXAMPLES / "ppo.py"), "-o", str(out)])
    assert result.exit_code == 1
    assert "Graphviz's `dot` program is not on PATH" in result.output
    assert (tmp_path / "ppo.dot").exists()


def test_graph_rejects_unknown_formats(runner, tmp_path):
    result = runner.invoke(main, ["graph", str(EXAMPLES / "ppo.py"), "-o", str(tmp_path / "x.pdf")])
    assert result.exit_code == 2 and ".dot, .svg or .png" in result.output


def test_graph_of_a_broken_flow_exits_1(runner, tmp_path):
    result = runner.invoke(main, ["graph", str(EXAMPLES / "broken_flow.py"), "-o",
                                  str(tmp_path / "b.dot")])
    assert result.exit_code == 1 and not (tmp_path / "b.dot").exists()


_TYPOS = textwrap.dedent("""
    from dataflows.models import GPT_BUILD
    from dataflows.model_ops import Backprop
    from dataflows.text import token_sequences
    from flowkit.dsl import Flow, Model

    actor = Model(name="actor", build=GPT_BUILD, config={"vocab_size": 256})
    with Flow("typos") as flow:
        Backprop(actor)(token_sequences(path="x.txt"), loss="rloo", schedule="1fb1", kl_kind="k4")
""")


@pytest.mark.parametrize("command", [["check"], ["run", "--no-dashboard"]])
def test_a_loss_schedule_or_kl_kind_the_executors_lack_fails_before_anything_starts(
        runner, tmp_path, command):
    result = runner.invoke(main, [*command, str(_write(tmp_path, _TYPOS))])
    assert result.exit_code == 1, result.output
    assert result.output.count("unknown-choice") == 3
    assert "loss='rloo'" in result.output and "known: lm, grpo, ppo, value" in result.output
    assert "did you mean '1f1b'?" in result.output
    assert "kl_kind='k4'" in result.output and "executors: sim" not in result.output
