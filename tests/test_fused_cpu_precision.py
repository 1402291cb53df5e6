"""The fused CPU kernels on half-precision and strided inputs: q, k and v read as a fused projection lays them out,
in their dtype, against the float64 reference on the same rounded values, through each way of multiplying that this
CPU can run (half-precision products on its matrix instructions, float32 products); how the way is chosen; nothing
copied or cast around the kernel."""

import logging
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, seed
from test_fuzz import fuzz_settings, padding_mask, request_2d, requests_1d
from tool_runner import load_tool, run_tool
from torch.profiler import profile

from vil.config import load_cfg
from vil.cpu import cpu_flags
from vil.ops import local_attention_1d, local_attention_2d
from vil.ops.backends import fused_cpu
from vil.training import setup

# Float32 products round each result once: bfloat16 keeps 8 significant bits, float16 11. Half-precision products
# also round the probabilities and the score gradients to the input's type before multiplying them.
TOLERANCE = {
    ("float32", torch.bfloat16): 8e-3,
    ("float32", torch.float16): 1.5e-3,
    ("float32", torch.float32): 2e-6,
    ("half", torch.bfloat16): 1e-2,
    ("half", torch.float16): 3e-3,
}
PATHS = list(TOLERANCE)
NAMES = ("out", "qkv", "global_k", "global_v", "rel_bias", "global_bias")


@pytest.fixture
def products(request, monkeypatch):
    """Runs the test's fused_cpu calls through the way of multiplying it names, or skips where this CPU has none."""
    way, dtype = request.param
    if way == "half" and fused_cpu.half_products_missing(dtype):
        pytest.skip(f"half-precision products: {fused_cpu.half_products_missing(dtype)}")
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, way)
    return way, dtype


def path_ids(path):
    return f"{path[0]}-{str(path[1]).split('.')[-1]}"


def leaves(B, tokens, H, D, G, rel_rows, dtype):
    """A (B, tokens, 3, H, D) qkv tensor, as a fused projection gives it, and the global keys, values and both bias
    tables (None for the global ones where G is 0); drawn in float32, then rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((B, tokens, 3, H, D), (B, H, G, D), (B, H, G, D), (H, rel_rows), (H, G))
    drawn = [torch.randn(*shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]
    return [None if G == 0 and i in (1, 2, 4) else t for i, t in enumerate(drawn)]


def in_float64(tensors):
    """The oracle's inputs: the same (rounded) values in float64."""
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


def split_qkv(qkv):
    """q, k and v as (B, H, tokens, D) views of qkv: none of them is contiguous."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def gradients(out, inputs, dtype):
    """The output and the gradients of ``inputs`` under one upstream gradient, rounded to ``dtype`` (the tested
    dtype, in the reference's float64 run too)."""
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(out.dtype)
    return (out, *torch.autograd.grad(out, [t for t in inputs if t is not None], upstream))


def relative_errors(got, want, dtype):
    """{name: the largest difference from the float64 reference, relative to the reference's size} of each result,
    which must be in ``dtype``."""
    errors = {}
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype, name
        errors[name] = float(((g.double() - w).abs().max() / w.abs().max().clamp(min=1.0)).detach())
    return errors


def assert_close_to_reference(got, want, path):
    """Each result in the path's dtype, within its tolerance of the float64 reference, relative to its size."""
    for name, error in relative_errors(got, want, path[1]).items():
        assert error <= TOLERANCE[path], f"{name}: relative error {error:.2e} in {path[1]}"


def optional_inputs(inputs):
    """The op's keyword arguments for the inputs after qkv."""
    return dict(zip(("global_k", "global_v", "rel_bias", "global_bias"), inputs[1:]))


def attend_2d(inputs, backend, grid, window, exact, dilation, dtype, scale=None, mode=0):
    q, k, v = (t.reshape(t.shape[:2] + grid + t.shape[-1:]) for t in split_qkv(inputs[0]))
    out = local_attention_2d(
        q,
        k,
        v,
        window,
        exact=exact,
        mode=mode,
        dilation=dilation,
        scale=scale,
        backend=backend,
        **optional_inputs(inputs),
    )
    return gradients(out, inputs, dtype)


# head_dim 40: the layouts' 16 x 16 blocks and their tails; 17: odd, padded. Window 6: chunks of 36 queries, more than
# the 32 tokens the column layout moves at a time.
CASES_2D = [(3, 0, 1, 40), (2, 1, 2, 17), (3, -1, 1, 40), (6, 0, 1, 40)]  # window, exact, dilation, head_dim
# w 34: blocks of 32 queries with float32 products, of 16 with half-precision ones. Without global keys (the last case)
# the spans of odd length end each P row the products read: its padding column must be zero, the next token is not.
CASES_1D = [  # dilation, causal, head_dim, window, global keys
    (1, False, 40, 34, 2),
    ((1, 2, 3), False, 17, 9, 2),
    (2, True, 40, 9, 2),
    ((1, 2, 3), False, 16, 9, 0),
]


def case_2d(dtype, window, exact, dilation, D, G=2, biases=True):
    """(fused_cpu's results, the reference's) on a 9x11 map with G global keys, and both bias tables where
    ``biases``."""
    grid = (9, 11)
    inputs = leaves(2, 99, 3, D, G, (4 * window - 1) ** 2, dtype)
    if not biases:
        inputs[3] = inputs[4] = None
    got = attend_2d(inputs, "fused_cpu", grid, window, exact, dilation, dtype)
    return got, attend_2d(in_float64(inputs), "reference", grid, window, exact, dilation, dtype)


@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("window,exact,dilation,D", CASES_2D)
def test_2d_strided_inputs_in_their_dtype_match_the_reference(products, window, exact, dilation, D):
    assert_close_to_reference(*case_2d(products[1], window, exact, dilation, D), products)


def attend_1d(inputs, backend, window, dilation, causal, padding, dtype, scale=None):
    out = local_attention_1d(
        *split_qkv(inputs[0]),
        window,
        dilation=dilation,
        causal=causal,
        key_padding_mask=padding,
        scale=scale,
        backend=backend,
        **optional_inputs(inputs),
    )
    return gradients(out, inputs, dtype)


def case_1d(dtype, dilation, causal, D, window, G, plain=False):
    """(fused_cpu's results, the reference's) on 75 tokens, padded keys, G global keys, the bias tables; where
    ``plain``, with neither the bias tables nor padding."""
    length = 75
    inputs = leaves(2, length, 3, D, G, 2 * window + 1, dtype)
    padding = torch.rand(2, length, generator=torch.Generator().manual_seed(3)) < 0.2
    if plain:
        inputs[3] = inputs[4] = padding = None
    got = attend_1d(inputs, "fused_cpu", window, dilation, causal, padding, dtype)
    return got, attend_1d(in_float64(inputs), "reference", window, dilation, causal, padding, dtype)


@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("dilation,causal,D,window,G", CASES_1D)
def test_1d_strided_inputs_in_their_dtype_match_the_reference(products, dilation, causal, D, window, G):
    assert_close_to_reference(*case_1d(products[1], dilation, causal, D, window, G), products)


# Longformer's own case: without biases and padding the 1D kernel leaves the scale to the softmax, which applies it as
# it reads each score (in the forward and in the backward).
@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("dilation,causal,D,window,G", [(1, False, 40, 34, 2), ((1, 2, 3), True, 17, 9, 0)])
def test_1d_without_biases_or_padding_matches_the_reference(products, dilation, causal, D, window, G):
    assert_close_to_reference(*case_1d(products[1], dilation, causal, D, window, G, plain=True), products)


# With neither biases nor a mask of the window's own, the 2D kernel has no table to add to the scores, except where the
# half-precision products give each odd key block (window 3: blocks of 9 keys) a masked column after it.
@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("window,exact", [(3, 0), (2, -1)])
def test_2d_without_biases_or_global_keys_matches_the_reference(products, window, exact):
    assert_close_to_reference(*case_2d(products[1], window, exact, 1, 17, G=0, biases=False), products)


# Seven global keys (an odd number, more than the other cases' two), in every pass: in 1D multiplied apart from the
# local keys, in 2D one more run of the map's layouts with half-precision products.
@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("dims", [1, 2])
def test_many_global_keys_match_the_reference(products, dims):
    if dims == 1:
        got_and_want = case_1d(products[1], (1, 2, 3), False, 17, 9, 7)
    else:
        got_and_want = case_2d(products[1], 3, 0, 1, 17, G=7)
    assert_close_to_reference(*got_and_want, products)


# The kernel keeps the memory of its key and value layouts from one call to the next (megabytes, which the system
# would otherwise map afresh at every call), and a call takes the buffers the latest one gave back. Nothing a call
# reads there may be what an earlier call left: after a call of the same shapes on NaN keys and values, forward and
# backward, every result matches the reference. Head size 17: the layouts' rows are padded (to 16 pairs, and to an
# even number of keys; in 2D, each block of 9 keys to 10).
@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("dims", [1, 2])
def test_calls_read_nothing_an_earlier_call_left_in_the_kept_layouts(products, dims):
    dtype = products[1]
    if dims == 1:
        poisoned = leaves(2, 75, 3, 17, 1, 19, dtype)
        attend = partial(attend_1d, window=9, dilation=(1, 2, 3), causal=False, padding=None, dtype=dtype)
        case = partial(case_1d, dtype, (1, 2, 3), False, 17, 9, 1)
    else:
        poisoned = leaves(2, 99, 3, 17, 1, 11**2, dtype)
        attend = partial(attend_2d, grid=(9, 11), window=3, exact=0, dilation=1, dtype=dtype)
        case = partial(case_2d, dtype, 3, 0, 1, 17)
    with torch.no_grad():
        for t in poisoned[:3]:
            t.fill_(float("nan"))
    out, grad_qkv, *_ = attend(poisoned, backend="fused_cpu")
    assert out.isnan().any() and grad_qkv.isnan().any()  # the layouts held NaN
    assert_close_to_reference(*case(), products)


# A negative scale is a number like any other: masked keys stay masked, and the lanes past the end of a row of scores
# (rows whose length is no multiple of 16) stay out of its sums.
@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("dims", [1, 2])
def test_a_negative_scale_matches_the_reference(products, dims):
    """A 9x11 map (window 3) or 99 tokens (w 9), one global key, no biases."""
    dtype = products[1]
    inputs = leaves(1, 99, 2, 17, 1, 1, dtype)[:3]

    def attend(inputs, backend):
        if dims == 2:
            return attend_2d(inputs, backend, (9, 11), 3, 0, 1, dtype, scale=-0.3)
        return attend_1d(inputs, backend, 9, 1, False, None, dtype, scale=-0.3)

    assert_close_to_reference(attend(inputs, "fused_cpu"), attend(in_float64(inputs), "reference"), products)


# A key holding NaN reaches only the queries that see it, on every path: the score columns of a chunk (block) that
# read a key some of its queries do not see (a 2D exact window's, a 1D span's) are set to -inf for them, not summed
# with the mask.
@pytest.mark.parametrize("products", PATHS, ids=path_ids, indirect=True)
@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("biases", [False, True])
def test_a_nan_key_reaches_only_the_queries_that_see_it(products, dims, biases):
    """A 9x11 map (exact windows of 5x5) or 99 tokens (w 9), the NaN in key 40."""
    dtype = products[1]
    window = 2 if dims == 2 else 9
    qkv, *_, rel_bias, _ = leaves(1, 99, 2, 17, 0, (4 * window - 1) ** 2 if dims == 2 else 2 * window + 1, dtype)
    q, k, v = (t.detach().clone() for t in split_qkv(qkv))
    k[:, :, 40] = float("nan")

    def attend(backend, converted):
        q_, k_, v_, bias = (converted(t) for t in (q, k, v, rel_bias.detach()))
        bias = bias if biases else None
        if dims == 1:
            return local_attention_1d(q_, k_, v_, window, rel_bias=bias, backend=backend)
        q_, k_, v_ = (t.reshape(1, 2, 9, 11, 17) for t in (q_, k_, v_))
        return local_attention_2d(q_, k_, v_, window, exact=1, rel_bias=bias, backend=backend).flatten(2, 3)

    got, want = attend("fused_cpu", lambda t: t), attend("reference", torch.Tensor.double)
    seeing = want.isnan().any(-1)
    assert int(seeing.sum()) == 2 * (25 if dims == 2 else 2 * window + 1)  # both heads' queries around key 40
    assert torch.equal(got.isnan().any(-1), seeing)
    assert_close_to_reference((got[~seeing],), (want[~seeing],), products)


# Random requests in half precision: the fixed cases above, drawn instead. Maps and sequences smaller and larger than
# the window; head sizes below, at and past the layouts' blocks of 16 and 32 elements (two blocks of 16 pairs from
# 64); chunked and exact windows, every mode, dilation (per head in 1D), causal windows, padding, global keys and bias
# tables, each on or off (the requests of tests/test_fuzz.py, larger).

HALF_PATHS = [path for path in PATHS if path[1] != torch.float32]


@pytest.mark.parametrize("products", HALF_PATHS, ids=path_ids, indirect=True)
@seed(20261128)
@fuzz_settings(12)
@given(**request_2d(side=12, head_dim=80, window=5))
def test_random_2d_requests_in_half_precision_match_the_reference(
    products, shape, window, options, num_global, with_bias
):
    B, H, X, Y, D = shape
    exact, mode, dilation = options
    dtype = products[1]
    inputs = leaves(B, X * Y, H, D, num_global, (4 * window - 1) ** 2, dtype)
    if not with_bias:
        inputs[3] = inputs[4] = None

    got = attend_2d(inputs, "fused_cpu", (X, Y), window, exact, dilation, dtype, mode=mode)
    want = attend_2d(in_float64(inputs), "reference", (X, Y), window, exact, dilation, dtype, mode=mode)
    assert_close_to_reference(got, want, products)


@pytest.mark.parametrize("products", HALF_PATHS, ids=path_ids, indirect=True)
@seed(20261128)
@fuzz_settings(12)
@given(request=requests_1d(length=90, head_dim=80, window=40))
def test_random_1d_requests_in_half_precision_match_the_reference(products, request):
    """q, k and v views of one projection, whatever the request's one_projection says."""
    B, H, L, D = request["shape"]
    G, window, dtype = request["num_global"], request["window"], products[1]
    inputs = leaves(B, L, H, D, G, 2 * window + 1, dtype)
    if not request["with_bias"]:
        inputs[3] = inputs[4] = None
    padding = padding_mask(request["padding"], B, L, torch.Generator().manual_seed(L))
    options = (window, request["dilation"], request["causal"], padding, dtype)
    got = attend_1d(inputs, "fused_cpu", *options)
    assert_close_to_reference(got, attend_1d(in_float64(inputs), "reference", *options), products)


def assert_score_gradients_sum_to_zero(backend, dtype, case):
    """Adding one number to all of a query's scores changes nothing, so where every key has a bias (a relative one in
    the window, a global one for the global keys) the bias gradients of a head sum to zero, within the rounding of
    each entry to ``dtype``. Values far from 0 make the rounding of an output large against the score gradients."""
    gen = torch.Generator().manual_seed(0)
    B, H, D, G = 3, 2, 33, 2
    if case == "2d":
        q, k, v = (torch.randn(B, H, 4, 16, D, generator=gen).to(dtype) for _ in range(3))
        rel_bias = torch.randn(H, 9, generator=gen).requires_grad_()
        options = dict(exact=-1, mode=8)  # wrapped neighbour chunks: every key is one of the window's 9 offsets
        attend = local_attention_2d
    else:
        q, k, v = (torch.randn(B, H, 80, D, generator=gen).to(dtype) for _ in range(3))
        rel_bias = torch.randn(H, 2 * 3 + 1, generator=gen).requires_grad_()
        padding = torch.rand(B, 80, generator=gen) < 0.2
        options = dict(dilation=(1, 4), causal=True, key_padding_mask=padding)
        attend = local_attention_1d
    global_k, global_v = (torch.randn(B, H, G, D, generator=gen).to(dtype) for _ in range(2))
    v, global_v = v + 16, global_v + 16
    global_bias = torch.randn(H, G, generator=gen).requires_grad_()  # float32 tables, as under autocast
    out = attend(
        q,
        k,
        v,
        3 if case == "1d" else 1,
        global_k=global_k,
        global_v=global_v,
        rel_bias=rel_bias,
        global_bias=global_bias,
        backend=backend,
        **options,
    )
    out.backward(torch.randn(out.shape, generator=gen).to(dtype))
    total = rel_bias.grad.sum(1) + global_bias.grad.sum(1)
    size = rel_bias.grad.abs().sum(1) + global_bias.grad.abs().sum(1)
    assert (total.abs() <= torch.finfo(dtype).eps / 2 * size).all(), (total / size).tolist()


@pytest.mark.parametrize("products", [p for p in PATHS if p[1] != torch.float32], ids=path_ids, indirect=True)
@pytest.mark.parametrize("case", ["1d", "2d"])
def test_each_querys_score_gradients_sum_to_zero_in_half_precision(products, case):
    """The backward takes delta = sum_j P_ij dP_ij from its rows, in float32; rowsum(dO * O) from the output rounded
    to the half type left each row of dS summing to its rounding error, and the totals far from zero: up to 8% of
    the gradients' size here, where the entries' own rounding allows 0.4% in bfloat16 and 0.05% in float16."""
    assert_score_gradients_sum_to_zero("fused_cpu", products[1], case)


@pytest.mark.parametrize("products", [p for p in PATHS if p[1] == torch.bfloat16], ids=path_ids, indirect=True)
def test_dilated_windows_sum_the_sub_lattices_gradients_of_shared_inputs_in_float32(products):
    """Dilated 2D windows run once per sub-lattice, each with the same global keys and bias tables; here the four
    pieces of the global bias's gradient are about -4.0, -3.7, 0.7 and 7.5, and their sum 0.45. Summed in bfloat16
    it was 0.469 (the reference's 0.449); in float32, then rounded once, it is within bfloat16's precision."""
    gen = torch.Generator().manual_seed(485)
    shape = (2, 1, 9, 10, 80)
    q, k, v = (torch.randn(*shape, generator=gen).bfloat16() for _ in range(3))
    global_k, global_v = (torch.randn(2, 1, 1, 80, generator=gen).bfloat16() for _ in range(2))
    global_bias = torch.randn(1, 1, generator=gen).bfloat16()
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    grads = []
    for dtype, backend in ((torch.float64, "reference"), (torch.bfloat16, "fused_cpu")):
        bias = global_bias.to(dtype).requires_grad_()
        qd, kd, vd, gk, gv = (t.to(dtype) for t in (q, k, v, global_k, global_v))
        out = local_attention_2d(
            qd, kd, vd, 5, exact=1, dilation=2, global_k=gk, global_v=gv, global_bias=bias, backend=backend
        )
        grads.append(torch.autograd.grad(out, bias, upstream.to(dtype))[0].item())
    assert grads[1] == pytest.approx(grads[0], rel=TOLERANCE[products])


def largest_relative_error(dtype):
    """Over every 2D and 1D case above: the largest relative error of any result."""
    cases = [case_2d(dtype, *case) for case in CASES_2D] + [case_1d(dtype, *case) for case in CASES_1D]
    return max(max(relative_errors(got, want, dtype).values()) for got, want in cases)


@pytest.mark.parametrize("products", [p for p in PATHS if p[1] == torch.bfloat16], ids=path_ids, indirect=True)
@pytest.mark.parametrize("dims", [1, 2])
def test_nothing_as_large_as_q_is_copied_or_cast_around_the_kernel(dims, products):
    """Under bfloat16 autocast, the op's forward and backward on the views of a bfloat16 projection: no operator
    outside the kernels copies, casts or scales a tensor of q's size (the kernels write the output and the
    gradients; only the small inputs, global keys and bias tables, are cast), and the output is laid out as q is,
    token-major, so that going back to (B, tokens, heads * head_dim) copies nothing either."""
    B, H, D, tokens = 2, 3, 16, 64
    qkv, global_k, global_v, rel_bias, global_bias = leaves(B, tokens, H, D, 1, 9 if dims == 1 else 121, torch.bfloat16)
    q, k, v = split_qkv(qkv)
    if dims == 2:
        q, k, v = (t.reshape(B, H, 8, 8, D) for t in (q, k, v))
    attend = local_attention_1d if dims == 1 else local_attention_2d
    extras = dict(global_k=global_k, global_v=global_v, rel_bias=rel_bias.float(), global_bias=global_bias.float())
    with profile(record_shapes=True) as prof, torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, 4 if dims == 1 else 3, backend="fused_cpu", **extras)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert out.movedim(1, -2).is_contiguous() and all(g.movedim(1, -2).is_contiguous() for g in grads)
    moved = [
        (event.name, shapes)
        for event in prof.events()
        if event.name in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::mul")
        for shapes in event.input_shapes
        if shapes and torch.Size(shapes).numel() >= q.numel()
    ]
    assert not moved, moved


@pytest.fixture
def fresh_check(monkeypatch):
    """The once-per-process check of half-precision products, run again in this test (and after it)."""
    fused_cpu.half_products_missing.cache_clear()
    fused_cpu.half_products_pay.cache_clear()
    yield
    fused_cpu.half_products_missing.cache_clear()
    fused_cpu.half_products_pay.cache_clear()


def test_the_variable_chooses_the_products(monkeypatch):
    able = not fused_cpu.half_products_missing(torch.bfloat16)
    for choice, half in (("auto", able and fused_cpu.half_products_pay(torch.bfloat16)), ("float32", False)):
        monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, choice)
        assert fused_cpu.half_products(torch.bfloat16) == half
        assert not fused_cpu.half_products(torch.float32)  # float32 and float64 are always multiplied as they are
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "bf16")
    with pytest.raises(ValueError, match=r"VIL_FUSED_CPU_PRODUCTS.*auto, half, float32.*'bf16'"):
        fused_cpu.half_products(torch.bfloat16)


def test_half_products_asked_for_where_the_cpu_has_none_are_refused_in_one_sentence(monkeypatch, fresh_check):
    monkeypatch.setattr(fused_cpu, "cpu_multiplies_natively", lambda dtype: False)
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "auto")
    assert not fused_cpu.half_products(torch.bfloat16)  # the float32 products are the fast ones there
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "half")
    q = torch.randn(1, 1, 4, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"=half asks for bfloat16 .*no bfloat16 matrix instructions .*AMX") as err:
        local_attention_2d(q, q, q, 2, backend="fused_cpu")
    assert "\n" not in str(err.value)


def test_products_that_disagree_with_float32_are_said_once_and_not_used(monkeypatch, fresh_check, caplog):
    """A micro-kernel that reads its operands in another layout than the kernels write them (as on a CPU it was never
    run on) is found by the first call's check: one warning, then the float32 products, bit for bit."""
    monkeypatch.setattr(fused_cpu, "cpu_multiplies_natively", lambda dtype: True)
    monkeypatch.setattr(fused_cpu, "half_products_fault", lambda dtype: "its products disagree (relative error 0.9)")
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "auto")
    q, k, v = (torch.randn(2, 3, 9, 9, 40, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3))
    with caplog.at_level(logging.WARNING, logger="vil"):
        outs = [local_attention_2d(q, k, v, 3, backend="fused_cpu") for _ in range(2)]
    assert caplog.text.count("relative error 0.9") == 1 and "float32 instead" in caplog.text
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "float32")
    assert all(torch.equal(out, local_attention_2d(q, k, v, 3, backend="fused_cpu")) for out in outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_the_check_passes_where_the_cpu_multiplies_half_precision(dtype):
    """float16 on AVX512-FP16 without AMX-FP16 reads its B operands plain, not in pairs: the layout is the CPU's."""
    if not fused_cpu.cpu_multiplies_natively(dtype):
        pytest.skip(f"this CPU has no {dtype} matrix instructions")
    assert fused_cpu.half_products_fault(dtype) == ""


@pytest.mark.parametrize("rate,pays", [(0.5, False), (1.2, False), (1.5, True), (2.0, True)])
def test_auto_multiplies_in_half_precision_where_the_cpu_does_it_faster(monkeypatch, fresh_check, caplog, rate, pays):
    """At least 1.5x float32's rate (HALF_RATE_THAT_PAYS): below it the products' own layouts cost more than the
    faster rate gains."""
    monkeypatch.setattr(fused_cpu, "cpu_multiplies_natively", lambda dtype: True)
    monkeypatch.setattr(fused_cpu, "half_products_fault", lambda dtype: "")
    monkeypatch.setattr(fused_cpu, "half_precision_rate", lambda dtype: rate)
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "auto")
    with caplog.at_level(logging.INFO, logger="vil"):
        chosen = [fused_cpu.half_products(torch.bfloat16) for _ in range(2)]
    assert chosen == [pays] * 2
    assert caplog.text.count(f"bfloat16 at {rate:.2f}x the rate of float32 (under 1.5x)") == (not pays)  # said once
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "half")
    assert fused_cpu.half_products(torch.bfloat16)  # asked for, half precision however slow
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, "float32")
    assert not fused_cpu.half_products(torch.bfloat16)  # asked for, float32 however fast half precision is


def test_products_that_give_not_a_number_are_a_fault(monkeypatch):
    """The check's half-precision results all NaN (float32's finite): a disagreement, not a pass."""
    check = fused_cpu._check_problem

    def not_a_number_in_half(*args):
        results = check(*args[:-1], False)
        return [torch.full_like(r, float("nan")) for r in results] if args[-1] else results

    monkeypatch.setattr(fused_cpu, "_check_problem", not_a_number_in_half)
    fault = fused_cpu.half_products_fault(torch.bfloat16)
    assert "bfloat16 products disagree with float32 ones" in fault and "relative error nan" in fault, fault


def test_the_half_precision_rate_is_the_ratio_of_the_best_times(monkeypatch):
    from vil import cpu

    clock, built = [0.0], set()

    def product(x, y):  # float32 takes 2 units of time and bfloat16 0.5; the first product of each 10 more
        assert not torch.is_autocast_enabled("cpu")  # which would multiply the float32 pair in bfloat16
        clock[0] += (2.0 if x.dtype == torch.float32 else 0.5) + (0 if x.dtype in built else 10)
        built.add(x.dtype)

    monkeypatch.setattr(cpu.torch, "mm", product)
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a model's first call may measure it
        assert cpu.half_precision_rate.__wrapped__(torch.bfloat16) == 4.0


# One fresh process per cap of oneDNN's instructions (read once, when oneDNN starts): the half-precision products on
# AMX tiles, on AVX512-BF16 dot products, or, below those, refused. Each runs every bfloat16 case above (outputs and
# every gradient, both dims, global keys, both bias tables, dilation, causal, padding) with VIL_FUSED_CPU_PRODUCTS=half
# and prints the largest relative error, or the refusal.
ISA_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_fused_cpu_precision import largest_relative_error
    from vil.ops.backends import fused_cpu
    try:
        fused_cpu.half_products(torch.bfloat16)
    except ValueError as error:
        sys.exit(str(error))
    print(largest_relative_error(torch.bfloat16))
    """
)


def run_with_isa(isa):
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa, VIL_FUSED_CPU_PRODUCTS="half")
    command = [sys.executable, "-c", ISA_SCRIPT, str(Path(__file__).parent)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("isa,flag", [("AVX512_CORE_AMX", "amx_bf16"), ("AVX512_CORE_BF16", "avx512_bf16")])
def test_half_products_on_each_kind_of_instruction_this_cpu_has(isa, flag):
    if flag not in cpu_flags():
        pytest.skip(f"this CPU has no {flag} instructions")
    done = run_with_isa(isa)
    assert done.returncode == 0, done.stderr
    assert 0 < float(done.stdout.split()[-1]) <= TOLERANCE["half", torch.bfloat16], done.stdout


def test_below_the_bfloat16_instructions_half_products_are_refused():
    """With oneDNN held below AVX512-BF16, its micro-kernel cannot be generated: the check finds it."""
    if not fused_cpu.cpu_multiplies_natively(torch.bfloat16):
        pytest.skip("this CPU has no bfloat16 matrix instructions (AVX512-BF16 or AMX)")
    done = run_with_isa("AVX512_CORE")
    assert done.returncode == 1
    assert "=half asks for bfloat16" in done.stderr and "micro-kernel fails here" in done.stderr


def test_amp_runs_on_the_cpu_when_asked_and_says_so_where_its_products_are_slow(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="vil"):
        amp, _ = setup.amp_context(load_cfg(overrides=["AMP.ENABLED", "True"]), torch.device("cpu"))
    with amp():
        assert not torch.is_autocast_enabled("cpu")  # the presets' AMP is their GPU recipe's
    assert "this run is float32 on cpu" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vil"):  # AMP.ON_CPU alone: AMP is not on
        amp, _ = setup.amp_context(load_cfg(overrides=["AMP.ON_CPU", "True"]), torch.device("cpu"))
    with amp():
        assert not torch.is_autocast_enabled("cpu")
    assert "AMP.ON_CPU True applies with AMP.ENABLED True; this run is float32 on cpu" in caplog.text
    cfg = load_cfg(overrides=["AMP.ENABLED", "True", "AMP.ON_CPU", "True"])
    for native, rate in ((True, 2.0), (True, 0.5), (False, 2.0)):
        monkeypatch.setattr(setup, "cpu_multiplies_natively", lambda dtype, native=native: native)
        monkeypatch.setattr(setup, "half_precision_rate", lambda dtype, rate=rate: rate)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vil"):
            amp, scaler = setup.amp_context(cfg, torch.device("cpu"))
        with amp():
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        assert not scaler.is_enabled() and "this run is float32" not in caplog.text
        assert "AMP: the model runs under torch.autocast on cpu in bfloat16" in caplog.text
        assert ("bfloat16" in caplog.text and "AVX512-BF16" in caplog.text) != native
        assert ("0.50x the rate of float32" in caplog.text and "AMP.ON_CPU" in caplog.text) == (native and rate < 1)


def test_precision_benchmark_prints_its_tables(tmp_path):
    status, out, _ = run_tool(
        "benchmark_precision",
        "--sizes",
        "6",
        "--tokens",
        "40",
        "--rounds",
        "1",
        "--matmul",
        "32",
        "--dtypes",
        "float32",
        "bfloat16",
        "float16",
        "--markdown",
        tmp_path / "precision.md",
    )
    assert status == 0
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 2D") or line.startswith("| 1D")]
    cases = [(f"| {problem}", mode) for problem in ("2D 6x6", "1D 40 tokens") for mode in ("inference", "training")]
    halves = (torch.bfloat16, torch.float16)
    names = {dtype: str(dtype).split(".")[-1] for dtype in halves}
    assert {(row[0], row[2], row[1]) for row in rows if len(row) == 9} == {
        (*case, dtype) for case in cases for dtype in ("float32", *names.values())
    }
    # Each half-precision dtype against float32; then, where the CPU has its instructions, with both products.
    assert {(row[0], row[1], row[2]) for row in rows if len(row) == 4} == {
        (*case, name) for case in cases for name in names.values()
    }
    assert {(row[0], row[2], row[1]) for row in rows if len(row) == 6} == {
        (*case, names[dtype]) for case in cases for dtype in halves if not fused_cpu.half_products_missing(dtype)
    }
    # The share of the rate of the matrix product in the dtype the op multiplies in: the row's, or float32's where
    # the fused kernels multiply that dtype in float32 here.
    rates = {row[1]: row[7] for row in rows if len(row) == 9}
    for dtype in halves:
        assert (rates[names[dtype]] == rates["float32"]) == (not fused_cpu.half_products(dtype))
    assert all(row[8].endswith("% |") for row in rows if len(row) == 9)
    assert "half-precision matrix flags" in out.splitlines()[0]
    machine, tables = (tmp_path / "precision.md").read_text().strip().split("\n\n", 1)
    assert machine == out.splitlines()[0] and tables in out  # the file: what was printed, the CPU first


@pytest.mark.parametrize("half", [True, False])
def test_precision_benchmark_figures_are_those_of_the_times_and_counts_measured(monkeypatch, half):
    """From given medians (s), FLOP counts and matrix-product rates (GFLOP/s), hand-computed: SDPA's time over the
    op's; the op's GFLOP/s and their share of the product's rate in the dtype the op multiplies in (bfloat16's where
    the fused kernels multiply bfloat16, ``half``, else float32's); float32's time over bfloat16's; and the
    half-precision products' speed-up, the op's row timed with the products ``auto`` takes and the third time with
    the others."""
    tool = load_tool("benchmark_precision")
    monkeypatch.setattr(tool, "half_products", lambda dtype: half)
    results = {  # (local, SDPA, local FLOPs, local with the other products)
        ("2D 8x8", "float32", "training"): (0.004, 0.010, 2e8, None),
        ("2D 8x8", "bfloat16", "training"): (0.002, 0.009, 2e8, 0.003),
    }
    lines = tool.table(results, {"float32": 100.0, "bfloat16": 400.0}, 64).splitlines()[2:]
    rows = {tuple(cells[:3]): cells[3:] for cells in (line.strip("| ").split(" | ") for line in lines)}
    assert rows["2D 8x8", "float32", "training"] == ["4.0", "10.0", "2.50x", "50.0", "100.0", "50%"]
    roof = ["400.0", "25%"] if half else ["100.0", "100%"]
    assert rows["2D 8x8", "bfloat16", "training"] == ["2.0", "9.0", "4.50x", "100.0", *roof]
    assert "| 2D 8x8 | training | bfloat16 | 2.00x |" in tool.dtype_ratios(results).splitlines()
    products = tool.products_table(results)
    in_half, in_float32, speed_up = ("2.0", "3.0", "1.50x") if half else ("3.0", "2.0", "0.67x")
    assert f"| 2D 8x8 | bfloat16 | training | {in_half} | {in_float32} | {speed_up} |" in products.splitlines()
    assert f"auto takes {'half-precision' if half else 'float32'} ones for bfloat16 here" in products


def test_precision_benchmark_rates_the_matrix_product_at_two_flops_per_multiply_add(monkeypatch):
    tool = load_tool("benchmark_precision")
    monkeypatch.setattr(tool, "seconds", lambda fn: 0.5)  # every product timed at 0.5 s
    assert tool.matmul_gflops(100, torch.float32) == pytest.approx(2 * 100**3 / 0.5 / 1e9)


@pytest.mark.parametrize(
    "dtype, avx512_bf16, amx_tiles, amx_fp16, flags, native",
    [
        (torch.bfloat16, True, False, False, "avx512_bf16", True),
        (torch.bfloat16, False, True, False, "amx_bf16 amx_tile", True),
        (torch.bfloat16, False, False, False, "avx512_fp16 avx2", False),
        (torch.float16, False, False, True, "amx_fp16", True),
        (torch.float16, False, False, False, "avx512_fp16", True),
        (torch.float16, True, True, False, "avx512_bf16 amx_bf16 amx_tile", False),
    ],
)
def test_which_half_types_the_cpu_multiplies_natively(
    monkeypatch, dtype, avx512_bf16, amx_tiles, amx_fp16, flags, native
):
    # bfloat16 on AVX512-BF16 or AMX tiles; float16 on AMX-FP16 or AVX512-FP16: a CPU with the one type's
    # instructions only multiplies the other in plain loops.
    from vil import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: set(flags.split()))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx_tiles)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: amx_fp16)
    assert cpu.cpu_multiplies_natively(dtype) is native


@pytest.mark.parametrize(
    "flags, granted, says", [("avx512_bf16", True, None), ("amx_bf16", True, "yes"), ("amx_bf16", False, "no")]
)
def test_the_cpu_description_says_whether_the_os_grants_amx_where_the_cpu_lists_it(monkeypatch, flags, granted, says):
    # A CPU that lists AMX but whose OS withholds the tiles multiplies bfloat16 at AVX512-BF16's rate: the line
    # written beside a timing has to tell the two apart.
    from vil import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: set(flags.split()))
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: granted)
    description = cpu.cpu_description()
    assert f"half-precision matrix flags: {flags}" in description
    if says is None:
        assert "AMX tiles" not in description
    else:
        assert description.endswith(f"AMX tiles granted by the OS: {says}")
