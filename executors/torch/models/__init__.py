"""Built-in models for the torch executor."""

from executors.torch.models.gpt import GPT, GPTConfig, split_gpt

__all__ = ["GPT", "GPTConfig", "split_gpt"]
