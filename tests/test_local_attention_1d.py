"""local_attention_1d: the reference against hand-computed bands, every backend against the reference."""

import numpy as np
import pytest
import torch
from test_local_attention import assert_matches_the_window_asked_for, upstream_gradient

from vil.ops import available_backends, base, check_backend_1d, default_backend, local_attention_1d
from vil.ops.backends import reference
from vil.ops.backends.reference import band_pairs
from vil.ops.base import Extras
from vil.ops.neighborhood import Neighborhood1d

CPU = torch.device("cpu")
# Backends with a backward on the CPU; flex runs forward only there (its own test below); triton takes float32 and
# half precision only (tests/test_triton_kernels_1d.py).
TRAINING = [b for b in available_backends(1) if b not in ("reference", "flex", "triton")]


# --- The oracle itself, against bands worked out by hand. ---


def visible(length, window, dilation, causal, query):
    allowed, _ = band_pairs(length, window, (dilation,), causal, CPU)
    return set(allowed[0, query].nonzero().flatten().tolist())


def test_reference_band_by_hand():
    assert visible(10, 2, 1, False, 4) == {2, 3, 4, 5, 6}
    assert visible(10, 2, 1, False, 0) == {0, 1, 2}  # cut at the start
    assert visible(10, 2, 1, True, 4) == {2, 3, 4}
    assert visible(10, 1, 3, False, 4) == {1, 4, 7}  # dilation: steps of 3
    assert visible(10, 2, 3, True, 8) == {2, 5, 8}
    assert visible(3, 5, 1, False, 1) == {0, 1, 2}  # the window is longer than the sequence


def test_reference_bias_row_counts_window_steps():
    # Key 7 of query 4 at dilation 3 is one step ahead: row a + w = 1 + 2, whatever the distance in tokens.
    _, row = band_pairs(10, 2, (3,), False, CPU)
    assert row[0, 4, 7] == 3 and row[0, 4, 1] == 1 and row[0, 4, 4] == 2


def test_reference_matches_softmax_by_hand():
    torch.manual_seed(0)
    L, w, D = 7, 2, 3
    q, k, v = (torch.randn(1, 1, L, D, dtype=torch.float64) for _ in range(3))
    gk, gv = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    rel, gb = torch.randn(1, 2 * w + 1, dtype=torch.float64), torch.randn(1, 1, dtype=torch.float64)
    padding = torch.zeros(1, L, dtype=torch.bool)
    padding[0, 5] = True
    out = local_attention_1d(
        q,
        k,
        v,
        w,
        key_padding_mask=padding,
        global_k=gk,
        global_v=gv,
        rel_bias=rel,
        global_bias=gb,
        backend="reference",
    )
    i, scale = 4, D**-0.5
    scores = [float(q[0, 0, i] @ gk[0, 0, 0]) * scale + float(gb[0, 0])]
    values = [gv[0, 0, 0]]
    for j in (2, 3, 4, 6):  # 5 is padding
        scores.append(float(q[0, 0, i] @ k[0, 0, j]) * scale + float(rel[0, j - i + w]))
        values.append(v[0, 0, j])
    weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
    torch.testing.assert_close(out[0, 0, i], sum(wt * val for wt, val in zip(weights, values)))


# --- Every backend against the reference. ---

# (L, w, dilation, causal, G, rel_bias, global_bias, key padding): w 1..9 and 64; L below, at and above w;
# dilations 1..3 and per head; "random" masks about a third of the keys, "row" a whole sequence (its queries see
# no key when G is 0).
CASES = [
    (1, 1, 1, False, 0, True, False, None),
    (5, 7, 1, False, 1, True, True, "random"),
    (4, 4, 1, True, 2, True, True, None),
    (13, 3, 1, False, 1, True, True, "random"),
    (13, 3, 1, True, 0, True, False, "row"),
    (17, 2, 2, False, 1, False, True, "random"),
    (19, 5, 3, True, 2, True, True, "random"),
    (16, 6, (1, 2), False, 0, True, False, None),
    (23, 8, (3, 1), True, 1, True, True, "random"),
    (29, 9, 1, False, 0, False, False, None),
    (150, 64, 1, False, 1, True, True, "random"),
    (137, 64, 1, True, 0, True, False, None),
    (11, 1, 2, False, 0, True, False, "row"),
]


def make_inputs(L, w, G, rel, glob_bias, mask, B=2, H=2, D=4, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()

    inputs = dict(q=rand(B, H, L, D), k=rand(B, H, L, D), v=rand(B, H, L, D))
    inputs["global_k"] = rand(B, H, G, D) if G else None
    inputs["global_v"] = rand(B, H, G, D) if G else None
    inputs["rel_bias"] = rand(H, 2 * w + 1) if rel else None
    inputs["global_bias"] = rand(H, G) if glob_bias and G else None
    padding = None
    if mask == "random":
        padding = torch.rand(B, L, generator=gen) < 0.3
    elif mask == "row":
        padding = torch.zeros(B, L, dtype=torch.bool)
        padding[-1] = True
    return inputs, padding


def run(backend, inputs, padding, w, dilation=1, causal=False, grads=True, upstream=None):
    out = local_attention_1d(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        w,
        dilation=dilation,
        causal=causal,
        key_padding_mask=padding,
        global_k=inputs["global_k"],
        global_v=inputs["global_v"],
        rel_bias=inputs["rel_bias"],
        global_bias=inputs["global_bias"],
        backend=backend,
    )
    if not grads:
        return out, ()
    leaves = [t for t in inputs.values() if t is not None]
    return out, torch.autograd.grad(out, leaves, upstream_gradient(out, 1) if upstream is None else upstream)


@pytest.mark.parametrize("backend", TRAINING)
@pytest.mark.parametrize("dilation,causal", [(1, False), (1, True), (2, False), ((1, 3), True)])
def test_a_window_longer_than_the_sequence_with_a_bias_table_is_the_window_asked_for(backend, dilation, causal):
    """The op computes a window longer than the sequence as the longest it can use, its bias table cut to that
    window's offsets: against the reference's own function, called with the window and table asked for."""
    for L, w in ((5, 9), (7, 4), (1, 2)):
        inputs, padding = make_inputs(L, w, 1, True, True, "random", B=2)
        out, grads = run(backend, inputs, padding, w, dilation, causal)
        extras = Extras(4**-0.5, *(inputs[n] for n in ("global_k", "global_v", "rel_bias", "global_bias")), padding)
        hood = Neighborhood1d(w, dilation, causal)
        assert_matches_the_window_asked_for(out, grads, reference.attention_1d, inputs, hood, extras)


@pytest.mark.parametrize("backend", TRAINING)
@pytest.mark.parametrize("L,w,dilation,causal,G,rel,glob,mask", CASES)
def test_backend_matches_reference(backend, L, w, dilation, causal, G, rel, glob, mask):
    inputs, padding = make_inputs(L, w, G, rel, glob, mask)
    expected, expected_grads = run("reference", inputs, padding, w, dilation, causal)
    out, grads = run(backend, inputs, padding, w, dilation, causal)
    names = ["output"] + [n for n, t in inputs.items() if t is not None]
    for name, got, want in zip(names, (out, *grads), (expected, *expected_grads)):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")
    if mask == "row" and not G:
        assert not out[-1].any() and not grads[0][-1].any()  # no key: zeros and zero gradients


@pytest.mark.parametrize("L,w,dilation,causal,G,rel,glob,mask", CASES)
def test_flex_forward_matches_reference(L, w, dilation, causal, G, rel, glob, mask):
    inputs, padding = make_inputs(L, w, G, rel, glob, mask, D=16, dtype=torch.float32)
    with torch.no_grad():
        expected, _ = run("reference", inputs, padding, w, dilation, causal, grads=False)
        out, _ = run("flex", inputs, padding, w, dilation, causal, grads=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "L,w,dilation,causal,G",
    [(1000, 100, 1, False, 0), (1000, 100, 3, True, 2), (300, 7, 1, False, 130), (300, 2, (1, 70), False, 1)]
    + [(256, 1, 1, False, 0), (383, 1, 1, True, 1)],  # a band that starts at the last key of a block
)
def test_flex_band_blocks_are_those_of_the_evaluated_mask(monkeypatch, L, w, dilation, causal, G):
    # The key blocks the flex backend reads from the band's shape are exactly those where torch's create_block_mask,
    # which evaluates the backend's mask_mod on every pair of every head, finds a key (on the CPU FlexAttention reads
    # only the mask_mod: this checks the blocks that compiled FlexAttention skips on a GPU).
    from torch.nn.attention import flex_attention

    from vil.ops.backends import flex

    masks = []
    monkeypatch.setattr(flex_attention, "flex_attention", lambda *a, block_mask, **_: masks.append(block_mask) or a[0])
    inputs, _ = make_inputs(L, w, G, False, False, None, B=1, D=2, dtype=torch.float32)
    with torch.no_grad():
        run("flex", inputs, None, w, dilation, causal, grads=False)
    (ours,) = masks
    evaluated = flex_attention.create_block_mask(ours.mask_mod, 1, 2, L, G + L, device=CPU, BLOCK_SIZE=flex.BAND_BLOCK)
    assert torch.equal(ours.to_dense()[0, 0], evaluated.to_dense()[0].any(0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's FlexAttention has no backward on the CPU")
@pytest.mark.usefixtures("compiled_flex")
@pytest.mark.parametrize("L,w,dilation,causal,G,rel,glob,mask", CASES[1:6])
def test_flex_gradients_match_reference_on_cuda(L, w, dilation, causal, G, rel, glob, mask):
    inputs, padding = make_inputs(L, w, G, rel, glob, mask, D=16, dtype=torch.float32)
    cuda = {n: None if t is None else t.detach().cuda().requires_grad_() for n, t in inputs.items()}
    expected, expected_grads = run("reference", inputs, padding, w, dilation, causal)
    out, grads = run("flex", cuda, None if padding is None else padding.cuda(), w, dilation, causal)
    for got, want in zip((out, *grads), (expected, *expected_grads)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", [b for b in TRAINING if b != "fused_cpu"])  # fused_cpu: test_fused_cpu_1d.py
def test_gradcheck(backend):
    inputs, padding = make_inputs(9, 2, 1, True, True, "random", B=1, H=2, D=3)
    dilation = (1, 2)
    names = [n for n, t in inputs.items() if t is not None]

    def fn(*tensors):
        return run(backend, dict(zip(names, tensors)), padding, 2, dilation, False, grads=False)[0]

    assert torch.autograd.gradcheck(
        fn, tuple(inputs[n] for n in names), fast_mode=True
    )  # random projections of the Jacobian


@pytest.mark.parametrize("backend", ["sliding_chunk", "chunks"])
@pytest.mark.parametrize("L,w,dilation,causal,G,rel,glob,mask", [CASES[3], CASES[4], CASES[9], CASES[10], CASES[11]])
def test_blocked_backends_in_groups_of_one_block(monkeypatch, backend, L, w, dilation, causal, G, rel, glob, mask):
    # Long sequences run in groups of blocks (chunks) whose scores fit a budget; a budget of one byte makes every
    # block a group of its own, so the softmax of a query is merged across groups.
    monkeypatch.setitem(base.BLOCK_BYTES, "cpu", 1)
    inputs, padding = make_inputs(L, w, G, rel, glob, mask)
    expected, expected_grads = run("reference", inputs, padding, w, dilation, causal)
    out, grads = run(backend, inputs, padding, w, dilation, causal)
    for got, want in zip((out, *grads), (expected, *expected_grads)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend,dilation", [("sliding_chunk", 2), ("loop", 2), ("chunks", 2)])
def test_half_precision_inputs(backend, dilation):
    inputs, padding = make_inputs(40, 5, 1, True, True, "random", D=16, dtype=torch.float32)
    low = {n: None if t is None else t.detach().bfloat16().requires_grad_() for n, t in inputs.items()}
    out, grads = run(backend, low, padding, 5, dilation, True)
    # The reference in float64 from the same bfloat16 values: inputs and the gradient flowing into the output.
    wide = {n: None if t is None else t.detach().double().requires_grad_() for n, t in low.items()}
    upstream = upstream_gradient(out, 1).double()
    expected, expected_grads = run("reference", wide, padding, 5, dilation, True, upstream=upstream)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)
    names = [n for n, t in low.items() if t is not None]
    assert len(grads) == len(expected_grads) == len(names) == 7
    for name, got, want in zip(names, grads, expected_grads):
        torch.testing.assert_close(got.double(), want, rtol=5e-2, atol=5e-2, msg=lambda m, name=name: f"{name}: {m}")


def test_empty_batch():
    q = torch.randn(0, 2, 10, 4)
    assert local_attention_1d(q, q, q, 3, backend="sliding_chunk").shape == (0, 2, 10, 4)


def test_an_empty_batch_of_long_sequences_computes_nothing_and_gives_zero_gradients():
    """No backend runs for it: the reference, which took such requests, built its (query, key) pair tables for the
    8192 positions whatever the batch, 40 s and 7 GB. The bias tables, which have elements, get zero gradients."""
    q = torch.randn(0, 2, 8192, 4, requires_grad=True)
    rel_bias = torch.randn(2, 7, requires_grad=True)
    global_bias = torch.full((2, 1), float("-inf"), requires_grad=True)
    global_kv = torch.randn(0, 2, 1, 4, requires_grad=True)
    out = local_attention_1d(
        q, q, q, 3, rel_bias=rel_bias, global_k=global_kv, global_v=global_kv, global_bias=global_bias
    )
    assert out.shape == (0, 2, 8192, 4)
    grads = torch.autograd.grad(out, (q, rel_bias, global_kv, global_bias), torch.ones_like(out))
    assert grads[0].shape == q.shape and grads[2].shape == global_kv.shape
    assert torch.equal(grads[1], torch.zeros(2, 7)) and torch.equal(grads[3], torch.zeros(2, 1))


def test_default_backend():
    assert default_backend(CPU, torch.float32, dims=1) == "fused_cpu"
    q = torch.randn(1, 2, 30, 4, dtype=torch.float64)
    torch.testing.assert_close(
        local_attention_1d(q, q, q, 4, dilation=(1, 2)),
        local_attention_1d(q, q, q, 4, dilation=(1, 2), backend="reference"),
    )


# --- Bad input: one plain sentence each. ---


def _qkv(shape=(2, 2, 10, 4)):
    return [torch.randn(shape) for _ in range(3)]


@pytest.mark.parametrize("backend", TRAINING)
def test_a_nan_key_reaches_only_the_queries_that_see_it(backend):
    """Causal windows of 2: a NaN at key 7 reaches queries 7, 8, 9 and no earlier one (masks are set, not added)."""
    q = torch.randn(2, 1, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    k, v = q.clone(), torch.randn_like(q)
    k[0, 0, 7] = float("nan")
    out = local_attention_1d(q, k, v, 2, causal=True, backend=backend)
    assert out[0, 0].isnan().any(-1).nonzero().flatten().tolist() == [7, 8, 9]
    assert not out[1].isnan().any()


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(window=0), r"window must be a positive integer.*got 0"),
        (dict(shape=(2, 10, 4)), r"q must have shape.*\(2, 10, 4\)"),
        (dict(shape=(2, 2, 0, 4)), r"q has length 0"),
        (dict(shape=()), r"q must have shape \(B, heads, L, head_dim\), got \(\)"),
        (dict(backend=["loop"]), r"backend must be a backend's name or None, got a list"),
        (dict(k_shape=(2, 2, 9, 4)), r"k must have the shape of q.*\(2, 2, 9, 4\)"),
        (dict(dilation=0), r"dilation must be a positive integer.*got 0"),
        (dict(dilation=[1, 2, 3]), r"one int per head \(2\), got 3 values"),
        (dict(dilation=torch.tensor([[1, 2]])), r"one int per head \(2\), got an array of shape \(1, 2\)"),
        (
            dict(key_padding_mask=torch.zeros(2, 9, dtype=torch.bool)),
            r"key_padding_mask.*\(2, 10\).*bool.*\(2, 9\)",
        ),
        (
            dict(key_padding_mask=torch.zeros(2, 10)),
            r"key_padding_mask.*\(2, 10\).*torch.float32",
        ),
        (dict(rel_bias=torch.randn(2, 49)), r"rel_bias.*\(2, 7\), got \(2, 49\)"),
        (
            dict(key_padding_mask=torch.zeros(2, 10, dtype=torch.bool, device="meta")),
            r"key_padding_mask is on meta but q is on cpu",
        ),
        (dict(causal=1), r"causal must be True or False, got 1"),
        (dict(backend="unfold"), r"unfold.*does not compute 1D windows"),
        (dict(backend="nope"), r"'nope'; available: "),
        (
            dict(backend="flex", grad=True),
            r"flex.*cannot train on the CPU",
        ),
    ],
)
def test_bad_arguments_are_one_sentence(change, message):
    shape = change.pop("shape", (2, 2, 10, 4))
    q, k, v = _qkv(shape)
    if "k_shape" in change:
        k = torch.randn(*change.pop("k_shape"))
    if change.pop("grad", False):
        q.requires_grad_()
    window = change.pop("window", 3)
    with pytest.raises(ValueError, match=message) as err:
        local_attention_1d(q, k, v, window, **change)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dilation", [2, np.int64(2), (1, 2), [1, 2], np.array([1, 2]), torch.tensor([1, 2])])
def test_the_build_time_check_takes_every_dilation_the_op_takes(dilation):
    """check_backend_1d (the 1D layers' check when they are built) takes what local_attention_1d takes, and refuses
    what it refuses, in the same sentence."""
    q, k, v = _qkv((1, 2, 10, 4))
    local_attention_1d(q, k, v, 3, dilation=dilation, backend="sliding_chunk")
    for backend in (None, "sliding_chunk"):
        check_backend_1d(backend, 2, 4, 3, dilation, causal=True)
    with pytest.raises(ValueError, match=r"The unfold backend does not compute 1D windows; 1D backends: "):
        check_backend_1d("unfold", 2, 4, 3, dilation)
    with pytest.raises(ValueError, match=r"window must be a positive integer"):
        check_backend_1d(None, 2, 4, 0, dilation)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q: local_attention_1d(q.tolist(), q, q, 1), r"q must be a torch.Tensor, got a list"),
        (
            lambda q: local_attention_1d(q, q, q, 1, key_padding_mask=[[False] * 6]),
            r"key_padding_mask must be a torch.Tensor.*list",
        ),
        (lambda q: local_attention_1d(q, q, q, 1, scale="0.5"), r"scale must be a number"),
        (lambda q: local_attention_1d(q[..., :0], q[..., :0], q[..., :0], 1), r"q has head_dim 0"),
        (lambda q: local_attention_1d(*(q.to("meta"),) * 3, 1), r"q is on the meta device"),
    ],
)
def test_odd_inputs_are_one_sentence(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 2, 6, 4))


def test_an_enormous_window_or_dilation_covers_the_sequence():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    dense = torch.softmax(q @ k.transpose(-1, -2) * 4**-0.5, dim=-1) @ v
    torch.testing.assert_close(local_attention_1d(q, k, v, 10**9), dense, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(local_attention_1d(q, k, v, 1, dilation=50), v, rtol=1e-4, atol=1e-5)  # only itself


@pytest.mark.parametrize("backend", TRAINING)
def test_a_head_whose_dilation_is_beyond_any_length_sees_only_its_own_position(backend):
    """Head 1's dilation of 10^9 leaves each query itself; head 0 the band. The loop backend padded the keys by the
    dilation times the window, 8e9 positions (256 GB)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 4) for _ in range(3))
    out = local_attention_1d(q, k, v, 4, dilation=[1, 10**9], backend=backend)
    torch.testing.assert_close(out[:, 1], v[:, 1], rtol=1e-4, atol=1e-5)
    want = local_attention_1d(q, k, v, 4, dilation=[1, 10**9], backend="reference")
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def assert_products_counted(attend, pairs, head_dim):
    """torch's flop counter sees the two products over ``pairs`` scores of a forward ``attend()`` and the five of
    its backward (as a backend registers them, ``vil/ops/operators.py``)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = attend()
    assert counter.get_total_flops() == 2 * 2 * pairs * head_dim
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 5 * 2 * pairs * head_dim


@pytest.mark.parametrize("backend", ["reference", *TRAINING])
def test_a_query_that_is_not_a_number_gives_its_own_output_only_as_not_a_number(backend):
    q, k, v = (torch.randn(1, 1, 24, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    q[0, 0, 3, 1] = float("nan")
    out = local_attention_1d(q, k, v, 2, backend=backend)
    assert out[0, 0, 3].isnan().all() and not out[0, 0, torch.arange(24) != 3].isnan().any()


@pytest.mark.parametrize("backend", available_backends(1))
def test_a_huge_finite_bias_on_every_key_gives_the_mean_of_the_values(backend):
    """-1e31 on every offset hides nothing: the scores all round to -1e31, so each query outputs the mean of the
    values in its window."""
    q, k, v = (torch.randn(1, 2, 9, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = local_attention_1d(q, k, v, 2, rel_bias=torch.full((2, 5), -1e31), backend=backend)
    keys = (torch.arange(9)[:, None] - torch.arange(9)).abs() <= 2
    torch.testing.assert_close(out, (keys / keys.sum(1, keepdim=True)).float() @ v)


@pytest.mark.parametrize("backend", ["reference", *TRAINING])
def test_queries_whose_every_key_a_bias_hides_give_zeros(backend):
    q, k, v = (torch.randn(1, 2, 9, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    rel_bias = torch.full((2, 5), float("-inf"))
    rel_bias[:, 4] = 0.0  # only the key 2 positions ahead: the last 2 queries see none
    out = local_attention_1d(q, k, v, 2, rel_bias=rel_bias, backend=backend)
    torch.testing.assert_close(out[:, :, :7], v[:, :, 2:])
    assert (out[:, :, 7:] == 0).all()
