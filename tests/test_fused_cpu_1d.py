"""The fused CPU kernel's 1D (Longformer) windows: blocks, spans, masks and partial sums against the reference."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_local_attention_1d import assert_products_counted

from vil.ops import local_attention_1d


def make_inputs(L, w, G=0, rel=False, glob_bias=False, B=2, H=3, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    inputs = dict(q=randn(B, H, L, D), k=randn(B, H, L, D), v=randn(B, H, L, D))
    if G:
        inputs.update(global_k=randn(B, H, G, D), global_v=randn(B, H, G, D))
    if rel:
        inputs["rel_bias"] = randn(H, 2 * w + 1)
    if glob_bias:
        inputs["global_bias"] = randn(H, G)
    return inputs


def random_mask(B, L, seed=1):
    return torch.rand(B, L, generator=torch.Generator().manual_seed(seed)) < 0.3


def run(backend, inputs, w, **options):
    """The output and the gradients of every input under one random upstream gradient."""
    out = local_attention_1d(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        w,
        backend=backend,
        **{name: t for name, t in inputs.items() if name not in ("q", "k", "v")},
        **options,
    )
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    return out, torch.autograd.grad(out, list(inputs.values()), upstream)


def assert_matches_reference(inputs, w, rtol=1e-7, atol=1e-9, **options):
    expected, expected_grads = run("reference", inputs, w, **options)
    out, grads = run("fused_cpu", inputs, w, **options)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    for name, got, want in zip(inputs, grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"grad of {name}: {m}")
    return out, grads


@pytest.mark.parametrize(
    "L,w,dilation,causal,G,biases,masked",
    [
        (9, 1, 1, False, 0, False, False),
        (12, 2, 2, True, 1, True, True),
        (23, 5, (1, 2, 3), False, 2, True, True),
        (23, 5, (1, 2, 3), True, 0, True, True),
        (3, 5, 1, False, 1, True, False),  # L < w: the window is clipped on both sides
        (5, 5, 2, True, 2, False, True),  # L == w
        (70, 2, (1, 2, 3), False, 0, True, False),  # several blocks per residue class
        (130, 40, 2, True, 1, True, True),
    ],
)
def test_matches_reference(L, w, dilation, causal, G, biases, masked):
    inputs = make_inputs(L, w, G, rel=biases, glob_bias=biases and G > 0)
    mask = random_mask(2, L) if masked else None
    assert_matches_reference(inputs, w, dilation=dilation, causal=causal, key_padding_mask=mask)


def test_query_that_sees_no_key_outputs_zeros_and_gets_zero_gradients():
    inputs = make_inputs(11, 2, rel=True)
    mask = random_mask(2, 11)
    mask[0] = True  # batch entry 0: every key padded, no global keys
    out, grads = assert_matches_reference(inputs, 2, dilation=(1, 2, 3), key_padding_mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    for grad in grads[:3]:
        assert torch.equal(grad[0], torch.zeros_like(grad[0]))
    assert not any(grad.isnan().any() for grad in grads)


def test_float32_with_more_batch_heads_than_threads():
    inputs = make_inputs(37, 3, G=2, rel=True, glob_bias=True, B=5, H=3, dtype=torch.float32)
    assert_matches_reference(inputs, 3, rtol=1e-4, atol=1e-4, dilation=(1, 2, 3), key_padding_mask=random_mask(5, 37))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_a_dilation_whose_rows_lie_beyond_blas_int_strides_matches_the_reference(dtype):
    """The backward adds its key and value gradients in place with BLAS, whose strides are ints: here a residue
    class's positions lie 2^29 x 8 elements apart in the gradients, beyond them, so the sums go through a buffer."""
    inputs = make_inputs(8, 2, B=1, H=2, dtype=dtype)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    assert_matches_reference(inputs, 2, dilation=2**29, **tolerance)


def test_calls_from_several_threads_at_once_keep_their_layouts_apart():
    """The kernel keeps its key and value layouts' memory between calls; calls running at the same time, of two
    sizes, each take buffers of their own."""
    cases = [make_inputs(L, 3, G=1, rel=True, D=D, seed=L) for L, D in ((40, 8), (90, 12))]
    expected = [run("reference", inputs, 3)[0] for inputs in cases]

    def calls(case):
        return [run("fused_cpu", cases[case], 3)[0] for _ in range(8)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(calls, [0, 1, 0, 1]))
    for case, outs in zip([0, 1, 0, 1], results):
        for out in outs:
            torch.testing.assert_close(out, expected[case], rtol=1e-7, atol=1e-9)


def test_bfloat16_is_computed_in_float32():
    inputs = make_inputs(29, 4, G=1, rel=True, glob_bias=True, dtype=torch.bfloat16)
    out, _ = run("fused_cpu", inputs, 4, dilation=2)
    assert out.dtype == torch.bfloat16
    wide = {name: t.detach().float() for name, t in inputs.items()}
    expected = local_attention_1d(
        wide.pop("q"), wide.pop("k"), wide.pop("v"), 4, dilation=2, backend="reference", **wide
    )
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_gradcheck():
    inputs = make_inputs(7, 2, G=1, rel=True, glob_bias=True, B=1, H=2, D=4)
    mask = torch.tensor([[False, False, True, False, False, False, True]])

    def fn(*tensors):
        named = dict(zip(inputs, tensors))
        return local_attention_1d(
            named.pop("q"),
            named.pop("k"),
            named.pop("v"),
            2,
            dilation=(1, 2),
            key_padding_mask=mask,
            backend="fused_cpu",
            **named,
        )

    assert torch.autograd.gradcheck(fn, tuple(inputs.values()))


# Blocks of 16 queries at 0, 16, 32 of 40 score the span of keys their windows cover, and the global key. w = 2: the
# spans 0..17, 14..33 and 30..39; w = 3: 0..18, 12..34 and 28..39, each span from an even key (13 and 29 rounded down).
@pytest.mark.parametrize(
    "window,pairs",
    [(2, 16 * (18 + 1) + 16 * (20 + 1) + 8 * (10 + 1)), (3, 16 * (19 + 1) + 16 * (23 + 1) + 8 * (12 + 1))],
)
def test_products_are_counted_by_the_flop_counter(window, pairs):
    from vil.ops.backends.fused_cpu import check_fused_cpu

    check_fused_cpu()  # the formulas are registered when the kernel loads, before the counter starts
    inputs = make_inputs(40, window, G=1, B=1, H=1, dtype=torch.float32)
    assert_products_counted(
        lambda: local_attention_1d(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            window,
            global_k=inputs["global_k"],
            global_v=inputs["global_v"],
            backend="fused_cpu",
        ),
        pairs,
        8,
    )


# bfloat16, 40 tokens, w 20, one global key. Float32 products take blocks of 20 queries (at 0 and 20, each scoring keys
# 0..39); half-precision ones blocks of 16 (at 0, 16 and 32, scoring keys 0..35, 0..39 and 12..39).
@pytest.mark.parametrize(
    "products,pairs", [("float32", 20 * (40 + 1) * 2), ("half", 16 * (36 + 1) + 16 * (40 + 1) + 8 * (28 + 1))]
)
def test_the_flop_counter_counts_the_blocks_each_way_of_multiplying_takes(monkeypatch, products, pairs):
    from vil.ops.backends import fused_cpu

    if products == "half" and fused_cpu.half_products_missing(torch.bfloat16):
        pytest.skip(f"half-precision products: {fused_cpu.half_products_missing(torch.bfloat16)}")
    monkeypatch.setenv(fused_cpu.PRODUCTS_VARIABLE, products)
    fused_cpu.check_fused_cpu()
    inputs = make_inputs(40, 20, G=1, B=1, H=1, dtype=torch.bfloat16)
    assert_products_counted(
        lambda: local_attention_1d(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            20,
            global_k=inputs["global_k"],
            global_v=inputs["global_v"],
            backend="fused_cpu",
        ),
        pairs,
        8,
    )


def test_refuses_other_devices():
    q, k, v = (torch.empty(1, 2, 8, 4, device="meta") for _ in range(3))
    with pytest.raises(ValueError, match=r"fused_cpu.*cpu tensors.*meta"):
        local_attention_1d(q, k, v, 2, backend="fused_cpu")


def kernel_arguments(B=1, H=2, L=9, D=8, G=1, w=2, residues=2):
    """The arguments of the C++ kernels' 1D forward and backward (``torch.ops.vil_local_attention_cpu``) by name:
    dilations (1, 2), so two residue classes of partial sums, one global key, both bias tables and a mask."""
    q, k, v, out, grad_out = (torch.randn(B, H, L, D) for _ in range(5))
    gk, gv = (torch.randn(B, H, G, D) for _ in range(2))
    return dict(
        q=q,
        k=k,
        v=v,
        global_k=gk,
        global_v=gv,
        rel_bias=torch.zeros(H, 2 * w + 1),
        global_bias=torch.zeros(H, G),
        key_padding_mask=random_mask(B, L),
        out=out,
        grad_out=grad_out,
        lse=torch.zeros(B, H, L),
        grad_q=torch.empty_like(q),
        grad_k=torch.empty_like(k),
        grad_v=torch.empty_like(v),
        grad_global_k=torch.zeros(B, H, residues, G, D),
        grad_global_v=torch.zeros(B, H, residues, G, D),
        grad_rel_bias=torch.zeros(B, H, residues, 2 * w + 1),
        grad_global_bias=torch.zeros(B, H, residues, G),
        dilations=[1, 2],
        window=w,
        causal=False,
        block=16,
        scale=0.25,
        half_products=False,
    )


FORWARD_1D = "q k v global_k global_v rel_bias global_bias key_padding_mask out lse dilations window causal block"
BACKWARD_1D = (
    "q k v global_k global_v rel_bias global_bias key_padding_mask out grad_out lse grad_q grad_k grad_v "
    "grad_global_k grad_global_v grad_rel_bias grad_global_bias dilations window causal block"
)


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("v", torch.randn(1, 2, 4, 8), r"v must have q's shape \[1, 2, 9, 8\] .* got shape \[1, 2, 4, 8\]"),
        ("q", torch.randn(2, 9, 8), r"q must have shape \(B, H, L, D\), got \[2, 9, 8\]"),
        ("lse", torch.zeros(1, 2, 4), r"lse must have shape \[1, 2, 9\], got \[1, 2, 4\]"),
        ("rel_bias", torch.zeros(2, 3), r"rel_bias must have shape \[2, 5\] \(or be empty\), got \[2, 3\]"),
        ("key_padding_mask", torch.zeros(1, 4, dtype=torch.bool), r"key_padding_mask must have shape \[1, 9\]"),
        ("key_padding_mask", torch.zeros(1, 9), r"key_padding_mask must be a contiguous Bool tensor, got Float"),
        ("dilations", [1, 0], r"dilations must be at least 1, got \[1, 0\]"),
        ("dilations", [1], r"dilations must hold one int per head \(2\), got 1"),
        ("window", 0, r"window must be at least 1, got 0"),
        ("block", 0, r"block must be at least 1, got 0"),
        (
            "grad_global_v",
            torch.zeros(1, 2, 1, 8),
            r"grad_global_v must have shape \[1, 2, 2, 1, 8\], got \[1, 2, 1, 8\]",
        ),
        ("grad_global_bias", torch.zeros(1, 2, 1), r"grad_global_bias must have shape \[1, 2, 2, 1\] \(or be empty\)"),
        ("grad_k", torch.randn(1, 2, 9, 4), r"grad_k must have q's shape \[1, 2, 9, 8\] .* got shape \[1, 2, 9, 4\]"),
    ],
)
def test_kernels_refuse_other_shapes_in_one_sentence(name, value, message):
    # The C++ entry points check everything they index with, so that no call reads or writes past a tensor (a
    # dilation of 0 would divide by zero).
    from vil.ops.backends import fused_cpu

    arguments = kernel_arguments()
    arguments[name] = value
    ops = fused_cpu._kernels()
    backward = name.startswith("grad")
    names = (BACKWARD_1D if backward else FORWARD_1D).split() + ["scale", "half_products"]
    with pytest.raises(RuntimeError, match=f"^local_attention_cpu: {message}"):
        (ops.backward_1d if backward else ops.forward_1d)(*(arguments[n] for n in names))


def test_padded_keys_of_any_value_stay_hidden():
    """A padded key's score is masked, not summed with the mask: padded keys of any value, NaN too, leave the outputs
    as finite keys do. (Padded values, and the gradients, take finite padding, as the reference's products do.)"""
    q, k, v = (torch.randn(2, 2, 40, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[:, 30:] = True
    want = local_attention_1d(q, k, v, 2, key_padding_mask=mask, backend="reference")
    k[:, :, 30:] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        got = local_attention_1d(q.to(dtype), k.to(dtype), v.to(dtype), 2, key_padding_mask=mask, backend="fused_cpu")
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[:, :, :30].float(), want[:, :, :30], atol=tol, rtol=tol)
