"""Fused 1D local attention (Longformer's band over a sequence) in Triton.

Query ``i`` of head ``h`` sees the G global keys and the keys ``i + d*a``, ``-W <= a <= W`` (``a <= 0`` when
CAUSAL; ``d`` the head's dilation, read from a table), that lie in the sequence and are not masked, all in one
softmax. The positions ``r, r + d, r + 2d, ...`` of one residue ``r`` form a sequence of their own, its *lattice*,
on which the window is the undilated one; kernels work in lattice indices ``t`` (position ``r + d*t``). One
program handles a tile of ``BM`` consecutive lattice queries and loops over key blocks of ``BN`` from ``t0 - W``
to ``t0 + BM - 1 + W`` (``t0 + BM - 1`` when causal) with an online softmax, after the global keys: its work grows
as ``L x W``, never ``L^2``. In the dQ pass key blocks start at multiples of ``KB`` from the tile, so that a
block's relative offsets fall into fixed bins for the bias gradient (``flash.offset_sums``).

Forward: one pass, saves the output and the base-2 log-sum-exp. Backward, by recomputation:
``flash.delta_kernel`` (rowsum(dO * O)); ``_bwd_dkdv_kernel`` (key-centric: a key block against the queries
whose band holds it); ``_bwd_dq_kernel`` (query-centric: dQ, and per-program sums of the bias table's gradient
over ``TILES_PER_PROGRAM`` tiles); ``_bwd_global_kernel`` (the global keys', values' and bias's gradients, as
per-segment sums over the sequence). The host adds the partial sums up in a fixed order: no atomics, so the
gradients are deterministic.
"""

from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import flash
from .flash import (
    LOG2E,
    dot,
    global_scores,
    initial_softmax_state,
    key_major_grads,
    load_globals,
    load_rows,
    offset_sums,
    online_softmax_step,
    softmax_grad,
    softmax_result,
    store_rows,
)

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
MAX_WINDOW = 512
# Candidate (query tile, key block, warps) per program; the interpreter takes the first.
TILE_SHAPES = ((64, 64, 4), (128, 64, 8), (64, 32, 4), (128, 128, 8), (32, 32, 4))
BLOCK_G = 16  # global keys per block
BLOCK_N = 64  # queries per step of the global-gradient pass


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _lattice_tile(tile, L, dilation, BLOCK: tl.constexpr):
    """Program index along the sequence -> (residue, first lattice index of the tile, lattice length) for a head
    of this dilation. Programs past the head's residues (other heads may have larger dilations) get length 0."""
    per_residue = tl.cdiv(tl.cdiv(L, dilation), BLOCK)
    residue = tile // per_residue
    length = tl.where(residue < tl.minimum(dilation, L), (L - 1 - residue) // dilation + 1, 0)
    return residue, (tile % per_residue) * BLOCK, length


@triton.jit
def _rows(first, residue, dilation, length, MASK, mask_row, ROWS: tl.constexpr, HAS_MASK: tl.constexpr):
    """``ROWS`` lattice indices from ``first``: the indices, their positions, and whether each is a token of the
    lattice (and, with HAS_MASK, not masked by the key padding mask row ``mask_row``)."""
    t = first + tl.arange(0, ROWS)
    valid = (t >= 0) & (t < length)
    pos = (residue + dilation * t).to(tl.int64)  # 64-bit: pos times a row stride can pass 2^31 (strided views)
    if HAS_MASK:
        valid = valid & (tl.load(MASK + mask_row + pos, mask=valid, other=1) == 0)
    return t, pos, valid


@triton.jit
def _key_range(
    t0, length, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BEFORE: tl.constexpr, CAUSAL: tl.constexpr
):
    """First and end lattice index of the key blocks a query tile from ``t0`` reads: from ``t0 - BEFORE`` (W; in
    the dQ pass W rounded up to a multiple of the bias bins' width) in steps of BN, skipping blocks wholly before
    the sequence, to the tile's last query's last key. An empty range for a tile past the lattice."""
    first = t0 - BEFORE
    first += tl.maximum(0, -first // BN) * BN
    if CAUSAL:
        stop = t0 + BM
    else:
        stop = t0 + BM + W
    stop = tl.minimum(stop, length)
    return first, tl.where(t0 < length, stop, first)


@triton.jit
def _band_scores(
    x,
    y,
    x_t,
    y_t,
    x_valid,
    y_valid,
    rel_bias,
    qk_scale,
    W: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KEY_MAJOR: tl.constexpr = False,
):
    """Base-2 scores of query rows ``x`` (lattice indices ``x_t``) against key rows ``y``: (queries, keys), -inf
    where the key is not in the query's band. With KEY_MAJOR the caller passes the keys as ``x`` and the queries
    as ``y`` and gets (keys, queries)."""
    s = dot(x, tl.trans(y), DOT_PRECISION) * qk_scale
    if KEY_MAJOR:
        a = x_t[:, None] - y_t[None, :]  # key - query, in steps of the dilation
    else:
        a = y_t[None, :] - x_t[:, None]
    allowed = x_valid[:, None] & y_valid[None, :] & (a >= -W)
    if CAUSAL:
        allowed = allowed & (a <= 0)
    else:
        allowed = allowed & (a <= W)
    if HAS_REL_BIAS:
        s += tl.load(rel_bias + a + W, mask=allowed, other=0.0).to(tl.float32) * 1.4426950408889634
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _global_block(
    GK,
    GV,
    GLOBAL_BIAS,
    b_idx,
    h,
    g0,
    s_gkb,
    s_gkh,
    s_gkg,
    s_gvb,
    s_gvh,
    s_gvg,
    q,
    G,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_GLOBAL_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The global keys ``g0 .. g0 + BLOCK_G - 1`` of (b_idx, h): keys, values, and the base-2 scores of q against
    them."""
    gk = load_globals(GK + b_idx * s_gkb + h * s_gkh + g0 * s_gkg, s_gkg, G - g0, HEAD_DIM, BLOCK_D, BLOCK_G)
    gv = load_globals(GV + b_idx * s_gvb + h * s_gvh + g0 * s_gvg, s_gvg, G - g0, HEAD_DIM, BLOCK_D, BLOCK_G)
    s_g = global_scores(q, gk, GLOBAL_BIAS + h * G + g0, G - g0, qk_scale, BLOCK_G, HAS_GLOBAL_BIAS, DOT_PRECISION)
    return gk, gv, s_g


@triton.jit
def _key_block(
    K,
    V,
    MASK,
    start,
    residue,
    dilation,
    length,
    b_idx,
    h,
    L,
    s_kb,
    s_kh,
    s_kl,
    s_vb,
    s_vh,
    s_vl,
    q,
    t,
    q_valid,
    rel_bias,
    qk_scale,
    W: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The BN keys from lattice index ``start``: keys, values, and the base-2 scores of the query tile against
    them."""
    u, k_pos, k_valid = _rows(start, residue, dilation, length, MASK, b_idx * L, BN, HAS_MASK)
    k = load_rows(K + b_idx * s_kb + h * s_kh, k_pos * s_kl, k_valid, HEAD_DIM, BLOCK_D)
    v = load_rows(V + b_idx * s_vb + h * s_vh, k_pos * s_vl, k_valid, HEAD_DIM, BLOCK_D)
    s = _band_scores(q, k, t, u, q_valid, k_valid, rel_bias, qk_scale, W, CAUSAL, HAS_REL_BIAS, DOT_PRECISION)
    return k, v, s


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    GK,
    GV,
    REL_BIAS,
    GLOBAL_BIAS,
    MASK,
    DILATIONS,
    Out,
    LSE,
    s_qb,
    s_qh,
    s_ql,
    s_kb,
    s_kh,
    s_kl,
    s_vb,
    s_vh,
    s_vl,
    s_ob,
    s_oh,
    s_ol,
    s_gkb,
    s_gkh,
    s_gkg,
    s_gvb,
    s_gvh,
    s_gvg,
    H,
    L,
    G,
    qk_scale,
    W: tl.constexpr,
    BEFORE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    HAS_GLOBAL_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B*H slices can pass 2^31 elements
    b_idx, h = bh // H, bh % H
    dilation = tl.load(DILATIONS + h)
    residue, t0, length = _lattice_tile(tl.program_id(0), L, dilation, BM)

    t, q_pos, q_valid = _rows(t0, residue, dilation, length, MASK, 0, BM, False)
    q = load_rows(Q + b_idx * s_qb + h * s_qh, q_pos * s_ql, q_valid, HEAD_DIM, BLOCK_D)
    rel_bias = REL_BIAS + h * (2 * W + 1)
    m_i, l_i, acc = initial_softmax_state(BM, BLOCK_D)
    if HAS_GLOBAL:
        for g0 in range(0, G, BLOCK_G):
            gk, gv, s_g = _global_block(
                GK,
                GV,
                GLOBAL_BIAS,
                b_idx,
                h,
                g0,
                s_gkb,
                s_gkh,
                s_gkg,
                s_gvb,
                s_gvh,
                s_gvg,
                q,
                G,
                qk_scale,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_G,
                HAS_GLOBAL_BIAS,
                DOT_PRECISION,
            )
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s_g, gv, DOT_PRECISION)

    first, stop = _key_range(t0, length, BM, BN, W, BEFORE, CAUSAL)
    for start in range(first, stop, BN):
        k, v, s = _key_block(
            K,
            V,
            MASK,
            start,
            residue,
            dilation,
            length,
            b_idx,
            h,
            L,
            s_kb,
            s_kh,
            s_kl,
            s_vb,
            s_vh,
            s_vl,
            q,
            t,
            q_valid,
            rel_bias,
            qk_scale,
            W,
            CAUSAL,
            HEAD_DIM,
            BLOCK_D,
            HAS_REL_BIAS,
            HAS_MASK,
            BN,
            DOT_PRECISION,
        )
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)

    out, lse = softmax_result(m_i, l_i, acc)
    store_rows(Out + b_idx * s_ob + h * s_oh, q_pos * s_ol, q_valid, out, HEAD_DIM, BLOCK_D)
    tl.store(LSE + bh * L + q_pos, lse, mask=q_valid)


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    REL_BIAS,
    MASK,
    DILATIONS,
    LSE,
    DELTA,
    DK,
    DV,
    s_qb,
    s_qh,
    s_ql,
    s_kb,
    s_kh,
    s_kl,
    s_vb,
    s_vh,
    s_vl,
    s_db,
    s_dh,
    s_dl,
    s_gb,
    s_gh,
    s_gl,
    H,
    L,
    qk_scale,
    scale,
    W: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dK and dV of a block of BN keys: a loop over the query tiles whose band holds one of its keys. DK and DV
    share the strides ``s_g*``."""
    bh = tl.program_id(1).to(tl.int64)
    b_idx, h = bh // H, bh % H
    dilation = tl.load(DILATIONS + h)
    residue, u0, length = _lattice_tile(tl.program_id(0), L, dilation, BN)

    u, k_pos, k_valid = _rows(u0, residue, dilation, length, MASK, b_idx * L, BN, HAS_MASK)
    k = load_rows(K + b_idx * s_kb + h * s_kh, k_pos * s_kl, k_valid, HEAD_DIM, BLOCK_D)
    v = load_rows(V + b_idx * s_vb + h * s_vh, k_pos * s_vl, k_valid, HEAD_DIM, BLOCK_D)
    rel_bias = REL_BIAS + h * (2 * W + 1)
    dk = tl.zeros([BN, BLOCK_D], tl.float32)
    dv = tl.zeros([BN, BLOCK_D], tl.float32)

    if CAUSAL:  # key u is seen by the queries u .. u + W (causal), u - W .. u + W otherwise
        first = u0
    else:
        first = tl.maximum(u0 - W, 0)
    stop = tl.minimum(u0 + BN + W, length)
    for start in range(first, stop, BM):
        t, q_pos, q_valid = _rows(start, residue, dilation, length, MASK, 0, BM, False)
        q = load_rows(Q + b_idx * s_qb + h * s_qh, q_pos * s_ql, q_valid, HEAD_DIM, BLOCK_D)
        do = load_rows(DO + b_idx * s_db + h * s_dh, q_pos * s_dl, q_valid, HEAD_DIM, BLOCK_D)
        lse = tl.load(LSE + bh * L + q_pos, mask=q_valid, other=0.0)
        delta = tl.load(DELTA + bh * L + q_pos, mask=q_valid, other=0.0)
        # Key-major (keys, queries) blocks: the products with Q and dO need no transposed copies.
        s_t = _band_scores(
            k, q, u, t, k_valid, q_valid, rel_bias, qk_scale, W, CAUSAL, HAS_REL_BIAS, DOT_PRECISION, KEY_MAJOR=True
        )
        dk_part, dv_part = key_major_grads(s_t, lse, delta, do, q, v, q_valid, DOT_PRECISION)
        dk += dk_part
        dv += dv_part

    store_rows(DK + b_idx * s_gb + h * s_gh, k_pos * s_gl, (u >= 0) & (u < length), dk * scale, HEAD_DIM, BLOCK_D)
    store_rows(DV + b_idx * s_gb + h * s_gh, k_pos * s_gl, (u >= 0) & (u < length), dv, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    GK,
    GV,
    DO,
    REL_BIAS,
    GLOBAL_BIAS,
    MASK,
    DILATIONS,
    LSE,
    DELTA,
    DQ,
    DRB_PART,
    s_qb,
    s_qh,
    s_ql,
    s_kb,
    s_kh,
    s_kl,
    s_vb,
    s_vh,
    s_vl,
    s_db,
    s_dh,
    s_dl,
    s_gb,
    s_gh,
    s_gl,
    s_gkb,
    s_gkh,
    s_gkg,
    s_gvb,
    s_gvh,
    s_gvg,
    H,
    L,
    G,
    TILES_PER_PROGRAM,
    qk_scale,
    scale,
    W: tl.constexpr,
    BEFORE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    HAS_GLOBAL_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
    BT_ROWS: tl.constexpr,
    BT_COLS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ of TILES_PER_PROGRAM consecutive query tiles, and their sums of the score gradients per relative
    offset: DRB_PART (B*H, programs, BT_ROWS, BT_COLS), bins (query row - key row + BEFORE // KB, query column
    - key column + KB - 1) of tokens laid out in rows of KB from the tile's first query. DQ has the strides
    ``s_g*``."""
    program = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b_idx, h = bh // H, bh % H
    dilation = tl.load(DILATIONS + h)
    rel_bias = REL_BIAS + h * (2 * W + 1)
    drb = tl.zeros([BT_ROWS, BT_COLS], tl.float32)

    for i in range(TILES_PER_PROGRAM):
        residue, t0, length = _lattice_tile(program * TILES_PER_PROGRAM + i, L, dilation, BM)
        t, q_pos, q_valid = _rows(t0, residue, dilation, length, MASK, 0, BM, False)
        q = load_rows(Q + b_idx * s_qb + h * s_qh, q_pos * s_ql, q_valid, HEAD_DIM, BLOCK_D)
        do = load_rows(DO + b_idx * s_db + h * s_dh, q_pos * s_dl, q_valid, HEAD_DIM, BLOCK_D)
        lse = tl.load(LSE + bh * L + q_pos, mask=q_valid, other=0.0)
        delta = tl.load(DELTA + bh * L + q_pos, mask=q_valid, other=0.0)
        dq = tl.zeros([BM, BLOCK_D], tl.float32)
        if HAS_GLOBAL:
            for g0 in range(0, G, BLOCK_G):
                gk, gv, s_g = _global_block(
                    GK,
                    GV,
                    GLOBAL_BIAS,
                    b_idx,
                    h,
                    g0,
                    s_gkb,
                    s_gkh,
                    s_gkg,
                    s_gvb,
                    s_gvh,
                    s_gvg,
                    q,
                    G,
                    qk_scale,
                    HEAD_DIM,
                    BLOCK_D,
                    BLOCK_G,
                    HAS_GLOBAL_BIAS,
                    DOT_PRECISION,
                )
                p_g, ds_g = softmax_grad(s_g, lse, delta, do, gv, q_valid, DOT_PRECISION)
                dq += dot(ds_g.to(gk.dtype), gk, DOT_PRECISION)

        first, stop = _key_range(t0, length, BM, BN, W, BEFORE, CAUSAL)
        for start in range(first, stop, BN):
            k, v, s = _key_block(
                K,
                V,
                MASK,
                start,
                residue,
                dilation,
                length,
                b_idx,
                h,
                L,
                s_kb,
                s_kh,
                s_kl,
                s_vb,
                s_vh,
                s_vl,
                q,
                t,
                q_valid,
                rel_bias,
                qk_scale,
                W,
                CAUSAL,
                HEAD_DIM,
                BLOCK_D,
                HAS_REL_BIAS,
                HAS_MASK,
                BN,
                DOT_PRECISION,
            )
            p, ds = softmax_grad(s, lse, delta, do, v, q_valid, DOT_PRECISION)
            dq += dot(ds.to(k.dtype), k, DOT_PRECISION)
            if HAS_REL_BIAS:  # the key block starts (start - t0) // KB rows of KB after the tile
                drb += offset_sums(
                    ds,
                    BEFORE // KB - (start - t0) // KB,
                    KB - 1,
                    KB,
                    BM // KB,
                    BN // KB,
                    BT_ROWS,
                    BT_COLS,
                    k.dtype,
                )
        store_rows(DQ + b_idx * s_gb + h * s_gh, q_pos * s_gl, q_valid, dq * scale, HEAD_DIM, BLOCK_D)

    if HAS_REL_BIAS:
        r = tl.arange(0, BT_ROWS)
        c = tl.arange(0, BT_COLS)
        slot = bh * tl.num_programs(0) + program
        tl.store(DRB_PART + (slot * BT_ROWS + r[:, None]) * BT_COLS + c[None, :], drb)


@triton.jit
def _bwd_global_kernel(
    Q,
    GK,
    GV,
    DO,
    GLOBAL_BIAS,
    LSE,
    DELTA,
    DGK_PART,
    DGV_PART,
    DGB_PART,
    s_qb,
    s_qh,
    s_ql,
    s_db,
    s_dh,
    s_dl,
    s_gkb,
    s_gkh,
    s_gkg,
    s_gvb,
    s_gvh,
    s_gvg,
    H,
    L,
    G,
    SEGMENT,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_GLOBAL_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The global keys', values' and bias's gradients of BLOCK_G global keys, summed over the SEGMENT positions
    of one segment of the sequence (dilation plays no part: every query sees every global key): DGK_PART and
    DGV_PART (segments, B*H, G, HEAD_DIM), DGB_PART (segments, B*H, G)."""
    segment = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b_idx, h = bh // H, bh % H
    g0 = tl.program_id(2) * BLOCK_G
    gk = load_globals(GK + b_idx * s_gkb + h * s_gkh + g0 * s_gkg, s_gkg, G - g0, HEAD_DIM, BLOCK_D, BLOCK_G)
    gv = load_globals(GV + b_idx * s_gvb + h * s_gvh + g0 * s_gvg, s_gvg, G - g0, HEAD_DIM, BLOCK_D, BLOCK_G)
    dgk = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    dgv = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    dgb = tl.zeros([BLOCK_G], tl.float32)

    end = tl.minimum(segment * SEGMENT + SEGMENT, L)
    for start in range(segment * SEGMENT, end, BLOCK_N):
        n = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        valid = n < end
        q = load_rows(Q + b_idx * s_qb + h * s_qh, n * s_ql, valid, HEAD_DIM, BLOCK_D)
        do = load_rows(DO + b_idx * s_db + h * s_dh, n * s_dl, valid, HEAD_DIM, BLOCK_D)
        lse = tl.load(LSE + bh * L + n, mask=valid, other=0.0)
        delta = tl.load(DELTA + bh * L + n, mask=valid, other=0.0)
        s_g = global_scores(q, gk, GLOBAL_BIAS + h * G + g0, G - g0, qk_scale, BLOCK_G, HAS_GLOBAL_BIAS, DOT_PRECISION)
        p_g, ds_g = softmax_grad(s_g, lse, delta, do, gv, valid, DOT_PRECISION)
        dgk += dot(tl.trans(ds_g.to(q.dtype)), q, DOT_PRECISION)
        dgv += dot(tl.trans(p_g.to(do.dtype)), do, DOT_PRECISION)
        dgb += tl.sum(ds_g, 0)

    g = g0 + tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    row = (segment * tl.num_programs(1) + bh) * G + g
    part = row[:, None] * HEAD_DIM + d[None, :]
    part_mask = (g[:, None] < G) & (d[None, :] < HEAD_DIM)
    tl.store(DGK_PART + part, dgk, mask=part_mask)
    tl.store(DGV_PART + part, dgv, mask=part_mask)
    if HAS_GLOBAL_BIAS:
        tl.store(DGB_PART + row, dgb, mask=g < G)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def bias_bins(query_tile, key_block, window):
    """``(KB, BEFORE, BT_ROWS, BT_COLS)`` of a tile shape: tokens in rows of KB (a power of two with at least 16
    row pairs per block, for the products of ``flash.offset_sums``), key blocks from ``BEFORE`` (W rounded up to
    KB) before the tile, and bins for every query row - key row and query column - key column of the band."""
    kb = 16
    while kb > 4 and (query_tile // kb) * (key_block // kb) < 16:
        kb //= 2
    rows = -(-window // kb)  # |query row - key row| <= ceil(W / KB) inside the band
    return kb, rows * kb, max(16, flash.next_power_of_2(2 * rows + 1)), max(16, 2 * kb)


def lattice_tiles(length, dilations, tile):
    """Programs along the sequence for tiles of ``tile`` lattice indices: the most any head needs (its dilation
    times its residues' tiles)."""
    return max(d * flash.cdiv(flash.cdiv(length, d), tile) for d in set(dilations))


def scored_pairs(length, window, dilations, causal, num_global):
    """The (query, key) scores the forward computes per batch entry, over all heads: every query of a tile
    against the key blocks :func:`_key_range` gives it and the global keys, for the interpreter's tile shape (a
    tuned shape differs by a few percent)."""
    tile, block, _ = TILE_SHAPES[0]
    pairs = 0
    for d in _fitted(dilations, length):
        for residue in range(d):
            n = (length - 1 - residue) // d + 1  # the residue's lattice length
            for t0 in range(0, n, tile):
                first = t0 - window + max(0, window - t0) // block * block
                stop = min(t0 + tile + (0 if causal else window), n)
                pairs += tile * (flash.cdiv(max(stop - first, 0), block) * block + num_global)
    return pairs


def _fitted(dilations, length):
    """Dilations of at most L: beyond it a query's only window key is itself either way (and the bias row is that
    of offset 0), while a larger one would launch a program per empty residue class."""
    return tuple(min(d, length) for d in dilations)


@lru_cache(maxsize=64)
def _dilation_table(dilations, device):
    return torch.tensor(dilations, dtype=torch.int32, device=device)


def _strides3(t):
    return t.stride()[:3]


def _check_inputs(tensors, dilations, window):
    """One sentence (``ValueError``) unless ``tensors`` (by name: q, k, v, global_k, global_v, the bias tables, the key
    padding mask, and in the backward do, o and lse; None: absent) have the shapes the kernels take, given q's, and the
    dtypes, laid out as they read them (:func:`flash.check_inputs`; the mask bool, in any layout: the launchers copy
    it), ``dilations`` has one positive int per head, and the head_dim, window, GPU and batch x heads are ones they
    take (:func:`check_supported`)."""
    q = tensors["q"]
    B, H, L, D = q.shape
    G = 0 if tensors["global_k"] is None else tensors["global_k"].shape[2]
    if len(dilations) != H or not all(isinstance(d, int) and d >= 1 for d in dilations):
        raise ValueError(f"The triton kernels take one positive int dilation per head ({H}), got {tuple(dilations)}.")
    rows = dict.fromkeys(("q", "k", "v", "do", "o"), (B, H, L, D)) | dict(global_k=(B, H, G, D), global_v=(B, H, G, D))
    flash.check_inputs(tensors, rows, dict(rel_bias=(H, 2 * window + 1), global_bias=(H, G), lse=(B, H, L)))
    mask = tensors["mask"]
    if mask is not None and (mask.shape != (B, L) or mask.dtype != torch.bool or mask.device != tensors["q"].device):
        raise ValueError(
            f"The triton kernels take a bool key_padding_mask of shape {(B, L)} on q's device, "
            f"got {mask.dtype} of shape {tuple(mask.shape)} on {mask.device}."
        )
    check_supported(D, window, q.dtype, q.device, B * H)


def _mask(key_padding_mask, q):
    return (
        q.new_empty(0, dtype=torch.uint8)
        if key_padding_mask is None
        else key_padding_mask.contiguous().view(torch.uint8)
    )


@flash.on_the_inputs_device
def forward(q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, dilations, window, causal, scale):
    """Output and base-2 log-sum-exp ``(B, H, L)``; q, k, v (B, H, L, D), global_k and global_v (B, H, G, D), each with
    unit stride along D, contiguous bias tables, a (B, L) mask and one dilation per head, checked by
    :func:`_check_inputs`; ``global_k``, ``global_v``, the bias tables and the mask may be None."""
    B, H, L, D = q.shape
    G = 0 if global_k is None else global_k.shape[2]
    _check_inputs(
        flash.by_name(q, k, v, global_k, global_v, rel_bias, global_bias, mask=key_padding_mask), dilations, window
    )
    dilations = _fitted(dilations, L)
    o = flash.new_output(q.shape, dtype=q.dtype, device=q.device)
    lse = flash.new_output((B, H, L), dtype=torch.float32, device=q.device)
    dummy = q.new_empty(0)
    mask = _mask(key_padding_mask, q)
    table = _dilation_table(dilations, q.device)
    key = (q.device, window, D, q.dtype, causal, G > 0, rel_bias is not None, key_padding_mask is not None)

    def launch(bm, bn, warps):
        _fwd_kernel[(lattice_tiles(L, dilations, bm), B * H)](
            q,
            k,
            v,
            global_k if G else dummy,
            global_v if G else dummy,
            dummy if rel_bias is None else rel_bias,
            dummy if global_bias is None else global_bias,
            mask,
            table,
            o,
            lse,
            *_strides3(q),
            *_strides3(k),
            *_strides3(v),
            *_strides3(o),
            *flash.global_strides(global_k, global_v),
            H,
            L,
            G,
            scale * LOG2E,
            W=window,
            BEFORE=window,
            CAUSAL=causal,
            HEAD_DIM=D,
            BLOCK_D=flash.next_power_of_2(D),
            BLOCK_G=BLOCK_G,
            HAS_GLOBAL=G > 0,
            HAS_REL_BIAS=rel_bias is not None,
            HAS_GLOBAL_BIAS=global_bias is not None,
            HAS_MASK=key_padding_mask is not None,
            BM=bm,
            BN=bn,
            DOT_PRECISION=flash.dot_precision(q.dtype),
            num_warps=warps,
        )

    flash.tuned_launch("forward_1d", key, TILE_SHAPES, launch)
    return o, lse


@flash.on_the_inputs_device
def backward(
    do, q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, o, lse, dilations, window, causal, scale
):
    """The gradients of :func:`forward`, as a dict by the names of :data:`flash.GRADIENTS` (None for absent inputs);
    ``lse`` (B, H, L) contiguous, the other tensors laid out as :func:`forward` takes them."""
    B, H, L, D = q.shape
    G = 0 if global_k is None else global_k.shape[2]
    tensors = flash.by_name(
        q, k, v, global_k, global_v, rel_bias, global_bias, mask=key_padding_mask, do=do, o=o, lse=lse
    )
    _check_inputs(tensors, dilations, window)
    dilations = _fitted(dilations, L)
    dummy = q.new_empty(0)
    mask = _mask(key_padding_mask, q)
    table = _dilation_table(dilations, q.device)
    common = dict(
        W=window,
        CAUSAL=causal,
        HEAD_DIM=D,
        BLOCK_D=flash.next_power_of_2(D),
        HAS_REL_BIAS=rel_bias is not None,
        HAS_MASK=key_padding_mask is not None,
        DOT_PRECISION=flash.dot_precision(q.dtype),
    )
    key = (q.device, window, D, q.dtype, causal, G > 0, rel_bias is not None, key_padding_mask is not None)
    rel = dummy if rel_bias is None else rel_bias
    delta = flash.delta(o, do)
    grads = dict.fromkeys(flash.GRADIENTS)
    for name, t in (("grad_q", q), ("grad_k", k), ("grad_v", v)):
        grads[name] = flash.new_output(t.shape, dtype=t.dtype, device=t.device)

    def launch_dkdv(bm, bn, warps):
        _bwd_dkdv_kernel[(lattice_tiles(L, dilations, bn), B * H)](
            q,
            k,
            v,
            do,
            rel,
            mask,
            table,
            lse,
            delta,
            grads["grad_k"],
            grads["grad_v"],
            *_strides3(q),
            *_strides3(k),
            *_strides3(v),
            *_strides3(do),
            *_strides3(grads["grad_k"]),
            H,
            L,
            scale * LOG2E,
            scale,
            BM=bm,
            BN=bn,
            num_warps=warps,
            **common,
        )

    flash.tuned_launch("backward_dkdv_1d", key, TILE_SHAPES, launch_dkdv)

    bias_sums = {}

    def launch_dq(bm, bn, warps):
        kb, before, bt_rows, bt_cols = bias_bins(bm, bn, window)
        per_program, programs = flash.program_split(lattice_tiles(L, dilations, bm), B * H)
        parts = dummy
        if rel_bias is not None:
            parts = flash.new_output((B * H, programs, bt_rows, bt_cols), dtype=torch.float32, device=q.device)
        _bwd_dq_kernel[(programs, B * H)](
            q,
            k,
            v,
            global_k if G else dummy,
            global_v if G else dummy,
            do,
            rel,
            dummy if global_bias is None else global_bias,
            mask,
            table,
            lse,
            delta,
            grads["grad_q"],
            parts,
            *_strides3(q),
            *_strides3(k),
            *_strides3(v),
            *_strides3(do),
            *_strides3(grads["grad_q"]),
            *flash.global_strides(global_k, global_v),
            H,
            L,
            G,
            per_program,
            scale * LOG2E,
            scale,
            BEFORE=before,
            BLOCK_G=BLOCK_G,
            HAS_GLOBAL=G > 0,
            HAS_GLOBAL_BIAS=global_bias is not None,
            BM=bm,
            BN=bn,
            KB=kb,
            BT_ROWS=bt_rows,
            BT_COLS=bt_cols,
            num_warps=warps,
            **common,
        )
        bias_sums.update(parts=parts, kb=kb, before=before)

    flash.tuned_launch("backward_dq_1d", key, TILE_SHAPES, launch_dq)
    if rel_bias is not None:
        table_sums = bias_sums["parts"].view(B, H, -1, *bias_sums["parts"].shape[2:]).sum((0, 2))
        grads["grad_rel_bias"] = _bias_gradient(table_sums, bias_sums["kb"], bias_sums["before"], window).to(
            rel_bias.dtype
        )
    if G:
        grads.update(_global_gradients(q, global_k, global_v, do, global_bias, lse, delta, scale))
    return grads


def _bias_gradient(table_sums, kb, before, window):
    """(H, 2W+1) from the summed (H, BT_ROWS, BT_COLS) bins of the dQ pass: bin (r, c) holds the pairs with key
    offset ``a = -((r - before // kb) * kb + c - (kb - 1))``. Writing ``s = kb * r + c``, the columns below kb and
    those from kb on each cover every s once (the latter shifted by kb), and row ``a + W`` is ``s = before + kb - 1
    + W - (a + W)``."""
    lower = table_sums[..., :kb].flatten(1)
    upper = table_sums[..., kb : 2 * kb].flatten(1)
    sums = torch.nn.functional.pad(lower, (0, kb)) + torch.nn.functional.pad(upper, (kb, 0))
    top = before + kb - 1 + window
    return sums[:, top - 2 * window : top + 1].flip(1)


def _global_gradients(q, global_k, global_v, do, global_bias, lse, delta, scale):
    B, H, L, D = q.shape
    G = global_k.shape[2]
    blocks = flash.cdiv(G, BLOCK_G)
    per_program, segments = flash.program_split(flash.cdiv(L, BLOCK_N), B * H * blocks)
    segment = per_program * BLOCK_N
    dgk = flash.new_output((segments, B * H, G, D), dtype=torch.float32, device=q.device)
    dgv = flash.new_output((segments, B * H, G, D), dtype=torch.float32, device=q.device)
    dgb = (
        flash.new_output((segments, B * H, G), dtype=torch.float32, device=q.device)
        if global_bias is not None
        else q.new_empty(0)
    )
    _bwd_global_kernel[(segments, B * H, blocks)](
        q,
        global_k,
        global_v,
        do,
        q.new_empty(0) if global_bias is None else global_bias,
        lse,
        delta,
        dgk,
        dgv,
        dgb,
        *_strides3(q),
        *_strides3(do),
        *flash.global_strides(global_k, global_v),
        H,
        L,
        G,
        segment,
        scale * LOG2E,
        HEAD_DIM=D,
        BLOCK_D=flash.next_power_of_2(D),
        BLOCK_G=BLOCK_G,
        HAS_GLOBAL_BIAS=global_bias is not None,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=flash.dot_precision(q.dtype),
        num_warps=4,
    )
    grads = dict(
        grad_global_k=(dgk.sum(0) * scale).view(B, H, G, D).to(global_k.dtype),
        grad_global_v=dgv.sum(0).view(B, H, G, D).to(global_v.dtype),
    )
    if global_bias is not None:
        grads["grad_global_bias"] = dgb.sum(0).view(B, H, G).sum(0).to(global_bias.dtype)
    return grads


def check_supported(head_dim, window, dtype=None, device=None, batch_heads=1):
    """Raise ``ValueError`` with one sentence if the 1D kernels cannot take these inputs (``dtype`` and ``device``
    are checked where given)."""
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"The triton backend takes head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM} for 1D windows, got {head_dim}."
        )
    if window > MAX_WINDOW:
        raise ValueError(f"The triton backend takes 1D windows 1..{MAX_WINDOW}, got {window}.")
    flash.check_device(dtype, device, batch_heads)
