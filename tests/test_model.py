"""The ViL model against the spec: layout and parameter counts, attention wiring, modes, bad input."""

import re
from pathlib import Path

import pytest
import torch

import vil.models.attention as attention_module
from vil.config import load_cfg
from vil.model_config import ATTN_TYPE_ALIASES, attention_of, build_model
from vil.models import PRESETS, MsViT, parse_arch
from vil.models.attention import FullAttention, LongformerAttention, LongformerOptions
from vil.models.msvit import MECHANISMS
from vil.ops import available_backends
from vil.ops.backends.reference import window_pairs

ROOT = Path(__file__).resolve().parents[1]
ORIGINAL_LAYOUTS = ROOT.parent / "shared" / "reference" / "original-release-state-dicts.txt"
PAPER_PARAMETERS = {  # millions, as published; Tiny and Small exactly
    "vil_tiny": 6_707_080,
    "vil_small": 24_635_752,
    "vil_medium_deep": 39.7,
    "vil_medium_wide": 39.8,
    "vil_base_deep": 55.7,
    "vil_base_wide": 79.0,
}


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PAPER_PARAMETERS))
def test_preset_configs_build_with_paper_parameter_counts(name):
    model = build_model(load_cfg(ROOT / "configs" / f"{name}.yaml"))
    expected = PAPER_PARAMETERS[name]
    if isinstance(expected, int):
        assert count(model) == expected
    else:
        assert round(count(model) / 1e6, 1) == expected
    assert load_cfg(ROOT / "configs" / f"{name}.yaml").MODEL.VIT.MSVIT.ARCH == PRESETS[name]


def original_layouts():
    if not ORIGINAL_LAYOUTS.exists():
        pytest.skip(f"the original release's state-dict listing is not beside this checkout ({ORIGINAL_LAYOUTS})")
    text = ORIGINAL_LAYOUTS.read_text()
    parts = re.split(
        r"^### (ViL-[^\n]*?) MODEL\.VIT\.MSVIT\.ARCH=(\S+)[^\n]*\n### parameters: (\d+)\n", text, flags=re.M
    )
    for i in range(1, len(parts), 4):
        title, arch, params, body = parts[i : i + 4]
        shapes = {}
        for line in body.strip().splitlines():
            if line and not line.startswith("#"):
                key, shape = re.match(r"(\S+) \(([\d, ]*)\)", line).groups()
                shapes[key] = tuple(int(s) for s in shape.replace(" ", "").split(",") if s)
        yield title, arch, int(params), shapes


def test_state_dict_layout_equals_the_original_release():
    layouts = list(original_layouts())
    assert len(layouts) == 4
    for title, arch, params, shapes in layouts:
        model = MsViT(arch)
        ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        theirs = {k: v for k, v in shapes.items() if not k.endswith("relative_position_index")}
        assert ours == theirs, title
        assert count(model) == params, title


def naive_longformer(attn, x, nx, ny, mode):
    """The spec's section 4 written densely: every query's scores over all keys, masked to its window."""
    G, H = attn.num_global, attn.heads
    B, N, C = x.shape
    D = C // H
    allowed, index = window_pairs(nx, ny, attn.window, attn.exact, mode, x.device)

    def heads(t):
        return t.view(B, -1, H, D).transpose(1, 2)

    k, v = heads(attn.kv(x)[..., :C]), heads(attn.kv(x)[..., C:])
    q = heads(attn.query(x[:, G:])) * D**-0.5
    scores = q @ k.transpose(-1, -2)  # local queries x (global + local keys)
    bias = torch.zeros(H, N - G, N)
    mask = torch.ones(N - G, N, dtype=torch.bool)
    mask[:, G:] = allowed
    if attn.rpe:
        bias[:, :, G:] = attn.local_relative_position_bias_table[index].permute(2, 0, 1)
        if G:
            bias[:, :, :G] = attn.g2l_relative_position_bias[1][:, None, :]
    local = torch.softmax((scores + bias).masked_fill(~mask, float("-inf")), -1) @ v
    out = attn.proj(local.transpose(1, 2).reshape(B, N - G, C))
    if not G:
        return out
    kg, vg = heads(attn.kv_global(x)[..., :C]), heads(attn.kv_global(x)[..., C:])
    qg = heads(attn.query_global(x[:, :G])) * D**-0.5
    gscores = qg @ kg.transpose(-1, -2)
    if attn.rpe:
        gscores = gscores + torch.cat(
            [attn.g2g_relative_position_bias, attn.g2l_relative_position_bias[0][:, :, None].expand(H, G, N - G)], -1
        )
    gout = attn.proj_global((torch.softmax(gscores, -1) @ vg).transpose(1, 2).reshape(B, G, C))
    return torch.cat([gout, out], dim=1)


@pytest.mark.parametrize(
    "G,rpe,exact,mode,share_w",
    [
        (1, True, 0, 0, True),
        (2, True, -1, 0, False),
        (1, False, 1, 0, True),
        (0, True, 0, -1, True),
        (2, False, 0, 6, False),
    ],
)
def test_longformer_attention_matches_the_spec_densely(G, rpe, exact, mode, share_w):
    torch.manual_seed(0)
    nx, ny, dim = 5, 7, 12
    options = LongformerOptions(exact=exact, mode=mode, share_w=share_w)
    attn = LongformerAttention(dim, 3, G, 2, rpe=rpe, options=options).eval()
    x = torch.randn(2, G + nx * ny, dim)
    with torch.no_grad():
        expected = naive_longformer(attn, x, nx, ny, mode if mode <= 0 else mode)
        attn.mode = mode  # a fixed mode (mode > 0 is random only in training; set it for this comparison)
        if mode > 0:
            attn.current_mode = lambda: mode
        torch.testing.assert_close(attn(x, nx, ny), expected, rtol=1e-5, atol=1e-5)


def test_only_global_attends_to_the_global_tokens_only():
    torch.manual_seed(0)
    attn = LongformerAttention(8, 2, 1, 2, rpe=True, options=LongformerOptions(only_global=True)).eval()
    x = torch.randn(1, 1 + 16, 8)
    out = attn(x, 4, 4)
    # Each local query sees one key, the global token: its attention output is that token's value.
    value = attn.kv(x[:, :1])[..., 8:]
    torch.testing.assert_close(out[:, 1:], attn.proj(value).expand(1, 16, 8))


def test_only_global_local_queries_take_no_relative_bias_as_in_the_original():
    """The original's only_glo branch adds no bias to the local queries' scores: its g2l[1] is in the state dict,
    unused. Local outputs: softmax(q k_g^T / sqrt(d)) v_g by hand, whatever g2l[1] holds."""
    torch.manual_seed(0)
    attn = LongformerAttention(8, 2, 3, 2, rpe=True, options=LongformerOptions(only_global=True)).eval()
    with torch.no_grad():
        attn.g2l_relative_position_bias.normal_(0, 2.0)
        x = torch.randn(2, 3 + 12, 8, dtype=torch.float64)
        attn.double()
        out = attn(x, 3, 4)[:, 3:]
        q = attn.query(x[:, 3:]).reshape(2, 12, 2, 4).transpose(1, 2)
        k, v = attn.kv(x[:, :3]).reshape(2, 3, 2, 2, 4).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)
        expected = attn.proj((weights @ v).transpose(1, 2).reshape(2, 12, 8))
    torch.testing.assert_close(out, expected)


def test_full_attention_relative_bias_by_hand():
    torch.manual_seed(0)
    nx, ny, heads, G = 3, 4, 2, 1
    attn = FullAttention(8, heads, G, nx, ny, rpe=True).eval()
    table = attn.local_relative_position_bias_table
    bias = attn._bias(nx, ny)
    for qi in range(nx):
        for qj in range(ny):
            for ki in range(nx):
                for kj in range(ny):
                    row = (qi - ki + nx - 1) * (2 * ny - 1) + (qj - kj + ny - 1)
                    assert torch.equal(bias[:, G + qi * ny + qj, G + ki * ny + kj], table[row])
    g2l, g2g = attn.g2l_relative_position_bias, attn.g2g_relative_position_bias
    assert torch.equal(bias[:, 0, 0], g2g[:, 0, 0])
    assert torch.equal(bias[:, 0, 5], g2l[0, :, 0])  # global query -> local key
    assert torch.equal(bias[:, 5, 0], g2l[1, :, 0])  # local query -> global key


@pytest.mark.parametrize("queries,keys,bias_rows", [(1, 300, 1), (20, 20, 20), (20, 3, 1)])
def test_softmax_attention_written_out_and_through_sdpa_match_the_formula(monkeypatch, queries, keys, bias_rows):
    """A global token's queries (1 x 300), a small full attention, the local queries of ONLY_GLOBAL (20 x 3): written
    out on the CPU (few scores per head), and through scaled_dot_product_attention when the threshold is 0; outputs
    and gradients against softmax(q k^T / sqrt(d) + bias) v computed by hand in float64."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, 3, queries, 8), (2, 3, keys, 8), (2, 3, keys, 8), (1, 3, bias_rows, keys))
    inputs = [torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True) for shape in shapes]
    q, k, v, bias = inputs
    weights = torch.exp(torch.einsum("bhqd,bhkd->bhqk", q, k) / 8**0.5 + bias)
    expected = torch.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdim=True), v)
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(expected, inputs, upstream)
    sdpa_calls = []
    sdpa = attention_module.F.scaled_dot_product_attention
    monkeypatch.setattr(
        attention_module.F, "scaled_dot_product_attention", lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw)
    )
    for threshold in (attention_module.WRITTEN_OUT_SCORES, 0):
        monkeypatch.setattr(attention_module, "WRITTEN_OUT_SCORES", threshold)
        out = attention_module.softmax_attention(q, k, v, bias)
        torch.testing.assert_close(out, expected)
        for got, grad in zip(torch.autograd.grad(out, inputs, upstream), want):
            torch.testing.assert_close(got, grad)
    assert len(sdpa_calls) == 1  # the threshold 0 only


def tiny_cfg(*overrides):
    return load_cfg(
        ROOT / "configs" / "vil_tiny.yaml", ["INPUT.IMAGE_SIZE", "64", "DATA.NUM_CLASSES", "10", *overrides]
    )


@pytest.mark.parametrize(
    "attn_type",
    ["longformer", "sliding_chunk_autograd", "unfold", "unfold_nnf", "chunk_rows", "flex", "fused_cpu"],
)
def test_every_attn_type_gives_the_logits_of_sliding_chunk(attn_type):
    # triton: tests/test_triton_kernels.py
    torch.manual_seed(0)
    hand = build_model(tiny_cfg("MODEL.VIT.MSVIT.ATTN_TYPE", "sliding_chunk")).eval()
    auto = build_model(tiny_cfg("MODEL.VIT.MSVIT.ATTN_TYPE", attn_type)).eval()
    auto.load_state_dict(hand.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(hand(x), auto(x), rtol=1e-5, atol=1e-5)
    if attn_type == "flex":
        return  # FlexAttention has no backward on the CPU
    # and the same gradients
    hand.train(), auto.train()
    torch.manual_seed(1)
    hand(x).square().sum().backward()
    torch.manual_seed(1)
    auto(x).square().sum().backward()
    for (name, a), b in zip(hand.named_parameters(), auto.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_attn_type_aliases_name_their_backends():
    """The original release's ATTN_TYPE names and this project's earlier ones build the model of their backend."""
    original = {
        "longformerhand": "sliding_chunk",
        "longformerauto": "sliding_chunk_autograd",
        "longformer_cuda": "triton",
    }
    assert original.items() <= ATTN_TYPE_ALIASES.items()
    names = {**ATTN_TYPE_ALIASES, **{f"longformer_{backend}": backend for backend in available_backends(2)}}
    for alias, backend in names.items():
        assert backend in available_backends(2) and alias not in available_backends(2)
        assert attention_of(alias) == ("longformer", backend)
    model = build_model(tiny_cfg("MODEL.VIT.MSVIT.ATTN_TYPE", "longformerhand"))
    assert model.layer1[1].attn.backend == "sliding_chunk"


def test_full_attn_type_uses_full_attention_everywhere():
    model = build_model(tiny_cfg("MODEL.VIT.MSVIT.ATTN_TYPE", "full"))
    assert not any(isinstance(m, LongformerAttention) for m in model.modules())
    # With SHARE_W, query + kv + proj hold exactly the parameters of qkv + proj.
    assert count(model) == count(build_model(tiny_cfg()))


def test_s0_stages_use_full_attention_and_s1_stages_longformer():
    model = build_model(tiny_cfg())
    assert isinstance(model.layer1[1].attn, LongformerAttention)
    assert isinstance(model.layer2[1].attn, LongformerAttention)
    assert isinstance(model.layer3[1].attn, FullAttention)
    assert isinstance(model.layer4[1].attn, FullAttention)


def test_random_shift_mode_draws_per_layer_in_training_and_uses_mode_0_in_eval(monkeypatch):
    seen = []
    real = attention_module.local_attention_2d

    def spy(*args, **kwargs):
        seen.append(int(kwargs["mode"]))  # a drawn neighbour is a 0-dim tensor
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "local_attention_2d", spy)
    model = build_model(tiny_cfg("MODEL.VIT.MSVIT.MODE", "1"))
    x = torch.randn(1, 3, 64, 64)
    torch.manual_seed(0)
    for _ in range(10):
        model(x)
    assert len(seen) == 20 and set(seen) <= set(range(1, 9)) and len(set(seen)) > 2
    draws = [int(model.layer1[1].attn.current_mode()) for _ in range(400)]  # every neighbour: 1 to 8, none oftener
    assert sorted(set(draws)) == list(range(1, 9)) and max(map(draws.count, set(draws))) < 100
    seen.clear()
    model.eval()
    model(x)
    assert seen == [0, 0]
    model.train()
    model.reset_vil_mode(0)
    seen.clear()
    model(x)
    assert seen == [0, 0]
    model.reset_vil_mode(-1)
    seen.clear()
    model(x)
    assert seen == [-1, -1]


def test_pooling_follows_the_spec():
    """The pooled feature is the first global token, or the mean over all tokens (global ones included): computed
    here from the last stage's tokens, which a hook on the final norm sees."""
    torch.manual_seed(0)
    model = MsViT(PRESETS["vil_tiny"].replace("g0", "g2"), img_size=64, num_classes=5).eval()
    seen = []
    model.norm.register_forward_hook(lambda module, args, out: seen.append(out))
    feats = model.forward_features(torch.randn(1, 3, 64, 64))
    (tokens,) = seen  # (1, 2 global + 2 x 2, C)
    assert model.output_fmt == "NHWC" and feats.shape == (1, 2, 2, model.num_features)
    torch.testing.assert_close(feats, tokens[:, 2:].reshape(1, 2, 2, -1))
    torch.testing.assert_close(model.forward_head(feats), model.head(tokens[:, 0]))
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), tokens[:, 0])
    model.reset_classifier(5, "avg")
    torch.testing.assert_close(model.forward_head(feats), model.head(tokens.mean(1)))
    with pytest.raises(ValueError, match="'avg'.*global_tokens"):
        model.forward_head(feats.clone())  # a copy of the map has lost its global tokens
    model.reset_classifier(0, "")
    assert model.forward_head(feats) is feats
    assert MsViT(PRESETS["vil_tiny"].replace("g0", "g2"), img_size=64, avg_pool=True).global_pool == "avg"
    assert MsViT(PRESETS["vil_tiny"], img_size=64).global_pool == "avg"  # the last stage has g0
    with pytest.raises(ValueError, match=r"avg_pool=True.*global_pool is 'token'"):
        MsViT(PRESETS["vil_tiny"].replace("g0", "g2"), img_size=64, avg_pool=True, global_pool="token")
    with pytest.raises(ValueError, match=r"Image size 2147483648 has a side above 2147483647"):
        MsViT(PRESETS["vil_tiny"], img_size=2**31)


def test_ln_eps_is_honoured():
    model = build_model(tiny_cfg("MODEL.VIT.MSVIT.LN_EPS", "1e-5"))
    assert {m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)} == {1e-5}


def test_no_weight_decay_names():
    names = build_model(tiny_cfg()).no_weight_decay()
    assert "layer1.0.cls_token" in names and "layer1.0.x_pos_embed" in names and "head.bias" in names
    assert "layer1.1.norm.weight" in names and "layer1.1.attn.query.weight" not in names


# --- Bad input: one plain sentence each. ---


def test_an_odd_hidden_size_is_taken_without_absolute_position_embeddings():
    (stage, *_) = parse_arch("l1,h3,d75,a0_l2_l3")  # relative position bias: nothing splits d in two
    assert (stage.dim, stage.ape) == (75, False)


@pytest.mark.parametrize(
    "arch,facts",
    [
        ("l1,h3,d96_l2,h3,d192", r"2 stages.*3 or 4"),
        ("l1,h3,d96_l2,x3_l3", r"stage 2 \('l2,x3'\).*'x3'.*letter 'x'"),
        ("l1,h3,d96_l2,h3,dd_l3", r"stage 2 \('l2,h3,dd'\).*'dd'.*non-negative integer"),
        ("l1,h3,d96_l3,h3_l2", r"stage 2 \('l3,h3'\).*l3.*1, 2, 3"),
        ("l1,h5,d96_l2_l3", r"stage 1 \('l1,h5,d96'\).*d96.*h5"),
        ("l1,s2_l2_l3", r"'s2'.*0 or 1"),
        ("l1,a2_l2_l3", r"'a2'.*0 or 1"),
        ("l1,h1,d5,a1_l2_l3", r"a1.*d5.*even"),
        ("l1,h3,h3_l2_l3", r"'h'.*twice"),
        ("l1,g2147483648_l2_l3", r"'g2147483648'.*g \(num_global\) must be at least 0 and at most 2147483647"),
        ("vil_small", r"'vil_small' is the name of a preset.*PRESETS\['vil_small'\].*build_fpn_backbone"),
        ("vil_smal", r"'vil_smal' is neither a preset's name \(did you mean vil_small\?\) \(vil_tiny, .*arch string"),
        ("l1,h3,d\u00b2_l2_l3", r"'d\u00b2'.*non-negative integer"),  # a digit to str.isdigit, not to int()
        (None, r"is a str .*got NoneType None"),
        (5, r"is a str .*got int 5"),
    ],
)
def test_bad_arch_strings(arch, facts):
    with pytest.raises(ValueError, match=facts) as err:
        parse_arch(arch)
    if "'x3'" in facts or "'dd'" in facts:
        assert "e.g." in str(err.value)  # shows the grammar


@pytest.mark.parametrize(
    "overrides,facts",
    [
        (("MODEL.VIT.MSVIT.ATTN_TYPE", "longformer_magic"), r"'longformer_magic'"),
        (("MODEL.VIT.MSVIT.ATTN_TYPE", "fused-cpu"), r"'fused-cpu' \(did you mean fused_cpu\?\)"),
        (("MODEL.VIT.MSVIT.SW_EXACT", "1", "MODEL.VIT.MSVIT.MODE", "3"), r"MODE\) 3.*SW_EXACT 0 or -1"),
        (("INPUT.IMAGE_SIZE", "16"), r"16.*total stride 32"),
        (
            ("MODEL.VIT.MSVIT.ONLY_GLOBAL", "True", "MODEL.VIT.MSVIT.ARCH", "l1,g0,d48,h1_l2,g0_l3,g0"),
            r"ONLY_GLOBAL.*global tokens",
        ),
        (("MODEL.ARCH", "resnet50"), r"MODEL.ARCH 'resnet50'.*'msvit'"),
        (
            ("MODEL.VIT.MSVIT.ATTN_TYPE", "full", "MODEL.VIT.MSVIT.SW_EXACT", "1", "MODEL.VIT.MSVIT.MODE", "3"),
            r"MODE\) 3.*SW_EXACT 0 or -1",
        ),
        (("MODEL.VIT.MSVIT.SW_EXACT", "7"), r"SW_EXACT\).*1, 0 or -1.*7"),
        # ONLY_GLOBAL computes no window: the options that shape one would change nothing.
        (
            ("MODEL.VIT.MSVIT.ONLY_GLOBAL", "True", "MODEL.VIT.MSVIT.SW_EXACT", "1"),
            r"SW_EXACT \(sw_exact\) 1 .*ONLY_GLOBAL",
        ),
        (("MODEL.VIT.MSVIT.ONLY_GLOBAL", "True", "MODEL.VIT.MSVIT.MODE", "2"), r"MODE \(mode\) 2 .*leave it at 0"),
        # Options of local stages where none is local (all s0: full attention), or of their global tokens where
        # none has any.
        (
            ("MODEL.VIT.MSVIT.ONLY_GLOBAL", "True", "MODEL.VIT.MSVIT.ARCH", "l1,s0,d48,h1_l2,s0_l3,s0"),
            r"ONLY_GLOBAL \(only_global\) True acts on a local stage \(s1\), which this architecture has none of",
        ),
        (
            ("MODEL.VIT.MSVIT.SW_EXACT", "-1", "MODEL.VIT.MSVIT.ARCH", "l1,s0,d48,h1_l2,s0_l3,s0"),
            r"SW_EXACT \(sw_exact\) -1 acts on a local stage \(s1\).*leave it at 0",
        ),
        (
            ("MODEL.VIT.MSVIT.SHARE_W", "False", "MODEL.VIT.MSVIT.ARCH", "l1,g0,d48,h1_l2,g0_l3,g0"),
            r"SHARE_W \(share_w\) False acts on a local stage \(s1\) with global tokens.*leave it at True",
        ),
    ],
)
def test_bad_model_configs(overrides, facts):
    with pytest.raises(ValueError, match=facts) as err:
        build_model(tiny_cfg(*overrides))
    if "longformer_magic" in overrides:
        from vil.model_config import attn_types

        assert all(f" {name}" in str(err.value) for name in attn_types())  # every name it takes


def test_wrong_images_at_forward():
    model = build_model(tiny_cfg())
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\).*\(1, 1, 96, 96\)"):
        model(torch.randn(1, 1, 96, 96))
    with pytest.raises(ValueError, match=r"31x96.*stride 32"):
        model(torch.randn(1, 3, 31, 96))
    with pytest.raises(ValueError, match=r"floating-point images.*got torch.uint8 ones"):
        model(torch.zeros(1, 3, 96, 96, dtype=torch.uint8))  # a decoded image's pixels
    with pytest.raises(ValueError, match=r"images are torch.float64 and the model's weights torch.float32"):
        model(torch.randn(1, 3, 96, 96, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"a tensor of images \(B, 3, H, W\), got a list"):
        model([torch.randn(3, 96, 96)])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the images as it casts the weights
        assert model(torch.randn(1, 3, 96, 96, dtype=torch.float16)).shape == (1, model.num_classes)
        with pytest.raises(ValueError, match=r"torch.float64 .*torch.autocast casts any floating dtype but float64"):
            model(torch.randn(1, 3, 96, 96, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"images are torch.float32 and the model's weights torch.float64"):
            model.double()(torch.randn(1, 3, 96, 96))  # nor float64 weights
    model.float()
    with torch.device("meta"):  # no autocast there: the model's own checks speak
        on_meta = build_model(tiny_cfg("MODEL.VIT.MSVIT.ARCH", "l1,s0,d48,h1_l2,s0_l3,s0"))
        assert on_meta(torch.randn(2, 3, 96, 96)).shape == (2, on_meta.num_classes)


@pytest.mark.parametrize(
    "arguments, facts",
    [
        (dict(num_classes=-1), r"num_classes.*got -1"),
        (dict(num_classes=2.5), r"num_classes.*got 2.5"),
        (dict(drop_path_rate=1.5), r"drop_path_rate.*\[0, 1\).*1.5"),
        (dict(drop_path_rate=-0.5), r"drop_path_rate.*-0.5"),
        (dict(ln_eps=-1.0), r"ln_eps.*positive.*-1.0"),
        (dict(img_size=(64,)), r"img_size.*\(H, W\).*\(64,\)"),
        (dict(img_size=64.0), r"img_size.*64.0"),
        (dict(attention="full", attn_backend="flex"), r"attn_backend 'flex'.*not 'full'.*None"),
    ],
)
def test_bad_model_arguments(arguments, facts):
    arch = "l1,h2,d16,n1,s1,g1,p4,f3,a0_l2,h2,d16,n1,s1,g1,p2,f3,a0_l3,h2,d32,n1,s0,g1,p2,f3,a0"
    with pytest.raises(ValueError, match=facts):
        MsViT(arch, **{"img_size": 64, **arguments})


@pytest.mark.parametrize("attention", MECHANISMS)
def test_an_empty_batch_gives_empty_logits(attention):
    arch = "l1,h2,d16,n1,s1,g1,p4,f2,a0_l2,h2,d16,n1,s1,g1,p2,f2,a0_l3,h2,d32,n1,s0,g1,p2,f2,a0"
    model = MsViT(arch, img_size=32, num_classes=3, attention=attention)
    out = model(torch.randn(0, 3, 32, 32))
    assert out.shape == (0, 3)
    out.sum().backward()


def test_reset_vil_mode_rejects_bad_modes():
    model = build_model(tiny_cfg("MODEL.VIT.MSVIT.SW_EXACT", "1"))
    with pytest.raises(ValueError, match="takes mode 0 only"):
        model.reset_vil_mode(2)
    with pytest.raises(ValueError, match=r"mode \(MODE\) must be 0, -1 or one of 1..8"):
        model.reset_vil_mode(12)
    # Where no stage is local (every stage s0) the options are refused as well, at build and at a reset.
    full = "l1,h1,d16,n1,s0,g1,p4_l2,h1,d16,n1,s0,g1,p2_l3,h1,d16,n1,s0,g1,p4"
    with pytest.raises(ValueError, match=r"SW_EXACT\).*1, 0 or -1.*got 5"):
        MsViT(full, img_size=32, sw_exact=5)
    with pytest.raises(ValueError, match=r"MODE\).*got 42"):
        MsViT(full, img_size=32, mode=42)
    with pytest.raises(ValueError, match=r"MODE\).*got 99"):
        MsViT(full, img_size=32).reset_vil_mode(99)


def test_three_stage_model_and_drop_path_schedule():
    arch = "l1,h2,d32,n2,s1,g1,p4,f3,a1_l2,h2,d64,n1,s1,g2,p2,f3,a0_l3,h4,d64,n1,s0,g1,p2,f3,a1"
    model = MsViT(arch, img_size=32, num_classes=4, drop_path_rate=0.3)
    assert not hasattr(model, "layer4")
    rates = [
        m.drop_path.drop_prob if hasattr(m.drop_path, "drop_prob") else 0.0
        for stage in (model.layer1, model.layer2, model.layer3)
        for m in stage[1:]
    ]
    # linspace(0, 0.3, 4 layers), both blocks of a layer share its rate
    expected = [0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3]
    assert rates == pytest.approx(expected)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_kernels_package_is_importable_under_its_own_name():
    import vil_kernels

    assert vil_kernels.__name__ == "vil_kernels"


@pytest.mark.parametrize("attn_type", ["sliding_chunk", "sliding_chunk_autograd"])
def test_relative_bias_model_trains_under_bfloat16_autocast(attn_type):
    torch.manual_seed(0)
    model = build_model(
        tiny_cfg("MODEL.VIT.MSVIT.ARCH", PRESETS["vil_tiny_rpb"], "MODEL.VIT.MSVIT.ATTN_TYPE", attn_type)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(2, 3, 64, 64)).float().logsumexp(-1).mean()
    loss.backward()
    table = model.layer1[1].attn.local_relative_position_bias_table
    assert table.grad is not None and torch.isfinite(table.grad).all() and table.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_grad_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = MsViT(PRESETS["vil_tiny"], img_size=64, num_classes=5, drop_path_rate=0.0)
    x = torch.randn(2, 3, 64, 64)
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    calls = []
    model.layer1[1].register_forward_pre_hook(lambda *_: calls.append(1))  # the first block: run again in backward
    model.set_grad_checkpointing(True)
    model(x).square().sum().backward()
    for a, b in zip(plain, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b)
    assert len(calls) == 2
    model.set_grad_checkpointing(False)
    model(x).square().sum().backward()
    assert len(calls) == 3


def test_patch_embedding_drops_the_remainder_as_the_original_or_pads():
    torch.manual_seed(0)
    arch = "l1,h1,d16,n1,s1,g1,p4,f2,a1_l2,h2,d32,n1,s0,g1,p2,f2,a1_l3,h2,d32,n1,s0,g0,p2,f2,a1"
    model = MsViT(arch, img_size=34, num_classes=3).eval()  # 34 // 4 = 8 rows, as the original's tables
    assert model.layer1[0].x_pos_embed.shape == (1, 8, 8) and model.layer2[0].x_pos_embed.shape == (1, 4, 16)
    x = torch.randn(2, 3, 34, 35)
    # The convolution never sees the rows and columns that do not fill a patch: they change nothing.
    torch.testing.assert_close(model(x), model(x[:, :, :32, :32]), rtol=0, atol=0)
    padded = MsViT(arch, img_size=34, num_classes=3, dynamic_img_pad=True).eval()
    assert padded.layer1[0].x_pos_embed.shape == (1, 9, 8)  # ceil(34 / 4)
    torch.testing.assert_close(
        padded(x[:, :, :34, :34]), padded(torch.nn.functional.pad(x[:, :, :34, :34], (0, 2, 0, 2)))
    )
    assert build_model(
        load_cfg(
            overrides=["MODEL.VIT.MSVIT.ARCH", arch, "INPUT.IMAGE_SIZE", "34", "MODEL.VIT.DYNAMIC_IMG_PAD", "True"]
        )
    ).dynamic_img_pad
