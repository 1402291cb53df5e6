"""Training and evaluation: one process, or one per device under ``torchrun`` (DistributedDataParallel).

Everything a run needs to continue is in ``OUTPUT_DIR/checkpoint_last.pth`` (model, optimizer, schedule,
gradient scaler, EMA, epoch, step and random states); running the same command again resumes from it.
The sample order of an epoch depends only on ``SEED`` and the epoch, so a resumed run repeats exactly
what an uninterrupted one would have done (from a mid-epoch checkpoint, bit for bit with
``DATALOADER.WORKERS 0``; data-loading workers restart their random streams).
"""

import json
import logging
import os
import random
import shutil
import time
from contextlib import nullcontext
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from timm.utils import ModelEmaV3, accuracy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from .checkpoint import atomic_write, load_checkpoint, model_state, read_checkpoint, save_checkpoint
from .data import build_dataset, build_loss, build_mixup, collate_skipping
from .models import build_model
from .models.attention import LongformerAttention
from .optim import build_optimizer, build_scheduler

log = logging.getLogger("vil")


class Runtime:
    """This process's place in the run: rank, world size and device (from torchrun's environment)."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
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


def epoch_order(dataset, epoch, seed, runtime):
    """The sample indices this process trains on in ``epoch``: a permutation seeded by seed and epoch."""
    if runtime.world > 1:
        sampler = DistributedSampler(dataset, num_replicas=runtime.world, rank=runtime.rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)
    return torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()


@torch.no_grad()
def evaluate(model, loader, runtime, amp):
    """Top-1 and top-5 accuracy (percent) over the whole evaluation set, all processes together."""
    model.eval()
    correct1 = correct5 = total = skipped = 0
    for images, targets, missed in loader:
        skipped += missed
        if not len(images):
            continue
        images, targets = images.to(runtime.device), targets.to(runtime.device)
        with amp():
            logits = model(images)
        top1, top5 = accuracy(logits.float(), targets, topk=(1, min(5, logits.shape[1])))
        correct1 += top1.item() * len(images) / 100
        correct5 += top5.item() * len(images) / 100
        total += len(images)
    correct1, correct5, total, skipped = runtime.sum(correct1, correct5, total, skipped)
    if skipped:
        log.warning(f"Evaluation skipped {int(skipped)} unreadable images.")
    return 100 * correct1 / max(total, 1), 100 * correct5 / max(total, 1)


def eval_loader(dataset, cfg, runtime):
    """Each process evaluates every world-th sample, so that all samples count exactly once."""
    indices = list(range(runtime.rank, len(dataset), runtime.world))
    return DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=cfg.DATALOADER.BSZ,
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


def train(cfg):
    """Train (or resume training) as ``cfg`` says; returns the final top-1 on the evaluation data."""
    runtime = Runtime()
    out = cfg.OUTPUT_DIR
    if runtime.is_main:
        os.makedirs(out, exist_ok=True)
        _write_text(os.path.join(out, "config.yaml"), cfg.dump())
    if runtime.world > 1:
        dist.barrier()
    setup_logging(out, runtime.is_main)
    torch.manual_seed(cfg.SEED + runtime.rank)
    np.random.seed(cfg.SEED + runtime.rank)
    random.seed(cfg.SEED + runtime.rank)

    train_set, test_set = build_dataset(cfg, train=True), build_dataset(cfg, train=False)
    model = build_model(cfg).to(runtime.device)
    model.set_grad_checkpointing(cfg.MODEL.GRAD_CHECKPOINT)
    amp, scaler = amp_context(cfg, runtime.device)
    if cfg.AMP.ENABLED and runtime.device.type != "cuda":
        log.info("AMP.ENABLED applies on CUDA; this run trains in float32 on the CPU.")
    batch, accum = cfg.DATALOADER.BSZ, cfg.OPTIM.ACCUM_STEPS
    mixup = build_mixup(cfg)
    if mixup is not None and batch % 2:
        raise ValueError(f"Mixup/CutMix pairs the samples of a batch, so DATALOADER.BSZ must be even, not {batch}.")
    batches_per_epoch = len(train_set) // runtime.world // batch
    if batches_per_epoch < accum:
        raise ValueError(f"{len(train_set)} training images make {batches_per_epoch} batches of {batch} per process, fewer than OPTIM.ACCUM_STEPS {accum}; lower DATALOADER.BSZ.")
    steps_per_epoch = batches_per_epoch // accum
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch)
    ema = ModelEmaV3(model, decay=cfg.MODEL.EMA_DECAY) if cfg.MODEL.EMA else None
    criterion = build_loss(cfg, mixup)
    net = DistributedDataParallel(model) if runtime.world > 1 else model

    start_epoch, step, best, resume_batch = 0, 0, 0.0, 0
    last = os.path.join(out, "checkpoint_last.pth")
    if os.path.exists(last):
        state = read_checkpoint(last)
        model.load_state_dict(model_state(state, last))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema"):
            ema.module.load_state_dict(state["ema"])
        start_epoch, step, best, resume_batch = state["epoch"], state["step"], state["best_acc"], state["batch_in_epoch"]
        _set_rng_state(state["rng"][min(runtime.rank, len(state["rng"]) - 1)])
        log.info(f"Resumed from {last}: epoch {start_epoch + 1}, optimizer step {step}.")

    writer = None
    if runtime.is_main:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(out, "tensorboard"))
    log.info(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train_set)} training and {len(test_set)} evaluation images, {runtime.world} process(es) on {runtime.device}.")

    def checkpoint(path, epoch, batch_in_epoch):
        rng = [None] * runtime.world
        if runtime.world > 1:
            dist.all_gather_object(rng, _rng_state())
        else:
            rng = [_rng_state()]
        if runtime.is_main:
            save_checkpoint(path, model, arch=cfg.MODEL.ARCH, epoch=epoch, batch_in_epoch=batch_in_epoch, step=step,
                            best_acc=best, optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                            scaler=scaler.state_dict() if scaler else None, ema=ema.module.state_dict() if ema else None,
                            rng=rng, config=cfg.dump())

    mode_switch_epoch = cfg.MODEL.VIT.MSVIT.VIL_MODE_SWITCH * cfg.OPTIM.EPOCHS
    top1 = 0.0
    for epoch in range(start_epoch, cfg.OPTIM.EPOCHS):
        if cfg.MODEL.VIT.MSVIT.MODE > 0 and epoch >= mode_switch_epoch:
            model.reset_vil_mode(0)
            log.info(f"Epoch {epoch + 1}: random-shift training ends; every attention layer now uses mode 0.")
        order = epoch_order(train_set, epoch, cfg.SEED, runtime)[resume_batch * batch :]
        # A generator of its own: creating the iterator then draws no number from the global random state.
        loader = DataLoader(torch.utils.data.Subset(train_set, order), batch_size=batch, drop_last=True,
                            num_workers=cfg.DATALOADER.WORKERS, collate_fn=partial(collate_skipping, refill=True),
                            generator=torch.Generator().manual_seed(cfg.SEED * 1000 + epoch))
        net.train()
        seen = skipped = loss_sum = 0.0
        start = time.perf_counter()
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}", disable=not runtime.is_main, leave=False)
        for i, (images, targets, missed) in enumerate(bar, start=resume_batch):
            skipped += missed
            images, targets = images.to(runtime.device), targets.to(runtime.device)
            if mixup is not None:
                images, targets = mixup(images, targets)
            last_micro = (i + 1) % accum == 0
            with (net.no_sync() if runtime.world > 1 and not last_micro else nullcontext()), amp():
                loss = criterion(net(images), targets)
            (loss_mean,) = [x / runtime.world for x in runtime.sum(loss.item())]
            if not np.isfinite(loss_mean):
                raise FloatingPointError(
                    f"The loss became {loss_mean} at epoch {epoch + 1}, batch {i + 1}: training stops, and {last} "
                    "keeps the last good state (lower OPTIM.LR or set OPTIM.CLIP_GRAD)."
                )
            (scaler.scale(loss / accum) if scaler else loss / accum).backward()
            if last_micro:
                if scaler:
                    scaler.unscale_(optimizer)
                if cfg.OPTIM.CLIP_GRAD > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.OPTIM.CLIP_GRAD)
                scaler.step(optimizer) if scaler else optimizer.step()
                if scaler:
                    scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                scheduler.step_update(step)
                if ema is not None:
                    ema.update(model, step=step)
                if cfg.CHECKPOINT.EVERY_STEPS and step % cfg.CHECKPOINT.EVERY_STEPS == 0:
                    checkpoint(last, epoch, i + 1)
            seen += len(images)
            loss_sum += loss_mean * len(images)
            bar.set_postfix(loss=f"{loss_mean:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        resume_batch = 0
        elapsed = time.perf_counter() - start
        seen, skipped = runtime.sum(seen, skipped)

        top1, top5 = evaluate(model, eval_loader(test_set, cfg, runtime), runtime, amp)
        ema_top1 = evaluate(ema.module, eval_loader(test_set, cfg, runtime), runtime, amp)[0] if ema else None
        memory = torch.cuda.max_memory_allocated() / 2**20 if runtime.device.type == "cuda" else _peak_rss_mib()
        mode = next((m.mode for m in model.modules() if isinstance(m, LongformerAttention)), 0)
        scalars = {"loss": loss_sum / max(seen / runtime.world, 1), "lr": optimizer.param_groups[0]["lr"], "top1": top1,
                   "top5": top5, "images_per_s": seen / elapsed, "max_memory_mib": memory, "attention_mode": mode}
        if ema_top1 is not None:
            scalars["top1_ema"] = ema_top1
        if writer:
            for name, value in scalars.items():
                writer.add_scalar(name, value, epoch + 1)
            writer.flush()
        log.info(f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}: " + ", ".join(f"{k} {v:.4g}" for k, v in scalars.items())
                 + (f"; skipped {int(skipped)} unreadable images" if skipped else ""))
        improved = top1 > best
        best = max(best, top1)
        checkpoint(last, epoch + 1, 0)
        if runtime.is_main:
            if improved:
                _copy(last, os.path.join(out, "model_best.pth"))
            _copy(last, os.path.join(out, f"checkpoint_epoch{epoch + 1}.pth"))
            stale = os.path.join(out, f"checkpoint_epoch{epoch + 1 - cfg.CHECKPOINT.KEEP}.pth")
            if os.path.exists(stale):
                os.remove(stale)
    if writer:
        writer.close()
    if runtime.world > 1:
        _check_ranks_agree(model, runtime)
    log.info(f"Best top-1 {best:.2f}. Checkpoints: {out}/checkpoint_last.pth, {out}/model_best.pth; "
             f"log: {out}/log.txt; TensorBoard: tensorboard --logdir {out}/tensorboard")
    if runtime.world > 1:
        dist.barrier()
    return top1


def evaluate_checkpoint(cfg):
    """Top-1 and top-5 (percent) of the checkpoint ``MODEL.MODEL_PATH`` (this project's or the original
    release's) on the evaluation data; also written to ``OUTPUT_DIR/eval.json``."""
    if not cfg.MODEL.MODEL_PATH:
        raise ValueError("Give the checkpoint to evaluate: MODEL.MODEL_PATH path/to/checkpoint.pth.")
    runtime = Runtime()
    setup_logging(cfg.OUTPUT_DIR, False)
    model = build_model(cfg)
    load_checkpoint(model, cfg.MODEL.MODEL_PATH)
    amp, _ = amp_context(cfg, runtime.device)
    dataset = build_dataset(cfg, train=False)
    top1, top5 = evaluate(model.to(runtime.device), eval_loader(dataset, cfg, runtime), runtime, amp)
    if runtime.is_main:
        os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
        result = {"checkpoint": cfg.MODEL.MODEL_PATH, "top1": top1, "top5": top5, "images": len(dataset)}
        _write_text(os.path.join(cfg.OUTPUT_DIR, "eval.json"), json.dumps(result, indent=2) + "\n")
    return top1, top5


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
