"""Ready-made flows written with the flowkit DSL: pipeline-parallel LM training, PPO, GRPO."""
