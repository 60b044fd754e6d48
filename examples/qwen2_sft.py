"""Supervised warm-up of the Hugging Face example: a tiny Qwen2 (examples/qwen2_build.py) in
two pipeline stages learns the chat format and the answers of a demonstrator that multiplies
four times in five ("3+5" -> "15") and adds the fifth time, so it starts RL knowing the format
but mostly wrong ([Note: noisy warm-up] in dataflows/rl/tasks.py):

    python examples/qwen2_build.py models/qwen2-tiny
    flowkit run examples/qwen2_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/qwen2_grpo.py --steps 40 --metrics qwen2-grpo-metrics.jsonl

--save-weights writes the trained model as a Hugging Face folder, checkpoints/actor (config,
safetensors and the tokenizer), which the GRPO step starts from.
"""

from dataflows.datasets import chat_sft_sequences
from dataflows.pretrain import pretrain_flow
from flowkit.dsl import Model

MODEL = "models/qwen2-tiny"

actor = Model(name="actor", build="hf", config={"path": MODEL}, stages=2, tags=("train",))
# the longest demonstration, chat-formatted, is 16 tokens with its EOS; shorter ones are
# padded with EOS, which like the prompt the loss skips (completion-only loss)
flow = pretrain_flow(model=actor, source=chat_sft_sequences,
                     source_config={"path": "examples/data/arithmetic_sft.jsonl",
                                    "tokenizer": MODEL, "seq_len": 16},
                     batch_size=64, microbatches=4, schedule="1f1b", lr=2e-3, name="qwen2_sft")
