"""Python ops of the RL flows: prompts of a small verifiable task, rewards, advantages."""
