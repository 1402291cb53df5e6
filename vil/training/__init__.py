"""Training: one process, or one per device under ``torchrun`` (DistributedDataParallel).

A run is set up (:mod:`vil.training.setup`: output folder, config, data, model, optimizer), continues from
``OUTPUT_DIR/checkpoint_last.pth`` when there is one (:mod:`vil.training_state`) or starts, from random weights
or from those of ``MODEL.MODEL_PATH`` (:mod:`vil.weights`), then trains epoch after epoch
(:mod:`vil.training.loop`): one epoch of training (:mod:`vil.training.epoch`), its evaluation
(:mod:`vil.training.evaluation`, which also evaluates a checkpoint for ``tools/eval.py``), the checkpoints.

Everything a run needs to continue is in ``checkpoint_last.pth``; running the same command again resumes from
it, and never again from ``MODEL.MODEL_PATH``. The sample order of an epoch depends only on ``SEED`` and the
epoch, and each sample's augmentation only on ``SEED``, the epoch and the sample (:mod:`vil.seeding`), so a
resumed run repeats bit for bit what an uninterrupted one would have done, from a mid-epoch checkpoint too and
with any number of data-loading workers (with shards, the number it started with).
A loss that is not finite stops the run before the optimizer step and before any checkpoint of that state;
so does a gradient that is not finite, except under float16 AMP (AMP.ENABLED with AMP.DTYPE float16), whose
gradient scaler skips that step instead (the weights stay as they were; the epoch's log line counts such steps,
and gradients that stay not finite until the scale falls below 1 stop the run).
"""
