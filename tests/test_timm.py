"""The presets as timm models: timm's model conventions, features_only, local checkpoint files."""

import numpy as np
import pytest
import timm
import torch
from test_checkpoint import original_release_checkpoint
from timm.models import group_parameters
from timm.models._manipulate import reinit_non_persistent_buffers

import vil  # noqa: F401  (registers the presets)
from vil.models import COMPARISONS, PRESETS, MsViT

NAMES = sorted([*PRESETS, *COMPARISONS, "vil_arch"])  # the presets, the attention comparison's models, any arch


def test_every_preset_is_registered_with_its_pretrained_cfg():
    assert sorted(timm.list_models("vil_*")) == NAMES
    for name in NAMES:
        cfg = timm.models.get_pretrained_cfg(name).to_dict()  # the default tag's
        if cfg.get("tag", "").endswith("_384"):  # the Base presets: published only as 384 fine-tunes on ImageNet-1K
            assert cfg["input_size"] == (3, 384, 384) and cfg["crop_pct"] == 0.922 and cfg["pool_size"] == (12, 12)
        else:
            assert cfg["input_size"] == (3, 224, 224) and cfg["crop_pct"] == 0.875
            assert cfg["pool_size"] == (7, 7)  # 224 / a total stride of 4 * 2 * 2 * 2
        assert cfg["interpolation"] == "bicubic" and cfg["num_classes"] == 1000
        assert cfg["mean"] == (0.485, 0.456, 0.406) and cfg["std"] == (0.229, 0.224, 0.225)
        assert cfg["first_conv"] == "layer1.0.proj" and cfg["classifier"] == "head"
        assert cfg["fixed_input_size"] == ("linformer" in name)  # linformer's projections fix the token count


@pytest.mark.parametrize("name", ["vil_tiny", "vil_small_rpb"])  # the others differ only in their arch strings
def test_timm_model_conventions(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7).eval()
    assert isinstance(model, MsViT) and model.stage_specs == MsViT(PRESETS[name], num_classes=0).stage_specs
    state = model.state_dict()
    assert "layer1.0.proj.weight" in state and "head.weight" in state
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        logits = model(x)
        tokens = model.forward_features(x)
        # timm's layout for a final map, as its Swin: NHWC, here 64x96 / 32 = 2x3 (the presets' last stage has g0).
        assert model.output_fmt == "NHWC" and logits.shape == (2, 7) and tokens.shape == (2, 2, 3, model.num_features)
        pooled = model.forward_head(tokens, pre_logits=True)
        torch.testing.assert_close(pooled, tokens.mean((1, 2)))
        torch.testing.assert_close(model.get_classifier()(pooled), logits)

        final, maps = model.forward_intermediates(x)
        torch.testing.assert_close(final, tokens)
        assert [m.shape[1:] for m in maps] == [
            (info["num_chs"], 64 // info["reduction"], 96 // info["reduction"]) for info in model.feature_info
        ]
        assert [info["reduction"] for info in model.feature_info] == [4, 8, 16, 32]
        # The last map is the last stage's tokens before the final norm.
        torch.testing.assert_close(model.norm(maps[-1].permute(0, 2, 3, 1)), tokens)
        nhwc = model.forward_intermediates(x, output_fmt="NHWC", intermediates_only=True)
        for got, want in zip(nhwc, maps):
            torch.testing.assert_close(got, want.permute(0, 2, 3, 1))

        model.reset_classifier(0)
        assert model(x).shape == (2, model.num_features)
        model.reset_classifier(0, "")
        torch.testing.assert_close(model(x), tokens)
        model.reset_classifier(3, "avg")
        assert model(x).shape == (2, 3) and model.num_classes == 3

    features = timm.create_model(name, features_only=True, out_indices=(0, 2)).eval()
    with torch.no_grad():
        maps = features(x)
    assert features.feature_info.channels() == [model.feature_info[i]["num_chs"] for i in (0, 2)]
    assert [m.shape for m in maps] == [
        (2, c, 64 // r, 96 // r) for c, r in zip(features.feature_info.channels(), (4, 16))
    ]

    groups = group_parameters(model, model.group_matcher())
    assert sum(len(g) for g in groups.values()) == len(list(model.parameters()))
    assert next(iter(groups.values())) == [n for n, _ in model.named_parameters() if n.startswith("layer1.0.")]
    # The final norm joins the last block (timm's (99999,)); the head, matched by nothing, comes last.
    assert list(groups.values())[-2][-2:] == ["norm.weight", "norm.bias"]
    assert list(groups.values())[-1] == ["head.weight", "head.bias"]
    # A later stage's patch embedding goes with its first layer, as timm groups Swin's downsampling.
    for stage in (2, 3, 4):
        (group,) = [g for g in groups.values() if f"layer{stage}.1.norm.weight" in g]
        assert f"layer{stage}.0.proj.weight" in group and f"layer{stage}.2.mlp.fc1.weight" in group
    assert (
        "layer1.0.cls_token" in model.no_weight_decay() and "layer1.1.attn.query.weight" not in model.no_weight_decay()
    )


@pytest.mark.parametrize("name", ["vil_tiny", "vil_tiny_rpb"])
def test_every_parameter_trains_and_grad_checkpointing_gives_the_same_gradients(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.0)
    x = torch.randn(2, 3, 64, 64)
    model(x).square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing()
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)


@pytest.mark.parametrize("name", ["vil_tiny_rpb", "vil_small_performer_partial"])
def test_device_and_dtype_as_timm_takes_them(name):
    """device="meta" builds without memory; the model then takes real weights and gives the outputs of one built
    on the CPU, timm's buffer hook restoring what no state dict holds."""
    torch.manual_seed(0)
    cpu = timm.create_model(name, img_size=64, num_classes=5).eval()
    meta = timm.create_model(name, img_size=64, num_classes=5, device="meta")
    assert {t.device.type for t in [*meta.parameters(), *meta.buffers()]} == {"meta"}
    meta.to_empty(device="cpu").load_state_dict(cpu.state_dict())
    assert reinit_non_persistent_buffers(meta) == ["(root)"]
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(meta.eval()(x), cpu(x), rtol=0, atol=0)
    assert {p.dtype for p in timm.create_model(name, img_size=64, dtype=torch.bfloat16).parameters()} == {
        torch.bfloat16
    }
    with pytest.raises(ValueError, match=r"meta device.*assign=True"):
        timm.create_model(name, pretrained=True, device="meta")


@pytest.mark.parametrize("name", ["vil_tiny", "vil_small_rpb"])
def test_features_only(name):
    torch.manual_seed(0)
    full = timm.create_model(name).eval()
    features = timm.create_model(name, features_only=True, out_indices=(1, -1)).eval()
    wanted = features.model.state_dict()
    assert set(wanted) == {k for k in full.state_dict() if not k.startswith(("norm.", "head."))}
    features.model.load_state_dict({k: v for k, v in full.state_dict().items() if k in wanted})
    assert features.feature_info.channels() == [full.feature_info[1]["num_chs"], full.feature_info[3]["num_chs"]]
    assert features.feature_info.reduction() == [8, 32]
    x = torch.randn(1, 3, 75, 100)
    with torch.no_grad():
        maps = features(x)
        expected = full.forward_intermediates(x, indices=[1, 3], intermediates_only=True)
    # The original's patch embeddings drop what does not fill a patch: floor(75 / 8) x floor(100 / 8), ...
    assert [m.shape for m in maps] == [
        (1, full.feature_info[1]["num_chs"], 9, 12),
        (1, full.feature_info[3]["num_chs"], 2, 3),
    ]
    for got, want in zip(maps, expected):
        torch.testing.assert_close(got, want)
    # The pruned model keeps only what the features need, and takes the images its stages take: from its last
    # stage's stride (8), not the whole model's (32).
    pruned = timm.create_model(name, features_only=True, out_indices=(0, 1)).eval()
    assert not hasattr(pruned.model, "layer3") and pruned.model.total_stride == 8
    with torch.no_grad():
        assert [m.shape[2:] for m in pruned(torch.randn(1, 3, 16, 24))] == [(4, 6), (2, 3)]


def test_weights_without_a_classifier_and_timms_checkpoints_give_the_class_count_they_hold(tmp_path):
    """A file without a classifier gives a model of num_classes=0, and one written by timm's train.py (its weights
    under "state_dict", its command line as an argparse.Namespace under "args") a model of its class count, each
    with the file's outputs."""
    import argparse

    args = argparse.Namespace(model="vil_tiny", lr=0.5, epochs=3, amp=False, mean=None, model_kwargs={}, decay=[30])
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    for classes in (0, 3):
        source = timm.create_model("vil_tiny", img_size=64, num_classes=classes).eval()
        state = source.state_dict()
        path = tmp_path / f"{classes}.pth"
        torch.save({"epoch": 3, "arch": "vil_tiny", "args": args, "state_dict": state, "state_dict_ema": state}, path)
        overlay = dict(file=str(path))
        loaded = timm.create_model("vil_tiny", img_size=64, pretrained=True, pretrained_cfg_overlay=overlay).eval()
        assert loaded.num_classes == classes
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), source(x), rtol=0, atol=0)


def test_original_release_checkpoint_through_pretrained_cfg_overlay(tmp_path):
    """``pretrained_cfg_overlay=dict(file=...)`` loads the original release's checkpoint format; at another
    image size the position tables are resized as the model itself interpolates them."""
    torch.manual_seed(0)
    for name in ("vil_tiny", "vil_tiny_rpb"):
        source = timm.create_model(name, img_size=64).eval()
        path = tmp_path / f"{name}.pth"
        torch.save(original_release_checkpoint(source.state_dict()), path)
        overlay = dict(file=str(path))
        x = torch.randn(2, 3, 64, 64)
        loaded = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, img_size=64).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), source(x), rtol=0, atol=0)
            larger = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, img_size=96).eval()
            y = torch.randn(1, 3, 96, 96)
            torch.testing.assert_close(larger(y), source(y))
            head_less = timm.create_model(
                name, pretrained=True, pretrained_cfg_overlay=overlay, img_size=64, num_classes=0
            ).eval()
            torch.testing.assert_close(head_less(x), source.forward_head(source.forward_features(x), pre_logits=True))


@pytest.mark.parametrize("last_stage_global", [0, 2], ids=["g0", "g2"])
def test_what_timms_model_tests_check(last_stage_global):
    """timm's own model tests, on vil_tiny and on vil_tiny with global tokens in the last stage (classified from
    its first one): forward_features at the default size against ``pool_size`` in ``output_fmt``, the head-less
    and pool-less model, and the model traced by torch.fx with timm's leaf modules."""
    from timm.layers import create_feature_extractor, get_channel_dim, get_graph_node_names, get_spatial_dim

    torch.manual_seed(0)
    arch = PRESETS["vil_tiny"].replace("g0", f"g{last_stage_global}")
    model = timm.create_model("vil_arch", arch=arch).eval()
    assert model.global_pool == ("token" if last_stage_global else "avg")
    cfg = model.pretrained_cfg
    x = torch.randn(1, *cfg["input_size"])
    feat_axis, (rows, cols) = get_channel_dim(model.output_fmt), get_spatial_dim(model.output_fmt)
    with torch.no_grad():
        out = model.forward_features(x)
        assert (out.shape[rows], out.shape[cols]) == cfg["pool_size"] and out.shape[feat_axis] == model.num_features
        assert model.forward_head(out, pre_logits=True).shape == (1, model.head_hidden_size)
        bare = timm.create_model("vil_arch", arch=arch, num_classes=0, global_pool="").eval()
        bare.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("head.")})
        torch.testing.assert_close(bare(x), out)

        _, eval_nodes = get_graph_node_names(model)
        traced = create_feature_extractor(model, return_nodes=[eval_nodes[-1]])
        torch.testing.assert_close(traced(x)[eval_nodes[-1]], model(x))


@pytest.mark.parametrize("feature_cls", ["hook", "fx"])
def test_hook_and_fx_feature_extractors_return_the_maps(feature_cls):
    """timm's other feature extractors catch the stage maps (``feature_info`` names the StageMap modules)."""
    x = torch.randn(1, 3, 64, 96)
    torch.manual_seed(0)
    getter = timm.create_model("vil_tiny", features_only=True, out_indices=(1, 3)).eval()
    torch.manual_seed(0)
    other = timm.create_model("vil_tiny", features_only=True, out_indices=(1, 3), feature_cls=feature_cls).eval()
    with torch.no_grad():
        want, got = getter(x), other(x)
    assert [m.shape for m in got] == [(1, 96, 8, 12), (1, 384, 2, 3)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    nhwc = timm.create_model("vil_tiny", features_only=True, out_indices=(1, 3), output_fmt="NHWC").eval()
    assert nhwc.output_fmt == "NHWC"


# --- Bad input: one plain sentence each. ---


def test_feature_options_this_model_does_not_have():
    with pytest.raises(
        ValueError,
        match="output_stride 16.*output stride is 32",
    ):
        timm.create_model("vil_tiny", features_only=True, output_stride=16)
    assert timm.create_model("vil_tiny", output_stride=32).total_stride == 32
    with pytest.raises(ValueError, match="feature_cls 'list'.*'getter'"):
        timm.create_model("vil_tiny", features_only=True, feature_cls="list")
    with pytest.raises(ValueError, match="feature_cls 'hook'.*'NHWC'.*'getter'"):
        timm.create_model("vil_tiny", features_only=True, feature_cls="hook", output_fmt="NHWC")
    with pytest.raises(ValueError, match="output_fmt 'NCL'.*'NCHW' or 'NHWC'"):
        timm.create_model("vil_tiny", features_only=True, output_fmt="NCL")
    with pytest.raises(ValueError, match="output_fmt 'NLC'.*'NCHW' or 'NHWC'"):
        timm.create_model("vil_tiny").forward_intermediates(torch.randn(1, 3, 64, 64), output_fmt="NLC")


def test_out_indices_out_of_range():
    with pytest.raises(ValueError, match=r"\[1, 4\].*4 stages.*0..3"):
        timm.create_model("vil_tiny", features_only=True, out_indices=(1, 4))
    model = timm.create_model("vil_tiny")
    with pytest.raises(ValueError, match="last 5 stages.*with 4.*1 to 4"):
        model.forward_intermediates(torch.randn(1, 3, 64, 64), indices=5)
    for indices in ([0.5], "a", 1.0, [True]):
        with pytest.raises(ValueError, match=r"Stage indices must be an int or a sequence of ints, got"):
            model.prune_intermediate_layers(indices)


def test_pruning_the_last_stages_gives_a_model_of_the_stage_left():
    """As timm's Swin: the features end at the last stage kept, so num_features is its width, and a classifier reset
    afterwards (or the one prune_head=False leaves) is made for it."""
    for prune_head in (True, False):
        model = timm.create_model("vil_arch", arch=ARCH_8, img_size=64, num_classes=5)
        model.prune_intermediate_layers([0], prune_head=prune_head)
        assert model.num_features == model.head_hidden_size == 16
        model.reset_classifier(10, "avg")
        assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)
        assert model.total_stride == 4 and model(torch.randn(2, 3, 8, 8)).shape == (2, 10)  # the first stage's


def test_a_new_classifier_takes_the_models_device_and_dtype():
    model = timm.create_model("vil_arch", arch=ARCH_8, img_size=64, num_classes=5).to(torch.bfloat16).eval()
    model.reset_classifier(3)
    assert model.head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64, dtype=torch.bfloat16)).shape == (1, 3)


def test_sizes_and_counts_take_numpy_integers_as_ints_and_refuse_bools():
    """Counts read from arrays (numpy's integers) are taken as the ints they hold, for every count alike."""
    model = timm.create_model("vil_arch", arch=ARCH_8, img_size=64, in_chans=np.int64(1), num_classes=np.int64(4))
    assert (model.in_chans, model.num_classes) == (1, 4) and type(model.in_chans) is type(model.num_classes) is int
    model.reset_classifier(np.int32(2))
    assert model.num_classes == 2 and type(model.num_classes) is int
    assert model(torch.randn(1, 1, 64, 64)).shape == (1, 2)
    for num_classes in (-1, 2.0, True):
        with pytest.raises(ValueError, match=rf"num_classes must be 0 .* number of classes, got {num_classes}"):
            model.reset_classifier(num_classes)


def test_bad_input_channels_and_traced_performer_features_are_one_sentence():
    for in_chans in (0, -1, 3.0, True):
        with pytest.raises(ValueError, match=rf"in_chans must be a positive number of image channels, got {in_chans}"):
            timm.create_model("vil_arch", arch=ARCH_8, img_size=64, in_chans=in_chans)
    with pytest.raises(ValueError, match="feature_cls 'fx' cannot extract a performer model's features"):
        timm.create_model(
            "vil_small_performer", features_only=True, feature_cls=timm.models.FeatureGraphNet, img_size=64
        )


def test_checkpoint_of_another_architecture(tmp_path):
    torch.save({"net": timm.create_model("vil_small_rpb", img_size=64).state_dict()}, tmp_path / "small.pth")
    with pytest.raises(
        ValueError,
        match=r"small\.pth does not fit.*layer1.0.cls_token \(1, 1, 96\) vs \(1, 1, 48\)",
    ):
        timm.create_model(
            "vil_tiny_rpb", pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "small.pth"))
        )


ARCH_8 = "l1,h1,d16,n1,s1,g1,p4,f8,a1_l2,h2,d32,n1,s1,g1,p2,f8,a1_l3,h2,d32,n1,s0,g1,p2,f2,a1"


def test_a_checkpoint_trained_with_other_model_options_is_refused_unless_built_with_them(tmp_path):
    """Options no tensor's shape shows (LN_EPS, AVG_POOL, ...) compute otherwise with the same weights: the config a
    training checkpoint stores names them, as evaluation refuses it (loaded without a word, ViL-Tiny's logits
    differed from the trained ones by up to 0.16)."""
    from vil.config import load_cfg
    from vil.model_config import build_model

    cfg = load_cfg(overrides=["MODEL.VIT.MSVIT.ARCH", ARCH_8, "INPUT.IMAGE_SIZE", "32", "DATA.NUM_CLASSES", "1000"])
    cfg.merge_from_list(["MODEL.VIT.MSVIT.LN_EPS", "0.5", "MODEL.VIT.AVG_POOL", "True"])
    trained = build_model(cfg).eval()
    torch.save({"net": trained.state_dict(), "config": cfg.dump()}, tmp_path / "run.pth")
    overlay = dict(file=str(tmp_path / "run.pth"))
    built = dict(arch=ARCH_8, img_size=32, pretrained=True, pretrained_cfg_overlay=overlay)
    with pytest.raises(
        ValueError, match=r"run\.pth was trained with ln_eps=0\.5 .*, not 1e-06, avg_pool=True .*not False"
    ):
        timm.create_model("vil_arch", **built)
    loaded = timm.create_model("vil_arch", ln_eps=0.5, avg_pool=True, **built).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), trained(images))


@pytest.mark.parametrize(
    "trained,built,option",
    [
        (dict(share_w=False), {}, "SHARE_W"),
        (dict(attention="linformer", share_kv=False), dict(attention="linformer"), "SHARE_KV"),
    ],
)
def test_different_tensors_under_names_one_tensor_holds_are_refused(tmp_path, trained, built, option):
    """Loaded into a model where query and query_global (linformer: proj_k and proj_v) are one tensor, the second
    name would overwrite the first."""
    model = timm.create_model("vil_arch", arch=ARCH_8, img_size=32, num_classes=3, **trained)
    torch.save({"net": model.state_dict()}, tmp_path / "w.pth")
    with pytest.raises(ValueError, match=rf"w\.pth holds different tensors under .*{option} False"):
        timm.create_model(
            "vil_arch", arch=ARCH_8, img_size=32, num_classes=3, pretrained=True,
            pretrained_cfg_overlay=dict(file=str(tmp_path / "w.pth")), **built,
        )  # fmt: skip


def test_pretrained_weights_for_other_input_channels_adapt_the_first_convolution(tmp_path):
    """timm's in_chans: with 1, the first convolution's weights summed over the channels, so a grey image gives
    the features of the 3-channel model on that image repeated 3 times; with 4, weights of the right shape."""
    torch.manual_seed(0)
    model = timm.create_model("vil_arch", arch=ARCH_8, img_size=32, num_classes=3).eval()
    torch.save({"net": model.state_dict()}, tmp_path / "w.pth")
    overlay = dict(file=str(tmp_path / "w.pth"))
    grey = timm.create_model(
        "vil_arch", arch=ARCH_8, img_size=32, num_classes=3, in_chans=1, pretrained=True, pretrained_cfg_overlay=overlay
    ).eval()
    images = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        want = model.forward_features(images.expand(2, 3, 32, 32))  # the classifier: timm's new one for 3 classes
        torch.testing.assert_close(grey.forward_features(images), want, atol=1e-5, rtol=1e-5)
    four = timm.create_model(
        "vil_arch", arch=ARCH_8, img_size=32, num_classes=3, in_chans=4, pretrained=True, pretrained_cfg_overlay=overlay
    )
    assert four.layer1[0].proj.weight.shape[1] == 4


def test_safetensors_save_model_files_keep_one_name_of_a_shared_tensor_and_load(tmp_path):
    """safetensors' save_model drops the names of SHARE_W's shared projections but one; loading fills them in."""
    import safetensors.torch

    arch = "l1,h2,d16,n1,s1,g1,p4,f3,a0_l2,h2,d16,n1,s1,g1,p2,f3,a0_l3,h2,d32,n1,s0,g1,p2,f3,a0"
    torch.manual_seed(0)
    model = timm.create_model("vil_arch", arch=arch, img_size=32, num_classes=3).eval()
    safetensors.torch.save_model(model, str(tmp_path / "m.safetensors"))
    saved = safetensors.torch.load_file(str(tmp_path / "m.safetensors"))
    assert len(saved) < len(model.state_dict())  # one name of each shared tensor
    loaded = timm.create_model(
        "vil_arch",
        arch=arch,
        img_size=32,
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "m.safetensors")),
    ).eval()
    from vil.checkpoint import load_checkpoint

    again = timm.create_model("vil_arch", arch=arch, img_size=32, num_classes=3).eval()
    load_checkpoint(again, tmp_path / "m.safetensors")  # the loader of detection backbones and training runs too
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)


def test_a_missing_checkpoint_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.pth does not exist.*\.safetensors.*Hub folder"):
        timm.create_model("vil_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "nothing.pth")))


def test_bad_pooling_and_class_counts():
    model = timm.create_model("vil_tiny")
    with pytest.raises(ValueError, match="global_pool 'token'.*g0.*'avg'"):
        model.reset_classifier(0, "token")
    with pytest.raises(ValueError, match="global_pool 'max'.*'token', 'avg' or ''"):
        model.reset_classifier(0, "max")
    with pytest.raises(ValueError, match=r"num_classes.*got -1"):
        model.reset_classifier(-1)


# What timm's train.py does with --model NAME: it builds the model through the registry with its own keyword
# arguments (None ones are dropped by create_model), resolves the data config from the pretrained_cfg, trains.
TIMM_TRAIN_STAND_IN = """
import argparse, sys, timm, timm.utils, torch
from timm.data import resolve_data_config
parser = argparse.ArgumentParser()
parser.add_argument("--model")
parser.add_argument("--num-classes", type=int)
parser.add_argument("--img-size", type=int)
args = parser.parse_args()
model = timm.create_model(args.model, pretrained=False, in_chans=3, num_classes=args.num_classes, drop_rate=0.0,
                          drop_path_rate=None, drop_block_rate=None, global_pool=None, bn_momentum=None, bn_eps=None,
                          scriptable=False, checkpoint_path="", img_size=args.img_size)
config = resolve_data_config({}, model=model)
logits = model(torch.randn(2, *config["input_size"][:1], args.img_size, args.img_size))
logits.sum().backward()
# --model-ema: each weight moves by (1 - decay) of the model's move, SHARE_W's shared ones too. The EMA is built as
# train.py builds it: through its task (timm.task.task imports ModelEmaV3 by name) from timm 1.0.27 on, from
# timm.utils before.
try:
    from timm.task import ClassificationTask
    ema = ClassificationTask(model, verbose=False).setup_ema(decay=0.9)
except ImportError:
    ema = timm.utils.ModelEmaV3(model, decay=0.9)
before = {name: p.detach().clone() for name, p in model.named_parameters()}
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
ema.update(model)
averaged = dict(ema.module.named_parameters())
ema_error = torch.cat([(averaged[name] - before[name] - 0.1).flatten() for name in before]).abs().max().item()
# A module holding the model (timm's feature distillation averages the student with its projection) as well.
held = timm.utils.ModelEmaV3(torch.nn.ModuleDict(dict(student=model)), decay=0.9)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
held.update(torch.nn.ModuleDict(dict(student=model)))
averaged = dict(held.module.named_parameters())
moved = [(averaged["student." + name] - before[name] - 1.1).flatten() for name in before]
ema_error = max(ema_error, torch.cat(moved).abs().max().item())
print(sys.argv[0].endswith("train.py"), type(model).__name__, tuple(logits.shape), config["interpolation"],
      ema_error < 1e-5)
"""


def test_timm_train_py_runs_with_vil_models(tmp_path):
    """tools/timm_train.py runs timm's script (here a stand-in making its calls) in a fresh interpreter, where
    only the tool's import of vil can register the models."""
    import subprocess
    import sys

    from tool_runner import ROOT, run_tool

    (tmp_path / "train.py").write_text(TIMM_TRAIN_STAND_IN)
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "timm_train.py"),
            str(tmp_path / "train.py"),
            "--model",
            "vil_tiny",
            "--num-classes",
            "3",
            "--img-size",
            "64",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "True MsViT (2, 3) bicubic True"
    status, _, stderr = run_tool("timm_train", tmp_path / "missing" / "train.py", "--model", "vil_tiny")
    assert status == 1 and stderr.startswith(f"error: {tmp_path / 'missing' / 'train.py'} is not a file; give the path")
    status, _, stderr = run_tool("timm_train", "--model", "vil_tiny")
    assert status == 1 and stderr.startswith("error: Give the path of timm's train.py first, then its arguments")


def test_pretrained_tags_download_once_into_the_hub_cache_under_their_own_names(tmp_path, monkeypatch):
    """A tag's checkpoint (here an original-release file behind a file:// URL; the release names every file
    model_best.pth) lands in torch hub's cache as <tag>.pth, and gives the logits of the file loaded directly;
    MODEL.MODEL_PATH takes the tag too."""
    from vil.config import load_cfg
    from vil.weights import resolve_model_path

    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    assert {
        "vil_tiny.in1k",
        "vil_tiny_rpb.in1k",
        "vil_small.in1k",
        "vil_small_rpb.in1k",
        "vil_medium_deep.in22k_ft_in1k_384",
        "vil_base_wide.in22k",
    } <= set(timm.list_pretrained("vil*"))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    for name in ("vil_tiny", "vil_tiny_rpb"):
        source = timm.create_model(name, img_size=64).eval()
        (tmp_path / name).mkdir()
        path = tmp_path / name / "model_best.pth"
        torch.save(original_release_checkpoint(source.state_dict()), path)
        tagged = timm.create_model(
            f"{name}.in1k", pretrained=True, pretrained_cfg_overlay=dict(url=path.as_uri()), img_size=64
        ).eval()
        direct = timm.create_model(
            name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), img_size=64
        ).eval()
        with torch.no_grad():
            torch.testing.assert_close(tagged(x), direct(x), rtol=0, atol=0)
        assert (tmp_path / "hub" / "checkpoints" / f"{name}.in1k.pth").read_bytes() == path.read_bytes()
    cached = resolve_model_path(load_cfg(overrides=["MODEL.MODEL_PATH", "vil_tiny_rpb.in1k"]))
    assert cached == str(tmp_path / "hub" / "checkpoints" / "vil_tiny_rpb.in1k.pth")
    from vil.checkpoint import download_checkpoint

    with pytest.raises(
        ValueError,
        match=r"download file:///nowhere/model_best.pth.*by hand",
    ):
        download_checkpoint("file:///nowhere/model_best.pth", "vil_small.in1k.pth")
    assert not (tmp_path / "hub" / "checkpoints" / "vil_small.in1k.pth").exists()
    with pytest.raises(FileNotFoundError, match=r"vil_tiny.in9k does not exist.*pretrained tag"):
        resolve_model_path(load_cfg(overrides=["MODEL.MODEL_PATH", "vil_tiny.in9k"]))
    # A tag's model is built for the tag's image size (and class count).
    model = timm.create_model("vil_medium_deep.in22k_ft_in1k_384")
    assert model.img_size == (384, 384) and model.pretrained_cfg["input_size"] == (3, 384, 384)
    assert timm.create_model("vil_medium_deep.in22k", img_size=64).num_classes == 21841


def test_vil_arch_pretrained_cfg_follows_the_arch_and_attention_it_is_built_with():
    arch = "l1,h1,d16,n1,s1,g1,p4,f2,a1_l2,h2,d32,n1,s1,g1,p2,f2,a1_l3,h2,d32,n1,s0,g1,p2,f2,a1"  # stride 16
    model = timm.create_model("vil_arch", arch=arch, num_classes=3).eval()
    with torch.no_grad():
        features = model.forward_features(torch.randn(1, *model.pretrained_cfg["input_size"]))
    assert model.pretrained_cfg["pool_size"] == tuple(features.shape[1:3]) == (14, 14)
    linformer = timm.create_model("vil_arch", arch=arch, attention="linformer", img_size=64, num_classes=3)
    assert linformer.pretrained_cfg["fixed_input_size"] and linformer.fixed_input_size
    full = arch.replace("s1", "s0")  # no local stage: no linformer projection, any size
    unfixed = timm.create_model("vil_arch", arch=full, attention="linformer", img_size=64, num_classes=3)
    assert not unfixed.pretrained_cfg["fixed_input_size"] and not unfixed.fixed_input_size
    # What timm's scripts resolve the input size from: the one size it takes; the registered linformer models too.
    assert timm.data.resolve_model_data_config(linformer)["input_size"] == (3, 64, 64)
    for name in ("vil_small_linformer", "vil_small_linformer_partial"):
        named = timm.create_model(name, img_size=64, num_classes=3).eval()
        input_size = timm.data.resolve_model_data_config(named)["input_size"]
        with torch.no_grad():
            features = named.forward_features(torch.randn(1, *input_size))
        assert input_size == (3, 64, 64) and named.pretrained_cfg["pool_size"] == tuple(features.shape[1:3])
    # Patch embeddings that pad (stride 12 at 224): the last map has ceil(224 / 12) positions a side.
    padding = timm.create_model("vil_arch", arch=arch.replace("p4", "p3"), dynamic_img_pad=True, num_classes=3)
    with torch.no_grad():
        features = padding.eval().forward_features(torch.randn(1, *padding.pretrained_cfg["input_size"]))
    assert padding.pretrained_cfg["pool_size"] == tuple(features.shape[1:3]) == (19, 19)
    srformer = timm.create_model("vil_arch", arch=arch.replace("f2", "f8"), attention="srformer", img_size=256)
    side = srformer.pretrained_cfg["min_input_size"][-1]
    with torch.no_grad():
        srformer(torch.randn(1, 3, side, side))  # the smallest image it says it takes runs
        with pytest.raises(ValueError, match="needs at least 2 positions"):
            srformer(torch.randn(1, 3, side - 16, side - 16))
