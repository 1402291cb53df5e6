"""Models out into the world: Hub folders (tools/export_hub.py) that timm and every checkpoint reader of this
project load, torch.hub's entry points, and tools/predict.py."""

import csv
import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import timm
import torch
from test_data import make_folder
from test_train import TINY_ARCH
from tool_runner import ROOT, run_tool
from torchvision.datasets.folder import default_loader

import vil  # noqa: F401  (registers the models)
from vil.checkpoint import save_checkpoint
from vil.config import load_cfg
from vil.data import build_transform
from vil.hub import class_names
from vil.model_config import build_model
from vil.models import MsViT
from vil.weights import load_weights

TINY = ["MODEL.VIT.MSVIT.ARCH", TINY_ARCH, "INPUT.IMAGE_SIZE", "32", "DATA.NUM_CLASSES", "2"]
PREPROCESSING = ["INPUT.MEAN", "[0.5, 0.4, 0.3]", "INPUT.STD", "[0.2, 0.25, 0.3]", "INPUT.CROP_PCT", "0.9"]
PREPROCESSING += ["INPUT.INTERPOLATION", "2"]  # the presets say 3 (bicubic)


def random_model(cfg, seed):
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    for p in model.parameters():  # not the initial values: a load that kept them would go unnoticed
        p.data.normal_(0, 0.05)
    return model


@pytest.fixture
def exported(tmp_path):
    """A folder of images, a training checkpoint with EMA weights of a model on it, and the Hub folder of those."""
    data = make_folder(tmp_path / "data", classes=("cat", "dog"), per_class=2)
    overrides = [*TINY, *PREPROCESSING, "DATA.PATH", str(data), "MODEL.LOAD_EMA", "True"]
    cfg = load_cfg("vil_tiny", overrides)
    model, ema = random_model(cfg, 0), random_model(cfg, 1)
    checkpoint = tmp_path / "checkpoint_last.pth"
    save_checkpoint(checkpoint, model, ema=ema.state_dict(), best_acc=87.5, epoch=4, config=cfg.dump())
    out = tmp_path / "hub"
    status, stdout, err = run_tool(
        "export_hub", "--config-file", "vil_tiny", "--out", out, *overrides, "MODEL.MODEL_PATH", checkpoint
    )
    assert status == 0, err
    assert f"timm.create_model('local-dir:{out}', pretrained=True)" in stdout  # the hint loads the weights
    return dict(cfg=cfg, data=data, out=out, model=model, ema=ema, checkpoint=checkpoint, overrides=overrides)


def test_a_hub_folder_rebuilds_the_ema_weights_through_timm(exported):
    out, ema, cfg = exported["out"], exported["ema"], exported["cfg"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "vil_arch" and config["model_args"]["arch"] == TINY_ARCH
    assert config["label_names"] == ["cat", "dog"] and config["num_classes"] == 2
    pretrained = config["pretrained_cfg"]
    assert pretrained["input_size"] == [3, 32, 32] and pretrained["crop_pct"] == 0.9
    assert pretrained["mean"] == [0.5, 0.4, 0.3] and pretrained["std"] == [0.2, 0.25, 0.3]
    assert pretrained["interpolation"] == "bilinear"  # INPUT.INTERPOLATION 2
    images = torch.randn(2, 3, 32, 32)
    rebuilt = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    with torch.no_grad():
        assert torch.equal(rebuilt(images), ema(images))
    card = (out / "README.md").read_text()
    parameters = sum(p.numel() for p in ema.parameters())
    assert TINY_ARCH in card and f"{parameters / 1e6:.2f}M" in card and "EMA" in card
    # The run's best top-1 is its model weights', which the card says beside these EMA weights.
    assert "87.50% (the run's best, its model weights', not these EMA weights')" in card
    assert "license: mit" in card and "arXiv:2103.15358" in card
    assert tuple(timm.data.resolve_data_config({}, model=rebuilt)["mean"]) == (0.5, 0.4, 0.3)
    assert cfg.INPUT.IMAGE_SIZE == 32


def test_a_hub_folder_holds_the_model_weights_unless_load_ema_asks_for_the_ema_ones(exported, tmp_path):
    """As tools/eval.py reads a checkpoint: its model weights, the ones its run's best top-1 is of, by default."""
    overrides = [o for o in exported["overrides"] if o not in ("MODEL.LOAD_EMA", "True")]
    out = tmp_path / "model_weights"
    status, stdout, err = run_tool(
        "export_hub", "--config-file", "vil_tiny", "--out", out, *overrides, "MODEL.MODEL_PATH", exported["checkpoint"]
    )
    assert status == 0 and "model weights" in stdout, err
    model = random_model(exported["cfg"], 0)  # the checkpoint's model weights
    rebuilt = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rebuilt(images), model(images)) and not torch.equal(rebuilt(images), exported["ema"](images))
    assert "87.50% (the run's best)" in (out / "README.md").read_text()


def test_every_checkpoint_reader_takes_the_folder_and_the_safetensors_file(exported, tmp_path):
    out, ema = exported["out"], exported["ema"]
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = ema(images)
        for path in (out, out / "model.safetensors"):
            cfg = load_cfg("vil_tiny", [*TINY, "MODEL.MODEL_PATH", str(path)])
            model = build_model(cfg).eval()
            load_weights(model, cfg)
            assert torch.equal(model(images), want)
        # The file's classifier (2 classes) is kept, for a model of its class count given or not; another count
        # gets a new classifier (the features stay the file's).
        torch.save({"net": ema.state_dict()}, tmp_path / "ema.pth")
        for file, classes in itertools.product(
            (out, tmp_path / "ema.pth"), ({}, dict(num_classes=2), dict(num_classes=3))
        ):
            overlay = timm.create_model(
                "vil_arch",
                arch=TINY_ARCH,
                img_size=32,
                pretrained=True,
                pretrained_cfg_overlay=dict(file=str(file)),
                **classes,
            ).eval()
            if classes.get("num_classes", 2) == 2:
                assert torch.equal(overlay(images), want)
            else:
                assert overlay.head.out_features == 3
                assert torch.equal(overlay.forward_features(images), ema.forward_features(images))
    evaluation = ["DATA.PATH", exported["data"], "OUTPUT_DIR", out.parent / "eval", "DATALOADER.WORKERS", "0"]
    evaluation += ["MODEL.MODEL_PATH", out]
    status, stdout, err = run_tool("eval", "--config-file", "vil_tiny", *TINY, *evaluation)
    assert status == 0, err
    assert stdout.strip().splitlines()[-1].startswith("top-1 ")


def test_timm_and_torch_hub_refuse_what_load_checkpoint_refuses(exported, tmp_path):
    # timm reads a file without checking it: a byte altered after the write would load as other weights, and a file
    # of no weights would fail inside timm. The checkpoint readers' sentences come first.
    from test_checkpoint import flip_a_byte_of_the_largest_tensor

    altered = tmp_path / "altered.pth"
    torch.save({"net": exported["ema"].state_dict()}, altered)
    record = flip_a_byte_of_the_largest_tensor(altered)
    torch.save([1, 2], tmp_path / "list.pth")
    (tmp_path / "no_weights").mkdir()
    shutil.copy(exported["out"] / "config.json", tmp_path / "no_weights")
    truncated = tmp_path / "truncated"
    shutil.copytree(exported["out"], truncated)
    (truncated / "model.safetensors").write_bytes((truncated / "model.safetensors").read_bytes()[:100])
    refusals = {
        altered: rf"altered\.pth is damaged: its record {re.escape(record)} no longer reads back",
        tmp_path / "list.pth": r"list\.pth holds a list, not a checkpoint dict",
        tmp_path / "no_weights": r"no_weights is a folder without model\.safetensors",
        truncated: r"truncated/model\.safetensors is not a readable safetensors file",
    }
    for path, refusal in refusals.items():
        with pytest.raises((ValueError, FileNotFoundError), match=refusal):
            timm.create_model(
                "vil_arch", arch=TINY_ARCH, img_size=32, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))
            )
    with pytest.raises(ValueError, match=refusals[truncated]):
        timm.create_model(f"local-dir:{truncated}", pretrained=True)
    with pytest.raises(ValueError, match=refusals[altered]):
        torch.hub.load(
            str(ROOT),
            "vil_arch",
            source="local",
            arch=TINY_ARCH,
            img_size=32,
            pretrained=True,
            pretrained_cfg_overlay=dict(file=str(altered)),
        )


@pytest.mark.parametrize("preset, size", [("vil_digits", 32), ("vil_tiny", 64)])
def test_presets_export_and_rebuild(tmp_path, preset, size):
    cfg = load_cfg(preset, ["INPUT.IMAGE_SIZE", str(size), "DATA.NUM_CLASSES", "10"])
    model = random_model(cfg, 2)
    save_checkpoint(tmp_path / "model.pth", model)
    status, _, err = run_tool(
        "export_hub", "--config-file", preset, "--out", tmp_path / "hub", "INPUT.IMAGE_SIZE", str(size),
        "DATA.NUM_CLASSES", "10", "MODEL.MODEL_PATH", tmp_path / "model.pth",
    )  # fmt: skip
    assert status == 0, err
    rebuilt = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True).eval()
    images = torch.randn(1, 3, size, size)
    with torch.no_grad():
        assert torch.equal(rebuilt(images), model(images))
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert config["model_args"]["arch"] == cfg.MODEL.VIT.MSVIT.ARCH and config["num_classes"] == 10
    if preset == "vil_digits":
        assert config["label_names"] == [str(d) for d in range(10)]


def test_export_refuses_a_missing_checkpoint_in_one_sentence(tmp_path):
    status, _, err = run_tool("export_hub", "--config-file", "vil_tiny", "--out", tmp_path / "hub", *TINY)
    assert status == 1 and "MODEL.MODEL_PATH" in err
    status, _, err = run_tool(
        "export_hub", "--config-file", "vil_tiny", "--out", tmp_path / "hub", *TINY, "MODEL.MODEL_PATH", tmp_path
    )
    assert status == 1 and "without model.safetensors" in err and str(tmp_path) in err
    assert not (tmp_path / "hub").exists()


def test_the_model_cards_code_run_as_written_gives_the_checkpoints_logits(exported):
    out, ema, cfg = exported["out"], exported["ema"], exported["cfg"]
    card = (out / "README.md").read_text()
    code = card.split("```python\n")[1].split("```")[0].replace("path/to/this/folder", str(out))
    names = {}
    exec(code, names)
    image = default_loader(str(exported["data"] / "val" / "dog" / "0.JPEG"))
    preprocessed = names["transform"](image)
    assert torch.allclose(preprocessed, build_transform(cfg, train=False)(image), atol=1e-6)
    with torch.no_grad():
        assert torch.equal(names["model"](preprocessed[None]), ema(preprocessed[None]))


def test_export_takes_out_after_the_overrides(exported, tmp_path):
    """The order the usage once showed: MODEL.MODEL_PATH ckpt --out DIR."""
    out = tmp_path / "hub_last"
    status, _, err = run_tool(
        "export_hub", "--config-file", "vil_tiny", *exported["overrides"],
        "MODEL.MODEL_PATH", exported["checkpoint"], "--out", out,
    )  # fmt: skip
    assert status == 0, err
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (exported["out"] / name).read_bytes()


def test_a_folder_keeps_the_model_options_and_classes_it_records(exported, tmp_path):
    """A folder exported from a model of LN_EPS 0.1 is refused for a model of the default eps, as the checkpoint it
    came from is; a detection backbone built from it takes its options; tools/export_backbone.py reads its arch."""
    from vil.checkpoint import read_checkpoint
    from vil.detection import build_fpn_backbone

    overrides = [*exported["overrides"], "MODEL.VIT.MSVIT.LN_EPS", "0.1", "MODEL.LOAD_EMA", "False"]
    overrides += ["MODEL.VIT.MSVIT.ATTN_TYPE", "sliding_chunk", "MODEL.VIT.DROP_PATH", "0.2"]  # training's choices
    cfg = load_cfg("vil_tiny", overrides)
    checkpoint = tmp_path / "eps.pth"
    save_checkpoint(checkpoint, random_model(cfg, 3), config=cfg.dump(), classes=["cat", "dog"])
    out = tmp_path / "eps"
    status, _, err = run_tool(
        "export_hub", "--config-file", "vil_tiny", "--out", out, *overrides, "MODEL.MODEL_PATH", checkpoint
    )
    assert status == 0, err
    assert read_checkpoint(out)["classes"] == ["cat", "dog"]
    # The backend and the drop rates are not the model's: the machine that loads the folder chooses its backend.
    recorded = json.loads((out / "config.json").read_text())["model_args"]
    assert recorded["ln_eps"] == 0.1 and not {"attn_backend", "drop_rate", "drop_path_rate"} & set(recorded)
    plain = load_cfg("vil_tiny", [*TINY, "MODEL.MODEL_PATH", str(out)])
    with pytest.raises(ValueError, match=r"LN_EPS 0.1 \(now 1e-06\)"):
        load_weights(build_model(plain), plain)
    # timm reads the folder's weights alone: the options its config.json records are checked all the same.
    for built in (
        dict(model_name="vil_arch", arch=TINY_ARCH, img_size=32, pretrained_cfg_overlay=dict(file=str(out))),
        dict(model_name=f"local-dir:{out}", ln_eps=1e-6),
    ):
        with pytest.raises(ValueError, match=r"eps was trained with ln_eps=0.1 \(MODEL.VIT.MSVIT.LN_EPS\), not 1e-06"):
            timm.create_model(pretrained=True, **built)
    assert timm.create_model(f"local-dir:{out}", pretrained=True).norm.eps == 0.1
    body = build_fpn_backbone(TINY_ARCH, checkpoint=str(out), img_size=32).body
    assert body.model_options["ln_eps"] == 0.1
    status, stdout, err = run_tool("export_backbone", out, tmp_path / "body.pth", "--format", "torchvision")
    assert status == 0, err
    assert "ln_eps 0.1" in stdout
    # A record that is not JSON, or arguments of the wrong type, are one sentence.
    record = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(record, model_args=dict(record["model_args"], sw_exact="one"))))
    with pytest.raises(ValueError, match=r"model_args of .*config.json, MODEL.VIT.MSVIT.SW_EXACT is 'one'"):
        read_checkpoint(out)
    (out / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json is not readable JSON"):
        read_checkpoint(out)


def test_export_refuses_a_checkpoint_trained_with_other_model_options(exported, tmp_path):
    assert exported["cfg"].MODEL.VIT.MSVIT.SW_EXACT == 0  # what the checkpoint was trained with
    status, _, err = run_tool(
        "export_hub", "--config-file", "vil_tiny", "--out", tmp_path / "hub_sw", *exported["overrides"],
        "MODEL.MODEL_PATH", exported["checkpoint"], "MODEL.VIT.MSVIT.SW_EXACT", "1",
    )  # fmt: skip
    assert status == 1 and "checkpoint_last.pth was trained with MODEL.VIT.MSVIT.SW_EXACT 0 (now 1)" in err
    assert not (tmp_path / "hub_sw").exists()


def test_the_folder_names_the_classes_the_checkpoint_records(exported, tmp_path):
    """Exported where the training data is not (DATA.PATH elsewhere): the class names are the checkpoint's own, in
    label order, not the indices as text."""
    cfg = exported["cfg"]
    checkpoint = tmp_path / "named.pth"
    save_checkpoint(checkpoint, random_model(cfg, 2), classes=["eel", "fox"], config=cfg.dump())
    out = tmp_path / "named"
    overrides = [*TINY, "DATA.PATH", tmp_path / "elsewhere", "MODEL.MODEL_PATH", checkpoint]
    status, _, err = run_tool("export_hub", "--config-file", "vil_tiny", "--out", out, *overrides)
    assert status == 0, err
    assert json.loads((out / "config.json").read_text())["label_names"] == ["eel", "fox"]


def test_export_refuses_an_unwritable_out_in_one_sentence(exported, tmp_path):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "hub"
    status, _, err = run_tool(
        "export_hub", "--config-file", "vil_tiny", "--out", out, *exported["overrides"],
        "MODEL.MODEL_PATH", exported["checkpoint"],
    )  # fmt: skip
    assert status == 1 and f"--out {out} cannot be written (Not a directory)" in err
    assert len(err.strip().splitlines()) == 1


def test_export_keeps_files_of_the_users_and_rewrites_its_own_folder(exported, tmp_path):
    """A folder holding a README.md and config.json of the user's is refused, untouched; the folder a previous
    export wrote is written again."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "README.md").write_text("my project")
    (mine / "config.json").write_text('{"mine": 1}')
    args = ["--config-file", "vil_tiny", *exported["overrides"], "MODEL.MODEL_PATH", exported["checkpoint"]]
    status, _, err = run_tool("export_hub", "--out", mine, *args)
    assert status == 1 and len(err.strip().splitlines()) == 1
    assert str(mine) in err and "README.md" in err and "config.json" in err
    assert sorted(p.name for p in mine.iterdir()) == ["README.md", "config.json"]
    clone = tmp_path / "clone"  # a cloned repository: its other files stay, the export is written beside them
    (clone / ".git").mkdir(parents=True)
    (clone / ".gitattributes").write_text("*.safetensors filter=lfs")
    status, _, err = run_tool("export_hub", "--out", clone, *args)
    assert status == 0 and (clone / ".gitattributes").read_text() == "*.safetensors filter=lfs", err
    assert {"README.md", "config.json", "model.safetensors"} <= {p.name for p in clone.iterdir()}
    assert (mine / "README.md").read_text() == "my project" and (mine / "config.json").read_text() == '{"mine": 1}'
    before = (exported["out"] / "model.safetensors").read_bytes()
    status, _, err = run_tool("export_hub", "--out", exported["out"], *args)
    assert status == 0, err
    assert (exported["out"] / "model.safetensors").read_bytes() == before


def test_vil_arch_builds_any_architecture_string():
    model = timm.create_model("vil_arch", arch=TINY_ARCH, img_size=32, num_classes=3)
    assert model.stage_specs == MsViT(TINY_ARCH, img_size=32, num_classes=3).stage_specs
    assert timm.create_model("vil_arch").stage_specs == timm.create_model("vil_small").stage_specs


def test_torch_hub_has_an_entry_per_registered_model():
    spec = importlib.util.spec_from_file_location("hubconf", ROOT / "hubconf.py")
    hubconf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hubconf)
    entries = [name for name in dir(hubconf) if callable(getattr(hubconf, name)) and not name.startswith("_")]
    assert sorted(entries) == sorted(timm.list_models("vil_*"))  # what torch.hub.list lists for a repository
    model = torch.hub.load(str(ROOT), "vil_arch", source="local", arch=TINY_ARCH, img_size=32, num_classes=3)
    assert isinstance(model, MsViT) and model.num_classes == 3


def test_torch_hub_loads_a_checkout_that_pip_has_not_installed():
    """torch.hub runs a downloaded checkout as it is: its kernels/ folder is not yet the vil_kernels that vil imports.
    Here the interpreter starts without site's .pth files (-S), so this project's install is not seen."""
    code = (
        f"import sys; sys.path.append({sysconfig.get_paths()['purelib']!r}); import torch; "
        f"model = torch.hub.load({str(ROOT)!r}, 'vil_arch', source='local', arch={TINY_ARCH!r}, img_size=32); "
        "import vil_kernels; print(type(model).__name__, vil_kernels.__file__)"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["MsViT", str(ROOT / "kernels" / "__init__.py")]


def test_predict_labels_files_folders_and_globs_and_skips_unreadable_images(exported, tmp_path, caplog):
    out, ema, data, cfg = exported["out"], exported["ema"], exported["data"], exported["cfg"]
    inputs = [data / "val", str(data / "train" / "dog" / "*.JPEG"), data / "train" / "cat" / "broken.JPEG"]
    with caplog.at_level(logging.WARNING):
        status, stdout, err = run_tool(
            "predict", "--model", f"local-dir:{out}", "--top-k", "2", "--batch-size", "3", *inputs,
            "--output", tmp_path / "labels.csv",
        )  # fmt: skip
    assert status == 0, err
    assert "broken.JPEG" in caplog.text and "6 of 7 images labelled" in err
    with open(tmp_path / "labels.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["path"] for row in rows] == [
        *(str(data / "val" / c / f"{i}.JPEG") for c in ("cat", "dog") for i in range(2)),
        *(str(data / "train" / "dog" / f"{i}.JPEG") for i in range(2)),
    ]
    transform = build_transform(cfg, train=False)  # the same preprocessing, from the run's config
    for row in rows:
        with torch.no_grad():
            probabilities = ema(transform(default_loader(row["path"]))[None]).softmax(-1)[0]
        best = int(probabilities.argmax())
        assert row["class_1"] == ["cat", "dog"][best]
        assert float(row["probability_1"]) == pytest.approx(float(probabilities[best]), abs=1e-5)
        assert float(row["probability_1"]) >= float(row["probability_2"])
    assert len(stdout.strip().splitlines()) == 6
    status, _, err = run_tool(
        "predict", "--config-file", "vil_tiny", *TINY, *PREPROCESSING, "DATA.PATH", data, "MODEL.MODEL_PATH", out,
        str(data / "val"), "--output", tmp_path / "labels.json",
    )  # fmt: skip
    assert status == 0, err
    records = json.loads((tmp_path / "labels.json").read_text())
    assert [r["path"] for r in records] == [r["path"] for r in rows[:4]]
    assert [r["classes"][0] for r in records] == [r["class_1"] for r in rows[:4]]


def test_predict_names_the_classes_the_checkpoint_records(exported, tmp_path):
    """The checkpoint's class names label the images, whatever data the config names; the same classes in another
    order in the config are refused, as evaluation refuses them."""
    checkpoint = tmp_path / "named.pth"
    torch.save({**torch.load(exported["checkpoint"], weights_only=True), "classes": ["fish", "cat"]}, checkpoint)
    images = str(exported["data"] / "val")
    common = ["--config-file", "vil_tiny", *TINY, *PREPROCESSING, "MODEL.MODEL_PATH", checkpoint, images]
    status, stdout, err = run_tool("predict", *common, "--top-k", "2")
    assert status == 0, err
    lines = stdout.strip().splitlines()
    assert len(lines) == 4 and all("fish (" in line and "cat (" in line for line in lines), stdout
    status, _, err = run_tool("predict", *common, "DATA.CLASSES", '["cat", "fish"]')
    assert status == 1 and "another order" in err and "label 0 is 'fish'" in err, err


def test_predict_labels_with_the_checkpoints_ema_weights_where_model_load_ema_says(exported, tmp_path):
    images = sorted(str(p) for p in (exported["data"] / "val").rglob("*.JPEG"))
    common = ["--config-file", "vil_tiny", *TINY, *PREPROCESSING, "MODEL.MODEL_PATH", exported["checkpoint"]]
    transform = build_transform(exported["cfg"], train=False)
    batch = torch.stack([transform(default_loader(path)) for path in images])
    for load_ema, weights in (("False", exported["model"]), ("True", exported["ema"])):
        output = tmp_path / f"ema_{load_ema}.json"
        status, _, err = run_tool("predict", *common, "MODEL.LOAD_EMA", load_ema, *images, "--output", output)
        assert status == 0, err
        with torch.no_grad():
            expected = weights.eval()(batch).softmax(-1).max(-1).values
        got = [record["probabilities"][0] for record in json.loads(output.read_text())]
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=0)


def test_predict_runs_the_model_as_the_configs_amp_keys_say(exported, monkeypatch):
    # As evaluation runs it: under autocast with AMP.ENABLED and AMP.ON_CPU, on channels-last images with nhwc.
    seen, forward = [], MsViT.forward

    def watched(model, x):
        seen.append((torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None, x.stride()))
        return forward(model, x)

    monkeypatch.setattr(MsViT, "forward", watched)
    common = ["--config-file", "vil_tiny", *TINY, *PREPROCESSING, "MODEL.MODEL_PATH", exported["checkpoint"]]
    amp = ["AMP.ENABLED", "True", "AMP.ON_CPU", "True", "AMP.DTYPE", "bfloat16", "AMP.MEMORY_FORMAT", "nhwc"]
    for overrides in ([], amp):
        status, _, err = run_tool("predict", *common, *overrides, str(exported["data"] / "val"))
        assert status == 0, err
    (plain_dtype, plain_strides), (amp_dtype, amp_strides) = seen
    assert plain_dtype is None and amp_dtype == torch.bfloat16
    assert plain_strides[1] > 1 and amp_strides[1] == 1  # channels last: the channel stride is 1


def test_predict_refuses_outputs_that_are_not_finite_and_writes_nothing(exported, monkeypatch, tmp_path):
    """Overflowed arithmetic (float16 under AMP, say) gives NaN logits, whose "top classes" would be any."""
    forward = MsViT.forward

    def overflowing(model, x):
        logits = forward(model, x).clone()
        logits[1:, -1] = float("inf")  # one logit of each image of the batch but its first: no top classes there
        return logits

    monkeypatch.setattr(MsViT, "forward", overflowing)
    images = sorted(str(p) for p in (exported["data"] / "val").rglob("*.JPEG"))
    common = ["--config-file", "vil_tiny", *TINY, *PREPROCESSING, "MODEL.MODEL_PATH", exported["checkpoint"]]
    status, _, err = run_tool("predict", *common, *images, "--batch-size", "3", "--output", tmp_path / "labels.json")
    assert status == 1 and f"outputs for {images[1]} (and 1 other images of its batch) are not finite" in err, err
    assert not (tmp_path / "labels.json").exists()


def test_a_folder_gives_the_images_a_file_name_gives(tmp_path):
    """GIF files, read when named one by one, are a folder's images too; other files are not."""
    from vil.predict import image_paths

    folder = tmp_path
    for name in ("a.gif", "b.PNG", "notes.txt"):
        (folder / name).write_bytes(b"")
    assert [Path(p).name for p in image_paths([folder])] == ["a.gif", "b.PNG"]
    assert [Path(p).name for p in image_paths([folder / "a.gif"])] == ["a.gif"]
    # A glob's ** reaches into folders at any depth; a folder whose name the glob matches is not an image.
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "sub" / "deeper" / "c.gif").write_bytes(b"")
    (folder / "folder.gif").mkdir()
    found = [Path(p).relative_to(folder).as_posix() for p in image_paths([str(folder / "**" / "*.gif")])]
    assert found == ["a.gif", "sub/deeper/c.gif"]


def test_a_folder_gives_the_images_of_linked_folders_once(tmp_path):
    """Links to folders are followed, as image folders' datasets follow them; one that leads back above itself, or a
    second link to a folder already read, adds nothing again."""
    from vil.predict import image_paths

    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "c.jpg").write_bytes(b"")
    top = tmp_path / "top"
    (top / "plain").mkdir(parents=True)
    (top / "plain" / "a.jpg").write_bytes(b"")
    (top / "linked").symlink_to(tmp_path / "store")
    (top / "linked_again").symlink_to(tmp_path / "store")
    (top / "plain" / "up").symlink_to(top)  # a loop
    found = [Path(p).relative_to(top).as_posix() for p in image_paths([top])]
    assert found in (["linked/c.jpg", "plain/a.jpg"], ["linked_again/c.jpg", "plain/a.jpg"]), found


def test_predict_writes_as_many_csv_columns_as_the_model_has_classes_below_top_k(exported, tmp_path):
    out, ema, data, cfg = exported["out"], exported["ema"], exported["data"], exported["cfg"]
    status, _, err = run_tool(
        "predict", "--model", f"local-dir:{out}", "--top-k", "5", data / "val", "--output", tmp_path / "labels.csv"
    )
    assert status == 0, err
    with open(tmp_path / "labels.csv") as f:
        header, *rows = list(csv.reader(f))
    assert header == ["path", "class_1", "probability_1", "class_2", "probability_2"]  # 2 classes, not 5
    assert len(rows) == 4 and all(len(row) == len(header) for row in rows)
    transform = build_transform(cfg, train=False)
    for path, *cells in rows:
        with torch.no_grad():
            probabilities = ema(transform(default_loader(path))[None]).softmax(-1)[0].tolist()
        shown = dict(zip(cells[0::2], map(float, cells[1::2])))
        assert shown == pytest.approx(dict(zip(["cat", "dog"], probabilities)), abs=1e-5)


def test_predict_writes_a_file_name_that_is_not_utf8_as_its_bytes(exported, tmp_path):
    """A Latin-1 name (as old archives unpack) in the CSV as the file system holds it; it stopped the write."""
    out, data = exported["out"], exported["data"]
    image = next((data / "val").rglob("*.*"))
    (tmp_path / "named").mkdir()
    with open(os.path.join(os.fsencode(tmp_path / "named"), b"caf\xe9.png"), "wb") as f:
        f.write(image.read_bytes())
    for output in ("labels.csv", "labels.json"):
        status, _, err = run_tool(
            "predict", "--model", f"local-dir:{out}", tmp_path / "named", "--output", tmp_path / output
        )
        assert status == 0, err
    assert b"caf\xe9.png," in (tmp_path / "labels.csv").read_bytes()


def test_predict_refuses_an_unknown_model_naming_the_registered_ones(tmp_path):
    data = make_folder(tmp_path, per_class=1, corrupt=False)
    status, _, err = run_tool("predict", "--model", "vil_tinyy", data / "val")
    assert status == 1 and "vil_tinyy" in err and "local-dir:DIR" in err
    assert all(name in err for name in timm.list_models("vil_*")) and "vil_small.in1k" in err
    assert len(err.strip().splitlines()) == 1


def test_predict_refuses_inputs_that_name_nothing(exported, tmp_path):
    status, _, err = run_tool("predict", "--model", f"local-dir:{exported['out']}", tmp_path / "nothing*.png")
    assert status == 1 and "nothing*.png" in err
    status, _, err = run_tool("predict", "--model", "vil_tiny", "--output", tmp_path / "x.txt", tmp_path)
    assert status == 2 and "x.txt" in err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "a.png").write_bytes(b"not an image")
    status, _, err = run_tool(
        "predict", "--model", f"local-dir:{exported['out']}", tmp_path / "broken", "--output", tmp_path / "x.json"
    )
    assert status == 1 and "none of the 1 images" in err and not (tmp_path / "x.json").exists()
    (tmp_path / "labels.json").mkdir()  # refused before any image is labelled, in one sentence
    status, _, err = run_tool("predict", "--model", "vil_tiny", "--output", tmp_path / "labels.json", tmp_path)
    assert status == 1 and err.startswith("error: --output") and "(it is a folder)" in err and "Traceback" not in err


def test_class_folders_of_another_count_name_no_classes_and_say_so(tmp_path, caplog):
    data = make_folder(tmp_path / "data", classes=("cat", "dog", "fox"), per_class=1, corrupt=False)
    cfg = load_cfg("vil_tiny", [*TINY, "DATA.PATH", str(data)])  # DATA.NUM_CLASSES 2
    with caplog.at_level(logging.WARNING, logger="vil"):
        assert class_names(cfg) == ["0", "1"]
    assert f"{data / 'train'} names 3 classes, not DATA.NUM_CLASSES 2" in caplog.text


def test_a_checkpoints_class_names_are_taken_where_they_are_as_many_as_the_models_classes():
    cfg = load_cfg("vil_tiny", [*TINY, "DATA.NUM_CLASSES", "3", "DATA.CLASSES", "['a', 'b', 'c']"])
    assert class_names(cfg, {"classes": ["x", "y", "z"]}) == ["x", "y", "z"]
    assert class_names(cfg, {"classes": ["x", "y"]}) == ["a", "b", "c"]  # two names for three outputs: the data's


def test_the_model_cards_figures_by_hand():
    """GMACs: multiply-adds, half the FLOP counter's count (a 768 x 1000 product: 768,000); a best top-1 of -inf
    (a run stopped before its first evaluation) is none."""
    from vil.hub import _gmacs, _recorded

    product = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 1000, bias=False))
    assert _gmacs(product, 16) == pytest.approx(768_000 / 1e9)
    assert _recorded(float("-inf")) is None and _recorded(None) is None and _recorded(87.5) == 87.5


def test_predict_refuses_a_folder_that_is_not_a_readable_hub_folder(exported, tmp_path):
    images = exported["data"] / "val"
    damaged = tmp_path / "damaged"
    shutil.copytree(exported["out"], damaged)
    (damaged / "model.safetensors").write_bytes(b"")
    (tmp_path / "bare").mkdir()
    # config.json readable JSON, but not what timm builds from: its keys altered (KeyError, TypeError in timm)
    altered = {}
    for key in ("architecture", "arch"):
        altered[key] = tmp_path / f"altered_{key}"
        shutil.copytree(exported["out"], altered[key])
        config = altered[key] / "config.json"
        config.write_text(config.read_text().replace(f'"{key}"', f'"x{key}"', 1))
    for folder, fact in (
        (tmp_path / "nowhere", "does not exist"),
        (tmp_path / "bare", "has no config.json"),
        (damaged, "model.safetensors"),
        (altered["architecture"], "'architecture'"),
        (altered["arch"], "'xarch'"),
    ):
        status, _, err = run_tool("predict", "--model", f"local-dir:{folder}", images)
        assert status == 1 and str(folder) in err and fact in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_predict_takes_its_options_between_the_images_and_names_a_bad_one(exported):
    cats, dogs = exported["data"] / "val" / "cat", exported["data"] / "val" / "dog"
    status, stdout, err = run_tool("predict", "--model", f"local-dir:{exported['out']}", cats, "--top-k", "1", dogs)
    assert status == 0, err
    lines = stdout.strip().splitlines()
    assert len(lines) == 4 and all(line.count(" (") == 1 for line in lines)  # both folders' images, one class each
    images = exported["data"] / "val"
    status, _, err = run_tool("predict", "--model", f"local-dir:{exported['out']}", images, "--top-k", "0")
    assert status == 2 and "--top-k" in err and "got 0" in err


def test_predict_tells_config_keys_from_image_names(tmp_path, monkeypatch):
    from tool_runner import load_tool

    monkeypatch.chdir(tmp_path)
    (tmp_path / "MODEL.JPG").touch()  # a key's form, a section's name, but a file
    args = load_tool("predict").parse_args(
        ["--config-file", "vil_tiny", "IMG_0001.JPG", "MODEL.MODEL_PATH", "m.pth", "MODEL.JPG", "DSC_0002.JPG"]
    )
    assert args.overrides == ["MODEL.MODEL_PATH", "m.pth"]
    assert args.images == ["IMG_0001.JPG", "MODEL.JPG", "DSC_0002.JPG"]
    # A near miss of a section is a key, which the config then names ("did you mean INPUT.CROP_PCT?").
    args = load_tool("predict").parse_args(["--config-file", "vil_tiny", "INPT.CROP_PCT", "0.9", "IMG_0001.JPG"])
    assert args.overrides == ["INPT.CROP_PCT", "0.9"] and args.images == ["IMG_0001.JPG"]
    # So is a key of the config's top level.
    args = load_tool("predict").parse_args(["--config-file", "vil_tiny", "IMG_0001.JPG", "SEED", "3"])
    assert args.overrides == ["SEED", "3"] and args.images == ["IMG_0001.JPG"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--config-file", "vil_tiny", "MODEL.MODEL_PATH", "m.pth"], "give the images to label"),
        (["--config-file", "", "a.png"], "--config-file is empty"),  # as from an unset $CFG: not the defaults
    ],
)
def test_predict_refuses_no_images_and_an_empty_config_file_before_loading_anything(argv, message, capsys):
    from tool_runner import load_tool

    with pytest.raises(SystemExit) as exit_info:
        load_tool("predict").parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_imagenet_models_show_imagenet_descriptions():
    from vil.hub import default_class_names
    from vil.predict import readable_names

    names = readable_names(default_class_names(1000))
    assert len(names) == 1000 and names[0].startswith("tench")
    assert readable_names(["a", "b"]) == ["a", "b"]


def test_the_package_imports_and_locks_without_fcntl(tmp_path):
    """As on Windows: no fcntl module."""
    code = (
        "import sys; sys.modules['fcntl'] = None; import vil, vil.files, vil.training; "
        f"lock = vil.files.FolderLock({str(tmp_path)!r}); print('locked')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "locked"


def test_an_older_torch_is_refused_in_one_sentence_at_the_lower_bound_pyproject_declares():
    declared = re.search(r'"torch>=([0-9.]+)"', (Path(ROOT) / "pyproject.toml").read_text()).group(1)
    assert declared == vil.MIN_TORCH
    older = "2.9.1"
    code = f"import torch; torch.__version__ = {older!r}; import vil"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0
    (sentence,) = [line for line in done.stderr.splitlines() if line.startswith("ImportError")]
    assert older in sentence and f"torch>={declared}" in sentence


def test_a_broken_safetensors_file_is_named_in_one_sentence(tmp_path):
    from vil.checkpoint import read_checkpoint

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match="not a readable safetensors file") as refused:
        read_checkpoint(path)
    assert str(path) in str(refused.value)
