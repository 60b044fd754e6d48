"""A run's checkpoints, in one place:

- format.py: what a checkpoint folder holds (manifest, the controller's state, each executor's)
  and reading it back [Note: run checkpoints]; writer.py: writing one, begun at a step boundary
  and finished once the open steps have generated; restore.py: checking and resuming from one.
- controller_state.py: the controller's part (`RunState`) and its schema; state_codec.py: its
  msgpack codec and private files [Note: run state on disk].
- open_steps.py: what a checkpoint of an asynchronous run holds of its open steps, and their
  replay [Note: checkpoints of asynchronous runs].
- policy.py: when to checkpoint, and Ctrl-C that finishes the step first; restarts.py: lost
  executors replaced from the newest checkpoint [Note: executor restarts].
- adaptor.py: the flow runner as its checkpoints see it (`RunnerCheckpoints`).
"""
