"""The training run from end to end: set up, resume, then epoch after epoch of training, evaluation and
checkpoints; at the end, the check that every process holds the same weights."""

import logging
import os
import time

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from ..optim import drop_learning_rate
from ..progress import log_lines_above_bars
from ..training_state import copy_epoch_checkpoints
from .epoch import train_one_epoch
from .evaluation import evaluate_epoch
from .setup import PLATEAU_OPTIMIZERS, log_failure, set_up

log = logging.getLogger("vil")


def train(cfg):
    """Train (or resume training) as ``cfg`` says; returns the final top-1 on the evaluation data (a run that has
    trained all its epochs already: its best)."""
    run, resume_point = set_up(cfg)
    logged = False  # whether this process logged an error of its own

    def another_process_stopped():
        """The sentence another process left when it stopped, as this run's error; or None."""
        left = run.runtime.failure_left()
        return None if left is None else ValueError(f"Another process stopped the run: {left}")

    def stopped_by_torchrun():
        """torchrun stops this process (SIGTERM) once another has failed, maybe before this one meets the failure in
        a collective call: the sentence the other left goes to log.txt and the console, which hear it from no one
        else then."""
        if not logged and (failure := another_process_stopped()) is not None:
            log.error(f"error: {failure}")

    with run.runtime.before_stopped(stopped_by_torchrun):
        try:
            if resume_point:
                run.resume(resume_point[1], resume_point[0])
                if run.epoch >= cfg.OPTIM.EPOCHS:
                    log.info(
                        f"{resume_point[0]} has trained all {cfg.OPTIM.EPOCHS} epochs (OPTIM.EPOCHS), best top-1 "
                        f"{run.best:.2f}: nothing is left to train; raise OPTIM.EPOCHS to train on."
                    )
                    return run.best
            return _train_epochs(run)
        except (ValueError, OSError, FloatingPointError) as e:
            logged = True
            run.runtime.leave_failure(e)
            log_failure(e)
            raise
        except RuntimeError:  # torch's words for a collective call another process left: its sentence, if it left one
            if (failure := another_process_stopped()) is None:
                raise
            log_failure(failure)
            logged = True
            raise failure from None
        finally:
            run.close()


def end_epoch(run, epoch, top1):
    """After an epoch's evaluation: the best top-1, ``OPTIM.VAL``'s learning-rate drop, the checkpoints (the
    mid-epoch one still waiting is superseded)."""
    cfg = run.cfg
    improved = top1 > run.best
    run.best = max(run.best, top1)
    if not improved and cfg.OPTIM.VAL and cfg.OPTIM.OPT in PLATEAU_OPTIMIZERS:
        run.lr_drop /= cfg.OPTIM.DROP_FACTOR
        drop_learning_rate(run.optimizer, run.lr_scales, run.lr_drop)
        log.info(
            f"Epoch {epoch + 1} did not improve top-1 (OPTIM.VAL): "
            f"the learning rate is divided by {cfg.OPTIM.DROP_FACTOR:g}."
        )
    run.pending = None
    run.flush_writers()  # the epoch's TensorBoard points on disk before its checkpoint
    run.write_checkpoint(run.snapshot(epoch + 1, 0, improved))
    if run.runtime.is_main:
        copy_epoch_checkpoints(cfg, epoch + 1, improved)


def _train_epochs(run):
    cfg, runtime, model, out = run.cfg, run.runtime, run.model, run.cfg.OUTPUT_DIR
    if runtime.is_main:
        # Each axis in a folder of its own, whose purge drops the points an interrupted run logged after the
        # checkpoint this one starts from (all of them where it starts afresh).
        board = os.path.join(out, "tensorboard")
        run.step_writer = SummaryWriter(os.path.join(board, "steps"), purge_step=run.step + 1)
        run.epoch_writer = SummaryWriter(os.path.join(board, "epochs"), purge_step=run.epoch + 1)
    log.info(
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(run.train_set)} training and "
        f"{len(run.test_set)} evaluation images, {runtime.world} process(es) on {runtime.device}."
    )
    mode_switch_epoch = cfg.MODEL.VIT.MSVIT.VIL_MODE_SWITCH * cfg.OPTIM.EPOCHS
    top1 = 0.0
    run.started = time.perf_counter(), run.epoch
    for epoch in range(run.epoch, cfg.OPTIM.EPOCHS):
        if epoch >= mode_switch_epoch and model.vil_mode > 0:  # once, at the first epoch past the switch
            model.reset_vil_mode(0)
            log.info(f"Epoch {epoch + 1}: random-shift training ends; every attention layer now uses mode 0.")
        if hasattr(model, "calls_since_last_redraw"):
            model.set_feature_redraw_interval(1 + 5 * epoch)  # performer: the original release's schedule
        run.scheduler.step(epoch)  # SOLVER.EPOCH_BASED_SCHEDULE; a per-step schedule ignores it
        start = time.perf_counter()
        with torch.autograd.set_detect_anomaly(cfg.SOLVER.DETECT_ANOMALY), log_lines_above_bars():
            seen, skipped, loss = train_one_epoch(run, epoch)
        top1 = evaluate_epoch(run, epoch, seen, skipped, loss, time.perf_counter() - start)
        end_epoch(run, epoch, top1)
    if runtime.world > 1:
        _check_ranks_agree(model, runtime)
    log.info(
        f"Best top-1 {run.best:.2f}. Checkpoints: {out}/checkpoint_last.pth, {out}/model_best.pth; "
        f"log: {out}/log.txt; TensorBoard: tensorboard --logdir {out}/tensorboard"
    )
    runtime.barrier()
    return top1


def _check_ranks_agree(model, runtime):
    """DistributedDataParallel keeps the replicas equal (parameters and buffers); say so, or fail loudly if they
    drifted apart."""
    total = torch.stack([t.detach().double().sum() for t in (*model.parameters(), *model.buffers())]).sum().reshape(1)
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low.item() != high.item():
        raise RuntimeError(
            f"The {runtime.world} processes ended with different weights (checksums {low.item()} to {high.item()}), "
            "which DistributedDataParallel should prevent; checkpoint_last.pth and model_best.pth hold the main "
            "process's (rank 0) weights: evaluate them before using them."
        )
    log.info(f"All {runtime.world} processes hold identical weights.")
