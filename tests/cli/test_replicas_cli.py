"""`flowkit run --replicas`: a model trained by two replicas of its pipeline from the command
line, checkpointed and resumed to the same curve; the settings that cannot work are refused in
one line before anything starts."""

from __future__ import annotations

import pytest

from tests.cli.runs import PRETRAIN, metrics_lines, refused, run_ok


def _losses(path) -> list[float]:
    return [line["backprop/loss"] for line in metrics_lines(path)]


def test_a_checkpoint_of_two_replicas_resumes_to_the_same_curve(tmp_path):
    flags = ("--replicas", "2", "--executors", "torch")
    run_ok(PRETRAIN, *flags, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"),
           "--checkpoint-every", "2", "--metrics", str(tmp_path / "whole.jsonl"))
    step = sorted((tmp_path / "ck").iterdir())[0]
    run_ok(PRETRAIN, *flags, "--steps", "4", "--resume", str(step),
           "--metrics", str(tmp_path / "resumed.jsonl"))
    whole, resumed = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert len(whole) == 4 and resumed[-2:] == whole[-2:]


def test_fewer_microbatches_than_replicas_are_refused():
    out = refused(PRETRAIN, "--replicas", "8", "--executors", "torch")
    assert "runs 4 microbatch(es) a step" in out and "--microbatches 8" in out


def test_sharded_optimizer_states_checkpoint_and_resume(tmp_path):
    """Each replica saves only its shard of the optimizer states, and resumes it."""
    import torch

    flags = ("--replicas", "2", "--shard-optimizer", "--executors", "torch")
    run_ok(PRETRAIN, *flags, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"),
           "--checkpoint-every", "2", "--metrics", str(tmp_path / "whole.jsonl"))
    step = sorted((tmp_path / "ck").iterdir())[0]
    counts = []
    for part in sorted((step / "executors").iterdir()):
        state = torch.load(part / "state.pt" if part.is_dir() else part, weights_only=True)
        (entry,) = [m for m in state["models"] if m["optimizers"]]
        assert entry["shards"], part
        counts.append({i: len(o["state"]) for i, o in entry["optimizers"].items()})
    # exec-0 and exec-2 hold stage 0 of replicas 0 and 1, exec-1 and exec-3 stage 1: each
    # replica keeps a part of the stage's optimizer states, none all of them
    assert len(counts) == 4
    for first, second in ((counts[0], counts[2]), (counts[1], counts[3])):
        assert first.keys() == second.keys()
        for stage in first:
            assert 0 < first[stage] < first[stage] + second[stage]
            assert 0 < second[stage]
    run_ok(PRETRAIN, *flags, "--steps", "3", "--resume", str(step),
           "--metrics", str(tmp_path / "resumed.jsonl"))
    whole, resumed = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert resumed[-1:] == whole[-1:]


@pytest.mark.parametrize(("before", "after"), [
    (("--replicas", "2"), ("--replicas", "1")),
    (("--replicas", "1"), ("--replicas", "2")),
    # sharded states merged for one replica, or for two that do not shard, and cut for two
    (("--replicas", "2", "--shard-optimizer"), ("--replicas", "1")),
    (("--replicas", "2", "--shard-optimizer"), ("--replicas", "2")),
    (("--replicas", "1"), ("--replicas", "2", "--shard-optimizer"))],
    ids=["2-to-1", "1-to-2", "zero2-to-1", "zero2-to-2", "1-to-zero2"])
def test_a_checkpoint_resumes_at_another_replica_count(tmp_path, before, after):
    """[Note: resuming at another replica count]: the resumed run ends with the parameters of
    the run that went on as the checkpoint's (float64, 1e-10)."""
    import torch

    def run(folder, *flags):
        run_ok(PRETRAIN, "--executors", "torch", "--steps", "3", "--save-weights",
               str(tmp_path / folder), *flags)
        (path,) = (tmp_path / folder).glob("*.pt")
        return torch.load(path, weights_only=True)

    whole = run("whole", *before, "--checkpoint-dir", str(tmp_path / "ck"),
                "--checkpoint-every", "1")
    step = sorted((tmp_path / "ck").iterdir())[0]
    resumed = run("resumed", *after, "--resume", str(step))
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=1e-10)
