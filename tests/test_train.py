"""Training end to end on tiny data: outputs, exact resume, torchrun, the mode switch, and clear failures."""

import itertools
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data import make_folder
from timm.utils import ModelEmaV3
from tool_runner import run_tool
from torch.optim.optimizer import register_optimizer_step_post_hook

import vil.training.setup as training_setup
import vil.training_state as training_state
from vil.checkpoint import read_checkpoint
from vil.config import load_cfg
from vil.models import MsViT
from vil.runtime import get_rng_state
from vil.training.evaluation import evaluate_checkpoint
from vil.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
TINY_ARCH = "l1,h1,d16,n1,s1,g1,p4,f2,a1_l2,h2,d32,n1,s1,g1,p2,f2,a1_l3,h2,d32,n1,s0,g1,p2,f2,a1"


def tiny_overrides(data, out, *overrides):
    return [
        "MODEL.VIT.MSVIT.ARCH",
        TINY_ARCH,
        "INPUT.IMAGE_SIZE",
        "32",
        "DATA.PATH",
        str(data),
        "DATA.NUM_CLASSES",
        "2",
        "DATALOADER.BSZ",
        "4",
        "OPTIM.EPOCHS",
        "2",
        "OPTIM.LR",
        "1e-3",
        "SOLVER.LR_POLICY",
        "cosine",
        "SOLVER.WARMUP_EPOCHS",
        "0.5",
        "MODEL.VIT.DROP_PATH",
        "0.1",
        "OUTPUT_DIR",
        str(out),
        *overrides,
    ]


def tiny_cfg(data, out, *overrides):
    return load_cfg(overrides=tiny_overrides(data, out, *overrides))


def final_weights(out):
    return read_checkpoint(str(out / "checkpoint_last.pth"))["net"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_logged_learning_rate_is_the_one_each_step_used(data, tmp_path, monkeypatch):
    """Each step line's learning rate is its step's (the schedule moves on after the step), the largest group's
    under layer decay (the head's, which the schedule sets; the stem's is 0.5^depth of it); the epoch line's is
    its last step's."""
    used, build = [], training_setup.build_optimizer

    def recording(cfg, model):
        optimizer = build(cfg, model)
        optimizer.register_step_pre_hook(lambda o, *_: used.append(max(g["lr"] for g in o.param_groups)))
        return optimizer

    monkeypatch.setattr(training_setup, "build_optimizer", recording)
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "LOG_FREQ", "1", "OPTIM.LAYER_DECAY", "0.5"))
    text = (out / "log.txt").read_text()
    logged = [float(x) for x in re.findall(r" step \d+: loss [^,]*, lr ([^,]*),", text)]
    assert len(used) == 6 and len(set(used)) == 6  # 3 steps an epoch; warm-up, then cosine: each its own rate
    assert logged == pytest.approx(used, rel=1e-3)  # the lines' 4 digits
    epoch_lines = [float(x) for x in re.findall(r"epoch \d/2: loss [^,]*, lr ([^,]*)", text)]
    assert epoch_lines == pytest.approx([used[2], used[5]], rel=1e-3)


@pytest.mark.parametrize(
    "killed_at, resumed_step",
    [
        (("train/loss", 5), 3),  # two steps past its checkpoint (the end of epoch 1, step 3)
        (("top1", 2), 3),  # after epoch 2's evaluation, before its checkpoint
        (("train/loss", 2), None),  # before the first checkpoint: the run starts again
    ],
)
def test_tensorboard_holds_each_point_once_after_a_killed_run(data, tmp_path, monkeypatch, killed_at, resumed_step):
    """The run that follows a killed one replaces the points the killed one logged after its checkpoint, on both
    axes (optimizer steps and epochs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    real_add = SummaryWriter.add_scalar

    def add_then_die(self, tag, value, step=None, *args, **kwargs):
        real_add(self, tag, value, step, *args, **kwargs)
        if (tag, step) == killed_at:
            self.flush()
            raise KeyboardInterrupt

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_then_die)
    out = tmp_path / "run"
    started = time.time()
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(data, out, "LOG_FREQ", "1"))
    last = out / "checkpoint_last.pth"
    assert (read_checkpoint(str(last))["step"] if last.exists() else None) == resumed_step
    monkeypatch.setattr(SummaryWriter, "add_scalar", real_add)
    # TensorBoard reads a folder's event files in the order of their names, which begin with the second they were
    # opened in: the second run's must come after (runs that follow one another in time are read in that order).
    time.sleep(max(0.0, started + 1 - time.time()))
    train(tiny_cfg(data, out, "LOG_FREQ", "1"))
    steps = EventAccumulator(str(out / "tensorboard" / "steps")).Reload()
    assert [e.step for e in steps.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    epochs = EventAccumulator(str(out / "tensorboard" / "epochs")).Reload()
    assert [e.step for e in epochs.Scalars("top1")] == [1, 2]


def test_a_second_run_in_one_process_closes_the_first_ones_log(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    training_setup.setup_logging(tmp_path / "a", True)
    (first,) = [h for h in training_setup.log.handlers if isinstance(h, logging.FileHandler)]
    training_setup.setup_logging(tmp_path / "b", True)
    training_setup.log.info("the second run")
    assert first.stream is None and "the second run" not in (tmp_path / "a" / "log.txt").read_text()
    assert "the second run" in (tmp_path / "b" / "log.txt").read_text()


def test_two_epochs_write_checkpoints_logs_and_report_skipped_files(data, tmp_path):
    out = tmp_path / "run"
    top1 = train(tiny_cfg(data, out, "LOG_FREQ", "2"))
    assert 0 <= top1 <= 100
    for name in ("config.yaml", "checkpoint_last.pth", "model_best.pth", "checkpoint_epoch1.pth", "log.txt"):
        assert (out / name).exists(), name
    text = (out / "log.txt").read_text()
    assert "epoch 2/2: loss" in text and "top1" in text and "images_per_s" in text
    assert re.search(r"epoch 1/2: .*; ETA \d:\d\d:\d\d\n", text) and re.search(r"epoch 2/2: .*; ETA 0:00:00\n", text)
    number = r"[-+0-9.e]+"
    step_line = re.compile(
        rf" step (\d+): loss {number}, lr {number}, images_per_s {number}, data_s {number}, "
        rf"step_s {number}, max_memory_mib {number}\n"
    )
    steps = read_checkpoint(str(out / "checkpoint_last.pth"))["step"]
    assert [int(n) for n in step_line.findall(text)] == list(range(2, steps + 1, 2))  # every LOG_FREQ steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard" / "steps")).Reload()
    for name in ("loss", "lr", "images_per_s", "data_s", "step_s", "max_memory_mib"):
        assert [e.step for e in events.Scalars(f"train/{name}")] == list(range(2, steps + 1, 2)), name
    assert [e.step for e in EventAccumulator(str(out / "tensorboard" / "epochs")).Reload().Scalars("top1")] == [1, 2]
    assert "skipped 1 unreadable images" in text and re.search(
        r"Skipped unreadable image \S*broken\.JPEG \(cannot identify", text
    )
    state = read_checkpoint(str(out / "checkpoint_last.pth"))
    assert state["epoch"] == 2 and {"optimizer", "lr_drop", "rng", "step", "config"} <= state.keys()
    assert load_cfg(out / "config.yaml").OPTIM.EPOCHS == 2
    # Run again: nothing is left to train, and it says so; fewer epochs than trained are refused, config untouched.
    written = (out / "checkpoint_last.pth").read_bytes()
    assert train(tiny_cfg(data, out, "LOG_FREQ", "2")) == state["best_acc"]
    assert "has trained all 2 epochs" in (out / "log.txt").read_text()
    assert (out / "checkpoint_last.pth").read_bytes() == written
    with pytest.raises(ValueError, match=r"trained 2 epochs, more than OPTIM.EPOCHS 1; set OPTIM.EPOCHS to 3"):
        train(tiny_cfg(data, out, "LOG_FREQ", "2", "OPTIM.EPOCHS", "1"))
    assert load_cfg(out / "config.yaml").OPTIM.EPOCHS == 2


def straight_and_resumed(data, tmp_path, *overrides):
    """Two epochs of training straight, and resumed from the state after the first one, as a run stopped there would
    have left it: the two output folders."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_cfg(data, straight, *overrides))
    resumed.mkdir()
    (resumed / "checkpoint_last.pth").write_bytes((straight / "checkpoint_epoch1.pth").read_bytes())
    train(tiny_cfg(data, resumed, *overrides))
    return straight, resumed


def test_resume_after_one_epoch_gives_identical_weights(data, tmp_path):
    """With the EMA weights, and Mixup, which draws from NumPy's random state in the main process: a resume restores
    it with torch's and Python's, or the resumed run mixes other pairs and ends elsewhere."""
    mixup = ("AUG.MIXUP", "0.8", "AUG.MIXUP_PROB", "1.0")
    straight, resumed = straight_and_resumed(data, tmp_path, "MODEL.EMA", "True", *mixup)
    assert re.search(r"Resumed from \S+: optimizer step 3 \(the end of epoch 1\)\.", (resumed / "log.txt").read_text())
    assert_same_weights(final_weights(straight), final_weights(resumed))
    ema = [read_checkpoint(str(d / "checkpoint_last.pth"))["ema"] for d in (straight, resumed)]
    assert_same_weights(*ema)


def test_a_resumed_runs_eta_counts_the_epochs_it_ran(data, tmp_path, monkeypatch):
    """A run of 1 epoch resumed to 3, with a clock that reads 10 s more each time: the resumed run starts at 0 s,
    its first epoch (2 of 3) runs from 10 s to 20 s and logs its ETA at 30 s, 30 s for that one epoch; the epoch left
    takes as long. Counting the epoch before the resume as well would halve it."""
    from types import SimpleNamespace

    import vil.training.evaluation as training_evaluation
    import vil.training.loop as training_loop

    train(tiny_cfg(data, tmp_path / "run", "OPTIM.EPOCHS", "1"))
    seconds = itertools.count(step=10)
    clock = SimpleNamespace(perf_counter=lambda: float(next(seconds)))
    for module in (training_loop, training_evaluation):
        monkeypatch.setattr(module, "time", clock)
    train(tiny_cfg(data, tmp_path / "run", "OPTIM.EPOCHS", "3"))
    etas = re.findall(r"epoch (\d)/3: .*; ETA (\S+)", (tmp_path / "run" / "log.txt").read_text())
    assert etas == [("2", "0:00:30"), ("3", "0:00:00")], etas


def test_train_returns_the_last_epochs_top1_and_keeps_the_best(data, tmp_path, monkeypatch):
    import vil.training.loop as training_loop

    scores = iter([50.0, 30.0])
    monkeypatch.setattr(training_loop, "evaluate_epoch", lambda *args: next(scores))
    assert train(tiny_cfg(data, tmp_path / "run")) == 30.0
    assert read_checkpoint(str(tmp_path / "run" / "checkpoint_last.pth"))["best_acc"] == 50.0


def test_a_snapshot_due_at_an_epochs_last_step_is_superseded_by_the_epochs_checkpoint(tmp_path, monkeypatch):
    """12 images in batches of 4 and CHECKPOINT.EVERY_STEPS 3: the snapshot due at each epoch's last step waits
    for the epoch's end, whose checkpoint (after the evaluation, with the best top-1) replaces it; nothing writes
    the older state over checkpoint_last.pth afterwards."""
    real, written = training_state.save_checkpoint, []

    def recorded(*args, **entries):
        written.append((entries["epoch"], entries["batch_in_epoch"], entries["step"], entries["best_acc"] >= 0))
        return real(*args, **entries)

    monkeypatch.setattr(training_state, "save_checkpoint", recorded)
    data = make_folder(tmp_path / "data", per_class=6, corrupt=False)
    train(tiny_cfg(data, tmp_path / "run", "CHECKPOINT.EVERY_STEPS", "3"))
    assert written == [(1, 0, 3, True), (2, 0, 6, True)], written


def test_a_run_resumed_after_an_optim_val_drop_keeps_the_rates_bits(data, tmp_path, monkeypatch):
    """Every epoch after the first scores no better (evaluation held at 50%), so OPTIM.VAL divides the rates by 10
    at the ends of epochs 2 and 3; under layer decay, a run resumed after the first drop ends with the
    uninterrupted run's learning rates and weights, bit for bit."""
    import vil.training.loop as loop

    evaluate_epoch = loop.evaluate_epoch
    monkeypatch.setattr(loop, "evaluate_epoch", lambda *args: [evaluate_epoch(*args), 50.0][1])
    overrides = ("OPTIM.OPT", "sgd", "OPTIM.VAL", "1", "OPTIM.EPOCHS", "3", "OPTIM.LAYER_DECAY", "0.65")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_cfg(data, straight, *overrides))
    resumed.mkdir()
    (resumed / "checkpoint_last.pth").write_bytes((straight / "checkpoint_epoch2.pth").read_bytes())
    train(tiny_cfg(data, resumed, *overrides))
    ends = [read_checkpoint(str(d / "checkpoint_last.pth")) for d in (straight, resumed)]
    assert ends[0]["lr_drop"] == ends[1]["lr_drop"] == 1 / 10 / 10
    scales = [[group["lr_scale"] for group in end["optimizer"]["param_groups"]] for end in ends]
    assert len(set(scales[0])) > 1 and scales[0] == scales[1]
    assert_same_weights(ends[0]["net"], ends[1]["net"])


@pytest.mark.parametrize("attention", [(), ("MODEL.VIT.MSVIT.ATTN_TYPE", "performer")], ids=["longformer", "performer"])
def test_run_killed_mid_epoch_resumes_from_its_last_checkpoint(data, tmp_path, monkeypatch, attention):
    """Performer attention draws its features in the forward, between the step a checkpoint is due at and the one
    it is written at: the checkpoint holds the draws of the first."""
    straight = tmp_path / "straight"
    train(tiny_cfg(data, straight, "CHECKPOINT.EVERY_STEPS", "2", *attention))
    killed = tmp_path / "killed"
    saves = []
    real_save = training_state.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        saves.append(kwargs["batch_in_epoch"])
        if len(saves) == 3:  # steps 2 (mid epoch 1) and 3 (its end), then step 4: batch 1 of epoch 2
            raise KeyboardInterrupt

    monkeypatch.setattr(training_state, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(data, killed, "CHECKPOINT.EVERY_STEPS", "2", *attention))
    assert saves == [2, 0, 1]  # killed mid-epoch, right after the checkpoint at batch 1 of epoch 2
    monkeypatch.setattr(training_state, "save_checkpoint", real_save)
    train(tiny_cfg(data, killed, "CHECKPOINT.EVERY_STEPS", "2", *attention))
    assert_same_weights(final_weights(straight), final_weights(killed))


def test_a_resume_whose_epochs_take_other_steps_goes_on_from_the_epochs_place_in_the_schedule(
    data, tmp_path, monkeypatch
):
    """Shards read by another number of processes, or another OPTIM.EPOCHS, change the steps of every epoch: from
    epoch 2 on, the learning rates are those of a run that took the new number from the start."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def rates(out):
        return [e.value for e in EventAccumulator(str(out / "tensorboard" / "steps")).Reload().Scalars("train/lr")]

    resumed = tmp_path / "resumed"
    train(tiny_cfg(data, resumed, "OPTIM.EPOCHS", "1", "LOG_FREQ", "1"))  # 13 images, 4 a batch: 3 steps
    monkeypatch.setattr(training_setup, "steps_per_epoch", lambda *args: 2)
    train(tiny_cfg(data, resumed, "OPTIM.EPOCHS", "3", "LOG_FREQ", "1"))
    assert "the schedule goes on from step 2 of 6" in (resumed / "log.txt").read_text()
    planned = tmp_path / "planned"
    train(tiny_cfg(data, planned, "OPTIM.EPOCHS", "3", "LOG_FREQ", "1"))
    # The image folders give 3 batches an epoch whatever the plan says: steps 4 to 9 (places 3 to 8) of the resumed
    # run are steps 3 to 8 of the planned one.
    assert rates(resumed)[3:] == pytest.approx(rates(planned)[2:8], rel=1e-6)
    assert read_checkpoint(str(resumed / "checkpoint_last.pth"))["schedule_offset"] == -1


def test_training_keys_that_the_chosen_optimizer_schedule_ema_amp_or_mixing_do_not_read_are_said(data, tmp_path):
    unread = ["OPTIM.MOM", "0.5", "OPTIM.NU", "0.5", "OPTIM.ADAM.EPS", "1e-6", "AMP.DTYPE", "float16"]
    unread += ["MODEL.EMA_DECAY", "0.99", "AUG.MIXUP_PROB", "1.0", "SOLVER.MIN_LR", "1e-6", "OPTIM.DROP_FACTOR", "5.0"]
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", "SOLVER.LR_POLICY", "constant", *unread))
    said = [line.split(" ", 2)[2] for line in (out / "log.txt").read_text().splitlines() if ", but " in line]
    assert said == [
        "OPTIM.MOM is set, but OPTIM.OPT adamw does not read it (sgd's and qhm's momentum).",
        "OPTIM.NU is set, but OPTIM.OPT adamw does not read it (qhm's).",
        "OPTIM.DROP_FACTOR is set, but only SOLVER.LR_POLICY step and OPTIM.VAL (sgd, qhm) read it.",
        "SOLVER.MIN_LR is set, but only SOLVER.LR_POLICY cosine and linear read it.",
        "MODEL.EMA_DECAY is set, but only MODEL.EMA True reads it.",
        "AMP.DTYPE is set, but only AMP.ENABLED True reads it.",
        "AUG.MIXUP_PROB is set, but no batch mixing is asked for (AUG.MIXUP, AUG.MIXCUT or AUG.MIXCUT_MINMAX), so "
        "nothing reads it.",
    ]  # OPTIM.ADAM.EPS is adamw's: read


def test_keys_that_their_own_switches_leave_unread_are_said(data, tmp_path):
    # 13 images, 4 a batch: 3 steps an epoch, of which 0.2 epochs are none.
    unread = ["MODEL.VIT.MSVIT.VIL_MODE_SWITCH", "0.1", "MODEL.LOAD_EMA", "True", "DATA.DATA_DIR", str(tmp_path)]
    unread += ["OUTPUT_PERCLASS_ACC", "True", "ONLY_SAVE_LAST", "1", "CHECKPOINT.KEEP", "5"]
    unread += ["FINETUNE.USE_TRAIN_AUG", "True", "AUG.COLOR_JITTER", "[0.8, 0.8, 0.8, 0.2, 0.0]"]
    schedule = ["SOLVER.LR_POLICY", "cosine", "SOLVER.WARMUP_EPOCHS", "0.2"]
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", *schedule, *unread))
    said = {line.split(" ", 2)[2] for line in (out / "log.txt").read_text().splitlines()}
    assert {
        "MODEL.VIT.MSVIT.VIL_MODE_SWITCH is set, but only MODEL.VIT.MSVIT.MODE 1 or 2 switches modes.",
        "MODEL.LOAD_EMA, DATA.DATA_DIR are set, but only MODEL.MODEL_PATH's checkpoint is read with them.",
        "OUTPUT_PERCLASS_ACC is set, but only evaluations (EVALUATE True, tools/eval.py) read it.",
        "CHECKPOINT.KEEP is set, but ONLY_SAVE_LAST 1 writes no epoch checkpoints for it to count.",
        "FINETUNE.USE_TRAIN_AUG is set, but only FINETUNE.FINETUNE True reads it.",
        "AUG.COLOR_JITTER is set, but its probability (the fifth number) is 0, so its strengths do nothing.",
        "SOLVER.WARMUP_EPOCHS 0.2 is less than one of the 3 optimizer steps an epoch takes, so the run has no "
        "warmup; give at least 0.333 epochs for one step.",
    } <= said


@pytest.mark.parametrize(
    "overrides, warned",
    [
        (
            ["SOLVER.LR_POLICY", "", "SOLVER.EPOCH_BASED_SCHEDULE", "True"],
            "SOLVER.EPOCH_BASED_SCHEDULE is set, but SOLVER.LR_POLICY '' (no schedule) has no warmup and keeps "
            "OPTIM.LR, so nothing reads it.",
        ),
        (
            ["SOLVER.LR_POLICY", "cosine", "SOLVER.WARMUP_EPOCHS", "0", "SOLVER.WARMUP_FACTOR", "0.5"],
            "SOLVER.WARMUP_FACTOR is set, but SOLVER.WARMUP_EPOCHS 0 (no warmup) leaves it unread.",
        ),
        (  # timm's Mixup takes CutMix's boxes from the fractions, and no Beta alpha, when they are given
            ["AUG.MIXUP", "0.8", "AUG.MIXCUT", "5.0", "AUG.MIXCUT_MINMAX", "[0.2, 0.8]"],
            "AUG.MIXCUT is set, but AUG.MIXCUT_MINMAX sizes CutMix's boxes instead, so nothing reads it.",
        ),
    ],
)
def test_schedule_keys_without_a_schedule_or_warmup_to_act_on_are_said(overrides, warned, caplog):
    from vil.config import warn_unread_keys

    warn_unread_keys(load_cfg(overrides=overrides), training_setup._unread_training_keys(load_cfg(overrides=overrides)))
    assert warned in caplog.text


def test_a_resume_says_that_it_does_not_read_a_new_model_path(data, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "2", "MODEL.MODEL_PATH", str(tmp_path / "other.pth")))  # never read
    text = (out / "log.txt").read_text()
    assert "new values, which the run follows from here: OPTIM.EPOCHS 1 -> 2." in text
    assert f"MODEL.MODEL_PATH is read when a run starts, not when it resumes: this run goes on from {out}" in text


def test_performer_features_are_redrawn_on_the_original_schedule(data, tmp_path, monkeypatch):
    """Every 1 + 5 * epoch training forwards (epochs counted from 0), set at the start of each epoch."""
    intervals, real_set = [], MsViT.set_feature_redraw_interval

    def recording(model, interval):
        intervals.append(interval)
        real_set(model, interval)

    monkeypatch.setattr(MsViT, "set_feature_redraw_interval", recording)
    train(tiny_cfg(data, tmp_path / "run", "OPTIM.EPOCHS", "3", "MODEL.VIT.MSVIT.ATTN_TYPE", "performer"))
    assert intervals == [1, 6, 11]


def test_workers_change_nothing_and_a_resume_with_workers_is_exact(data, tmp_path, monkeypatch):
    """Each sample's augmentation is seeded by (SEED, epoch, index): a run with two persistent loading workers,
    killed mid-epoch and resumed, ends with the weights of a straight run that loads in its own process."""
    straight = tmp_path / "straight"
    train(tiny_cfg(data, straight, "CHECKPOINT.EVERY_STEPS", "2", "DATALOADER.WORKERS", "0"))
    killed, saves = tmp_path / "killed", []
    real_save = training_state.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        saves.append(kwargs["batch_in_epoch"])
        if len(saves) == 1:  # step 2, mid epoch 1
            raise KeyboardInterrupt

    monkeypatch.setattr(training_state, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(data, killed, "CHECKPOINT.EVERY_STEPS", "2", "DATALOADER.WORKERS", "2"))
    monkeypatch.setattr(training_state, "save_checkpoint", real_save)
    train(tiny_cfg(data, killed, "CHECKPOINT.EVERY_STEPS", "2", "DATALOADER.WORKERS", "2"))
    assert_same_weights(final_weights(straight), final_weights(killed))


def test_the_training_loader_is_built_once_and_seeds_each_sample(data, tmp_path):
    from types import SimpleNamespace

    from vil.data import build_dataset
    from vil.runtime import Runtime
    from vil.training.epoch import SeededSamples, training_batches

    cfg = tiny_cfg(data, tmp_path / "out", "DATALOADER.WORKERS", "1")
    train_set = build_dataset(cfg, train=True)
    run = SimpleNamespace(cfg=cfg, runtime=Runtime(), train_set=train_set, batch=4, batch_in_epoch=0, train_loader=None)
    first = training_batches(run, 0)
    assert first.persistent_workers and not first.pin_memory  # pinned memory is for CUDA
    epochs = [[targets.tolist() for _, targets, _ in training_batches(run, epoch)] for epoch in (0, 1)]
    assert training_batches(run, 1) is first and epochs[0] != epochs[1]  # one loader, a new order each epoch
    run.batch_in_epoch = 1
    assert [t.tolist() for _, t, _ in training_batches(run, 1)] == epochs[1][1:]  # a resume skips what was trained
    draws = SeededSamples(RandomDraws(), cfg.SEED)  # what a random augmentation draws, from each generator
    torch.manual_seed(123)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist()
    first = draws[(0, 1)]
    assert torch.equal(torch.get_rng_state(), states[0])  # the caller's random states are left as they were
    assert (random.getstate(), np.random.get_state()[1].tolist()) == states[1:]
    assert draws[(0, 1)] == first and draws[(1, 1)] != first and draws[(0, 2)] != first
    # Keys whose numbers add up alike draw apart too: epoch 1's sample 0, and the next seed's epoch 0 sample 0.
    next_seed = SeededSamples(RandomDraws(), cfg.SEED + 1)[(0, 0)]
    assert draws[(1, 0)] != first and next_seed != first and next_seed != draws[(1, 0)]


class RandomDraws(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.rand(1).item(), random.random(), float(np.random.rand())


def test_mode_switch_happens_at_the_configured_epoch_also_after_resume(data, tmp_path, monkeypatch):
    from vil.models.attention import LongformerAttention

    drawn = []  # the neighbour mode of each training forward of each longformer layer
    real_mode = LongformerAttention.current_mode

    def recorded(self):
        mode = real_mode(self)
        if self.training:
            drawn.append(int(mode))
        return mode

    monkeypatch.setattr(LongformerAttention, "current_mode", recorded)
    out, resumed = straight_and_resumed(
        data, tmp_path, "MODEL.VIT.MSVIT.MODE", "2", "MODEL.VIT.MSVIT.VIL_MODE_SWITCH", "0.3", "OPTIM.EPOCHS", "3"
    )
    # The straight run: 2 layers x 3 batches an epoch, random modes 1..8 in epoch 1 and mode 0 in epochs 2 and 3;
    # then the resumed run's epochs 2 and 3, mode 0 as well.
    assert len(drawn) == 30 and all(1 <= m <= 8 for m in drawn[:6]) and drawn[6:] == [0] * 24
    text = (out / "log.txt").read_text()
    assert re.findall(r"Epoch \d: random-shift training ends", text) == ["Epoch 2: random-shift training ends"]
    assert "Epoch 2: random-shift training ends" in (resumed / "log.txt").read_text()
    assert_same_weights(final_weights(out), final_weights(resumed))


def torchrun_two_processes(data, out, *overrides, succeeds=True):
    """One epoch of tools/train.py in two processes on the CPU (gloo); the finished process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    overrides = [
        "MODEL.VIT.MSVIT.ARCH",
        TINY_ARCH,
        "INPUT.IMAGE_SIZE",
        "32",
        "DATA.PATH",
        str(data),
        "DATA.NUM_CLASSES",
        "2",
        "DATALOADER.BSZ",
        "4",
        "DATALOADER.WORKERS",
        "0",
        "OPTIM.EPOCHS",
        "1",
        "OUTPUT_DIR",
        str(out),
        *overrides,
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",  # a free port: tests in other workers run at the same time
            str(ROOT / "tools" / "train.py"),
            "--config-file",
            str(ROOT / "configs" / "vil_tiny.yaml"),
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert (done.returncode == 0) == succeeds, done.stderr[-8000:]  # the ranks' own errors come before torchrun's
    return done


def test_torchrun_the_log_names_the_unreadable_images_every_process_met(tmp_path):
    """The main process writes log.txt: the other's unreadable images are named there too, and each total once."""
    data = make_folder(tmp_path / "data", corrupt=False)
    (data / "val" / "cat" / "0_broken.JPEG").write_bytes(b"not a jpeg")  # the second image: process 1's share
    out = tmp_path / "ddp"
    done = torchrun_two_processes(data, out)
    text = (out / "log.txt").read_text()
    assert re.search(r"Skipped unreadable image \S*0_broken\.JPEG \(cannot identify .*\) \(process 1\)\.", text)
    assert text.count("Evaluation skipped 1 unreadable images.") == 1
    assert done.stderr.count("Evaluation skipped 1 unreadable images.") == 1


SLOW_MAIN_PROCESS = """
import os

if os.environ.get("RANK") == "0":
    import time

    import vil.training.loop as loop

    epoch = loop.train_one_epoch

    def after_a_pause(*args):  # torchrun stops every process within 0.1 s of one failing: this one sleeps then
        time.sleep(3)
        return epoch(*args)

    loop.train_one_epoch = after_a_pause
"""


@pytest.mark.parametrize("main", ["meets the failure", "is stopped by torchrun first"])
def test_torchrun_a_process_that_stops_alone_leaves_its_sentence_for_the_main_process(tmp_path, monkeypatch, main):
    """Process 1 alone meets a training batch whose images are all unreadable: the main process, which then fails in
    gloo's words in its next collective call, says process 1's sentence instead, in log.txt too; so it does when
    torchrun stops it (SIGTERM) before its first training step (a sitecustomize module delays it)."""
    from types import SimpleNamespace

    from vil.data import build_dataset
    from vil.training.epoch import epoch_order

    data = make_folder(tmp_path / "data", per_class=4, corrupt=False)
    cfg = load_cfg(ROOT / "configs" / "vil_tiny.yaml", ["DATA.PATH", str(data), "DATA.NUM_CLASSES", "2"])
    dataset = build_dataset(cfg, train=True)
    process_1 = SimpleNamespace(world=2, rank=1)
    for index in epoch_order(dataset, 0, cfg.SEED, process_1, cfg.AUG.REPEATED_AUG)[:2]:  # its first batch of 2
        Path(dataset.samples[index][0]).write_bytes(b"not a jpeg")
    if main == "is stopped by torchrun first":
        (tmp_path / "slow_main").mkdir()
        (tmp_path / "slow_main" / "sitecustomize.py").write_text(SLOW_MAIN_PROCESS)
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join([str(tmp_path / "slow_main"), os.environ.get("PYTHONPATH", "")])
        )
    out = tmp_path / "ddp"
    done = torchrun_two_processes(data, out, succeeds=False)
    stopped = "Another process stopped the run: process 1: All 2 images of the training batch at epoch 1, batch 1"
    assert f"error: {stopped}" in (out / "log.txt").read_text() and stopped in done.stderr, done.stderr[-4000:]


def test_the_main_process_stopped_by_sigterm_runs_its_action_then_stops_as_sigterm_stops_it():
    """torchrun stops every process with SIGTERM within 0.1 s of one failing, maybe before the main process has met
    the failure: the main process first says what it must (the action), then stops as SIGTERM stops it. Outside
    the block, and in the other processes, SIGTERM's handler is the one before."""
    import signal

    from vil.runtime import Runtime

    script = """
import os, signal, time
from vil.runtime import Runtime
runtime = Runtime("gloo")
runtime.world = 2  # as under torchrun, without a process group
with runtime.before_stopped(lambda: print("said before stopping", flush=True)):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("not stopped")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (-signal.SIGTERM, "said before stopping\n"), done
    runtime, before = Runtime("gloo"), signal.getsignal(signal.SIGTERM)
    runtime.world = 2
    with runtime.before_stopped(lambda: None):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    runtime.is_main = False
    with runtime.before_stopped(lambda: None):
        assert signal.getsignal(signal.SIGTERM) is before


def test_torchrun_a_refusal_of_the_main_process_alone_is_its_sentence_in_every_process(data, tmp_path):
    """The run folder is checked in the main process only: the other must say the same, not fail in gloo's words
    while it waits for the first."""
    (tmp_path / "a_file").write_text("")
    done = torchrun_two_processes(data, tmp_path / "a_file", succeeds=False)
    assert f"error: OUTPUT_DIR {tmp_path / 'a_file'} cannot be written (it is a file" in done.stderr
    assert "[rank1]" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-4000:]


@pytest.mark.parametrize("attn_type", ["longformer", "performer"])  # performer: each process draws features
def test_torchrun_two_processes_end_with_identical_weights(data, tmp_path, attn_type):
    """Parameters and buffers agree at the end (the performer redraws at every step of its first epoch, also at the
    last one before the evaluation)."""
    out = tmp_path / "ddp"
    done = torchrun_two_processes(data, out, "AUG.REPEATED_AUG", "True", "MODEL.VIT.MSVIT.ATTN_TYPE", attn_type)
    assert "Grad strides do not match" not in done.stderr  # each gradient laid out as its parameter
    text = (out / "log.txt").read_text()
    assert "2 process(es)" in text and "All 2 processes hold identical weights." in text
    backend_lines = [line for line in text.splitlines() if "DISTRIBUTED_BACKEND" in line]
    assert backend_lines and all("nccl" in line and "CUDA" in line and "gloo" in line for line in backend_lines)
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["step"] == 3  # 13 images, 2 a process a batch


def test_torchrun_two_processes_on_shards_end_the_epoch_together_where_a_damaged_shard_runs_one_short(tmp_path):
    """4 shards of 3 images, 2 processes with batches of 2: each process reads its 2 shards (which ones, and that
    they cover every sample once, tests/test_shards.py checks for every rank), 3 steps an epoch by the plan. The
    first shard is cut within its first sample: the process that reads it has 3 readable images and the cut shard's
    one unreadable sample, 2 batches where the plan has 3. Both processes end the epoch after 2 steps, said once,
    instead of the other waiting in its third step for ever (had each process read every shard, the plan would
    have 6 steps and the short one 5)."""
    folder = make_folder(tmp_path / "folder", per_class=6, corrupt=False)
    assert run_tool("make_shards", folder, tmp_path / "shards", "--per-shard", "3")[0] == 0
    first = tmp_path / "shards" / "train" / "shard-000000.tar"
    first.write_bytes(first.read_bytes()[:600])  # the first member's header and a little of its data
    out = tmp_path / "ddp"
    done = torchrun_two_processes(tmp_path / "shards", out, "DATA.FORMAT", "shards")
    text = (out / "log.txt").read_text()
    assert "12 training and 12 evaluation images, 2 process(es)" in text
    assert "Epoch 1 ends 1 of its batches early: 1 of 2 process(es) ran out of samples" in text
    assert (done.stdout + done.stderr).count("ends 1 of its batches early") == 1  # on the console too
    assert "All 2 processes hold identical weights." in text
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["step"] == 2


@pytest.mark.parametrize(
    "args,facts",
    [
        (["OPTIM.LRR", "0.1"], ["Unknown config key OPTIM.LRR", "OPTIM.LR?", "vil/config.py"]),
        (["DATA.PATH", "/nonexistent"], ["DATA.PATH /nonexistent does not exist", "DATA.PATH/train/<class>/<image>"]),
    ],
)
def test_config_typo_and_missing_data_are_one_sentence(args, facts, tmp_path):
    status, _, stderr = run_tool(
        "train", "--config-file", ROOT / "configs" / "vil_tiny.yaml", "OUTPUT_DIR", tmp_path / "o", *args
    )
    assert status == 1 and "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(fact in last for fact in facts), last


def break_loss(monkeypatch, at_call, broken):
    """Make the training loss ``broken(criterion, logits, targets)`` at its ``at_call``-th call."""
    real_loss = training_setup.build_loss
    calls = []

    def build(cfg, mixup):
        criterion = real_loss(cfg, mixup)

        def loss(logits, targets):
            calls.append(1)
            return broken(criterion, logits, targets) if len(calls) == at_call else criterion(logits, targets)

        return loss

    monkeypatch.setattr(training_setup, "build_loss", build)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_nan_loss_stops_before_the_last_good_checkpoint_is_overwritten(data, tmp_path, monkeypatch, value):
    # epoch 2, batch 2 (3 batches an epoch)
    break_loss(monkeypatch, 5, lambda criterion, logits, targets: criterion(logits, targets) * float(value))
    out = tmp_path / "nan"
    with pytest.raises(
        FloatingPointError,
        match=rf"^Training stops before optimizer step 5: the loss became {value} at epoch 2, batch 2; "
        r"\S+checkpoint_last.pth keeps optimizer step 3 \(the end of epoch 1\), "
        r"the newest state whose loss and gradients were finite",
    ):
        train(tiny_cfg(data, out))
    assert (out / "checkpoint_last.pth").read_bytes() == (out / "checkpoint_epoch1.pth").read_bytes()
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["epoch"] == 1


def test_weights_of_another_architecture_or_mechanism_are_refused_naming_what_changed(data, tmp_path):
    """A checkpoint that records its config: weights that do not fit the model are refused naming the config
    values that differ, when fine-tuning (where other values are allowed while the weights fit) and evaluating."""
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    weights = ("MODEL.MODEL_PATH", str(out / "model_best.pth"))
    wider = TINY_ARCH.replace("d32", "d48")
    with pytest.raises(ValueError) as caught:
        train(tiny_cfg(data, tmp_path / "tune", *weights, "MODEL.VIT.MSVIT.ARCH", wider))
    message = str(caught.value)
    assert "MODEL.VIT.MSVIT.ARCH" in message and repr(wider) in message and "do not fit" in message
    with pytest.raises(ValueError) as caught:
        evaluate_checkpoint(tiny_cfg(data, tmp_path / "eval", *weights, "MODEL.VIT.MSVIT.ATTN_TYPE", "full"))
    message = str(caught.value)
    assert "MODEL.VIT.MSVIT.ATTN_TYPE" in message and "(now 'full')" in message and "do not fit" in message
    # Another refusal is not taken for weights that do not fit: here, EMA weights the checkpoint does not hold.
    with pytest.raises(ValueError, match="holds no EMA weights"):
        train(tiny_cfg(data, tmp_path / "ema", *weights, "MODEL.LOAD_EMA", "True", "MODEL.VIT.MSVIT.LN_EPS", "0.1"))


def test_evaluation_at_another_image_size_than_the_training_says_so(data, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    capsys.readouterr()
    for size, said in (("32", False), ("64", True)):
        weights = ("MODEL.MODEL_PATH", str(out / "model_best.pth"))
        cfg = tiny_cfg(data, tmp_path / size, *weights, "INPUT.IMAGE_SIZE", size, "AMP.ENABLED", "True")
        evaluate_checkpoint(cfg)  # its log, on the console
        printed = capsys.readouterr().err
        assert ("trained on 32x32 images; this model is built for 64x64" in printed) == said, printed
        # The presets' AMP.ENABLED, which the CPU takes only with AMP.ON_CPU: the evaluation says it is float32.
        assert printed.count("applies on CUDA, and on the CPU with AMP.ON_CPU True; this run is float32 on cpu") == 1
    # The original release's layout holds no config: its position tables tell the maps they were made for.
    net = read_checkpoint(str(out / "model_best.pth"))["net"]
    torch.save({"net": {f"module.{k}": v for k, v in net.items()}, "arch": "msvit"}, tmp_path / "original.pth")
    for size, said in (("32", False), ("64", True)):
        cfg = tiny_cfg(data, tmp_path / f"o{size}", "MODEL.MODEL_PATH", str(tmp_path / "original.pth"))
        cfg.merge_from_list(["INPUT.IMAGE_SIZE", size])
        evaluate_checkpoint(cfg)
        printed = capsys.readouterr().err
        assert ("tables made for 32x32 images; this model is built for 64x64" in printed) == said, printed


def test_eval_reports_top1_top5_for_own_and_original_checkpoints(data, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    net = read_checkpoint(str(out / "model_best.pth"))["net"]
    torch.save({"net": {f"module.{k}": v for k, v in net.items()}, "arch": "msvit"}, tmp_path / "original.pth")
    common = [
        "MODEL.VIT.MSVIT.ARCH",
        TINY_ARCH,
        "INPUT.IMAGE_SIZE",
        "32",
        "DATA.PATH",
        str(data),
        "DATA.NUM_CLASSES",
        "2",
        "DATALOADER.WORKERS",
        "0",
        "OUTPUT_DIR",
        str(tmp_path / "eval"),
    ]
    lines = []
    for checkpoint in (out / "model_best.pth", tmp_path / "original.pth"):
        status, stdout, stderr = run_tool(
            "eval", "--config-file", ROOT / "configs" / "vil_tiny.yaml", *common, "MODEL.MODEL_PATH", checkpoint
        )
        assert status == 0, stderr[-2000:]
        lines.append(stdout.strip().splitlines()[-1])
    assert lines[0] == lines[1]
    assert re.fullmatch(r"top-1 \d+\.\d\d top-5 \d+\.\d\d", lines[0])
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert f"top-1 {result['top1']:.2f} top-5 {result['top5']:.2f}" == lines[0] and result["images"] == 12
    assert result["weights"] == "model"  # MODEL.LOAD_EMA False
    status, _, stderr = run_tool("eval", "--config-file", ROOT / "configs" / "vil_tiny.yaml", *common)
    assert status == 1 and re.fullmatch(r"error: [^\n]*MODEL\.MODEL_PATH[^\n]*\.", stderr.strip())
    net["head.weight"].fill_(3e38)  # finite weights whose logits overflow
    torch.save({"net": net}, tmp_path / "huge.pth")
    status, _, stderr = run_tool(
        "eval", "--config-file", ROOT / "configs" / "vil_tiny.yaml", *common, "MODEL.MODEL_PATH", tmp_path / "huge.pth"
    )
    assert status == 1 and re.search(r"error: .*12 of the 12 evaluation images are not finite.*huge\.pth", stderr)
    net["head.bias"][1] = float("nan")  # weights that are not finite are refused as the checkpoint is loaded
    torch.save({"net": net}, tmp_path / "nan.pth")
    status, _, stderr = run_tool(
        "eval", "--config-file", ROOT / "configs" / "vil_tiny.yaml", *common, "MODEL.MODEL_PATH", tmp_path / "nan.pth"
    )
    assert status == 1 and re.search(
        r"error: Checkpoint \S*nan\.pth holds values that are not finite .* 1 tensors, e.g. head\.bias", stderr
    )
    # The checkpoint records the training data's classes; the same ones in another order are refused.
    best = read_checkpoint(str(out / "model_best.pth"))
    assert best["classes"] == ["cat", "dog"]
    for classes, name in ((["dog", "cat"], "swapped"), (["0", "1"], "renamed"), (["cat", "dog", "bird"], "more")):
        torch.save({**best, "classes": classes}, tmp_path / f"{name}.pth")
        status, _, stderr = run_tool(
            "eval", "--config-file", ROOT / "configs" / "vil_tiny.yaml", *common, "MODEL.MODEL_PATH",
            tmp_path / f"{name}.pth",
        )  # fmt: skip
        if name == "swapped":
            assert status == 1 and re.search(
                r"error: .*swapped\.pth.*label 0 is 'dog', the data's 'cat'.*CLASSES", stderr
            )
        elif name == "renamed":  # another naming of two labels: scored label by label, said once
            assert status == 0 and re.search(r"label 0 is '0', the data's 'cat'", stderr), stderr[-2000:]
        else:  # another class count: not a naming of the data's labels (the classifier decides), no word of one
            assert status == 0 and "named otherwise" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("big,accum,epochs", [(4, 2, 1), (8, 4, 2)])
def test_gradient_accumulation_matches_the_larger_batch(tmp_path, big, accum, epochs):
    """12 images: batches of ``big``, or of 2 with ``accum`` of them a step. With 8 and 4, an epoch has 6 batches of
    2, one step and 2 batches that fill none: those are left out, as the batch of 8 leaves out the last 4 images."""
    data = make_folder(tmp_path / "clean", per_class=6, corrupt=False)  # a refilled batch would differ
    # SGD: linear in the gradient (Adam would turn rounding noise in near-zero gradients into full steps).
    common = (
        "MODEL.VIT.DROP_PATH",
        "0.0",
        "OPTIM.EPOCHS",
        str(epochs),
        "SOLVER.WARMUP_EPOCHS",
        "0.0",
        "OPTIM.OPT",
        "sgd",
    )
    train(tiny_cfg(data, tmp_path / "big", *common, "DATALOADER.BSZ", str(big)))
    train(tiny_cfg(data, tmp_path / "accum", *common, "DATALOADER.BSZ", "2", "OPTIM.ACCUM_STEPS", str(accum)))
    weights = {run: final_weights(tmp_path / run) for run in ("big", "accum")}
    for key in weights["big"]:
        torch.testing.assert_close(weights["accum"][key], weights["big"][key], rtol=1e-4, atol=1e-6, msg=key)
    assert read_checkpoint(str(tmp_path / "accum" / "checkpoint_last.pth"))["step"] == 12 // big * epochs


@pytest.mark.parametrize("accum", [1, 2])
def test_the_log_gives_the_seconds_of_each_optimizer_step(tmp_path, monkeypatch, accum):
    """With a clock that advances one second each time it is read, each batch takes a second to fetch and one to
    compute: data_s and step_s, the seconds per optimizer step, are the batches each step takes (OPTIM.ACCUM_STEPS)."""
    from types import SimpleNamespace

    import vil.training.epoch as training_epoch

    seconds = itertools.count()
    monkeypatch.setattr(training_epoch, "time", SimpleNamespace(perf_counter=lambda: float(next(seconds))))
    data = make_folder(tmp_path / "clean", per_class=4, corrupt=False)
    common = ("OPTIM.EPOCHS", "1", "DATALOADER.BSZ", "2", "LOG_FREQ", "1", "OPTIM.ACCUM_STEPS", str(accum))
    train(tiny_cfg(data, tmp_path / "run", *common))
    logged = re.findall(r" step \d+: .*, data_s (\S+), step_s (\S+),", (tmp_path / "run" / "log.txt").read_text())
    assert len(logged) == 4 // accum and all(float(d) == float(s) == accum for d, s in logged), logged


def test_gradient_clipping_bounds_each_update(data, tmp_path, monkeypatch):
    """Each SGD step (no momentum, no weight decay) of gradients whose norm is far above OPTIM.CLIP_GRAD moves the
    weights by exactly the step's learning rate times OPTIM.CLIP_GRAD."""
    import vil.training.epoch as training_epoch

    real_step, moves = training_epoch.optimizer_step, []

    def measured_step(run, where):
        before = [p.detach().clone() for p in run.model.parameters()]
        real_step(run, where)
        moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(run.model.parameters(), before)))
        moves.append((moved.item(), run.lr))  # run.lr: the rate of the step just taken

    monkeypatch.setattr(training_epoch, "optimizer_step", measured_step)
    common = ("MODEL.VIT.DROP_PATH", "0.0", "OPTIM.EPOCHS", "1", "OPTIM.OPT", "sgd", "OPTIM.MOM", "0.0")
    common += ("OPTIM.WD", "0.0", "SOLVER.WARMUP_EPOCHS", "0.0", "OPTIM.LR", "0.1")
    train(tiny_cfg(data, tmp_path / "clipped", *common, "OPTIM.CLIP_GRAD", "1e-3"))
    assert len(moves) == 3
    for moved, lr in moves:
        assert lr > 0 and moved == pytest.approx(lr * 1e-3, rel=1e-4)


def test_ema_weights_are_kept_and_differ_from_the_model(data, tmp_path, monkeypatch):
    # Relative position bias: its models carry integer index buffers, which the average must leave alone.
    train(
        tiny_cfg(
            data,
            tmp_path / "ema",
            "MODEL.EMA",
            "True",
            "MODEL.EMA_DECAY",
            "0.5",
            "MODEL.VIT.MSVIT.ARCH",
            TINY_ARCH.replace("a1", "a0"),
        )
    )
    state = read_checkpoint(str(tmp_path / "ema" / "checkpoint_last.pth"))
    assert state["ema"].keys() == state["net"].keys()
    assert any(not torch.equal(state["ema"][k], state["net"][k]) for k in state["net"])
    assert "top1_ema" in (tmp_path / "ema" / "log.txt").read_text()
    # The average is updated after every optimizer step: at decay 0 it is the last step's weights.
    steps, updates, update = [], [], ModelEmaV3.update
    monkeypatch.setattr(ModelEmaV3, "update", lambda ema, *a, **k: updates.append(1) or update(ema, *a, **k))
    hook = register_optimizer_step_post_hook(lambda *_: steps.append(1))
    try:
        train(tiny_cfg(data, tmp_path / "now", "MODEL.EMA", "True", "MODEL.EMA_DECAY", "0.0", "OPTIM.EPOCHS", "1"))
    finally:
        hook.remove()
    assert len(updates) == len(steps) > 1
    state = read_checkpoint(str(tmp_path / "now" / "checkpoint_last.pth"))
    assert all(torch.equal(state["ema"][k], state["net"][k]) for k in state["net"])


def test_the_digits_check_asks_one_image_of_margin():
    from tool_runner import load_tool

    passes = load_tool("check_digits_demo").passes_with_margin
    assert passes(98.89, 180, 98.0) and not passes(98.33, 180, 98.0)  # 178 of 180 passes, 177 (98% rounded up) not
    assert passes(95.54, 359, 95.0) and not passes(95.26, 359, 95.0)  # 343 and 342 of 359


def test_an_earlier_runs_checkpoints_are_never_replaced_or_pruned(data, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", "CHECKPOINT.KEEP", "1"))
    (out / "checkpoint_epoch5.pth").write_bytes((out / "checkpoint_epoch1.pth").read_bytes())  # not this run's epoch
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "2", "CHECKPOINT.KEEP", "1"))  # resumes; KEEP prunes epoch 1 only
    assert sorted(p.name for p in out.glob("checkpoint_epoch*")) == ["checkpoint_epoch2.pth", "checkpoint_epoch5.pth"]
    (out / "checkpoint_last.pth").unlink()
    best = (out / "model_best.pth").read_bytes()
    with pytest.raises(
        ValueError, match=r"model_best\.pth, checkpoint_epoch5\.pth, checkpoint_epoch2\.pth.*OUTPUT_DIR"
    ):
        train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    assert (out / "model_best.pth").read_bytes() == best


def test_repeated_augmentation_order_follows_the_seed():
    from types import SimpleNamespace

    from vil.training.epoch import epoch_order

    def order(seed, epoch, rank):
        return epoch_order(range(12), epoch, seed, SimpleNamespace(world=2, rank=rank), repeated_aug=True)

    assert order(0, 0, 0) == order(0, 0, 0) and len(order(0, 0, 0)) == 6
    assert order(0, 0, 0) != order(1, 0, 0) and order(0, 0, 0) != order(0, 1, 0)
    both = order(0, 0, 0) + order(0, 0, 1)  # 3 repeats of each sample, spread over the processes
    assert all(both.count(i) in (0, 3) for i in range(12)) and len(set(both)) == 4


def test_the_distributed_order_follows_the_seed_and_the_epoch():
    from types import SimpleNamespace

    from vil.training.epoch import epoch_order

    def order(seed, epoch, rank):
        return epoch_order(range(20), epoch, seed, SimpleNamespace(world=2, rank=rank))

    assert order(0, 0, 0) == order(0, 0, 0) and order(0, 0, 0) != order(0, 1, 0) and order(0, 0, 0) != order(7, 0, 0)
    for seed, epoch in ((0, 0), (7, 3)):  # the processes share each epoch's samples between them
        assert sorted(order(seed, epoch, 0) + order(seed, epoch, 1)) == list(range(20))


def test_the_copies_of_repeated_augmentation_are_augmented_apart():
    """Each sample's three copies (two on one process here) have keys of their own and so draw different random
    numbers: they were the same images. A resumed epoch gives the rest of the same keys."""
    from types import SimpleNamespace

    from vil.training.epoch import EpochSampler, SeededSamples

    def keys(rank, skip=0):
        sampler = EpochSampler(range(12), 0, SimpleNamespace(world=2, rank=rank), True, 1)
        sampler.set_epoch(1, skip)
        return list(sampler)

    both = keys(0) + keys(1)
    for index in {key[1] for key in both}:
        copies = [key for key in both if key[1] == index]
        assert sorted(key[2] for key in copies) == [0, 1, 2]
        draws = SeededSamples(RandomDraws(), 0)
        assert len({draws[key] for key in copies}) == 3
    assert keys(1, skip=2) == keys(1)[2:]


def test_the_schedule_counts_the_steps_every_process_samples_in_an_epoch():
    """10 images over 3 processes: torch's DistributedSampler gives each 4 (it repeats 2 to fill the last round),
    so with batches of 1 an epoch is 4 steps, with ACCUM_STEPS 3 one step; EpochSampler gives as many."""
    from types import SimpleNamespace

    from vil.training.epoch import EpochSampler, steps_per_epoch

    for rank in range(3):
        runtime = SimpleNamespace(world=3, rank=rank)
        for accum, steps in ((1, 4), (3, 1)):
            cfg = load_cfg(overrides=["OPTIM.ACCUM_STEPS", str(accum)])
            assert steps_per_epoch(range(10), cfg, runtime, 1) == steps
            assert len(EpochSampler(range(10), 0, runtime, False, accum)) == steps * accum


def test_an_epoch_of_no_optimizer_step_is_refused(tmp_path):
    data = make_folder(tmp_path / "data", per_class=3, corrupt=False)  # 6 images: one batch of 4, no step of 2
    with pytest.raises(ValueError, match=r"6 training images make no optimizer step of OPTIM.ACCUM_STEPS 2 .* of 4"):
        train(tiny_cfg(data, tmp_path / "out", "OPTIM.ACCUM_STEPS", "2"))


def test_training_and_evaluation_data_must_name_the_same_classes(tmp_path):
    data = make_folder(tmp_path / "data", per_class=2, corrupt=False)
    (data / "val" / "dog").rename(data / "val" / "fox")  # label 1 would be dog in training, fox in evaluation
    with pytest.raises(
        ValueError, match=r"only the training data has \['dog'\]; only the evaluation data has \['fox'\]"
    ):
        train(tiny_cfg(data, tmp_path / "out"))


def test_evaluation_data_lacking_a_class_is_scored_as_the_models_classes(tmp_path):
    """In training (the training data's classes) and in evaluating a checkpoint (the classes it records)."""
    data = make_folder(tmp_path / "data", classes=("ant", "bee", "cat"), per_class=2, corrupt=False)
    shutil.rmtree(data / "val" / "bee")
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "DATA.NUM_CLASSES", "3", "OPTIM.EPOCHS", "1"))
    assert "no images of 1 of the 3 classes, ['bee']" in (out / "log.txt").read_text()
    report = evaluate_checkpoint(
        tiny_cfg(
            data, tmp_path / "eval", "DATA.NUM_CLASSES", "3", "MODEL.MODEL_PATH", str(out / "model_best.pth"),
            "OUTPUT_PERCLASS_ACC", "True",
        )
    )  # fmt: skip
    assert report["images"] == 4 and report["per_class"]["bee"] == {"images": 0, "top1": None, "top5": None}
    assert [report["per_class"][name]["images"] for name in ("ant", "cat")] == [2, 2]


def test_processes_added_on_resume_keep_random_states_of_their_own():
    """Resumed at an epoch's end with two processes, from one: process 0 takes the saved state, process 1 keeps its
    own seed (SEED + rank) rather than a copy of process 0's, which would draw the same masks and augmentation."""
    torch.manual_seed(5)
    saved = [get_rng_state()]
    torch.manual_seed(5 + 1)
    own = torch.get_rng_state()
    training_state.restore_rng_state(saved, 1)
    assert torch.equal(torch.get_rng_state(), own)
    training_state.restore_rng_state(saved, 0)
    assert torch.equal(torch.get_rng_state(), saved[0]["torch"])
    # Resumed with the processes that wrote it, each takes its own saved state.
    torch.manual_seed(9)
    saved.append(get_rng_state())
    training_state.restore_rng_state(saved, 1)
    assert torch.equal(torch.get_rng_state(), saved[1]["torch"])


def test_each_process_is_seeded_with_the_seed_plus_its_rank(data, tmp_path, monkeypatch):
    seeds = []
    monkeypatch.setattr(training_setup, "seed_everything", seeds.append)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        run, _ = training_setup.set_up(tiny_cfg(data, tmp_path / "run", "SEED", "7"))
        run.close()
    assert seeds == [7, 8]


def test_bfloat16_amp_on_a_gpu_without_bfloat16_tensor_cores_says_so(monkeypatch, caplog):
    """A V100 or T4 (compute capability 7.x) emulates bfloat16 products: the log says to use float16 there."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    cfg = load_cfg("vil_tiny")  # AMP.ENABLED, bfloat16
    with caplog.at_level(logging.WARNING, logger="vil"):
        training_setup.amp_context(cfg, torch.device("cuda"))
    assert "compute capability below 8.0" in caplog.text and "AMP.DTYPE float16" in caplog.text
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    training_setup.amp_context(cfg, torch.device("cuda"))
    assert "compute capability" not in caplog.text


def test_mixing_an_odd_batch_is_one_sentence_before_training(data, tmp_path):
    """timm's Mixup pairs each sample with another of its batch: an odd batch would stop in its assertion."""
    mixing = ("AUG.MIXUP", "0.8", "AUG.MIXUP_PROB", "1.0")
    for batch in ("3", "1"):
        with pytest.raises(ValueError, match=rf"Mixup/CutMix pairs the samples .*DATALOADER.BSZ.* even, not {batch}\."):
            train(tiny_cfg(data, tmp_path / "run", *mixing, "DATALOADER.BSZ", batch))
    assert not (tmp_path / "run" / "checkpoint_last.pth").exists()


def test_distributed_backend_names_a_torch_distributed_backend(data, tmp_path):
    from vil.runtime import Runtime

    with pytest.raises(ValueError, match=r"DISTRIBUTED_BACKEND 'foo' is not a torch.distributed backend; use one of "):
        train(tiny_cfg(data, tmp_path / "run", "DISTRIBUTED_BACKEND", "foo"))
    for name in ("GLOO", "cpu:gloo,cuda:nccl"):  # torch takes either letter case, and one backend per device
        assert Runtime(name).world == 1


def test_model_best_keeps_the_best_epoch_and_the_random_shift_ends_at_its_epoch(tmp_path, monkeypatch):
    """model_best.pth is replaced by a better top-1 only (scripted 50, 40, 45, 30: it stays epoch 1's); a
    VIL_MODE_SWITCH of exactly one epoch of four ends the random shift as epoch 2 begins."""
    import vil.training.loop as training_loop

    data = make_folder(tmp_path / "data", per_class=2, corrupt=False)
    real, scripted = training_loop.evaluate_epoch, iter([50.0, 40.0, 45.0, 30.0])

    def scripted_epoch(*args):
        real(*args)
        return next(scripted)

    monkeypatch.setattr(training_loop, "evaluate_epoch", scripted_epoch)
    out = tmp_path / "run"
    switch = ("MODEL.VIT.MSVIT.MODE", "1", "MODEL.VIT.MSVIT.VIL_MODE_SWITCH", "0.25")
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "4", *switch))
    best = read_checkpoint(str(out / "model_best.pth"))
    assert (best["epoch"], best["best_acc"]) == (1, 50.0)
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["best_acc"] == 50.0
    text = (out / "log.txt").read_text()
    assert "Best top-1 50.00" in text
    assert re.findall(r"Epoch \d: random-shift training ends", text) == ["Epoch 2: random-shift training ends"]


def test_the_epochs_loss_is_the_mean_over_its_images(tmp_path):
    """Three full batches, each logged as a step of its own: the epoch's loss is their mean."""
    data = make_folder(tmp_path / "data", per_class=6, corrupt=False)
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", "LOG_FREQ", "1"))
    text = (out / "log.txt").read_text()
    steps = [float(x) for x in re.findall(r" step \d+: loss ([-+0-9.e]+),", text)]
    (epoch,) = [float(x) for x in re.findall(r"epoch 1/1: loss ([-+0-9.e]+),", text)]
    assert len(steps) == 3 and epoch == pytest.approx(sum(steps) / 3, rel=2e-3)


def test_the_eta_of_a_resumed_run_counts_its_own_epochs_only():
    """Resumed at epoch 5 of 10, its first epoch taking 100 s: 4 epochs left, 400 s."""
    from types import SimpleNamespace

    from vil.training.evaluation import _run_eta

    run = SimpleNamespace(cfg=load_cfg(overrides=["OPTIM.EPOCHS", "10"]), started=(time.perf_counter() - 100, 5))
    hours, minutes, seconds = map(int, _run_eta(run, 5).split(":"))
    assert 400 <= 3600 * hours + 60 * minutes + seconds <= 402


def test_the_log_calls_top1_ema_what_the_ema_weights_score(tmp_path, monkeypatch):
    """The EMA weights' evaluation is what the epoch's line calls top1_ema (a score given to them alone here)."""
    import vil.training.evaluation as training_evaluation

    real, models = training_evaluation.evaluate, []

    def marked(model, *args, **kwargs):
        models.append(model)
        result = real(model, *args, **kwargs)
        return {**result, "top1": 12.5} if model is not models[0] else result

    monkeypatch.setattr(training_evaluation, "evaluate", marked)
    data = make_folder(tmp_path / "data", per_class=2, corrupt=False)
    train(tiny_cfg(data, tmp_path / "run", "OPTIM.EPOCHS", "1", "MODEL.EMA", "True"))
    assert len(models) == 2 and models[1] is not models[0]
    text = (tmp_path / "run" / "log.txt").read_text()
    assert re.search(r"epoch 1/1: .*, top1 [0-9.]+, .*, top1_ema 12\.5[,;\n]", text)


def test_evaluation_outputs_that_are_not_finite_stop_the_run_at_the_epochs_end(tmp_path, monkeypatch):
    """Outputs that are finite in training but NaN in evaluation: the run stops when it evaluates, naming the
    images (all 8 of the evaluation set), rather than logging a top-1 and going on."""
    real = training_setup.build_model

    def nan_in_evaluation(cfg):
        model = real(cfg)
        model.register_forward_hook(lambda module, inputs, out: out if module.training else out * float("nan"))
        return model

    monkeypatch.setattr(training_setup, "build_model", nan_in_evaluation)
    data = make_folder(tmp_path / "data", per_class=4, corrupt=False)
    with pytest.raises(FloatingPointError, match=r"the outputs of 8 evaluation images were not finite at the end of "):
        train(tiny_cfg(data, tmp_path / "run", "OPTIM.EPOCHS", "1"))


def test_ema_outputs_that_are_not_finite_are_named_and_scored_wrong(tmp_path, monkeypatch):
    """The EMA weights are evaluated, not trained: their NaN outputs get a warning with their count, and top1_ema
    counts those images as wrong (0, not whatever class topk ranks first). A set read whole warns of no lost image."""
    real = training_setup.model_ema

    def nan_ema(model, decay):
        ema = real(model, decay)
        ema.module.register_forward_hook(lambda module, inputs, out: out * float("nan"))
        return ema

    monkeypatch.setattr(training_setup, "model_ema", nan_ema)
    data = make_folder(tmp_path / "data", per_class=4, corrupt=False)
    train(tiny_cfg(data, tmp_path / "run", "OPTIM.EPOCHS", "1", "MODEL.EMA", "True"))
    text = (tmp_path / "run" / "log.txt").read_text()
    assert "The EMA weights' outputs of 8 evaluation images were not finite" in text
    assert re.search(r"epoch 1/1: .*, top1_ema 0[,;\n]", text), text
    assert "never read" not in text


def test_the_epoch_line_gives_the_training_images_per_second_of_its_epoch(tmp_path, monkeypatch):
    """With the loop's clock at 100 s when the run and the epoch start and 104 s when the epoch's training ends,
    the epoch's 8 training images (two batches of 4) went at 2 images per second."""
    from types import SimpleNamespace

    import vil.training.loop as training_loop

    readings = iter([100.0, 100.0, 104.0])
    monkeypatch.setattr(training_loop, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    data = make_folder(tmp_path / "data", per_class=4, corrupt=False)
    train(tiny_cfg(data, tmp_path / "run", "OPTIM.EPOCHS", "1"))
    logged = re.findall(r"epoch 1/1: .*, images_per_s (\S+),", (tmp_path / "run" / "log.txt").read_text())
    assert logged == ["2"], logged


def test_a_checkpoints_report_scores_the_weights_it_names_per_class(tmp_path):
    """The net predicts "cat" whatever the image, its EMA weights "ant": with MODEL.LOAD_EMA the report says EMA
    and scores "ant"'s 4 images of 7 right; top-5 of three classes holds every class."""
    from vil.checkpoint import save_checkpoint
    from vil.model_config import build_model

    data = make_folder(tmp_path / "data", classes=("ant", "bee", "cat"), per_class=4, corrupt=False)
    for name, keep in (("bee", 2), ("cat", 1)):
        for image in sorted((data / "val" / name).iterdir())[keep:]:
            image.unlink()
    cfg = tiny_cfg(data, tmp_path / "eval", "DATA.NUM_CLASSES", "3")
    model = build_model(cfg)
    constant = {"head.weight": torch.zeros_like(model.head.weight)}
    ema = {**model.state_dict(), **constant, "head.bias": torch.tensor([10.0, 0.0, 0.0])}
    entries = {**constant, "head.bias": torch.tensor([0.0, 0.0, 10.0])}
    save_checkpoint(str(tmp_path / "w.pth"), model, entries, ema=ema)
    keys = ("MODEL.MODEL_PATH", str(tmp_path / "w.pth"), "OUTPUT_PERCLASS_ACC", "True", "DATA.NUM_CLASSES", "3")
    report = evaluate_checkpoint(tiny_cfg(data, tmp_path / "eval", *keys, "MODEL.LOAD_EMA", "True"))
    assert report["weights"] == "EMA" and report["top1"] == pytest.approx(400 / 7) and report["top5"] == 100
    per_class = {name: (c["images"], c["top1"], c["top5"]) for name, c in report["per_class"].items()}
    assert per_class == {"ant": (4, 100, 100), "bee": (2, 0, 100), "cat": (1, 0, 100)}
    report = evaluate_checkpoint(tiny_cfg(data, tmp_path / "eval", *keys))
    assert report["weights"] == "model" and report["top1"] == pytest.approx(100 / 7)
