"""The code a run ships to its executors [Note: shipped code in flowkit/runner/flowcode.py]: the
modules a flow's ops, model builds and environments come from, found in this process, so that
`flowkit.run(flow)` needs no `code=`; a module found nowhere fails before anything starts."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowkit import RunConfigError
from flowkit.dsl import Flow, Model, Stream, load_flow, op
from flowkit.runner.flowcode import code_to_ship, flow_references

ROOT = Path(__file__).resolve().parents[2]

_TASK = textwrap.dedent('''
    """A newcomer's own task: reverse three digits."""
    import random

    import attrs

    from flowkit.dsl import Stream, op
    from flowkit.ops.records import Prompt, Rollout, Scored


    @op
    def reverse_prompts(*, count: int = 4, seed: int = 0, step: int = 0) -> Stream[Prompt]:
        rng = random.Random(f"{seed}/{step}")
        for i in range(count):
            digits = "".join(rng.choice("0123456789") for _ in range(3))
            yield Prompt(prompt_id=i, tokens=list(f"rev {digits}:".encode()),
                         answer=digits[::-1])


    @op
    def reverse_reward(rollout: Rollout) -> Scored:
        text = bytes(t for t in rollout.response_tokens if t < 128).decode(errors="replace")
        reward = 1.0 if text.strip() == rollout.answer else 0.0
        return Scored(**attrs.asdict(rollout, recurse=False), reward=reward)
''')


def _module_in(folder: Path, name: str, body: str = _TASK) -> Path:
    """`name` (dotted: a package's module) written under `folder`, importable from it."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        package = folder.joinpath(*parts[:depth])
        package.mkdir(exist_ok=True)
        (package / "__init__.py").touch()
    path = folder.joinpath(*parts[:-1], parts[-1] + ".py")
    path.write_text(body)
    return path


@pytest.fixture
def imported_from(tmp_path, monkeypatch):
    """Import a module written under a folder of its own, as a script beside it would (its
    folder on this process's sys.path, neither the working directory nor PYTHONPATH)."""
    folder = tmp_path / "task"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    names = []

    def load(name: str):
        _module_in(folder, name)
        names.append(name)
        importlib.invalidate_caches()
        return importlib.import_module(name)

    yield folder, load
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name.split(".")[0])]:
            sys.modules.pop(loaded, None)


def _flow_of(prompts_op, *, build: str = "executors.torch.models.gpt:GPT", **config) -> Flow:
    with Flow("own") as flow:
        flow.add_model(Model(name="actor", build=build, config={"n_layer": 2}))
        prompts_op(**config)
    return flow


def test_an_op_module_imported_from_a_folder_of_its_own_ships_that_folder(imported_from):
    folder, load = imported_from
    task = load("reverse_task_a")
    assert code_to_ship(_flow_of(task.reverse_prompts)) == (str(folder.resolve()),)


def test_a_package_module_ships_the_folder_its_package_sits_in(imported_from):
    folder, load = imported_from
    task = load("mytasks_b.reverse")
    assert code_to_ship(_flow_of(task.reverse_prompts)) == (str(folder.resolve()),)


def test_modules_the_executors_import_already_ship_nothing(imported_from, monkeypatch):
    from dataflows.rl.tasks import sort_prompts  # the repository's own: flowkit's folder

    assert code_to_ship(_flow_of(sort_prompts)) == ()
    folder, load = imported_from  # the working directory is first on an executor's path
    monkeypatch.chdir(folder)
    assert code_to_ship(_flow_of(load("reverse_task_c").reverse_prompts)) == ()


def test_a_flow_file_loaded_by_path_ships_the_file_once(tmp_path):
    path = tmp_path / "own_flow.py"
    path.write_text(_TASK + textwrap.dedent("""
        from flowkit.dsl import Flow
        with Flow("own") as flow:
            reverse_prompts()
    """))
    flow = load_flow(str(path))
    assert code_to_ship(flow) == (str(path.resolve()),)
    # what the CLI passes (`code=[path]`) is not shipped twice
    assert code_to_ship(flow, given=[str(path)]) == (str(path),)


def test_references_name_ops_model_builds_and_environments(imported_from):
    _, load = imported_from
    task = load("reverse_task_d")
    flow = _flow_of(task.reverse_prompts, build="mymodels_d:Tiny")
    flow.nodes["reverse_prompts"].config["environment"] = "myenvs_d.games:Guess"
    found = {(r.module, r.by) for r in flow_references(flow)}
    assert found == {("reverse_task_d", "op 'reverse_prompts'"),
                     ("mymodels_d", "the build of model 'actor'"),
                     ("myenvs_d.games", "the environment of 'reverse_prompts'")}


def test_a_module_found_nowhere_is_one_line_naming_it_and_the_folders_searched(imported_from):
    _, load = imported_from
    flow = _flow_of(load("reverse_task_e").reverse_prompts, build="no_such_models_e:Tiny")
    with pytest.raises(RunConfigError) as raised:
        code_to_ship(flow)
    text = str(raised.value)
    assert "\n" not in text and raised.value.setting == "code"
    assert "no_such_models_e" in text and "the build of model 'actor'" in text
    assert "searched" in text and str(Path.cwd()) in text
    assert "code=" in text  # the way out for what cannot be found


def test_an_op_of_the_script_being_run_says_to_move_it_into_a_module():
    def guess() -> Stream[int]:
        yield 1

    guess.__module__ = "__main__"
    with pytest.raises(RunConfigError, match="op 'guess' is defined in the script .*module of "
                       "its own") as raised:
        code_to_ship(_flow_of(op(guess)))
    assert "\n" not in str(raised.value)


def test_the_executor_puts_shipped_folders_first_on_its_import_path(tmp_path, monkeypatch):
    from executors.serve import load_code

    (tmp_path / "a").mkdir()
    _module_in(tmp_path / "a", "shipped_f")
    monkeypatch.setattr(sys, "path", list(sys.path))
    load_code([str(tmp_path / "a")])
    assert sys.path[0] == str((tmp_path / "a").resolve())
    assert importlib.import_module("shipped_f").reverse_prompts
    sys.modules.pop("shipped_f", None)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["its folder", "another folder"])
def test_a_newcomers_own_task_runs_from_python_without_code(tmp_path, where):
    """The issue's task: ops in their own module, `grpo_flow`, `flowkit.run` with no `code=`,
    run as a script from the module's folder or from another one (`python task/run_it.py`)."""
    folder = tmp_path / "task"
    folder.mkdir()
    _module_in(folder, "reverse_task")
    (folder / "run_it.py").write_text(textwrap.dedent("""
        import flowkit
        from flowkit import RunConfig
        from dataflows.grpo import grpo_flow
        from reverse_task import reverse_prompts, reverse_reward

        flow = grpo_flow(prompts=2, n=2, max_new_tokens=4, prompt_source=reverse_prompts,
                         reward=reverse_reward, gpt={"vocab_size": 128, "block_size": 16,
                                                     "n_layer": 2, "n_head": 2, "n_embd": 16})
        if __name__ == "__main__":
            print("done", flowkit.run(flow, RunConfig(steps=3, dashboard=False)).steps)
    """))
    cwd = folder if where == "its folder" else tmp_path
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # flowkit as installed: the fork server serves it
    done = subprocess.run([sys.executable, str(folder / "run_it.py")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "done 3" in done.stdout
