"""tools/export_backbone.py and the backbone builder together: the exported backbone is the trained model's, with
its options, its image size in every layout, and tables made for the maps the model had."""

import shutil

import pytest
import torch
from test_checkpoint import original_release_checkpoint
from test_detection import SMALL, TRAINED_OPTIONS, assert_maps_of, small_checkpoint
from tool_runner import run_tool

from vil.detection import build_fpn_backbone
from vil.models.tables import resize_full_bias_table

# SMALL without the absolute position embedding: relative biases only.
SMALL_RPB = SMALL.replace("a1", "a0")


def export(*args):
    status, printed, error = run_tool("export_backbone", *args)
    assert status == 0, error
    return printed


def test_the_export_keeps_the_options_the_model_was_trained_with(tmp_path):
    source, _ = small_checkpoint(tmp_path / "cls.pth", overrides=TRAINED_OPTIONS)
    printed = export(tmp_path / "cls.pth", tmp_path / "d2.pth", "--format", "detectron2")
    info = torch.load(tmp_path / "d2.pth", weights_only=True)["vil"]
    assert info["options"] == {"only_global": True, "share_w": False, "ln_eps": 0.1}
    assert "options only_global True, share_w False, ln_eps 0.1" in printed
    built = build_fpn_backbone(SMALL, img_size=64, level_norm=False, checkpoint=tmp_path / "d2.pth").body
    assert_maps_of(built, source, torch.randn(1, 3, 64, 64))
    with pytest.raises(ValueError, match=r"d2\.pth was trained with share_w False \(MODEL.VIT.MSVIT.SHARE_W\), not"):
        build_fpn_backbone(SMALL, img_size=64, share_w=True, checkpoint=tmp_path / "d2.pth")
    # The original release's layout holds no config: --config-file says how the model was trained.
    torch.save(original_release_checkpoint(source.state_dict()), tmp_path / "orig.pth")
    (tmp_path / "trained.yaml").write_text(
        f'MODEL:\n  VIT:\n    MSVIT:\n      ARCH: "{SMALL}"\n      LN_EPS: 0.1\n      ONLY_GLOBAL: True\n'
        "      SHARE_W: False\nINPUT:\n  IMAGE_SIZE: 64\n"
    )
    export(
        tmp_path / "orig.pth", tmp_path / "mmdet.pth", "--format", "mmdet", "--config-file", tmp_path / "trained.yaml"
    )
    assert torch.load(tmp_path / "mmdet.pth", weights_only=True)["meta"]["vil"]["options"] == info["options"]
    built = build_fpn_backbone(SMALL, img_size=64, level_norm=False, checkpoint=tmp_path / "mmdet.pth").body
    assert_maps_of(built, source, torch.randn(1, 3, 64, 64))
    # A --config-file of other options than those stored in the checkpoint is refused.
    (tmp_path / "other.yaml").write_text(f'MODEL:\n  VIT:\n    MSVIT:\n      ARCH: "{SMALL}"\n')
    status, _, error = run_tool(
        "export_backbone",
        tmp_path / "cls.pth",
        tmp_path / "x.pth",
        "--format",
        "mmdet",
        "--config-file",
        tmp_path / "other.yaml",
    )
    assert status == 1 and "cls.pth was trained with only_global True (MODEL.VIT.MSVIT.ONLY_GLOBAL), not False" in error
    assert not (tmp_path / "x.pth").exists()


@pytest.mark.parametrize("attention", ["performer", "srformer"])
def test_the_export_keeps_the_attention_mechanism_and_refuses_to_make_its_stages_local(tmp_path, attention):
    """A model of another attention than ViL's: its export stores the mechanism, which the backbone builder takes
    (the maps are the model's); turning full-attention stages into longformer ones, which would split its weights as
    full attention's, is refused in one sentence and writes nothing."""
    source, _ = small_checkpoint(tmp_path / "cls.pth", overrides=["MODEL.VIT.MSVIT.ATTN_TYPE", attention])
    printed = export(tmp_path / "cls.pth", tmp_path / "tv.pth", "--format", "torchvision")
    assert f"options attention '{attention}'" in printed
    built = build_fpn_backbone(SMALL, img_size=64, level_norm=False, checkpoint=tmp_path / "tv.pth").body
    assert built.model_options["attention"] == attention
    assert_maps_of(built, source, torch.randn(1, 3, 64, 64))
    with pytest.raises(ValueError, match=rf"tv\.pth was trained with attention '{attention}' .*, not 'longformer'"):
        build_fpn_backbone(SMALL, img_size=64, attention="longformer", checkpoint=tmp_path / "tv.pth")
    status, _, error = run_tool(
        "export_backbone", tmp_path / "cls.pth", tmp_path / "local.pth", "--format", "torchvision",
        "--full-attention-to-local",
    )  # fmt: skip
    assert status == 1 and f"this model's attention is {attention}" in error and "--full-attention-to-local" in error
    assert not (tmp_path / "local.pth").exists()
    status, _, error = run_tool("export_backbone", tmp_path / "tv.pth", tmp_path / "again.pth", "--format", "mmdet")
    assert status == 1 and "tv.pth is a backbone export already" in error and not (tmp_path / "again.pth").exists()
    with pytest.raises(ValueError, match=rf"attention is {attention}, whose weights are not full attention's"):
        build_fpn_backbone(SMALL, img_size=64, full_attention_to_local=True, checkpoint=tmp_path / "cls.pth")


def test_a_full_attention_model_becomes_a_longformer_backbone(tmp_path):
    """A model trained with ATTN_TYPE full: full_attention_to_local builds its backbone of longformer stages, each
    taking the full attention's query and key-value weights, where the export does so too."""
    source, _ = small_checkpoint(tmp_path / "cls.pth", overrides=["MODEL.VIT.MSVIT.ATTN_TYPE", "full"])
    built = build_fpn_backbone(SMALL, img_size=64, full_attention_to_local=True, checkpoint=tmp_path / "cls.pth").body
    assert built.model_options["attention"] == "longformer"
    export(tmp_path / "cls.pth", tmp_path / "tv.pth", "--format", "torchvision", "--full-attention-to-local")
    exported = {
        k.removeprefix("backbone.body."): v
        for k, v in torch.load(tmp_path / "tv.pth", weights_only=True)["model"].items()
    }
    for stage, dim in ((1, 16), (2, 32), (3, 32)):
        qkv = source.state_dict()[f"layer{stage}.1.attn.qkv.weight"]
        for state in (built.state_dict(), exported):
            torch.testing.assert_close(state[f"layer{stage}.1.attn.query.weight"], qkv[:dim])
            torch.testing.assert_close(state[f"layer{stage}.1.attn.kv_global.weight"], qkv[dim:])


def test_the_export_replaces_an_earlier_export_but_no_other_file(tmp_path):
    small_checkpoint(tmp_path / "cls.pth")
    shutil.copy(tmp_path / "cls.pth", tmp_path / "finetuned.pth")
    kept = (tmp_path / "finetuned.pth").read_bytes()
    status, _, error = run_tool(
        "export_backbone", tmp_path / "cls.pth", tmp_path / "finetuned.pth", "--format", "mmdet"
    )
    assert status == 1 and "finetuned.pth is a file that is not a backbone export" in error
    assert (tmp_path / "finetuned.pth").read_bytes() == kept
    export(tmp_path / "cls.pth", tmp_path / "tv.pth", "--format", "torchvision")
    export(tmp_path / "cls.pth", tmp_path / "tv.pth", "--format", "mmdet")  # again, in another layout
    assert "state_dict" in torch.load(tmp_path / "tv.pth", weights_only=True)


@pytest.mark.parametrize("fmt", ["torchvision", "mmdet"])
def test_an_export_for_another_image_size_loads_in_every_layout(tmp_path, fmt):
    """Exported for 96x128 (stage 3: a 6x8 map, an 11x15 table, which shows no square image size), built for 64x64
    (a 4x4 map): the table is resized from the stored size's map, in mmdetection's layout (size under "meta") too."""
    small_checkpoint(tmp_path / "cls.pth", arch=SMALL_RPB)
    export(tmp_path / "cls.pth", tmp_path / "out.pth", "--format", fmt, "--new-image-size", "96", "128")
    exported = torch.load(tmp_path / "out.pth", weights_only=True)
    container, prefix = ("state_dict", "backbone.") if fmt == "mmdet" else ("model", "backbone.body.")
    key = "layer3.1.attn.local_relative_position_bias_table"
    stored = exported[container][prefix + key]
    assert stored.shape == (11 * 15, 2)
    built = build_fpn_backbone(SMALL_RPB, img_size=64, checkpoint=tmp_path / "out.pth").body
    torch.testing.assert_close(built.get_parameter(key), resize_full_bias_table(stored, (6, 8), (4, 4)))


def test_sizes_below_the_stride_and_paths_taken_as_sizes_are_refused_in_one_sentence(tmp_path):
    small_checkpoint(tmp_path / "cls.pth")
    paths, layout = (tmp_path / "cls.pth", tmp_path / "out.pth"), ("--format", "torchvision")
    status, _, err = run_tool("export_backbone", *paths, *layout, "--new-image-size", "3")
    assert status == 1 and "3x3" in err and "total stride 16" in err and "16 or more" in err, err
    assert not (tmp_path / "out.pth").exists()
    status, _, err = run_tool("export_backbone", *layout, "--image-size", "64", *paths)
    assert status == 2 and "cls.pth" in err and "end its values with --" in err, err
    export(*layout, "--image-size", "64", "--", *paths)  # as the hint says


def test_a_model_trained_at_a_size_that_is_not_a_multiple_of_the_stride_exports(tmp_path):
    """At 72 pixels the model's stage-3 map is 4x4 (72 // 16, no padding): exported for 64x64 (also 4x4), its tables
    are the model's own, and the backbone computes the model's maps."""
    source, _ = small_checkpoint(tmp_path / "cls.pth", size=72)
    export(tmp_path / "cls.pth", tmp_path / "out.pth", "--format", "torchvision", "--new-image-size", "64")
    built = build_fpn_backbone(SMALL, img_size=64, level_norm=False, checkpoint=tmp_path / "out.pth").body
    assert_maps_of(built, source, torch.randn(1, 3, 64, 64))
    export(tmp_path / "cls.pth", tmp_path / "at72.pth", "--format", "torchvision")  # padded: a 5x5 map at 72
    assert torch.load(tmp_path / "at72.pth", weights_only=True)["vil"]["image_size"] == [72, 72]
    # With a bias table there, the export's table is the padded 5x5 map's, and a backbone at 64 resizes it so.
    small_checkpoint(tmp_path / "rpb.pth", size=72, arch=SMALL_RPB)
    export(tmp_path / "rpb.pth", tmp_path / "rpb72.pth", "--format", "torchvision")
    key = "layer3.1.attn.local_relative_position_bias_table"
    stored = torch.load(tmp_path / "rpb72.pth", weights_only=True)["model"]["backbone.body." + key]
    assert stored.shape == (9 * 9, 2)
    built = build_fpn_backbone(SMALL_RPB, img_size=64, checkpoint=tmp_path / "rpb72.pth").body
    torch.testing.assert_close(built.get_parameter(key), resize_full_bias_table(stored, (5, 5), (4, 4)))


def test_weights_that_are_not_finite_are_refused_by_the_export_the_builder_and_timm(tmp_path):
    import timm

    from vil.checkpoint import read_checkpoint

    small_checkpoint(tmp_path / "cls.pth")
    checkpoint = read_checkpoint(str(tmp_path / "cls.pth"))
    checkpoint["net"]["layer1.2.mlp.fc1.weight"][0, 0] = float("nan")
    torch.save(checkpoint, tmp_path / "nan.pth")
    status, _, error = run_tool("export_backbone", tmp_path / "nan.pth", tmp_path / "out.pth", "--format", "detectron2")
    assert status == 1 and "holds values that are not finite (NaN or infinite) in 1 tensors" in error
    assert "layer1.2.mlp.fc1.weight" in error and not (tmp_path / "out.pth").exists()
    with pytest.raises(ValueError, match=r"not finite .*layer1\.2\.mlp\.fc1\.weight"):
        build_fpn_backbone(SMALL, img_size=64, checkpoint=tmp_path / "nan.pth")
    with pytest.raises(ValueError, match=r"not finite .*layer1\.2\.mlp\.fc1\.weight"):
        timm.create_model(
            "vil_arch",
            arch=SMALL,
            img_size=64,
            pretrained=True,
            pretrained_cfg_overlay=dict(file=str(tmp_path / "nan.pth")),
        )
