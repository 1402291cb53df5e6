"""tools/export_backbone.py: classification checkpoints into torchvision, detectron2 and mmdet backbones; and
tools/export_onnx.py's output check and export at one image size."""

import re

import onnxruntime
import pytest
import torch
from test_checkpoint import original_release_checkpoint
from tool_runner import ROOT, load_tool, run_tool

import vil.models.attention
from vil.checkpoint import save_checkpoint
from vil.config import load_cfg
from vil.detection import ViLBackbone, build_fpn_backbone, export_state
from vil.export import export_onnx, export_program, onnx_model, onnx_outputs
from vil.model_config import build_model
from vil.models import PRESETS, MsViT, arch_string, parse_arch

export_backbone = load_tool("export_backbone")
# Two small architectures: the second has one more block in stage 2 and a wider stage 3.
TINY = arch_string(parse_arch("l1,h1,d16,p4,f2_l2,h1,d32,f2_l3,h2,d32,s0"))
OTHER = arch_string(parse_arch("l1,h1,d16,p4,f2_l2,h1,d32,n2,f2_l3,h2,d48,s0"))


def classification_model(arch, seed=0, size=64):
    """A classification model that pads its inputs as the detection backbone does, so that the two compute
    the same maps also on sizes that are not multiples of the stride."""
    torch.manual_seed(seed)
    return MsViT(arch, img_size=size, num_classes=10, dynamic_img_pad=True).eval()


def own_checkpoint(path, model):
    """This project's checkpoint, with the config that says the model's arch and image size."""
    overrides = ["MODEL.VIT.MSVIT.ARCH", arch_string(model.stage_specs), "INPUT.IMAGE_SIZE", str(model.img_size[0])]
    save_checkpoint(path, model, config=load_cfg(ROOT / "configs" / "vil_tiny.yaml", overrides).dump(), epoch=3)


def stage_maps(model, x):
    with torch.no_grad():
        return model.forward_intermediates(x, intermediates_only=True)


def assert_same_maps(backbone, source, x):
    with torch.no_grad():
        got = list(backbone(x).values())
    for a, b in zip(got, stage_maps(source, x), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "fmt,container,prefix",
    [
        ("torchvision", "model", "backbone.body."),
        ("detectron2", "model", "backbone.bottom_up."),
        ("mmdet", "state_dict", "backbone."),
    ],
)
def test_round_trip_reproduces_the_stage_outputs(tmp_path, fmt, container, prefix):
    source = classification_model(PRESETS["vil_tiny_rpb"])
    own_checkpoint(tmp_path / "cls.pth", source)
    export_backbone.main([str(tmp_path / "cls.pth"), str(tmp_path / "out.pth"), "--format", fmt])
    exported = torch.load(tmp_path / "out.pth", weights_only=True)
    keys = exported[container]
    assert all(k.startswith(prefix) for k in keys) and f"{prefix}layer1.0.proj.weight" in keys
    assert not any(k.startswith((prefix + "head.", prefix + "norm.")) for k in keys)
    info = exported["meta"]["vil"] if fmt == "mmdet" else exported["vil"]
    assert info == {"arch": PRESETS["vil_tiny_rpb"], "image_size": [64, 64]}
    # Loaded the way each framework would: strip its prefix, load strictly into the backbone.
    backbone = ViLBackbone(info["arch"], img_size=64, level_norm=False).eval()
    backbone.load_state_dict({k[len(prefix) :]: v for k, v in keys.items()})
    x = torch.randn(2, 3, 96, 80)
    assert_same_maps(backbone, source, x)
    # And through the backbone builder.
    built = build_fpn_backbone(
        "vil_tiny_rpb", img_size=64, level_norm=False, checkpoint=tmp_path / "out.pth"
    ).body.eval()
    assert_same_maps(built, source, x)


def test_original_release_checkpoint_with_arch_and_resized_tables(tmp_path):
    """The original release's format (no config inside: --arch); tables resized for 96x128 give the model
    the classification model computes on such images itself."""
    for name in ("vil_tiny", "vil_tiny_rpb"):
        source = classification_model(PRESETS[name])
        torch.save(original_release_checkpoint(source.state_dict()), tmp_path / "orig.pth")
        export_backbone.main(
            [
                str(tmp_path / "orig.pth"),
                str(tmp_path / "out.pth"),
                "--format",
                "detectron2",
                "--arch",
                name,
                "--new-image-size",
                "96",
                "128",
            ]
        )
        exported = torch.load(tmp_path / "out.pth", weights_only=True)
        assert exported["vil"]["image_size"] == [96, 128]
        backbone = ViLBackbone(PRESETS[name], img_size=(96, 128), level_norm=False).eval()
        backbone.load_state_dict({k.removeprefix("backbone.bottom_up."): v for k, v in exported["model"].items()})
        assert_same_maps(backbone, source, torch.randn(1, 3, 96, 128))


@pytest.mark.parametrize("name", ["vil_tiny", "vil_tiny_rpb"])
def test_full_attention_to_local_where_the_window_covers_the_map(tmp_path, name):
    """At 64x64 the full-attention stages' maps (4x4, 2x2) fit in one 7x7 chunk, so the converted longformer
    layers attend to exactly the keys full attention did, with the same biases: the same outputs."""
    source = classification_model(PRESETS[name])
    own_checkpoint(tmp_path / "cls.pth", source)
    export_backbone.main(
        [str(tmp_path / "cls.pth"), str(tmp_path / "out.pth"), "--format", "mmdet", "--full-attention-to-local"]
    )
    exported = torch.load(tmp_path / "out.pth", weights_only=True)
    arch = exported["meta"]["vil"]["arch"]
    assert all(spec.local for spec in parse_arch(arch))
    state = {k.removeprefix("backbone."): v for k, v in exported["state_dict"].items()}
    qkv = source.state_dict()["layer3.1.attn.qkv.weight"]
    torch.testing.assert_close(state["layer3.1.attn.query.weight"], qkv[:192])
    torch.testing.assert_close(state["layer3.1.attn.kv_global.weight"], qkv[192:])
    backbone = ViLBackbone(arch, img_size=64, level_norm=False).eval()
    backbone.load_state_dict(state)
    assert_same_maps(backbone, source, torch.randn(2, 3, 64, 64))
    # The backbone builder converts a classification checkpoint the same way.
    built = build_fpn_backbone(
        name, img_size=64, level_norm=False, full_attention_to_local=True, checkpoint=tmp_path / "cls.pth"
    )
    for key, value in built.body.state_dict().items():
        torch.testing.assert_close(value, state[key], msg=key)


@pytest.mark.parametrize("init", ["copy", "average"])
def test_number_of_global_tokens(tmp_path, init):
    arch = PRESETS["vil_tiny_rpb"].replace("g1", "g2")
    source = classification_model(arch)
    own_checkpoint(tmp_path / "cls.pth", source)
    export_backbone.main(
        [
            str(tmp_path / "cls.pth"),
            str(tmp_path / "out.pth"),
            "--format",
            "torchvision",
            "--num-global",
            "3",
            "--global-init",
            init,
        ]
    )
    exported = torch.load(tmp_path / "out.pth", weights_only=True)
    new_arch = exported["vil"]["arch"]
    assert [s.num_global for s in parse_arch(new_arch)] == [3, 3, 3, 0]
    state = {k.removeprefix("backbone.body."): v for k, v in exported["model"].items()}
    old = source.state_dict()
    tokens, g2g = old["layer2.0.cls_token"], old["layer3.1.attn.g2g_relative_position_bias"]
    g2l = old["layer1.1.attn.g2l_relative_position_bias"]  # (heads, 1, global tokens)
    if init == "copy":
        expected_tokens = tokens[:, [0, 1, 0]]
        expected_g2g = g2g[:, [0, 1, 0]][:, :, [0, 1, 0]]
        expected_g2l = g2l[:, :, [0, 1, 0]]
    else:
        expected_tokens = tokens.mean(1, keepdim=True).expand(-1, 3, -1)
        expected_g2g = g2g.mean((1, 2), keepdim=True).expand(-1, 3, 3)
        expected_g2l = g2l.mean(2, keepdim=True).expand(-1, -1, 3)
    torch.testing.assert_close(state["layer2.0.cls_token"], expected_tokens)
    torch.testing.assert_close(state["layer3.1.attn.g2g_relative_position_bias"], expected_g2g)
    assert g2l.shape == (2, 1, 2) and not torch.equal(g2l[..., 0], g2l[..., 1])
    torch.testing.assert_close(state["layer1.1.attn.g2l_relative_position_bias"], expected_g2l)
    ViLBackbone(new_arch, img_size=64).load_state_dict(state, strict=False)
    build_fpn_backbone(new_arch, img_size=64, checkpoint=tmp_path / "out.pth")  # strict apart from the new level norms
    # No global tokens at all.
    export_backbone.main(
        [str(tmp_path / "cls.pth"), str(tmp_path / "none.pth"), "--format", "torchvision", "--num-global", "0"]
    )
    none = torch.load(tmp_path / "none.pth", weights_only=True)
    assert [s.num_global for s in parse_arch(none["vil"]["arch"])] == [0, 0, 0, 0]
    assert not [key for key in none["model"] if "cls_token" in key or "g2g" in key or "g2l" in key]
    build_fpn_backbone(none["vil"]["arch"], img_size=64, checkpoint=tmp_path / "none.pth")


# --- Bad input: one plain sentence each. ---


def test_bad_export_requests(tmp_path, capsys):
    status, _, stderr = run_tool("export_backbone", "in.pth", "out.pth", "--format", "caffe")
    assert status == 2 and "argument --format: invalid choice: 'caffe' (choose from" in stderr
    source = classification_model(PRESETS["vil_tiny"])
    torch.save(original_release_checkpoint(source.state_dict()), tmp_path / "orig.pth")
    with pytest.raises(SystemExit) as exit_info:
        export_backbone.main([str(tmp_path / "orig.pth"), str(tmp_path / "out.pth"), "--format", "mmdet"])
    assert "does not say which architecture it holds; give --arch (a preset or arch string) or --config-file" in str(
        exit_info.value
    )
    assert not (tmp_path / "out.pth").exists()
    written = (tmp_path / "orig.pth").read_bytes()
    (tmp_path / "link.pth").symlink_to(tmp_path / "orig.pth")
    with pytest.raises(SystemExit) as exit_info:  # the output is the input: it would be lost
        export_backbone.main([str(tmp_path / "orig.pth"), str(tmp_path / "link.pth"), "--format", "mmdet"])
    assert f"{tmp_path / 'link.pth'} is the file it is made from, {tmp_path / 'orig.pth'}" in str(exit_info.value)
    assert (tmp_path / "orig.pth").read_bytes() == written
    # A position table that is no table, in a checkpoint whose tables tell its image size: one line, not an IndexError.
    damaged = original_release_checkpoint(source.state_dict())
    damaged["net"]["module.layer1.0.x_pos_embed"] = torch.zeros(())
    torch.save(damaged, tmp_path / "damaged.pth")
    with pytest.raises(SystemExit) as exit_info:
        export_backbone.main(
            [str(tmp_path / "damaged.pth"), str(tmp_path / "out.pth"), "--format", "mmdet", "--arch", "vil_tiny"]
        )
    assert re.match(
        r"error: Checkpoint .*damaged.pth holds layer1.0.x_pos_embed as torch.float32 of shape \(\),",
        str(exit_info.value),
    )
    with pytest.raises(ValueError, match=r"'onnx'.*torchvision, detectron2, mmdet"):
        export_state({}, "onnx", PRESETS["vil_tiny"], (224, 224))


def test_an_exported_backbone_loads_at_another_image_size(tmp_path):
    """The export stores its image size: a backbone built for another one takes its tables resized from it."""
    from vil.models.tables import resize_position_embedding

    own_checkpoint(tmp_path / "cls.pth", classification_model(PRESETS["vil_tiny"]))  # built at 64 x 64
    export_backbone.main(
        [
            str(tmp_path / "cls.pth"),
            str(tmp_path / "out.pth"),
            "--format",
            "torchvision",
            "--new-image-size",
            "96",
            "128",
        ]
    )
    exported = torch.load(tmp_path / "out.pth", weights_only=True)
    assert exported["vil"]["image_size"] == [96, 128]
    built = build_fpn_backbone(exported["vil"]["arch"], img_size=64, checkpoint=tmp_path / "out.pth")
    stored = exported["model"]["backbone.body.layer1.0.y_pos_embed"]  # 32 columns at 128 pixels
    torch.testing.assert_close(built.body.layer1[0].y_pos_embed, resize_position_embedding(stored, 16))


def _refusal(argv):
    """The sentence export_backbone exits with."""
    with pytest.raises(SystemExit) as exit_info:
        export_backbone.main([str(a) for a in argv])
    return str(exit_info.value)


@pytest.mark.parametrize("layout", ["bare", "original"])
def test_weights_of_another_architecture_are_refused(tmp_path, layout):
    """A checkpoint without a config, given --arch of another model: refused naming what does not fit, not written
    under that arch."""
    source = classification_model(TINY, size=32)
    state = source.state_dict()
    torch.save(state if layout == "bare" else original_release_checkpoint(state), tmp_path / "in.pth")
    error = _refusal([tmp_path / "in.pth", tmp_path / "out.pth", "--format", "detectron2", "--arch", OTHER])
    expected = MsViT(OTHER, img_size=32, num_classes=0).state_dict()
    missing = [key for key in expected if key not in state]  # stage 2's second block
    assert f"{len(missing)} missing: {missing[0]}" in error
    key = "layer3.0.proj.weight"
    assert f"{key} {tuple(state[key].shape)} vs {tuple(expected[key].shape)}" in error
    assert error.startswith("error: ") and str(tmp_path / "in.pth") in error
    assert not (tmp_path / "out.pth").exists()
    # The model's own arch exports it.
    export_backbone.main(
        [str(tmp_path / "in.pth"), str(tmp_path / "out.pth"), "--format", "detectron2", "--arch", TINY]
    )
    assert torch.load(tmp_path / "out.pth", weights_only=True)["vil"]["arch"] == TINY


def test_an_arch_other_than_the_stored_one_is_refused(tmp_path):
    own_checkpoint(tmp_path / "cls.pth", classification_model(TINY, size=32))
    common = [tmp_path / "cls.pth", tmp_path / "out.pth", "--format", "mmdet"]
    error = _refusal([*common, "--arch", OTHER])
    assert f"arch {TINY} " in error and f"not {OTHER} (--arch {OTHER})" in error
    tiny_preset = arch_string(parse_arch(load_cfg("vil_tiny").MODEL.VIT.MSVIT.ARCH))
    error = _refusal([*common, "--config-file", "vil_tiny"])
    assert f"arch {TINY} " in error and f"not {tiny_preset} (--config-file vil_tiny)" in error
    assert not (tmp_path / "out.pth").exists()
    # The stored arch, given again (written without the fields it leaves at their defaults), is accepted.
    export_backbone.main([*map(str, common), "--arch", "l1,h1,d16,p4,f2_l2,h1,d32,f2_l3,h2,d32,s0"])
    assert torch.load(tmp_path / "out.pth", weights_only=True)["meta"]["vil"] == {"arch": TINY, "image_size": [32, 32]}
    # A backbone built with another arch than the export's is refused naming the stored one (its keys listed before).
    with pytest.raises(ValueError, match=rf"holds a backbone of arch '{TINY}' .*not this model's '{OTHER}'"):
        build_fpn_backbone(OTHER, checkpoint=tmp_path / "out.pth", img_size=32)
    build_fpn_backbone(TINY, checkpoint=tmp_path / "out.pth", img_size=32)


# --- tools/export_onnx.py ---

export_onnx_tool = load_tool("export_onnx")


def test_export_onnx_checks_the_output_before_exporting(tmp_path, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the export started")

    monkeypatch.setattr(export_onnx_tool, "build_model", started)
    (tmp_path / "file").write_text("")
    output = tmp_path / "file" / "m.onnx"
    with pytest.raises(SystemExit) as exit_info:
        export_onnx_tool.main(["--config-file", "vil_digits", "--output", str(output)])
    assert str(exit_info.value).startswith("error: ") and f"{output} cannot be written" in str(exit_info.value)
    assert "not a folder" in str(exit_info.value)
    checkpoint = tmp_path / "weights.pth"
    checkpoint.write_bytes(b"the user's weights")
    with pytest.raises(SystemExit) as exit_info:  # the checkpoint the export reads: it would be lost
        export_onnx_tool.main(
            ["--config-file", "vil_digits", "--output", str(checkpoint), "MODEL.MODEL_PATH", str(checkpoint)]
        )
    assert f"{checkpoint} is the file it is made from" in str(exit_info.value)
    assert checkpoint.read_bytes() == b"the user's weights"
    # The same file named otherwise: a Hub folder's weights, and a path found under DATA.DATA_DIR.
    (tmp_path / "hub").mkdir()
    weights = tmp_path / "hub" / "model.safetensors"
    weights.write_bytes(b"the user's weights")
    for output, model_path in ((weights, tmp_path / "hub"), (checkpoint, "weights.pth")):
        with pytest.raises(SystemExit) as exit_info:
            export_onnx_tool.main(
                ["--config-file", "vil_digits", "--output", str(output), "MODEL.MODEL_PATH", str(model_path)]
                + ["DATA.DATA_DIR", str(tmp_path)]
            )
        assert f"{output} is the file it is made from" in str(exit_info.value)
        assert output.read_bytes() == b"the user's weights"


def test_export_onnx_exports_a_linformer_model_at_its_one_image_size(tmp_path, monkeypatch, capsys):
    """A linformer model takes only INPUT.IMAGE_SIZE: the tool exports at that size, not at a multiple of the
    stride it would round to (72 to 64, which the export then refused)."""
    asked = []

    def onnx_model(model, height, width, dynamic_size=True):
        asked.append((height, width, model.fixed_input_size))
        raise ValueError("stopped before the export")

    monkeypatch.setattr(export_onnx_tool, "onnx_model", onnx_model)
    arch = "l1,h1,d16,p4,f2_l2,h1,d32,f2_l3,h2,d32,s0"
    overrides = ["MODEL.VIT.MSVIT.ARCH", arch, "MODEL.VIT.MSVIT.ATTN_TYPE", "linformer", "INPUT.IMAGE_SIZE", "72"]
    with pytest.raises(SystemExit, match="stopped before the export"):
        export_onnx_tool.main(["--config-file", "vil_digits", "--output", str(tmp_path / "m.onnx"), *overrides])
    assert asked == [(72, 72, True)]
    assert "No MODEL.MODEL_PATH" in capsys.readouterr().out  # says the weights are the initial ones


def test_sw_exact_minus_one_exports_at_one_image_size(tmp_path):
    """Windows that wrap around the map (SW_EXACT -1, which differ from zero-padded ones at this size) export with
    ``--static``: the file takes only that size, any batch (the tool's second check runs another), and computes the
    PyTorch model's logits."""
    overrides = ["MODEL.VIT.MSVIT.ARCH", TINY, "INPUT.IMAGE_SIZE", "32", "MODEL.VIT.MSVIT.SW_EXACT", "-1"]

    def model(*more):
        torch.manual_seed(0)
        return build_model(load_cfg("vil_digits", overrides + list(more))).eval()

    wrapping, padded, unfold = (
        model(),
        model("MODEL.VIT.MSVIT.SW_EXACT", "0"),
        model("MODEL.VIT.MSVIT.ATTN_TYPE", "unfold"),
    )
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = wrapping(images)
        assert (want - padded(images)).abs().max() > 1e-5
    save_checkpoint(tmp_path / "ckpt.pth", wrapping, config=load_cfg("vil_digits", overrides).dump(), epoch=3)
    status, printed, error = run_tool(
        "export_onnx",
        "--config-file",
        "vil_digits",
        "--output",
        tmp_path / "m.onnx",
        "--static",
        *overrides,
        "MODEL.MODEL_PATH",
        tmp_path / "ckpt.pth",
    )
    assert status == 0, error
    assert printed.count("32x32: largest difference from PyTorch") == 2 and "No MODEL.MODEL_PATH" not in printed
    shape = onnxruntime.InferenceSession(str(tmp_path / "m.onnx")).get_inputs()[0].shape
    assert shape[1:] == [3, 32, 32] and not isinstance(shape[0], int)
    torch.testing.assert_close(onnx_outputs(tmp_path / "m.onnx", images), want, atol=1e-6, rtol=0)
    # The trace left no fake tensors in the op layer's window tables for that size: the unfold backends, whose
    # computation the file records, still compute the model eagerly.
    with torch.no_grad():
        torch.testing.assert_close(unfold(images), want)


def test_an_exported_program_takes_sizes_on_both_sides_of_the_written_out_scores_limit(monkeypatch):
    """On the CPU a head with few scores has them written out, others go to scaled_dot_product_attention: an
    export must not turn that choice into a guard on the image size."""
    monkeypatch.setattr(vil.models.attention, "WRITTEN_OUT_SCORES", 100)  # 32x32 under it, 96x96 over it
    torch.manual_seed(0)
    model = MsViT(TINY, img_size=64, num_classes=5).eval()
    program = export_program(model, 32, 32)
    for side in (32, 96):
        images = torch.randn(1, 3, side, side)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(images), model(images))


def test_a_program_of_standard_operators_holds_no_operator_of_the_op_layer():
    """The default program calls the op layer's operators (Python custom operators: it needs vil imported where it
    runs); with standard_operators it holds none of them and computes the same logits."""
    torch.manual_seed(0)
    model = MsViT(TINY, img_size=64, num_classes=5).eval()
    images = torch.randn(2, 3, 64, 64)
    for standard, expected in ((False, True), (True, False)):
        program = export_program(model, 64, 64, standard_operators=standard)
        graphs = [m.graph for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
        namespaces = {getattr(node.target, "namespace", None) for graph in graphs for node in graph.nodes}
        assert ("vil" in namespaces) is expected, namespaces
        with torch.no_grad():
            torch.testing.assert_close(program.module()(images), model(images))


@pytest.mark.parametrize("window", [1, 3])
def test_the_window_tables_of_symbolic_sizes_are_those_of_a_chunk_whose_neighbours_are_all_in_the_map(window):
    """A program of standard operators for any size builds its window tables as those of a chunk with all nine
    neighbours, for every neighbour mode (-1: its own chunk only; 1..8: one neighbour): the middle chunk's of a map of
    3x3 chunks, as the eager op computes them."""
    from vil.ops.backends.unfold import _inner_chunk_tables
    from vil.ops.geometry import unfolded_window_tables

    for mode in range(-1, 9):
        symbolic = _inner_chunk_tables(window, 0, mode, torch.device("cpu"))
        allowed, bias_index = unfolded_window_tables(3 * window, 3 * window, window, 0, mode, torch.device("cpu"))
        assert torch.equal(symbolic[0][0, 0], allowed[1, 1]) and torch.equal(symbolic[1], bias_index), mode


def test_a_program_of_standard_operators_with_cyclic_windows_takes_one_image_size():
    """Cyclic windows (SW_EXACT -1) need a fixed map size: a program of standard operators for any size is refused
    naming dynamic_size=False, and with it the program computes the model's logits for any batch."""
    torch.manual_seed(0)
    model = MsViT(TINY, img_size=32, num_classes=5, sw_exact=-1).eval()
    with pytest.raises(ValueError, match=r"SW_EXACT -1 .*dynamic_size=False in vil.export.export_program"):
        export_program(model, 32, 32, standard_operators=True)
    program = export_program(model, 32, 32, standard_operators=True, dynamic_size=False)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(images), model(images))


def test_exporting_leaves_the_model_in_the_mode_it_was_in():
    """A model exported in the middle of training trains on afterwards (dropout, drop-path, MODE > 0 draws), and
    one refused by the export keeps its mode too."""
    model = MsViT(TINY, img_size=64, num_classes=5).train()
    export_program(model, 64, 64)
    assert model.training
    with pytest.raises(ValueError):
        export_program(model, model.total_stride, 64)
    assert model.training
    model.eval()
    export_program(model, 64, 64)
    assert not model.training


def test_an_export_below_twice_the_stride_is_refused():
    model = MsViT(TINY, img_size=64, num_classes=5).eval()
    stride = model.total_stride
    with pytest.raises(ValueError, match=f"multiple of the model's total stride {stride} and at least {2 * stride}"):
        export_program(model, stride, 2 * stride)


@pytest.mark.parametrize(
    "last_stage,global_tokens",
    [("s0", "drop"), ("s0,a0", "drop"), ("s0", "average")],
    ids=["position_embedding", "relative_bias", "global_tokens_averaged"],
)
def test_a_padding_detection_backbone_exports_for_sizes_that_are_not_multiples_of_its_stride(last_stage, global_tokens):
    """Its patch embeddings pad each image to a multiple of their patch size: the program takes any size from twice
    the stride, the padding computed from the size (declared as multiples of the stride, it had dropped out of the
    graph, and other sizes failed inside the program). Two heads in the first stage, as every preset has: the
    attention's q, k, v are then strided views whose layout torch had decided by a guard on the size. A last stage
    of full attention with relative bias (the _rpb presets'): its bias had been a view torch could not prove for
    every padded size. The global tokens' mean added to the maps: added to the permuted map, it left a guard on the
    map's strides that torch could not prove."""
    torch.manual_seed(0)
    arch = f"l1,h2,d16,p4,f2_l2,h1,d32,f2_l3,h2,d32,{last_stage}"
    backbone = ViLBackbone(arch, img_size=64, global_tokens=global_tokens).eval()
    program = export_program(backbone, 64, 64)
    for size in ((70, 70), (50, 33), (97, 131)):
        images = torch.randn(1, 3, *size)
        with torch.no_grad():
            want = backbone(images)
            got = program.module()(images)
        assert [tuple(got[name].shape[2:]) for name in want] == [tuple(m.shape[2:]) for m in want.values()]
        for name in want:
            torch.testing.assert_close(got[name], want[name])
    with pytest.raises(ValueError, match=r"at least 32 on each side, got 30x64"):
        export_program(backbone, 30, 64)


def test_a_padding_model_whose_last_stage_has_patches_of_one_position_exports_for_any_size():
    """A patch of one position never pads: padding the previous stage's map (a permuted view) by a symbolic zero left
    torch.export a guard on its strides that it could not prove for every size, and the export failed whatever the
    trace size."""
    torch.manual_seed(0)
    model = MsViT("l1,h1,d8,p2,f2_l2,h1,d8,p2,f2_l3,h1,d8,p1,f1,s1", img_size=32, num_classes=3, dynamic_img_pad=True)
    program = export_program(model.eval(), 29, 44)
    for size in ((29, 44), (32, 32), (35, 9)):
        images = torch.randn(2, 3, *size)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(images), model(images))


def test_programs_of_standard_operators_take_sizes_whether_or_not_the_maps_fill_their_chunks():
    """The decomposition sliced each chunked map out of its padded chunks: a view that is contiguous exactly where
    the map fills them, which torch.export kept as a guard on the size. Traced at 32x24 the program of standard
    operators refused every other size in that guard; traced at 32x16, where the last stage has one chunk per side,
    the check of the sizes taken missed it, and the ONNX file stopped in onnxruntime's Reshape at 24x24. The map's
    rows and columns are now gathered: the program takes every size at which each chunked stage has two chunks per
    side (torch's decomposition of F.unfold guards against one), the ONNX file every size, and a trace at 32x16 is
    refused in one sentence naming a size that works."""
    torch.manual_seed(0)
    arch = "l1,h1,d2,n1,s0,g1,p2,f2,a1_l2,h1,d6,n1,s1,g1,p2,f3,a0_l3,h1,d4,n2,s1,g2,p1,f5,a1_l4,h3,d12,n1,g0,p2,f2,a0"
    model = MsViT(arch, img_size=32, num_classes=3).eval()
    program = export_program(model, 32, 24, standard_operators=True)
    for size in ((24, 24), (40, 48), (56, 40)):
        images = torch.randn(2, 3, *size)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(images), model(images), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"Traced at 32x16, .* one chunk per side.*export at 32x24 or larger"):
        onnx_model(model, 32, 16)


def test_a_model_of_total_stride_one_exports_with_its_operators_and_refuses_standard_ones_in_one_sentence():
    """Every stage with patch size 1: torch takes the sides as they are rather than narrowing them, and stopped the
    standard operators' trace in its own UserError, on guards it cannot prove for every size."""
    torch.manual_seed(0)
    model = MsViT("l1,h1,d6,p1,f2,a0_l2,h1,d4,p1,f3,a0_l3,h1,d6,p1,f3", img_size=16, num_classes=3).eval()
    with pytest.raises(ValueError, match=r"cannot prove .* traced at 16x16 .*--static.*without standard_operators"):
        onnx_model(model, 16, 16)
    program = export_program(model, 16, 16)
    images = torch.randn(1, 3, 11, 20)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(images), model(images))


def test_features_only_models_and_backbones_export_with_their_maps_named():
    """timm's features_only wrapper exports like the model it holds (it had no sizes of its own to read), and an
    ONNX file of maps names them map0, map1, ... (they were named logits and the graph's node names)."""
    import timm
    from onnx import load_from_string

    from vil.export import onnx_model

    torch.manual_seed(0)
    features = timm.create_model("vil_arch", arch=TINY, features_only=True, img_size=64).eval()
    program = export_program(features, 64, 64)
    images = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        for got, want in zip(program.module()(images), features(images), strict=True):
            torch.testing.assert_close(got, want)
    full_attention = "l1,h1,d16,p4,s0_l2,h1,d16,s0_l3,h1,d16,s0"  # a quicker export: no local attention to record
    backbone = ViLBackbone(full_attention, img_size=64).eval()
    data = onnx_model(backbone, 64, 64)
    assert [output.name for output in load_from_string(data).graph.output] == ["map0", "map1", "map2"]
    # onnx_outputs gives every map, in float32 from float64 images too, and empty ones for an empty batch.
    for images in (torch.randn(2, 3, 64, 96, dtype=torch.float64), torch.randn(0, 3, 64, 64)):
        with torch.no_grad():
            want = list(backbone(images.float()).values())
        got = onnx_outputs(data, images)
        assert [m.shape for m in got] == [m.shape for m in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for images, named in (
        (torch.randn(3, 64, 64), r"shape \(N, 3, H, W\), got \(3, 64, 64\)"),
        (torch.randn(1, 1, 64, 64), r"shape \(N, 3, H, W\), got \(1, 1, 64, 64\)"),
        (torch.zeros(1, 3, 64, 64, dtype=torch.uint8), r"floating-point images \(float32\), got torch.uint8"),
    ):
        with pytest.raises(ValueError, match=named):
            onnx_outputs(data, images)
    with pytest.raises(ValueError, match=r"takes a ViL model .*got Linear"):
        export_program(torch.nn.Linear(2, 2), 64, 64)
    import timm

    arch = "l1,h1,d16,n1,s1,g1,p4,f2,a0_l2,h1,d16,n1,s0,g1,p2,f2,a0_l3,h1,d16,n1,s0,g1,p2,f2,a0"
    hooked = timm.create_model("vil_arch", arch=arch, img_size=32, features_only=True, feature_cls="hook")
    with pytest.raises(ValueError, match=r"features_only model of one with feature_cls 'getter'.*got FeatureHookNet"):
        export_program(hooked, 64, 64)


def test_a_spatial_reduction_model_exports_from_the_least_size_it_takes():
    """Stage 2 reduces its map by 4 (stride 8): images from 64 on give its instance norm 2x2 positions. The file
    records 64 as its least side, and the program declares it, where both declared twice the stride (32), at which
    the model refuses images and the file computed numbers all the same."""
    from onnx import load_from_string

    torch.manual_seed(0)
    model = MsViT("l1,h1,d16,p4,f2_l2,h1,d32,f4_l3,h2,d32,s0", img_size=64, num_classes=3, attention="srformer").eval()
    assert model.least_image_side == 64
    data = onnx_model(model, 64, 64)
    recorded = {p.key: p.value for p in load_from_string(data).metadata_props}
    assert recorded["vil.image_side_least"] == "64" and recorded["vil.image_side_step"] == "16"
    images = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        torch.testing.assert_close(onnx_outputs(data, images), model(images), atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="needs at least 2 positions"):
            model(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"multiples of 16 from 64 up, not 32x48"):
        onnx_outputs(data, torch.randn(1, 3, 32, 48))
    with pytest.raises(ValueError, match=r"at least 64 on each side, got 48x48"):
        export_program(model, 48, 48)


# A chunked local stage 3 (stride 16, chunks of 5): at 64x64 its 4x4 map is one chunk per side, from 96 two. (Full
# attention before it: the export takes half the time.)
ONE_CHUNK = "l1,h1,d16,p4,s0,g0,a1_l2,h1,d16,s0,g0,a1_l3,h1,d16,s1,g0,f5,a1"


def test_the_trace_size_a_refusal_names_gives_a_file_for_any_size(tmp_path):
    """At 64 torch narrows the sizes to the traced one's chunk count (ONNX keeps no such guard, and onnxruntime
    failed on larger images): the refusal (tested with the tool below) names 96, which gives a file for any size."""
    torch.manual_seed(0)
    model = MsViT(ONE_CHUNK, img_size=64, num_classes=5).eval()
    export_onnx(model, tmp_path / "m.onnx", 96, 96)
    for height, width in ((32, 32), (80, 96), (128, 160)):  # one chunk per side, then two, then more
        images = torch.randn(1, 3, height, width)
        with torch.no_grad():
            torch.testing.assert_close(onnx_outputs(tmp_path / "m.onnx", images), model(images), atol=1e-5, rtol=0)
    # Sizes the file does not take are refused by the sizes it records, before onnxruntime fails inside the graph.
    for height, width in ((50, 64), (16, 64), (64, 40), (64, 16)):
        with pytest.raises(ValueError, match=rf"multiples of 16 from 32 up, not {height}x{width}"):
            onnx_outputs(tmp_path / "m.onnx", torch.randn(1, 3, height, width))
    export_onnx(model, tmp_path / "fixed.onnx", 96, 64, dynamic_size=False)  # height 96, width 64
    images = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        torch.testing.assert_close(onnx_outputs(tmp_path / "fixed.onnx", images), model(images), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"takes 96x64 images only, not 64x96"):
        onnx_outputs(tmp_path / "fixed.onnx", torch.randn(1, 3, 64, 96))


def test_export_onnx_tool_writes_only_a_file_that_passes_its_check(tmp_path, monkeypatch):
    """A refused trace size and an onnxruntime failure each end in one ``error:`` line and leave the output as it
    was (and no temporary file beside it)."""
    output = tmp_path / "m.onnx"
    output.write_text("the previous file")

    def failure(arch, size):
        with pytest.raises(SystemExit) as exit_info:
            export_onnx_tool.main(
                ["--config-file", "vil_digits", "--output", str(output), "MODEL.VIT.MSVIT.ARCH", arch]
                + ["INPUT.IMAGE_SIZE", str(size)]
            )
        error = str(exit_info.value)
        assert error.startswith("error: ") and "\n" not in error, error
        assert output.read_text() == "the previous file" and list(tmp_path.iterdir()) == [output]
        return error

    # The size given is named, not its multiple of the stride (16) that the export would trace at.
    error = failure(TINY, 20)
    assert re.search(r"INPUT.IMAGE_SIZE 20 .* at 16 .* stride 16.* at least 32; set INPUT.IMAGE_SIZE to 32", error)
    error = failure(ONE_CHUNK, 64)
    assert re.search(r"Traced at 64x64.* at most 80x80 .* export at 96x96 or larger", error), error
    monkeypatch.setattr(export_onnx_tool, "onnx_model", lambda *args, **kwargs: _file_of_one_input_shape())
    assert "onnxruntime cannot run the exported file at 32x32 (" in failure(TINY, 32)

    # Logits that differ from the model's, or that are not numbers, fail the check at the first size.
    def constant_logits(value):
        return lambda path, images: torch.full((images.shape[0], 10), value)

    for value, said in ((0.0, r"by \d\.\d\de-0[0-3], more than 0.0001"), (float("nan"), "by nan, more than 0.0001")):
        monkeypatch.setattr(export_onnx_tool, "onnx_outputs", constant_logits(value))
        assert re.search(f"at 32x32 the ONNX file's logits differ from the model's {said}", failure(TINY, 32))


def _file_of_one_input_shape():
    """The bytes of an ONNX file that takes only 1 x 3 x 8 x 8 images (onnxruntime refuses others)."""
    from onnx import TensorProto, helper

    shape = [1, 3, 8, 8]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["images"], ["logits"])],
        "one_shape",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
