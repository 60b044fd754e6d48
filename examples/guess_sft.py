"""Supervised warm-up for the guessing game (dataflows/envs.py): the built-in GPT, two pipeline
stages, learns the game's format ("guess 1-8:" "4\\n" "higher\\n" "6\\n" ...) from a demonstrator
that ignores the feedback in 40 % of its guesses and, when it follows it, bisects what is still
possible in 60 % of them (any number still possible otherwise), so RL starts winning about half
its games and has the best play (binary search) within its reach:

    flowkit run examples/guess_sft.py --steps 300 --save-weights checkpoints
    flowkit run examples/guess_grpo.py --steps 40 --metrics guess.jsonl
"""

from dataflows.envs import GUESS_GPT, guess_transcripts
from dataflows.pretrain import pretrain_flow

flow = pretrain_flow(source=guess_transcripts,
                     source_config={"follow_fraction": 0.6, "bisect_fraction": 0.6},
                     batch_size=64, stages=2, microbatches=4, schedule="1f1b", gpt=GUESS_GPT,
                     lr=2e-3, model_name="actor", name="guess_sft")
