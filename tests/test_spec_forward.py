"""The whole model against the spec (``vil-spec.md`` sections 2-4), written here from scratch on the state dict
alone: a checkpoint's tensors, under the original release's names, must give what the spec computes from them.

The oracle is dense and float64: every query scores every key of its stage and a boolean mask keeps its window,
built here from the spec's words (chunks of the stage's f, the SW_EXACT rule), not from the project's geometry."""

import math

import pytest
import torch
import torch.nn.functional as F

from vil.models import MsViT

EPS = 1e-6  # the spec's LayerNorm eps (MODEL.VIT.MSVIT.LN_EPS's default)

# (index, heads, dim, layers, s, g, patch, f) per stage; a (position embedding or bias) is set per test. A map of
# 40 x 48 gives stages of 10 x 12 (f 3: 4 x 4 chunks), 5 x 6 (f 2: 3 x 3 chunks), 2 x 3 and 1 x 1.
STAGES = [(1, 2, 16, 1, 1, 2, 4, 3), (2, 2, 16, 2, 1, 1, 2, 2), (3, 2, 24, 1, 0, 1, 2, 7), (4, 2, 32, 1, 0, 0, 2, 7)]
IMAGE = (40, 48)


def arch_string(a, last_g):
    fields = []
    for index, heads, dim, layers, s, g, patch, f in STAGES:
        g = last_g if index == 4 else g
        fields.append(f"l{index},h{heads},d{dim},n{layers},s{s},g{g},p{patch},f{f},a{a}")
    return "_".join(fields)


def layer_norm(x, sd, name):
    return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], EPS)


def linear(x, sd, name):
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def heads_of(x, h):
    B, N, C = x.shape
    return x.view(B, N, h, C // h).transpose(1, 2)


def merge_heads(x):
    B, h, N, D = x.shape
    return x.transpose(1, 2).reshape(B, N, h * D)


def window(nx, ny, w, exact):
    """(allowed, di, dj): which local key each local query of an nx x ny map attends to, and the offsets
    qi - ki, qj - kj the relative bias reads (neighbour chunks counted as adjacent), each (nx*ny, nx*ny)."""
    qi, qj = (t.flatten() for t in torch.meshgrid(torch.arange(nx), torch.arange(ny), indexing="ij"))
    qi, qj, ki, kj = qi[:, None], qj[:, None], qi[None, :], qj[None, :]
    if exact == 1:
        return ((qi - ki).abs() <= w) & ((qj - kj).abs() <= w), qi - ki, qj - kj
    chunks_x, chunks_y = math.ceil(nx / w), math.ceil(ny / w)
    step_x, step_y = ki // w - qi // w, kj // w - qj // w  # chunk steps from the query's chunk to the key's
    if exact == -1:  # cyclic: the step taken modulo the chunk count, as -1, 0 or +1 (3 or more chunks here)
        step_x = (step_x + 1) % chunks_x - 1
        step_y = (step_y + 1) % chunks_y - 1
    allowed = (step_x.abs() <= 1) & (step_y.abs() <= 1)
    # The key as if its chunk were the query's chunk plus the step: that row and column give the bias offsets.
    nominal_i, nominal_j = (qi // w + step_x) * w + ki % w, (qj // w + step_y) * w + kj % w
    return allowed, qi - nominal_i, qj - nominal_j


def attend(q, k, v, bias, allowed):
    scores = q @ k.transpose(-1, -2) + bias
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def longformer_attention(t, sd, name, h, g, nx, ny, w, exact, rpe):
    """Section 4: local queries over the global keys and their window; global queries over every key."""
    B, N, C = t.shape
    scale = (C // h) ** -0.5
    kv = heads_of(linear(t, sd, f"{name}.kv"), 2 * h)
    k, v = kv[:, :h], kv[:, h:]
    q = heads_of(linear(t[:, g:], sd, f"{name}.query"), h) * scale
    allowed_local, di, dj = window(nx, ny, w, exact)
    allowed = torch.cat([torch.ones(nx * ny, g, dtype=torch.bool), allowed_local], 1)
    bias = torch.zeros(h, nx * ny, N, dtype=t.dtype)
    if rpe:
        table = sd[f"{name}.local_relative_position_bias_table"]  # ((4w-1)^2, heads)
        rows = (di + 2 * w - 1) * (4 * w - 1) + (dj + 2 * w - 1)
        bias[:, :, g:] = torch.where(allowed_local, table[rows.clamp(0, len(table) - 1)].permute(2, 0, 1), 0)
        bias[:, :, :g] = sd[f"{name}.g2l_relative_position_bias"][1][:, None, :]
    local = linear(merge_heads(attend(q, k, v, bias, allowed)), sd, f"{name}.proj")
    if not g:
        return local
    kv_global = heads_of(linear(t, sd, f"{name}.kv_global"), 2 * h)
    q_global = heads_of(linear(t[:, :g], sd, f"{name}.query_global"), h) * scale
    global_bias = torch.zeros(h, g, N, dtype=t.dtype)
    if rpe:
        global_bias[:, :, :g] = sd[f"{name}.g2g_relative_position_bias"]
        global_bias[:, :, g:] = sd[f"{name}.g2l_relative_position_bias"][0][:, :, None]
    everything = torch.ones(g, N, dtype=torch.bool)
    out = attend(q_global, kv_global[:, :h], kv_global[:, h:], global_bias, everything)
    return torch.cat([linear(merge_heads(out), sd, f"{name}.proj_global"), local], 1)


def full_attention(t, sd, name, h, g, nx, ny, rpe):
    """Section 3: every token over every token; qkv is the queries', keys' and values' projections in turn."""
    B, N, C = t.shape
    qkv = heads_of(linear(t, sd, f"{name}.qkv"), 3 * h)
    q, k, v = qkv[:, :h] * (C // h) ** -0.5, qkv[:, h : 2 * h], qkv[:, 2 * h :]
    bias = torch.zeros(h, N, N, dtype=t.dtype)
    if rpe:
        qi, qj = (x.flatten() for x in torch.meshgrid(torch.arange(nx), torch.arange(ny), indexing="ij"))
        rows = (qi[:, None] - qi[None, :] + nx - 1) * (2 * ny - 1) + (qj[:, None] - qj[None, :] + ny - 1)
        bias[:, g:, g:] = sd[f"{name}.local_relative_position_bias_table"][rows].permute(2, 0, 1)
        if g:
            bias[:, :g, :g] = sd[f"{name}.g2g_relative_position_bias"]
            bias[:, :g, g:] = sd[f"{name}.g2l_relative_position_bias"][0][:, :, None]
            bias[:, g:, :g] = sd[f"{name}.g2l_relative_position_bias"][1][:, None, :]
    return linear(merge_heads(attend(q, k, v, bias, torch.ones(N, N, dtype=torch.bool))), sd, f"{name}.proj")


def spec_forward(sd, images, a, last_g, exact):
    """Sections 2-4 on the state dict ``sd``: the logits of ``images``."""
    x = images
    for index, h, d, layers, s, g, patch, w in STAGES:
        g = last_g if index == 4 else g
        stage = f"layer{index}"
        x = F.conv2d(x, sd[f"{stage}.0.proj.weight"], sd[f"{stage}.0.proj.bias"], stride=patch)
        B, _, nx, ny = x.shape
        t = layer_norm(x.flatten(2).transpose(1, 2), sd, f"{stage}.0.norm_embed")  # row-major tokens
        if g:
            t = torch.cat([sd[f"{stage}.0.cls_token"].expand(B, -1, -1), t], 1)
        if a:
            x_pos, y_pos = sd[f"{stage}.0.x_pos_embed"][0], sd[f"{stage}.0.y_pos_embed"][0]
            grid = torch.cat([x_pos[:, None].expand(nx, ny, d // 2), y_pos[None].expand(nx, ny, d // 2)], -1)
            t = t + torch.cat([sd[f"{stage}.0.cls_pos_embed"][0], grid.reshape(nx * ny, d)])
        for layer in range(layers):
            name = f"{stage}.{2 * layer + 1}"
            normed = layer_norm(t, sd, f"{name}.norm")
            if s:
                t = t + longformer_attention(normed, sd, f"{name}.attn", h, g, nx, ny, w, exact, rpe=not a)
            else:
                t = t + full_attention(normed, sd, f"{name}.attn", h, g, nx, ny, rpe=not a)
            mlp = f"{stage}.{2 * layer + 2}"
            hidden = F.gelu(linear(layer_norm(t, sd, f"{mlp}.norm"), sd, f"{mlp}.mlp.fc1"))
            t = t + linear(hidden, sd, f"{mlp}.mlp.fc2")
        x = t[:, g:].transpose(1, 2).reshape(B, d, nx, ny)
    t = layer_norm(t, sd, "norm")
    pooled = t[:, 0] if last_g else t.mean(1)
    return linear(pooled, sd, "head")


@pytest.mark.parametrize(
    "a,last_g,exact",
    [(1, 0, 0), (0, 0, 0), (0, 1, -1), (1, 1, 1), (0, 0, 1)],
    ids=["ape", "rpb", "rpb-cyclic-token-pool", "ape-exact-token-pool", "rpb-exact"],
)
def test_logits_equal_the_spec_computed_from_the_state_dict(a, last_g, exact):
    torch.manual_seed(0)
    arch = arch_string(a, last_g)
    model = MsViT(arch, img_size=IMAGE, num_classes=5, drop_path_rate=0.0, share_w=False, sw_exact=exact)
    model = model.double().eval()
    # Every tensor random and of order 1 (biases, norms and tables included), so that each one counts.
    state = {k: torch.randn_like(v) * 0.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    images = torch.randn(2, 3, *IMAGE, dtype=torch.float64)
    with torch.no_grad():
        expected = spec_forward(state, images, a, last_g, exact)
        torch.testing.assert_close(model(images), expected, rtol=1e-9, atol=1e-9)


def test_initial_weights_follow_the_spec():
    """Linear weights truncated normal std 0.02 with zero bias; LayerNorms 1 and 0; global tokens, position
    embeddings and bias tables std 0.02."""
    torch.manual_seed(0)
    models = [MsViT(arch_string(a, 1), img_size=224) for a in (0, 1)]  # bias tables; position embeddings
    spread = {"linear": [], "small": []}
    for name, module in (item for model in models for item in model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            spread["linear"].append(module.weight.flatten())
            assert not module.bias.any(), name
        elif isinstance(module, torch.nn.LayerNorm):
            assert (module.weight == 1).all() and not module.bias.any(), name
    for name, p in (item for model in models for item in model.named_parameters()):
        if any(part in name for part in ("cls_token", "pos_embed", "relative_position")):
            spread["small"].append(p.flatten())
    for kind, values in spread.items():
        values = torch.cat(values)
        assert abs(values.std().item() - 0.02) < 0.002, kind
        assert abs(values.mean().item()) < 0.002, kind
    models[0].reset_classifier(17)  # a new head for fine-tuning is initialised so too, not as torch's nn.Linear
    head = models[0].get_classifier()
    assert head.out_features == 17 and not head.bias.any()
    assert abs(head.weight.std().item() - 0.02) < 0.002 and abs(head.weight.mean().item()) < 0.002
