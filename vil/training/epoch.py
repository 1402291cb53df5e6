"""One epoch of training: the batches of this process, the steps (gradient accumulation, clipping, the
checkpoint that waits for a finite step), the ``LOG_FREQ`` lines, and the stop when a loss or gradient is not
finite."""

import logging
import math
import os
import time
from contextlib import nullcontext
from functools import partial

import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from tqdm import tqdm

from ..data import collate_skipping
from ..profiling import peak_memory_mib
from ..seeding import sample_seed, seeded_call
from ..shards import ShardDataset
from ..training_state import LAST
from ..unreadable import warn_held, warn_unreadable

log = logging.getLogger("vil")


def stop_diverged(run, what, where):
    """Stop the run because ``what`` is not finite (at ``where``), in one sentence that says what
    ``checkpoint_last.pth`` holds and how to go on (:func:`~vil.training.loop.train` writes it to ``log.txt``)."""
    last = os.path.join(run.cfg.OUTPUT_DIR, LAST)
    advice = "a lower OPTIM.LR (a resumed run follows it) or OPTIM.CLIP_GRAD set"
    if run.kept is None:
        held = f"no checkpoint was written yet, so start again with {advice}"
    elif run.kept.step == run.step:
        held = f"{last} holds the state it came from, {run.kept.where()}, so resume it with {advice}"
    else:
        held = (
            f"{last} keeps {run.kept.where()}, the newest state whose loss and gradients were finite: "
            f"run again with {advice}"
        )
    raise FloatingPointError(f"Training stops before optimizer step {run.step + 1}: {what} at {where}; {held}.")


def optimizer_step(run, where):
    """Check the gradients (unscaled, clipped to ``OPTIM.CLIP_GRAD``), write the checkpoint that waited for
    them, step the optimizer, the schedule and the EMA."""
    optimizer, scaler = run.optimizer, run.scaler
    scaler.unscale_(optimizer)
    if run.cfg.OPTIM.CLIP_GRAD > 0:
        norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.OPTIM.CLIP_GRAD)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in run.model.parameters() if p.grad is not None])
    finite = math.isfinite(norm)
    if not scaler.is_enabled() and not finite:  # fp16's scaler skips such steps by itself
        stop_diverged(run, f"the gradient norm became {norm.item()}", where)
    if run.pending:
        run.write_checkpoint(run.pending)
        run.pending = None
    run.lr = max(group["lr"] for group in optimizer.param_groups)  # before the schedule moves on
    scaler.step(optimizer)
    scaler.update()
    if not finite:  # skipped by fp16's scaler, which halves its scale: counted in the epoch's line
        run.scaler_skips += 1
        if scaler.get_scale() < 1:  # halved from 2**16 more often than it grew: not an overflow, a divergence
            stop_diverged(
                run,
                f"the float16 gradients stayed not finite while the gradient scaler lowered its scale to "
                f"{scaler.get_scale():g}",
                where,
            )
    optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.scheduler.step_update(run.schedule_step)
    if run.ema is not None:
        run.ema.update(run.model, step=run.step)


def train_one_epoch(run, epoch):
    """One epoch (or what is left of it after a mid-epoch resume); returns (images seen, images skipped, mean
    loss) over all processes."""
    cfg, runtime, accum = run.cfg, run.runtime, run.cfg.OPTIM.ACCUM_STEPS
    loader = training_batches(run, epoch)
    run.net.train()
    seen = skipped = loss_sum = 0.0
    run.scaler_skips = 0
    window = _new_window(time.perf_counter())  # since the last LOG_FREQ line
    bar = tqdm(loader, desc=f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}", disable=not runtime.is_main, leave=False)
    step_end = time.perf_counter()
    last_micro = True
    held = None if runtime.is_main else []  # the names this process met, for the main process to log
    for i, (images, targets, unreadable) in enumerate(bar, start=run.batch_in_epoch):
        fetched = time.perf_counter()
        window["data_s"] += fetched - step_end
        skipped += warn_unreadable(unreadable, held)
        where = f"epoch {epoch + 1}, batch {i + 1}"
        if not len(images):
            if held is not None:  # no other process will take part in warn_held
                warn_unreadable(unreadable)
            raise ValueError(
                f"All {len(unreadable)} images of the training batch at {where} are unreadable; "
                "check the data (the warnings above name them)."
            )
        images = images.to(runtime.device, memory_format=run.memory_format, non_blocking=True)
        targets = targets.to(runtime.device, non_blocking=True)
        if run.mixup is not None:
            images, targets = run.mixup(images, targets)
        last_micro = (i + 1) % accum == 0
        with run.net.no_sync() if runtime.world > 1 and not last_micro else nullcontext(), run.amp():
            loss = run.criterion(run.net(images), targets)
        (loss_mean,) = [x / runtime.world for x in runtime.sum(loss.item())]
        if not math.isfinite(loss_mean):
            stop_diverged(run, f"the loss became {loss_mean}", where)
        run.scaler.scale(loss / accum).backward()
        seen += len(images)
        loss_sum += loss_mean * len(images)
        window["loss"] += loss_mean * len(images)
        window["images"] += len(images) * runtime.world
        if last_micro:
            optimizer_step(run, where)
        step_end = time.perf_counter()
        window["step_s"] += step_end - fetched
        window["steps"] += last_micro
        bar.set_postfix(
            loss=f"{loss_mean:.4f}",
            lr=f"{run.lr:.2e}",
            img_s=f"{window['images'] / max(step_end - window['start'], 1e-9):.1f}",
        )
        if last_micro and cfg.LOG_FREQ and run.step % cfg.LOG_FREQ == 0:
            window = _log_steps(run, window, step_end)
        if last_micro and cfg.CHECKPOINT.EVERY_STEPS and run.step % cfg.CHECKPOINT.EVERY_STEPS == 0:
            run.pending = run.snapshot(epoch, i + 1)
    if not last_micro:  # an epoch ended early (batches_of_every_process) inside an optimizer step
        run.optimizer.zero_grad(set_to_none=True)
        log.warning(
            f"The gradients of the last {(i + 1) % accum} batch(es) of epoch {epoch + 1} make no step: dropped."
        )
    run.batch_in_epoch = 0
    warn_held(runtime, held or [])
    seen, skipped = runtime.sum(seen, skipped)
    return seen, skipped, loss_sum / max(seen / runtime.world, 1)


def training_batches(run, epoch):
    """The batches this process trains on in ``epoch``, from the one a resumed run stopped at. Image folders go
    through one loader for the whole run (its workers persist from epoch to epoch); shards through one per epoch."""
    cfg, runtime, collate = run.cfg, run.runtime, partial(collate_skipping, refill=True)
    accum = cfg.OPTIM.ACCUM_STEPS
    if isinstance(run.train_set, ShardDataset):
        stop = run.steps_per_epoch * accum
        batches = run.train_set.training_batches(
            epoch, runtime.rank, runtime.world, run.batch, cfg.DATALOADER.WORKERS, collate, run.batch_in_epoch, stop
        )
        return batches_of_every_process(batches, runtime, stop - run.batch_in_epoch, epoch)
    if run.train_loader is None:
        workers = cfg.DATALOADER.WORKERS
        run.train_loader = DataLoader(
            SeededSamples(run.train_set, cfg.SEED),
            batch_size=run.batch,
            sampler=EpochSampler(run.train_set, cfg.SEED, runtime, cfg.AUG.REPEATED_AUG, run.batch * accum),
            drop_last=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=runtime.device.type == "cuda",
            collate_fn=collate,
            # its own generator: starting workers then draws no number from the global random state
            generator=torch.Generator().manual_seed(cfg.SEED),
        )
    run.train_loader.sampler.set_epoch(epoch, run.batch_in_epoch * run.batch)
    return run.train_loader


def batches_of_every_process(batches, runtime, planned, epoch):
    """``batches`` (``planned`` of them), for as long as every process has one. A damaged shard loses the samples
    after the damage, so its process can run out of batches before the plan: the others would then wait in their
    next step's collectives for ever. Before each batch the processes count those that have one; where one has
    none, every process ends the epoch there, said once."""
    batches = iter(batches)
    for taken in range(planned):
        batch = next(batches, None)
        have = int(batch is not None)
        if runtime.world > 1:
            (have,) = runtime.sum(have)
        if have < runtime.world:
            if runtime.is_main:
                log.warning(
                    f"Epoch {epoch + 1} ends {planned - taken} of its batches early: "
                    f"{runtime.world - int(have)} of {runtime.world} process(es) ran out of samples (a damaged shard "
                    "loses the samples after the damage; the warnings above name it)."
                )
            return
        yield batch


def steps_per_epoch(train_set, cfg, runtime, batch):
    """The optimizer steps every epoch takes (a per-step schedule counts on them): whole steps of
    ``OPTIM.ACCUM_STEPS`` batches of ``batch`` samples, from the samples this process trains on."""
    accum = cfg.OPTIM.ACCUM_STEPS
    if isinstance(train_set, ShardDataset):
        return train_set.steps_per_epoch(cfg.OPTIM.EPOCHS, runtime.world, batch, cfg.DATALOADER.WORKERS, accum)
    return len(epoch_order(train_set, 0, cfg.SEED, runtime, cfg.AUG.REPEATED_AUG)) // (batch * accum)


REPEATS = 3  # the copies of each sample with AUG.REPEATED_AUG, as in the original release


class EpochSampler(Sampler):
    """The samples this process trains on in the epoch set by :meth:`set_epoch`, from sample ``skip`` on, as
    ``(epoch, index)`` pairs: :class:`SeededSamples` seeds each sample's augmentation by them. An epoch is whole
    optimizer steps of ``step_samples`` samples (the batch times ``OPTIM.ACCUM_STEPS``): the samples that do not
    fill one are left out, as ``drop_last`` leaves out those that do not fill a batch."""

    def __init__(self, dataset, seed, runtime, repeated_aug, step_samples):
        self.dataset, self.seed, self.runtime, self.step_samples = dataset, seed, runtime, step_samples
        self.repeated_aug, self.epoch, self.skip = repeated_aug, 0, 0

    def set_epoch(self, epoch, skip=0):
        """``skip``: the samples (whole batches) a resumed epoch has trained on already."""
        self.epoch, self.skip = epoch, skip

    def _order(self):
        order = epoch_order(self.dataset, self.epoch, self.seed, self.runtime, self.repeated_aug)
        return order[self.skip : len(order) - len(order) % self.step_samples]

    def __iter__(self):
        order = self._order()
        if not (self.repeated_aug and self.runtime.world > 1):
            return iter([(self.epoch, index) for index in order])
        # Repeated augmentation lists each index REPEATS times in a row and deals the list out to the processes in
        # turn: which copy a sample is joins its key, so that the copies get different augmentations.
        rank, world = self.runtime.rank, self.runtime.world
        return iter([(self.epoch, index, (rank + (self.skip + j) * world) % REPEATS) for j, index in enumerate(order)])

    def __len__(self):
        return len(self._order())


class SeededSamples(Dataset):
    """Sample ``(epoch, index)`` of ``dataset`` (or ``(epoch, index, copy)``, one of repeated augmentation's copies),
    loaded and augmented with random states seeded by ``(seed, epoch, index[, copy])``
    (:func:`~vil.seeding.seeded_call`): each sample gets the same augmentation whichever process or worker loads it,
    so a run resumed anywhere, with any number of workers, sees the same images."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index, *copy = key
        return seeded_call(sample_seed(self.seed, epoch, index, *copy), self.dataset.__getitem__, index)


def epoch_order(dataset, epoch, seed, runtime, repeated_aug=False):
    """The sample indices this process trains on in ``epoch``: a permutation seeded by seed and epoch (with
    ``repeated_aug`` in distributed training: timm's repeated-augmentation sampler, 3 repeats)."""
    if runtime.world > 1:
        if repeated_aug:
            # selected_round 0: every process takes len / world samples, as DistributedSampler (timm's default
            # rounds down to multiples of 256, which the epoch's step count would not match).
            sampler = RepeatAugSampler(
                dataset,
                num_replicas=runtime.world,
                rank=runtime.rank,
                shuffle=True,
                num_repeats=REPEATS,
                selected_round=0,
            )
            sampler.set_epoch(sample_seed(seed, epoch))  # its order is seeded by the epoch alone
        else:
            sampler = DistributedSampler(
                dataset, num_replicas=runtime.world, rank=runtime.rank, shuffle=True, seed=seed
            )
            sampler.set_epoch(epoch)
        return list(sampler)
    return torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _new_window(now):
    """The sums since the last ``LOG_FREQ`` line: loss x images, images (all processes), optimizer steps, and the
    seconds spent waiting for batches and computing steps."""
    return dict(loss=0.0, images=0, steps=0, data_s=0.0, step_s=0.0, start=now)


def _log_steps(run, window, now):
    """The ``LOG_FREQ`` line, also as TensorBoard points under ``train/``: since the last line, the mean loss,
    images/s, the mean seconds per optimizer step waiting for data and computing, the learning rate and the peak
    memory. Returns a fresh window."""
    steps = max(window["steps"], 1)
    scalars = {
        "loss": window["loss"] * run.runtime.world / max(window["images"], 1),
        "lr": run.lr,
        "images_per_s": window["images"] / max(now - window["start"], 1e-9),
        "data_s": window["data_s"] / steps,
        "step_s": window["step_s"] / steps,
        "max_memory_mib": peak_memory_mib(run.runtime.device),
    }
    log.info(f"step {run.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
    if run.step_writer:
        for name, value in scalars.items():
            run.step_writer.add_scalar(f"train/{name}", value, run.step)
    return _new_window(now)
