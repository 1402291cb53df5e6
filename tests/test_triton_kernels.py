"""The fused Triton kernels against the reference backend, run by Triton's CPU interpreter where there is no CUDA
GPU, and compiled for the GPU where there is one (tests/conftest.py).

Interpreted kernels are slow, so problems are small (one or two heads of 16 channels, maps of a few chunks);
every output buffer a kernel writes is filled with NaN first (``poisoned_triton_outputs`` in conftest.py).
"""

import contextlib
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed; the triton backend cannot run here")

from test_local_attention import make_inputs as make_local_inputs  # noqa: E402
from test_local_attention_1d import assert_products_counted  # noqa: E402

from vil.config import load_cfg  # noqa: E402
from vil.model_config import build_model  # noqa: E402
from vil.ops import local_attention_2d  # noqa: E402
from vil_kernels import flash  # noqa: E402
from vil_kernels import local_attention as kernels

DEVICE = torch.device("cpu" if flash.interpreting() or not torch.cuda.is_available() else "cuda")

# What the kernels must cover, as (X, Y, w, exact, mode, G, rel_bias, global_bias, dilation): every SW_EXACT,
# the random-shift modes, 0/1/2 global keys, each bias table alone and together, odd map sizes, maps smaller
# than a chunk or of one chunk along an axis (duplicate neighbours under wrap-around), w 1..7, dilation 2 and 3.
CASES = [
    (7, 8, 3, 0, 0, 1, True, True, 1),
    (9, 7, 2, 0, 0, 2, True, False, 1),
    (6, 10, 3, 0, 0, 0, False, False, 1),
    (7, 7, 3, -1, 0, 1, True, True, 1),
    (5, 7, 3, -1, 0, 2, True, True, 1),  # 2 x 3 chunks: wrapped neighbours coincide
    (3, 8, 4, -1, 0, 1, False, True, 1),  # one chunk row
    (8, 6, 3, 1, 0, 1, True, True, 1),
    (9, 9, 1, 1, 0, 0, True, False, 1),
    (11, 5, 2, 1, 0, 2, False, True, 1),
    (6, 7, 3, 0, -1, 1, True, True, 1),
    (7, 7, 2, 0, 1, 1, True, True, 1),
    (8, 7, 3, 0, 5, 2, True, False, 1),
    (6, 6, 3, -1, 2, 1, True, True, 1),
    (5, 8, 3, -1, 8, 0, True, False, 1),
    (4, 6, 3, -1, 3, 1, False, True, 1),  # modes with wrap-around onto the own chunk
    (6, 5, 7, 0, 0, 1, True, True, 1),  # the map is smaller than w
    (10, 9, 5, 0, 0, 1, True, True, 1),  # w 5..8: 8 x 8 chunk tiles
    (9, 10, 6, 1, 0, 1, True, False, 1),
    (9, 9, 7, -1, 0, 1, True, True, 1),
    (9, 8, 1, 1, 0, 1, True, True, 2),  # dilation
    (11, 7, 2, 1, 0, 0, True, False, 2),
    (10, 9, 1, 1, 0, 2, False, True, 3),
]


pytestmark = pytest.mark.usefixtures("poisoned_triton_outputs")


def make_inputs(X, Y, w, G, rel, glob, B=1, H=2, D=16, dtype=torch.float32, seed=0):
    return make_local_inputs(X, Y, w, G, rel, glob, B=B, H=H, D=D, dtype=dtype, seed=seed, device=DEVICE)


def run(backend, inputs, w, exact=0, mode=0, dilation=1):
    kw = {name: t for name, t in inputs.items() if name not in ("q", "k", "v")}
    out = local_attention_2d(
        inputs["q"], inputs["k"], inputs["v"], w, exact=exact, mode=mode, dilation=dilation, backend=backend, **kw
    )
    leaves = [t for t in inputs.values() if t is not None]
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return out, torch.autograd.grad(out, leaves, upstream)


def assert_matches_reference(inputs, w, exact=0, mode=0, dilation=1, tolerance=2e-5):
    """Output and every gradient of the kernels against the reference, computed in float64."""
    wide = {n: None if t is None else t.detach().double().requires_grad_() for n, t in inputs.items()}
    expected, expected_grads = run("reference", wide, w, exact, mode, dilation)
    out, grads = run("triton", inputs, w, exact, mode, dilation)
    assert_close_in_dtype(inputs, (out, *grads), (expected, *expected_grads), tolerance)


def assert_close_in_dtype(inputs, results, expected, tolerance):
    """The output and the gradients of ``inputs`` (those not None, in order) in the dtypes of q and of each input,
    close to the reference's."""
    assert results[0].dtype == inputs["q"].dtype
    names = ["output"] + [n for n, t in inputs.items() if t is not None]
    for name, got, want in zip(names, results, expected):
        if name != "output":
            assert got.dtype == inputs[name].dtype
        torch.testing.assert_close(
            got.double(),
            want,
            rtol=tolerance,
            atol=tolerance,
            msg=lambda m, name=name: f"{name}: {m}\nTile shapes (kernel, tuning key: tile): {flash._TUNED}",
        )


@pytest.mark.parametrize("X,Y,w,exact,mode,G,rel,glob,dilation", CASES)
def test_matches_reference(X, Y, w, exact, mode, G, rel, glob, dilation):
    assert_matches_reference(make_inputs(X, Y, w, G, rel, glob), w, exact, mode, dilation)


def test_batch_of_several_and_strided_inputs():
    # Two batch entries (the backward adds up the bias gradients over them), q/k/v as views of one tensor.
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 7, 6, 3, 2, 16, generator=gen).to(DEVICE).requires_grad_()
    inputs = make_inputs(7, 6, 3, 1, True, True, B=2)
    q, k, v = (qkv[:, :, :, i].permute(0, 3, 1, 2, 4) for i in range(3))
    inputs.update(q=q, k=k, v=v)
    assert not q.is_contiguous()
    assert_matches_reference(inputs, 3, 0, 0)


def test_queries_whose_every_key_a_bias_hides_give_zeros_as_the_reference_does():
    # Only the table's offset (-3, -3) is finite (query minus key): the queries without a key 3 rows and 3 columns
    # further in their window see none, and output zeros with zero gradients (their log-sum-exp is +inf).
    inputs = make_inputs(4, 5, 2, 0, True, False)
    rel_bias = torch.full_like(inputs["rel_bias"], float("-inf"))
    rel_bias[:, 0] = 0.5
    inputs["rel_bias"] = rel_bias.requires_grad_()
    out, _ = run(
        "reference", {n: None if t is None else t.detach().double().requires_grad_() for n, t in inputs.items()}, 2
    )
    assert (out.abs().sum(-1) == 0).sum() == 2 * 19  # of the 2 heads x 20 queries
    assert_matches_reference(inputs, 2)


@pytest.mark.parametrize("D", [32, 48, 96, 128])
def test_head_dims(D):
    # 48 and 96 are not powers of two: the kernels mask the channels past them.
    assert_matches_reference(make_inputs(6, 5, 2, 1, True, True, H=1, D=D), 2, 0, 0)


@pytest.mark.parametrize(
    "w,shape,stages",
    [(5, (8, 4), 3), (6, (4, 8), 3), (7, (4, 4), 3), (9, (8, 8), 3), (10, (4, 4), 3), (12, (4, 4), 1)],
)
def test_every_tile_shape(monkeypatch, w, shape, stages):
    # The interpreter runs the first candidate; tuning on a GPU may pick any other. Chunks of 5..8 tokens are 8 x 8
    # tiles, of 9..16 tokens 16 x 16, split into (query rows, key rows) per program; the last candidate is the
    # smallest shape without pipelining.
    pad = max(4, 1 << (w - 1).bit_length())
    candidate = (*shape, kernels.num_warps(shape[0], pad), stages)
    assert candidate in kernels._candidates(pad)
    monkeypatch.setattr(kernels, "_candidates", lambda chunk_pad: (candidate,))
    monkeypatch.setattr(flash, "_TUNED", {})  # no shape chosen before for this problem
    X, Y = (12, 11) if w < 9 else (11, 13)
    with skipped_beyond_the_gpu(shape):  # float32 with a bias table: (8, 8) tiles of 16 x 16 chunks need 272 KiB
        assert_matches_reference(make_inputs(X, Y, w, 1, True, True, H=1), w, 0 if w != 9 else 1, 0)


@contextlib.contextmanager
def skipped_beyond_the_gpu(shape):
    """Skip the test where the one tile shape it forces needs more shared memory than the GPU has (the tuner never
    picks such a shape)."""
    try:
        yield
    except RuntimeError as error:
        if "more than this GPU's" not in str(error):
            raise
        pytest.skip(f"tiles {shape} need more shared memory than this GPU has; the tuner skips them there")


@pytest.mark.skipif(flash.interpreting(), reason="the interpreter takes the first tile shape; tuning times a GPU")
def test_tuning_picks_a_timed_tile_shape(monkeypatch):
    # The tests run the first candidate that fits (conftest.py); users get the fastest of the four for 8 x 8 chunks.
    monkeypatch.setattr(flash, "TUNE_TILES", True)
    assert_matches_reference(make_inputs(12, 11, 7, 1, True, True, H=1), 7)
    assert {name for name, _ in flash._TUNED} == {"forward", "backward_dkdv", "backward_dq"}
    assert all(tiles in kernels._candidates(8) for tiles in flash._TUNED.values())


def test_tuning_keeps_the_fastest_tile_shape(monkeypatch):
    timings = {(64, 64, 4): 3.0, (32, 32, 4): 1.0, (16, 16, 4): 2.0}  # do_bench's milliseconds, stubbed
    monkeypatch.setattr(flash.triton.testing, "do_bench", lambda launch: timings[launch.args])
    assert flash._fastest("forward", list(timings), lambda *tiles: None) == (32, 32, 4)


def test_several_batch_entries_per_program_sum_every_entrys_bias_gradients(monkeypatch):
    """Where batch x tiles x heads exceeds TARGET_PROGRAMS (ViL-Small's first stage from a batch of 11 on), a
    backward program takes several batch entries, whose bias-table sums must each be counted once."""
    monkeypatch.setattr(flash, "TARGET_PROGRAMS", 30)
    assert_matches_reference(make_inputs(8, 8, 2, 1, True, True, B=3, H=1), 2)


def test_tile_shapes_are_tuned_per_block_of_global_keys(monkeypatch):
    """BLOCK_G (all the global keys, at least 16) sets a program's registers and shared memory: a shape tuned with
    one global key is not taken for 20 (a block of 32) without being tuned again."""
    monkeypatch.setattr(flash, "_TUNED", {})
    for G in (1, 2, 20):
        run("triton", make_inputs(4, 5, 2, G, False, False, H=1), 2)
    forward_keys = [key for name, key in flash._TUNED if name == "forward"]
    assert len(forward_keys) == 2  # blocks of 16 (one and two global keys) and of 32


def test_tile_shapes_beyond_the_gpu_are_passed_over_or_refused_in_one_sentence(monkeypatch):
    from triton.runtime.errors import OutOfResources

    launched = []

    def launch(bq, bk, warps):  # a GPU whose shared memory holds tiles of 32 queries at most
        if bq > 32:
            raise OutOfResources(278528, 232448, "shared memory")
        launched.append((bq, bk, warps))

    monkeypatch.setattr(flash, "interpreting", lambda: False)
    monkeypatch.setattr(flash, "_TUNED", {})
    # Untimed (as in the tests), the first shape that fits runs.
    flash.tuned_launch("forward", ("key",), [(64, 64, 4), (32, 32, 4), (16, 16, 4)], launch)
    assert launched == [(32, 32, 4)] and flash._TUNED["forward", ("key",)] == (32, 32, 4)  # launched once
    with pytest.raises(
        RuntimeError, match=r"backward_dq kernel with tiles \(64, 8, 8\) needs 278528 .* 232448; choose another backend"
    ):
        flash.tuned_launch("backward_dq", ("key",), [(64, 8, 8)], launch)
    monkeypatch.setattr(flash, "TUNE_TILES", True)
    monkeypatch.setattr(flash.triton.testing, "do_bench", lambda run: run() or 1.0)
    every_shape = r"backward_dq kernel needs .* 232448 bytes .* \(64, 8, 8\), \(128, 8, 8\); choose another backend"
    with pytest.raises(RuntimeError, match=every_shape):
        flash.tuned_launch("backward_dq", ("other key",), [(64, 8, 8), (128, 8, 8)], launch)


def test_products_are_counted_by_the_flop_counter():
    # An 8 x 8 map of 2 x 2 chunks in tiles of 4 x 4 (16 query rows each): 4 corner chunks read 4 chunks, 8 edge
    # chunks 6 and 4 inner ones 9, 100 key tiles of 16 in all, and each of the 16 chunks the global key.
    inputs = make_inputs(8, 8, 2, 1, False, False, H=1)
    pairs = 16 * (100 * 16 + 16 * 1)
    assert_products_counted(
        lambda: local_attention_2d(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            2,
            global_k=inputs["global_k"],
            global_v=inputs["global_v"],
            backend="triton",
        ),
        pairs,
        16,
    )


def test_neighbour_rows_list_present_slots_first():
    # Chunk 0 reads chunks 2 and 0 through slots 0 and 2; chunk 1 reads chunk 1 through slot 2 only.
    table = torch.tensor([[2, -1, 0], [-1, -1, 1]])
    offsets = torch.tensor([[0, 0], [0, 1], [1, 0]])
    rows, counts = kernels.present_first(table, offsets)
    assert rows.dtype == counts.dtype == torch.int32 and rows.is_contiguous()
    assert counts.tolist() == [2, 1]
    assert rows[0, :2].tolist() == [[2, 0, 0], [0, 1, 0]] and rows[1, :1].tolist() == [[1, 1, 0]]


def test_tile_shapes_fit_the_products():
    for chunk_pad in (4, 8, 16):
        shapes = kernels._tile_shapes(chunk_pad)
        assert shapes and shapes[0][0] * chunk_pad >= 16
        for q_rows, k_rows in shapes:
            assert chunk_pad % q_rows == 0 and chunk_pad % k_rows == 0
            assert q_rows * chunk_pad >= 16 and k_rows * chunk_pad >= 16 and q_rows * k_rows >= 16


def test_float16():
    inputs = make_inputs(7, 9, 3, 1, True, True, dtype=torch.float16)
    assert_matches_reference(inputs, 3, 0, 0, tolerance=1e-2)
    assert_matches_reference(make_inputs(8, 7, 2, 1, True, True, dtype=torch.float16), 2, 1, 0, tolerance=1e-2)


def test_bfloat16():
    # Under the interpreter, which multiplies bfloat16 bit patterns, the kernels widen their products' operands
    # (flash.operand); compiled, they multiply bfloat16 on the tensor cores.
    assert_matches_reference(make_inputs(7, 9, 3, 1, True, True, dtype=torch.bfloat16), 3, 0, 0, tolerance=3e-2)


def test_bias_tables_of_float32_under_half_inputs():
    # Float32 parameters next to float16 activations, as under autocast: gradients come back in float32.
    inputs = make_inputs(6, 6, 2, 1, True, True, dtype=torch.float16)
    inputs["rel_bias"] = inputs["rel_bias"].detach().float().requires_grad_()
    inputs["global_bias"] = inputs["global_bias"].detach().float().requires_grad_()
    _, grads = run("triton", inputs, 2)
    assert grads[-2].dtype == torch.float32 and grads[-1].dtype == torch.float32


@pytest.fixture
def matmul_settings():
    """torch's float32 matmul settings as they were before the test, restored after it: the older switch first (it
    also sets the newer per-operation one), then the newer global and per-operation settings."""
    matmul = torch.backends.cuda.matmul
    older = torch.get_float32_matmul_precision()
    newer = (torch.backends.fp32_precision, matmul.fp32_precision) if hasattr(matmul, "fp32_precision") else None
    yield
    torch.set_float32_matmul_precision(older)
    if newer is not None:
        torch.backends.fp32_precision, matmul.fp32_precision = newer


def _set_allow_tf32(on):
    torch.backends.cuda.matmul.allow_tf32 = on


def _set_fp32_precision(global_setting, matmul_setting):
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision settings")
    torch.backends.fp32_precision = global_setting
    torch.backends.cuda.matmul.fp32_precision = matmul_setting


class _PrecisionRecorder:
    """A kernel stand-in that launches nothing and records the DOT_PRECISION of each launch."""

    def __init__(self):
        self.precisions = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.precisions.append(meta["DOT_PRECISION"])


@pytest.mark.parametrize(
    "setting,precision",
    [
        (lambda: _set_allow_tf32(True), "tf32"),
        (lambda: _set_allow_tf32(False), "tf32x3"),
        (lambda: torch.set_float32_matmul_precision("high"), "tf32"),
        (lambda: _set_fp32_precision("none", "tf32"), "tf32"),
        (lambda: _set_fp32_precision("tf32", "none"), "tf32"),  # "none": matmuls follow the global setting
        (lambda: _set_fp32_precision("none", "ieee"), "tf32x3"),
        (lambda: _set_fp32_precision("tf32", "ieee"), "tf32x3"),
        (lambda: _set_fp32_precision("ieee", "tf32"), "tf32"),
    ],
    ids=[
        "allow_tf32",
        "not allow_tf32",
        "high",
        "matmul tf32",
        "global tf32",
        "ieee",
        "global tf32 matmul ieee",
        "global ieee matmul tf32",
    ],
)
def test_float32_products_follow_torchs_tf32_setting(monkeypatch, matmul_settings, setting, precision):
    # Either API of torch may set it; once the newer one has, torch refuses reads of the older allow_tf32.
    from vil.ops import local_attention_1d
    from vil_kernels import local_attention_1d as kernels_1d

    setting()
    recorders = {module: _PrecisionRecorder() for module in (kernels, kernels_1d)}
    for module, recorder in recorders.items():
        monkeypatch.setattr(module, "_fwd_kernel", recorder)
    q = torch.randn(1, 1, 4, 4, 16, device=DEVICE)
    with torch.no_grad():
        local_attention_2d(q, q, q, 2, backend="triton")
        local_attention_1d(q[:, :, 0], q[:, :, 0], q[:, :, 0], 2, backend="triton")
        local_attention_2d(q.half(), q.half(), q.half(), 2, backend="triton")
    assert recorders[kernels].precisions == [precision, "tf32"]  # half precision ignores the setting
    assert recorders[kernels_1d].precisions == [precision]


def test_float32_products_follow_allow_tf32_where_torch_has_only_that(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(allow_tf32=False))
    assert flash.dot_precision(torch.float32) == "tf32x3"
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(allow_tf32=True))
    assert flash.dot_precision(torch.float32) == "tf32"


def _tiny_cfg(attn_type):
    arch = "l1,h2,d32,n1,s1,g1,p4,f3,a0_l2,h1,d32,n1,s1,g1,p2,f2,a0_l3,h1,d32,n1,s0,g1,p2,f2,a0"
    return load_cfg(
        None,
        [
            "MODEL.VIT.MSVIT.ARCH",
            arch,
            "MODEL.VIT.MSVIT.ATTN_TYPE",
            attn_type,
            "INPUT.IMAGE_SIZE",
            "32",
            "DATA.NUM_CLASSES",
            "5",
            "MODEL.VIT.DROP_PATH",
            "0.0",
        ],
    )


def test_model_gives_the_logits_of_sliding_chunk():
    torch.manual_seed(0)
    hand = build_model(_tiny_cfg("sliding_chunk")).eval().to(DEVICE)
    fused = build_model(_tiny_cfg("triton")).eval().to(DEVICE)
    with torch.no_grad():  # relative bias tables start near zero: make them count
        for name, param in hand.named_parameters():
            if "relative_position" in name:
                param.normal_()
    fused.load_state_dict(hand.state_dict())
    images = torch.randn(2, 3, 32, 32, device=DEVICE)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # on a GPU, float32 convolutions in float32
        torch.testing.assert_close(fused(images), hand(images), rtol=1e-4, atol=1e-4)


# --- Bad input: one plain sentence each. ---


@pytest.mark.parametrize(
    "change,facts",
    [
        (dict(D=40), ["head_dim", "16, 32, 48, 64, 96, 128", "got 40"]),
        (dict(dtype=torch.float64), ["float32, float16 or bfloat16", "got torch.float64"]),
        (dict(w=17), ["windows 1..16", "got 17"]),
    ],
)
def test_unsupported_inputs_are_one_sentence(change, facts):
    w = change.pop("w", 2)
    inputs = make_inputs(4, 40, w, 0, False, False, **change)  # a map wide enough to use a window of 17
    with pytest.raises(ValueError) as err:
        run("triton", inputs, w)
    message = str(err.value)
    assert message.count("\n") == 0 and all(fact in message for fact in ["triton", *facts]), message


def with_stride_2(t):
    """``t``'s values with stride 2 along the last dimension."""
    return torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)[..., ::2]


FORWARD_ARGS = ("q", "k", "v", "global_k", "global_v", "rel_bias", "global_bias")
BACKWARD_ARGS = ("do", *FORWARD_ARGS, "o", "lse")


@pytest.mark.parametrize(
    "launcher,name,change,message",
    [
        (
            "forward",
            "q",
            with_stride_2,
            r"q of shape \(1, 2, 5, 6, 16\) with unit stride .* strides \(1920, 960, 192, 32, 2\)",
        ),
        ("forward", "k", lambda k: k[:, :, :2, :2], r"k of shape \(1, 2, 5, 6, 16\) .* got shape \(1, 2, 2, 2, 16\)"),
        (
            "forward",
            "global_v",
            lambda global_v: global_v[:, :1],
            r"global_v of shape \(1, 2, 1, 16\) .* got shape \(1, 1, 1, 16\)",
        ),
        ("forward", "rel_bias", lambda rb: rb[:, :10], r"rel_bias as a contiguous .* \(2, 49\), got shape \(2, 10\)"),
        ("forward", "global_bias", lambda gb: gb.t(), r"global_bias as a contiguous .* \(2, 1\), got shape \(1, 2\)"),
        (
            "backward",
            "do",
            with_stride_2,
            r"do of shape \(1, 2, 5, 6, 16\) with unit stride .* strides \(1920, 960, 192, 32, 2\)",
        ),
        ("backward", "lse", lambda lse: lse[:, :, :-1], r"lse as a contiguous .* \(1, 2, 30\), got shape \(1, 2, 29\)"),
        ("forward", "q", lambda q: q.double(), r"float32, float16 or bfloat16 q, k and v, got q of torch.float64"),
        ("forward", "global_k", lambda global_k: None, r"global keys and values together"),
        (
            "forward",
            "rel_bias",
            lambda rb: rb.double(),
            r"rel_bias of .*bfloat16 on q's device {device}, got torch.float64",
        ),
        ("backward", "v", lambda v: v.bfloat16(), r"v of q's dtype and device .* got torch.bfloat16 on {device}"),
    ],
)
def test_launchers_refuse_tensors_of_other_shapes_or_layouts_in_one_sentence(launcher, name, change, message):
    # The launchers read rows through the strides of all but the last dimension and index the tables themselves:
    # a tensor laid out otherwise is refused before a kernel reads it.
    from vil.ops.backends.triton import kernel_geometry

    inputs = make_inputs(5, 6, 2, 1, True, True)
    tensors = {name: inputs[name].detach() for name in ("q", "k", "v", "rel_bias", "global_bias")}
    tensors.update(global_k=inputs["global_k"].detach(), global_v=inputs["global_v"].detach())
    geo = kernel_geometry(5, 6, 2, 0, 0, 1, DEVICE)
    tensors["o"], tensors["lse"] = kernels.forward(*(tensors[n] for n in FORWARD_ARGS), geo, 0.25)
    tensors["do"] = torch.ones_like(tensors["o"])
    tensors[name] = change(tensors[name])
    args = FORWARD_ARGS if launcher == "forward" else BACKWARD_ARGS
    # "{device}" in a message stands for the device as the launchers name it: "cpu", "cuda:0".
    message = message.replace("{device}", rf"{DEVICE.type}(:\d+)?")
    with pytest.raises(ValueError, match=f"^The triton kernels take {message}"):
        getattr(kernels, launcher)(*(tensors[n] for n in args), geo, 0.25)


@pytest.mark.parametrize(
    "head_dim,window,message", [(20, 2, r"head_dim 16, 32, .*, 128, got 20"), (16, 17, "1..16, got 17")]
)
def test_launchers_refuse_head_dims_and_windows_the_kernels_do_not_take(head_dim, window, message):
    # Called directly, not through the op layer's backend check: the launchers check what the kernels take.
    from vil.ops.backends.triton import kernel_geometry

    inputs = make_inputs(5, 6, window, 0, False, False, D=head_dim)
    geo = kernel_geometry(5, 6, window, 0, 0, 1, DEVICE)
    with pytest.raises(ValueError, match=message):
        kernels.forward(*(inputs[n].detach() for n in ("q", "k", "v")), None, None, None, None, geo, 0.25)


# CPU tensors without the interpreter: refused by the kernels' check where the backend was loaded for the interpreter
# (the tests then switch it off), by the dispatcher on a GPU machine, where the backend runs on CUDA only.
CPU_REFUSED = (
    r"CUDA.*TRITON_INTERPRET=1.*on cpu.*'sliding_chunk'"
    if flash.interpreting()
    else r"runs on cuda tensors, but q is on cpu.*sliding_chunk"
)


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(flash, "interpreting", lambda: False)
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", torch.device("cpu"))
    with pytest.raises(ValueError, match=CPU_REFUSED):
        run("triton", make_inputs(4, 4, 2, 0, False, False), 2)


def test_model_with_an_unsupported_head_dim_is_refused_at_build():
    cfg = _tiny_cfg("triton")
    cfg.defrost()
    cfg.MODEL.VIT.MSVIT.ARCH = cfg.MODEL.VIT.MSVIT.ARCH.replace("d32", "d40", 1)
    with pytest.raises(ValueError, match="head_dim 16, 32, 48, 64, 96, 128, got 20"):
        build_model(cfg)


@pytest.mark.parametrize("value", ["1", "true", "On", "yes", "y", "0", "false", "off", "", "2"])
def test_the_interpreter_is_read_from_the_environment_as_triton_reads_it(monkeypatch, value):
    import triton

    from vil_kernels import interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == triton.knobs.runtime.interpret


def test_kernels_compile_for_a_gpu():
    # The interpreter does not compile; this does, for sm_90: every candidate tile shape of ViL-Small's 2D variant,
    # and the 1D kernels of Longformer's settings (the first tile shape: each 1D shape takes seconds to compile).
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "true"}  # the tool compiles whatever value asks for the interpreter
    root = os.path.dirname(os.path.dirname(__file__))
    tool = [sys.executable, "tools/compile_kernels.py", "--arch", "90"]
    done = subprocess.run(tool + ["--variant", "bfloat16,32,7,0"], capture_output=True, text=True, env=env, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    # the delta pass, and the three kernels with and without globals and bias tables for each candidate
    assert done.stdout.count("| sm_90 | 2D |") == 1 + 3 * 2 * len(kernels._candidates(8))
    assert "unpipelined" in done.stdout and "no globals or bias tables" in done.stdout
    done = subprocess.run(
        tool + ["--variant-1d", "bfloat16,64,256,0", "--first-tile"], capture_output=True, text=True, env=env, cwd=root
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("| sm_90 | 1D |") == 2 + 3  # the delta and global-key passes, and one per tile shape


@pytest.mark.parametrize("parts", ["float32", "bfloat16", "float16"])
def test_bias_bins_sum_score_gradients_per_offset_to_float32_accuracy(parts):
    # flash.offset_sums, which sums the dQ pass's score gradients into the bias table's bins, against sums per
    # (row offset, column offset) taken here in float64: with half-precision parts each float32 term is split in
    # two (its high part alone would be off by 2^-9 of it), with float32 three TF32 products.
    import triton
    import triton.language as tl

    @triton.jit
    def bins_kernel(
        DS,
        OUT,
        row_shift,
        col_shift,
        P: tl.constexpr,
        BQI: tl.constexpr,
        BKI: tl.constexpr,
        BT: tl.constexpr,
        PARTS: tl.constexpr,
    ):
        i, j, t = tl.arange(0, BQI * P), tl.arange(0, BKI * P), tl.arange(0, BT)
        ds = tl.load(DS + i[:, None] * (BKI * P) + j[None, :])
        sums = flash.offset_sums(ds, row_shift, col_shift, P, BQI, BKI, BT, BT, PARTS)
        tl.store(OUT + t[:, None] * BT + t[None, :], sums)

    P, BQI, BKI, BT, row_shift, col_shift = 8, 4, 8, 32, 9, 10  # every bin inside the (BT, BT) table
    ds = torch.randn(BQI * P, BKI * P, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, BKI * P)
    out = torch.full((BT, BT), float("nan"), device=DEVICE)
    bins_kernel[(1,)](ds.to(DEVICE), out, row_shift, col_shift, P, BQI, BKI, BT, getattr(tl, parts))
    q, k = torch.arange(BQI * P), torch.arange(BKI * P)
    rows = ((q // P)[:, None] - (k // P)[None, :] + row_shift).flatten()
    cols = ((q % P)[:, None] - (k % P)[None, :] + col_shift).flatten()
    expected, magnitude, terms = (torch.zeros(BT, BT, dtype=torch.float64) for _ in range(3))
    expected.index_put_((rows, cols), ds.double().flatten(), accumulate=True)
    magnitude.index_put_((rows, cols), ds.double().abs().flatten(), accumulate=True)
    terms.index_put_((rows, cols), torch.ones(rows.shape, dtype=torch.float64), accumulate=True)
    assert (terms > 0).sum() == (BQI + BKI - 1) * (2 * P - 1)  # every offset of the block has its bin
    # each term off by at most 2^-16 of itself, or, in float16, by the subnormal spacing of its rest, 2^-24; Triton's
    # interpreter rounds float32 to bfloat16 by truncation (GPUs to nearest), which leaves up to 2^-14
    relative = 2**-14 if parts == "bfloat16" and flash.interpreting() else 2e-5
    allowed = relative * magnitude + (2**-24 * terms if parts == "float16" else 0) + 1e-30
    assert ((out.cpu().double() - expected).abs() <= allowed).all()


@pytest.mark.parametrize("key_major", [False, True])
def test_scores_read_the_bias_table_only_for_tokens_of_the_chunks(key_major):
    # kernels._local_scores on tiles of P x P tokens whose last row and column are padding (chunks of C = 3 in tiles
    # of P = 4): the scores of the chunks' tokens add the table's entry of their offset, and padding queries and
    # keys score -inf without reading the table, where their offsets would reach past it (here into NaN around it).
    import triton
    import triton.language as tl

    @triton.jit
    def scores_kernel(
        Q,
        K,
        BIAS,
        OUT,
        a,
        b,
        qk_scale,
        W: tl.constexpr,
        C: tl.constexpr,
        P: tl.constexpr,
        D: tl.constexpr,
        PRECISION: tl.constexpr,
        KEY_MAJOR: tl.constexpr,
    ):
        t, d = tl.arange(0, P * P), tl.arange(0, D)
        row, col = t // P, t % P
        valid = (row < C) & (col < C)
        q = tl.load(Q + t[:, None] * D + d[None, :])
        k = tl.load(K + t[:, None] * D + d[None, :])
        if KEY_MAJOR:  # (keys, queries), as the dK and dV pass asks: the key tile first, the offset negated
            s = kernels._local_scores(
                k, q, row, col, row, col, valid, -a, -b, BIAS, qk_scale, W, C, 0, True, PRECISION, KEY_MAJOR=True
            )
        else:
            s = kernels._local_scores(q, k, row, col, row, col, valid, a, b, BIAS, qk_scale, W, C, 0, True, PRECISION)
        tl.store(OUT + t[:, None] * (P * P) + t[None, :], s)

    W = C = 3
    P, D, T, (a, b) = 4, 16, 4 * W - 1, (-1, 1)  # the key chunk is the query chunk's neighbour up and right
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, P * P, D, generator=generator)
    table = torch.randn(T * T, generator=generator)
    around = torch.full((3 * T * T,), float("nan"))
    around[T * T : 2 * T * T] = table
    scale = D**-0.5
    out = torch.full((P * P, P * P), float("nan"), device=DEVICE)
    precision = flash.dot_precision(torch.float32)
    args = (q.to(DEVICE), k.to(DEVICE), around.to(DEVICE)[T * T :], out, a, b, scale * flash.LOG2E)
    scores_kernel[(1,)](*args, W, C, P, D, precision, key_major)
    expected = torch.full((P * P, P * P), float("-inf"), dtype=torch.float64)
    for i in range(P * P):
        for j in range(P * P):
            (qi, qj), (ki, kj) = divmod(i, P), divmod(j, P)
            if max(qi, qj, ki, kj) < C:
                di, dj = qi - ki - a * C, qj - kj - b * C  # query minus key, the chunks side by side
                bias = table[(di + 2 * W - 1) * T + dj + 2 * W - 1].item()
                expected[i, j] = (q[i].double() @ k[j].double() * scale + bias) * flash.LOG2E
    got = out.cpu().double()
    torch.testing.assert_close(got.T if key_major else got, expected, rtol=1e-5, atol=1e-5)


def test_the_default_on_cuda_is_triton_for_the_windows_its_kernels_take(monkeypatch, caplog):
    from vil.ops import registry
    from vil.ops.neighborhood import Neighborhood2d

    def queries(D):  # no memory where there is no GPU (the interpreter takes any device)
        device = "cuda" if torch.cuda.is_available() else "meta"
        return torch.empty(2, 3, 14, 14, D, dtype=torch.bfloat16, device=device)

    monkeypatch.setattr(registry, "_warned_passed_over", set())
    cuda = torch.device("cuda")
    assert registry.default_backend(cuda, torch.bfloat16, 2, Neighborhood2d(7), queries(32)) == "triton"
    with caplog.at_level("WARNING", logger=registry.__name__):
        assert registry.default_backend(cuda, torch.bfloat16, 2, Neighborhood2d(7), queries(24)) == "sliding_chunk"
        wide = Neighborhood2d(kernels.MAX_WINDOW + 1)
        assert registry.default_backend(cuda, torch.bfloat16, 2, wide, queries(32)) == "sliding_chunk"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all(w.endswith("Using sliding_chunk instead.") for w in warnings)
    assert "got 24" in warnings[0] and f"got {kernels.MAX_WINDOW + 1}" in warnings[1]
