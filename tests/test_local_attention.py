"""local_attention_2d: the reference against hand-computed windows, every backend against the reference."""

import itertools
import os
import platform
import re
import subprocess
import sysconfig

import pytest
import torch
from test_fused_cpu_precision import assert_score_gradients_sum_to_zero

from vil.ops import available_backends, check_backend, default_backend, local_attention_1d, local_attention_2d
from vil.ops.backends import fused_cpu, reference
from vil.ops.backends.reference import window_pairs
from vil.ops.base import Extras
from vil.ops.neighborhood import Neighborhood2d
from vil.ops.registry import BACKENDS

# The Triton kernels have their own tests (tests/test_triton_kernels.py: interpreter, smaller problems), and
# so has FlexAttention (no backward on the CPU).
FAST_BACKENDS = [b for b in available_backends() if b not in ("reference", "triton", "flex")]
CPU = torch.device("cpu")


def visible(rows, cols, window, exact, mode, query):
    """The set of (row, col) keys the reference lets the local query at ``query`` see."""
    allowed, _ = window_pairs(rows, cols, window, exact, mode, CPU)
    row = allowed[query[0] * cols + query[1]]
    return {(int(i) // cols, int(i) % cols) for i in row.nonzero().flatten()}


def box(r0, r1, c0, c1):
    return {(i, j) for i in range(r0, r1) for j in range(c0, c1)}


# --- The oracle itself, against windows worked out by hand from the spec. ---


def test_reference_window_zero_padding():
    # 6x6 map, w=2: chunks are 2x2, a 3x3 grid of them. Query (2, 3) is in chunk (1, 1): sees everything.
    assert visible(6, 6, 2, 0, 0, (2, 3)) == box(0, 6, 0, 6)
    # Query (0, 0) in chunk (0, 0): chunks (0..1, 0..1) only.
    assert visible(6, 6, 2, 0, 0, (0, 0)) == box(0, 4, 0, 4)
    # 5x5 with w=2 pads to 6x6: the padded row/column are never keys.
    assert visible(5, 5, 2, 0, 0, (4, 4)) == box(2, 5, 2, 5)


def test_the_reference_scales_before_its_half_precision_products():
    # Products of about 1e5, over float16's 65504, scaled by 1e-3 into scores of about 100: finite, as in float64.
    gen = torch.Generator().manual_seed(0)
    q, k = (40 + torch.randn(1, 1, 4, 5, 64, generator=gen) for _ in range(2))
    v = torch.randn(1, 1, 4, 5, 64, generator=gen)
    for attention, to_input in ((local_attention_2d, lambda t: t), (local_attention_1d, lambda t: t.flatten(2, 3))):
        want = attention(*(to_input(t).double() for t in (q, k, v)), 2, scale=1e-3, backend="reference")
        got = attention(*(to_input(t).half() for t in (q, k, v)), 2, scale=1e-3, backend="reference")
        torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=0)


def test_reference_window_cyclic():
    # 6x6 map, w=2, cyclic: query (0, 0) in chunk (0, 0) sees chunk rows/cols {2, 0, 1}: everything.
    assert visible(6, 6, 2, -1, 0, (0, 0)) == box(0, 6, 0, 6)
    # 8x8 map, w=2 (4x4 chunks): chunk (0, 0) sees chunk rows/cols {3, 0, 1}.
    expected = {(i, j) for i in (6, 7, 0, 1, 2, 3) for j in (6, 7, 0, 1, 2, 3)}
    assert visible(8, 8, 2, -1, 0, (0, 0)) == expected


def test_reference_window_exact():
    # Exact window of radius 1 around (2, 2) in a 5x5 map; truncated at the corner for (0, 0).
    assert visible(5, 5, 1, 1, 0, (2, 2)) == box(1, 4, 1, 4)
    assert visible(5, 5, 1, 1, 0, (0, 0)) == box(0, 2, 0, 2)


def test_reference_window_dilated():
    # Dilation 2, radius 1 around (3, 3) in a 7x7 map: rows and columns 1, 3, 5; at (0, 1): rows 0, 2, columns 1, 3.
    def visible_dilated(query):
        allowed, index = window_pairs(7, 7, 1, 1, 0, CPU, 2)
        row = allowed[query[0] * 7 + query[1]]
        return {(int(i) // 7, int(i) % 7) for i in row.nonzero().flatten()}, index[query[0] * 7 + query[1]]

    keys, index = visible_dilated((3, 3))
    assert keys == {(i, j) for i in (1, 3, 5) for j in (1, 3, 5)}
    # The bias row counts offsets in steps of the dilation: key (1, 5) is (a, b) = (1, -1) steps away.
    assert index[1 * 7 + 5] == (1 + 1) * 3 + (-1 + 1)
    assert visible_dilated((0, 1))[0] == {(i, j) for i in (0, 2) for j in (1, 3)}


def test_reference_window_modes():
    # 6x6 map, w=2, query (2, 2) in chunk (1, 1). Mode -1: own chunk; mode 1: plus chunk (0, 0); mode 8: plus (2, 2).
    own = box(2, 4, 2, 4)
    assert visible(6, 6, 2, 0, -1, (2, 2)) == own
    assert visible(6, 6, 2, 0, 1, (2, 2)) == own | box(0, 2, 0, 2)
    assert visible(6, 6, 2, 0, 5, (2, 2)) == own | box(2, 4, 4, 6)
    assert visible(6, 6, 2, 0, 8, (2, 2)) == own | box(4, 6, 4, 6)
    # Mode 1 from chunk (0, 0) with zero padding: the neighbour is outside, only the own chunk remains.
    assert visible(6, 6, 2, 0, 1, (0, 0)) == box(0, 2, 0, 2)
    # ... and cyclic: the neighbour wraps to chunk (2, 2).
    assert visible(6, 6, 2, -1, 1, (0, 0)) == box(0, 2, 0, 2) | box(4, 6, 4, 6)


def test_reference_relative_bias_index():
    w = 2
    _, index = window_pairs(6, 6, w, 0, 0, CPU)
    # Query (2, 3), key (1, 5): di = 1, dj = -2 -> row (1 + 3) * 7 + (-2 + 3) = 29.
    assert index[2 * 6 + 3, 1 * 6 + 5] == 29
    # Cyclic, 8x8 map (4 chunks a side): query (0, 0), key (7, 7) is in the wrapped neighbour chunk (-1, -1):
    # nominal position (-1, -1), so di = dj = 1 -> row (1 + 3) * 7 + (1 + 3) = 32.
    _, index = window_pairs(8, 8, w, -1, 0, CPU)
    assert index[0, 7 * 8 + 7] == 32


def test_reference_cyclic_counts_each_key_once():
    # A 2x2 chunk grid: offsets -1 and +1 reach the same chunk. Each key once, at its direct (unwrapped) offset.
    w = 2
    allowed, index = window_pairs(4, 4, w, -1, 0, CPU)
    assert bool(allowed.all())
    # Query (0, 0), key (3, 3): direct offset (+1, +1) chunk -> di = dj = -3 -> row 0 * 7 + 0 = 0.
    assert index[0, 3 * 4 + 3] == 0
    q = torch.randn(1, 1, 4, 4, 3, dtype=torch.float64)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cyclic = local_attention_2d(q, k, v, w, exact=-1, backend="reference")
    zero_pad = local_attention_2d(q, k, v, w, exact=0, backend="reference")
    torch.testing.assert_close(cyclic, zero_pad)  # with 2 chunks a side both see all 16 keys once


def test_reference_matches_dense_softmax_by_hand():
    # One query row computed by hand: softmax over its visible keys plus one global key, with biases.
    torch.manual_seed(0)
    X, Y, w, D = 5, 4, 2, 3
    q, k, v = (torch.randn(1, 1, X, Y, D, dtype=torch.float64) for _ in range(3))
    gk, gv = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    rel = torch.randn(1, (4 * w - 1) ** 2, dtype=torch.float64)
    gb = torch.randn(1, 1, dtype=torch.float64)
    out = local_attention_2d(q, k, v, w, global_k=gk, global_v=gv, rel_bias=rel, global_bias=gb, backend="reference")
    qi, qj = 3, 1  # chunk (1, 0): sees chunk rows 0..2, chunk cols 0..1 -> rows 0..4, cols 0..3
    keys = box(0, 5, 0, 4)
    scale = D**-0.5
    scores = [float(q[0, 0, qi, qj] @ gk[0, 0, 0]) * scale + float(gb[0, 0])]
    values = [gv[0, 0, 0]]
    for ki, kj in sorted(keys):
        row = (qi - ki + 2 * w - 1) * (4 * w - 1) + (qj - kj + 2 * w - 1)
        scores.append(float(q[0, 0, qi, qj] @ k[0, 0, ki, kj]) * scale + float(rel[0, row]))
        values.append(v[0, 0, ki, kj])
    weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
    expected = sum(wt * val for wt, val in zip(weights, values))
    torch.testing.assert_close(out[0, 0, qi, qj], expected)


# --- Every backend against the reference. ---

WINDOWS = [(1, 0), (0, 0), (-1, 0)] + [(exact, mode) for exact in (0, -1) for mode in [-1] + list(range(1, 9))]
SHAPES = [
    (13, 17, 3),
    (8, 8, 4),
    (5, 6, 1),
    (7, 9, 2),
    (9, 11, 7),
    (4, 10, 3),
    (2, 9, 3),
    (5, 4, 7),
]  # last: one chunk along an axis; map smaller than w


def make_inputs(X, Y, w, G, rel, glob_bias, B=2, H=2, D=4, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device).requires_grad_()

    inputs = dict(q=rand(B, H, X, Y, D), k=rand(B, H, X, Y, D), v=rand(B, H, X, Y, D))
    inputs["global_k"] = rand(B, H, G, D) if G else None
    inputs["global_v"] = rand(B, H, G, D) if G else None
    inputs["rel_bias"] = rand(H, (4 * w - 1) ** 2) if rel else None
    inputs["global_bias"] = rand(H, G) if glob_bias and G else None
    return inputs


def run(backend, inputs, window, exact, mode, grad_seed=1, upstream=None):
    out = local_attention_2d(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        window,
        exact=exact,
        mode=mode,
        global_k=inputs["global_k"],
        global_v=inputs["global_v"],
        rel_bias=inputs["rel_bias"],
        global_bias=inputs["global_bias"],
        backend=backend,
    )
    leaves = [t for t in inputs.values() if t is not None]
    if upstream is None:
        upstream = upstream_gradient(out, grad_seed)
    return out, torch.autograd.grad(out, leaves, upstream)


def upstream_gradient(out, seed):
    """A random gradient for ``out``, drawn in float32 or wider, so that a half-precision run gets the float32 run's
    values (torch before 2.12 draws other values in half precision), and on the CPU, so that a GPU run gets them too."""
    wide = torch.promote_types(out.dtype, torch.float32)
    drawn = torch.randn(out.shape, dtype=wide, generator=torch.Generator().manual_seed(seed))
    return drawn.to(out.device, out.dtype)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("exact,mode", WINDOWS)
def test_backend_matches_reference(backend, exact, mode):
    for (X, Y, w), G in itertools.product(SHAPES, (0, 1, 2)):
        inputs = make_inputs(X, Y, w, G, rel=True, glob_bias=True)
        expected, expected_grads = run("reference", inputs, w, exact, mode)
        out, grads = run(backend, inputs, w, exact, mode)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", [b for b in available_backends(2) if b not in ("triton", "flex")])
@pytest.mark.parametrize("exact,mode,dilation", [(1, 0, 1), (1, 0, 2), (0, 0, 1), (-1, 0, 1), (0, 3, 1), (-1, 5, 1)])
def test_a_window_wider_than_the_map_with_a_bias_table_is_the_window_asked_for(backend, exact, mode, dilation):
    """The op computes a window wider than the map as the widest the map can use, its bias table cut to that window's
    offsets: against the reference's own function, called with the window and table asked for."""
    for X, Y, w in ((5, 4, 7), (2, 9, 12), (3, 3, 2)):
        inputs = make_inputs(X, Y, w, 1, rel=True, glob_bias=True, B=1)
        out, grads = run(backend, inputs, w, exact, mode) if dilation == 1 else run_dilated(backend, inputs, w)
        extras = Extras(4**-0.5, inputs["global_k"], inputs["global_v"], inputs["rel_bias"], inputs["global_bias"])
        hood = Neighborhood2d(w, exact, mode, dilation)
        assert_matches_the_window_asked_for(out, grads, reference.attention_2d, inputs, hood, extras)


def assert_matches_the_window_asked_for(out, grads, attention, inputs, hood, extras):
    """``out`` and ``grads`` (those of every input present, for the upstream gradient of seed 1) against the reference
    function ``attention`` called with ``hood`` and ``extras`` as they are, not fitted to the map."""
    expected = attention(inputs["q"], inputs["k"], inputs["v"], hood, extras)
    leaves = [t for t in inputs.values() if t is not None]
    expected_grads = torch.autograd.grad(expected, leaves, upstream_gradient(expected, 1))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def run_dilated(backend, inputs, w):
    """``run`` with the exact window dilated by 2."""
    kw = {name: t for name, t in inputs.items() if name not in ("q", "k", "v")}
    out = local_attention_2d(inputs["q"], inputs["k"], inputs["v"], w, exact=1, dilation=2, backend=backend, **kw)
    leaves = [t for t in inputs.values() if t is not None]
    return out, torch.autograd.grad(out, leaves, upstream_gradient(out, 1))


@pytest.mark.parametrize("backend", [b for b in available_backends(2) if b not in ("triton", "flex")])
def test_a_training_call_after_an_inference_mode_call_of_the_same_size_matches_reference(backend):
    """A validation loop under torch.inference_mode() at the training's map size builds the window tables first,
    and the backends keep them: the training call after it saves them for its backward (inference tensors could
    not be). The map size is this test's own, so that no other test built its tables before."""
    inputs = make_inputs(11, 6, 2, 1, rel=True, glob_bias=True)
    with torch.inference_mode():
        run_without_grad = local_attention_2d(
            *(inputs[n].detach() for n in ("q", "k", "v")), 2, rel_bias=inputs["rel_bias"].detach(), backend=backend
        )
    assert run_without_grad.is_inference()
    out, grads = run(backend, inputs, 2, 0, 0)
    expected, expected_grads = run("reference", inputs, 2, 0, 0)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("rel", [False, True])
def test_a_nan_key_reaches_only_the_queries_that_see_it(backend, rel):
    """The window's mask is set, not added: NaN + (-inf) would be NaN."""
    inputs = make_inputs(8, 8, 2, 0, rel=rel, glob_bias=False, B=1, H=1)
    k = inputs["k"].detach().clone()
    k[0, 0, 3, 3] = float("nan")
    rel_bias = inputs["rel_bias"] if rel else None
    want = local_attention_2d(inputs["q"], k, inputs["v"], 2, exact=1, rel_bias=rel_bias, backend="reference")
    got = local_attention_2d(inputs["q"], k, inputs["v"], 2, exact=1, rel_bias=rel_bias, backend=backend)
    assert int(want.isnan().any(-1).sum()) == 25  # the 5 x 5 queries around (3, 3)
    assert torch.equal(got.isnan(), want.isnan())


def test_integers_of_numpy_are_taken_as_ints():
    import numpy as np

    q = torch.randn(1, 1, 6, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = local_attention_2d(q, q, q, np.int64(2), exact=np.int32(0), mode=np.int64(3))
    assert torch.equal(got, local_attention_2d(q, q, q, 2, exact=0, mode=3))
    q1 = q.flatten(2, 3)[:, :, :, :2].expand(1, 2, 36, 2)
    want = local_attention_1d(q1, q1, q1, 2, dilation=(1, 2))
    for dilation in ((np.int64(1), 2), np.array([1, 2]), range(1, 3), [1, 2]):
        assert torch.equal(local_attention_1d(q1, q1, q1, np.int64(2), dilation=dilation), want)
    assert torch.equal(
        local_attention_1d(q1, q1, q1, 2, dilation=np.int64(2)), local_attention_1d(q1, q1, q1, 2, dilation=2)
    )


@pytest.mark.parametrize("exact,mode", [(1, 0), (0, 0), (-1, 0), (0, 3)])
def test_fused_cpu_windows_wider_than_a_thin_map(exact, mode):
    """Its buffers hold a chunk as the map clips it (a w x w tile would be 9 w^2 keys per query row and thread)."""
    for X, Y, w in ((2, 13, 12), (3, 5, 8), (14, 2, 6)):
        inputs = make_inputs(X, Y, w, 1, rel=True, glob_bias=True, B=1)
        expected, expected_grads = run("reference", inputs, w, exact, mode)
        out, grads = run("fused_cpu", inputs, w, exact, mode)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_cpu_follows_biases_changed_in_place_between_calls(dtype):
    # The kernel keeps the bias tables of its recent calls, found again by the biases' values: biases changed in
    # place, as an optimizer step changes them, give the reference's results at the next call.
    inputs = make_inputs(9, 7, 3, 1, rel=True, glob_bias=True, dtype=dtype)
    before, _ = run("fused_cpu", inputs, 3, 0, 0)
    with torch.no_grad():
        inputs["rel_bias"].mul_(-2.0).add_(0.5)
        inputs["global_bias"].add_(1.0)
    out, grads = run("fused_cpu", inputs, 3, 0, 0)
    expected, expected_grads = run("reference", inputs, 3, 0, 0)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    assert not torch.allclose(out, before, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("rel,glob_bias,G", [(False, False, 0), (False, False, 1), (True, False, 1), (False, True, 2)])
def test_backend_matches_reference_without_some_inputs(backend, rel, glob_bias, G):
    inputs = make_inputs(7, 9, 3, G, rel=rel, glob_bias=glob_bias)
    expected, expected_grads = run("reference", inputs, 3, 0, 0)
    out, grads = run(backend, inputs, 3, 0, 0)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("exact,mode", [(1, 0), (0, 0), (-1, 0), (0, 3), (-1, -1)])
def test_gradcheck(backend, exact, mode):
    inputs = make_inputs(3, 5, 2, 1, rel=True, glob_bias=True, B=1, H=2, D=2)
    names = list(inputs)

    def fn(*tensors):
        kw = dict(zip(names, tensors))
        return local_attention_2d(
            kw.pop("q"), kw.pop("k"), kw.pop("v"), 2, exact=exact, mode=mode, backend=backend, **kw
        )

    assert torch.autograd.gradcheck(fn, tuple(inputs.values()), fast_mode=True)  # random projections of the Jacobian


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("scale", [0.3, -0.3])  # negative: the softmax's row maximum, lanes past a row's end left out
def test_float32_and_explicit_scale(backend, scale):
    inputs = make_inputs(14, 14, 7, 1, rel=True, glob_bias=True, dtype=torch.float32, D=8)
    expected = local_attention_2d(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        7,
        global_k=inputs["global_k"],
        global_v=inputs["global_v"],
        scale=scale,
        backend="reference",
    )
    out = local_attention_2d(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        7,
        global_k=inputs["global_k"],
        global_v=inputs["global_v"],
        scale=scale,
        backend=backend,
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # A scale s is the default 1/sqrt(D) applied to queries multiplied by s * sqrt(D).
    rescaled = local_attention_2d(
        inputs["q"] * (scale * 8**0.5),
        inputs["k"],
        inputs["v"],
        7,
        global_k=inputs["global_k"],
        global_v=inputs["global_v"],
        backend=backend,
    )
    torch.testing.assert_close(out, rescaled, rtol=1e-5, atol=1e-5)


def test_large_batch_spans_several_blocks():
    # Enough batch and chunks that the hand-written backend works in several (batch, chunk) blocks.
    inputs = make_inputs(42, 35, 7, 1, rel=True, glob_bias=True, B=3, H=3, D=4, dtype=torch.float32)
    expected, expected_grads = run("reference", inputs, 7, 0, 0)
    out, grads = run("sliding_chunk", inputs, 7, 0, 0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sliding_chunk_in_blocks_of_one_chunk(monkeypatch):
    # Large maps are processed a few chunks at a time: a budget of one byte makes every chunk a block of its own.
    from vil.ops import base

    monkeypatch.setitem(base.BLOCK_BYTES, "cpu", 1)
    assert base.items_per_block(4096, CPU) == 1  # the CPU's budget, not a GPU's, on the CPU
    for exact in (0, 1):
        inputs = make_inputs(11, 9, 3, 2, rel=True, glob_bias=True, B=2, H=2)
        expected, expected_grads = run("reference", inputs, 3, exact, 0)
        out, grads = run("sliding_chunk", inputs, 3, exact, 0)
        torch.testing.assert_close(out, expected)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want)


def test_chunk_rows_in_blocks_of_one_batch_entry(monkeypatch):
    # Large inputs are processed a chunk row and a few batch entries at a time: force one entry per block.
    from vil.ops.backends import chunk_rows

    monkeypatch.setattr(chunk_rows, "_BLOCK_BYTES", 1)
    inputs = make_inputs(9, 8, 3, 2, rel=True, glob_bias=True, B=3, H=2)
    expected, expected_grads = run("reference", inputs, 3, -1, 0)
    out, grads = run("chunk_rows", inputs, 3, -1, 0)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_default_backend_is_a_fast_one():
    assert default_backend(CPU, torch.float32) == "fused_cpu"
    assert default_backend(CPU, torch.bfloat16) == "fused_cpu"
    inputs = make_inputs(6, 6, 2, 1, rel=False, glob_bias=False)
    expected, _ = run("reference", inputs, 2, 0, 0)
    out, _ = run(None, inputs, 2, 0, 0)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_dilation_runs_per_sub_lattice(backend):
    # Backends without dilated windows of their own compute each sub-lattice of equal residues separately.
    for X, Y, w, d in ((9, 7, 2, 2), (8, 10, 1, 3)):
        inputs = make_inputs(X, Y, w, 1, rel=True, glob_bias=True)
        leaves = [t for t in inputs.values() if t is not None]
        outs = []
        for name in ("reference", backend):
            out = local_attention_2d(
                inputs["q"],
                inputs["k"],
                inputs["v"],
                w,
                exact=1,
                dilation=d,
                backend=name,
                **{k: v for k, v in inputs.items() if k not in "qkv"},
            )
            outs.append((out, torch.autograd.grad(out.square().sum(), leaves)))
        torch.testing.assert_close(outs[1][0], outs[0][0])
        for got, want in zip(outs[1][1], outs[0][1]):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("exact,mode", WINDOWS)
def test_the_pairwise_window_is_the_reference_window(exact, mode):
    # FlexAttention's mask and score modifiers see the window one (query, key) pair at a time
    # (geometry.pair_in_window_2d): the same pairs and bias rows as the oracle's mask, with 1, 2, 3 and more chunks
    # along an axis, after two global keys.
    from vil.ops.geometry import pair_in_window_2d

    for rows, cols, w, dilation in ((7, 9, 2, 1), (5, 4, 7, 1), (4, 6, 2, 1), (6, 3, 3, 1), (9, 9, 3, 1), (9, 8, 2, 2)):
        if dilation > 1 and exact != 1:
            continue
        allowed, index = window_pairs(rows, cols, w, exact, mode, CPU, dilation)
        queries, keys = torch.arange(rows * cols)[:, None], 2 + torch.arange(rows * cols)[None, :]
        got, rows_of_bias = pair_in_window_2d(queries, keys, Neighborhood2d(w, exact, mode, dilation), rows, cols, 2)
        assert torch.equal(got, allowed), (rows, cols, w)
        assert torch.equal(rows_of_bias[allowed], index[allowed]), (rows, cols, w)


# Every window of the zero-padded chunks; of the cyclic ones, the own chunk, all nine and a corner and a side
# neighbour (the modes share one block-mask rule; torch's FlexAttention takes seconds per call on the CPU).
FLEX_WINDOWS = [w for w in WINDOWS if w[0] != -1 or w[1] in (-1, 0, 3, 8)]


@pytest.mark.parametrize("exact,mode", FLEX_WINDOWS)
def test_flex_forward_matches_reference(exact, mode):
    # On the CPU torch's FlexAttention runs forward only (the gradients are tested on CUDA below).
    for X, Y, w, G in ((7, 9, 2, 2), (5, 4, 7, 0)):
        inputs = make_inputs(X, Y, w, G, rel=True, glob_bias=True, dtype=torch.float32, D=16)
        with torch.no_grad():
            expected, _ = run_forward("reference", inputs, w, exact, mode)
            out, _ = run_forward("flex", inputs, w, exact, mode)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_flex_dilated_forward_matches_reference():
    inputs = make_inputs(9, 8, 1, 1, rel=True, glob_bias=True, dtype=torch.float32, D=16)
    with torch.no_grad():
        torch.testing.assert_close(
            run_forward("flex", inputs, 1, 1, 0, dilation=2)[0],
            run_forward("reference", inputs, 1, 1, 0, dilation=2)[0],
            rtol=1e-5,
            atol=1e-5,
        )


def run_forward(backend, inputs, window, exact, mode, dilation=1):
    kw = {name: t for name, t in inputs.items() if name not in ("q", "k", "v")}
    return local_attention_2d(
        inputs["q"], inputs["k"], inputs["v"], window, exact=exact, mode=mode, dilation=dilation, backend=backend, **kw
    ), kw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's FlexAttention has no backward on the CPU")
@pytest.mark.usefixtures("compiled_flex")
@pytest.mark.parametrize("exact,mode", [(1, 0), (0, 0), (-1, 0), (0, 3), (-1, -1)])
def test_flex_gradients_match_reference_on_cuda(exact, mode):
    # Four shapes, with and without a global key: each is a compilation of its own (seconds on the GPU's host).
    for (X, Y, w), G in zip(SHAPES[:4], (0, 1, 1, 0)):
        inputs = {
            n: None if t is None else t.detach().float().cuda().requires_grad_()
            for n, t in make_inputs(X, Y, w, G, rel=True, glob_bias=True, D=16).items()
        }
        expected, expected_grads = run("reference", inputs, w, exact, mode)
        out, grads = run("flex", inputs, w, exact, mode)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_flex_refuses_to_train_on_the_cpu():
    inputs = make_inputs(6, 6, 2, 1, rel=True, glob_bias=True, dtype=torch.float32, D=16)
    with pytest.raises(ValueError, match="flex.*cannot train on the CPU") as err:
        run("flex", inputs, 2, 0, 0)
    can = str(err.value).split(";")[1]
    assert all(name in can for name in ("sliding_chunk", "fused_cpu", "reference")) and "flex" not in can


def test_default_falls_back_to_sliding_chunk_with_one_warning(monkeypatch, caplog):
    import dataclasses

    from vil.ops import registry

    def no_compiler():
        raise ValueError("The fused_cpu backend could not build its C++ kernel (no compiler).")

    fused_cpu = dataclasses.replace(registry.BACKENDS["fused_cpu"], available=no_compiler)
    monkeypatch.setitem(registry.BACKENDS, "fused_cpu", fused_cpu)
    monkeypatch.setattr(registry, "_warned_passed_over", set())
    with caplog.at_level("WARNING", logger=registry.__name__):
        assert default_backend(CPU, torch.float32) == "sliding_chunk"
        assert default_backend(CPU, torch.float64) == "sliding_chunk"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        len(warnings) == 1 and "(no compiler)" in warnings[0] and warnings[0].endswith("Using sliding_chunk instead.")
    )
    assert default_backend(torch.device("meta"), torch.float32) == "sliding_chunk"


def test_default_passes_over_a_backend_of_other_dtypes_with_one_warning(monkeypatch, caplog):
    # CUDA is only named here: choosing runs nothing there. The triton kernels take no float64.
    from vil.ops import registry

    monkeypatch.setattr(registry, "_warned_passed_over", set())
    cuda = torch.device("cuda")
    with caplog.at_level("WARNING", logger=registry.__name__):
        for dims in (2, 1, 2):
            assert default_backend(cuda, torch.float64, dims) == "sliding_chunk"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert re.match(r"The triton backend takes float32, float16 or bfloat16 inputs, got torch\.float64\. ", warnings[0])
    assert warnings[0].endswith("Using sliding_chunk instead.")


@pytest.fixture
def forget_fused_cpu_build():
    """Lets a test fail the C++ build; torch's cached build is loaded again afterwards."""
    fused_cpu._build.cache_clear()
    yield fused_cpu
    fused_cpu._build.cache_clear()


def test_fused_cpu_build_failure_is_one_sentence_and_not_retried(monkeypatch, forget_fused_cpu_build):
    from torch.utils import cpp_extension

    attempts = []

    def broken_load(**kwargs):
        attempts.append(kwargs["name"])
        raise RuntimeError("Ninja is required to load C++ extensions\n(more lines)")

    monkeypatch.setattr(cpp_extension, "load", broken_load)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"fused_cpu.*\(Ninja is required.*sliding_chunk") as err:
            forget_fused_cpu_build.check_fused_cpu()
        assert "more lines" not in str(err.value)  # the error's first line only
    assert attempts[-1] == "vil_local_attention_cpu"  # the build for any CPU was tried after the vectorised one
    assert len(attempts) == len(set(attempts))  # and nothing was built twice


def test_a_compiler_that_fails_its_version_check_is_a_build_failure(monkeypatch, forget_fused_cpu_build):
    """torch asks ``c++ --version`` before it builds; a broken compiler fails there, with a subprocess error."""
    from torch.utils import cpp_extension

    def compiler_fails(**kwargs):
        raise subprocess.CalledProcessError(1, ["c++", "--version"])

    monkeypatch.setattr(cpp_extension, "load", compiler_fails)
    with pytest.raises(ValueError, match=r"fused_cpu.*could not build.*c\+\+', '--version'.*sliding_chunk"):
        forget_fused_cpu_build.check_fused_cpu()


@pytest.mark.parametrize("bf16", [True, False])
def test_fused_cpu_builds_one_name_per_instruction_set(monkeypatch, bf16):
    # A build cache may be shared between CPUs: a build that uses AVX512-BF16 must never carry the name of one
    # that does not, and a CPU without the extension must not try it.
    monkeypatch.setattr(fused_cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    builds = fused_cpu._builds(["-O3"])
    names = [name for name, _, _ in builds]
    assert len(set(names)) == len(names) and names[-1] == "vil_local_attention_cpu"
    with_bf16 = [name for name, flags, _ in builds if "-mavx512bf16" in flags]
    assert with_bf16 == (["vil_local_attention_cpu_x86_64_v4_bf16"] if bf16 else [])
    assert builds[0][0] == ("vil_local_attention_cpu_x86_64_v4_bf16" if bf16 else "vil_local_attention_cpu_x86_64_v4")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the kernel's instruction-set paths are x86-64's")
def test_fused_cpu_source_compiles_for_the_instruction_sets_this_cpu_lacks(monkeypatch):
    # The other tests run the path of this CPU's build only; the compiler checks the builds other x86-64 CPUs make
    # (AVX-512 with and without AVX512-BF16, AVX2), whose #if branches differ: a branch that did not compile left
    # every CPU without AVX-512 with no fused_cpu.
    from torch.utils import cpp_extension

    def first_build(capability, bf16):
        with monkeypatch.context() as patch:
            patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
            patch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
            return fused_cpu._builds(fused_cpu.COMPILER_FLAGS)[0]

    own_name = fused_cpu._builds(fused_cpu.COMPILER_FLAGS)[0][0]
    builds = [first_build(*cpu) for cpu in (("AVX512", True), ("AVX512", False), ("AVX2", False))]
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    common = [os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++20", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    common += [f"-isystem{path}" for path in includes]
    compilers = {  # at once, one per core
        target: subprocess.Popen([*common, *flags, str(fused_cpu.kernel_source())], stderr=subprocess.PIPE, text=True)
        for name, flags, target in builds
        if name != own_name
    }
    for target, compiler in compilers.items():
        errors = compiler.communicate(timeout=600)[1]
        assert compiler.returncode == 0, f"{target}: {errors[:3000]}"


def fused_cpu_arguments_2d():
    """The arguments of the C++ kernels' 2D forward and backward (``torch.ops.vil_local_attention_cpu``) for a
    5 x 5 map of 2 heads, w = 2 (3 x 3 chunks), one global key and both bias tables, by name."""
    q, k, v, out, grad_out = (torch.randn(1, 2, 5, 5, 8) for _ in range(5))
    gk, gv = (torch.randn(1, 2, 1, 8) for _ in range(2))
    return dict(
        q=q,
        k=k,
        v=v,
        global_k=gk,
        global_v=gv,
        rel_bias=torch.zeros(2, 49),
        global_bias=torch.zeros(2, 1),
        slots=fused_cpu._slot_table(5, 5, 2, 0, 0),
        out=out,
        grad_out=grad_out,
        lse=torch.zeros(1, 2, 5, 5),
        grad_q=torch.empty_like(q),
        grad_k=torch.empty_like(k),
        grad_v=torch.empty_like(v),
        grad_global_k=torch.zeros_like(gk),
        grad_global_v=torch.zeros_like(gv),
        grad_rel_bias=torch.zeros(1, 2, 49),
        grad_global_bias=torch.zeros(1, 2, 1),
        window=2,
        exact=0,
        scale=0.25,
        half_products=False,
    )


FUSED_CPU_FORWARD_2D = "q k v global_k global_v rel_bias global_bias slots out lse window exact scale half_products"
FUSED_CPU_BACKWARD_2D = (
    "q k v global_k global_v rel_bias global_bias slots out grad_out lse grad_q grad_k grad_v grad_global_k "
    "grad_global_v grad_rel_bias grad_global_bias window exact scale half_products"
)


def naming_chunk_9(slots):
    """The slot table with chunk 8's first slot naming a chunk past the map's nine."""
    slots = slots.clone()
    slots[8, 0, 0] = 9
    return slots


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("k", torch.randn(1, 2, 2, 2, 8), r"k must have q's shape \[1, 2, 5, 5, 8\] .* got shape \[1, 2, 2, 2, 8\]"),
        ("out", torch.randn(1, 2, 5, 5, 16)[..., ::2], r"out must have unit stride along head_dim, got strides"),
        ("lse", torch.zeros(0), r"lse must have shape \[1, 2, 5, 5\], got \[0\]"),
        (
            "slots",
            lambda _: fused_cpu._slot_table(3, 3, 2, 0, 0),
            r"slots must be .* \(9, at most 9, 3\), got .* \[4, 9, 3\]",
        ),
        ("slots", naming_chunk_9, r"slots holds the row \(9, -1, -1\), .* chunk in -1\.\.8 and an offset .* -1\.\.1"),
        ("rel_bias", torch.zeros(2, 1), r"rel_bias must have shape \[2, 49\] \(or be empty\), got \[2, 1\]"),
        ("global_bias", torch.zeros(1, 2), r"global_bias must have shape \[2, 1\] \(or be empty\), got \[1, 2\]"),
        ("global_v", torch.randn(1, 2, 3, 8), r"global_v must have shape \[1, 2, 1, 8\], got \[1, 2, 3, 8\]"),
        ("global_k", torch.randn(2, 1, 8), r"global_k must have shape \(B, H, G, D\), got \[2, 1, 8\]"),
        ("window", 0, r"window must be at least 1, got 0"),
        ("exact", 2, r"exact must be -1, 0 or 1, got 2"),
        ("half_products", True, r"half_products takes bfloat16 or float16 inputs, got Float"),
        ("grad_out", torch.randn(1, 2, 5, 4, 8), r"grad_out must have q's shape .* got shape \[1, 2, 5, 4, 8\]"),
        ("grad_global_k", torch.zeros(2, 1, 8), r"grad_global_k must have shape \[1, 2, 1, 8\], got \[2, 1, 8\]"),
        ("grad_rel_bias", torch.zeros(2, 49), r"grad_rel_bias must have shape \[1, 2, 49\] \(or be empty\)"),
    ],
)
def test_fused_cpu_kernels_refuse_other_shapes_in_one_sentence(name, value, message):
    # The C++ entry points check everything they index with, so that no call reads or writes past a tensor.
    arguments = fused_cpu_arguments_2d()
    arguments[name] = value(arguments[name]) if callable(value) else value
    ops = fused_cpu._kernels()
    backward = name.startswith("grad")
    names = (FUSED_CPU_BACKWARD_2D if backward else FUSED_CPU_FORWARD_2D).split()
    with pytest.raises(RuntimeError, match=f"^local_attention_cpu: {message}"):
        (ops.backward if backward else ops.forward)(*(arguments[n] for n in names))


def _attend(backend, dims):
    """A function of q alone (k, v fixed, float64) through ``backend``, 2D or 1D."""
    gen = torch.Generator().manual_seed(3)
    shape = (1, 2, 5, 6, 4) if dims == 2 else (1, 2, 9, 4)
    k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))
    attention = local_attention_2d if dims == 2 else local_attention_1d
    return torch.randn(shape, generator=gen, dtype=torch.float64), lambda q: attention(q, k, v, 2, backend=backend)


@pytest.mark.parametrize("dims", [1, 2])
def test_the_lowest_finite_bias_masks_on_every_backend_as_in_the_reference(dims):
    """torch.finfo(dtype).min as a bias, a common masking value: the backends that compute in base 2 multiplied it by
    log2(e) into -inf and gave a query whose keys all had it zeros, where the reference, adding a finite value,
    averages the values. Head 0 has it on every key (global key too): its outputs are compared (its gradients are
    a documented limit); head 1 on some keys: its outputs and every gradient."""
    gen = torch.Generator().manual_seed(7)
    shape = (2, 2, 6, 5, 4) if dims == 2 else (2, 2, 9, 4)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    global_k, global_v = (torch.randn(2, 2, 1, 4, generator=gen) for _ in range(2))
    lowest = torch.finfo(torch.float32).min
    rel_bias = torch.randn(2, 49 if dims == 2 else 5, generator=gen)
    rel_bias[0] = lowest
    rel_bias[1, ::3] = lowest
    global_bias = torch.tensor([[lowest], [0.5]])
    inputs = (q, k, v, global_k, global_v, rel_bias, global_bias)
    attention = local_attention_2d if dims == 2 else local_attention_1d

    def outputs_and_gradients(backend):
        """The output, then the gradients of head 1's outputs."""
        leaves = [t.clone().requires_grad_() for t in inputs]
        q, k, v, global_k, global_v, rel_bias, global_bias = leaves
        out = attention(
            q,
            k,
            v,
            2,
            global_k=global_k,
            global_v=global_v,
            rel_bias=rel_bias,
            global_bias=global_bias,
            backend=backend,
        )
        head_1 = out[:, 1]
        grads = torch.autograd.grad(head_1, leaves, upstream_gradient(head_1, 8), allow_unused=True)
        return out, *(g[1] if g.dim() == 2 else g[:, 1] for g in grads)

    want = outputs_and_gradients("reference")
    assert want[0][:, 0].abs().max() < 3  # the head whose keys are all masked averages its values
    for backend in (b for b in FAST_BACKENDS if BACKENDS[b].computes(dims)):
        for got, expected in zip(outputs_and_gradients(backend), want):
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=backend)


@pytest.mark.parametrize("backend,dims", [("fused_cpu", 2), ("sliding_chunk", 2), ("chunk_rows", 2), ("chunks", 1)])
def test_function_transforms_are_refused_by_backends_they_cannot_see_through(backend, dims):
    # Their passes or autograd functions would give forward-mode AD no tangent (a zero or missing derivative), and
    # torch.func.grad failed inside torch; torch.func.vmap alone maps the fused passes as it should.
    q, attend = _attend(backend, dims)
    transforms = {
        "torch.func.grad": lambda: torch.func.grad(lambda x: attend(x).sum())(q),
        r"forward-mode AD \(torch.func.jvp\)": lambda: torch.func.jvp(attend, (q,), (torch.ones_like(q),)),
    }
    for name, transform in transforms.items():
        with pytest.raises(RuntimeError, match=f"^{name} cannot differentiate the {backend} backend") as err:
            transform()
        assert str(err.value).endswith(" or reference.")
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError, match=r"^forward-mode AD \(torch.autograd.forward_ad\) cannot differentiate"):
            attend(dual)
    if backend in ("fused_cpu", "sliding_chunk"):
        batched = torch.func.vmap(attend)(q.unsqueeze(1))  # over a batch axis of its own
        torch.testing.assert_close(batched.squeeze(1), attend(q))
    else:  # their autograd functions loop over the batch
        with pytest.raises(RuntimeError, match=f"^torch.func.vmap cannot map the {backend} backend.*reference"):
            torch.func.vmap(attend)(q.unsqueeze(1))


@pytest.mark.parametrize("dims", [1, 2])
def test_vmap_of_flex_is_refused_naming_the_backends_it_maps(dims):
    """torch's FlexAttention failed inside torch.func.vmap (a fake tensor call), where the op refuses in one sentence
    and names the backends that vmap maps."""
    q, attend = _attend("flex", dims)
    with pytest.raises(RuntimeError, match=r"^torch.func.vmap cannot map the flex backend.*fused_cpu") as err:
        torch.func.vmap(attend)(q.unsqueeze(1))
    assert "flex" not in str(err.value).split(":")[-1]


@pytest.mark.parametrize("backend,dims", [("unfold", 2), ("sliding_chunk_autograd", 2), ("reference", 1)])
def test_forward_mode_ad_through_backends_of_standard_operators(backend, dims):
    q, attend = _attend(backend, dims)
    tangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    _, got = torch.func.jvp(attend, (q,), (tangent,))
    eps = 1e-6  # central difference in float64
    torch.testing.assert_close(got, (attend(q + eps * tangent) - attend(q - eps * tangent)) / (2 * eps))
    grad = torch.func.grad(lambda x: attend(x).square().sum())(q)
    leaf = q.clone().requires_grad_()
    attend(leaf).square().sum().backward()
    torch.testing.assert_close(grad, leaf.grad)


@pytest.mark.parametrize("backend", ["sliding_chunk", "fused_cpu"])
def test_eager_calls_and_the_operator_compute_the_same(backend):
    # Eagerly the fused passes run under an autograd function of their own; where something watches operators (here
    # the profiler) through the registered operator. The same passes either way: the same bits.
    inputs = make_inputs(9, 7, 3, 1, rel=True, glob_bias=True)
    eager_out, eager_grads = run(backend, inputs, 3, 0, 0)
    with torch.profiler.profile() as profiler:
        out, grads = run(backend, inputs, 3, 0, 0)
    assert "_EagerPasses" in type(eager_out.grad_fn).__name__ and "_EagerPasses" not in type(out.grad_fn).__name__
    assert {"vil::local_attention_2d", "vil::local_attention_2d_backward"} <= {e.key for e in profiler.key_averages()}
    assert torch.equal(out, eager_out) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


def test_fused_cpu_gradients_are_not_differentiated_again():
    inputs = make_inputs(4, 4, 2, 0, rel=False, glob_bias=False)
    weights = torch.randn(2, 2, 4, 4, 4, dtype=torch.float64)
    # Eagerly, asking for gradients of the gradients is refused when the backward runs, also where the upstream
    # gradient is a constant (a gradient penalty), whose second-order terms would otherwise be lost.
    for loss in (lambda out: out.square().sum(), lambda out: (out * weights).sum()):
        out = local_attention_2d(inputs["q"], inputs["k"], inputs["v"], 2, backend="fused_cpu")
        with pytest.raises(RuntimeError, match="fused_cpu backend's backward is not differentiable") as err:
            torch.autograd.grad(loss(out), inputs["q"], create_graph=True)
        assert "sliding_chunk_autograd, unfold, unfold_nnf or reference." in str(err.value)
    one_d = torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True)
    out = local_attention_1d(one_d, one_d, one_d, 2, backend="fused_cpu")
    with pytest.raises(RuntimeError, match=r"backward is autograd's: loop or reference\.$"):
        torch.autograd.grad(out.square().sum(), one_d, create_graph=True)
    qkv = inputs["q"], inputs["k"], inputs["v"]
    # The backends with a hand-written backward in Python refuse the second backward as the fused ones do, also
    # for a constant upstream gradient (a gradient penalty: once_differentiable let that through, with wrong numbers).
    for name, q, attend in (
        ("chunks", one_d, lambda: local_attention_1d(one_d, one_d, one_d, 2, backend="chunks")),
        ("chunk_rows", inputs["q"], lambda: local_attention_2d(*qkv, 2, backend="chunk_rows")),
    ):
        for loss in (lambda out: out.sum(), lambda out: out.square().sum()):
            with pytest.raises(RuntimeError, match=f"The {name} backend's backward is not differentiable.*autograd's"):
                torch.autograd.grad(loss(attend()), q, create_graph=True)
    # Through the operator (under torch.compile, the profiler, a dispatch mode) the backward operator has no autograd
    # formula, which stops the second backward.
    with torch.profiler.profile():
        out = local_attention_2d(inputs["q"], inputs["k"], inputs["v"], 2, backend="fused_cpu")
        (grad_q,) = torch.autograd.grad(out.square().sum(), inputs["q"], create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        grad_q.sum().backward()


@pytest.mark.parametrize("backend", [b for b in available_backends(2) if b != "flex"])
def test_dilated_windows_in_bfloat16_with_every_extra(backend):
    """Dilated windows split per sub-lattice share float32 copies of the global keys and bias tables (so that their
    gradients are summed in float32); each piece takes them in the dtype the backend reads: bfloat16 out, close to
    the reference. (Backends that read them only in q's dtype failed on the float32 copies.)"""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 6, 16, generator=gen) for _ in range(3))
    gk, gv = (torch.randn(1, 2, 1, 16, generator=gen) for _ in range(2))
    rel_bias, global_bias = torch.randn(2, 9, generator=gen), torch.randn(2, 1, generator=gen)
    extras = dict(global_k=gk, global_v=gv, rel_bias=rel_bias, global_bias=global_bias)
    for dilation in (2, 5):  # 5: past a side of the map, which every backend splits
        want = local_attention_2d(
            *(t.double() for t in (q, k, v)),
            1,
            exact=1,
            dilation=dilation,
            backend="reference",
            **{n: t.double() for n, t in extras.items()},
        )
        out = local_attention_2d(
            *(t.bfloat16() for t in (q, k, v)),
            1,
            exact=1,
            dilation=dilation,
            backend=backend,
            **{n: t.bfloat16() for n, t in extras.items()},
        )
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)


def assert_backward_inside_autocast_gives_the_gradients_outside(attend, tensors):
    """``attend(*tensors)`` under bfloat16 autocast, its backward called inside the autocast block, then outside it:
    the same gradients."""
    grads = []
    for inside in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attend(*tensors)
            if inside:
                grads.append(torch.autograd.grad(out.sum(), tensors))
        if not inside:
            grads.append(torch.autograd.grad(out.sum(), tensors))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize(
    "backend",
    ["sliding_chunk", "fused_cpu", "sliding_chunk_autograd", "unfold", "unfold_nnf", "chunk_rows", "reference"],
)
def test_a_backward_inside_the_autocast_region_of_its_forward(backend):
    # Training loops often call backward() inside the autocast block: every backend's backward runs with autocast off,
    # as its forward does, and gets the gradients a backward outside the block gets (autograd runs each node under
    # the autocast state of the backward() call, which cast the float32 products of autograd-built backends to
    # bfloat16: 4e-3 of the gradients' size).
    inputs = make_inputs(9, 7, 3, 1, rel=True, glob_bias=True, dtype=torch.float32)
    names = ("global_k", "global_v", "rel_bias", "global_bias")

    def attend(q, k, v, *extras):
        return local_attention_2d(q, k, v, 3, **dict(zip(names, extras)), backend=backend)

    assert_backward_inside_autocast_gives_the_gradients_outside(attend, [inputs[n] for n in ("q", "k", "v", *names)])


@pytest.mark.parametrize("backend", ["sliding_chunk", "fused_cpu", "chunks", "loop", "reference"])
def test_a_1d_backward_inside_the_autocast_region_of_its_forward(backend):
    q, k, v = (torch.randn(2, 2, 13, 8, dtype=torch.float32, requires_grad=True) for _ in range(3))
    assert_backward_inside_autocast_gives_the_gradients_outside(
        lambda q, k, v: local_attention_1d(q, k, v, 3, backend=backend), (q, k, v)
    )


def test_second_order_and_repeated_backwards_inside_autocast_reach_the_callers_tensors():
    # Under autocast an autograd-built backend is recorded on a graph of its own; a second backward of a retained
    # graph gets the same gradients as without autocast, and a gradient of its gradient still reaches the caller's
    # tensors (its products in bfloat16 where the second backward runs inside the region, as torch's own are).
    q, k, v = (torch.randn(1, 2, 6, 5, 8, dtype=torch.float32, requires_grad=True) for _ in range(3))
    first, second = [], []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = local_attention_2d(q, k, v, 3, backend="unfold")
            first.append([torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True) for _ in range(2)])
            (grad_q,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
            second.append(torch.autograd.grad(grad_q.pow(2).sum(), (q, k, v)))
    runs = first[0] + first[1]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    for got, want in zip(*reversed(second)):
        torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=0)


def test_a_compiled_backward_inside_the_autocast_region_of_its_forward():
    q, k, v = (torch.randn(1, 2, 6, 5, 8, dtype=torch.float32, requires_grad=True) for _ in range(3))
    attend = torch.compile(lambda q, k, v: local_attention_2d(q, k, v, 3, backend="unfold"), backend="aot_eager")
    assert_backward_inside_autocast_gives_the_gradients_outside(attend, (q, k, v))


def test_fused_cpu_products_are_counted_by_the_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from vil.ops.backends.fused_cpu import check_fused_cpu

    check_fused_cpu()  # the formulas are registered when the kernel loads, before the counter starts
    q, k, v = (torch.randn(1, 1, 6, 5, 8, requires_grad=True) for _ in range(3))
    global_k = global_v = torch.randn(1, 1, 1, 8)
    with FlopCounterMode(display=False) as counter:
        out = local_attention_2d(q, k, v, 3, global_k=global_k, global_v=global_v, backend="fused_cpu")
    # 2x2 chunks of 3x3, 3x2, 3x3, 3x2 real tokens; each sees all 30 tokens and the global key: 31 keys.
    assert counter.get_total_flops() == 2 * 2 * 30 * 31 * 8
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 5 * 2 * 30 * 31 * 8


def test_fused_cpu_refuses_other_devices():
    q, k, v = (torch.empty(1, 1, 4, 4, 8, device="meta") for _ in range(3))
    with pytest.raises(ValueError, match="fused_cpu.*cpu tensors.*meta") as err:
        local_attention_2d(q, k, v, 2, backend="fused_cpu")
    there = str(err.value).split(";")[1]
    assert all(name in there for name in ("sliding_chunk", "unfold", "chunk_rows")) and "fused_cpu" not in there


def assert_fused_cpu_matches_reference(inputs, window, out_tolerance, grad_tolerance):
    """fused_cpu's output and gradients against the reference's, with SW_EXACT 0 and 1."""
    for exact in (0, 1):
        expected, expected_grads = run("reference", inputs, window, exact, 0)
        out, grads = run("fused_cpu", inputs, window, exact, 0)
        torch.testing.assert_close(out, expected, rtol=out_tolerance, atol=out_tolerance)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=grad_tolerance, atol=grad_tolerance)


def test_fused_cpu_many_threads_and_uneven_chunks():
    """More (batch, head) pairs than threads and a map that is no multiple of the window, in float32."""
    inputs = make_inputs(17, 10, 3, 2, rel=True, glob_bias=True, B=5, H=3, D=8, dtype=torch.float32)
    assert_fused_cpu_matches_reference(inputs, 3, 1e-5, 1e-4)


def test_fused_cpu_large_windows_mask_row_by_row():
    """w 14 on a 42x42 map: the dense bias tables of its 9 kinds of chunk (2 heads, 196 x 1765 each) exceed the
    kernel's budget, so the biases and masks are added row by row; against the reference, float64."""
    inputs = make_inputs(42, 42, 14, 1, rel=True, glob_bias=True, B=1, H=2, D=4)
    assert_fused_cpu_matches_reference(inputs, 14, 1e-10, 1e-10)


# --- Bad input: one plain sentence each. ---


def _qkv(shape=(1, 2, 4, 4, 8), **kw):
    return [torch.randn(*shape, **kw) for _ in range(3)]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(window=0), "window must be a positive integer"),
        (dict(exact=2), r"exact \(SW_EXACT\).*1, 0 or -1"),
        (dict(mode=9), r"mode \(MODE\).*0, -1 or one of 1..8, got 9"),
        (
            dict(exact=1, mode=2),
            r"mode \(MODE\) 2.*SW_EXACT 0 or -1.*mode 0",
        ),
        (dict(backend="nope"), r"'nope'.*available: sliding_chunk"),
        (dict(global_k=torch.randn(1, 2, 1, 8)), "global_k and global_v go together"),
        (
            dict(global_k=torch.randn(1, 2, 1, 4), global_v=torch.randn(1, 2, 1, 4)),
            r"global_k.*\(1, 2, G, 8\).*\(1, 2, 1, 4\)",
        ),
        (
            dict(global_k=torch.randn(1, 2, 1, 8), global_v=torch.randn(1, 2, 2, 8)),  # as many values as keys
            r"global_v.*\(1, 2, G, 8\).*\(1, 2, 2, 8\)",
        ),
        (
            dict(global_k=torch.randn(1, 2, 1, 8), global_v=torch.randn(1, 2, 1, 8, dtype=torch.float64)),
            r"global_v is torch.float64 on cpu but q is torch.float32 on cpu",
        ),
        (
            dict(global_k=torch.randn(1, 2, 1, 8), global_v=torch.randn(1, 2, 1, 8, device="meta")),
            r"global_v is torch.float32 on meta but q is torch.float32 on cpu",
        ),
        (dict(rel_bias=torch.randn(2, 10)), r"rel_bias.*\(2, 49\).*\(2, 10\)"),
        (dict(rel_bias=torch.randn(2, 49, device="meta")), r"rel_bias must be a floating tensor on cpu, got .* meta"),
        (dict(global_bias=torch.randn(2, 1)), "global_bias needs global_k and global_v"),
        (dict(dilation=2), r"dilation 2.*SW_EXACT 1.*dilation 1"),
        (dict(exact=1, dilation=0), "dilation must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_are_one_sentence(kwargs, message):
    q, k, v = _qkv()
    args = dict(window=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message) as err:
        local_attention_2d(q, k, v, args.pop("window"), **args)
    assert str(err.value).count("\n") == 0


def test_mismatched_tensors_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"k .*\(1, 2, 4, 4, 8\).*\(1, 2, 4, 5, 8\)"):
        local_attention_2d(q, torch.randn(1, 2, 4, 5, 8), v, 2)
    with pytest.raises(ValueError, match=r"v is torch.float64.*q is torch.float32"):
        local_attention_2d(q, k, v.double(), 2)
    with pytest.raises(ValueError, match=r"q must have shape.*\(2, 4, 4, 8\)"):
        local_attention_2d(q[0], k[0], v[0], 2)
    with pytest.raises(ValueError, match=r"k is torch.float32 on meta.*on cpu"):
        local_attention_2d(q, k.to("meta"), v, 2)
    with pytest.raises(ValueError, match="must be floating point"):
        local_attention_2d(*(t.long() for t in (q, k, v)), 2)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_half_precision_inputs(backend, dtype, tolerance):
    """Output and every gradient within the dtype's rounding of the reference in float64, run on the same rounded
    inputs with the same upstream gradient; the tolerance is relative to each tensor's largest value."""
    inputs = make_inputs(13, 17, 3, 1, rel=True, glob_bias=True, D=16, dtype=dtype)
    out, grads = run(backend, inputs, 3, 0, 0)
    wide = {name: None if t is None else t.detach().double().requires_grad_() for name, t in inputs.items()}
    expected, expected_grads = run("reference", wide, 3, 0, 0, upstream=upstream_gradient(out, 1).double())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    names = ["output"] + [name for name, t in inputs.items() if t is not None]
    for name, got, want in zip(names, (out, *grads), (expected, *expected_grads), strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(
            got.double(), want, rtol=0, atol=tolerance * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


# The backends that compute half-precision scores and softmax in float32 (vil/ops/local_attention.py) and train here.
FLOAT32_SCORES = {2: ("fused_cpu", "sliding_chunk", "chunk_rows"), 1: ("fused_cpu", "sliding_chunk", "chunks")}


@pytest.mark.parametrize("dims,backend", [(dims, b) for dims, names in FLOAT32_SCORES.items() for b in names])
def test_float16_scores_beyond_its_range(dims, backend):
    """q = k = 200 in every channel of 8: every scaled score is 200 * 200 * 8 ** 0.5 = 113137, beyond float16's
    65504. These backends compute scores in float32, so each query averages its window's values: the output and v's
    gradient are the float64 reference's on the same values, within 1e-2 of their largest (float32 holds a score of
    1.1e5 to 0.008, which the backward's probabilities, exp(score - log-sum-exp), carry). The gradients of q and k
    are finite; their values are sums of terms 200 times their size that cancel, so float16's rounding of the output
    decides them."""
    shape = (1, 2, 5, 6, 8) if dims == 2 else (1, 2, 12, 8)
    attention = local_attention_2d if dims == 2 else local_attention_1d
    q = torch.full(shape, 200.0, dtype=torch.float16, requires_grad=True)
    k = torch.full(shape, 200.0, dtype=torch.float16, requires_grad=True)
    v = torch.randn(shape, generator=torch.Generator().manual_seed(0)).half().requires_grad_()
    out = attention(q, k, v, 2, backend=backend)
    upstream = upstream_gradient(out, 1)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = attention(*wide, 2, backend="reference")
    expected_grads = torch.autograd.grad(expected, wide, upstream.double())
    assert all(g.dtype == torch.float16 and torch.isfinite(g).all() for g in (out, *grads))
    for name, got, want in (("output", out, expected), ("v", grads[2], expected_grads[2])):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-2 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "dims,backend", [(dims, b) for dims, names in FLOAT32_SCORES.items() for b in names if b != "fused_cpu"]
)
def test_half_precision_score_gradients_sum_to_zero(dims, backend, dtype):
    """The softmax backward's row term in float32, as fused_cpu's (tests/test_fused_cpu_precision.py, on each of
    its ways of multiplying): chunk_rows took it from the output rounded to the half type, and its bias gradients of a
    head summed to 8% of their size in bfloat16."""
    assert_score_gradients_sum_to_zero(backend, dtype, f"{dims}d")


@pytest.mark.parametrize("backend", FAST_BACKENDS + ["reference"])
def test_bias_tables_of_another_dtype_are_cast(backend):
    # float32 parameters next to half-precision activations, as under autocast: no error, same result.
    inputs = make_inputs(7, 9, 3, 1, rel=True, glob_bias=True, dtype=torch.float32)
    expected, _ = run(backend, inputs, 3, 0, 0)
    wide = dict(inputs, rel_bias=inputs["rel_bias"].double(), global_bias=inputs["global_bias"].double())
    out, grads = run(backend, wide, 3, 0, 0)
    torch.testing.assert_close(out, expected)
    assert grads[-2].dtype == torch.float64 and grads[-1].dtype == torch.float64


@pytest.mark.parametrize("backend", FAST_BACKENDS + ["reference"])
def test_empty_inputs(backend):
    q, k, v = (torch.randn(2, 2, 5, 6, 4) for _ in range(3))
    none = torch.randn(2, 2, 0, 4)  # zero global keys
    torch.testing.assert_close(
        local_attention_2d(q, k, v, 3, global_k=none, global_v=none, backend=backend),
        local_attention_2d(q, k, v, 3, backend="reference"),
    )
    empty = torch.randn(0, 2, 5, 6, 4)
    assert local_attention_2d(empty, empty, empty, 3, backend=backend).shape == (0, 2, 5, 6, 4)


CPU_2D = [b for b in available_backends(2) if b not in ("triton",)]


@pytest.mark.parametrize("backend", CPU_2D)
def test_a_dilation_beyond_the_map_leaves_each_query_with_itself_and_the_global_keys(backend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, 8) for _ in range(3))
    gk, gv = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out = local_attention_2d(q, k, v, 1, exact=1, dilation=5, global_k=gk, global_v=gv, backend=backend)
    # By hand: the softmax over two keys, the query's own and the global one.
    scale = 8**-0.5
    own, glob = (q * k).sum(-1) * scale, (q * gk[:, :, None]).sum(-1) * scale
    weight = torch.sigmoid(own - glob)[..., None]
    torch.testing.assert_close(out, weight * v + (1 - weight) * gv[:, :, None], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exact", [1, 0, -1])
def test_an_enormous_window_is_the_whole_map(exact):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, 4) for _ in range(3))
    out = local_attention_2d(q, k, v, 10**9, exact=exact)
    dense = torch.softmax(torch.einsum("bhxyd,bhijd->bhxyij", q, k).flatten(-2) * 4**-0.5, dim=-1)
    torch.testing.assert_close(out, torch.einsum("bhxyn,bhnd->bhxyd", dense, v.flatten(2, 3)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda q: local_attention_2d(q.tolist(), q, q, 1),
            r"q must be a torch.Tensor.*list",
        ),
        (
            lambda q: local_attention_2d(q, q.numpy(), q, 1),
            r"k must be a torch.Tensor.*ndarray",
        ),
        (
            lambda q: local_attention_2d(q, q, q, 1, scale="0.5"),
            r"scale must be a number.*'0.5'",
        ),
        (lambda q: local_attention_2d(q, None, q, 1), r"k must be a torch.Tensor, got None"),
        (lambda q: local_attention_1d(None, q[:, :, 0], q[:, :, 0], 1), r"q must be a torch.Tensor, got None"),
        (lambda q: local_attention_2d(q.to_sparse(), q, q, 1), r"q must be a dense \(strided\) tensor.*sparse_coo"),
        (
            lambda q: local_attention_2d(q, q, q, 1, scale=float("nan")),
            r"scale must be a finite number, got nan\.$",
        ),
        (
            lambda q: local_attention_1d(q[:, :, 0], q[:, :, 0], q[:, :, 0], 1, scale=-float("inf")),
            r"scale must be a finite number, got -inf\.$",
        ),
        (
            lambda q: local_attention_2d(q, q, q, 1, mode=torch.tensor(2.7)),
            r"mode must be an int or a 0-dim integer tensor, got a torch\.float32 tensor of shape \(\)\.$",
        ),
        (
            lambda q: local_attention_2d(q, q, q, 1, mode=torch.tensor([1, 2])),
            r"mode must be an int or a 0-dim integer tensor, got a torch\.int64 tensor of shape \(2,\)\.$",
        ),
        (
            lambda q: local_attention_2d(q, q, q, 1, mode=True),
            r"mode \(MODE\) must be 0, -1 or one of 1\.\.8, got True\.$",
        ),
        (
            lambda q: local_attention_2d(q, q, q, 1, exact=True),
            r"exact \(SW_EXACT\) must be 1, 0 or -1, got True\.$",
        ),
        (
            lambda q: local_attention_2d(q, q, q, 1, exact=1.0),
            r"exact \(SW_EXACT\) must be 1, 0 or -1, got 1\.0\.$",
        ),
        (
            lambda q: local_attention_2d(q[..., :0], q[..., :0], q[..., :0], 1),
            r"head_dim 0.*\(1, 1, 3, 3, 0\)",
        ),
        (
            lambda q: local_attention_2d(*(q.to("meta"),) * 3, 1),
            r"q is on the meta device",
        ),
    ],
)
def test_odd_inputs_are_one_sentence(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 1, 3, 3, 4))


@pytest.mark.parametrize("check", ["call", "check_backend"])
def test_a_1d_backend_for_2d_windows_is_refused_as_such(check):
    # loop computes 1D bands only: the same sentence from the op and from check_backend (the model's build check).
    q = torch.randn(1, 1, 3, 3, 4)
    with pytest.raises(ValueError, match=r"^The loop backend does not compute 2D windows; 2D backends: ") as err:
        local_attention_2d(q, q, q, 1, backend="loop") if check == "call" else check_backend("loop", 4, 1)
    named = str(err.value).split(": ")[1].rstrip(".").split(", ")
    assert named == available_backends(2) and "loop" not in named
    with pytest.raises(ValueError, match=r"^Unknown local attention backend 'lop'; available: .*sliding_chunk"):
        local_attention_2d(q, q, q, 1, backend="lop") if check == "call" else check_backend("lop", 4, 1)


def test_mode_as_a_0_dim_integer_tensor_is_that_mode():
    # The model passes its randomly drawn neighbour as such a tensor, so that torch.compile keeps the draw.
    q, k, v = (torch.randn(1, 2, 6, 6, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected = local_attention_2d(q, k, v, 2, mode=3, backend="reference")
    for dtype in (torch.int64, torch.int32, torch.uint8):
        torch.testing.assert_close(local_attention_2d(q, k, v, 2, mode=torch.tensor(3, dtype=dtype)), expected)


def test_a_numpy_scale_is_a_number():
    import numpy as np

    q = torch.randn(1, 1, 3, 3, 4)
    torch.testing.assert_close(
        local_attention_2d(q, q, q, 1, scale=np.float32(0.5)), local_attention_2d(q, q, q, 1, scale=0.5)
    )


@pytest.mark.parametrize("backend", ["unfold", "unfold_nnf", "sliding_chunk_autograd"])
def test_dilated_windows_split_into_pieces_keep_the_inputs_dtype_under_autocast(backend):
    """Every backend computes in q's dtype, autocast or not (as the operators that torch.compile records do)."""
    q, k, v = (torch.randn(1, 2, 6, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = local_attention_2d(q, k, v, 1, exact=1, backend=backend)
        pieces = local_attention_2d(q, k, v, 1, exact=1, dilation=2, backend=backend)
    assert whole.dtype == pieces.dtype == torch.float32
    want = local_attention_2d(q.double(), k.double(), v.double(), 1, exact=1, dilation=2, backend="reference")
    torch.testing.assert_close(pieces.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [b for b in available_backends(2) if b not in ("triton", "flex", "reference")])
def test_half_precision_products_that_fit_once_scaled_stay_finite(backend):
    """q.k reaches 1e5, past float16's 65504; scaled by head_dim ** -0.5 the scores fit (the reference, the
    definition written out, multiplies in the input's dtype)."""
    q, k, v = (torch.randn(1, 1, 5, 6, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    q, k = 100 * q, 100 * k
    out = local_attention_2d(q.half(), k.half(), v.half(), 2, exact=1, backend=backend)
    want = local_attention_2d(q.double(), k.double(), v.double(), 2, exact=1, backend="reference")
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", [b for b in available_backends(2) if b != "reference"])
def test_a_huge_finite_bias_on_every_key_gives_the_mean_of_the_values(backend):
    """-1e31 on every offset hides nothing: each query's scores all round to -1e31, so it outputs the mean of its
    window's values, as the reference does. (A running maximum that starts at a finite -1e30, or a log-sum-exp
    that rounds to the maximum, gave zeros or sums.)"""
    q, k, v = (torch.randn(1, 2, 5, 6, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    rel_bias = torch.full((2, 7 * 7), -1e31)
    out = local_attention_2d(q, k, v, 2, exact=1, rel_bias=rel_bias, backend=backend)
    # Equal scores: each query outputs the mean of the values in its 5 x 5 window, cut by the map's border.
    want = torch.empty_like(v)
    for i in range(5):
        for j in range(6):
            window = v[:, :, max(i - 2, 0) : i + 3, max(j - 2, 0) : j + 3]
            want[:, :, i, j] = window.mean(dim=(2, 3))
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("backend", [b for b in available_backends(2) if b not in ("triton", "flex", "reference")])
def test_queries_whose_every_key_a_bias_hides_give_zeros_as_the_reference_does(backend):
    """A -inf bias hides a key as padding does: with one offset of the table left, some queries see one key and
    the others none, which output zeros with zero gradients."""
    seeds = [torch.Generator().manual_seed(i) for i in range(3)]
    inputs = [torch.randn(1, 2, 4, 5, 4, dtype=torch.float64, generator=seed) for seed in seeds]
    rel_bias = torch.full((2, 7 * 7), float("-inf"), dtype=torch.float64)
    rel_bias[:, 0] = 0.5  # the offset (-3, -3): 19 of the 20 queries have no such key
    results = []
    for name in (backend, "reference"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = local_attention_2d(*leaves, 2, rel_bias=rel_bias, backend=name)
        results.append((out, *torch.autograd.grad((out * out.detach().sign()).sum(), leaves)))
    assert (results[1][0].abs().sum(-1) == 0).sum() == 2 * 19
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("trains", [False, True])
def test_a_backend_of_another_device_is_refused_naming_those_that_can_do_what_is_asked(monkeypatch, trains):
    # A training call is told the backends that train on its device: a backend that only infers there (flex on the
    # CPU) would be refused next.
    from dataclasses import replace

    monkeypatch.setitem(BACKENDS, "triton", replace(BACKENDS["triton"], devices=("cuda",)))
    q, k, v = (torch.randn(1, 1, 4, 4, 8, requires_grad=trains) for _ in range(3))
    with pytest.raises(ValueError, match=r"triton backend runs on cuda tensors") as refusal:
        local_attention_2d(q, k, v, 3, backend="triton")
    named = re.search(r"backends that (?:run|train) there: (.*)\.$", str(refusal.value)).group(1).split(", ")
    if trains:
        assert named == [n for n in available_backends(2) if BACKENDS[n].trains_on_device("cpu")]
    else:
        assert named == [n for n in available_backends(2) if BACKENDS[n].runs_on("cpu")]
