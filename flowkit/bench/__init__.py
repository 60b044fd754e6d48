"""Benchmarks that measure flowkit against baselines taken side by side in the same run."""
