"""What the 2D (``local_attention.py``) and 1D (``local_attention_1d.py``) Triton kernels share: loading rows of
tokens, the online softmax and its backward, the global keys, sums of score gradients per relative offset (the
bias tables' gradients), the backward's ``rowsum(dO * O)`` pass, the input checks and the tile-shape tuner.

Scores are in base 2 throughout (``qk_scale = scale * log2(e)``; bias tables are multiplied by ``log2(e)`` where
they are added), so the softmax uses ``exp2`` and the saved log-sum-exp is in base 2.
"""

from functools import cache, partial, wraps

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import interpreting

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The names of the gradients the backward launchers return (a dict), in the order of the inputs they are of.
GRADIENTS = ("grad_q", "grad_k", "grad_v", "grad_global_k", "grad_global_v", "grad_rel_bias", "grad_global_bias")
LOG2E = 1.4426950408889634
DELTA_BLOCK_N = 64  # queries per program of the delta pass
# Programs a backward pass with partial sums aims for: enough to fill a GPU, few enough that the sums stay small.
TARGET_PROGRAMS = 2048


# Allocator of every buffer a kernel writes; tests replace it with one that fills buffers with NaN.
new_output = torch.empty


def cdiv(a, b):
    """``ceil(a / b)`` for the launchers (Triton's ``triton.cdiv`` is a constexpr function, about 2 µs a call)."""
    return -(-a // b)


@cache
def next_power_of_2(n):
    """``triton.next_power_of_2``, cached: the launchers call it for a few sizes on every call."""
    return triton.next_power_of_2(n)


# ---------------------------------------------------------------------------------------------------------------
# Pieces of kernels
# ---------------------------------------------------------------------------------------------------------------


# Triton's interpreter does no bfloat16 arithmetic: its tl.dot multiplies the bit patterns of bfloat16 operands. Under
# it the kernels' products widen such operands to float32 first, which is exact, so that they compute what the GPU
# computes (up to the order of the sums); compiled, the branch is not there.
WIDEN_BFLOAT16 = tl.constexpr(interpreting())


@triton.jit
def operand(x):
    """``x`` as a product reads it: itself, or under the interpreter, bfloat16 widened to float32."""
    if WIDEN_BFLOAT16:
        if x.dtype == tl.bfloat16:
            x = x.to(tl.float32)
    return x


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` with float32 sums; ``DOT_PRECISION`` for float32 operands (half precision ignores it)."""
    return tl.dot(operand(a), operand(b), input_precision=DOT_PRECISION)


@triton.jit
def load_rows(base, row_offsets, valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows of ``HEAD_DIM`` channels (unit stride) at ``base + row_offsets``; zeros for rows not ``valid``."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(base + row_offsets[:, None] + d[None, :], mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def store_rows(base, row_offsets, valid, value, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    tl.store(
        base + row_offsets[:, None] + d[None, :],
        value.to(base.dtype.element_ty),
        mask=valid[:, None] & (d[None, :] < HEAD_DIM),
    )


@triton.jit
def load_globals(base, stride_g, G, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr):
    """The first ``min(G, BLOCK_G)`` global keys (or values) at ``base``; zero rows past G."""
    g = tl.arange(0, BLOCK_G)
    return load_rows(base, g * stride_g, g < G, HEAD_DIM, BLOCK_D)


@triton.jit
def global_scores(
    q, gk, global_bias, G, qk_scale, BLOCK_G: tl.constexpr, HAS_GLOBAL_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """Base-2 scores of the queries against a block of global keys: (queries, BLOCK_G), -inf past G."""
    g = tl.arange(0, BLOCK_G)
    s = dot(q, tl.trans(gk), DOT_PRECISION) * qk_scale
    if HAS_GLOBAL_BIAS:
        s += tl.load(global_bias + g, mask=g < G, other=0.0).to(tl.float32)[None, :] * 1.4426950408889634
    return tl.where((g < G)[None, :], s, float("-inf"))


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    """Adds a block of base-2 scores ``s`` (queries, keys; -inf for hidden keys) and their values to the running
    maximum, sum of exponentials and unnormalised output of each query."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exponentials 0, not NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def initial_softmax_state(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The running state before any key. The maximum starts at -inf, not at a finite stand-in, so that scores below
    any such stand-in (huge negative biases on every key of a query) still count."""
    return (
        tl.full([ROWS], float("-inf"), tl.float32),
        tl.zeros([ROWS], tl.float32),
        tl.zeros([ROWS, BLOCK_D], tl.float32),
    )


@triton.jit
def softmax_result(m_i, l_i, acc):
    """The output and the base-2 log-sum-exp; a query that saw no key outputs zeros, and its log-sum-exp is +inf, so
    that the backward's probabilities ``2^(s - lse)`` are zeros."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(l_i > 0, m_i + tl.log2(l_safe), float("inf"))


@triton.jit
def softmax_grad(s, lse, delta, do, v, row_valid, DOT_PRECISION: tl.constexpr):
    """Probabilities and score gradients of a (queries, keys) block of base-2 scores, from the saved log-sum-exp
    and ``delta = rowsum(dO * O)``: ``p = 2^(s - lse)``, ``ds = p * (dO v^T - delta)``; zero on invalid rows."""
    p = tl.where(row_valid[:, None], tl.exp2(s - lse[:, None]), 0.0)
    dp = dot(do, tl.trans(v), DOT_PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def key_major_grads(s_t, lse, delta, do, q, v, col_valid, DOT_PRECISION: tl.constexpr):
    """The contributions of a (keys, queries) block of base-2 scores to the keys' dK (before the scale) and dV:
    :func:`softmax_grad` transposed, so that the products with Q and dO need no transposed copies; zero for
    invalid query columns."""
    p_t = tl.where(col_valid[None, :], tl.exp2(s_t - lse[None, :]), 0.0)
    dv = dot(p_t.to(do.dtype), do, DOT_PRECISION)
    dp_t = dot(v, tl.trans(do), DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    return dot(ds_t.to(q.dtype), q, DOT_PRECISION), dv


@triton.jit
def _one_hot_product(x, one_hot, ONE_HOT_FIRST: tl.constexpr, PARTS: tl.constexpr):
    """``one_hot @ x`` or ``x @ one_hot`` for a float32 ``x`` and a matrix of zeros and ones, to about float32's
    accuracy: ``x`` as the sum of two ``PARTS`` (bfloat16 or float16) matrices, the high part and the rest, in
    two half-precision products (each term off by at most 2^-16 of itself, or, in float16, by the subnormal spacing
    of its rest, 2^-24); for ``PARTS`` float32, three TF32 products."""
    if PARTS == tl.float32:
        if ONE_HOT_FIRST:
            product = tl.dot(one_hot.to(tl.float32), x, input_precision="tf32x3")
        else:
            product = tl.dot(x, one_hot.to(tl.float32), input_precision="tf32x3")
    else:
        high = x.to(PARTS)
        rest = operand((x - high.to(tl.float32)).to(PARTS))
        if WIDEN_BFLOAT16:  # the interpreter casts True to bfloat16 as the bit pattern 1, not as 1.0
            one_hot = one_hot.to(tl.float32)
        high, one_hot = operand(high), operand(one_hot.to(PARTS))
        if ONE_HOT_FIRST:
            product = tl.dot(one_hot, rest, acc=tl.dot(one_hot, high))
        else:
            product = tl.dot(rest, one_hot, acc=tl.dot(high, one_hot))
    return product


@triton.jit
def offset_sums(
    ds,
    row_shift,
    col_shift,
    P: tl.constexpr,
    BQI: tl.constexpr,
    BKI: tl.constexpr,
    BT_ROWS: tl.constexpr,
    BT_COLS: tl.constexpr,
    PARTS: tl.constexpr,
):
    """Sums of a (BQI*P, BKI*P) block of score gradients per relative offset, for tokens laid out in rows of P
    (token t at row ``t // P``, column ``t % P``): entry (r, c) of the (BT_ROWS, BT_COLS) result adds up the pairs
    with ``query row - key row + row_shift == r`` and ``query column - key column + col_shift == c`` (others are
    dropped). Two products with one-hot matrices (see :func:`_one_hot_product` for ``PARTS``, the inputs'
    dtype), after regrouping the block so that rows pair a query row with a key row and columns a query column
    with a key column; no atomics, so sums are deterministic."""
    ds = tl.reshape(ds, (BQI, P, BKI, P))
    ds = tl.permute(ds, (0, 2, 1, 3))
    ds = tl.reshape(ds, (BQI * BKI, P * P))
    pair = tl.arange(0, BQI * BKI)
    row_bin = pair // BKI - pair % BKI + row_shift
    col = tl.arange(0, P * P)
    col_bin = col // P - col % P + col_shift
    by_col = _one_hot_product(ds, col_bin[:, None] == tl.arange(0, BT_COLS)[None, :], False, PARTS)
    rows = tl.arange(0, BT_ROWS)
    return _one_hot_product(by_col, rows[:, None] == row_bin[None, :], True, PARTS)


@triton.jit
def delta_kernel(
    Out,
    DO,
    DELTA,
    s_ob,
    s_oh,
    s_on,
    s_db,
    s_dh,
    s_dn,
    H,
    N,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """delta = rowsum(dO * O) per query (the softmax backward's correction term), for O and dO of
    (B, H, N tokens, HEAD_DIM) with strides (s_*b, s_*h, s_*n, 1); DELTA is (B*H, N)."""
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B*H slices can pass 2^31 elements
    b_idx, h = bh // H, bh % H
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = n < N
    n = n.to(tl.int64)  # n times a row stride can pass 2^31 (rows of a wide projection, strided)
    o = load_rows(Out + b_idx * s_ob + h * s_oh, n * s_on, valid, HEAD_DIM, BLOCK_D).to(tl.float32)
    do = load_rows(DO + b_idx * s_db + h * s_dh, n * s_dn, valid, HEAD_DIM, BLOCK_D).to(tl.float32)
    tl.store(DELTA + bh * N + n, tl.sum(o * do, 1), mask=valid)


# ---------------------------------------------------------------------------------------------------------------
# Launch helpers
# ---------------------------------------------------------------------------------------------------------------


def delta(o, do):
    """rowsum(dO * O) of (B, H, N, D) tensors with unit stride along D: (B, H, N) float32."""
    B, H, N, D = o.shape
    out = new_output((B, H, N), dtype=torch.float32, device=o.device)
    delta_kernel[(cdiv(N, DELTA_BLOCK_N), B * H)](
        o,
        do,
        out,
        *o.stride()[:3],
        *do.stride()[:3],
        H,
        N,
        HEAD_DIM=D,
        BLOCK_D=next_power_of_2(D),
        BLOCK_N=DELTA_BLOCK_N,
    )
    return out


def program_split(items, other_programs):
    """``(items per program, programs)`` for ``items`` shared out over programs that run beside
    ``other_programs`` others each: about ``TARGET_PROGRAMS`` in all."""
    per_program = min(items, cdiv(items * other_programs, TARGET_PROGRAMS))
    return per_program, cdiv(items, per_program)


def global_strides(global_k, global_v):
    """The (batch, head, key) strides of the global keys and values, zeros without them."""
    return (*global_k.stride()[:3], *global_v.stride()[:3]) if global_k is not None else (0,) * 6


_TUNED = {}
# Whether the first call per problem kind times every candidate tile shape; off, it takes the first that fits, as
# the interpreter takes the first (the tests switch it off, so that each test runs a known shape).
TUNE_TILES = True


def tuned_launch(name, key, candidates, launch):
    """Run ``launch(*candidate)`` with the fastest of ``candidates`` (tile shapes and warps) for ``key``, measured
    on the first call and cached for the process; candidates that need more shared memory than the GPU has are
    skipped. The interpreter takes the first candidate; ``TUNE_TILES = False`` (or a lone candidate) the first that
    fits, untimed."""
    if (name, key) in _TUNED or interpreting():
        return launch(*_TUNED.setdefault((name, key), candidates[0]))
    if TUNE_TILES and len(candidates) > 1:
        _TUNED[name, key] = _fastest(name, candidates, launch)
        return launch(*_TUNED[name, key])
    for config in candidates:  # the first that fits; its launch is the call's
        try:
            launch(*config)
        except OutOfResources as error:
            refusal = error
            continue
        _TUNED[name, key] = config
        return
    raise _beyond_the_gpu(name, candidates, refusal)


def _fastest(name, candidates, launch):
    """The candidate whose launch ``triton.testing.do_bench`` times fastest, of those that fit the GPU."""
    timings = {}
    for config in candidates:
        try:
            timings[config] = triton.testing.do_bench(partial(launch, *config))
        except OutOfResources as error:
            refusal = error
    if not timings:
        raise _beyond_the_gpu(name, candidates, refusal)
    return min(timings, key=timings.get)


def _beyond_the_gpu(name, candidates, error):
    """The one-sentence error for a kernel none of whose ``candidates`` fits the GPU (``error``: the last refusal)."""
    if len(candidates) == 1:
        return RuntimeError(
            f"The triton backend's {name} kernel with tiles {candidates[0]} needs {error.required} bytes of "
            f"{error.name}, more than this GPU's {error.limit}; choose another backend for this layer."
        )
    return RuntimeError(
        f"The triton backend's {name} kernel needs more {error.name} than this GPU's {error.limit} bytes with each "
        f"of its tile shapes {', '.join(map(str, candidates))}; choose another backend for this layer."
    )


def by_name(q, k, v, global_k, global_v, rel_bias, global_bias, **others):
    """A launcher's tensors by the names :func:`check_inputs` and its messages use."""
    return dict(
        q=q, k=k, v=v, global_k=global_k, global_v=global_v, rel_bias=rel_bias, global_bias=global_bias, **others
    )


def check_inputs(tensors, rows, tables):
    """Raise ``ValueError`` with one sentence unless ``tensors`` (by name; None: absent) are what the kernels read:
    each named in ``rows`` of the shape given there, of q's dtype (float32, float16 or bfloat16) and device, with
    unit stride along its last dimension (the kernels read rows of channels through the other strides); each named
    in ``tables`` of the shape given there, contiguous (the kernels compute its offsets), on q's device, ``lse``
    float32 and the bias tables of a dtype above; global keys and values both or neither."""
    q = tensors["q"]
    if q.dtype not in DTYPES:
        raise ValueError(f"The triton kernels take float32, float16 or bfloat16 q, k and v, got q of {q.dtype}.")
    if (tensors.get("global_k") is None) != (tensors.get("global_v") is None):
        raise ValueError("The triton kernels take global keys and values together (global_k and global_v), or neither.")
    for name, shape in rows.items():
        t = tensors.get(name)
        if t is not None and (t.shape != shape or t.stride(-1) != 1):
            raise ValueError(
                f"The triton kernels take {name} of shape {tuple(shape)} with unit stride along its last dimension, "
                f"got shape {tuple(t.shape)} with strides {t.stride()}."
            )
        if t is not None and (t.dtype != q.dtype or t.device != q.device):
            raise ValueError(
                f"The triton kernels take {name} of q's dtype and device ({q.dtype} on {q.device}), "
                f"got {t.dtype} on {t.device}."
            )
    for name, shape in tables.items():
        t = tensors.get(name)
        if t is not None and (t.shape != shape or not t.is_contiguous()):
            raise ValueError(
                f"The triton kernels take {name} as a contiguous tensor of shape {tuple(shape)}, got shape "
                f"{tuple(t.shape)} with strides {t.stride()}."
            )
        dtypes = (torch.float32,) if name == "lse" else DTYPES
        if t is not None and (t.dtype not in dtypes or t.device != q.device):
            raise ValueError(
                f"The triton kernels take {name} of {' or '.join(map(str, dtypes))} on q's device {q.device}, "
                f"got {t.dtype} on {t.device}."
            )


def on_the_inputs_device(launcher):
    """``launcher`` run with its first argument's CUDA device as the current one: Triton launches its kernels on the
    current device, which in a process that uses several GPUs need not be the inputs'."""

    @wraps(launcher)
    def run(first, *args):
        if first.device.type != "cuda":
            return launcher(first, *args)
        with torch.cuda.device(first.device):
            return launcher(first, *args)

    return run


def dot_precision(dtype):
    """Float32 products follow torch's TF32 switch for matrix products: TF32, or else three TF32 products (about
    float32's accuracy, still on tensor cores). Half-precision products ignore the setting."""
    return "tf32x3" if dtype == torch.float32 and not _matmuls_may_use_tf32() else "tf32"


def _matmuls_may_use_tf32():
    """torch's CUDA matmul TF32 switch, read through ``torch.backends.cuda.matmul.fp32_precision`` ("none": the
    global ``torch.backends.fp32_precision``) where torch has it: once that setting was used, reading the older
    ``allow_tf32`` raises."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = matmul.fp32_precision
    except AttributeError:  # a torch without the fp32_precision settings
        return matmul.allow_tf32
    if precision == "none":
        precision = torch.backends.fp32_precision
    return precision == "tf32"


def check_device(dtype=None, device=None, batch_heads=1):
    """Raise ``ValueError`` with one sentence if the kernels cannot run on ``device`` with ``dtype`` (each checked
    where given) or take ``batch_heads`` (B x heads) programs along a grid axis."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"The triton backend takes float32, float16 or bfloat16 inputs, got {dtype}.")
    if device is not None and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"The triton backend runs on CUDA GPUs (or on the CPU under TRITON_INTERPRET=1, for tests), but the "
            f"inputs are on {device}; use backend 'sliding_chunk' there."
        )
    if (
        device is not None
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device) < (8, 0)
    ):
        raise ValueError("The triton backend needs a GPU of compute capability 8.0 or newer for bfloat16; use float16.")
    if batch_heads > 65535:
        raise ValueError(f"The triton backend takes at most 65535 batch x heads, got {batch_heads}.")
