"""What users and machines do to a run: diverging losses, bad images, unwritable or full outputs, empty,
corrupt or foreign checkpoints, two runs on one folder, crafted checkpoint metadata. Each ends in one sentence
with nothing lost."""

import errno
import os
import re
import runpy
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_data import make_folder
from test_train import TINY_ARCH, assert_same_weights, break_loss, final_weights, tiny_cfg, tiny_overrides

import vil.files as files
import vil.training.evaluation as evaluation
import vil.training.setup as training_setup
from vil.checkpoint import read_checkpoint
from vil.config import load_cfg
from vil.files import FolderLock, OutputError, atomic_write
from vil.loss import build_loss
from vil.models import MsViT
from vil.optim import build_optimizer, build_scheduler
from vil.training.loop import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def data(tmp_path):
    return make_folder(tmp_path / "data", per_class=6)


def tool_error(monkeypatch, tool, *args):
    """Run ``tools/<tool>`` in this process (as its command line would); returns the one sentence it exits with."""
    monkeypatch.setattr(sys, "argv", [tool, *map(str, args)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "tools" / tool), run_name="__main__")
    message = exited.value.code
    assert (
        isinstance(message, str) and message.startswith("error: ") and message.endswith(".") and "\n" not in message
    ), message
    return message


# 1. Not finite.


def test_exploding_learning_rate_leaves_a_true_message_and_a_run_that_recovers(data, tmp_path):
    out = tmp_path / "explode"
    with pytest.raises(FloatingPointError) as caught:
        train(tiny_cfg(data, out, "CHECKPOINT.EVERY_STEPS", "1", "OPTIM.LR", "1e10", "SOLVER.WARMUP_EPOCHS", "0.0"))
    message = str(caught.value)
    assert message in (out / "log.txt").read_text()  # the log says it too
    last = out / "checkpoint_last.pth"
    if "no checkpoint was written yet" in message:
        assert not last.exists()
    else:  # it names the state it kept, and that state is finite
        step = int(re.search(r"keeps optimizer step (\d+)", message).group(1))
        state = read_checkpoint(str(last))
        assert state["step"] == step and all(
            torch.isfinite(v).all() for v in state["net"].values() if v.is_floating_point()
        )
    # Following the message: the same command with a sane learning rate trains to the end.
    train(tiny_cfg(data, out, "CHECKPOINT.EVERY_STEPS", "1", "OPTIM.LR", "1e-3", "SOLVER.WARMUP_EPOCHS", "0.0"))
    assert read_checkpoint(str(last))["epoch"] == 2


class InfiniteGradient(torch.autograd.Function):
    """Identity forward; a backward that is not finite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def test_non_finite_gradients_stop_before_the_step_and_before_a_checkpoint_of_that_state(data, tmp_path, monkeypatch):
    break_loss(monkeypatch, 3, lambda criterion, logits, targets: criterion(InfiniteGradient.apply(logits), targets))
    out = tmp_path / "grad"
    # Steps 1 and 2 checkpointed (step 2's waits for step 3's gradients, which are not finite).
    with pytest.raises(
        FloatingPointError,
        match=r"optimizer step 3\b.*\b(inf|nan) at epoch 1, batch 3\b.*checkpoint_last.pth.*optimizer step 1 "
        r"\(epoch 1, batch 1\)",
    ):
        train(tiny_cfg(data, out, "CHECKPOINT.EVERY_STEPS", "1"))
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["step"] == 1


FLOAT16 = ("AMP.ENABLED", "True", "AMP.ON_CPU", "True", "AMP.DTYPE", "float16")


def test_float16_steps_the_scaler_skips_are_counted_and_a_scale_below_one_stops_the_run(data, tmp_path, monkeypatch):
    """fp16's gradient scaler skips a step whose gradients overflow and halves its scale: one such step is counted in
    the epoch's line; gradients that stay not finite while the scale falls below 1 are no overflow, and stop."""

    def skipped(out):
        found = re.search(r"the float16 gradient scaler skipped (\d+) optimizer steps \(gradients not finite\)", out)
        return int(found.group(1)) if found else 0

    infinite = lambda criterion, logits, targets: criterion(InfiniteGradient.apply(logits), targets)  # noqa: E731
    train(tiny_cfg(data, tmp_path / "plain", "OPTIM.EPOCHS", "1", *FLOAT16))  # its first scale may overflow too
    break_loss(monkeypatch, 3, infinite)
    train(tiny_cfg(data, tmp_path / "once", "OPTIM.EPOCHS", "1", *FLOAT16))
    plain, once = ((tmp_path / name / "log.txt").read_text() for name in ("plain", "once"))
    assert skipped(once) == skipped(plain) + 1
    real_scaler = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *args, **kwargs: real_scaler(*args, init_scale=2.0, **kwargs))
    monkeypatch.setattr(training_setup, "build_loss", lambda cfg, mixup: partial(infinite, build_loss(cfg, mixup)))
    with pytest.raises(FloatingPointError, match=r"optimizer step 2: the float16 gradients stayed not finite while "):
        train(tiny_cfg(data, tmp_path / "always", *FLOAT16))  # scale 2, then 1, then 0.5


def test_a_resumed_run_follows_a_changed_learning_rate_and_schedule(data, tmp_path):
    out = tmp_path / "lr"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    changed = tiny_cfg(data, out, "OPTIM.EPOCHS", "2", "OPTIM.LR", "5e-4", "SOLVER.MIN_LR", "1e-5")
    train(changed)
    assert (
        "Resuming with new values, which the run follows from here: "
        "OPTIM.EPOCHS 1 -> 2, OPTIM.LR 0.001 -> 0.0005, SOLVER.MIN_LR 0.0 -> 1e-05." in (out / "log.txt").read_text()
    )
    state = read_checkpoint(str(out / "checkpoint_last.pth"))
    optimizer = build_optimizer(changed, MsViT(TINY_ARCH, img_size=32, num_classes=2))
    build_scheduler(changed, optimizer, steps_per_epoch=3).step_update(state["step"])
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [g["lr"] for g in optimizer.param_groups]


# 2. Bad images.


def test_one_bad_image_is_a_named_skip_in_training_and_evaluation_with_workers(tmp_path):
    data = make_folder(tmp_path / "data", per_class=6)
    for split in ("train", "val"):
        Image.new("1", (15000, 15000)).save(data / split / "dog" / "bomb.png")  # a decompression bomb, 28 KB
        good = (data / split / "dog" / "0.JPEG").read_bytes()
        (data / split / "dog" / "cut.JPEG").write_bytes(good[:200])
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", "DATALOADER.WORKERS", "2"))
    text = (out / "log.txt").read_text()
    assert re.search(
        r"Skipped unreadable image \S+train/dog/bomb\.png \(Image size \(225000000 pixels\) exceeds limit", text
    )
    assert re.search(r"Skipped unreadable image \S+val/dog/cut\.JPEG \(", text)
    assert "Evaluation skipped 2 unreadable images." in text and "Traceback" not in text


# 3. Unwritable or full output.

UNWRITABLE = "/proc/vil-output"  # not even root can create a folder there


@pytest.mark.parametrize("kind", ["unwritable", "a file"])
def test_an_output_dir_that_cannot_be_written_is_refused_before_any_work(data, tmp_path, kind, monkeypatch):
    out = UNWRITABLE if kind == "unwritable" else tmp_path / "file"
    if kind == "a file":
        out.write_text("notes")
    message = tool_error(
        monkeypatch,
        "train.py",
        "--config-file",
        ROOT / "configs" / "vil_tiny.yaml",
        "DATA.PATH",
        data,
        "DATA.NUM_CLASSES",
        "2",
        "OUTPUT_DIR",
        out,
    )
    why = "it is a file, not a folder" if kind == "a file" else "No such file or directory"
    assert message.startswith("error: OUTPUT_DIR") and message.count("\n") == 0
    assert str(out) in message and why in message


class DiskFullAfter:
    """A binary file that a full disk stops after ``room`` bytes, as the system stops it: write raises ENOSPC."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def flush(self):
        self.file.flush()


def test_a_failed_write_says_whether_a_previous_file_is_left_and_what_to_do(tmp_path):
    def write(code):
        def fail(f):
            raise OSError(code, os.strerror(code))

        return fail

    (tmp_path / "old.pth").write_bytes(b"kept")
    for name, code, facts in (
        ("old.pth", errno.ENOSPC, ("No space left on device", "the previous file is intact", "free some space")),
        ("new.pth", errno.ENOSPC, ("No space left on device", "nothing was written", "free some space")),
        ("new.pth", errno.EIO, ("Input/output error", "nothing was written", "check the folder")),
    ):
        with pytest.raises(OutputError) as raised:
            files.atomic_write(tmp_path / name, write(code))
        message = str(raised.value)
        assert str(tmp_path / name) in message and all(fact in message for fact in facts), message
    assert sorted(os.listdir(tmp_path)) == ["old.pth"] and (tmp_path / "old.pth").read_bytes() == b"kept"


def test_a_full_disk_is_one_sentence_and_keeps_the_previous_checkpoint(data, tmp_path, monkeypatch):
    out = tmp_path / "full"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    before = (out / "checkpoint_last.pth").read_bytes()
    real_save = torch.save

    def save_until_the_disk_is_full(obj, f, *args, **kwargs):
        real_save(obj, DiskFullAfter(f, 1000), *args, **kwargs)  # torch's writer fails on the file's OSError

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    with pytest.raises(
        OutputError,
        match=r"checkpoint_last.pth failed \(No space left.*intact",
    ):
        train(tiny_cfg(data, out, "OPTIM.EPOCHS", "2"))
    monkeypatch.setattr(torch, "save", real_save)
    assert (out / "checkpoint_last.pth").read_bytes() == before
    assert not [n for n in os.listdir(out) if n.startswith(files.TEMPORARY_PREFIX)]


def test_eval_checks_its_report_path_first_and_prints_before_writing(data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    common = [
        "--config-file",
        ROOT / "configs" / "vil_tiny.yaml",
        "MODEL.VIT.MSVIT.ARCH",
        TINY_ARCH,
        "INPUT.IMAGE_SIZE",
        "32",
        "DATA.PATH",
        data,
        "DATA.NUM_CLASSES",
        "2",
        "MODEL.MODEL_PATH",
        out / "model_best.pth",
    ]
    message = tool_error(monkeypatch, "eval.py", *common, "OUTPUT_DIR", UNWRITABLE)
    assert message.startswith(f"error: The evaluation report {UNWRITABLE}/eval.json cannot be written (")
    assert "top-1" not in capsys.readouterr().out  # refused before evaluating

    def full(path, write):
        raise OutputError(
            f"Writing {path} failed (No space left on device); nothing was written: free some space and run again."
        )

    monkeypatch.setattr(evaluation, "atomic_write", full)
    monkeypatch.setattr(sys, "argv", ["eval.py", *map(str, common), "OUTPUT_DIR", str(tmp_path / "report")])
    with pytest.raises(SystemExit, match=r"eval.json failed \(No space left on device\)"):
        runpy.run_path(str(ROOT / "tools" / "eval.py"), run_name="__main__")
    assert re.fullmatch(r"top-1 \d+\.\d\d top-5 \d+\.\d\d", capsys.readouterr().out.strip())


def test_export_to_an_unwritable_path_is_one_sentence(tmp_path, monkeypatch):
    path = tmp_path / "model.pth"
    torch.save({"net": MsViT(TINY_ARCH, img_size=32, num_classes=2).state_dict()}, path)
    message = tool_error(
        monkeypatch,
        "export_backbone.py",
        path,
        f"{UNWRITABLE}/backbone.pth",
        "--format",
        "torchvision",
        "--arch",
        TINY_ARCH,
    )
    assert message.startswith(f"error: The output {UNWRITABLE}/backbone.pth cannot be written (")


# 4. and 7. Empty and corrupt checkpoints.


def test_an_empty_checkpoint_is_one_sentence_everywhere(data, tmp_path, monkeypatch):
    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    expected = f"{empty} is empty (0 bytes), not a checkpoint; its write was interrupted, or it is the wrong file."
    with pytest.raises(ValueError, match=re.escape(expected)):
        read_checkpoint(str(empty))
    common = [
        "--config-file",
        ROOT / "configs" / "vil_tiny.yaml",
        "DATA.PATH",
        data,
        "DATA.NUM_CLASSES",
        "2",
        "MODEL.MODEL_PATH",
        empty,
        "OUTPUT_DIR",
        tmp_path / "out",
    ]
    for tool, args in (
        ("train.py", common),
        ("eval.py", common),
        ("export_backbone.py", [empty, tmp_path / "b.pth", "--format", "mmdet"]),
    ):
        assert tool_error(monkeypatch, tool, *args) == f"error: {expected}", tool


def test_a_corrupt_last_checkpoint_falls_back_to_the_newest_readable_epoch_checkpoint(data, tmp_path):
    straight = tmp_path / "straight"
    train(tiny_cfg(data, straight, "OPTIM.EPOCHS", "3"))
    out = tmp_path / "corrupt"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "3"))
    (out / "checkpoint_epoch3.pth").unlink()  # as if the run had stopped after epoch 2
    (out / "checkpoint_last.pth").write_bytes((out / "checkpoint_last.pth").read_bytes()[:1000])  # torn
    (out / ".tmp-abc12345.partial").write_bytes(b"half a checkpoint")  # left by an interrupted write
    kept = {name: (out / name).read_bytes() for name in ("checkpoint_epoch2.pth", "model_best.pth")}
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "3"))
    text = (out / "log.txt").read_text()
    assert re.search(
        r"Resuming from \S+checkpoint_epoch2\.pth, the newest readable checkpoint, "
        r"because \S+checkpoint_last\.pth is not a readable",
        text,
    )
    assert "Removed 1 temporary files that interrupted writes left in" in text
    assert not (out / ".tmp-abc12345.partial").exists()
    assert_same_weights(final_weights(straight), final_weights(out))
    # The checkpoint resumed from is not replaced by copies of the torn one (model_best.pth: where epoch 3 did not
    # improve on it).
    assert (out / "checkpoint_epoch2.pth").read_bytes() == kept["checkpoint_epoch2.pth"]
    best = torch.load(out / "model_best.pth", weights_only=True)
    assert best["epoch"] == 3 or (out / "model_best.pth").read_bytes() == kept["model_best.pth"]


# 5. Changed config, foreign checkpoints.


def test_a_resumed_run_may_compute_its_attention_with_another_backend(data, tmp_path):
    """Backends (and their other names) compute the same model: a run goes on with another, saying so."""
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", "MODEL.VIT.MSVIT.ATTN_TYPE", "sliding_chunk"))
    for epochs, attn_type in (("2", "longformerhand"), ("3", "unfold")):
        train(tiny_cfg(data, out, "OPTIM.EPOCHS", epochs, "MODEL.VIT.MSVIT.ATTN_TYPE", attn_type))
    text = (out / "log.txt").read_text()
    assert "ATTN_TYPE 'sliding_chunk' -> 'longformerhand'" in text and "ATTN_TYPE 'longformerhand' -> 'unfold'" in text
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["epoch"] == 3


def test_a_refusal_at_start_up_is_in_the_log_too(data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError) as caught:
        train(tiny_cfg(tmp_path / "no_data", out))
    assert f"{tmp_path / 'no_data'} does not exist" in str(caught.value)
    assert f"error: {caught.value}" in (out / "log.txt").read_text()


@pytest.mark.parametrize(
    "change, named",
    [
        (("MODEL.VIT.MSVIT.ARCH", TINY_ARCH.replace("d32", "d48")), "MODEL.VIT.MSVIT.ARCH"),
        (("OPTIM.OPT", "sgd"), "OPTIM.OPT 'adamw' (now 'sgd')"),
        (("MODEL.VIT.MSVIT.ATTN_TYPE", "performer"), "MODEL.VIT.MSVIT.ATTN_TYPE"),  # another attention
    ],
)
def test_resuming_with_a_changed_config_names_the_keys_and_overwrites_nothing(data, tmp_path, change, named):
    out = tmp_path / "run"
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    files_before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "log.txt"}
    with pytest.raises(
        ValueError,
        match=rf"checkpoint_last.pth was trained with {re.escape(named)}",
    ):
        train(tiny_cfg(data, out, "OPTIM.EPOCHS", "2", *change))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "log.txt"} == files_before


def test_a_foreign_last_checkpoint_is_refused(data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    torch.save(MsViT(TINY_ARCH, img_size=32, num_classes=2).state_dict(), out / "checkpoint_last.pth")  # weights only
    with pytest.raises(
        ValueError,
        match=r"checkpoint_last.pth is not a training checkpoint.*net, optimizer, epoch",
    ):
        train(tiny_cfg(data, out))
    assert not (out / "config.yaml").exists()


def test_a_config_file_in_the_output_dir_is_not_replaced(data, tmp_path):
    """OUTPUT_DIR/config.yaml that no run wrote (here the very file the run reads) is refused, not overwritten with
    the resolved config, by a fresh run and by a resumed one; a run's own is replaced by the next run's."""
    from vil.config import load_cfg

    out = tmp_path / "myexp"
    out.mkdir()
    mine = "# my experiment\nOPTIM:\n  EPOCHS: 1\n"
    (out / "config.yaml").write_text(mine)
    with pytest.raises(ValueError, match=r"config.yaml is not a config this project's training wrote"):
        train(tiny_cfg(data, out))
    assert (out / "config.yaml").read_text() == mine
    (out / "config.yaml").unlink()
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    assert load_cfg(out / "config.yaml").OPTIM.EPOCHS == 1
    (out / "config.yaml").write_text(mine)  # put there after the run started: its resume refuses it too
    with pytest.raises(ValueError, match=r"config.yaml is not a config this project's training wrote"):
        train(tiny_cfg(data, out, "OPTIM.EPOCHS", "2"))
    assert (out / "config.yaml").read_text() == mine


# 6. Two runs, one folder.


def test_a_second_run_on_the_same_output_dir_is_refused_naming_the_first(data, tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from vil.files import FolderLock; "
            f"FolderLock({str(out)!r}); print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputError, match=rf"{re.escape(str(out))} is in use.*process {holder.pid}"):
            train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))
    finally:
        holder.kill()
        holder.wait()
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1"))  # a killed holder left no lock behind
    lock = FolderLock(str(out))  # and a finished run released its own
    lock.release()


# 10. Crafted metadata.


@pytest.mark.parametrize(
    "config, message",
    [
        ("MODEL: [", "Not valid YAML in the config stored in"),
        ("- a list", "Expected a mapping of config keys (like 'MODEL: ...') in the config stored in"),
        ("INPUT:\n  IMAGE_SIZE: abc\n", "INPUT.IMAGE_SIZE is 'abc', but it must be an integer"),
        ("INPUT:\n  IMAGE_SIZE: -3\n", "INPUT.IMAGE_SIZE is -3, but it must be a positive number of pixels"),
    ],
)
def test_crafted_config_in_a_checkpoint_is_refused_by_export(tmp_path, config, message, monkeypatch):
    path = tmp_path / "crafted.pth"
    torch.save({"net": MsViT(TINY_ARCH, img_size=32, num_classes=2).state_dict(), "config": config}, path)
    line = tool_error(monkeypatch, "export_backbone.py", path, tmp_path / "b.pth", "--format", "torchvision")
    assert message in line and f"the config stored in {path}" in line
    assert not (tmp_path / "b.pth").exists()


# 11. File modes.


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_written_atomically_get_the_mode_a_plain_write_gives(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write(str(tmp_path / "f"), lambda f: f.write(b"x"))
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == mode


def test_a_file_is_on_the_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    """The new file's bytes are flushed to the disk before it replaces the old one: after a power cut the name holds
    one whole file or the other, never a renamed empty one."""
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_size)), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", dst)), real_replace(src, dst))[1])
    atomic_write(str(tmp_path / "f"), lambda f: f.write(b"xyz"))
    assert events[:2] == [("fsync", 3), ("replace", str(tmp_path / "f"))] and (tmp_path / "f").read_bytes() == b"xyz"


def test_the_gradient_scalers_state_is_restored_on_resume():
    """A float16 run's loss scale (here lowered to 128 by overflows) goes on from where it was."""
    from vil.runtime import get_rng_state
    from vil.training_state import restore

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = torch.amp.GradScaler("cpu", init_scale=128.0).state_dict()
    checkpoint = dict(net=model.state_dict(), optimizer=optimizer.state_dict(), scaler=saved, epoch=1)
    checkpoint.update(batch_in_epoch=0, step=10, best_acc=1.0, rng=[get_rng_state()])
    scaler = torch.amp.GradScaler("cpu")
    restore(checkpoint, "checkpoint_last.pth", model, optimizer, scaler, None, 0)
    assert scaler.get_scale() == 128.0


def test_a_file_written_again_keeps_its_mode_and_a_link_keeps_pointing_at_it(tmp_path):
    private = tmp_path / "private.pth"
    private.write_bytes(b"old")
    private.chmod(0o600)
    (tmp_path / "link.pth").symlink_to(private)
    atomic_write(str(tmp_path / "link.pth"), lambda f: f.write(b"new"))
    assert (tmp_path / "link.pth").is_symlink() and private.read_bytes() == b"new"
    assert private.stat().st_mode & 0o777 == 0o600


def test_a_lock_refuses_a_second_holder_in_the_same_process_until_released(tmp_path):
    first = FolderLock(str(tmp_path))
    with pytest.raises(OutputError, match=rf"in use by another run \(process {os.getpid()} on "):
        FolderLock(str(tmp_path))
    first.release()
    FolderLock(str(tmp_path)).release()
    assert os.listdir(tmp_path) == [files.LOCK_NAME]


# Fault injection: kill -9 in the middle of a checkpoint write, then a full disk, then resume.

KILLED_DURING_WRITE = """
import os, signal, sys
import torch
from vil.config import load_cfg
from vil.training.loop import train

real_save, writes = torch.save, []

def save_then_die(obj, f, *args, **kwargs):
    writes.append(f)
    if len(writes) == int(sys.argv[1]):
        f.write(b"the first bytes of a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, f, *args, **kwargs)

torch.save = save_then_die
train(load_cfg(overrides=sys.argv[2:]))
"""


def test_kill_during_a_write_then_a_full_disk_then_resume_gives_the_uninterrupted_weights(data, tmp_path, monkeypatch):
    every_step = ("CHECKPOINT.EVERY_STEPS", "1")
    straight = tmp_path / "straight"
    train(tiny_cfg(data, straight, *every_step))
    out = tmp_path / "faults"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_WRITE, "4", *tiny_overrides(data, out, *every_step)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL
    assert [n for n in os.listdir(out) if n.startswith(files.TEMPORARY_PREFIX)]  # the torn write's temporary file
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["step"] == 3  # the newest complete one: epoch 1's end

    real_save, writes = torch.save, []

    def disk_full_on_the_second_write(obj, f, *args, **kwargs):
        writes.append(f)
        real_save(obj, DiskFullAfter(f, 1000) if len(writes) == 2 else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_on_the_second_write)
    with pytest.raises(OutputError, match="No space left on device"):
        train(tiny_cfg(data, out, *every_step))
    monkeypatch.setattr(torch, "save", real_save)
    assert not [n for n in os.listdir(out) if n.startswith(files.TEMPORARY_PREFIX)]
    train(tiny_cfg(data, out, *every_step))
    assert_same_weights(final_weights(straight), final_weights(out))


def test_only_the_temporary_files_of_interrupted_writes_are_removed(tmp_path):
    import tempfile

    names = ("pretrained.pth", "snapshot", "abcdefgh", "weights_2024.partial", "abc.partial")
    users = [f"{files.TEMPORARY_PREFIX}{name}" for name in names]
    for name in users:  # a user's files of names alike: never theirs
        (tmp_path / name).write_bytes(b"weights")
    # As atomic_write makes them (a write killed before its rename leaves one).
    _, torn = tempfile.mkstemp(dir=tmp_path, prefix=files.TEMPORARY_PREFIX, suffix=files.TEMPORARY_SUFFIX)
    assert files.remove_temporaries(tmp_path) == [os.path.basename(torn)]
    assert sorted(os.listdir(tmp_path)) == sorted(users)


# The parts of the loop on their own.


def test_epoch_checkpoints_are_rotated_by_number_and_the_best_is_copied(tmp_path):
    from vil.training_state import LAST, copy_epoch_checkpoints, epoch_checkpoints

    cfg = load_cfg(overrides=["OUTPUT_DIR", str(tmp_path), "CHECKPOINT.KEEP", "2"])
    for epoch in (8, 9, 10, 11):
        (tmp_path / LAST).write_bytes(f"epoch {epoch}".encode())
        copy_epoch_checkpoints(cfg, epoch, improved=epoch == 9)
    assert [os.path.basename(p) for p in epoch_checkpoints(str(tmp_path))] == [
        "checkpoint_epoch11.pth",
        "checkpoint_epoch10.pth",
    ]
    assert (tmp_path / "model_best.pth").read_bytes() == b"epoch 9"
    only_last = load_cfg(overrides=["OUTPUT_DIR", str(tmp_path), "ONLY_SAVE_LAST", "1"])
    copy_epoch_checkpoints(only_last, 12, improved=False)
    assert not (tmp_path / "checkpoint_epoch12.pth").exists()


def test_a_run_stopped_before_an_epochs_copies_writes_them_when_resumed(data, tmp_path, monkeypatch):
    """Stopped (a kill) between writing epoch 1's checkpoint_last.pth and copying it to model_best.pth and
    checkpoint_epoch1.pth, the resumed run makes the copies. (It held the raised best top-1 and never made them:
    epoch 1's best model was lost.)"""
    from vil.training import loop

    straight, out = tmp_path / "straight", tmp_path / "stopped"
    train(tiny_cfg(data, straight))

    def stop(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(loop, "copy_epoch_checkpoints", stop)
        train(tiny_cfg(data, out))
    assert (out / "checkpoint_last.pth").exists() and not (out / "model_best.pth").exists()
    train(tiny_cfg(data, out))
    names = sorted(n for n in os.listdir(out) if n.endswith(".pth"))
    assert names == sorted(n for n in os.listdir(straight) if n.endswith(".pth"))
    for name in names:
        want, got = (read_checkpoint(str(folder / name)) for folder in (straight, out))
        assert want["epoch"] == got["epoch"], name
        assert_same_weights(want["net"], got["net"])


def test_a_first_epoch_of_top1_zero_is_the_best_so_far(data, tmp_path, monkeypatch):
    """As timm's checkpoint saver counts it: model_best.pth is written and OPTIM.VAL lowers no learning rate."""
    from vil.training import loop

    out = tmp_path / "run"
    monkeypatch.setattr(loop, "evaluate_epoch", lambda *args: 0.0)
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", "OPTIM.OPT", "sgd", "OPTIM.VAL", "1"))
    assert read_checkpoint(str(out / "model_best.pth"))["epoch"] == 1
    assert "did not improve" not in (out / "log.txt").read_text()


def test_resume_check_follows_schedule_changes_and_names_other_changes(caplog):
    from vil.training_state import check_resumable

    saved = load_cfg(overrides=["OPTIM.LR", "0.1", "SEED", "3"])
    checkpoint = {key: 0 for key in ("net", "optimizer", "epoch", "batch_in_epoch", "step", "best_acc", "rng")}
    checkpoint["config"] = saved.dump()
    with caplog.at_level("INFO", logger="vil"):
        check_resumable(
            checkpoint, "last.pth", load_cfg(overrides=["OPTIM.LR", "0.01", "SEED", "3", "SOLVER.MIN_LR", "1e-6"])
        )
    assert "OPTIM.LR 0.1 -> 0.01, SOLVER.MIN_LR 0.0 -> 1e-06." in caplog.text
    # How the model is computed (compiled, recomputed in backward) may change: the same model goes on.
    with caplog.at_level("INFO", logger="vil"):
        computed_otherwise = ["OPTIM.LR", "0.1", "SEED", "3", "MODEL.COMPILE", "True", "MODEL.GRAD_CHECKPOINT", "True"]
        check_resumable(checkpoint, "last.pth", load_cfg(overrides=computed_otherwise))
    assert "MODEL.COMPILE False -> True, MODEL.GRAD_CHECKPOINT False -> True." in caplog.text
    with pytest.raises(
        ValueError,
        match=r"DATALOADER.BSZ 128 \(now 64\), SEED 3 \(now 4\)",
    ):
        check_resumable(checkpoint, "last.pth", load_cfg(overrides=["SEED", "4", "DATALOADER.BSZ", "64"]))
    # The loading workers: followed with image folders; with shards they decide an epoch's batches.
    check_resumable(
        checkpoint, "last.pth", load_cfg(overrides=["OPTIM.LR", "0.1", "SEED", "3", "DATALOADER.WORKERS", "2"])
    )
    checkpoint["config"] = load_cfg(overrides=["SEED", "3", "DATA.FORMAT", "shards"]).dump()
    shards_with_2_workers = load_cfg(overrides=["SEED", "3", "DATA.FORMAT", "shards", "DATALOADER.WORKERS", "2"])
    with pytest.raises(ValueError, match=r"DATALOADER.WORKERS 0 \(now 2\) \(with DATA.FORMAT shards.*workers"):
        check_resumable(checkpoint, "last.pth", shards_with_2_workers)
    # Mid-epoch, each process goes on with its share of the epoch's samples: their number cannot change.
    checkpoint.update(config=saved.dump(), rng=[0, 0], epoch=4, batch_in_epoch=3)
    with pytest.raises(ValueError, match=r"middle of epoch 5 by 2 process\(es\).* 1 process\(es\).*with 2"):
        check_resumable(checkpoint, "last.pth", saved, world=1)
    check_resumable(checkpoint, "last.pth", saved, world=2)
    checkpoint["batch_in_epoch"] = 0
    check_resumable(checkpoint, "last.pth", saved, world=1)
    # Epoch 5 begun: OPTIM.EPOCHS 4 would end the run with the part of epoch 5 silently kept.
    checkpoint["batch_in_epoch"] = 3
    with pytest.raises(ValueError, match=r"trained 4 epochs and part of the next, more than OPTIM.EPOCHS 4; .* 5 "):
        check_resumable(checkpoint, "last.pth", load_cfg(overrides=["SEED", "3", "OPTIM.EPOCHS", "4"]), world=2)
    checkpoint["batch_in_epoch"] = 0
    checkpoint["config"] = "OPTIM: [1, 2]"
    with pytest.raises(ValueError, match=r"last.pth.*OPTIM is \[1, 2\].*section"):
        check_resumable(checkpoint, "last.pth", saved)


def test_an_arch_string_with_fields_left_out_is_logged_as_resolved(caplog):
    from vil.training.setup import _log_resolved_arch

    cfg = load_cfg(overrides=["MODEL.VIT.MSVIT.ARCH", "l1,h1,d16,n1_l2,h2,d32,n1_l3,h2,d32,n1"])
    with caplog.at_level("INFO", logger="vil"):
        _log_resolved_arch(cfg)
    assert (
        "MODEL.VIT.MSVIT.ARCH resolves to "
        "l1,h1,d16,n1,s1,g1,p2,f7,a1_l2,h2,d32,n1,s1,g1,p2,f7,a1_l3,h2,d32,n1,s1,g1,p2,f7,a1 "
        "(the fields it leaves out take the original release's defaults)."
    ) in caplog.text


def test_a_checkpoint_written_without_fused_optimizer_kernels_resumes_to_the_uninterrupted_weights(data, tmp_path):
    """Checkpoints written before the optimizer ran torch's fused kernels say ``fused: None`` in their groups and
    keep their step counts as the default implementation does; a resume runs the fused kernels all the same."""
    straight = tmp_path / "straight"
    train(tiny_cfg(data, straight))
    checkpoint = read_checkpoint(str(straight / "checkpoint_epoch1.pth"))
    for group in checkpoint["optimizer"]["param_groups"]:
        assert group["fused"] is True
        group["fused"] = None
    out = tmp_path / "old"
    out.mkdir()
    torch.save(checkpoint, out / "checkpoint_last.pth")
    train(tiny_cfg(data, out))
    resumed = read_checkpoint(str(out / "checkpoint_last.pth"))
    assert all(group["fused"] is True for group in resumed["optimizer"]["param_groups"])
    assert_same_weights(final_weights(straight), final_weights(out))
