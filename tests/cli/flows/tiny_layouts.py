"""Pipeline pretraining of tiny float64 models deep enough to cut in 1 to 4 stages: the built-in
GPT (`flow`) and a Hugging Face Llama built from its config, offline (`llama`), for resuming a
checkpoint on another layout (tests/cli/test_layout_resume.py)."""

from pathlib import Path

from dataflows.pretrain import pretrain_flow
from flowkit.dsl import Model

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
