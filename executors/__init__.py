"""Executor processes and the ops they run. process.py serves a controller and runs each task's
op from the op table (optable.py: built-in ops and plugins); kinds.py says which ops a kind loads:
the timed simulator (sim/) or torch stages (torch/). The ops they implement for flows are
declared in flowkit/ops; serve.py is the process's command line."""
