"""The backbone at any input size, its multi-scale features, and torchvision's detectors on top of it."""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

import vil.models.attention as attention
import vil.models.msvit as msvit
from vil.checkpoint import save_checkpoint
from vil.config import load_cfg
from vil.detection import BACKBONE_OPTIONS, ViLBackbone, build_fpn_backbone, export_state, load_backbone_checkpoint
from vil.model_config import build_model, model_kwargs
from vil.models import PRESETS, MsViT, arch_string, parse_arch, stage_map_sizes
from vil.models.convert import resize_tables
from vil.models.tables import full_bias_to_local, resize_full_bias_table, resize_position_embedding


def test_position_embedding_interpolation_by_hand():
    table = torch.tensor([0.0, 2.0, 4.0]).view(1, 3, 1)
    assert resize_position_embedding(table, 3) is table
    # Linear, half-pixel centres: position p of 6 samples the old axis at (p + 0.5) / 2 - 0.5, clamped.
    expected = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.5, 4.0]).view(1, 6, 1)
    torch.testing.assert_close(resize_position_embedding(table, 6), expected)


def test_full_bias_table_resize_keeps_the_centre_and_local_conversion_keeps_offsets():
    torch.manual_seed(0)
    table = torch.randn(5 * 7, 2)  # a 3x4 map: row offsets -2..2, column offsets -3..3
    assert resize_full_bias_table(table, (3, 4), (3, 4)) is table
    grid = table.view(5, 7, 2)
    constant = torch.full((5 * 7, 2), 0.25)
    torch.testing.assert_close(resize_full_bias_table(constant, (3, 4), (6, 9)), torch.full((11 * 17, 2), 0.25))
    larger = resize_full_bias_table(table, (3, 4), (5, 6)).view(9, 11, 2)
    torch.testing.assert_close(larger[4, 5], grid[2, 3])  # offset (0, 0)
    local = full_bias_to_local(table, (3, 4), window=1).view(3, 3, 2)  # offsets -1..1 both ways, all present
    torch.testing.assert_close(local, grid[1:4, 2:5])
    clamped = full_bias_to_local(table, (3, 4), window=2).view(7, 7, 2)  # offsets -3..3: rows beyond +-2 clamped
    torch.testing.assert_close(clamped[0], grid[0])
    torch.testing.assert_close(clamped[3], grid[1 + 1])


def test_full_bias_table_resize_is_bicubic_by_hand():
    """A 1x3 map's table (one row of offsets -2..2) for a 1x5 map (offsets -4..4): along the columns, position p
    samples the old offsets at x = (p + 0.5) * 5/9 - 0.5, from the four columns around it (clamped at the ends),
    weighted by the cubic convolution kernel with a = -0.75 (torch's and OpenCV's bicubic)."""
    values = [0.0, 1.0, 4.0, 2.0, -3.0]

    def kernel(d, a=-0.75):
        d = abs(d)
        return (a + 2) * d**3 - (a + 3) * d**2 + 1 if d <= 1 else a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a

    expected = []
    for p in range(9):
        x = (p + 0.5) * 5 / 9 - 0.5
        left = math.floor(x)
        taps = range(left - 1, left + 3)
        expected.append(sum(kernel(x - i) * values[min(max(i, 0), 4)] for i in taps))
    got = resize_full_bias_table(torch.tensor(values).view(5, 1), (1, 3), (1, 5))
    torch.testing.assert_close(got.flatten(), torch.tensor(expected))


@pytest.mark.parametrize("name", ["vil_tiny", "vil_tiny_rpb"])
@pytest.mark.parametrize("pad", [False, True])
def test_odd_sizes_through_every_stage(name, pad):
    torch.manual_seed(0)
    model = MsViT(PRESETS[name], img_size=64, num_classes=3, dynamic_img_pad=pad).eval()
    for size in [(33, 45), (97, 131), (64, 64), (47, 160)]:
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            maps = model.forward_intermediates(x, intermediates_only=True)
            logits = model(x)
        assert [m.shape[-2:] for m in maps] == stage_map_sizes(model.stage_specs, size, pad)
        rounded = (lambda n, r: -(-n // r)) if pad else (lambda n, r: n // r)
        assert [m.shape[-2:] for m in maps] == [(rounded(size[0], r), rounded(size[1], r)) for r in (4, 8, 16, 32)]
        assert torch.isfinite(logits).all()
    if pad:  # an image padded with zeros to the first patch size by hand gives the same outputs
        x = torch.randn(1, 3, 33, 45)
        with torch.no_grad():
            torch.testing.assert_close(model(x), model(F.pad(x, (0, 3, 0, 3))))


def test_training_size_uses_the_tables_as_they_are_and_other_sizes_equal_a_model_built_for_them(monkeypatch):
    """At its own size the model never interpolates; at another size it equals a model built for that size
    whose tables were resized once (both ways use the same interpolation)."""
    torch.manual_seed(0)
    for name in ("vil_tiny", "vil_tiny_rpb"):
        model = MsViT(PRESETS[name], img_size=64, num_classes=3).eval()
        bigger = MsViT(PRESETS[name], img_size=(96, 128), num_classes=3).eval()
        bigger.load_state_dict(resize_tables(model.state_dict(), model.stage_specs, (64, 64), (96, 128)))
        x = torch.randn(2, 3, 96, 128)
        with torch.no_grad():
            torch.testing.assert_close(model(x), bigger(x))
    # At 64x64 every resize is asked for the size the table already has, so it returns the table itself.
    sizes = []
    resize_embedding, resize_table = msvit.resize_position_embedding, attention.resize_full_bias_table

    def recording_embedding(table, length):
        sizes.append((table.shape[1], length))
        return resize_embedding(table, length)

    def recording_table(table, old_map, new_map):
        sizes.append((old_map, new_map))
        return resize_table(table, old_map, new_map)

    monkeypatch.setattr(msvit, "resize_position_embedding", recording_embedding)
    monkeypatch.setattr(attention, "resize_full_bias_table", recording_table)
    for name in ("vil_tiny", "vil_tiny_rpb"):
        MsViT(PRESETS[name], img_size=64)(torch.randn(1, 3, 64, 64))
    assert len(sizes) == 4 * 2 + 10 and all(old == new for old, new in sizes)  # 4 stages x 2 axes, 10 full layers


def test_multi_scale_features_options():
    torch.manual_seed(0)
    arch = PRESETS["vil_tiny"].replace("g0", "g2")
    plain = ViLBackbone(arch, img_size=64, level_norm=False).eval()
    normed = ViLBackbone(arch, img_size=64, level_norm=True).eval()
    averaged = ViLBackbone(arch, img_size=64, level_norm=False, global_tokens="average").eval()
    normed.load_state_dict(plain.state_dict(), strict=False)
    averaged.load_state_dict(plain.state_dict())
    assert plain.out_channels_list == [48, 96, 192, 384]
    tokens = {}
    for spec in plain.stage_specs:
        getattr(plain, f"layer{spec.index}").register_forward_hook(
            lambda m, i, out, k=spec.index: tokens.__setitem__(k, out[0])
        )
    x = torch.randn(2, 3, 70, 90)
    with torch.no_grad():
        maps, with_norm, with_average = plain(x), normed(x), averaged(x)
    assert list(maps) == ["0", "1", "2", "3"]
    for (key, m), spec in zip(maps.items(), plain.stage_specs):
        G = spec.num_global
        local = tokens[spec.index][:, G:].transpose(1, 2).reshape(m.shape)
        torch.testing.assert_close(m, local)
        mean = tokens[spec.index][:, :G].mean(1)[:, :, None, None]
        torch.testing.assert_close(with_average[key], m + mean)
        ln = F.layer_norm(m.permute(0, 2, 3, 1), (m.shape[1],), eps=1e-6).permute(0, 3, 1, 2)
        torch.testing.assert_close(with_norm[key], ln)
    assert not hasattr(ViLBackbone(arch, img_size=64, out_indices=(0, 1)), "layer3")


def test_frozen_stages_get_no_gradients_and_stay_in_eval_mode():
    body = build_fpn_backbone("vil_tiny", trainable_stages=np.int64(2), img_size=64).body  # numpy's too
    assert body.frozen_stages == 2 and type(body.frozen_stages) is int
    frozen = [n for n, p in body.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("layer1.", "layer2.")) for n in frozen)
    assert all(p.requires_grad for n, p in body.named_parameters() if n.startswith(("layer3.", "layer4.")))
    body.train()
    assert not body.layer1.training and not body.layer2.training and body.layer3.training


def _target(height, width, boxes, labels):
    boxes = torch.tensor(boxes, dtype=torch.float32)
    masks = torch.zeros(len(boxes), height, width, dtype=torch.uint8)
    for mask, (x0, y0, x1, y1) in zip(masks, boxes.int().tolist()):
        mask[y0:y1, x0:x1] = 1
    return dict(boxes=boxes, labels=torch.tensor(labels), masks=masks)


def test_mask_rcnn_trains_and_detects_on_odd_image_sizes():
    torch.manual_seed(0)
    backbone = build_fpn_backbone("vil_tiny", trainable_stages=3)
    model = MaskRCNN(backbone, num_classes=3, min_size=320, max_size=480)
    images = [torch.rand(3, 333, 457), torch.rand(3, 400, 300)]
    targets = [
        _target(333, 457, [[10, 20, 200, 150], [220, 100, 440, 320]], [1, 2]),
        _target(400, 300, [[30, 40, 250, 380]], [2]),
    ]
    model.train()
    losses = model(images, targets)
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    body = backbone.body
    assert body.layer1[0].proj.weight.grad is None  # frozen
    for name in (
        "layer2.0.proj.weight",
        "layer2.1.attn.query.weight",
        "layer3.1.attn.qkv.weight",
        "layer4.0.proj.weight",
    ):
        grad = body.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    model.eval()
    with torch.no_grad():
        detections = model(images)
    assert len(detections) == 2
    for det, image in zip(detections, images):
        assert set(det) == {"boxes", "labels", "scores", "masks"}
        assert det["masks"].shape[-2:] == image.shape[-2:]
        assert (det["boxes"][:, 2] <= image.shape[-1]).all() and (det["boxes"][:, 3] <= image.shape[-2]).all()


def test_faster_rcnn_and_retinanet_take_the_backbone():
    torch.manual_seed(0)
    images = [torch.rand(3, 161, 203)]
    faster = FasterRCNN(
        build_fpn_backbone("vil_tiny_rpb", img_size=64), num_classes=4, min_size=160, max_size=256
    ).eval()
    retina_backbone = build_fpn_backbone("vil_tiny", out_indices=(1, 2, 3), extra_blocks=LastLevelP6P7(256, 256))
    retina = RetinaNet(retina_backbone, num_classes=4, min_size=160, max_size=256).eval()
    with torch.no_grad():
        for model in (faster, retina):
            (det,) = model(images)
            assert {"boxes", "labels", "scores"} <= set(det) and det["boxes"].shape[1] == 4


def test_a_three_stage_backbone_detects_with_the_anchors_and_pooling_the_readme_gives():
    """Four maps ("0", "1", "2", "pool"): torchvision's default anchors (five maps) and RoI pooling (maps "0" to
    "3") do not fit; the README's generator and pooling do."""
    torch.manual_seed(0)
    backbone = build_fpn_backbone(load_cfg("vil_digits"), out_channels=64)
    images = [torch.rand(3, 64, 80)]
    with torch.no_grad():
        assert list(backbone(images[0][None])) == ["0", "1", "2", "pool"]
    anchors = AnchorGenerator(((16,), (32,), (64,), (128,)), ((0.5, 1.0, 2.0),) * 4)
    faster = FasterRCNN(
        backbone, num_classes=3, rpn_anchor_generator=anchors, box_roi_pool=MultiScaleRoIAlign(["0", "1", "2"], 7, 2),
        min_size=64, max_size=96,
    ).eval()  # fmt: skip
    with torch.no_grad():
        (det,) = faster(images)
    assert {"boxes", "labels", "scores"} <= set(det) and det["boxes"].shape[1] == 4
    with pytest.raises((AssertionError, ValueError, KeyError)), torch.no_grad():  # torchvision's defaults
        FasterRCNN(backbone, num_classes=3, min_size=64, max_size=96).eval()(images)


def test_fpn_backbone_from_a_config_and_a_classification_checkpoint(tmp_path):
    overrides = ["INPUT.IMAGE_SIZE", "64", "MODEL.VIT.MSVIT.ATTN_TYPE", "sliding_chunk_autograd"]
    cfg = load_cfg(Path(__file__).resolve().parents[1] / "configs" / "vil_tiny.yaml", overrides)
    torch.manual_seed(0)
    source = MsViT(cfg.MODEL.VIT.MSVIT.ARCH, img_size=64, num_classes=10).eval()
    save_checkpoint(tmp_path / "cls.pth", source, config=cfg.dump())
    backbone = build_fpn_backbone(cfg, checkpoint=tmp_path / "cls.pth", level_norm=False).eval()
    assert backbone.body.layer1[1].attn.backend == "sliding_chunk_autograd"
    x = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        for got, want in zip(backbone.body(x).values(), source.forward_intermediates(x, intermediates_only=True)):
            torch.testing.assert_close(got, want)


# --- Bad input: one plain sentence each. ---


def test_bad_backbone_input(tmp_path):
    backbone = build_fpn_backbone("vil_tiny", img_size=64)
    with pytest.raises(ValueError, match=r"20x64.*stride 32.*32x32"):
        backbone(torch.randn(1, 3, 20, 64))
    with pytest.raises(ValueError, match=r"\[0, 7\].*4 stages.*0..3"):
        build_fpn_backbone("vil_tiny", out_indices=(0, 7))
    for trainable, kept, out_indices in ((5, 4, None), (1.5, 4, None), (3, 2, (0, 1))):
        with pytest.raises(ValueError, match=rf"trainable_stages {trainable}.*0 to {kept}"):
            build_fpn_backbone("vil_tiny", img_size=64, trainable_stages=trainable, out_indices=out_indices)
    with pytest.raises(ValueError, match=r"out_channels.*got 0"):
        build_fpn_backbone("vil_tiny", img_size=64, out_channels=0)
    with pytest.raises(ValueError, match="'vil_huge' is neither a ViL preset"):
        build_fpn_backbone("vil_huge")
    save_checkpoint(tmp_path / "small.pth", MsViT(PRESETS["vil_small"], img_size=64))
    with pytest.raises(
        ValueError,
        match=r"layer1.0.cls_token \(1, 1, 96\) vs \(1, 1, 48\)",
    ):
        build_fpn_backbone("vil_tiny", img_size=64, checkpoint=tmp_path / "small.pth")


def test_a_padding_backbone_exports_and_compiles_for_sizes_that_are_not_multiples_of_its_patches(tmp_path):
    """The padding depends on the image size: it must stay a function of the size in the traced graph."""
    pytest.importorskip("onnxruntime")
    import onnxruntime

    # One local stage among full-attention ones: the padding is the patch embeddings', and the export is twice as fast.
    arch = "l1,h2,d32,n1,s0,g0,p4,a1_l2,h2,d32,n1,s1,g1,p2,f2,a1_l3,h2,d32,n1,s0,g0,p2,a1"
    torch.manual_seed(0)
    backbone = ViLBackbone(arch, img_size=32, out_indices=(0, 1, 2)).eval()

    class Maps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = backbone

        def forward(self, x):
            return tuple(self.backbone(x).values())

    height, width = torch.export.Dim("height", min=32, max=256), torch.export.Dim("width", min=32, max=256)
    with torch.no_grad():
        program = torch.onnx.export(
            Maps().eval(), (torch.randn(1, 3, 32, 32),), dynamo=True, dynamic_shapes=({2: height, 3: width},)
        )
    program.save(str(tmp_path / "backbone.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "backbone.onnx"), providers=["CPUExecutionProvider"])
    compiled = torch.compile(Maps(), backend="aot_eager")
    for size in ((45, 70), (50, 33)):  # traced at 32 x 32; compiled for any height and width at the first size
        x = torch.randn(1, 3, *size)
        if size == (45, 70):
            torch._dynamo.mark_dynamic(x, 2)
            torch._dynamo.mark_dynamic(x, 3)
        rows, cols, maps = -(-size[0] // 4), -(-size[1] // 4), []  # each stage pads to a multiple of its patch
        for _ in range(3):
            maps.append((rows, cols))
            rows, cols = -(-rows // 2), -(-cols // 2)
        with torch.no_grad():
            expected = Maps()(x)
            onnx_maps = session.run(None, {session.get_inputs()[0].name: x.numpy()})
            assert [tuple(m.shape[-2:]) for m in expected] == maps
            with torch._dynamo.config.patch(error_on_recompile=True):
                compiled_maps = compiled(x)
            for ours, theirs, compiled_map in zip(expected, onnx_maps, compiled_maps):
                torch.testing.assert_close(torch.from_numpy(theirs), ours, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(compiled_map, ours, rtol=1e-4, atol=1e-4)


def test_the_default_maps_are_every_stages_and_trainable_stages_count_those_kept():
    """A 3-stage architecture (the digits preset's) has 3 maps by default, for timm's features_only too; with
    out_indices (0, 1) the backbone keeps 2 stages, the last trainable_stages of which train."""
    import timm

    arch = "l1,h2,d32,n1,s1,g1,p4,f2,a0_l2,h2,d32,n1,s1,g1,p2,f2,a1_l3,h2,d32,n1,s0,g1,p2,f2,a0"
    maps = build_fpn_backbone(arch, img_size=64).body(torch.randn(1, 3, 64, 64))
    assert [tuple(m.shape[-2:]) for m in maps.values()] == [(16, 16), (8, 8), (4, 4)]
    features = timm.create_model("vil_arch", arch=arch, img_size=64, features_only=True)
    assert [f.shape[1] for f in features(torch.randn(1, 3, 64, 64))] == [32, 32, 32]
    body = build_fpn_backbone(arch, img_size=64, trainable_stages=1, out_indices=(0, 1)).body
    assert body.frozen_stages == 1 and not any(p.requires_grad for p in body.layer1.parameters())
    assert all(p.requires_grad for p in body.layer2.parameters())


# --- Checkpoints into backbones: stored options, pruned stages, training sizes, freezing. ---

# Three small stages (strides 4, 8, 16): an absolute position embedding in stage 1, relative biases after, full
# attention in stage 3.
SMALL = "l1,h1,d16,p4,f2,a1_l2,h1,d32,f2,a0_l3,h2,d32,s0,a0"


# Options that change what the same weights compute, none of them at its default.
TRAINED_OPTIONS = [
    "MODEL.VIT.MSVIT.LN_EPS",
    "0.1",
    "MODEL.VIT.MSVIT.ONLY_GLOBAL",
    "True",
    "MODEL.VIT.MSVIT.SHARE_W",
    "False",
]


def small_checkpoint(path, size=64, overrides=(), arch=SMALL):
    """This project's checkpoint of a model built from a config (its options and image size stored): the model, in
    eval mode, and the config."""
    cfg = load_cfg(overrides=["MODEL.VIT.MSVIT.ARCH", arch, "INPUT.IMAGE_SIZE", str(size), *overrides])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    save_checkpoint(path, model, config=cfg.dump())
    return model, cfg


def assert_maps_of(backbone, source, x):
    """The backbone's maps are the classification model's own stage outputs."""
    with torch.no_grad():
        got, want = list(backbone.eval()(x).values()), source.forward_intermediates(x, intermediates_only=True)
    assert len(got) <= len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_classification_checkpoint_builds_the_backbone_with_its_trained_options(tmp_path):
    source, cfg = small_checkpoint(tmp_path / "cls.pth", overrides=TRAINED_OPTIONS)
    assert set(BACKBONE_OPTIONS) <= set(model_kwargs(cfg)) and "ln_eps" in BACKBONE_OPTIONS
    x = torch.randn(1, 3, 64, 64)
    for name_or_cfg in (SMALL, cfg):
        built = build_fpn_backbone(name_or_cfg, img_size=64, level_norm=False, checkpoint=tmp_path / "cls.pth")
        assert built.body.model_options["ln_eps"] == 0.1 and built.body.model_options["share_w"] is False
        assert_maps_of(built.body, source, x)
    with pytest.raises(ValueError, match=r"trained with ln_eps 0\.1 \(MODEL\.VIT\.MSVIT\.LN_EPS\), not 1e-05;"):
        build_fpn_backbone(SMALL, img_size=64, ln_eps=1e-5, checkpoint=tmp_path / "cls.pth")
    default_cfg = load_cfg(overrides=["MODEL.VIT.MSVIT.ARCH", SMALL, "INPUT.IMAGE_SIZE", "64"])
    with pytest.raises(ValueError, match=r"only_global True \(MODEL.VIT.MSVIT.ONLY_GLOBAL\), not False, share_w"):
        build_fpn_backbone(default_cfg, checkpoint=tmp_path / "cls.pth")
    with pytest.raises(ValueError, match=r"share_w False \(MODEL.VIT.MSVIT.SHARE_W\), not True"):
        load_backbone_checkpoint(ViLBackbone(SMALL, img_size=64), tmp_path / "cls.pth", SMALL)


def test_a_classification_checkpoint_of_another_arch_is_refused_naming_both(tmp_path):
    """Another head count and window give weights of the same shapes: the arch the checkpoint's config stores tells
    them apart."""
    small_checkpoint(tmp_path / "cls.pth")
    other = SMALL.replace("l1,h1,d16,p4,f2", "l1,h4,d16,p4,f3")
    named = r"cls\.pth holds a model of arch l1,h1,d16,[^ ]* \(its stored config says so\), not l1,h4,d16,"
    with pytest.raises(ValueError, match=named):
        build_fpn_backbone(other, img_size=64, checkpoint=tmp_path / "cls.pth")
    with pytest.raises(ValueError, match=named):
        load_backbone_checkpoint(ViLBackbone(other, img_size=64), tmp_path / "cls.pth", other)


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("layer1.0.x_pos_embed", torch.zeros(1, 16, 8, dtype=torch.int32), r"layer1.0.x_pos_embed as torch.int32"),
        ("layer3.1.attn.qkv.bias", torch.zeros(()), r"layer3.1.attn.qkv.bias as torch.float32 of shape \(\)"),
        ("layer1.0.cls_token", torch.zeros(16), r"layer1.0.cls_token .* of shape \(16,\).* in 3 dimensions"),
    ],
    ids=["integer position table", "scalar projection", "flat global token"],
)
def test_tensors_the_conversions_cannot_take_are_one_sentence(tmp_path, key, value, named):
    """A position table to resize, a projection to split or global tokens to repeat that are not a ViL model's: one
    sentence naming the tensor (they stopped in the conversions with torch's errors)."""
    small_checkpoint(tmp_path / "cls.pth")
    checkpoint = torch.load(tmp_path / "cls.pth", weights_only=True)
    checkpoint["net"][key] = value
    torch.save(checkpoint, tmp_path / "changed.pth")
    conversions = dict(full_attention_to_local=True, num_global=2)
    body = ViLBackbone(arch_string([replace(s, local=True, num_global=2) for s in parse_arch(SMALL)]), img_size=48)
    with pytest.raises(ValueError, match=rf"changed.pth holds {named}.*use a checkpoint of a ViL model") as refusal:
        load_backbone_checkpoint(body, tmp_path / "changed.pth", SMALL, **conversions)
    assert "\n" not in str(refusal.value)


def test_an_exported_backbone_whose_weights_are_not_finite_is_refused_naming_a_tensor(tmp_path):
    """As a classification checkpoint is: in a shared weight (SHARE_W's query and query_global), NaN != NaN once
    made the check of shared tensors say that they differ."""
    source, _ = small_checkpoint(tmp_path / "cls.pth")
    for key in ("layer1.2.mlp.fc1.weight", "layer2.1.attn.query.weight"):
        state = {k: v.clone() for k, v in source.state_dict().items()}
        state[key][0, 0] = float("nan")
        if key.endswith("query.weight"):
            state[key.replace("query", "query_global")] = state[key]
        for fmt in ("torchvision", "mmdet"):
            torch.save(export_state(state, fmt, SMALL, (64, 64)), tmp_path / "nan.pth")
            with pytest.raises(ValueError, match=rf"nan.pth holds values that are not finite .* e.g. {key}"):
                build_fpn_backbone(SMALL, img_size=64, checkpoint=tmp_path / "nan.pth")
    body_state = {k: v for k, v in source.state_dict().items() if not k.startswith(("head.", "norm."))}
    exported = export_state(body_state, "torchvision", SMALL, (64, 64))
    exported["model"]["backbone.body.foo"] = 3  # not a tensor: named as a key this model does not have
    torch.save(exported, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match=r"odd.pth does not fit this model's architecture \(1 unexpected: foo\)"):
        build_fpn_backbone(SMALL, img_size=64, checkpoint=tmp_path / "odd.pth")


def test_a_backbone_of_fewer_stages_loads_the_stages_it_keeps(tmp_path):
    """out_indices that end before the last stage: the checkpoint's weights of the stages after it are left out,
    those of the stages kept are still all required."""
    source, _ = small_checkpoint(tmp_path / "cls.pth")
    state = {k: v for k, v in source.state_dict().items() if not k.startswith(("head.", "norm."))}
    torch.save(export_state(state, "torchvision", SMALL, (64, 64)), tmp_path / "export.pth")
    x = torch.randn(1, 3, 64, 64)
    for path in (tmp_path / "cls.pth", tmp_path / "export.pth"):
        body = build_fpn_backbone(SMALL, img_size=64, level_norm=False, out_indices=(0, 1), checkpoint=path).body
        assert not hasattr(body, "layer3") and [s.index for s in body.pruned_specs] == [3]
        assert_maps_of(body, source, x)
    del state["layer2.0.proj.weight"]
    torch.save(export_state(state, "torchvision", SMALL, (64, 64)), tmp_path / "partial.pth")
    with pytest.raises(ValueError, match=r"\(1 missing: layer2\.0\.proj\.weight\); use a checkpoint"):
        build_fpn_backbone(SMALL, img_size=64, out_indices=(0, 1), checkpoint=tmp_path / "partial.pth")


@pytest.mark.parametrize("pad", [False, True])
def test_a_checkpoint_trained_at_a_size_that_is_not_a_multiple_of_the_stride(tmp_path, pad):
    """At 72 pixels stage 3's map is 4x4 (72 // 16) without padding, 5x5 with: the tables are converted from the
    maps the model made them for, so that at 64 pixels (4x4, padded or not) the backbone computes the model's own
    maps, whose tables it then uses as they are."""
    overrides = ["MODEL.VIT.DYNAMIC_IMG_PAD", str(pad)]
    source, _ = small_checkpoint(tmp_path / "cls.pth", size=72, overrides=overrides)
    rows = source.state_dict()["layer3.1.attn.local_relative_position_bias_table"].shape[0]
    assert rows == (9 * 9 if pad else 7 * 7)
    body = build_fpn_backbone(SMALL, img_size=64, level_norm=False, checkpoint=tmp_path / "cls.pth").body
    assert_maps_of(body, source, torch.randn(1, 3, 64, 64))


def test_freeze_sets_each_stage_to_frozen_or_not():
    body = ViLBackbone(SMALL, img_size=32, frozen_stages=2)
    body.freeze(0)
    body.train()
    assert all(p.requires_grad for p in body.parameters())
    assert body.layer1.training and body.layer2.training
    body.freeze(1)
    assert not any(p.requires_grad for p in body.layer1.parameters()) and not body.layer1.training
    assert all(p.requires_grad for p in body.layer2.parameters()) and body.layer2.training
    body.eval().freeze(0)
    assert all(p.requires_grad for p in body.parameters()) and not body.layer1.training


def test_crafted_backbone_options_are_refused(tmp_path):
    state = ViLBackbone(SMALL, img_size=64).state_dict()
    exported = export_state(state, "mmdet", SMALL, (64, 64), {"ln_eps": 0.1})
    assert exported["meta"]["vil"]["options"] == {"ln_eps": 0.1}
    exported["meta"]["vil"]["options"] = {"ln_eps": "0.1", "depth": 3}
    torch.save(exported, tmp_path / "crafted.pth")
    with pytest.raises(ValueError, match=r"crafted\.pth stores the backbone options .* export the backbone again"):
        build_fpn_backbone(SMALL, img_size=64, checkpoint=tmp_path / "crafted.pth")
