"""Executor processes and the ops they run (torch stages, a timed simulator). Arrives with the runtime."""
