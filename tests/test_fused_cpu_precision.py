"""The fused CPU kernels on half-precision and strided inputs: q, k and v read as a fused projection lays them out,
in their dtype, against the float64 reference on the same rounded values; nothing copied or cast around the kernel."""

import logging

import pytest
import torch
from tool_runner import run_tool
from torch.profiler import profile

from vil.config import load_cfg
from vil.ops import local_attention_1d, local_attention_2d
from vil.training import setup

# The kernels compute in float32 and round each result once; bfloat16 keeps 8 significant bits, float16 11.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1.5e-3, torch.float32: 2e-6}
DTYPES = list(TOLERANCE)
NAMES = ("out", "qkv", "global_k", "global_v", "rel_bias", "global_bias")


def leaves(B, tokens, H, D, G, rel_rows, dtype):
    """A (B, tokens, 3, H, D) qkv tensor, as a fused projection gives it, and the global keys, values and both bias
    tables; drawn in float32, then rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((B, tokens, 3, H, D), (B, H, G, D), (B, H, G, D), (H, rel_rows), (H, G))
    return [torch.randn(*shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def in_float64(tensors):
    """The oracle's inputs: the same (rounded) values in float64."""
    return [t.detach().double().requires_grad_() for t in tensors]


def split_qkv(qkv):
    """q, k and v as (B, H, tokens, D) views of qkv: none of them is contiguous."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def gradients(out, inputs):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return (out, *torch.autograd.grad(out, inputs, upstream))


def assert_close_to_reference(got, want, dtype):
    """Each result in ``dtype``, within the dtype's tolerance of the float64 reference, relative to its size."""
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype, name
        error = (g.double() - w).abs().max() / w.abs().max().clamp(min=1.0)
        assert error <= TOLERANCE[dtype], f"{name}: relative error {error:.2e} in {dtype}"


def optional_inputs(inputs):
    """The op's keyword arguments for the inputs after qkv."""
    return dict(zip(("global_k", "global_v", "rel_bias", "global_bias"), inputs[1:]))


def attend_2d(inputs, backend, grid, window, exact, dilation):
    q, k, v = (t.reshape(t.shape[:2] + grid + t.shape[-1:]) for t in split_qkv(inputs[0]))
    out = local_attention_2d(
        q, k, v, window, exact=exact, dilation=dilation, backend=backend, **optional_inputs(inputs)
    )
    return gradients(out, inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,exact,dilation", [(3, 0, 1), (2, 1, 2), (3, -1, 1)])
def test_2d_strided_inputs_in_their_dtype_match_the_reference(dtype, window, exact, dilation):
    grid = (9, 11)
    inputs = leaves(2, 99, 3, 16, 2, (4 * window - 1) ** 2, dtype)
    got = attend_2d(inputs, "fused_cpu", grid, window, exact, dilation)
    want = attend_2d(in_float64(inputs), "reference", grid, window, exact, dilation)
    assert_close_to_reference(got, want, dtype)


def attend_1d(inputs, backend, window, dilation, causal, padding):
    out = local_attention_1d(
        *split_qkv(inputs[0]),
        window,
        dilation=dilation,
        causal=causal,
        key_padding_mask=padding,
        backend=backend,
        **optional_inputs(inputs),
    )
    return gradients(out, inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dilation,causal", [(1, False), ((1, 2, 3), False), (2, True)])
def test_1d_strided_inputs_in_their_dtype_match_the_reference(dtype, dilation, causal):
    window, length = 4, 45
    inputs = leaves(2, length, 3, 16, 2, 2 * window + 1, dtype)
    padding = torch.rand(2, length, generator=torch.Generator().manual_seed(3)) < 0.2
    got = attend_1d(inputs, "fused_cpu", window, dilation, causal, padding)
    want = attend_1d(in_float64(inputs), "reference", window, dilation, causal, padding)
    assert_close_to_reference(got, want, dtype)


@pytest.mark.parametrize("dims", [1, 2])
def test_nothing_as_large_as_q_is_copied_or_cast_around_the_kernel(dims):
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


def test_amp_runs_on_the_cpu_when_asked_and_says_so_where_its_products_are_slow(monkeypatch, caplog):
    amp, _ = setup.amp_context(load_cfg(overrides=["AMP.ENABLED", "True"]), torch.device("cpu"))
    with amp():
        assert not torch.is_autocast_enabled("cpu")  # the presets' AMP is their GPU recipe's
    cfg = load_cfg(overrides=["AMP.ENABLED", "True", "AMP.ON_CPU", "True"])
    for native in (True, False):
        monkeypatch.setattr(setup, "cpu_multiplies_natively", lambda dtype, native=native: native)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vil"):
            amp, scaler = setup.amp_context(cfg, torch.device("cpu"))
        with amp():
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        assert not scaler.is_enabled()
        assert ("bfloat16" in caplog.text and "AVX512-BF16" in caplog.text) != native


def test_precision_benchmark_prints_both_tables(tmp_path):
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
        "--markdown",
        tmp_path / "precision.md",
    )
    assert status == 0
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 2D") or line.startswith("| 1D")]
    problems = {(row[0], row[1], row[2]) for row in rows if len(row) == 9}
    assert problems == {
        (f"| {problem}", dtype, mode)
        for problem in ("2D 6x6", "1D 40 tokens")
        for dtype in ("float32", "bfloat16")
        for mode in ("inference", "training")
    }
    assert {tuple(row[:2]) for row in rows if len(row) == 3} == {
        ("| 2D 6x6", "inference"),
        ("| 2D 6x6", "training"),
        ("| 1D 40 tokens", "inference"),
        ("| 1D 40 tokens", "training"),
    }
    assert "half-precision matrix flags" in out.splitlines()[0]
    assert (tmp_path / "precision.md").read_text().strip() in out
