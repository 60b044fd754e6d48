"""Builds the Hugging Face example's model folder offline: a BPE tokenizer trained on the
arithmetic data, with a chat template and <|im_end|> as EOS, beside a tiny random Qwen2
(tied embeddings, as Qwen2's small models), both written with save_pretrained:

    python examples/qwen2_build.py models/qwen2-tiny
    python examples/qwen2_build.py models/qwen2-tiny --vllm   # head size 32, for vLLM on a CPU

`python examples/qwen2_build.py --data examples/data` writes the two jsonl files again (the
RL prompts with their answers, and the noisy demonstrations of the supervised warm-up); they
are shipped, so this is only needed to change them. [Note: noisy warm-up] in
dataflows/rl/tasks.py says why the demonstrations are mostly wrong.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# Qwen2's chat format: each message "<|im_start|>ROLE\nTEXT<|im_end|>\n"; the assistant's turn
# ends at <|im_end|>, which is therefore the tokenizer's EOS
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# small enough for a GRPO step in well under a second on two CPU cores
QWEN2_TINY = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": True, "rope_theta": 10000.0}
# the same width in 2 heads of 32 (1 KV head): vLLM's CPU attention runs no head of 16
QWEN2_TINY_VLLM = {**QWEN2_TINY, "num_attention_heads": 2, "num_key_value_heads": 1}


def arithmetic_rows(*, count: int, seed: int, correct_fraction: float = 1.0) -> list[dict]:
    """Sums of two digits, "3+5" -> "8". With `correct_fraction` < 1 a demonstrator that
    multiplies instead ("15") in the other cases: a wrong answer of the right format."""
    rng = random.Random(f"arithmetic/{seed}")
    rows = []
    for _ in range(count):
        a, b = rng.randrange(10), rng.randrange(10)
        right = rng.random() < correct_fraction
        rows.append({"prompt": f"{a}+{b}", "answer": str(a + b if right else a * b)})
    return rows


def write_data(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("arithmetic.jsonl", arithmetic_rows(count=1000, seed=0)),
                       ("arithmetic_sft.jsonl",
                        arithmetic_rows(count=4000, seed=1, correct_fraction=0.2))):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_tokenizer(texts: list[str], *, vocab_size: int = 300,
                    chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE trained on `texts` (the chat-formatted examples), with <|im_end|> as
    EOS, <|endoftext|> as padding and `chat_template` (None: no template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=chat_template)


def build(folder: Path, *, data: Path, seed: int = 0, shape: dict | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    rows = [json.loads(line) for line in (data / "arithmetic_sft.jsonl").read_text().splitlines()]
    texts = [f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n"
             f"{r['answer']}<|im_end|>\n" for r in rows]
    tokenizer = build_tokenizer(texts)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         **(shape or QWEN2_TINY))
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main(argv: list[str]) -> None:
    here = Path(__file__).parent / "data"
    if argv[:1] == ["--data"]:
        write_data(Path(argv[1]) if len(argv) > 1 else here)
    elif len(argv) == 1:
        build(Path(argv[0]), data=here)
    elif len(argv) == 2 and argv[1] == "--vllm":
        build(Path(argv[0]), data=here, shape=QWEN2_TINY_VLLM)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
