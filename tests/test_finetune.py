"""Fine-tuning: starting from the weights of MODEL.MODEL_PATH, the original release's two recipes, EVALUATE."""

import json
import re
import subprocess
import sys

import pytest
import torch
from test_data import make_folder
from test_train import ROOT, TINY_ARCH, tiny_cfg

from vil.checkpoint import read_checkpoint
from vil.config import load_cfg
from vil.models import MsViT
from vil.models.convert import resize_tables
from vil.training.evaluation import evaluate_checkpoint
from vil.training.loop import train
from vil.weights import load_weights

# The original release's recipes (../shared/reference/original-recipes.md), as its YAML files wrote them.
IMAGENET_RECIPE = """
AMP: {ENABLED: True}
AUG:
  MIXCUT: 1.0
  MIXUP: 0.8
  MIXUP_PROB: 1.0
  TIMM_AUG: {AUTO_AUGMENT: 'rand-m9-mstd0.5-inc1', COLOR_JITTER: 0.4, HFLIP: 0.5, RE_COUNT: 1, RE_MODE: 'pixel',
             RE_PROB: 0.25, RE_SPLIT: False, USE_TRANSFORM: True, VFLIP: 0.0}
BACKUP_LOG_DIR: ''
DATA:
  DATA_DIR: './data'
  NUM_CLASSES: 1000
  PATH: './datasets'
  TEST: ('imagenet',)
  TRAIN: ('imagenet',)
DATALOADER: {BSZ: 256, RE: 'no', WORKERS: 6}
EVALUATE: False
INPUT: {INTERPOLATION: 3}
LOG_FREQ: 100
LOSS: {LABEL_SMOOTHING: 0.1, LOSS: 'xentropy'}
MODEL:
  ARCH: 'msvit'
  MODEL_PATH: ''
  PRETRAINED: False
  VIT: {DROP: 0.0, DROP_PATH: 0.1, NORM_EMBED: True,
        MSVIT: {MODE: 0, SHARE_KV: True, SHARE_W: True, SW_EXACT: 0, VIL_MODE_SWITCH: 0.75}}
ONLY_SAVE_LAST: 0
OPTIM: {ADAM: {BETA1: 0.9, BETA2: 0.999}, DROP_FACTOR: 10.0, DROP_FREQ: 30, EPOCHS: 300, LR: 5e-4, MOM: 0.9, NU: 1.0,
        OPT: 'adamw', TEST_FREQ: 1000, VAL: 0, WARMUP: 0, WD: 0.05, WD0: 0.0}
OUTPUT_DIR: '/tmp'
SOLVER: {LR_POLICY: 'cosine', MIN_LR: 1e-6, WARMUP_EPOCHS: 5.0, WARMUP_FACTOR: 0.002}
"""
FINETUNE_RECIPE = """
AMP: {ENABLED: True}
AUG: {MIXCUT: 0.0, MIXUP: 0.1, MIXUP_PROB: 0.0, TIMM_AUG: {USE_TRANSFORM: False}}
DATA:
  DATA_DIR: './data'
  NUM_CLASSES: 1000
  PATH: './datasets'
  TEST: ('imagenet',)
  TRAIN: ('imagenet',)
DATALOADER: {BSZ: 256, RE: 'no', WORKERS: 6}
EVALUATE: False
FINETUNE: {FINETUNE: True, USE_TRAIN_AUG: False}
INPUT: {CROP_PCT: 0.922, IMAGE_SIZE: 384, INTERPOLATION: 3, MEAN: [0.485, 0.456, 0.406], STD: [0.229, 0.224, 0.225]}
LOG_FREQ: 100
LOSS: {LABEL_SMOOTHING: 0.1, LOSS: 'xentropy'}
MODEL:
  ARCH: 'msvit'
  MODEL_PATH: ''
  PRETRAINED: False
  VIT: {DROP: 0.0, DROP_PATH: 0.1, NORM_EMBED: True, MSVIT: {SHARE_KV: True, SHARE_W: True, SW_EXACT: 0}}
ONLY_SAVE_LAST: 0
OPTIM: {EPOCHS: 10, LR: 0.01, MOM: 0.9, NU: 1.0, OPT: 'qhm', WD: 0.0, WD0: 0.0}
OUTPUT_DIR: '/tmp'
SOLVER: {EPOCH_BASED_SCHEDULE: False, LR_POLICY: 'cosine', MIN_LR: 1e-06, USE_LARC: False, WARMUP_EPOCHS: 0.25,
         WARMUP_FACTOR: 0.002, WARMUP_METHOD: 'linear'}
"""


def original_checkpoint(path, img_size, num_classes, seed=0, ema=None):
    """A checkpoint as the original release saved it (DDP prefixes, "net", "arch"), of a tiny model built for
    ``img_size``; returns the model."""
    torch.manual_seed(seed)
    model = MsViT(TINY_ARCH, img_size=img_size, num_classes=num_classes)
    checkpoint = {"net": {f"module.{k}": v for k, v in model.state_dict().items()}, "arch": "msvit", "epoch": 300}
    if ema is not None:
        checkpoint["ema"] = ema
    torch.save(checkpoint, path)
    return model


def recipe_cfg(tmp_path, recipe, *overrides):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    # What the original gave on the command line (arch, data, output), and what keeps the run to one step.
    return load_cfg(
        path,
        [
            "MODEL.VIT.MSVIT.ARCH",
            TINY_ARCH,
            "DATA.PATH",
            str(make_folder(tmp_path / "data", per_class=6)),
            "DATA.NUM_CLASSES",
            "2",
            "OUTPUT_DIR",
            str(tmp_path / "out"),
            "DATALOADER.WORKERS",
            "0",
            "DATALOADER.BSZ",
            "12",
            "OPTIM.EPOCHS",
            "1",
            *overrides,
        ],
    )


def test_imagenet_recipe_trains_one_step(tmp_path):
    cfg = recipe_cfg(tmp_path, IMAGENET_RECIPE, "INPUT.IMAGE_SIZE", "32")
    train(cfg)
    checkpoint = read_checkpoint(str(tmp_path / "out" / "checkpoint_last.pth"))
    assert checkpoint["step"] == 1 and checkpoint["epoch"] == 1
    assert isinstance(checkpoint["optimizer"]["param_groups"][0]["lr"], float)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "is ignored" not in log  # the recipe sets no compatibility-only key to another value than its default


def test_finetune_recipe_starts_from_an_original_checkpoint_of_a_smaller_size(tmp_path):
    source = original_checkpoint(tmp_path / "vil_224.pth", img_size=32, num_classes=7)
    cfg = recipe_cfg(
        tmp_path, FINETUNE_RECIPE, "INPUT.IMAGE_SIZE", "48", "MODEL.MODEL_PATH", str(tmp_path / "vil_224.pth")
    )
    train(cfg)
    out = tmp_path / "out"
    checkpoint = read_checkpoint(str(out / "checkpoint_last.pth"))
    assert checkpoint["step"] == 1
    log = (out / "log.txt").read_text()
    assert (
        f"Checkpoint {tmp_path / 'vil_224.pth'} has a classifier for 7 classes: "
        "this run trains a new one for DATA.NUM_CLASSES 2." in log
    )
    # One qhm step at the warmup's first rate (0.01 * 0.002) barely moves the weights: they are the
    # checkpoint's, with the position tables resized from 32 to 48.
    expected = resize_tables(source.state_dict(), source.stage_specs, (32, 32), (48, 48))
    tuned = checkpoint["net"]
    assert tuned["layer1.0.x_pos_embed"].shape == (1, 12, 8) and tuned["head.weight"].shape == (2, 32)
    for key, value in expected.items():
        if not key.startswith("head."):
            torch.testing.assert_close(tuned[key], value, atol=1e-3, rtol=0, msg=key)


def test_finetune_at_another_size_and_class_count_then_resume_never_reads_model_path_again(tmp_path):
    data = make_folder(tmp_path / "data", per_class=6)
    original_checkpoint(tmp_path / "start.pth", img_size=24, num_classes=10)
    out = tmp_path / "run"
    overrides = [
        "MODEL.MODEL_PATH",
        str(tmp_path / "start.pth"),
        "ONLY_SAVE_LAST",
        "1",
        "LOG_FREQ",
        "1",
        "SOLVER.DETECT_ANOMALY",
        "True",
        "OPTIM.OPT",
        "qhm",
        "OPTIM.NU",
        "0.7",
        "OPTIM.TEST_FREQ",
        "500",
    ]
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "1", *overrides))
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["net"]["head.weight"].shape == (2, 32)
    (tmp_path / "start.pth").unlink()  # a resume that read it again would fail
    train(tiny_cfg(data, out, "OPTIM.EPOCHS", "2", *overrides))
    log = (out / "log.txt").read_text()
    assert log.count("Starting from the weights of") == 1 and "Resumed from" in log
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["epoch"] == 2
    files = sorted(p.name for p in out.iterdir() if p.suffix == ".pth")
    assert files == ["checkpoint_last.pth", "model_best.pth"]  # ONLY_SAVE_LAST: no per-epoch files
    steps = re.findall(r" step (\d+): loss ", log)
    assert steps == ["1", "2", "3", "4", "5", "6"]  # LOG_FREQ 1: one line per optimizer step (3 a epoch)
    # A compatibility-only key warns once per run.
    assert log.count("OPTIM.TEST_FREQ 500 is ignored") == 2


def test_start_from_the_ema_copy(tmp_path):
    torch.manual_seed(1)
    ema = MsViT(TINY_ARCH, img_size=32, num_classes=2).state_dict()
    original_checkpoint(tmp_path / "with_ema.pth", img_size=32, num_classes=2, ema=ema)
    model = MsViT(TINY_ARCH, img_size=32, num_classes=2)
    common = [
        "MODEL.VIT.MSVIT.ARCH",
        TINY_ARCH,
        "INPUT.IMAGE_SIZE",
        "32",
        "DATA.NUM_CLASSES",
        "2",
        "MODEL.MODEL_PATH",
        str(tmp_path / "with_ema.pth"),
    ]
    load_weights(model, load_cfg(overrides=[*common, "MODEL.LOAD_EMA", "True"]))
    for key, value in model.state_dict().items():
        assert torch.equal(value, ema[key]), key
    original_checkpoint(tmp_path / "no_ema.pth", img_size=32, num_classes=2)
    with pytest.raises(ValueError, match=r"no_ema.pth.*no EMA.*MODEL.LOAD_EMA False"):
        load_weights(model, load_cfg(overrides=[*common[:-1], str(tmp_path / "no_ema.pth"), "MODEL.LOAD_EMA", "True"]))


def test_model_path_is_looked_up_under_data_dir_and_other_architectures_are_refused(tmp_path):
    (tmp_path / "weights").mkdir()
    original_checkpoint(tmp_path / "weights" / "tiny.pth", img_size=32, num_classes=2)
    common = ["MODEL.VIT.MSVIT.ARCH", TINY_ARCH, "INPUT.IMAGE_SIZE", "32", "DATA.NUM_CLASSES", "2"]
    model = MsViT(TINY_ARCH, img_size=32, num_classes=2)
    found = load_weights(
        model, load_cfg(overrides=[*common, "DATA.DATA_DIR", str(tmp_path / "weights"), "MODEL.MODEL_PATH", "tiny.pth"])
    )
    assert found == str(tmp_path / "weights" / "tiny.pth")
    with pytest.raises(FileNotFoundError, match=r"other.pth does not exist.*DATA.DATA_DIR"):
        load_weights(model, load_cfg(overrides=[*common, "MODEL.MODEL_PATH", "other.pth"]))
    wider = TINY_ARCH.replace("d16", "d24")
    with pytest.raises(ValueError, match=r"tiny.pth.*mis-shaped.*layer1.0.proj.weight"):
        load_weights(
            MsViT(wider, img_size=32, num_classes=2),
            load_cfg(overrides=[*common, "MODEL.MODEL_PATH", str(tmp_path / "weights" / "tiny.pth")]),
        )
    with pytest.raises(ValueError, match=r"classifier for 2 classes.*NUM_CLASSES 3.*set DATA.NUM_CLASSES to its count"):
        load_weights(
            MsViT(TINY_ARCH, img_size=32, num_classes=3),
            load_cfg(overrides=[*common, "MODEL.MODEL_PATH", str(tmp_path / "weights" / "tiny.pth")]),
        )
    # One that records the classes it was trained on (some of the data's, say) names them, with DATA.CLASSES.
    recorded = {**torch.load(tmp_path / "weights" / "tiny.pth", weights_only=True), "classes": ["cat", "dog"]}
    torch.save(recorded, tmp_path / "weights" / "cats_and_dogs.pth")
    with pytest.raises(ValueError, match=r"NUM_CLASSES to its count and DATA.CLASSES to .*\(\['cat', 'dog'\]\)"):
        load_weights(
            MsViT(TINY_ARCH, img_size=32, num_classes=3),
            load_cfg(overrides=[*common, "MODEL.MODEL_PATH", str(tmp_path / "weights" / "cats_and_dogs.pth")]),
        )


@pytest.mark.parametrize("change, named", [("drop", "no head.bias"), ("add", "head.extra")])
def test_a_classifier_with_a_missing_or_foreign_part_is_refused_naming_it(tmp_path, change, named):
    """Whether the run keeps the classifier or trains a new one, a classifier that is not a linear layer's is another
    model's or a damaged file."""
    original_checkpoint(tmp_path / "tiny.pth", img_size=32, num_classes=2)
    checkpoint = torch.load(tmp_path / "tiny.pth", weights_only=True)
    if change == "drop":
        del checkpoint["net"]["module.head.bias"]
    else:
        checkpoint["net"]["module.head.extra"] = torch.zeros(3)
    torch.save(checkpoint, tmp_path / "changed.pth")
    overrides = ["MODEL.VIT.MSVIT.ARCH", TINY_ARCH, "INPUT.IMAGE_SIZE", "32", "DATA.NUM_CLASSES", "2"]
    for new_classifier in (False, True):
        with pytest.raises(ValueError, match=rf"changed.pth has {named}, which a linear classifier"):
            load_weights(
                MsViT(TINY_ARCH, img_size=32, num_classes=2),
                load_cfg(overrides=[*overrides, "MODEL.MODEL_PATH", str(tmp_path / "changed.pth")]),
                new_classifier=new_classifier,
            )


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("module.head.weight", torch.zeros(()), r"a head.weight of shape \(\) and a head.bias of shape \(2,\)"),
        ("module.head.weight", torch.zeros(32, 2), r"a head.weight of shape \(32, 2\) and a head.bias of shape \(2,\)"),
        (
            "module.layer3.0.y_pos_embed",
            torch.zeros(()),
            r"layer3.0.y_pos_embed as torch.float32 of shape \(\), where .* floating-point numbers in 3 dim",
        ),
        (
            "module.layer2.0.proj.weight",
            torch.zeros(32, 16, 2, 2, dtype=torch.int32),
            r"1 of another kind of number \(checkpoint vs model\): layer2.0.proj.weight torch.int32 vs torch.float32",
        ),
        (
            "module.layer1.0.proj.bias",
            torch.zeros(16, dtype=torch.bool),
            r"layer1.0.proj.bias torch.bool vs torch.float32",
        ),
        ("module.norm.weight", torch.zeros(32, dtype=torch.complex64), r"norm.weight torch.complex64 vs torch.float32"),
    ],
    ids=["scalar classifier", "transposed classifier", "scalar position table", "integers", "booleans", "complex"],
)
def test_tensors_that_are_not_the_models_are_refused_naming_them(tmp_path, key, value, named):
    """Whether the run keeps the classifier or trains a new one, and at another image size (whose position tables
    are resized first): a classifier that is not a linear layer's, a position table of another shape, and whole,
    boolean or complex numbers where the model has real ones are one sentence naming them (the last were cast and
    loaded, with a warning for the complex ones; the others stopped with an IndexError)."""
    original_checkpoint(tmp_path / "tiny.pth", img_size=32, num_classes=2)
    checkpoint = torch.load(tmp_path / "tiny.pth", weights_only=True)
    checkpoint["net"][key] = value
    torch.save(checkpoint, tmp_path / "changed.pth")
    overrides = [
        "MODEL.VIT.MSVIT.ARCH",
        TINY_ARCH,
        "DATA.NUM_CLASSES",
        "2",
        "MODEL.MODEL_PATH",
        str(tmp_path / "changed.pth"),
    ]
    for new_classifier, size in ((False, 32), (True, 48)):
        with pytest.raises(ValueError, match=rf"changed.pth (has|holds|does not fit).*{named}") as refusal:
            load_weights(
                MsViT(TINY_ARCH, img_size=size, num_classes=2),
                load_cfg(overrides=[*overrides, "INPUT.IMAGE_SIZE", str(size)]),
                new_classifier=new_classifier,
            )
        assert "\n" not in str(refusal.value)


def test_a_half_precision_checkpoint_loads_its_values(tmp_path):
    source = original_checkpoint(tmp_path / "tiny.pth", img_size=32, num_classes=2)
    checkpoint = torch.load(tmp_path / "tiny.pth", weights_only=True)
    checkpoint["net"] = {k: v.to(torch.bfloat16) for k, v in checkpoint["net"].items()}
    torch.save(checkpoint, tmp_path / "half.pth")
    overrides = ["MODEL.VIT.MSVIT.ARCH", TINY_ARCH, "INPUT.IMAGE_SIZE", "32", "DATA.NUM_CLASSES", "2"]
    model = MsViT(TINY_ARCH, img_size=32, num_classes=2)
    load_weights(model, load_cfg(overrides=[*overrides, "MODEL.MODEL_PATH", str(tmp_path / "half.pth")]))
    for key, value in model.state_dict().items():
        assert torch.equal(value, source.state_dict()[key].to(torch.bfloat16).float()), key


def test_evaluate_true_makes_train_py_evaluate_model_path(tmp_path):
    data = make_folder(tmp_path / "data", per_class=6)
    original_checkpoint(tmp_path / "tiny.pth", img_size=32, num_classes=2)
    overrides = [
        "MODEL.VIT.MSVIT.ARCH",
        TINY_ARCH,
        "INPUT.IMAGE_SIZE",
        "32",
        "DATA.PATH",
        str(data),
        "DATA.NUM_CLASSES",
        "2",
        "MODEL.MODEL_PATH",
        str(tmp_path / "tiny.pth"),
        "OUTPUT_DIR",
        str(tmp_path / "eval"),
        "OUTPUT_PERCLASS_ACC",
        "True",
    ]
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "train.py"),
            "--config-file",
            str(ROOT / "configs" / "vil_tiny.yaml"),
            *overrides,
            "EVALUATE",
            "True",
            "MODEL.PRETRAINED",
            "True",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("MODEL.PRETRAINED True is ignored") == 1
    assert not (tmp_path / "eval" / "checkpoint_last.pth").exists()  # evaluated, not trained
    cfg = load_cfg(ROOT / "configs" / "vil_tiny.yaml", overrides + ["AMP.MEMORY_FORMAT", "nhwc"])
    report = evaluate_checkpoint(cfg)  # channels last gives the same figures
    assert done.stdout.strip().splitlines()[-1] == f"top-1 {report['top1']:.2f} top-5 {report['top5']:.2f}"
    per_class = json.loads((tmp_path / "eval" / "eval.json").read_text())["per_class"]
    assert set(per_class) == {"cat", "dog"} and sum(c["images"] for c in per_class.values()) == 12
    hits = sum(c["top1"] * c["images"] / 100 for c in per_class.values())
    assert hits == pytest.approx(report["top1"] * 12 / 100)


def test_a_checkpoint_trained_with_other_model_options_is_refused_or_said(tmp_path, caplog):
    """Heads, windows, SW_EXACT... change no tensor's shape: the config the checkpoint stores tells them."""
    from vil.checkpoint import save_checkpoint

    common = ["MODEL.VIT.MSVIT.ARCH", TINY_ARCH, "INPUT.IMAGE_SIZE", "32", "DATA.NUM_CLASSES", "2"]
    trained = load_cfg(overrides=[*common, "MODEL.VIT.MSVIT.MODE", "3"])
    path = tmp_path / "own.pth"
    save_checkpoint(path, MsViT(TINY_ARCH, img_size=32, num_classes=2), config=trained.dump())
    model = MsViT(TINY_ARCH, img_size=32, num_classes=2)
    load_weights(model, load_cfg(overrides=[*common, "MODEL.MODEL_PATH", str(path)]))  # MODE 3 evaluates as 0
    other_heads = TINY_ARCH.replace("h2", "h1", 1)
    for key, value in (("MODEL.VIT.MSVIT.ARCH", other_heads), ("MODEL.VIT.MSVIT.SW_EXACT", "1")):
        cfg = load_cfg(overrides=[*common, "MODEL.MODEL_PATH", str(path), key, value])
        with pytest.raises(ValueError, match=rf"own.pth was trained with {key} .*\(now .*{value}"):
            load_weights(model, cfg)
        with caplog.at_level("WARNING", logger="vil"):
            load_weights(model, cfg, new_classifier=True)
        assert re.search(rf"own.pth was trained with {key} .*\(now .*{value}.*starts from its weights", caplog.text)
    caplog.clear()  # weights that do not fit the new architecture: refused, and nothing said before
    cfg = load_cfg(
        overrides=[*common, "MODEL.MODEL_PATH", str(path), "MODEL.VIT.MSVIT.ARCH", TINY_ARCH.replace("d16", "d24")]
    )
    with caplog.at_level("WARNING", logger="vil"), pytest.raises(ValueError, match=r"ARCH .*\(now .*d24.*do not fit"):
        load_weights(MsViT(cfg.MODEL.VIT.MSVIT.ARCH, img_size=32, num_classes=2), cfg, new_classifier=True)
    assert "starts from its weights" not in caplog.text
