"""The 1D Triton kernels (``backend="triton"`` of local_attention_1d) against the reference, run by Triton's CPU
interpreter where there is no CUDA GPU, and compiled for the GPU where there is one (tests/conftest.py).

Interpreted kernels are slow, so problems are small (16 channels, sequences of a few tiles); every output buffer
a kernel writes is filled with NaN first (``poisoned_triton_outputs`` in conftest.py).
"""

import sys

import pytest
import torch
from hypothesis import given, seed
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the triton package is not installed; the triton backend cannot run here")

from test_fuzz import fuzz_settings  # noqa: E402
from test_local_attention_1d import CASES, assert_products_counted  # noqa: E402
from test_local_attention_1d import make_inputs as make_local_inputs
from test_triton_kernels import (  # noqa: E402
    CPU_REFUSED,
    assert_close_in_dtype,
    skipped_beyond_the_gpu,
    with_stride_2,
)

from vil.ops import default_backend, local_attention_1d  # noqa: E402
from vil_kernels import flash  # noqa: E402
from vil_kernels import local_attention_1d as kernels

pytestmark = pytest.mark.usefixtures("poisoned_triton_outputs")
DEVICE = torch.device("cpu" if flash.interpreting() or not torch.cuda.is_available() else "cuda")


def make_inputs(L, w, G, rel, glob, mask, B=2, H=2, D=16, dtype=torch.float32, seed=0):
    inputs, padding = make_local_inputs(L, w, G, rel, glob, mask, B=B, H=H, D=D, dtype=dtype, seed=seed)
    inputs = {n: None if t is None else t.detach().to(DEVICE).requires_grad_() for n, t in inputs.items()}
    return inputs, None if padding is None else padding.to(DEVICE)


def run(backend, inputs, padding, w, dilation=1, causal=False):
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
    leaves = [t for t in inputs.values() if t is not None]
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return out, torch.autograd.grad(out, leaves, upstream)


def assert_matches_reference(inputs, padding, w, dilation=1, causal=False, tolerance=2e-5):
    """Output and every gradient of the kernels against the reference, computed in float64."""
    wide = {n: None if t is None else t.detach().double().requires_grad_() for n, t in inputs.items()}
    expected, expected_grads = run("reference", wide, padding, w, dilation, causal)
    out, grads = run("triton", inputs, padding, w, dilation, causal)
    assert_close_in_dtype(inputs, (out, *grads), (expected, *expected_grads), tolerance)
    return out, grads


@pytest.mark.parametrize(
    "L,w,dilation,causal",
    [(128, 1, 1, True), (129, 3, 2, False)],  # a band that ends a tile's keys; a dilation class one over a tile
)
def test_lengths_at_the_edges_of_tiles(L, w, dilation, causal):
    inputs, padding = make_inputs(L, w, 0, False, False, None, B=1, H=1)
    assert_matches_reference(inputs, padding, w, dilation, causal)


@pytest.mark.parametrize("L,w,dilation,causal,G,rel,glob,mask", CASES)
def test_matches_reference(L, w, dilation, causal, G, rel, glob, mask):
    # The op's 1D grid: w 1..64, sequences shorter and longer than the window and than a tile, dilations 1..3 and
    # per head, causal, 0..2 global keys, both bias tables, masked keys and a fully masked sequence.
    inputs, padding = make_inputs(L, w, G, rel, glob, mask)
    out, grads = assert_matches_reference(inputs, padding, w, dilation, causal)
    if mask == "row" and not G:
        assert not out[-1].any() and not grads[0][-1].any()  # no key: zeros and zero gradients


@seed(20261124)
@fuzz_settings(8)
@given(
    B=st.integers(1, 2),
    L=st.integers(1, 200),
    w=st.integers(1, 70),
    dilations=st.lists(st.integers(1, 5), min_size=2, max_size=2),
    causal=st.booleans(),
    G=st.integers(0, 20),
    rel=st.booleans(),
    glob=st.booleans(),
    mask=st.sampled_from([None, "random", "row"]),
)
def test_random_requests_match_reference(B, L, w, dilations, causal, G, rel, glob, mask):
    inputs, padding = make_inputs(L, w, G, rel, glob, mask, B=B, H=2, seed=L * 100 + w)
    assert_matches_reference(inputs, padding, w, tuple(dilations), causal)


@pytest.mark.parametrize("shape", kernels.TILE_SHAPES[1:])
def test_every_tile_shape(monkeypatch, shape):
    # The interpreter runs the first candidate; tuning on a GPU may pick any other (each with its own bias bins).
    monkeypatch.setattr(kernels, "TILE_SHAPES", (shape,))
    inputs, padding = make_inputs(300, 40, 1, True, True, "random", B=1, H=2)
    with skipped_beyond_the_gpu(shape):  # float32: the dQ kernel of (128, 128) tiles needs 384 KiB
        assert_matches_reference(inputs, padding, 40, dilation=(1, 2))


def test_many_global_keys_several_tiles_per_program_and_strided_inputs(monkeypatch):
    # 20 global keys: two blocks of BLOCK_G; one dQ program for all of a head's tiles (its bias sums span them);
    # q, k, v as views of Longformer's (B, L, 3, heads, D) projection.
    monkeypatch.setattr(flash, "TARGET_PROGRAMS", 1)
    inputs, padding = make_inputs(200, 9, 20, True, True, "random", B=2, H=2)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 200, 3, 2, 16, generator=gen).to(DEVICE).requires_grad_()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    inputs.update(q=q, k=k, v=v)
    assert not q.is_contiguous() and q.stride(-1) == 1
    assert_matches_reference(inputs, padding, 9, causal=True)


def test_dilations_beyond_the_sequence():
    # A dilation of 40 over 7 positions leaves each query its own key (and the global one): one program per
    # position, not per empty residue class.
    inputs, padding = make_inputs(7, 2, 1, True, True, None, B=1, H=2)
    assert_matches_reference(inputs, padding, 2, dilation=(40, 3))
    assert kernels.lattice_tiles(7, kernels._fitted((40, 3), 7), 64) == 7


def test_the_widest_window():
    inputs, padding = make_inputs(700, kernels.MAX_WINDOW, 1, True, False, None, B=1, H=1)
    assert_matches_reference(inputs, padding, kernels.MAX_WINDOW, dilation=1)


def test_tiles_read_no_key_outside_their_band():
    # Values past position 600 are NaN: a tile that read a key block beyond its band would turn its outputs NaN
    # (0 * NaN), so the queries whose tiles end well before it must come out as the reference computes them
    # without the NaN (it multiplies every value, so it gets the values zeroed there).
    inputs, _ = make_inputs(1024, 8, 0, False, False, None, B=1, H=1)
    q, k, v = (inputs[n].detach().double() for n in "qkv")
    expected = local_attention_1d(q, k, v, 8, backend="reference")
    with torch.no_grad():
        inputs["v"][:, :, 600:] = float("nan")
    out = local_attention_1d(inputs["q"], inputs["k"], inputs["v"], 8, backend="triton")
    torch.testing.assert_close(out[:, :, :448].double(), expected[:, :, :448], rtol=2e-5, atol=2e-5)
    assert out[:, :, 600:].isnan().all()


@pytest.mark.parametrize("D", [24, 128])
def test_head_dims(D):
    # 24 is not a power of two: the kernels mask the channels past it.
    inputs, padding = make_inputs(40, 5, 1, True, True, "random", B=1, H=1, D=D)
    assert_matches_reference(inputs, padding, 5)


def test_float16_and_float32_bias_tables():
    inputs, padding = make_inputs(70, 6, 1, True, True, "random", dtype=torch.float16)
    assert_matches_reference(inputs, padding, 6, dilation=2, tolerance=1e-2)
    # Float32 parameters next to float16 activations, as under autocast: gradients come back in float32.
    inputs["rel_bias"] = inputs["rel_bias"].detach().float().requires_grad_()
    inputs["global_bias"] = inputs["global_bias"].detach().float().requires_grad_()
    _, grads = run("triton", inputs, padding, 6)
    assert grads[-2].dtype == torch.float32 and grads[-1].dtype == torch.float32


def test_bfloat16():
    inputs, padding = make_inputs(70, 6, 1, True, True, "random", dtype=torch.bfloat16)
    assert_matches_reference(inputs, padding, 6, causal=True, tolerance=3e-2)


@pytest.mark.parametrize(
    "window,pairs",
    [
        # Tiles of 64 queries at 0, 64, 128 read key blocks of 64 from w before them to w after their last query:
        # -5..122, 59..186 and 123..186, and the global key.
        (5, 64 * (128 + 1) + 64 * (128 + 1) + 64 * (64 + 1)),
        # With w 70 the first tile's first block would lie wholly before the sequence (-70..-7) and is skipped:
        # -6..185, -6..185 and 58..185.
        (70, 64 * (192 + 1) + 64 * (192 + 1) + 64 * (128 + 1)),
    ],
)
def test_products_are_counted_by_the_flop_counter(window, pairs):
    inputs, padding = make_inputs(150, window, 1, False, False, None, B=1, H=1)
    assert_products_counted(
        lambda: local_attention_1d(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            window,
            global_k=inputs["global_k"],
            global_v=inputs["global_v"],
            backend="triton",
        ),
        pairs,
        16,
    )


def test_the_default_backend_is_never_triton_where_it_cannot_run():
    assert default_backend(torch.device("cpu"), torch.float32, dims=1) != "triton"
    assert default_backend(torch.device("cuda"), torch.float64, dims=1) != "triton"


def test_the_default_on_cuda_is_triton_for_the_bands_its_kernels_take(monkeypatch, caplog):
    from vil.ops import registry
    from vil.ops.neighborhood import Neighborhood1d

    def queries(B, H, D):  # no memory where there is no GPU (the interpreter takes any device)
        return torch.empty(B, H, 16, D, dtype=torch.float16, device="cuda" if torch.cuda.is_available() else "meta")

    monkeypatch.setattr(registry, "_warned_passed_over", set())
    cuda, band = torch.device("cuda"), Neighborhood1d(256, 2, causal=True)
    assert default_backend(cuda, torch.float16, dims=1) == "triton"
    assert default_backend(cuda, torch.float16, 1, band, queries(2, 12, 64)) == "triton"
    assert default_backend(cuda, torch.float16, dims=2) == "triton"
    with caplog.at_level("WARNING", logger=registry.__name__):
        for _ in range(2):  # passed over with one warning per reason, which names what the kernels take
            assert default_backend(cuda, torch.float16, 1, band, queries(2, 12, 8)) == "sliding_chunk"
            wide = Neighborhood1d(kernels.MAX_WINDOW + 1)
            assert default_backend(cuda, torch.float16, 1, wide, queries(2, 12, 64)) == "sliding_chunk"
            assert default_backend(cuda, torch.float16, 1, band, queries(5462, 12, 64)) == "sliding_chunk"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3 and all(w.endswith("Using sliding_chunk instead.") for w in warnings)
    assert "head_dim 16..128" in warnings[0] and "got 8" in warnings[0]
    assert f"1..{kernels.MAX_WINDOW}" in warnings[1] and f"got {kernels.MAX_WINDOW + 1}" in warnings[1]
    assert "at most 65535" in warnings[2] and "got 65544" in warnings[2]


def test_a_transformers_longformer_on_the_kernels_gives_its_outputs_and_gradients(monkeypatch):
    # What backend=None runs on CUDA for transformers' Longformer: two layers of different windows, padding and a
    # global token per sequence, float32 (head_dim 16, the kernels' least), against transformers' own model.
    pytest.importorskip("transformers", reason="the transformers extra (pip install 'vil[transformers]')")
    import copy

    import transformers
    from test_transformers_longformer import batch, longformer_config

    import vil

    monkeypatch.setattr(flash, "_TUNED", {})
    torch.manual_seed(0)
    reference = transformers.LongformerModel(longformer_config(hidden_size=64)).to(DEVICE)
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference), backend="triton")
    ids, mask, global_mask = (t.to(DEVICE) for t in batch(one_global_each=True))
    results = []
    for model in (reference, accelerated):
        out = model.train()(ids, attention_mask=mask, global_attention_mask=global_mask).last_hidden_state
        (out * mask[..., None]).square().sum().backward()
        results.append((out[mask.bool()], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    assert {name for name, _ in flash._TUNED} == {"forward_1d", "backward_dkdv_1d", "backward_dq_1d"}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")


# --- Bad input: one plain sentence each. ---


@pytest.mark.parametrize(
    "change,facts",
    [
        (dict(D=8), ["head_dim 16..128", "got 8"]),
        (dict(D=136), ["head_dim 16..128", "got 136"]),
        (dict(dtype=torch.float64), ["float32, float16 or bfloat16", "got torch.float64"]),
        (dict(w=513), ["windows 1..512", "got 513"]),
    ],
)
def test_unsupported_inputs_are_one_sentence(change, facts):
    w = change.pop("w", 2)
    length = w + 1  # long enough that the window is not fitted to the sequence
    inputs, padding = make_inputs(length, w, 0, True, False, None, B=1, H=1, **change)
    with pytest.raises(ValueError) as err:
        run("triton", inputs, padding, w)
    message = str(err.value)
    assert message.count("\n") == 0 and all(fact in message for fact in ["triton", *facts]), message


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(flash, "interpreting", lambda: False)
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", torch.device("cpu"))
    inputs, padding = make_inputs(8, 2, 0, False, False, None, B=1, H=1)
    with pytest.raises(ValueError, match=CPU_REFUSED):
        run("triton", inputs, padding, 2)


FORWARD_ARGS = ("q", "k", "v", "global_k", "global_v", "rel_bias", "global_bias", "mask", "dilations")
BACKWARD_ARGS = (
    "do",
    "q",
    "k",
    "v",
    "global_k",
    "global_v",
    "rel_bias",
    "global_bias",
    "mask",
    "o",
    "lse",
    "dilations",
)


@pytest.mark.parametrize(
    "head_dim,window,message", [(8, 2, "head_dim 16..128 .*, got 8"), (16, 513, "1..512, got 513")]
)
def test_launchers_refuse_head_dims_and_windows_the_kernels_do_not_take(head_dim, window, message):
    # Called directly, not through the op layer's backend check: the launchers check what the kernels take.
    inputs, _ = make_inputs(9, 2, 0, False, False, None, B=1, D=head_dim)
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=message):
        kernels.forward(q, k, v, None, None, None, None, None, (1, 1), window, False, 0.25)


@pytest.mark.parametrize(
    "launcher,name,change,message",
    [
        ("forward", "q", with_stride_2, r"q of shape \(1, 2, 9, 16\) with unit stride .* strides \(576, 288, 32, 2\)"),
        ("forward", "v", lambda v: v[:, :, :4], r"v of shape \(1, 2, 9, 16\) .* got shape \(1, 2, 4, 16\)"),
        (
            "forward",
            "global_k",
            lambda global_k: global_k[..., :8],
            r"global_k of shape \(1, 2, 1, 16\) .* got shape \(1, 2, 1, 8\)",
        ),
        ("forward", "rel_bias", lambda rb: rb[:, :3], r"rel_bias as a contiguous .* \(2, 5\), got shape \(2, 3\)"),
        ("forward", "mask", lambda mask: mask[:, :4], r"a bool key_padding_mask of shape \(1, 9\) .* shape \(1, 4\)"),
        ("forward", "dilations", lambda dilations: (1,), r"one positive int dilation per head \(2\), got \(1,\)"),
        ("forward", "dilations", lambda dilations: (0, 1), r"one positive int dilation per head \(2\), got \(0, 1\)"),
        ("forward", "mask", lambda mask: mask.long(), r"a bool key_padding_mask of shape \(1, 9\) .* got torch.int64"),
        (
            "forward",
            "k",
            lambda k: k.half(),
            r"k of q's dtype and device \(torch.float32 on {device}\), got torch.float16 on {device}",
        ),
        ("forward", "global_v", lambda global_v: None, r"global keys and values together"),
        ("backward", "o", with_stride_2, r"o of shape \(1, 2, 9, 16\) with unit stride .* strides \(576, 288, 32, 2\)"),
        (
            "backward",
            "lse",
            lambda lse: lse.transpose(1, 2),
            r"lse as a contiguous .* \(1, 2, 9\), got shape \(1, 9, 2\)",
        ),
        ("backward", "lse", lambda lse: lse.half(), r"lse of torch.float32 on q's device {device}, got torch.float16"),
    ],
)
def test_launchers_refuse_tensors_of_other_shapes_or_layouts_in_one_sentence(launcher, name, change, message):
    # The launchers read rows through the strides of all but the last dimension and index the tables themselves:
    # a tensor laid out otherwise is refused before a kernel reads it.
    inputs, mask = make_inputs(9, 2, 1, True, True, "random", B=1, H=2)
    tensors = {name: inputs[name].detach() for name in ("q", "k", "v", "rel_bias", "global_bias")}
    tensors.update(
        global_k=inputs["global_k"].detach(), global_v=inputs["global_v"].detach(), mask=mask, dilations=(1, 2)
    )
    tensors["o"], tensors["lse"] = kernels.forward(*(tensors[n] for n in FORWARD_ARGS), 2, False, 0.25)
    tensors["do"] = torch.ones_like(tensors["o"])
    tensors[name] = change(tensors[name])
    args = FORWARD_ARGS if launcher == "forward" else BACKWARD_ARGS
    # "{device}" in a message stands for the device as the launchers name it: "cpu", "cuda:0".
    message = message.replace("{device}", rf"{DEVICE.type}(:\d+)?")
    with pytest.raises(ValueError, match=f"^The triton kernels take {message}"):
        getattr(kernels, launcher)(*(tensors[n] for n in args), 2, False, 0.25)
