"""What a training run writes so that it can continue, and continuing from it.

``OUTPUT_DIR`` holds ``checkpoint_last.pth`` (everything the run needs to continue: model, optimizer, gradient
scaler, EMA, counters, every process's random state, the config), ``checkpoint_epoch<N>.pth`` copies (the
newest ``CHECKPOINT.KEEP``) and ``model_best.pth``.

A state is written only after a pass on it came out finite: a mid-epoch checkpoint
(``CHECKPOINT.EVERY_STEPS``) waits for the next optimizer step's loss and gradients (with float16's gradient
scaler, the loss: the scaler skips a step whose gradients are not finite), an end-of-epoch one for the
evaluation's outputs. So ``checkpoint_last.pth`` never holds weights that already diverged.

A resumed run compares its config with the one stored in the checkpoint before it touches anything: keys in
:data:`FOLLOWED_ON_RESUME` (learning rate, schedule, epochs, logging, ...) may change and the run follows the
new values from where the checkpoint stands; any other change is refused in one sentence naming the keys.
"""

import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from .checkpoint import load_model_state, model_state, read_checkpoint, save_checkpoint, stored_config
from .config import config_items
from .files import atomic_write
from .model_config import mechanism_of
from .optim import drop_learning_rate
from .runtime import get_rng_state, set_rng_state

log = logging.getLogger("vil")
LAST = "checkpoint_last.pth"
BEST = "model_best.pth"
# Keys a run reads when it starts only: a resumed run may change them, and is told they are not read.
READ_AT_START = ("MODEL.MODEL_PATH", "MODEL.LOAD_EMA")
# Keys a resumed run may change (a key, or a section with all its keys): it follows their new values.
FOLLOWED_ON_RESUME = (
    "OPTIM.LR",
    "OPTIM.EPOCHS",
    "OPTIM.MOM",
    "OPTIM.NU",
    "OPTIM.WD",
    "OPTIM.WD0",
    "OPTIM.ADAM",
    "OPTIM.CLIP_GRAD",
    "OPTIM.DROP_FREQ",
    "OPTIM.DROP_FACTOR",
    "OPTIM.VAL",
    "SOLVER",
    "MODEL.EMA_DECAY",
    "MODEL.GRAD_CHECKPOINT",
    "MODEL.COMPILE",
    "MODEL.MODEL_PATH",
    "MODEL.LOAD_EMA",
    "DATA.PATH",
    "DATA.DATA_DIR",
    "DATALOADER.WORKERS",
    "AMP",
    "LOG_FREQ",
    "CHECKPOINT",
    "ONLY_SAVE_LAST",
    "OUTPUT_DIR",
    "OUTPUT_PERCLASS_ACC",
    "EVALUATE",
    "DISTRIBUTED_BACKEND",
    "BACKUP_LOG_DIR",
    "GATHER_ON_CPU",
)
_REQUIRED = ("net", "optimizer", "epoch", "batch_in_epoch", "step", "best_acc", "rng", "config")


def epoch_checkpoint_name(epoch):
    return f"checkpoint_epoch{epoch}.pth"


@dataclass
class Snapshot:
    """Where a run stood when a checkpoint was due: its counters, every process's random state and the model's
    buffers (a forward may change them: performer attention's feature draws). The weights, optimizer, scaler and
    EMA are read when the snapshot is written: no optimizer step comes in between."""

    epoch: int  # epochs completed, or the epoch in progress when batch_in_epoch > 0
    batch_in_epoch: int
    step: int
    best: float  # the best top-1 so far
    lr_drop: float  # the product of OPTIM.VAL's learning-rate drops so far
    rng: list  # every process's random state, in rank order
    buffers: dict = field(default_factory=dict)  # the model's state-dict buffers, copied (empty: read when written)
    improved: bool = False  # an epoch's end whose evaluation improved top-1: model_best.pth holds this checkpoint
    # The schedule's place is step + schedule_offset: a resume whose epochs take other steps than steps_per_epoch
    # (shards read by another number of processes, another OPTIM.EPOCHS) goes on from the epoch's place in its plan.
    steps_per_epoch: Optional[int] = None  # None: not recorded (an older checkpoint), taken as the run's
    schedule_offset: int = 0

    def where(self):
        if self.batch_in_epoch:
            return f"optimizer step {self.step} (epoch {self.epoch + 1}, batch {self.batch_in_epoch})"
        return f"optimizer step {self.step} (the end of epoch {self.epoch})"


def gather_rng_states(runtime):
    """Every process's random state, in rank order (every process takes part)."""
    if runtime.world == 1:
        return [get_rng_state()]
    states = [None] * runtime.world
    dist.all_gather_object(states, get_rng_state())
    return states


def write_snapshot(cfg, snapshot, model, optimizer, scaler, ema, classes):
    """Write ``checkpoint_last.pth`` from ``snapshot`` and the run's weights, optimizer, gradient scaler and EMA as
    they are now, with the training data's ``classes`` (names in label order); the main process writes it."""
    save_checkpoint(
        os.path.join(cfg.OUTPUT_DIR, LAST),
        model,
        entries=snapshot.buffers,
        arch=cfg.MODEL.ARCH,
        epoch=snapshot.epoch,
        batch_in_epoch=snapshot.batch_in_epoch,
        step=snapshot.step,
        best_acc=snapshot.best,
        lr_drop=snapshot.lr_drop,
        improved=snapshot.improved,
        steps_per_epoch=snapshot.steps_per_epoch,
        schedule_offset=snapshot.schedule_offset,
        optimizer=optimizer.state_dict(),
        scaler=scaler.state_dict(),
        ema=ema.module.state_dict() if ema else None,
        rng=snapshot.rng,
        config=cfg.dump(),
        classes=list(classes),
    )


def copy_epoch_checkpoints(cfg, epoch, improved):
    """After ``checkpoint_last.pth`` was written at the end of ``epoch``: ``model_best.pth`` when top-1
    improved, ``checkpoint_epoch<epoch>.pth`` (unless ``ONLY_SAVE_LAST``), and the oldest copies beyond
    ``CHECKPOINT.KEEP`` removed. Copying again what was copied before changes nothing: a resumed run does it, in
    case the run stopped between writing ``checkpoint_last.pth`` and its copies."""
    out = cfg.OUTPUT_DIR
    last = os.path.join(out, LAST)
    if improved:
        _copy(last, os.path.join(out, BEST))
    if cfg.ONLY_SAVE_LAST:
        return
    _copy(last, os.path.join(out, epoch_checkpoint_name(epoch)))
    for old in epoch_checkpoints(out, up_to=epoch)[cfg.CHECKPOINT.KEEP :]:
        os.remove(old)


def epoch_checkpoints(out, up_to=None):
    """The ``checkpoint_epoch<N>.pth`` files in ``out`` (those of epochs up to ``up_to``), newest first."""
    found = [
        (int(m.group(1)), name) for name in os.listdir(out) if (m := re.fullmatch(r"checkpoint_epoch(\d+)\.pth", name))
    ]
    return [os.path.join(out, name) for n, name in sorted(found, reverse=True) if up_to is None or n <= up_to]


def check_fresh_folder(out):
    """Refuse, in one sentence, to start a run in ``out`` where an earlier run left checkpoints but no
    ``checkpoint_last.pth`` to resume from: the new run would replace its ``model_best.pth`` and epoch copies."""
    left = ([BEST] if os.path.exists(os.path.join(out, BEST)) else []) + [
        os.path.basename(path) for path in epoch_checkpoints(out)
    ]
    if left:
        raise ValueError(
            f"{out} holds {', '.join(left)} of an earlier run but no {LAST} to resume from; a new run there would "
            "replace them, so choose another OUTPUT_DIR or move them away."
        )


def read_resume_point(out):
    """``(path, checkpoint)`` to resume from: ``checkpoint_last.pth``, or when that cannot be read, the newest
    readable epoch checkpoint (with a warning naming both); None when ``out`` has no ``checkpoint_last.pth``
    (epoch checkpoints alone are not resumed from)."""
    last = os.path.join(out, LAST)
    if not os.path.isdir(out) or not os.path.exists(last):
        return None
    try:
        return last, read_checkpoint(last)
    except ValueError as e:
        problem = str(e).rstrip(".")
    for path in epoch_checkpoints(out):
        try:
            checkpoint = read_checkpoint(path)
        except ValueError:
            continue
        log.warning(f"Resuming from {path}, the newest readable checkpoint, because {problem}.")
        return path, checkpoint
    raise ValueError(
        f"Cannot resume: {problem}, and {out} holds no readable epoch checkpoint; choose another OUTPUT_DIR to "
        "start afresh."
    )


def check_resumable(checkpoint, path, cfg, world=1):
    """Refuse, in one sentence, a checkpoint that is not this project's training checkpoint, has trained more epochs
    than ``OPTIM.EPOCHS``, was trained with another value of a key outside :data:`FOLLOWED_ON_RESUME`, or was
    written in the middle of an epoch by another number of processes than ``world``; log the followed keys that
    changed."""
    missing = [key for key in _REQUIRED if key not in checkpoint]
    if missing:
        raise ValueError(
            f"{path} is not a training checkpoint of this project (it has no {', '.join(missing)}); "
            "move it out of OUTPUT_DIR to start afresh, or choose another OUTPUT_DIR."
        )
    writers = len(checkpoint["rng"]) if checkpoint["batch_in_epoch"] else world  # one random state a process
    if writers != world:
        raise ValueError(
            f"{path} was written in the middle of epoch {checkpoint['epoch'] + 1} by {writers} process(es), whose "
            f"share of the epoch's samples {world} process(es) cannot go on with; resume with {writers} (from the "
            "epoch's end on, any number can go on)."
        )
    done, epochs = checkpoint["epoch"], cfg.OPTIM.EPOCHS
    if done > epochs or (done == epochs and checkpoint["batch_in_epoch"]):
        raise ValueError(
            f"{path} has trained {done} epochs{' and part of the next' if checkpoint['batch_in_epoch'] else ''}, "
            f"more than OPTIM.EPOCHS {epochs}; set OPTIM.EPOCHS to {done + 1} or more to train on, or choose another "
            "OUTPUT_DIR for a new run."
        )
    saved = _flat(stored_config(checkpoint, path))  # a training checkpoint holds one (_REQUIRED)
    now = _flat(cfg)
    changed = [key for key in sorted(saved.keys() | now.keys()) if saved.get(key) != now.get(key)]
    # Shards: each loading worker batches shards of its own, so the workers decide an epoch's batches and steps.
    workers_decide = now.get("DATA.FORMAT") == "shards" and "DATALOADER.WORKERS" in changed
    refused = [
        key
        for key in changed
        if not (_followed(key) or _another_backend(key, saved, now)) or (workers_decide and key == "DATALOADER.WORKERS")
    ]
    if refused:
        differences = ", ".join(f"{key} {saved.get(key)!r} (now {now.get(key)!r})" for key in refused)
        why = " (with DATA.FORMAT shards the loading workers decide an epoch's batches)" if workers_decide else ""
        raise ValueError(
            f"{path} was trained with {differences}{why}; "
            "set those values again to resume, or choose another OUTPUT_DIR for a new run."
        )
    followed = [key for key in changed if key not in READ_AT_START]
    if followed:
        log.info(
            "Resuming with new values, which the run follows from here: "
            + ", ".join(f"{key} {saved.get(key)!r} -> {now.get(key)!r}" for key in followed)
            + "."
        )
    unread = [key for key in changed if key in READ_AT_START]
    if unread:
        log.warning(
            f"{' and '.join(unread)} {'is' if len(unread) == 1 else 'are'} read when a run starts, not when it "
            f"resumes: this run goes on from {path}, not from {now.get('MODEL.MODEL_PATH') or 'other weights'}; "
            "choose another OUTPUT_DIR to start from them."
        )


def restore(checkpoint, path, model, optimizer, scaler, ema, rank):
    """Load the weights, optimizer, gradient scaler and EMA that ``checkpoint`` (read from ``path``) holds, and
    process ``rank``'s random state; returns the :class:`Snapshot` of where the run stood. The optimizer's
    hyper-parameters stay the run's, from the config (so a changed ``OPTIM.LR`` or schedule is followed);
    ``OPTIM.VAL``'s drops are kept."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    load_model_state(model, model_state(checkpoint, path), path)
    try:
        # The run's settings replace the saved ones before loading, so that torch places the state for them
        # (the step counts of fused kernels, say, which a checkpoint written without them keeps on the CPU).
        saved = checkpoint["optimizer"]["param_groups"]
        groups = [{**group, **fresh} for group, fresh in zip(saved, settings)] + saved[len(settings) :]
        optimizer.load_state_dict({**checkpoint["optimizer"], "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as e:
        raise ValueError(
            f"The optimizer state in {path} does not fit this run's optimizer ({str(e).rstrip('.')}); "
            "choose another OUTPUT_DIR for a new run."
        ) from None
    lr_drop = float(checkpoint.get("lr_drop", 1.0))
    drop_learning_rate(optimizer, [fresh.get("lr_scale", 1.0) for fresh in settings], lr_drop)
    if checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    if ema is not None and checkpoint.get("ema"):
        ema.module.load_state_dict(checkpoint["ema"])
    epoch, batch_in_epoch, step, best = (checkpoint[k] for k in ("epoch", "batch_in_epoch", "step", "best_acc"))
    restore_rng_state(checkpoint["rng"], rank)
    improved = bool(checkpoint.get("improved", False))
    schedule = dict(
        steps_per_epoch=checkpoint.get("steps_per_epoch"), schedule_offset=checkpoint.get("schedule_offset", 0)
    )
    snapshot = Snapshot(epoch, batch_in_epoch, step, best, lr_drop, checkpoint["rng"], improved=improved, **schedule)
    log.info(f"Resumed from {path}: {snapshot.where()}.")
    return snapshot


def restore_rng_state(states, rank):
    """Process ``rank``'s saved random state. A run resumed (at an epoch's end) with more processes than wrote
    ``states`` has none for the new ranks: they keep the state they were seeded with, ``SEED + rank``, so that no
    two processes draw the same dropout and augmentation."""
    if rank < len(states):
        set_rng_state(states[rank])


def _followed(key):
    return any(key == k or key.startswith(k + ".") for k in FOLLOWED_ON_RESUME)


def _another_backend(key, saved, now):
    """Whether ``key`` is ATTN_TYPE naming another backend (or another name of one) of the same attention: the
    same model, computed otherwise, which a resumed run may follow."""
    if key != "MODEL.VIT.MSVIT.ATTN_TYPE" or key not in saved or key not in now:
        return False
    mechanism = mechanism_of(saved[key])
    return mechanism is not None and mechanism == mechanism_of(now[key])


def _flat(cfg):
    """Every key's value, tuples as lists (a YAML round trip may turn one into the other)."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in config_items(cfg)}


def _copy(source, target):
    with open(source, "rb") as src:
        atomic_write(target, lambda f: shutil.copyfileobj(src, f))
