"""The runner: running a flow's steps on a controller's executors.

- flowrun.py: a flow's steps, node by node as the lowering says (stepstate.py: the step's items,
  steprun.py: one step's progress); flowtrain.py: a trained model's pipeline, optimizer step,
  weight sync (training.py: what each of those tasks is told; pipeline.py: a pipeline schedule
  as tasks; balance.py: stages by cost); asyncstate.py and partial.py: steps that overlap and
  calls carried between them; checkpoint.py: a run's state on disk.
"""
