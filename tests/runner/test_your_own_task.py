"""The tutorial docs/your-own-task.md runs: its task module (examples/reverse_task.py, whose
parts the page shows) and its Python script, taken from the page, as a newcomer would run them
[Note: shipped code in flowkit/runner/flowcode.py]: beside the module, no `code=`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from flowkit.ops.records import Rollout, Scored

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "your-own-task.md"
TASK = ROOT / "examples" / "reverse_task.py"


@pytest.fixture(scope="module")
def task():
    sys.path.insert(0, str(TASK.parent))
    try:
        import reverse_task
        yield reverse_task
    finally:
        sys.path.remove(str(TASK.parent))
        sys.modules.pop("reverse_task", None)


def _rollout(response: bytes, answer: str = "914") -> Rollout:
    return Rollout(prompt_id=0, sample=1, prompt_tokens=list(b"rev 419:"),
                   response_tokens=list(response), logprobs=[-0.1] * len(response),
                   answer=answer, versions=[0] * len(response))


def test_the_prompts_are_new_every_step_and_the_same_for_a_step(task):
    prompts = list(task.reverse_prompts.fn(count=16, step=3))
    assert len(prompts) == 16 and [p.prompt_id for p in prompts] == list(range(16))
    first = prompts[0]
    digits = bytes(first.tokens).decode()[len("rev "):-1]
    assert first.answer == digits[::-1]
    assert prompts == list(task.reverse_prompts.fn(count=16, step=3))
    assert prompts != list(task.reverse_prompts.fn(count=16, step=4))


@pytest.mark.parametrize(("response", "reward"), [
    (b"914\n", 1.0), (b"914", 0.0), (b"419\n", 0.0), (b"914\n\n", 0.0)])
def test_the_reward_is_exact_match_then_eos(task, response, reward):
    rollout = _rollout(response)
    scored = task.reverse_reward.fn(rollout)
    assert isinstance(scored, Scored) and scored.reward == reward
    # the Scored is its Rollout's fields and the reward, as the page says
    assert attrs.asdict(scored, recurse=False) == {**attrs.asdict(rollout, recurse=False),
                                                   "reward": reward, "task_reward": None}


def test_the_page_shows_the_task_modules_parts():
    text = PAGE.read_text(encoding="utf-8")
    shown = re.findall(r'--8<-- "examples/reverse_task.py:(\w+)"', text)
    source = TASK.read_text(encoding="utf-8")
    assert set(shown) == {"prompts", "reward", "warmup_data", "warmup", "flow"}
    for name in shown:
        assert f"[start:{name}]" in source and f"[end:{name}]" in source


def _script_on_the_page(steps: int) -> str:
    """The page's `run_reverse.py`, with every run cut to `steps` steps."""
    text = PAGE.read_text(encoding="utf-8")
    script = re.search(r"```python\n(# run_reverse\.py\n.*?)```", text, re.DOTALL).group(1)
    return re.sub(r"steps=\d+", f"steps={steps}", script)


@pytest.mark.slow
def test_the_pages_script_runs_the_warm_up_then_grpo_from_another_folder(tmp_path):
    folder = tmp_path / "mytask"
    folder.mkdir()
    shutil.copy(TASK, folder / "reverse_task.py")
    (folder / "run_reverse.py").write_text(_script_on_the_page(steps=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # flowkit as installed: the fork server serves it
    done = subprocess.run([sys.executable, str(folder / "run_reverse.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "actor.pt").is_file()  # the warm-up's, GRPO starts there
    assert re.search(r"^2 steps, reward [0-9.]+$", done.stdout, re.MULTILINE), done.stdout[-2000:]
