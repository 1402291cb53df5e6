"""Setting up a training run: the output folder (checked, locked), logging, the checkpoint to resume from
(checked against the config), data, model, optimizer, schedule and EMA, held together in a :class:`Run`."""

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Optional, Union

import torch
from timm.data import Mixup
from timm.scheduler.scheduler import Scheduler
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter
from yacs.config import CfgNode

from ..config import warn_compatibility_keys, warn_unread_keys
from ..cpu import cpu_multiplies_natively, half_precision_rate
from ..data import build_dataset, build_mixup, check_same_classes
from ..files import FolderLock, atomic_write, check_writable_folder, remove_temporaries
from ..loss import build_loss
from ..model_config import build_model
from ..models import MsViT, arch_string, parse_arch
from ..optim import build_optimizer, build_scheduler, model_ema
from ..runtime import Runtime, seed_everything
from ..shards import ShardDataset
from ..training_state import (
    LAST,
    Snapshot,
    check_fresh_folder,
    check_resumable,
    copy_epoch_checkpoints,
    gather_rng_states,
    read_resume_point,
    restore,
    write_snapshot,
)
from ..weights import load_weights
from .epoch import steps_per_epoch

log = logging.getLogger("vil")
MEMORY_FORMATS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
# OPTIM.VAL lowers the learning rate of these optimizers only, as in the original release.
PLATEAU_OPTIMIZERS = ("sgd", "qhm")


def setup_logging(output_dir, is_main, to_file=True):
    """The "vil" logger to the console and, in the main process with ``to_file``, to ``output_dir/log.txt``; the
    handlers of an earlier run in this process are closed (its log file with them). The other processes say only
    warnings."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    log.propagate = False
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(console)
    if is_main and to_file:
        file = logging.FileHandler(os.path.join(output_dir, "log.txt"))
        file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(file)


def log_failure(error):
    """``error``'s sentence, which stops the run, in ``log.txt`` too (the console gets it from whoever catches it)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, f"error: {error}", None, None)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def per_process_batch(cfg, runtime):
    """``DATALOADER.BSZ`` is the batch of all processes together, as in the original release."""
    batch = cfg.DATALOADER.BSZ
    if batch % runtime.world:
        raise ValueError(
            f"DATALOADER.BSZ {batch} is the batch of all {runtime.world} processes together, "
            f"so it must be a multiple of {runtime.world}."
        )
    return batch // runtime.world


def amp_dtype(cfg):
    """``AMP.DTYPE`` as a torch dtype: what autocast computes in where AMP applies."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.AMP.DTYPE]


def amp_context(cfg, device):
    """Autocast for AMP on CUDA, and on the CPU with ``AMP.ON_CPU`` (bf16, or fp16 with gradient scaling), and the
    gradient scaler, which is a pass-through unless fp16 needs it. The presets enable AMP for their GPU recipe: on
    the CPU it is a choice of its own, since only CPUs with half-precision matrix instructions gain from it."""
    dtype = amp_dtype(cfg)
    on = amp_enabled(cfg, device)
    if on:
        log.info(f"AMP: the model runs under torch.autocast on {device.type} in {cfg.AMP.DTYPE}.")
    elif cfg.AMP.ENABLED:
        log.info(f"AMP.ENABLED applies on CUDA, and on the CPU with AMP.ON_CPU True; this run is float32 on {device}.")
    elif cfg.AMP.ON_CPU and not cfg.AMP.ENABLED:
        log.info(f"AMP.ON_CPU True applies with AMP.ENABLED True; this run is float32 on {device}.")
    if on and device.type == "cpu" and not cpu_multiplies_natively(dtype):
        log.warning(
            "AMP.DTYPE %s: this CPU has no %s matrix instructions, so torch's %s matrix products run many times slower "
            "than float32 here; training and evaluation are faster without AMP.ON_CPU on it.",
            cfg.AMP.DTYPE,
            "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AVX512-FP16 or AMX-FP16",
            cfg.AMP.DTYPE,
        )
    elif on and device.type == "cpu" and (rate := half_precision_rate(dtype)) < 1:
        log.warning(
            "AMP.DTYPE %s: this CPU multiplies %s matrices at %.2fx the rate of float32, so training and evaluation "
            "are faster without AMP.ON_CPU on it.",
            cfg.AMP.DTYPE,
            cfg.AMP.DTYPE,
            rate,
        )
    if on and device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0):
        log.warning(
            "AMP.DTYPE bfloat16: this GPU (compute capability below 8.0) has no bfloat16 tensor cores, so its bfloat16 "
            "products are emulated, many times slower than float16; set AMP.DTYPE float16 on it."
        )
    scaler = torch.amp.GradScaler(device.type, enabled=on and dtype == torch.float16)
    return ((lambda: torch.autocast(device.type, dtype=dtype)) if on else nullcontext), scaler


def amp_enabled(cfg, device):
    """Whether steps on ``device`` run under autocast: ``AMP.ENABLED`` on CUDA, and with ``AMP.ON_CPU`` on the CPU."""
    return cfg.AMP.ENABLED and (device.type == "cuda" or (device.type == "cpu" and cfg.AMP.ON_CPU))


def memory_format(cfg):
    """``AMP.MEMORY_FORMAT``: ``nchw`` (PyTorch's default layout) or ``nhwc`` (channels last)."""
    return MEMORY_FORMATS[cfg.AMP.MEMORY_FORMAT]


def _training_net(model, cfg, runtime):
    """What the training step calls: the model, wrapped for several processes, compiled with ``MODEL.COMPILE``."""
    net = DistributedDataParallel(model) if runtime.world > 1 else model
    if not cfg.MODEL.COMPILE:
        return net
    log.info(
        "MODEL.COMPILE: the training steps run the model through torch.compile (Inductor); the first step compiles "
        "it, minutes on a CPU; evaluation stays eager."
    )
    return torch.compile(net)


@dataclass
class Run:
    """What one training run holds; the counters say where it stands."""

    cfg: CfgNode
    runtime: Runtime
    model: MsViT
    net: torch.nn.Module  # what the training step calls: the model, wrapped and compiled as _training_net says
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler
    scaler: torch.amp.GradScaler
    ema: Optional[ModelEmaV3]
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    mixup: Optional[Mixup]
    amp: Callable[[], AbstractContextManager]  # a fresh autocast context (or a no-op one) for each forward
    memory_format: torch.memory_format
    train_set: Union[Dataset, ShardDataset]
    test_set: Union[Dataset, ShardDataset]
    batch: int  # per process
    steps_per_epoch: int  # the optimizer steps of every epoch
    lock: Optional[FolderLock] = None  # the main process's lock on OUTPUT_DIR
    train_loader: Optional[DataLoader] = None  # image folders' training loader, built at the first epoch
    epoch: int = 0
    step: int = 0
    best: float = float("-inf")  # so that the first evaluation improves on it, whatever its top-1
    batch_in_epoch: int = 0
    lr_drop: float = 1.0  # the product of OPTIM.VAL's learning-rate drops so far
    schedule_offset: int = 0  # the per-step schedule's place is step + schedule_offset (Snapshot says why)
    scaler_skips: int = 0  # the optimizer steps of this epoch that fp16's gradient scaler skipped
    lr_scales: tuple[float, ...] = ()  # the optimizer groups' lr_scale before any drop (layer decay's)
    lr: float = 0.0  # the last optimizer step's learning rate: its largest group's (layer decay scales the others)
    kept: Optional[Snapshot] = None  # the one checkpoint_last.pth holds
    pending: Optional[Snapshot] = (
        None  # to write once the next step's loss (and, without fp16's scaler, gradients) is finite
    )
    step_writer: Optional[SummaryWriter] = None  # TensorBoard's step lines, tensorboard/steps (main process)
    epoch_writer: Optional[SummaryWriter] = None  # and its epoch lines, tensorboard/epochs
    started: Optional[tuple[float, int]] = None  # (time.perf_counter(), epoch) when this process began training

    def snapshot(self, epoch, batch_in_epoch, improved=False):
        """A :class:`Snapshot` of the run now, at ``batch_in_epoch`` of ``epoch`` (every process takes part);
        ``improved``: at an epoch's end whose evaluation improved top-1."""
        state = self.model.state_dict()
        buffers = {name: state[name].clone() for name, _ in self.model.named_buffers() if name in state}
        rng = gather_rng_states(self.runtime)
        schedule = dict(steps_per_epoch=self.steps_per_epoch, schedule_offset=self.schedule_offset)
        return Snapshot(epoch, batch_in_epoch, self.step, self.best, self.lr_drop, rng, buffers, improved, **schedule)

    @property
    def schedule_step(self):
        """The per-step schedule's place: the optimizer steps taken, as the epochs of this run count them."""
        return self.step + self.schedule_offset

    def write_checkpoint(self, snapshot):
        """Write ``checkpoint_last.pth`` from ``snapshot`` (main process); it becomes the one kept."""
        if self.runtime.is_main:
            write_snapshot(
                self.cfg, snapshot, self.model, self.optimizer, self.scaler, self.ema, self.train_set.classes
            )
        self.kept = snapshot

    def resume(self, checkpoint, path):
        """Continue from ``checkpoint``, read from ``path``: its states, counters and place in the schedule."""
        kept = restore(checkpoint, path, self.model, self.optimizer, self.scaler, self.ema, self.runtime.rank)
        self.epoch, self.batch_in_epoch, self.step = kept.epoch, kept.batch_in_epoch, kept.step
        self.best, self.lr_drop, self.kept = kept.best, kept.lr_drop, kept
        self.schedule_offset = kept.schedule_offset
        if kept.steps_per_epoch not in (None, self.steps_per_epoch):
            accum = self.cfg.OPTIM.ACCUM_STEPS
            place = kept.epoch * self.steps_per_epoch + min(kept.batch_in_epoch // accum, self.steps_per_epoch)
            self.schedule_offset = place - self.step
            log.info(
                f"Epochs take {self.steps_per_epoch} optimizer steps in this run, {kept.steps_per_epoch} in the one "
                f"resumed (its processes read the shards otherwise): the schedule goes on from step {place} of "
                f"{self.steps_per_epoch * self.cfg.OPTIM.EPOCHS}, this epoch's place in the new plan."
            )
        self.scheduler.step_update(self.schedule_step)
        # At an epoch's end, its copies again (the run may have stopped before making them), which are copies of
        # checkpoint_last.pth: not where the resume fell back to an epoch checkpoint because that one is unreadable.
        if self.runtime.is_main and kept.epoch and not kept.batch_in_epoch and os.path.basename(path) == LAST:
            copy_epoch_checkpoints(self.cfg, kept.epoch, kept.improved)

    def flush_writers(self):
        for writer in (self.step_writer, self.epoch_writer):
            if writer:
                writer.flush()

    def close(self):
        for writer in (self.step_writer, self.epoch_writer):
            if writer:
                writer.close()
        if self.lock:
            self.lock.release()


def set_up(cfg):
    """Output folder (checked, locked, cleared of the leftovers of interrupted writes), logging, the checkpoint
    to resume from (checked against the config before anything is written), seeds, data, model (with the
    weights of ``MODEL.MODEL_PATH`` when the run starts from them), optimizer, schedule, EMA. Returns the
    :class:`Run` and the ``(path, checkpoint)`` to resume from, or None."""
    runtime = Runtime(cfg.DISTRIBUTED_BACKEND)
    out = cfg.OUTPUT_DIR
    logging_here = False
    lock = runtime.in_main(lambda: _claim_folder(out))
    try:
        setup_logging(out, runtime.is_main)
        logging_here = True
        if runtime.is_main and (leftovers := remove_temporaries(out)):
            log.info(
                f"Removed {len(leftovers)} temporary files that interrupted writes left in {out}: "
                f"{', '.join(leftovers)}."
            )
        resume_point = read_resume_point(out)
        if resume_point:
            check_resumable(resume_point[1], resume_point[0], cfg, runtime.world)
        else:
            check_fresh_folder(out)
        runtime.in_main(lambda: write_run_config(cfg, out))
        warn_compatibility_keys(cfg, log)
        _log_resolved_arch(cfg)
        if runtime.world > 1 and runtime.backend != cfg.DISTRIBUTED_BACKEND:
            log.info(
                f"DISTRIBUTED_BACKEND {cfg.DISTRIBUTED_BACKEND} serves CUDA devices; these CPU processes use gloo."
            )
        seed_everything(cfg.SEED + runtime.rank)
        return _build_run(cfg, runtime, lock, starts_fresh=resume_point is None), resume_point
    except BaseException as e:
        if logging_here and isinstance(e, (ValueError, OSError)):
            log_failure(e)
        if lock:
            lock.release()
        raise


def _unread_training_keys(cfg):
    """The ``(keys, why)`` of :func:`vil.config.warn_unread_keys` for the optimizer, schedule, EMA, AMP and batch
    mixing keys that what the config chose does not read."""
    optim, policy, aug = cfg.OPTIM, cfg.SOLVER.LR_POLICY, cfg.AUG
    opt = f"OPTIM.OPT {optim.OPT}"
    unread = []
    if optim.OPT not in ("sgd", "qhm"):
        unread.append((("OPTIM.MOM",), f"{opt} does not read {{}} (sgd's and qhm's momentum)"))
    if optim.OPT != "qhm":
        unread.append((("OPTIM.NU",), f"{opt} does not read {{}} (qhm's)"))
    if optim.OPT not in ("adamw", "adam", "lamb"):
        unread.append((("OPTIM.ADAM.BETA1", "OPTIM.ADAM.BETA2", "OPTIM.ADAM.EPS"), f"{opt} does not read {{}}"))
    # OPTIM.DROP_FREQ is left out: the presets keep the original recipe's, for the step policies.
    if policy not in ("step", "multistep") and not (optim.VAL and optim.OPT in PLATEAU_OPTIMIZERS):
        unread.append((("OPTIM.DROP_FACTOR",), "only SOLVER.LR_POLICY step and OPTIM.VAL (sgd, qhm) read {}"))
    if policy not in ("cosine", "linear"):
        unread.append((("SOLVER.MIN_LR",), "only SOLVER.LR_POLICY cosine and linear read {}"))
    if not policy:
        unread.append(
            (
                ("SOLVER.WARMUP_EPOCHS", "SOLVER.WARMUP_FACTOR", "SOLVER.EPOCH_BASED_SCHEDULE"),
                "SOLVER.LR_POLICY '' (no schedule) has no warmup and keeps OPTIM.LR, so nothing reads {}",
            )
        )
    elif cfg.SOLVER.WARMUP_EPOCHS == 0:
        unread.append((("SOLVER.WARMUP_FACTOR",), "SOLVER.WARMUP_EPOCHS 0 (no warmup) leaves {} unread"))
    if cfg.MODEL.VIT.MSVIT.MODE == 0:
        unread.append((("MODEL.VIT.MSVIT.VIL_MODE_SWITCH",), "only MODEL.VIT.MSVIT.MODE 1 or 2 switches modes"))
    if not cfg.MODEL.MODEL_PATH:
        unread.append((("MODEL.LOAD_EMA", "DATA.DATA_DIR"), "only MODEL.MODEL_PATH's checkpoint is read with {}"))
    if not cfg.EVALUATE:
        unread.append((("OUTPUT_PERCLASS_ACC",), "only evaluations (EVALUATE True, tools/eval.py) read {}"))
    if cfg.ONLY_SAVE_LAST:
        unread.append((("CHECKPOINT.KEEP",), "ONLY_SAVE_LAST 1 writes no epoch checkpoints for {} to count"))
    if not cfg.MODEL.EMA:
        unread.append((("MODEL.EMA_DECAY",), "only MODEL.EMA True reads {}"))
    if not cfg.AMP.ENABLED:
        unread.append((("AMP.DTYPE",), "only AMP.ENABLED True reads {}"))
    mixed = aug.MIXUP > 0 or aug.MIXCUT > 0 or bool(aug.MIXCUT_MINMAX)
    if not mixed:
        unread.append(
            (
                ("AUG.MIXUP_PROB", "AUG.MIXUP_SWITCH_PROB", "AUG.MIXUP_MODE"),
                "no batch mixing is asked for (AUG.MIXUP, AUG.MIXCUT or AUG.MIXCUT_MINMAX), so nothing reads {}",
            )
        )
    elif not (aug.MIXUP > 0 and (aug.MIXCUT > 0 or aug.MIXCUT_MINMAX)):
        unread.append((("AUG.MIXUP_SWITCH_PROB",), "only Mixup and CutMix together switch between them"))
    if aug.MIXCUT_MINMAX:
        unread.append((("AUG.MIXCUT",), "AUG.MIXCUT_MINMAX sizes CutMix's boxes instead, so nothing reads {}"))
    return unread


def _claim_folder(out):
    """The lock of the run folder ``out``, checked to be writable (the main process's)."""
    check_writable_folder(out)
    return FolderLock(out)


RUN_CONFIG_HEADER = (
    "# The resolved config of the training run in this folder (written by it; it loads as a config file).\n"
)


def write_run_config(cfg, out):
    """``out/config.yaml``: the run's resolved config, first of all. Where a run, fresh or resumed, finds a
    ``config.yaml`` there that no run wrote (a config file of the user's, perhaps the one this run reads), it is
    refused in one sentence rather than replaced."""
    path = os.path.join(out, "config.yaml")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.readline().decode(errors="replace") != RUN_CONFIG_HEADER:
                raise ValueError(
                    f"{path} is not a config this project's training wrote (a config file of yours?), and the run "
                    "would write its resolved config over it; choose another OUTPUT_DIR or move the file away."
                )
    atomic_write(path, lambda f: f.write((RUN_CONFIG_HEADER + cfg.dump()).encode()))


def _log_resolved_arch(cfg):
    given = cfg.MODEL.VIT.MSVIT.ARCH
    resolved = arch_string(parse_arch(given))
    if resolved != given:
        log.info(
            f"MODEL.VIT.MSVIT.ARCH resolves to {resolved} "
            "(the fields it leaves out take the original release's defaults)."
        )


def _build_run(cfg, runtime, lock, starts_fresh):
    train_set = build_dataset(cfg, train=True)
    test_set = build_dataset(cfg, train=False, model_classes=train_set.classes)
    check_same_classes(train_set, test_set)
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
    batch, accum = per_process_batch(cfg, runtime), cfg.OPTIM.ACCUM_STEPS
    mixup = build_mixup(cfg)
    if mixup is not None and batch % 2:
        raise ValueError(
            "Mixup/CutMix pairs the samples of a batch, so each process's batch (DATALOADER.BSZ / processes) "
            f"must be even, not {batch}."
        )
    steps = steps_per_epoch(train_set, cfg, runtime, batch)
    if isinstance(train_set, ShardDataset) and len(train_set.counts) < runtime.world:
        raise ValueError(
            f"The training data has {len(train_set.counts)} shards for {runtime.world} processes, each of which reads "
            "shards of its own; write at least one shard per process (tools/make_shards.py --per-shard smaller)."
        )
    if steps == 0:
        raise ValueError(
            f"{len(train_set)} training images make no optimizer step of OPTIM.ACCUM_STEPS {accum} batches of "
            f"{batch} per process{' and DataLoader worker' if cfg.DATA.FORMAT == 'shards' else ''}; "
            "lower DATALOADER.BSZ."
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
    if runtime.is_main:
        warn_unread_keys(cfg, _unread_training_keys(cfg))
    optimizer = build_optimizer(cfg, model)
    return Run(
        cfg=cfg,
        runtime=runtime,
        model=model,
        net=_training_net(model, cfg, runtime),
        optimizer=optimizer,
        lr_scales=tuple(group.get("lr_scale", 1.0) for group in optimizer.param_groups),
        scheduler=build_scheduler(cfg, optimizer, steps),
        scaler=scaler,
        ema=model_ema(model, decay=cfg.MODEL.EMA_DECAY) if cfg.MODEL.EMA else None,
        criterion=build_loss(cfg, mixup),
        mixup=mixup,
        amp=amp,
        memory_format=layout,
        train_set=train_set,
        test_set=test_set,
        batch=batch,
        steps_per_epoch=steps,
        lock=lock,
    )
