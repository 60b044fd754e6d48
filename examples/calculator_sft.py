"""Supervised warm-up for the calculator example (dataflows/envs.py, dataflows/tools.py): the
built-in GPT learns the format of answers to "123*45=", from a demonstrator that calls the
calculator ("calculator(123*45)", then copies its result) in only a quarter of them, otherwise
answers with a number whose first two digits are right:

    flowkit run examples/calculator_sft.py --steps 800 --save-weights checkpoints
    flowkit run examples/calculator_grpo.py --steps 40 --metrics calculator.jsonl
"""

from dataflows.envs import CALCULATOR_GPT, calculator_transcripts
from dataflows.pretrain import pretrain_flow

flow = pretrain_flow(source=calculator_transcripts, source_config={"call_fraction": 0.25},
                     batch_size=64, stages=2, microbatches=4, schedule="1f1b",
                     gpt=CALCULATOR_GPT, lr=2e-3, model_name="actor", name="calculator_sft")
