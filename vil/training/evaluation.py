"""Evaluation: top-1 and top-5 over the evaluation data, all processes together; after each training epoch (the
EMA weights too, one log line, TensorBoard points), and of a checkpoint on its own (``tools/eval.py``,
``EVALUATE True``), with its report ``OUTPUT_DIR/eval.json``."""

import datetime
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..checkpoint import recorded_classes
from ..config import warn_compatibility_keys
from ..data import build_dataset, collate_skipping
from ..files import atomic_write, check_writable_file
from ..model_config import build_model
from ..profiling import peak_memory_mib
from ..progress import log_lines_above_bars
from ..runtime import Runtime
from ..shards import ShardDataset
from ..unreadable import warn_held, warn_unreadable
from ..weights import check_trained_classes, load_read_weights, read_model_checkpoint
from .epoch import stop_diverged
from .setup import amp_context, memory_format, per_process_batch, setup_logging

log = logging.getLogger("vil")


@torch.no_grad()
def evaluate(model, loader, runtime, amp, num_classes, memory_format=torch.contiguous_format, expected=None):
    """Top-1 and top-5 accuracy (percent) over the whole evaluation set, all processes together, and per class:
    ``{"top1", "top5", "per_class": (classes, 3) tensor of images, top-1 hits, top-5 hits, "images": images
    scored, "skipped": unreadable images, "nonfinite": images whose outputs are not all finite, which count as
    wrong}``. Unreadable images are skipped, each named in a warning. ``expected``: the evaluation set's size;
    images of it that no process read (lost with the rest of a damaged shard) count as skipped too."""
    model.eval()
    counts = torch.zeros(num_classes, 3, dtype=torch.float64, device=runtime.device)
    skipped, nonfinite = 0, torch.zeros((), dtype=torch.long, device=runtime.device)
    bar = tqdm(loader, desc="evaluation", disable=not runtime.is_main, leave=False)
    held = None if runtime.is_main else []  # the names this process met, for the main process to log
    with log_lines_above_bars():
        for images, targets, unreadable in bar:
            skipped += warn_unreadable(unreadable, held)
            if not len(images):
                continue
            images, targets = images.to(runtime.device, memory_format=memory_format), targets.to(runtime.device)
            with amp():
                logits = model(images).float()
            finite = torch.isfinite(logits).all(dim=1)
            nonfinite += (~finite).sum()
            # topk ranks NaN too: an image whose outputs are not all finite is no hit
            ranks = logits.topk(min(5, num_classes), dim=1).indices.eq(targets[:, None]) & finite[:, None]
            hits = torch.stack([torch.ones_like(ranks[:, 0]), ranks[:, 0], ranks.any(dim=1)], dim=1)
            counts.index_add_(0, targets, hits.double())
    warn_held(runtime, held or [])
    if runtime.world > 1:
        dist.all_reduce(counts)
    skipped, nonfinite = runtime.sum(skipped, nonfinite.item())
    images, top1, top5 = counts.sum(dim=0).tolist()
    lost = expected - images - skipped if expected is not None else 0
    if lost > 0 and runtime.is_main:
        log.warning(f"{int(lost)} of the {expected} evaluation images were never read (lost with damaged shards).")
    skipped += max(lost, 0)
    if skipped and runtime.is_main:
        log.warning(f"Evaluation skipped {int(skipped)} unreadable images.")
    if not images:  # an accuracy of 0 over no images would read as a model's
        why = f"all {int(skipped)} were unreadable (the warnings above name them)" if skipped else "it holds none"
        raise ValueError(f"No image of the evaluation data could be scored: {why}; check the evaluation data.")
    return {
        "top1": 100 * top1 / max(images, 1),
        "top5": 100 * top5 / max(images, 1),
        "per_class": counts.cpu(),
        "images": int(images),
        "skipped": int(skipped),
        "nonfinite": int(nonfinite),
    }


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


def evaluate_epoch(run, epoch, seen, skipped, loss, elapsed):
    """Evaluate after ``epoch`` (the EMA weights too); one log line and TensorBoard points. Returns top-1."""
    cfg, runtime, model = run.cfg, run.runtime, run.model
    if runtime.world > 1:
        _share_rank0_buffers(run)
    loader, expected = eval_loader(run.test_set, cfg, runtime), len(run.test_set)
    result = evaluate(model, loader, runtime, run.amp, cfg.DATA.NUM_CLASSES, run.memory_format, expected)
    if result["nonfinite"]:
        stop_diverged(
            run,
            f"the outputs of {result['nonfinite']} evaluation images were not finite",
            f"the end of epoch {epoch + 1}",
        )
    memory = peak_memory_mib(runtime.device)
    scalars = {
        "loss": loss,
        "lr": run.lr,
        "top1": result["top1"],
        "top5": result["top5"],
        "images_per_s": seen / elapsed,
        "max_memory_mib": memory,
        "attention_mode": model.vil_mode,
    }
    if run.ema is not None:
        ema_loader = eval_loader(run.test_set, cfg, runtime)
        ema = evaluate(run.ema.module, ema_loader, runtime, run.amp, cfg.DATA.NUM_CLASSES, run.memory_format, expected)
        if ema["nonfinite"]:
            log.warning(
                f"The EMA weights' outputs of {ema['nonfinite']} evaluation images were not finite; top1_ema "
                "counts them as wrong (MODEL.EMA_DECAY closer to 1 averages more steps)."
            )
        scalars["top1_ema"] = ema["top1"]
    if run.epoch_writer:
        for name, value in scalars.items():
            run.epoch_writer.add_scalar(name, value, epoch + 1)
    log.info(
        f"epoch {epoch + 1}/{cfg.OPTIM.EPOCHS}: "
        + ", ".join(f"{k} {v:.4g}" for k, v in scalars.items())
        + (f"; skipped {int(skipped)} unreadable images" if skipped else "")
        + (
            f"; the float16 gradient scaler skipped {run.scaler_skips} optimizer steps (gradients not finite)"
            if run.scaler_skips
            else ""
        )
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


def evaluate_checkpoint(cfg):
    """Evaluate the checkpoint ``MODEL.MODEL_PATH`` (this project's or the original release's) on the
    evaluation data. Returns, in the main process, the report for :func:`write_eval_report` (top-1, top-5,
    and with ``OUTPUT_PERCLASS_ACC`` every class's figures); None in the others."""
    if not cfg.MODEL.MODEL_PATH:
        raise ValueError("Give the checkpoint to evaluate: MODEL.MODEL_PATH path/to/checkpoint.pth.")
    runtime = Runtime(cfg.DISTRIBUTED_BACKEND)
    runtime.in_main(lambda: check_writable_file(eval_report_path(cfg), "The evaluation report"))
    setup_logging(cfg.OUTPUT_DIR, runtime.is_main, to_file=False)
    warn_compatibility_keys(cfg, log)
    model = build_model(cfg)
    path, checkpoint = read_model_checkpoint(cfg)
    dataset = build_dataset(cfg, train=False, model_classes=recorded_classes(checkpoint))
    check_trained_classes(checkpoint, path, dataset.classes)
    load_read_weights(model, cfg, path, checkpoint, cfg.MODEL.LOAD_EMA)
    amp, _ = amp_context(cfg, runtime.device)
    layout = memory_format(cfg)
    loader = eval_loader(dataset, cfg, runtime)
    model = model.to(runtime.device, memory_format=layout)
    result = evaluate(model, loader, runtime, amp, cfg.DATA.NUM_CLASSES, layout, len(dataset))
    if result["nonfinite"]:
        raise ValueError(
            f"The outputs of {result['nonfinite']} of the {result['images']} evaluation images are not finite with the "
            f"weights of {path}; the checkpoint holds values that are not finite, or the arithmetic overflowed "
            "(try AMP.ENABLED False)."
        )
    if not runtime.is_main:
        return None
    report = {key: result[key] for key in ("top1", "top5", "images", "skipped")}
    report = {"checkpoint": path, "weights": "EMA" if cfg.MODEL.LOAD_EMA else "model", **report}
    if cfg.OUTPUT_PERCLASS_ACC:
        report["per_class"] = {
            name: {"images": int(n), "top1": 100 * hit1 / n if n else None, "top5": 100 * hit5 / n if n else None}
            for name, (n, hit1, hit5) in zip(dataset.classes, result["per_class"].tolist())
        }
    return report


def eval_report_path(cfg):
    return os.path.join(cfg.OUTPUT_DIR, "eval.json")


def write_eval_report(cfg, report):
    """``OUTPUT_DIR/eval.json``."""
    atomic_write(eval_report_path(cfg), lambda f: f.write((json.dumps(report, indent=2) + "\n").encode()))
