"""A stage's update, from accumulated gradients to new weights: one home for every kind of run.

    updater.py    Updater: the optimizer, Error Feedback, the LR schedule of parameters updated together
    gradients.py  dp averaging and the squared gradient norm (a device tensor), and its one host read
    rule.py       UpdateRule: clip, step, or skip a non-finite update — the same rule for every run
    report.py     StepReport: what a step reports of its updates (norms, ages, skips)
    together.py   stages that update together: a synchronous flush, the emulator's units
    held.py       HeldNorms and GlobalClipping: updates held for the pipeline's global norm, and when
                  each must be applied (the runtime and the schedule checker ask the same rule)
    versions.py   VersionedStage: weight versions an asynchronous stage's microbatches are bound to
    stage.py      StageUpdate: an asynchronous stage's update, as the runtime calls it (StageUpdater)

It imports nothing from the schedules or the executors above it: the asynchronous runtime calls a
StageUpdater, the executors build the pieces. Import the modules themselves: this package's own import
stays light, so that the schedule checks, which need only held.py's rule, do not load the optimizers.
"""
