"""LongformerSelfAttention against dense masked attention written from Longformer's definition (float64)."""

import pytest
import torch

from vil.models.longformer import LongformerSelfAttention, folding_pays

BACKENDS = ["reference", "sliding_chunk", "fused_cpu", "loop"]
DIM, HEADS = 16, 4


def dense(layer, x, padding, is_global):
    """Longformer's attention as (L, L) masks over full attention: a token that is not global sees its band
    minus padding and global tokens, plus every global token; a global token sees every token that is not
    padding (global projections); padded positions output zeros."""
    B, L, C = x.shape
    H, D = layer.num_heads, C // layer.num_heads

    def heads(t):
        return t.view(B, L, H, D).transpose(1, 2)

    def attend(q, k, v, allowed):
        allowed = allowed | padding[:, None, :, None]  # padded queries: anything finite, zeroed below
        scores = (q @ k.transpose(-1, -2) * D**-0.5).masked_fill(~allowed, float("-inf"))
        return scores.softmax(-1) @ v

    dilations = layer.dilation if isinstance(layer.dilation, tuple) else (layer.dilation,) * H
    offset = torch.arange(L)[None, :] - torch.arange(L)[:, None]  # key - query
    d = torch.tensor(dilations)[:, None, None]
    band = (offset % d == 0) & (offset.abs() <= layer.window * d)
    if layer.causal:
        band = band & (offset <= 0)
    window_keys = band[None] & ~(padding | is_global)[:, None, None, :]
    local = attend(
        heads(layer.query(x)), heads(layer.key(x)), heads(layer.value(x)), window_keys | is_global[:, None, None, :]
    )
    full = attend(
        heads(layer.query_global(x)),
        heads(layer.key_global(x)),
        heads(layer.value_global(x)),
        ~padding[:, None, None, :].expand(B, H, L, L),
    )
    out = torch.where(is_global[:, None, :, None], full, local)
    return out.transpose(1, 2).reshape(B, L, C).masked_fill(padding[..., None], 0.0)


def masks(lengths, global_positions, L):
    """(B, L) key_padding_mask and global_mask from each sequence's length and global token positions."""
    padding = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]
    is_global = torch.zeros(len(lengths), L, dtype=torch.bool)
    for b, positions in enumerate(global_positions):
        is_global[b, list(positions)] = True
    return padding, is_global


def make(window, backend, seed=0, **kwargs):
    torch.manual_seed(seed)
    return LongformerSelfAttention(DIM, HEADS, window, backend=backend, **kwargs).double()


def check(layer, lengths, global_positions, L, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(len(lengths), L, DIM, dtype=torch.float64)
    padding, is_global = masks(lengths, global_positions, L)
    out = layer(x, key_padding_mask=padding, global_mask=is_global)
    assert out.shape == x.shape and not out.isnan().any()
    torch.testing.assert_close(out, dense(layer, x, padding, is_global))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "global_positions",
    [[[0], [0, 1]], [[6], [3, 9]], [[], []], [[0, 12], []]],
    ids=["start", "middle", "none", "mixed"],
)
def test_global_tokens(backend, global_positions):
    check(make(2, backend), [13, 13], global_positions, 13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_batch(backend):
    # Different lengths and global counts; a global token right before the padding; an all-padding sequence.
    out = check(make(2, backend), [13, 9, 5, 11, 0], [[0], [0, 4, 8], [], [1, 2], []], 13)
    assert (out[1, 9:] == 0).all() and (out[4] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dilation", [2, (1, 2, 3, 1)], ids=["2", "per-head"])
def test_dilation(backend, dilation):
    check(make(2, backend, dilation=dilation), [15, 10], [[7], [0, 2]], 15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal(backend):
    check(make(3, backend, causal=True), [11, 6], [[], []], 11)
    check(make(2, backend, causal=True, dilation=(1, 2, 1, 2)), [11], [[]], 11)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L", [1, 3, 7])
def test_short_and_odd_lengths(backend, L):
    layer = make(5, backend)
    check(layer, [L, L - 1], [[L // 2], []], L)
    x = torch.randn(2, L, DIM, dtype=torch.float64)
    no_mask = torch.zeros(2, L, dtype=torch.bool)
    torch.testing.assert_close(layer(x), dense(layer, x, no_mask, no_mask))  # no masks at all


def check_gradients(layer, lengths, global_positions, L):
    """The layer's output and the gradients of x and every parameter against :func:`dense`'s; returns the layer's
    gradients."""
    padding, is_global = masks(lengths, global_positions, L)
    x = torch.randn(len(lengths), L, DIM, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(len(lengths), L, DIM, dtype=torch.float64)
    results = []
    for fn in (layer, lambda *a, **k: dense(layer, *a)):
        layer.zero_grad()
        x.grad = None
        out = fn(x, padding, is_global)
        out.backward(grad_out)
        results.append([out.detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    for got, want in zip(*results):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want)
    return results[0][1:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients(backend):
    grads = check_gradients(make(2, backend, dilation=(1, 2, 1, 2)), [12, 8, 10], [[0, 5], [3], []], 12)
    assert all(g.abs().sum() > 0 for g in grads)  # every parameter takes part


@pytest.mark.parametrize("backend", ["reference", "fused_cpu"])
def test_many_global_tokens_project_every_token(backend):
    """Up to ``g (heads - 1) < dim`` global tokens their keys and values fold into the global queries' products;
    beyond, every token is projected with ``key_global`` and ``value_global``, which then costs less. A batch with
    5 (folded) and 6 and 9 (projected) global tokens: outputs and every gradient against the dense definition."""
    assert folding_pays(5, HEADS, DIM) and not folding_pays(6, HEADS, DIM)
    global_positions = [[0, 2, 4, 6, 13], range(6), [1, 2, 4, 6, 7, 8, 10, 12, 13]]
    assert masks([14, 11, 14], global_positions, 14)[1].sum(1).tolist() == [5, 6, 9]
    check_gradients(make(2, backend), [14, 11, 14], global_positions, 14)


def test_a_hooked_global_projection_in_a_batch_of_different_global_counts():
    """A hook that changes key_global's outputs: they are computed for every token, then taken per group of
    sequences with the same number of global tokens (here 1 and 2)."""
    layer = make(2, "reference")
    layer.key_global.register_forward_hook(lambda module, inputs, out: 0.5 * out)
    check(layer, [13, 11], [[0], [3, 9]], 13)


def test_state_dict_names():
    layer = LongformerSelfAttention(DIM, HEADS, 2)
    names = {
        f"{p}.{t}"
        for p in ("query", "key", "value", "query_global", "key_global", "value_global")
        for t in ("weight", "bias")
    }
    assert set(layer.state_dict()) == names
    state = {name: torch.randn(DIM, DIM) if name.endswith("weight") else torch.randn(DIM) for name in names}
    layer.load_state_dict(state)
    torch.testing.assert_close(layer.key_global.bias, state["key_global.bias"])


def test_bad_input():
    layer = LongformerSelfAttention(DIM, HEADS, 2, backend="reference")
    x = torch.randn(2, 6, DIM)
    bad = [
        (dict(x=torch.randn(6, DIM)), r"x must have shape \(B, L, dim=16\), got \(6, 16\)\."),
        (dict(x=torch.randn(2, 6, 8)), r"x must have shape \(B, L, dim=16\), got \(2, 6, 8\)\."),
        (
            dict(x=x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
            r"key_padding_mask.*\(2, 6\).*torch.bool of shape \(2, 5\)",
        ),
        (
            dict(x=x, global_mask=torch.zeros(2, 6)),
            r"global_mask.*\(2, 6\).*torch.float32",
        ),
        (
            dict(
                x=x, key_padding_mask=torch.ones(2, 6, dtype=torch.bool), global_mask=torch.ones(2, 6, dtype=torch.bool)
            ),
            "global_mask marks padded positions",
        ),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            layer(**kwargs)
    causal = LongformerSelfAttention(DIM, HEADS, 2, causal=True, backend="reference")
    causal(x, global_mask=torch.zeros(2, 6, dtype=torch.bool))
    one_sequence = torch.zeros(2, 6, dtype=torch.bool)
    one_sequence[1, 0] = True  # a global token in one sequence of the batch only
    for global_mask in (torch.eye(2, 6, dtype=torch.bool), one_sequence):
        with pytest.raises(ValueError, match="A causal layer takes no global tokens"):
            causal(x, global_mask=global_mask)
    with pytest.raises(ValueError, match=r"dim \(16\) must be divisible by num_heads \(3\)\."):
        LongformerSelfAttention(DIM, 3, 2)
    with pytest.raises(ValueError, match=r"one int per head \(4\), got 2 values"):
        LongformerSelfAttention(DIM, HEADS, 2, dilation=(1, 2))
    with pytest.raises(ValueError, match="window must be a positive integer"):
        LongformerSelfAttention(DIM, HEADS, 0)
    # The backend when the layer is built, as ViL's attention module checks it, not at its first call.
    with pytest.raises(ValueError, match=r"'nonsense'.*; available: sliding_chunk, .*reference"):
        LongformerSelfAttention(DIM, HEADS, 2, backend="nonsense")
    with pytest.raises(ValueError, match=r"unfold .*1D .*: sliding_chunk, .*reference"):
        LongformerSelfAttention(DIM, HEADS, 2, backend="unfold")


def test_flex_runs_eagerly_and_compiled_outside_the_layers_operator():
    """torch's FlexAttention maps with vmap, which torch's check of a compiled graph's operators refuses on their
    first call: under torch.compile the layer is traced as its Python code with it, not run inside its operator
    (on the CPU with aot_eager: inductor cannot lower FlexAttention there)."""
    layer = make(2, "flex").float().eval()
    x = torch.randn(2, 9, DIM)
    padding, is_global = masks([9, 7], [[0], []], 9)
    with torch.no_grad():
        eager = layer(x, key_padding_mask=padding, global_mask=is_global)
        torch.testing.assert_close(eager, dense(layer, x, padding, is_global), atol=1e-5, rtol=1e-5)
        compiled = torch.compile(layer, backend="aot_eager")(x, key_padding_mask=padding, global_mask=is_global)
    torch.testing.assert_close(compiled, eager)
