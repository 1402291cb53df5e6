"""Training and evaluation: one process, or one per device under ``torchrun`` (DistributedDataParallel).

A run is set up (:func:`set_up`: output folder, config, data, model, optimizer), continues from
``OUTPUT_DIR/checkpoint_last.pth`` when there is one (:mod:`vil.training_state`) or starts, from random
weights or from those of ``MODEL.MODEL_PATH``, then trains epoch after epoch (:func:`train_one_epoch`,
:func:`evaluate_epoch`, :func:`end_epoch`).

Everything a run needs to continue is in ``checkpoint_last.pth``; running the same command again resumes from
it, and never again from ``MODEL.MODEL_PATH``. The sample order of an epoch depends only on ``SEED`` and the
epoch, so a resumed run repeats exactly what an uninterrupted one would have done (from a mid-epoch
checkpoint, bit for bit with ``DATALOADER.WORKERS 0``; data-loading workers restart their random streams).
A loss or gradient that is not finite stops the run before the optimizer step and before any checkpoint of
that state.
"""

import datetime
import json
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from timm.data.distributed_sampler import RepeatAugSampler
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from .checkpoint import ema_state, load_model_state, model_state, read_checkpoint
from .config import warn_compatibility_keys
from .data import build_dataset, build_mixup, collate_skipping
from .files import FolderLock, atomic_write, check_writable_file, check_writable_folder, remove_temporaries
from .loss import build_loss
from .models import arch_string, build_model, parse_arch, pretrained_checkpoint
from .models.attention import LongformerAttention
from .models.convert import fit_to_model
from .optim import build_optimizer, build_scheduler, drop_learning_rate, model_ema
from .runtime import Runtime, seed_everything
from .shards import ShardDataset
from .training_state import (
    LAST,
    check_resumable,
    copy_epoch_checkpoints,
    read_resume_point,
    restore,
    take_snapshot,
    write_snapshot,
)

log = logging.getLogger("vil")
MEMORY_FORMATS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
# OPTIM.VAL lowers the learning rate of these optimizers only, as in the original release.
PLATEAU_OPTIMIZERS = ("sgd", "qhm")


def setup_logging(output_dir, is_main):
    log.handlers.clear()
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    log.propagate = False
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(console)
    if is_main:
        file = logging.FileHandler(os.path.join(output_dir, "log.txt"))
        file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(file)


def epoch_order(dataset, epoch, seed, runtime, repeated_aug=False):
    """The sample indices this process trains on in ``epoch``: a permutation seeded by seed and epoch (with
    ``repeated_aug`` in distributed training: timm's repeated-augmentation sampler, 3 repeats)."""
    if runtime.world > 1:
        if repeated_aug:
            # selected_round 0: every process takes len / world samples, as DistributedSampler (timm's default
            # rounds down to multiples of 256, which the epoch's step count would not match).
            sampler = RepeatAugSampler(
                dataset, num_replicas=runtime.world, rank=runtime.rank, shuffle=True, selected_round=0
            )
        else:
            sampler = DistributedSampler(
                dataset, num_replicas=runtime.world, rank=runtime.rank, shuffle=True, seed=seed
            )
        sampler.set_epoch(epoch)
        return list(sampler)
    return torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def per_process_batch(cfg, runtime):
    """``DATALOADER.BSZ`` is the batch of all processes together, as in the original release."""
    batch = cfg.DATALOADER.BSZ
    if batch % runtime.world:
        raise ValueError(
            f"DATALOADER.BSZ {batch} is the batch of all {runtime.world} processes together, "
            f"so it must be a multiple of {runtime.world}."
        )
    return batch // runtime.world


@torch.no_grad()
def evaluate(model, loader, runtime, amp, num_classes, memory_format=torch.contiguous_format):
    """Top-1 and top-5 accuracy (percent) over the whole evaluation set, all processes together, and per class:
    ``{"top1", "top5", "per_class": (classes, 3) tensor of images, top-1 hits, top-5 hits, "nonfinite": images
    whose outputs are not all finite}``. Unreadable images are skipped, each named in a warning."""
    model.eval()
    counts = torch.zeros(num_classes, 3, dtype=torch.float64, device=runtime.device)
    skipped, nonfinite = 0, torch.zeros((), dtype=torch.long, device=runtime.device)
    for images, targets, unreadable in loader:
        skipped += _warn_unreadable(unreadable)
        if not len(images):
            continue
        images, targets = images.to(runtime.device, memory_format=memory_format), targets.to(runtime.device)
        with amp():
            logits = model(images).float()
        nonfinite += (~torch.isfinite(logits).all(dim=1)).sum()
        ranks = logits.topk(min(5, num_classes), dim=1).indices.eq(targets[:, None])
        hits = torch.stack([torch.ones_like(ranks[:, 0]), ranks[:, 0], ranks.any(dim=1)], dim=1)
        counts.index_add_(0, targets, hits.double())
    if runtime.world > 1:
        dist.all_reduce(counts)
    skipped, nonfinite = runtime.sum(skipped, nonfinite.item())
    if skipped:
        log.warning(f"Evaluation skipped {int(skipped)} unreadable images.")
    images, top1, top5 = counts.sum(dim=0).tolist()
    return {
        "top1": 100 * top1 / max(images, 1),
        "top5": 100 * top5 / max(images, 1),
        "per_class": counts.cpu(),
        "nonfinite": int(nonfinite),
    }


def _warn_unreadable(unreadable):
    """Name each unreadable image in a warning; returns how many there were."""
    for name in unreadable:
        log.warning(f"Skipped unreadable image {name}.")
    return len(unreadable)


def eval_loader(dataset, cfg, runtime):
    """Each process evaluates every world-th sample (of shards: its own shards), so that all samples count
    exactly once."""
    if isinstance(dataset, ShardDataset):
        return dataset.evaluation_batches(
            runtime.rank, runtime.world, per_process_batch(cfg, runtime), cfg.DATALOADER.WORKERS, collate_skipping
        )
    indices = list(range(runtime.rank, len(dataset), runtime.world))
    return DataLoader(
        torch.utils.data.Subset(dataset, indices),
        batch_size=per_process_batch(cfg, runtime),
        num_workers=cfg.DATALOADER.WORKERS,
        collate_fn=collate_skipping,
    )


def amp_context(cfg, device):
    """Autocast for AMP on CUDA (bf16, or fp16 with gradient scaling), and the gradient scaler, which is a
    pass-through unless fp16 needs it."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.AMP.DTYPE]
    on = cfg.AMP.ENABLED and device.type == "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=on and dtype == torch.float16)
    return ((lambda: torch.autocast("cuda", dtype=dtype)) if on else nullcontext), scaler


def memory_format(cfg):
    """``AMP.MEMORY_FORMAT``: ``nchw`` (PyTorch's default layout) or ``nhwc`` (channels last)."""
    return MEMORY_FORMATS[cfg.AMP.MEMORY_FORMAT]


def resolve_model_path(cfg):
    """``MODEL.MODEL_PATH``; when that is not a file, the same path under ``DATA.DATA_DIR`` (as the original
    release looked it up), or the checkpoint of a pretrained tag (``vil_small.in1k``), downloaded once."""
    path = cfg.MODEL.MODEL_PATH
    for candidate in (path, os.path.join(cfg.DATA.DATA_DIR, path)):
        if os.path.isfile(candidate):
            return candidate
    downloaded = pretrained_checkpoint(path)
    if downloaded:
        return downloaded
    raise FileNotFoundError(
        f"Checkpoint {path} does not exist (nor under DATA.DATA_DIR {cfg.DATA.DATA_DIR}), and is "
        "not a pretrained tag (timm.list_pretrained('vil*') lists them)."
    )


def load_weights(model, cfg, new_classifier=False):
    """Load the weights of ``MODEL.MODEL_PATH`` (this project's checkpoint, the original release's, a bare state
    dict; its EMA weights with ``MODEL.LOAD_EMA``) into ``model``, position tables resized to the model's image
    size. With ``new_classifier``, a classifier of another class count stays the model's fresh one, and the
    log says so; otherwise it is refused with the rest of a checkpoint that does not fit."""
    path = resolve_model_path(cfg)
    checkpoint = read_checkpoint(path)
    state = fit_to_model(
        ema_state(checkpoint, path) if cfg.MODEL.LOAD_EMA else model_state(checkpoint, path), model, path
    )
    head = {k: v.shape for k, v in state.items() if k.startswith("head.")}
    if head != {k: v.shape for k, v in model.state_dict().items() if k.startswith("head.")}:
        found = f"a classifier for {head['head.weight'][0]} classes" if "head.weight" in head else "no classifier"
        if not new_classifier:
            raise ValueError(
                f"Checkpoint {path} has {found}, "
                f"not one for the DATA.NUM_CLASSES {model.num_classes} classes of this model."
            )
        log.info(f"Checkpoint {path} has {found}: this run trains a new one for DATA.NUM_CLASSES {model.num_classes}.")
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    load_model_state(model, state, path, may_miss=("head.",))
    return path


def _training_net(model, cfg, runtime):
    """What the training step calls: the model, wrapped for several processes, compiled with ``MODEL.COMPILE``."""
    net = DistributedDataParallel(model) if runtime.world > 1 else model
    return torch.compile(net) if cfg.MODEL.COMPILE else net


@dataclass
class Run:
    """What one training run holds; the counters say where it stands."""

    cfg: Any
    runtime: Runtime
    model: torch.nn.Module
    net: torch.nn.Module  # the model, or its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    ema: Any
    criterion: Any
    mixup: Any
    amp: Any
    memory_format: Any
    train_set: Any
    test_set: Any
    batch: int  # per process
    lock: Any = None  # the main process's FolderLock on OUTPUT_DIR
    epoch: int = 0
    step: int = 0
    best: float = 0.0
    batch_in_epoch: int = 0
    lr_drop: float = 1.0  # the product of OPTIM.VAL's learning-rate drops so far
    kept: Any = None  # the Snapshot checkpoint_last.pth holds
    pending: Any = None  # a Snapshot to write once the next step's loss and gradients are finite
    writer: Any = None
    started: Any = None  # (time.perf_counter(), epoch) when this process began training, for the ETA

    def close(self):
        if self.writer:
            self.writer.close()
        if self.lock:
            self.lock.release()


def set_up(cfg):
    """Output folder (checked, locked, cleared of the leftovers of interrupted writes), logging, the checkpoint
    to resume from (checked against the config before anything is written), seeds, data, model (with the
    weights of ``MODEL.MODEL_PATH`` when the run starts from them), optimizer, schedule, EMA. Returns the
    :class:`Run` and the ``(path, checkpoint)`` to resume from, or None."""
    runtime = Runtime(cfg.DISTRIBUTED_BACKEND)
    out = cfg.OUTPUT_DIR
    lock = None
    if runtime.is_main:
        check_writable_folder(out)
        lock = FolderLock(out)
    try:
        runtime.barrier()
        setup_logging(out, runtime.is_main)
        if runtime.is_main and (leftovers := remove_temporaries(out)):
            log.info(
                f"Removed {len(leftovers)} temporary files that interrupted writes left in {out}: "
                f"{', '.join(leftovers)}."
            )
        resume_point = read_resume_point(out)
        if resume_point:
            check_resumable(resume_point[1], resume_point[0], cfg)
        if runtime.is_main:
            atomic_write(os.path.join(out, "config.yaml"), lambda f: f.write(cfg.dump().encode()))
        warn_compatibility_keys(cfg, log)
        _log_resolved_arch(cfg)
        if runtime.world > 1 and runtime.backend != cfg.DISTRIBUTED_BACKEND:
            log.info(
                f"DISTRIBUTED_BACKEND {cfg.DISTRIBUTED_BACKEND} serves CUDA devices; these CPU processes use gloo."
            )
        seed_everything(cfg.SEED + runtime.rank)
        return _build_run(cfg, runtime, lock, starts_fresh=resume_point is None), resume_point
    except BaseException:
        if lock:
            lock.release()
        raise


def _log_resolved_arch(cfg):
    given = cfg.MODEL.VIT.MSVIT.ARCH
    resolved = arch_string(parse_arch(given))
    if resolved != given:
        log.info(
            f"MODEL.VIT.MSVIT.ARCH resolves to {resolved} "
            "(the fields it leaves out take the original release's defaults)."
        )


def _build_run(cfg, runtime, lock, starts_fresh):
    train_set, test_set = build_dataset(cfg, train=True), build_dataset(cfg, train=False)
    model = build_model(cfg)
    if cfg.MODEL.MODEL_PATH and starts_fresh:
        path = load_weights(model, cfg, new_classifier=True)
        log.info(
            f"Starting from the weights of {path}{' (its EMA copy)' if cfg.MODEL.LOAD_EMA else ''}; "
            "optimizer, schedule and epochs start fresh."
        )
    layout = memory_format(cfg)
    model = model.to(runtime.device, memory_format=layout)
    model.set_grad_checkpointing(cfg.MODEL.GRAD_CHECKPOINT)
    amp, scaler = amp_context(cfg, runtime.device)
    if cfg.AMP.ENABLED and runtime.device.type != "cuda":
        log.info("AMP.ENABLED applies on CUDA; this run trains in float32 on the CPU.")
    batch, accum = per_process_batch(cfg, runtime), cfg.OPTIM.ACCUM_STEPS
    mixup = build_mixup(cfg)
    if mixup is not None and batch % 2:
        raise ValueError(
            "Mixup/CutMix pairs the samples of a batch, so each process's batch (DATALOADER.BSZ / processes) "
            f"must be even, not {batch}."
        )
    batches_per_epoch = len(train_set) // runtime.world // batch
    if batches_per_epoch < accum:
        raise ValueError(
            f"{len(train_set)} training images make {batches_per_epoch} batches of {batch} per process, "
            f"fewer than OPTIM.ACCUM_STEPS {accum}; lower DATALOADER.BSZ."
        )
    if cfg.AUG.REPEATED_AUG and cfg.DATA.FORMAT == "shards":
        raise ValueError(
            "AUG.REPEATED_AUG repeats samples of image folders; with DATA.FORMAT shards each process "
            "reads its own shards, so set AUG.REPEATED_AUG False."
        )
    if cfg.AUG.REPEATED_AUG and runtime.world == 1:
        log.info(
            "AUG.REPEATED_AUG applies to distributed training (as in the original release); "
            "this single process sees each image once an epoch."
        )
    if cfg.OPTIM.VAL and cfg.OPTIM.OPT not in PLATEAU_OPTIMIZERS:
        log.info(
            f"OPTIM.VAL lowers the learning rate of {' and '.join(PLATEAU_OPTIMIZERS)} only "
            f"(as in the original release); this {cfg.OPTIM.OPT} run ignores it."
        )
    optimizer = build_optimizer(cfg, model)
    return Run(
        cfg=cfg,
        runtime=runtime,
        model=model,
        net=_training_net(model, cfg, runtime),
        optimizer=optimizer,
        scheduler=build_scheduler(cfg, optimizer, batches_per_epoch // accum),
        scaler=scaler,
        ema=model_ema(model, decay=cfg.MODEL.EMA_DECAY) if cfg.MODEL.EMA else None,
        criterion=build_loss(cfg, mixup),
        mixup=mixup,
        amp=amp,
        memory_format=layout,
        train_set=train_set,
        test_set=test_set,
        batch=batch,
        lock=lock,
    )


def stop_diverged(run, what, where):
    """Stop the run because ``what`` is not finite (at ``where``), in one sentence that says what
    ``checkpoint_last.pth`` holds and how to go on; also written to ``log.txt``."""
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
    message = f"Training stops before optimizer step {run.step + 1}: {what} at {where}; {held}."
    log.error(message)
    raise FloatingPointError(message)


def optimizer_step(run, where):
    """Check the gradients (unscaled, clipped to ``OPTIM.CLIP_GRAD``), write the checkpoint that waited for
    them, step the optimizer, the schedule and the EMA."""
    optimizer, scaler = run.optimizer, run.scaler
    scaler.unscale_(optimizer)
    if run.cfg.OPTIM.CLIP_GRAD > 0:
        norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.OPTIM.CLIP_GRAD)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in run.model.parameters() if p.grad is not None])
    if not scaler.is_enabled() and not math.isfinite(norm):  # fp16's scaler skips such steps by itself
        stop_diverged(run, f"the gradient norm became {norm.item()}", where)
    if run.pending:
        write_snapshot(run, run.pending)
        run.pending = None
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.scheduler.step_update(run.step)
    if run.ema is not None:
        run.ema.update(run.model, step=run.step)


def train_one_epoch(run, epoch):
    """One epoch (or what is left of it after a mid-epoch resume); returns (images seen, images skipped, mean
    loss) over all processes."""
    cfg, runtime, accum = run.cfg, run.runtime, run.cfg.OPTIM.ACCUM_STEPS
    loader = training_batches(run, epoch)
    run.net.train()
    seen = skipped = loss_sum = 0.0
    window = _new_window(time.perf_counter())  # since the last LOG_FREQ line
    bar = tqdm(loader, desc=f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}", disable=not runtime.is_main, leave=False)
    step_end = time.perf_counter()
    for i, (images, targets, unreadable) in enumerate(bar, start=run.batch_in_epoch):
        fetched = time.perf_counter()
        window["data_s"] += fetched - step_end
        skipped += _warn_unreadable(unreadable)
        where = f"epoch {epoch + 1}, batch {i + 1}"
        if not len(images):
            raise ValueError(
                f"All {len(unreadable)} images of the training batch at {where} are unreadable; "
                "check the data (the warnings above name them)."
            )
        images, targets = images.to(runtime.device, memory_format=run.memory_format), targets.to(runtime.device)
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
            lr=f"{run.optimizer.param_groups[0]['lr']:.2e}",
            img_s=f"{window['images'] / max(step_end - window['start'], 1e-9):.1f}",
        )
        if last_micro and cfg.LOG_FREQ and run.step % cfg.LOG_FREQ == 0:
            window = _log_steps(run, window, step_end)
        if last_micro and cfg.CHECKPOINT.EVERY_STEPS and run.step % cfg.CHECKPOINT.EVERY_STEPS == 0:
            run.pending = take_snapshot(run, epoch, i + 1)
    run.batch_in_epoch = 0
    seen, skipped = runtime.sum(seen, skipped)
    return seen, skipped, loss_sum / max(seen / runtime.world, 1)


def training_batches(run, epoch):
    """The batches this process trains on in ``epoch``, from the one a resumed run stopped at."""
    cfg, runtime, collate = run.cfg, run.runtime, partial(collate_skipping, refill=True)
    if isinstance(run.train_set, ShardDataset):
        return run.train_set.training_batches(
            epoch,
            cfg.SEED,
            runtime.rank,
            runtime.world,
            run.batch,
            cfg.DATALOADER.WORKERS,
            collate,
            skip=run.batch_in_epoch,
        )
    order = epoch_order(run.train_set, epoch, cfg.SEED, runtime, cfg.AUG.REPEATED_AUG)[run.batch_in_epoch * run.batch :]
    # A generator of its own: creating the iterator then draws no number from the global random state.
    return DataLoader(
        torch.utils.data.Subset(run.train_set, order),
        batch_size=run.batch,
        drop_last=True,
        num_workers=cfg.DATALOADER.WORKERS,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(cfg.SEED * 1000 + epoch),
    )


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
        "lr": run.optimizer.param_groups[0]["lr"],
        "images_per_s": window["images"] / max(now - window["start"], 1e-9),
        "data_s": window["data_s"] / steps,
        "step_s": window["step_s"] / steps,
        "max_memory_mib": _peak_memory_mib(run),
    }
    log.info(f"step {run.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
    if run.writer:
        for name, value in scalars.items():
            run.writer.add_scalar(f"train/{name}", value, run.step)
    return _new_window(now)


def _peak_memory_mib(run):
    """The peak of the allocator on CUDA, else of the process's resident set."""
    return torch.cuda.max_memory_allocated() / 2**20 if run.runtime.device.type == "cuda" else _peak_rss_mib()


def evaluate_epoch(run, epoch, seen, skipped, loss, elapsed):
    """Evaluate after ``epoch`` (the EMA weights too); one log line and TensorBoard points. Returns top-1."""
    cfg, runtime, model = run.cfg, run.runtime, run.model
    if runtime.world > 1:
        _share_rank0_buffers(run)
    result = evaluate(
        model, eval_loader(run.test_set, cfg, runtime), runtime, run.amp, cfg.DATA.NUM_CLASSES, run.memory_format
    )
    if result["nonfinite"]:
        stop_diverged(
            run,
            f"the outputs of {result['nonfinite']} evaluation images were not finite",
            f"the end of epoch {epoch + 1}",
        )
    memory = _peak_memory_mib(run)
    mode = next((m.mode for m in model.modules() if isinstance(m, LongformerAttention)), 0)
    scalars = {
        "loss": loss,
        "lr": run.optimizer.param_groups[0]["lr"],
        "top1": result["top1"],
        "top5": result["top5"],
        "images_per_s": seen / elapsed,
        "max_memory_mib": memory,
        "attention_mode": mode,
    }
    if run.ema is not None:
        ema_loader = eval_loader(run.test_set, cfg, runtime)
        scalars["top1_ema"] = evaluate(
            run.ema.module, ema_loader, runtime, run.amp, cfg.DATA.NUM_CLASSES, run.memory_format
        )["top1"]
    if run.writer:
        for name, value in scalars.items():
            run.writer.add_scalar(name, value, epoch + 1)
        run.writer.flush()
    log.info(
        f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}: "
        + ", ".join(f"{k} {v:.4g}" for k, v in scalars.items())
        + (f"; skipped {int(skipped)} unreadable images" if skipped else "")
        + f"; ETA {_run_eta(run, epoch)}"
    )
    return result["top1"]


def _share_rank0_buffers(run):
    """Every process takes rank 0's buffers (of the model and its EMA). DistributedDataParallel does so at each
    training forward; between the last one and the evaluation, a performer layer may have drawn features of its own
    in each process, and every process must evaluate the model that is saved."""
    for module in [run.model] + ([run.ema.module] if run.ema else []):
        for buffer in module.buffers():
            dist.broadcast(buffer, 0)


def _run_eta(run, epoch):
    """The time the remaining epochs will take at the mean pace (training and evaluation) of this process's
    epochs so far, as h:mm:ss."""
    started_at, first_epoch = run.started
    per_epoch = (time.perf_counter() - started_at) / (epoch + 1 - first_epoch)
    return str(datetime.timedelta(seconds=round(per_epoch * (run.cfg.OPTIM.EPOCHS - epoch - 1))))


def end_epoch(run, epoch, top1):
    """After an epoch's evaluation: the best top-1, ``OPTIM.VAL``'s learning-rate drop, the checkpoints (the
    mid-epoch one still waiting is superseded)."""
    cfg = run.cfg
    improved = top1 > run.best
    run.best = max(run.best, top1)
    if not improved and cfg.OPTIM.VAL and cfg.OPTIM.OPT in PLATEAU_OPTIMIZERS:
        drop_learning_rate(run.optimizer, cfg.OPTIM.DROP_FACTOR)
        run.lr_drop /= cfg.OPTIM.DROP_FACTOR
        log.info(
            f"Epoch {epoch + 1} did not improve top-1 (OPTIM.VAL): "
            f"the learning rate is divided by {cfg.OPTIM.DROP_FACTOR:g}."
        )
    run.pending = None
    write_snapshot(run, take_snapshot(run, epoch + 1, 0))
    if run.runtime.is_main:
        copy_epoch_checkpoints(cfg, epoch + 1, improved)


def train(cfg):
    """Train (or resume training) as ``cfg`` says; returns the final top-1 on the evaluation data."""
    run, resume_point = set_up(cfg)
    try:
        if resume_point:
            restore(run, resume_point[1], resume_point[0])
        return _train_epochs(run)
    finally:
        run.close()


def _train_epochs(run):
    cfg, runtime, model, out = run.cfg, run.runtime, run.model, run.cfg.OUTPUT_DIR
    if runtime.is_main:
        from torch.utils.tensorboard import SummaryWriter

        run.writer = SummaryWriter(os.path.join(out, "tensorboard"))
    log.info(
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(run.train_set)} training and "
        f"{len(run.test_set)} evaluation images, {runtime.world} process(es) on {runtime.device}."
    )
    mode_switch_epoch = cfg.MODEL.VIT.MSVIT.VIL_MODE_SWITCH * cfg.OPTIM.EPOCHS
    top1 = 0.0
    run.started = time.perf_counter(), run.epoch
    for epoch in range(run.epoch, cfg.OPTIM.EPOCHS):
        if cfg.MODEL.VIT.MSVIT.MODE > 0 and epoch >= mode_switch_epoch:
            model.reset_vil_mode(0)
            log.info(f"Epoch {epoch + 1}: random-shift training ends; every attention layer now uses mode 0.")
        if hasattr(model, "calls_since_last_redraw"):
            model.set_feature_redraw_interval(1 + 5 * epoch)  # performer: the original release's schedule
        run.scheduler.step(epoch)  # SOLVER.EPOCH_BASED_SCHEDULE; a per-step schedule ignores it
        start = time.perf_counter()
        with torch.autograd.set_detect_anomaly(cfg.SOLVER.DETECT_ANOMALY):
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


def evaluate_checkpoint(cfg):
    """Evaluate the checkpoint ``MODEL.MODEL_PATH`` (this project's or the original release's) on the
    evaluation data. Returns, in the main process, the report for :func:`write_eval_report` (top-1, top-5,
    and with ``OUTPUT_PERCLASS_ACC`` every class's figures); None in the others."""
    if not cfg.MODEL.MODEL_PATH:
        raise ValueError("Give the checkpoint to evaluate: MODEL.MODEL_PATH path/to/checkpoint.pth.")
    runtime = Runtime(cfg.DISTRIBUTED_BACKEND)
    if runtime.is_main:
        check_writable_file(eval_report_path(cfg), "The evaluation report")
    setup_logging(cfg.OUTPUT_DIR, False)
    warn_compatibility_keys(cfg, log)
    model = build_model(cfg)
    path = load_weights(model, cfg)
    amp, _ = amp_context(cfg, runtime.device)
    layout = memory_format(cfg)
    dataset = build_dataset(cfg, train=False)
    loader = eval_loader(dataset, cfg, runtime)
    result = evaluate(
        model.to(runtime.device, memory_format=layout), loader, runtime, amp, cfg.DATA.NUM_CLASSES, layout
    )
    if not runtime.is_main:
        return None
    report = {"checkpoint": path, "top1": result["top1"], "top5": result["top5"], "images": len(dataset)}
    if cfg.OUTPUT_PERCLASS_ACC:
        report["per_class"] = {
            name: {"images": int(n), "top1": 100 * hit1 / max(n, 1), "top5": 100 * hit5 / max(n, 1)}
            for name, (n, hit1, hit5) in zip(dataset.classes, result["per_class"].tolist())
        }
    return report


def eval_report_path(cfg):
    return os.path.join(cfg.OUTPUT_DIR, "eval.json")


def write_eval_report(cfg, report):
    """``OUTPUT_DIR/eval.json``."""
    atomic_write(eval_report_path(cfg), lambda f: f.write((json.dumps(report, indent=2) + "\n").encode()))


def _peak_rss_mib():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _check_ranks_agree(model, runtime):
    """DistributedDataParallel keeps the replicas equal (parameters and buffers); say so, or fail loudly if they
    drifted apart."""
    total = torch.stack([t.detach().double().sum() for t in (*model.parameters(), *model.buffers())]).sum().reshape(1)
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low.item() != high.item():
        raise RuntimeError(
            f"The {runtime.world} processes ended with different weights (checksums {low.item()} to {high.item()})."
        )
    log.info(f"All {runtime.world} processes hold identical weights.")
