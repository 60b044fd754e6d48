"""Ready-made flows written with the flowkit DSL: pipeline-parallel LM training, PPO, GRPO, RLOO
and REINFORCE++. Their model ops are declared in model_ops.py (each names an executor op of
flowkit/ops), their Python ops in rl/ and text.py."""
