"""Benchmarks that measure flowkit against baselines taken side by side in the same run.

They stand outside the library: `flowkit bench` imports each when it runs it, and nothing in
flowkit below its commands imports them (pyproject.toml's import contracts)."""
