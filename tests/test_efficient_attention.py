"""ATTN_TYPE linformer, srformer and performer: each against a plain implementation of the spec (section 7) written
here, the original release's checkpoint layout, the performer's redraw schedule, and their refusals."""

import math
import re
from pathlib import Path

import onnxruntime
import pytest
import timm
import torch
import torch.nn.functional as F
from test_train import assert_same_weights, final_weights, straight_and_resumed
from tool_runner import run_tool

from vil.checkpoint import read_checkpoint
from vil.config import load_cfg
from vil.detection import ViLBackbone
from vil.export import export_program
from vil.model_config import build_model
from vil.models import COMPARISONS
from vil.models.efficient_attention import (
    FavorFeatures,
    LinformerAttention,
    PerformerAttention,
    SpatialReductionAttention,
    orthogonal_random_features,
)
from vil.profiling import flop_counter
from vil.weights import load_weights

ROOT = Path(__file__).resolve().parents[1]

ARCH = "l1,h2,d16,n1,s1,g2,p4,f3,a1_l2,h2,d32,n1,s1,g1,p2,f2,a1_l3,h2,d32,n1,s0,g1,p2,f2,a1"


def heads(x, h):
    B, N, C = x.shape
    return x.reshape(B, N, h, C // h).permute(0, 2, 1, 3)


def unheads(x):
    B, H, N, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, N, H * D)


def softmax_attention(q, k, v):
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


def plain_linformer(layer, x):
    """Spec: K' = proj_k^T K, V' = proj_v^T V over all heads at once, then softmax attention of the scaled queries."""
    d = x.shape[-1]
    kv = x @ layer.kv.weight.t() + layer.kv.bias
    k, v = kv[..., :d], kv[..., d:]
    k, v = layer.proj_k.t() @ k, layer.proj_v.t() @ v  # (B, k, d)
    q = x @ layer.query.weight.t() + layer.query.bias
    out = softmax_attention(heads(q, layer.heads), heads(k, layer.heads), heads(v, layer.heads))
    return unheads(out) @ layer.proj.weight.t() + layer.proj.bias


def plain_srformer(layer, x, nx, ny):
    """Spec: the local map through the r x r stride-r convolution and a parameter-free instance norm; keys and values
    from the global tokens followed by the reduced tokens."""
    B, N, d = x.shape
    G, r = layer.num_global, layer.ratio
    local = x[:, G:].transpose(1, 2).reshape(B, d, nx, ny)
    reduced = F.conv2d(local, layer.proj_sr.weight, stride=r)
    mean = reduced.mean(dim=(2, 3), keepdim=True)
    var = reduced.var(dim=(2, 3), unbiased=False, keepdim=True)
    reduced = ((reduced - mean) / torch.sqrt(var + 1e-5)).flatten(2).transpose(1, 2)
    kv = torch.cat([x[:, :G], reduced], 1) @ layer.kv.weight.t() + layer.kv.bias
    q = x @ layer.query.weight.t() + layer.query.bias
    out = softmax_attention(heads(q, layer.heads), heads(kv[..., :d], layer.heads), heads(kv[..., d:], layer.heads))
    return unheads(out) @ layer.proj.weight.t() + layer.proj.bias


def plain_performer(layer, x):
    """Spec: phi(q) = m^-1/2 (exp(c q.W^T - c^2|q|^2/2 - rowmax) + 1e-4), keys with the maximum over the whole key
    tensor; out = phi(q)(phi(K)^T V) / (phi(q) . sum_j phi(k_j))."""
    d = x.shape[-1]
    qkv = x @ layer.qkv.weight.t() + layer.qkv.bias
    q, k, v = (heads(qkv[..., i * d : (i + 1) * d], layer.heads) for i in range(3))
    W = layer.fast_attention.projection_matrix
    m, D = W.shape
    c = D**-0.25

    def phi(t, peak):
        dash = torch.einsum("bhnd,md->bhnm", c * t, W)
        return m**-0.5 * (torch.exp(dash - (t * t).sum(-1, keepdim=True) * c * c / 2 - peak(dash)) + 1e-4)

    fq, fk = phi(q, lambda s: s.max(-1, keepdim=True).values), phi(k, lambda s: s.max())
    out = torch.einsum("bhnm,bhme->bhne", fq, torch.einsum("bhnm,bhne->bhme", fk, v))
    out = out / torch.einsum("bhnm,bhm->bhn", fq, fk.sum(2))[..., None]
    return unheads(out) @ layer.proj.weight.t() + layer.proj.bias


@pytest.mark.parametrize("share_kv", [True, False])
def test_linformer_matches_the_spec(share_kv):
    torch.manual_seed(0)
    layer = LinformerAttention(24, 3, num_global=2, grid=(5, 6), k=7, share_kv=share_kv)
    assert (layer.proj_v is layer.proj_k) == share_kv
    assert set(layer.state_dict()) >= {"proj_k", "proj_v"}  # both names, also when shared
    bound = 7**-0.5
    assert -bound <= layer.proj_k.min() < layer.proj_k.max() <= bound  # uniform in [-1/sqrt(k), 1/sqrt(k)]
    x = torch.randn(2, 32, 24)
    torch.testing.assert_close(layer(x, 5, 6), plain_linformer(layer, x), atol=1e-5, rtol=1e-5)


def test_linformer_refuses_another_map():
    layer = LinformerAttention(16, 2, num_global=1, grid=(4, 6), k=4, stage=1)
    with pytest.raises(ValueError, match=r"stage 1.*a 4x6 map.*got 5x5"):
        layer(torch.randn(1, 26, 16), 5, 5)
    with pytest.raises(ValueError, match=r"a 4x6 map.*got 6x4"):  # as many tokens, transposed
        layer(torch.randn(1, 25, 16), 6, 4)


@pytest.mark.parametrize("num_global, nx, ny, ratio", [(1, 8, 6, 2), (0, 7, 9, 3), (2, 4, 4, 2)])
def test_srformer_matches_the_spec(num_global, nx, ny, ratio):
    torch.manual_seed(1)
    layer = SpatialReductionAttention(16, 2, num_global, ratio)
    x = torch.randn(2, num_global + nx * ny, 16)
    torch.testing.assert_close(layer(x, nx, ny), plain_srformer(layer, x, nx, ny), atol=1e-5, rtol=1e-5)
    assert not any(k.startswith("norm") for k in layer.state_dict())  # the instance norm has no parameters


def test_srformer_refuses_a_map_reduced_to_one_position():
    layer = SpatialReductionAttention(16, 2, 1, 4, stage=2)
    with pytest.raises(ValueError, match=r"stage 2 reduces its 5x7 map by 4 to 1x1"):
        layer(torch.randn(1, 36, 16), 5, 7)
    # A model built for such an image size is refused as it is built (its pretrained_cfg says 128 at least).
    with pytest.raises(ValueError, match=r"stage 1 reduces its 16x16 map by 16 to 1x1"):
        timm.create_model("vil_small_srformer64", img_size=64)


def test_performer_matches_the_spec():
    torch.manual_seed(2)
    layer = PerformerAttention(24, 2, num_features=20)
    x = torch.randn(2, 30, 24)
    torch.testing.assert_close(layer(x, 5, 6), plain_performer(layer, x), atol=1e-5, rtol=1e-4)


def test_favor_features_approximate_softmax_attention():
    """With many random features FAVOR+ is close to the softmax attention it stands for (scale head_dim^-1/2)."""
    torch.manual_seed(3)
    favor = FavorFeatures(8, 4096)
    q, k, v = (0.5 * torch.randn(1, 2, 40, 8) for _ in range(3))
    exact = softmax_attention(q, k, v)
    error = (favor(q, k, v) - exact).abs().max()
    assert error < 0.05 < (favor(q, k.flip(2), v) - exact).abs().max()  # close to this attention, not to another


def test_orthogonal_random_features():
    torch.manual_seed(4)
    W = orthogonal_random_features(20, 8)
    assert W.shape == (20, 8)
    for block in (W[:8], W[8:16], W[16:]):
        directions = block / block.norm(dim=1, keepdim=True)
        gram = directions @ directions.t()
        torch.testing.assert_close(gram, torch.eye(len(block)), atol=1e-5, rtol=0)
    # Row norms are those of 8-dimensional Gaussian vectors (chi with 8 degrees of freedom: mean about 2.74).
    norms = orthogonal_random_features(2000, 8).norm(dim=1)
    assert abs(norms.mean() - math.sqrt(2) * math.gamma(4.5) / math.gamma(4)) < 0.05
    # Haar-distributed blocks: each block's first row points either way along the first axis with probability 1/2
    # (the QR of a Gaussian matrix alone always gives it one sign there). 500 blocks: 250 +- 11 (one s.d.).
    first_rows = orthogonal_random_features(500 * 8, 8)[::8]
    assert 200 < (first_rows[:, 0] < 0).sum() < 300


def tiny_cfg(attn_type, *overrides):
    return load_cfg(
        overrides=[
            "MODEL.VIT.MSVIT.ARCH",
            ARCH,
            "INPUT.IMAGE_SIZE",
            "32",
            "DATA.NUM_CLASSES",
            "5",
            "MODEL.VIT.MSVIT.ATTN_TYPE",
            attn_type,
            *overrides,
        ]
    )


ORIGINAL_KEYS = {  # parameter and buffer names of the original release, stage 1's attention
    "linformer": {
        "layer1.1.attn.query.weight",
        "layer1.1.attn.kv.bias",
        "layer1.1.attn.proj.weight",
        "layer1.1.attn.proj_k",
        "layer1.1.attn.proj_v",
    },
    "srformer": {"layer1.1.attn.query.weight", "layer1.1.attn.kv.weight", "layer1.1.attn.proj_sr.weight"},
    "performer": {
        "layer1.1.attn.qkv.weight",
        "layer1.1.attn.proj.bias",
        "layer1.1.attn.fast_attention.projection_matrix",
        "calls_since_last_redraw",
    },
}


@pytest.mark.parametrize("attn_type", ["linformer", "srformer", "performer"])
def test_original_checkpoints_load_and_give_the_same_outputs(attn_type, tmp_path):
    torch.manual_seed(5)
    cfg = tiny_cfg(attn_type)
    original = build_model(cfg).eval()
    state = original.state_dict()
    assert ORIGINAL_KEYS[attn_type] <= set(state)
    assert not any(".attn." in k and "layer3" in k and "proj_k" in k for k in state)  # s0 stages stay full attention
    assert "layer3.1.attn.qkv.weight" in state
    path = tmp_path / "model_best.pth"
    torch.save({"net": {"module." + k: v.clone() for k, v in state.items()}}, path)  # as the original saved it
    torch.manual_seed(6)
    model = build_model(cfg)
    load_weights(model, load_cfg(overrides=["MODEL.MODEL_PATH", str(path)]))
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model.eval()(x), original(x))
    other = "srformer" if attn_type != "srformer" else "linformer"
    with pytest.raises((ValueError, RuntimeError)):  # the parameters of another mechanism do not fit
        load_weights(build_model(tiny_cfg(other)), load_cfg(overrides=["MODEL.MODEL_PATH", str(path)]))


def test_share_kv_false_gives_two_linformer_parameters():
    shared = build_model(tiny_cfg("linformer"))
    separate = build_model(tiny_cfg("linformer", "MODEL.VIT.MSVIT.SHARE_KV", "False"))
    extra = separate.layer1[1].attn.proj_v.numel() + separate.layer2[1].attn.proj_v.numel()
    assert _parameter_count(separate) == _parameter_count(shared) + extra


def _parameter_count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "attention,key,value,owner",
    [
        ("performer", "ONLY_GLOBAL", "True", "longformer"),
        ("full", "SW_EXACT", "1", "longformer"),
        ("linformer", "MODE", "1", "longformer"),
        ("srformer", "SHARE_W", "False", "longformer"),
        ("performer", "SHARE_KV", "False", "linformer"),
    ],
)
def test_options_of_another_attention_are_refused(attention, key, value, owner):
    """An option that changes nothing in the chosen attention is refused rather than ignored."""
    with pytest.raises(ValueError, match=rf"{key} \({key.lower()}\) {value} is an option of {owner}.*'{attention}'"):
        build_model(tiny_cfg(attention, f"MODEL.VIT.MSVIT.{key}", value))


def redraws(model, forwards, x):
    """The forwards (1-based) after which layer 1's projection differs from before."""
    changed = []
    for i in range(1, forwards + 1):
        before = model.layer1[1].attn.fast_attention.projection_matrix.clone()
        model(x)
        if not torch.equal(before, model.layer1[1].attn.fast_attention.projection_matrix):
            changed.append(i)
    return changed


def test_performer_redraws_every_interval_training_forwards_and_never_in_evaluation():
    torch.manual_seed(7)
    model = build_model(tiny_cfg("performer"))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert redraws(model.eval(), 4, x) == []
        model.train()
        assert redraws(model, 5, x) == [2, 3, 4, 5]  # interval 1 (the first epoch's): every forward after the first
        model.set_feature_redraw_interval(3)
        assert redraws(model, 9, x) == [3, 6, 9]
        # Every performer layer redraws, each its own matrix.
        layers = [m.fast_attention.projection_matrix for m in model.modules() if isinstance(m, PerformerAttention)]
        assert len(layers) == 2 and layers[0].shape == (3, 8) and layers[1].shape == (2, 16)
    with pytest.raises(ValueError, match="at least 1"):
        model.set_feature_redraw_interval(0)
    with pytest.raises(ValueError, match=r"no performer attention"):
        build_model(tiny_cfg("srformer")).set_feature_redraw_interval(2)


def test_frozen_stages_keep_their_features():
    """A detection backbone keeps its frozen stages in eval mode: their performer layers never redraw."""
    torch.manual_seed(13)
    backbone = ViLBackbone(ARCH, out_indices=(0, 1, 2), img_size=32, attention="performer", frozen_stages=1).train()
    key = "layer{}.1.attn.fast_attention.projection_matrix"
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    with torch.no_grad():
        for _ in range(3):
            backbone(torch.randn(1, 3, 32, 32))
    after = backbone.state_dict()
    assert torch.equal(after[key.format(1)], before[key.format(1)])
    assert not torch.equal(after[key.format(2)], before[key.format(2)])


def test_fx_feature_extraction_of_a_performer_is_refused():
    with pytest.raises(ValueError, match=r"feature_cls 'fx'.*performer"):
        timm.create_model("vil_small_performer_partial", features_only=True, feature_cls="fx", img_size=64)


def test_performer_redraws_continue_identically_from_a_state_dict_and_random_state():
    """What a resumed training run restores (the weights with both buffers, and torch's random state) is all that the
    redraws depend on."""
    torch.manual_seed(8)
    x = torch.randn(1, 3, 32, 32)
    straight = build_model(tiny_cfg("performer")).train()
    straight.set_feature_redraw_interval(2)
    with torch.no_grad():
        for _ in range(3):
            straight(x)
        state, random_state = {k: v.clone() for k, v in straight.state_dict().items()}, torch.get_rng_state()
        for _ in range(4):
            straight(x)
        torch.manual_seed(123)
        resumed = build_model(tiny_cfg("performer")).train()
        resumed.load_state_dict(state)
        resumed.set_feature_redraw_interval(2)
        torch.set_rng_state(random_state)
        for _ in range(4):
            resumed(x)
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_performer_compiles_with_fullgraph_and_redraws_in_the_graph():
    """The redraw decision and the draw are tensor operations: fullgraph compiles a training forward, which redraws
    as eager does from the same random state (aot_eager), and a new interval compiles nothing new."""
    torch._dynamo.reset()
    torch.manual_seed(10)
    model = build_model(tiny_cfg("performer", "MODEL.VIT.DROP_PATH", "0.0")).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    x = torch.randn(2, 3, 32, 32)
    key = "layer2.1.attn.fast_attention.projection_matrix"
    for interval in (1, 2):
        model.set_feature_redraw_interval(interval)
        state, random_state = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
        with torch._dynamo.config.patch(error_on_recompile=interval > 1):
            got = [compiled(x) for _ in range(3)]
        got_state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        torch.set_rng_state(random_state)
        want = [model(x) for _ in range(3)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(got_state[key], model.state_dict()[key])
        assert int(model.calls_since_last_redraw) == int(got_state["calls_since_last_redraw"])
    assert not torch.equal(state[key], model.state_dict()[key])


def test_performer_trains_with_double_backward():
    """Gradient penalties need the gradient's gradient: the performer's ops all have one."""
    torch.manual_seed(9)
    layer = PerformerAttention(8, 2, 6).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: layer(t, 2, 2), (x,), fast_mode=True)


PUBLISHED_MILLIONS = {
    "vil_small_full": 24.6,
    "vil_small_linformer": 26.3,
    "vil_small_linformer_partial": 25.8,
    "vil_small_srformer64": 52.9,
    "vil_small_srformer32": 31.1,
    "vil_small_srformer32_partial": 26.4,
}


def test_comparison_variants_are_registered_as_published():
    """The ViL-Small-sized models of the original's comparison, with its published parameter counts (in millions,
    rounded) where its parameters are this project's (the performer's and global's depend on choices made here)."""
    assert sorted(timm.list_models("vil_small_*")) == sorted([*COMPARISONS, "vil_small_rpb"])
    for name in COMPARISONS:
        assert timm.models.get_pretrained_cfg(name).pool_size == (7, 7)
    for name, millions in PUBLISHED_MILLIONS.items():
        model = timm.create_model(name)
        assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == millions, name


def test_features_only_and_linformer_refuses_another_size():
    model = timm.create_model("vil_small_linformer_partial", features_only=True, img_size=64)
    maps = model(torch.randn(1, 3, 64, 64))
    assert [m.shape[1:] for m in maps] == [(96, 16, 16), (192, 8, 8), (384, 4, 4), (768, 2, 2)]
    with pytest.raises(ValueError, match=r"stage 1.*16x16 map.*24x24"):
        model(torch.randn(1, 3, 96, 96))
    srformer = timm.create_model("vil_small_srformer32_partial", features_only=True, img_size=96)
    assert [m.shape[-1] for m in srformer(torch.randn(1, 3, 128, 96))] == [24, 12, 6, 3]  # any size


def test_flop_counting_sees_each_mechanism():
    """torch's FLOP counter counts every product: for linformer, q/kv/proj, the two token projections and the
    attention over k keys, by hand."""
    N, d, k, H = 17, 16, 5, 2
    layer = LinformerAttention(d, H, 1, (4, 4), k)
    with flop_counter() as counter:
        layer(torch.randn(1, N, d), 4, 4)
    linears = 2 * N * d * (d + 2 * d + d)
    projections = 2 * (2 * N * k * d)
    attention = 2 * (2 * N * k * d)
    assert counter.get_total_flops() == linears + projections + attention


@pytest.mark.parametrize("attn_type", ["linformer", "srformer", "performer"])
def test_digits_demo_trains_with_one_override(attn_type, tmp_path):
    """The digits demo's config with ATTN_TYPE switched (and one short epoch): tools/train.py trains, evaluates and
    writes its checkpoint; the model in it is the asked-for mechanism, and it learned (the loss fell). Three of the
    ten classes keep it short."""
    out = tmp_path / attn_type
    status, printed, _ = run_tool(
        "train",
        "--config-file",
        ROOT / "configs" / "vil_digits.yaml",
        "MODEL.VIT.MSVIT.ATTN_TYPE",
        attn_type,
        "OPTIM.EPOCHS",
        "1",
        "DATA.CLASSES",
        "['0', '1', '2']",
        "DATA.NUM_CLASSES",
        "3",
        "DATALOADER.BSZ",
        "16",
        "LOG_FREQ",
        "2",
        "OUTPUT_DIR",
        out,
    )
    assert status == 0
    state = read_checkpoint(str(out / "checkpoint_last.pth"))["net"]
    assert ORIGINAL_KEYS[attn_type] <= set(state)
    losses = [float(x) for x in re.findall(r" step \d+: loss ([0-9.]+)", (out / "log.txt").read_text())]
    assert len(losses) >= 3 and losses[-1] < losses[0]


def test_performer_exported_in_training_mode_redraws_as_eager_does():
    """torch.export keeps the redraw (a buffer mutation) in the program: from the same random state the exported
    module draws the same features at the same forwards as the eager model."""
    torch.manual_seed(11)
    model = build_model(tiny_cfg("performer", "MODEL.VIT.DROP_PATH", "0.0")).train()
    model.set_feature_redraw_interval(2)
    x = torch.randn(1, 3, 32, 32)
    key = "layer2.1.attn.fast_attention.projection_matrix"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    exported = torch.export.export(model, (x,)).module()
    exported.load_state_dict(state)
    random_state = torch.get_rng_state()
    with torch.no_grad():
        got = [(exported(x), exported.state_dict()[key].clone()) for _ in range(4)]
        model.load_state_dict(state)
        torch.set_rng_state(random_state)
        want = [(model(x), model.state_dict()[key].clone()) for _ in range(4)]
    for (out, features), (want_out, want_features) in zip(got, want):
        torch.testing.assert_close(out, want_out)
        assert torch.equal(features, want_features)
    assert not torch.equal(want[-1][1], state[key])  # the features were redrawn


def test_performer_training_resumes_with_the_same_redraws(data, tmp_path):
    """Two epochs straight against one, then a resume: the same weights and the same random features. Three steps an
    epoch: the interval is 1 in epoch 1 (redraws at its steps 2 and 3) and 6 in epoch 2 (no redraw)."""
    straight, resumed = straight_and_resumed(data, tmp_path, "MODEL.VIT.MSVIT.ATTN_TYPE", "performer")
    assert_same_weights(final_weights(straight), final_weights(resumed))
    epoch1 = read_checkpoint(str(straight / "checkpoint_epoch1.pth"))["net"]
    assert epoch1["calls_since_last_redraw"] == 1 and final_weights(straight)["calls_since_last_redraw"] == 4


@pytest.mark.parametrize("attn_type", ["linformer", "srformer"])
def test_export_runs_at_other_sizes_or_linformer_at_its_own(attn_type):
    """torch.export with dynamic batch and image size; linformer, which takes one size, with dynamic batch only.
    (The performer's operators are all standard ones; its one unusual use, a maximum over a whole tensor, is held
    against onnxruntime below.)"""
    torch.manual_seed(11)
    model = build_model(tiny_cfg(attn_type)).eval()
    assert model.fixed_input_size == (attn_type == "linformer")
    if attn_type == "linformer":
        with pytest.raises(ValueError, match="takes only 32x32 images .* not 64x32"):
            export_program(model, 64, 32)
    exported = export_program(model, 32, 32).module()
    shapes = ((3, 3, 32, 32),) if attn_type == "linformer" else ((1, 3, 64, 64), (3, 3, 96, 32))
    for shape in shapes:
        y = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(exported(y), model(y))


def test_favor_features_export_to_onnx(tmp_path):
    """The performer's one unusual operator, the maximum over a whole tensor, through the ONNX exporter and
    onnxruntime (the whole models' ONNX export is tested with the other attention types)."""
    torch.manual_seed(12)
    favor = FavorFeatures(8, 12).eval()
    q, k, v = (torch.randn(2, 2, 9, 8) for _ in range(3))
    program = torch.onnx.export(favor, (q, k, v), dynamo=True, input_names=["q", "k", "v"])

    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), favor(q, k, v), atol=1e-5, rtol=1e-5)
