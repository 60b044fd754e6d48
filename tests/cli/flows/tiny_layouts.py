"""Pipeline pretraining of tiny float64 models deep enough to cut in 1 to 4 stages: the built-in
GPT (`flow`) and a Hugging Face Llama built from its config, offline (`llama`); and a fused GRPO
(`grpo`), for resuming a checkpoint on another layout (tests/cli/test_layout_resume.py)."""

from pathlib import Path

from dataflows.grpo import grpo_flow
from dataflows.pretrain import pretrain_flow
from dataflows.rl.tasks import sort_prompts
from flowkit.dsl import Model
from tests.cli.flows.tiny_grpo import TINY_GPT
from tests.torch.rl_ops import even_token_reward

CORPUS = Path(__file__).resolve().parents[3] / "examples" / "data" / "corpus.txt"
GPT4 = {"vocab_size": 256, "block_size": 16, "n_layer": 4, "n_head": 2, "n_embd": 16,
        "dtype": "float64"}
LLAMA = {"vocab_size": 256, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}
_SHAPE = {"corpus": str(CORPUS), "microbatches": 4, "schedule": "1f1b", "batch_size": 8,
          "seq_len": 16, "lr": 3e-3}

flow = pretrain_flow(stages=2, gpt=GPT4, **_SHAPE)

llama = pretrain_flow(model=Model(name="llama", build="executors.torch.models.hf:HFCausalLM",
                                  config={"architecture": "llama", "hf_config": LLAMA,
                                          "dtype": "float64", "seed": 1},
                                  stages=2, tags=("train",)), **_SHAPE)

# the actor's 2 layers in 1 or 2 stages; a reward every sample earns some of, so each step's
# advantages differ and the policy gradient moves the weights (sort_reward's is 0 here)
_GRPO = {"prompts": 4, "n": 4, "stages": 2, "microbatches": 2, "schedule": "1f1b",
         "max_new_tokens": 6, "kl_coef": 0.001, "lr": 1e-2, "prompt_source": sort_prompts,
         "reward": even_token_reward, "source_config": {"digits": 3}}
grpo = grpo_flow(gpt=TINY_GPT, **_GRPO)
# the same with LoRA adapters on the actor's attention (its base frozen), and run asynchronously
# (generation a weights version ahead of training)
lora = grpo_flow(model=Model(name="actor", build="executors.torch.models.gpt:GPT",
                             config={**TINY_GPT, "seed": 3}, stages=2, tags=("train",),
                             lora={"r": 2, "alpha": 4, "target_modules": ["c_attn", "c_proj"]}),
                 **{**_GRPO, "lr": 5e-2})
grpo_async = grpo_flow(gpt=TINY_GPT, max_staleness=1, **_GRPO)
