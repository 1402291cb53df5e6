"""Training and evaluation: one process, or one per device under ``torchrun`` (DistributedDataParallel).

A run is set up (:func:`set_up`), continues from ``OUTPUT_DIR/checkpoint_last.pth`` or starts, from random
weights or from those of ``MODEL.MODEL_PATH`` (:func:`resume_or_start`), then trains epoch after epoch
(:func:`train_one_epoch`, :func:`evaluate`, :func:`end_epoch`).

Everything a run needs to continue is in ``checkpoint_last.pth`` (model, optimizer, schedule, gradient scaler,
EMA, epoch, step and random states); running the same command again resumes from it, and never again from
``MODEL.MODEL_PATH``. The sample order of an epoch depends only on ``SEED`` and the epoch, so a resumed run
repeats exactly what an uninterrupted one would have done (from a mid-epoch checkpoint, bit for bit with
``DATALOADER.WORKERS 0``; data-loading workers restart their random streams).
"""

import json
import logging
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from timm.data.distributed_sampler import RepeatAugSampler
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from .checkpoint import atomic_write, ema_state, load_model_state, model_state, read_checkpoint, save_checkpoint
from .config import warn_compatibility_keys
from .data import build_dataset, build_loss, build_mixup, collate_skipping
from .models import build_model
from .models.attention import LongformerAttention
from .models.convert import fit_to_model
from .optim import build_optimizer, build_scheduler, drop_learning_rate

log = logging.getLogger("vil")
MEMORY_FORMATS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
# OPTIM.VAL lowers the learning rate of these optimizers only, as in the original release.
PLATEAU_OPTIMIZERS = ("sgd", "qhm")


class Runtime:
    """This process's place in the run: rank, world size and device (from torchrun's environment). Processes
    talk through ``backend`` on CUDA and through gloo on the CPU."""

    def __init__(self, backend="nccl"):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        self.backend = backend if self.device.type == "cuda" else "gloo"
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(self.backend)
        self.is_main = self.rank == 0

    def sum(self, *values):
        """Sum numbers over all processes."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()


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


def _rng_state():
    numpy = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(numpy[1].astype(np.int64)), "pos": numpy[2], "gauss": [numpy[3], numpy[4]]}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], *numpy["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def epoch_order(dataset, epoch, seed, runtime, repeated_aug=False):
    """The sample indices this process trains on in ``epoch``: a permutation seeded by seed and epoch (with
    ``repeated_aug`` in distributed training: timm's repeated-augmentation sampler, 3 repeats)."""
    if runtime.world > 1:
        if repeated_aug:
            # selected_round 0: every process takes len / world samples, as DistributedSampler (timm's default
            # rounds down to multiples of 256, which the epoch's step count would not match).
            sampler = RepeatAugSampler(dataset, num_replicas=runtime.world, rank=runtime.rank, shuffle=True, selected_round=0)
        else:
            sampler = DistributedSampler(dataset, num_replicas=runtime.world, rank=runtime.rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)
    return torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def per_process_batch(cfg, runtime):
    """``DATALOADER.BSZ`` is the batch of all processes together, as in the original release."""
    batch = cfg.DATALOADER.BSZ
    if batch % runtime.world:
        raise ValueError(f"DATALOADER.BSZ {batch} is the batch of all {runtime.world} processes together, so it must be a multiple of {runtime.world}.")
    return batch // runtime.world


@torch.no_grad()
def evaluate(model, loader, runtime, amp, num_classes, memory_format=torch.contiguous_format):
    """Top-1 and top-5 accuracy (percent) over the whole evaluation set, all processes together, and per class:
    ``{"top1", "top5", "per_class": (classes, 3) tensor of images, top-1 hits, top-5 hits}``."""
    model.eval()
    counts = torch.zeros(num_classes, 3, dtype=torch.float64, device=runtime.device)
    skipped = 0
    for images, targets, missed in loader:
        skipped += missed
        if not len(images):
            continue
        images, targets = images.to(runtime.device, memory_format=memory_format), targets.to(runtime.device)
        with amp():
            logits = model(images)
        ranks = logits.float().topk(min(5, num_classes), dim=1).indices.eq(targets[:, None])
        hits = torch.stack([torch.ones_like(ranks[:, 0]), ranks[:, 0], ranks.any(dim=1)], dim=1)
        counts.index_add_(0, targets, hits.double())
    if runtime.world > 1:
        dist.all_reduce(counts)
    (skipped,) = runtime.sum(skipped)
    if skipped:
        log.warning(f"Evaluation skipped {int(skipped)} unreadable images.")
    images, top1, top5 = counts.sum(dim=0).tolist()
    return {"top1": 100 * top1 / max(images, 1), "top5": 100 * top5 / max(images, 1), "per_class": counts.cpu()}


def eval_loader(dataset, cfg, runtime):
    """Each process evaluates every world-th sample, so that all samples count exactly once."""
    indices = list(range(runtime.rank, len(dataset), runtime.world))
    return DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=per_process_batch(cfg, runtime),
                      num_workers=cfg.DATALOADER.WORKERS, collate_fn=collate_skipping)


def amp_context(cfg, device):
    """Autocast for AMP on CUDA (bf16, or fp16 with a scaler); a no-op elsewhere."""
    if not (cfg.AMP.ENABLED and device.type == "cuda"):
        return nullcontext, None
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.AMP.DTYPE)
    if dtype is None:
        raise ValueError(f"AMP.DTYPE {cfg.AMP.DTYPE!r} is not supported; use 'bfloat16' or 'float16'.")
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    return (lambda: torch.autocast("cuda", dtype=dtype)), scaler


def memory_format(cfg):
    """``AMP.MEMORY_FORMAT``: ``nchw`` (PyTorch's default layout) or ``nhwc`` (channels last)."""
    if cfg.AMP.MEMORY_FORMAT not in MEMORY_FORMATS:
        raise ValueError(f"AMP.MEMORY_FORMAT {cfg.AMP.MEMORY_FORMAT!r} is not a layout; use 'nchw' or 'nhwc'.")
    return MEMORY_FORMATS[cfg.AMP.MEMORY_FORMAT]


def resolve_model_path(cfg):
    """``MODEL.MODEL_PATH``, or, when that is not a file, the same path under ``DATA.DATA_DIR`` (as the
    original release looked it up)."""
    path = cfg.MODEL.MODEL_PATH
    for candidate in (path, os.path.join(cfg.DATA.DATA_DIR, path)):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"Checkpoint {path} does not exist (nor under DATA.DATA_DIR {cfg.DATA.DATA_DIR}).")


def load_weights(model, cfg, new_classifier=False):
    """Load the weights of ``MODEL.MODEL_PATH`` (this project's checkpoint, the original release's, a bare state
    dict; its EMA weights with ``MODEL.LOAD_EMA``) into ``model``, position tables resized to the model's image
    size. With ``new_classifier``, a classifier of another class count stays the model's fresh one, and the
    log says so; otherwise it is refused with the rest of a checkpoint that does not fit."""
    path = resolve_model_path(cfg)
    checkpoint = read_checkpoint(path)
    state = fit_to_model(ema_state(checkpoint, path) if cfg.MODEL.LOAD_EMA else model_state(checkpoint, path), model, path)
    head = {k: v.shape for k, v in state.items() if k.startswith("head.")}
    if head != {k: v.shape for k, v in model.state_dict().items() if k.startswith("head.")}:
        found = f"a classifier for {head['head.weight'][0]} classes" if "head.weight" in head else "no classifier"
        if not new_classifier:
            raise ValueError(f"Checkpoint {path} has {found}, not one for the DATA.NUM_CLASSES {model.num_classes} classes of this model.")
        log.info(f"Checkpoint {path} has {found}: this run trains a new one for DATA.NUM_CLASSES {model.num_classes}.")
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    load_model_state(model, state, path, may_miss=("head.",))
    return path


@dataclass
class Run:
    """What one training run holds; the counters say where it stands."""

    cfg: Any
    runtime: Runtime
    model: torch.nn.Module
    net: torch.nn.Module  # the model, or its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    ema: Any
    criterion: Any
    mixup: Any
    amp: Any
    memory_format: Any
    train_set: Any
    test_set: Any
    batch: int  # per process
    epoch: int = 0
    step: int = 0
    best: float = 0.0
    batch_in_epoch: int = 0
    writer: Any = None

    @property
    def last_checkpoint(self):
        return last_checkpoint_path(self.cfg)


def last_checkpoint_path(cfg):
    return os.path.join(cfg.OUTPUT_DIR, "checkpoint_last.pth")


def set_up(cfg):
    """Output folder, logging, seeds, data, model (with the weights of ``MODEL.MODEL_PATH`` when the run starts
    from them), optimizer, schedule, EMA."""
    runtime = Runtime(cfg.DISTRIBUTED_BACKEND)
    out = cfg.OUTPUT_DIR
    if runtime.is_main:
        os.makedirs(out, exist_ok=True)
        _write_text(os.path.join(out, "config.yaml"), cfg.dump())
    if runtime.world > 1:
        dist.barrier()
    setup_logging(out, runtime.is_main)
    warn_compatibility_keys(cfg, log)
    if runtime.world > 1 and runtime.backend != cfg.DISTRIBUTED_BACKEND:
        log.info(f"DISTRIBUTED_BACKEND {cfg.DISTRIBUTED_BACKEND} serves CUDA devices; these CPU processes use gloo.")
    torch.manual_seed(cfg.SEED + runtime.rank)
    np.random.seed(cfg.SEED + runtime.rank)
    random.seed(cfg.SEED + runtime.rank)

    train_set, test_set = build_dataset(cfg, train=True), build_dataset(cfg, train=False)
    model = build_model(cfg)
    if cfg.MODEL.MODEL_PATH and not os.path.exists(last_checkpoint_path(cfg)):
        path = load_weights(model, cfg, new_classifier=True)
        log.info(f"Starting from the weights of {path}{' (its EMA copy)' if cfg.MODEL.LOAD_EMA else ''}; optimizer, schedule and epochs start fresh.")
    layout = memory_format(cfg)
    model = model.to(runtime.device, memory_format=layout)
    model.set_grad_checkpointing(cfg.MODEL.GRAD_CHECKPOINT)
    amp, scaler = amp_context(cfg, runtime.device)
    if cfg.AMP.ENABLED and runtime.device.type != "cuda":
        log.info("AMP.ENABLED applies on CUDA; this run trains in float32 on the CPU.")
    batch, accum = per_process_batch(cfg, runtime), cfg.OPTIM.ACCUM_STEPS
    mixup = build_mixup(cfg)
    if mixup is not None and batch % 2:
        raise ValueError(f"Mixup/CutMix pairs the samples of a batch, so each process's batch (DATALOADER.BSZ / processes) must be even, not {batch}.")
    batches_per_epoch = len(train_set) // runtime.world // batch
    if batches_per_epoch < accum:
        raise ValueError(f"{len(train_set)} training images make {batches_per_epoch} batches of {batch} per process, fewer than OPTIM.ACCUM_STEPS {accum}; lower DATALOADER.BSZ.")
    if cfg.AUG.REPEATED_AUG and runtime.world == 1:
        log.info("AUG.REPEATED_AUG applies to distributed training (as in the original release); this single process sees each image once an epoch.")
    if cfg.OPTIM.VAL and cfg.OPTIM.OPT not in PLATEAU_OPTIMIZERS:
        log.info(f"OPTIM.VAL lowers the learning rate of {' and '.join(PLATEAU_OPTIMIZERS)} only (as in the original release); this {cfg.OPTIM.OPT} run ignores it.")
    steps_per_epoch = batches_per_epoch // accum
    optimizer = build_optimizer(cfg, model)
    return Run(
        cfg=cfg, runtime=runtime, model=model, net=DistributedDataParallel(model) if runtime.world > 1 else model,
        optimizer=optimizer, scheduler=build_scheduler(cfg, optimizer, steps_per_epoch), scaler=scaler,
        ema=ModelEmaV3(model, decay=cfg.MODEL.EMA_DECAY) if cfg.MODEL.EMA else None, criterion=build_loss(cfg, mixup),
        mixup=mixup, amp=amp, memory_format=layout, train_set=train_set, test_set=test_set, batch=batch,
    )


def resume_or_start(run):
    """Continue from ``checkpoint_last.pth`` when the output folder has one (the model weights
    :func:`set_up` loaded from ``MODEL.MODEL_PATH`` are then never read)."""
    last = run.last_checkpoint
    if not os.path.exists(last):
        return
    state = read_checkpoint(last)
    run.model.load_state_dict(model_state(state, last))
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    if run.scaler is not None and state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    if run.ema is not None and state.get("ema"):
        run.ema.module.load_state_dict(state["ema"])
    run.epoch, run.step, run.best, run.batch_in_epoch = state["epoch"], state["step"], state["best_acc"], state["batch_in_epoch"]
    _set_rng_state(state["rng"][min(run.runtime.rank, len(state["rng"]) - 1)])
    log.info(f"Resumed from {last}: epoch {run.epoch + 1}, optimizer step {run.step}.")


def save_training_checkpoint(run, path, epoch, batch_in_epoch):
    """Everything the run needs to continue, from every process's random state, written by the main process."""
    rng = [None] * run.runtime.world
    if run.runtime.world > 1:
        dist.all_gather_object(rng, _rng_state())
    else:
        rng = [_rng_state()]
    if run.runtime.is_main:
        save_checkpoint(path, run.model, arch=run.cfg.MODEL.ARCH, epoch=epoch, batch_in_epoch=batch_in_epoch, step=run.step,
                        best_acc=run.best, optimizer=run.optimizer.state_dict(), scheduler=run.scheduler.state_dict(),
                        scaler=run.scaler.state_dict() if run.scaler else None,
                        ema=run.ema.module.state_dict() if run.ema else None, rng=rng, config=run.cfg.dump())


def _optimizer_step(run):
    optimizer, scaler = run.optimizer, run.scaler
    if scaler:
        scaler.unscale_(optimizer)
    if run.cfg.OPTIM.CLIP_GRAD > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.OPTIM.CLIP_GRAD)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.scheduler.step_update(run.step)
    if run.ema is not None:
        run.ema.update(run.model, step=run.step)


def train_one_epoch(run, epoch):
    """One epoch (or what is left of it after a mid-epoch resume); returns (images seen, images skipped, mean
    loss) over all processes."""
    cfg, runtime, accum = run.cfg, run.runtime, run.cfg.OPTIM.ACCUM_STEPS
    order = epoch_order(run.train_set, epoch, cfg.SEED, runtime, cfg.AUG.REPEATED_AUG)[run.batch_in_epoch * run.batch :]
    # A generator of its own: creating the iterator then draws no number from the global random state.
    loader = DataLoader(torch.utils.data.Subset(run.train_set, order), batch_size=run.batch, drop_last=True,
                        num_workers=cfg.DATALOADER.WORKERS, collate_fn=partial(collate_skipping, refill=True),
                        generator=torch.Generator().manual_seed(cfg.SEED * 1000 + epoch))
    run.net.train()
    seen = skipped = loss_sum = 0.0
    window = dict(loss=0.0, images=0, start=time.perf_counter())  # since the last LOG_FREQ line
    bar = tqdm(loader, desc=f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}", disable=not runtime.is_main, leave=False)
    for i, (images, targets, missed) in enumerate(bar, start=run.batch_in_epoch):
        skipped += missed
        images, targets = images.to(runtime.device, memory_format=run.memory_format), targets.to(runtime.device)
        if run.mixup is not None:
            images, targets = run.mixup(images, targets)
        last_micro = (i + 1) % accum == 0
        with (run.net.no_sync() if runtime.world > 1 and not last_micro else nullcontext()), run.amp():
            loss = run.criterion(run.net(images), targets)
        (loss_mean,) = [x / runtime.world for x in runtime.sum(loss.item())]
        if not np.isfinite(loss_mean):
            raise FloatingPointError(
                f"The loss became {loss_mean} at epoch {epoch + 1}, batch {i + 1}: training stops, and {run.last_checkpoint} "
                "keeps the last good state (lower OPTIM.LR or set OPTIM.CLIP_GRAD)."
            )
        (run.scaler.scale(loss / accum) if run.scaler else loss / accum).backward()
        seen += len(images)
        loss_sum += loss_mean * len(images)
        window["loss"] += loss_mean * len(images)
        window["images"] += len(images) * runtime.world
        if last_micro:
            _optimizer_step(run)
            if cfg.LOG_FREQ and run.step % cfg.LOG_FREQ == 0:
                _log_steps(run, window)
            if cfg.CHECKPOINT.EVERY_STEPS and run.step % cfg.CHECKPOINT.EVERY_STEPS == 0:
                save_training_checkpoint(run, run.last_checkpoint, epoch, i + 1)
        bar.set_postfix(loss=f"{loss_mean:.4f}", lr=f"{run.optimizer.param_groups[0]['lr']:.2e}")
    run.batch_in_epoch = 0
    seen, skipped = runtime.sum(seen, skipped)
    return seen, skipped, loss_sum / max(seen / runtime.world, 1)


def _log_steps(run, window):
    """The ``LOG_FREQ`` line: mean loss, learning rate and images/s since the last one; also to TensorBoard."""
    now = time.perf_counter()
    scalars = {"loss": window["loss"] * run.runtime.world / max(window["images"], 1),
               "lr": run.optimizer.param_groups[0]["lr"], "images_per_s": window["images"] / max(now - window["start"], 1e-9)}
    log.info(f"step {run.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
    if run.writer:
        for name, value in scalars.items():
            run.writer.add_scalar(f"train/{name}", value, run.step)
    window.update(loss=0.0, images=0, start=now)


def end_epoch(run, epoch, top1):
    """After an epoch's evaluation: the best top-1, ``OPTIM.VAL``'s learning-rate drop, the checkpoints."""
    cfg, out = run.cfg, run.cfg.OUTPUT_DIR
    improved = top1 > run.best
    run.best = max(run.best, top1)
    if not improved and cfg.OPTIM.VAL and cfg.OPTIM.OPT in PLATEAU_OPTIMIZERS:
        drop_learning_rate(run.optimizer, cfg.OPTIM.DROP_FACTOR)
        log.info(f"Epoch {epoch + 1} did not improve top-1 (OPTIM.VAL): the learning rate is divided by {cfg.OPTIM.DROP_FACTOR:g}.")
    save_training_checkpoint(run, run.last_checkpoint, epoch + 1, 0)
    if not run.runtime.is_main:
        return
    if improved:
        _copy(run.last_checkpoint, os.path.join(out, "model_best.pth"))
    if not cfg.ONLY_SAVE_LAST:
        _copy(run.last_checkpoint, os.path.join(out, f"checkpoint_epoch{epoch + 1}.pth"))
        stale = os.path.join(out, f"checkpoint_epoch{epoch + 1 - cfg.CHECKPOINT.KEEP}.pth")
        if os.path.exists(stale):
            os.remove(stale)


def train(cfg):
    """Train (or resume training) as ``cfg`` says; returns the final top-1 on the evaluation data."""
    run = set_up(cfg)
    resume_or_start(run)
    runtime, model, out = run.runtime, run.model, cfg.OUTPUT_DIR
    if runtime.is_main:
        from torch.utils.tensorboard import SummaryWriter

        run.writer = SummaryWriter(os.path.join(out, "tensorboard"))
    log.info(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(run.train_set)} training and {len(run.test_set)} evaluation images, {runtime.world} process(es) on {runtime.device}.")

    mode_switch_epoch = cfg.MODEL.VIT.MSVIT.VIL_MODE_SWITCH * cfg.OPTIM.EPOCHS
    num_classes = cfg.DATA.NUM_CLASSES
    top1 = 0.0
    for epoch in range(run.epoch, cfg.OPTIM.EPOCHS):
        if cfg.MODEL.VIT.MSVIT.MODE > 0 and epoch >= mode_switch_epoch:
            model.reset_vil_mode(0)
            log.info(f"Epoch {epoch + 1}: random-shift training ends; every attention layer now uses mode 0.")
        run.scheduler.step(epoch)  # SOLVER.EPOCH_BASED_SCHEDULE; a per-step schedule ignores it
        start = time.perf_counter()
        with torch.autograd.set_detect_anomaly(cfg.SOLVER.DETECT_ANOMALY):
            seen, skipped, loss = train_one_epoch(run, epoch)
        elapsed = time.perf_counter() - start

        result = evaluate(model, eval_loader(run.test_set, cfg, runtime), runtime, run.amp, num_classes, run.memory_format)
        top1 = result["top1"]
        memory = torch.cuda.max_memory_allocated() / 2**20 if runtime.device.type == "cuda" else _peak_rss_mib()
        mode = next((m.mode for m in model.modules() if isinstance(m, LongformerAttention)), 0)
        scalars = {"loss": loss, "lr": run.optimizer.param_groups[0]["lr"], "top1": top1, "top5": result["top5"],
                   "images_per_s": seen / elapsed, "max_memory_mib": memory, "attention_mode": mode}
        if run.ema is not None:
            ema_loader = eval_loader(run.test_set, cfg, runtime)
            scalars["top1_ema"] = evaluate(run.ema.module, ema_loader, runtime, run.amp, num_classes, run.memory_format)["top1"]
        if run.writer:
            for name, value in scalars.items():
                run.writer.add_scalar(name, value, epoch + 1)
            run.writer.flush()
        log.info(f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}: " + ", ".join(f"{k} {v:.4g}" for k, v in scalars.items())
                 + (f"; skipped {int(skipped)} unreadable images" if skipped else ""))
        end_epoch(run, epoch, top1)
    if run.writer:
        run.writer.close()
    if runtime.world > 1:
        _check_ranks_agree(model, runtime)
    log.info(f"Best top-1 {run.best:.2f}. Checkpoints: {out}/checkpoint_last.pth, {out}/model_best.pth; "
             f"log: {out}/log.txt; TensorBoard: tensorboard --logdir {out}/tensorboard")
    if runtime.world > 1:
        dist.barrier()
    return top1


def evaluate_checkpoint(cfg):
    """Top-1 and top-5 (percent) of the checkpoint ``MODEL.MODEL_PATH`` (this project's or the original
    release's) on the evaluation data; also written to ``OUTPUT_DIR/eval.json``, with every class's figures
    when ``OUTPUT_PERCLASS_ACC``."""
    if not cfg.MODEL.MODEL_PATH:
        raise ValueError("Give the checkpoint to evaluate: MODEL.MODEL_PATH path/to/checkpoint.pth.")
    runtime = Runtime(cfg.DISTRIBUTED_BACKEND)
    setup_logging(cfg.OUTPUT_DIR, False)
    warn_compatibility_keys(cfg, log)
    model = build_model(cfg)
    path = load_weights(model, cfg)
    amp, _ = amp_context(cfg, runtime.device)
    layout = memory_format(cfg)
    dataset = build_dataset(cfg, train=False)
    loader = eval_loader(dataset, cfg, runtime)
    result = evaluate(model.to(runtime.device, memory_format=layout), loader, runtime, amp, cfg.DATA.NUM_CLASSES, layout)
    if runtime.is_main:
        os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
        report = {"checkpoint": path, "top1": result["top1"], "top5": result["top5"], "images": len(dataset)}
        if cfg.OUTPUT_PERCLASS_ACC:
            report["per_class"] = {
                name: {"images": int(n), "top1": 100 * hit1 / max(n, 1), "top5": 100 * hit5 / max(n, 1)}
                for name, (n, hit1, hit5) in zip(dataset.classes, result["per_class"].tolist())
            }
        _write_text(os.path.join(cfg.OUTPUT_DIR, "eval.json"), json.dumps(report, indent=2) + "\n")
    return result["top1"], result["top5"]


def _check_ranks_agree(model, runtime):
    """DistributedDataParallel keeps the replicas equal; say so, or fail loudly if they drifted apart."""
    total = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low.item() != high.item():
        raise RuntimeError(f"The {runtime.world} processes ended with different weights (checksums {low.item()} to {high.item()}).")
    log.info(f"All {runtime.world} processes hold identical weights.")


def _peak_rss_mib():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_text(path, text):
    atomic_write(path, lambda f: f.write(text.encode()))


def _copy(source, target):
    with open(source, "rb") as src:
        atomic_write(target, lambda f: shutil.copyfileobj(src, f))
