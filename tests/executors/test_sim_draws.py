"""The simulator's made-up values [Note: simulator draws in executors/sim/ops.py]: a function of a
sample's identity alone, the same on any machine, with the laws the benches rely on."""

from __future__ import annotations

import statistics

from executors.sim.ops import _draws, _normal, _sampled_length, _uniform, sample_rollout
from flowkit.ops.records import Prompt


def test_the_first_bytes_do_not_depend_on_how_many_are_drawn() -> None:
    assert _draws("3/1/2").digest(100)[:16] == _draws("3/1/2").digest(16)
    assert _draws("3/1/2").digest(16) != _draws("3/1/3").digest(16)


def test_uniforms_lie_in_the_half_open_unit_interval() -> None:
    assert _uniform(b"\0" * 8) == 0.0
    assert 0.0 < _uniform(b"\xff" * 8) < 1.0
    assert _uniform(b"\0" * 8 + b"\xff" * 8, at=8) == _uniform(b"\xff" * 8)


def test_a_sample_is_pinned_so_that_a_change_of_draws_shows() -> None:
    rollout = sample_rollout(Prompt(prompt_id=7, tokens=[1, 2], answer="3"), 2, step=5,
                             max_new_tokens=32)
    assert len(rollout.response_tokens) == 29
    assert rollout.response_tokens[:5] == [113, 79, 50, 51, 38]
    assert rollout.logprobs[:2] == [-1.4705882352941175, -0.4]
    assert all(-3.0 <= lp <= 0.0 for lp in rollout.logprobs)
    assert all(32 <= t < 127 for t in rollout.response_tokens)


def test_exponential_lengths_average_a_quarter_of_the_budget_with_a_tail_at_it() -> None:
    lengths = [_sampled_length(_draws(f"{i}").digest(16), 1, 32) for i in range(20_000)]
    assert 8.0 < statistics.mean(lengths) < 8.8  # E[floor(X) + 1], X exponential of mean 8
    assert 0.018 < sum(n == 32 for n in lengths) / len(lengths) < 0.024  # P(X >= 31) = 0.021
    assert min(lengths) == 1


def test_log_normal_lengths_have_their_median_at_an_eighth_of_the_budget() -> None:
    lengths = [_sampled_length(_draws(f"{i}").digest(16), 1, 256, sigma=1.0)
               for i in range(20_000)]
    assert 30 <= statistics.median(lengths) <= 33  # floor of a log-normal whose median is 32
    normals = [_normal(_draws(f"n{i}").digest(16)) for i in range(20_000)]
    assert abs(statistics.mean(normals)) < 0.03 and abs(statistics.stdev(normals) - 1) < 0.03
