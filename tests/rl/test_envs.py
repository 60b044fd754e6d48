"""The ready-made game's demonstrator (dataflows/envs.py): its transcripts are games as the
engine renders them, and the share of guesses that bisect is what it says."""

from __future__ import annotations

import re

from dataflows.envs import guess_transcripts


def _games(**settings) -> list[list[tuple[int, str]]]:
    """Each transcript as (guess, the environment's answer) pairs, decoded from its ids."""
    games = []
    for ids in guess_transcripts.fn(sequences=64, **settings):
        text = bytes(t if t >= 0 else ~t for t in ids.tolist()).rstrip(b"\0").decode()
        games.append([(int(g), a) for g, a in re.findall(r"(\d+)\n(higher|lower|)", text)])
    return games


def test_a_demonstrator_that_always_bisects_plays_binary_search():
    for game in _games(follow_fraction=1.0, bisect_fraction=1.0):
        lo, hi = 1, 8
        for guess, answer in game:
            assert guess == (lo + hi) // 2
            lo, hi = (guess + 1, hi) if answer == "higher" else (lo, guess - 1)


def test_the_transcripts_answers_are_a_games():
    """Some secret fits every answer; a game ends when it is guessed, or after 3 guesses."""
    for game in _games(follow_fraction=0.6, bisect_fraction=0.6):
        secrets = set(range(1, 9))
        for guess, answer in game:
            secrets &= ({s for s in secrets if s > guess} if answer == "higher" else
                        {s for s in secrets if s < guess} if answer == "lower" else {guess})
        assert secrets and len(game) <= 3 and (game[-1][1] == "" or len(game) == 3)


def test_bisecting_nothing_keeps_the_transcripts_they_were():
    assert all((a == b).all() for a, b in zip(
        guess_transcripts.fn(sequences=16), guess_transcripts.fn(sequences=16,
                                                                 bisect_fraction=0.0)))
