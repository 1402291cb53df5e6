"""Fused 2D local attention (ViL's conv-like windows) in Triton.

The map is cut into chunks of ``C x C`` tokens (``C = W`` for ViL's chunked windows). One program handles a
tile of a query chunk (``BQI`` of its rows), and loops over the key chunks of its window (the 3x3 neighbour
chunks, or the 1 or 2 of the random-shift modes) with an online softmax, after the G global keys, all in one
softmax. A chunk is laid out as ``P x P`` tokens, ``P`` a power of two >= C, so that a token's row and column
inside its chunk are ``t // P`` and ``t % P``; tokens with a row or column >= C, or outside the map, are padding
and are masked.

Which chunks a query chunk reads, and through which neighbour offset, comes from a small table built on the host
(:func:`present_first`): each chunk's present neighbours first (a slot can be absent: outside the map with zero
padding, or a duplicate under wrap-around), and their count, so that the kernels loop over the count with no branch
around their loads (the compiler pipelines the loads of a loop only outside branches). The transposed table, the
query chunks that read a chunk, is built the same way for the key-centric backward. Relative offsets for the bias
are taken "as if neighbour chunks were adjacent": ``qi - ki - a * C`` for in-chunk rows and the chunk offset ``a``.

SW_EXACT 1 uses chunks of ``C = P`` tokens, whose 3x3 neighbours cover every ``(2W+1)^2`` window of a chunk's
queries, and masks by distance. Dilation ``DIL`` (SW_EXACT 1 only) runs the same on each of the ``DIL^2``
sub-lattices of positions with equal row and column residues modulo ``DIL``; all indices are lattice indices.

Forward: one pass, saves the output and the base-2 log-sum-exp. Backward, by recomputation:
``flash.delta_kernel`` (rowsum(dO * O)), ``_bwd_dkdv_kernel`` (key-centric: loops over the query chunks that see a
key chunk), ``_bwd_dq_kernel`` (query-centric: dQ, and per-program partial sums for the global keys' and the
bias tables' gradients, which the host adds up in a fixed order, so results are deterministic). What this file
shares with the 1D kernels (the online softmax, global keys, bias-gradient sums, tuner) is in ``flash.py``.
"""

from dataclasses import dataclass
from functools import cache

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

HEAD_DIMS = (16, 32, 48, 64, 96, 128)
MAX_WINDOW = 16


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _split_tile_index(tile, N_CHUNKS, P: tl.constexpr, ROWS: tl.constexpr, DIL: tl.constexpr):
    """Program index along the map -> (first chunk row of the tile, chunk, sub-lattice row and column residue)."""
    sub = tile % (P // ROWS)
    chunk = (tile // (P // ROWS)) % N_CHUNKS
    residue = tile // ((P // ROWS) * N_CHUNKS)
    return sub * ROWS, chunk, residue // DIL, residue % DIL


@triton.jit
def _neighbour(TABLE, chunk, o, N_OFF: tl.constexpr):
    """Entry ``o`` (below the chunk's count) of a chunk's row of a neighbour table: the other chunk and the offset
    (a, b) of the slot it is reached through."""
    row = TABLE + (chunk * N_OFF + o) * 3
    return tl.load(row), tl.load(row + 1), tl.load(row + 2)


@triton.jit
def _tile(
    chunk, first_row, res_i, res_j, X, Y, MY, C: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, DIL: tl.constexpr
):
    """The ``ROWS x P`` tokens from row ``first_row`` of lattice chunk ``chunk``: in-chunk row and column, map row
    and column, and whether the token exists."""
    t = tl.arange(0, ROWS * P)
    row = first_row + t // P
    col = t % P
    x = res_i + DIL * ((chunk // MY) * C + row)
    y = res_j + DIL * ((chunk % MY) * C + col)
    return row, col, x, y, (row < C) & (col < C) & (x < X) & (y < Y)


@triton.jit
def _load_tile(base, stride_x, stride_y, x, y, valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # 64-bit offsets: a position times a stride of a strided view (channels last, fused projections) can pass 2^31
    return load_rows(base, x.to(tl.int64) * stride_x + y.to(tl.int64) * stride_y, valid, HEAD_DIM, BLOCK_D)


@triton.jit
def _store_tile(base, stride_x, stride_y, x, y, valid, value, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    store_rows(base, x.to(tl.int64) * stride_x + y.to(tl.int64) * stride_y, valid, value, HEAD_DIM, BLOCK_D)


@triton.jit
def _local_scores(
    q,
    k,
    q_row,
    q_col,
    k_row,
    k_col,
    k_valid,
    a,
    b,
    rel_bias,
    qk_scale,
    W: tl.constexpr,
    C: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KEY_MAJOR: tl.constexpr = False,
):
    """Base-2 scores of a query tile against a key tile of the neighbour chunk at offset (a, b):
    (queries, keys), -inf where the key is not in the query's window. With KEY_MAJOR, the caller passes the
    key tile as ``q`` and the query tile as ``k`` (positions likewise, offset negated) and gets (keys, queries)."""
    s = dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
    allowed = ((q_row < C) & (q_col < C))[:, None] & k_valid[None, :]  # padding rows and columns read no bias
    if EXACT == 1:
        di = q_row[:, None] - k_row[None, :] - a * C
        dj = q_col[:, None] - k_col[None, :] - b * C
        allowed = allowed & (di <= W) & (di >= -W) & (dj <= W) & (dj >= -W)
    if HAS_REL_BIAS:
        # Offset (di, dj), query minus key, is entry (di + 2W - 1) * T + dj + 2W - 1 of the table; a position's
        # share of it is row * T + column, so that each score adds one difference of per-position indices.
        T: tl.constexpr = 4 * W - 1
        first = q_row * T + q_col
        second = k_row * T + k_col
        if KEY_MAJOR:
            index = (second + (2 * W - 1) * (T + 1) + (a * T + b) * C)[None, :] - first[:, None]
        else:
            index = (first + (2 * W - 1) * (T + 1) - (a * T + b) * C)[:, None] - second[None, :]
        bias = tl.load(rel_bias + index, mask=allowed, other=float("-inf"))
        return s + bias.to(tl.float32) * 1.4426950408889634
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _key_tile(
    K,
    V,
    s_kx,
    s_ky,
    s_vx,
    s_vy,
    key_chunk,
    first_row,
    res_i,
    res_j,
    X,
    Y,
    MY,
    q,
    q_row,
    q_col,
    a,
    b,
    rel_bias,
    qk_scale,
    W: tl.constexpr,
    C: tl.constexpr,
    P: tl.constexpr,
    BKI: tl.constexpr,
    DIL: tl.constexpr,
    EXACT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The ``BKI`` rows from ``first_row`` of key chunk ``key_chunk``, reached through offset (a, b) (``K`` and
    ``V`` at the batch entry and head): keys, values, and the base-2 scores of the query tile against them."""
    k_row, k_col, kx, ky, k_valid = _tile(key_chunk, first_row, res_i, res_j, X, Y, MY, C, P, BKI, DIL)
    k = _load_tile(K, s_kx, s_ky, kx, ky, k_valid, HEAD_DIM, BLOCK_D)
    v = _load_tile(V, s_vx, s_vy, kx, ky, k_valid, HEAD_DIM, BLOCK_D)
    s = _local_scores(
        q, k, q_row, q_col, k_row, k_col, k_valid, a, b, rel_bias, qk_scale, W, C, EXACT, HAS_REL_BIAS, DOT_PRECISION
    )
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
    NEIGHBOURS,
    COUNTS,
    Out,
    LSE,
    s_qb,
    s_qh,
    s_qx,
    s_qy,
    s_kb,
    s_kh,
    s_kx,
    s_ky,
    s_vb,
    s_vh,
    s_vx,
    s_vy,
    s_ob,
    s_oh,
    s_ox,
    s_oy,
    s_gkb,
    s_gkh,
    s_gkg,
    s_gvb,
    s_gvh,
    s_gvg,
    H,
    X,
    Y,
    MY,
    N_CHUNKS,
    G,
    qk_scale,
    W: tl.constexpr,
    C: tl.constexpr,
    P: tl.constexpr,
    DIL: tl.constexpr,
    EXACT: tl.constexpr,
    N_OFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    HAS_GLOBAL_BIAS: tl.constexpr,
    BQI: tl.constexpr,
    BKI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B*H slices can pass 2^31 elements
    b_idx, h = bh // H, bh % H
    first_row, chunk, res_i, res_j = _split_tile_index(tile, N_CHUNKS, P, BQI, DIL)

    q_row, q_col, qx, qy, q_valid = _tile(chunk, first_row, res_i, res_j, X, Y, MY, C, P, BQI, DIL)
    q = _load_tile(Q + b_idx * s_qb + h * s_qh, s_qx, s_qy, qx, qy, q_valid, HEAD_DIM, BLOCK_D)
    rel_bias = REL_BIAS + h * (4 * W - 1) * (4 * W - 1)

    m_i, l_i, acc = initial_softmax_state(BQI * P, BLOCK_D)
    if HAS_GLOBAL:
        gk = load_globals(GK + b_idx * s_gkb + h * s_gkh, s_gkg, G, HEAD_DIM, BLOCK_D, BLOCK_G)
        gv = load_globals(GV + b_idx * s_gvb + h * s_gvh, s_gvg, G, HEAD_DIM, BLOCK_D, BLOCK_G)
        s_g = global_scores(q, gk, GLOBAL_BIAS + h * G, G, qk_scale, BLOCK_G, HAS_GLOBAL_BIAS, DOT_PRECISION)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s_g, gv, DOT_PRECISION)

    for o in range(tl.load(COUNTS + chunk)):
        key_chunk, a, b = _neighbour(NEIGHBOURS, chunk, o, N_OFF)
        for kb in tl.static_range(P // BKI):
            k, v, s = _key_tile(
                K + b_idx * s_kb + h * s_kh,
                V + b_idx * s_vb + h * s_vh,
                s_kx,
                s_ky,
                s_vx,
                s_vy,
                key_chunk,
                kb * BKI,
                res_i,
                res_j,
                X,
                Y,
                MY,
                q,
                q_row,
                q_col,
                a,
                b,
                rel_bias,
                qk_scale,
                W,
                C,
                P,
                BKI,
                DIL,
                EXACT,
                HEAD_DIM,
                BLOCK_D,
                HAS_REL_BIAS,
                DOT_PRECISION,
            )
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)

    out, lse = softmax_result(m_i, l_i, acc)
    _store_tile(Out + b_idx * s_ob + h * s_oh, s_ox, s_oy, qx, qy, q_valid, out, HEAD_DIM, BLOCK_D)
    tl.store(LSE + bh * X * Y + qx * Y + qy, lse, mask=q_valid)


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    REL_BIAS,
    LSE,
    DELTA,
    NEIGHBOURS_T,
    COUNTS_T,
    DK,
    DV,
    s_qb,
    s_qh,
    s_qx,
    s_qy,
    s_kb,
    s_kh,
    s_kx,
    s_ky,
    s_vb,
    s_vh,
    s_vx,
    s_vy,
    s_db,
    s_dh,
    s_dx,
    s_dy,
    H,
    X,
    Y,
    MY,
    N_CHUNKS,
    qk_scale,
    scale,
    W: tl.constexpr,
    C: tl.constexpr,
    P: tl.constexpr,
    DIL: tl.constexpr,
    EXACT: tl.constexpr,
    N_OFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    BQI: tl.constexpr,
    BKI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dK and dV of a key tile: a loop over the query chunks that see its chunk (the transposed table).
    DK and DV are contiguous."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B*H slices can pass 2^31 elements
    b_idx, h = bh // H, bh % H
    first_row, chunk, res_i, res_j = _split_tile_index(tile, N_CHUNKS, P, BKI, DIL)

    k_row, k_col, kx, ky, k_valid = _tile(chunk, first_row, res_i, res_j, X, Y, MY, C, P, BKI, DIL)
    k = _load_tile(K + b_idx * s_kb + h * s_kh, s_kx, s_ky, kx, ky, k_valid, HEAD_DIM, BLOCK_D)
    v = _load_tile(V + b_idx * s_vb + h * s_vh, s_vx, s_vy, kx, ky, k_valid, HEAD_DIM, BLOCK_D)
    rel_bias = REL_BIAS + h * (4 * W - 1) * (4 * W - 1)
    dk = tl.zeros([BKI * P, BLOCK_D], tl.float32)
    dv = tl.zeros([BKI * P, BLOCK_D], tl.float32)

    for o in range(tl.load(COUNTS_T + chunk)):
        query_chunk, a, b = _neighbour(NEIGHBOURS_T, chunk, o, N_OFF)
        for qb in tl.static_range(P // BQI):
            q_row, q_col, qx, qy, q_valid = _tile(query_chunk, qb * BQI, res_i, res_j, X, Y, MY, C, P, BQI, DIL)
            q = _load_tile(Q + b_idx * s_qb + h * s_qh, s_qx, s_qy, qx, qy, q_valid, HEAD_DIM, BLOCK_D)
            do = _load_tile(DO + b_idx * s_db + h * s_dh, s_dx, s_dy, qx, qy, q_valid, HEAD_DIM, BLOCK_D)
            lse = tl.load(LSE + bh * X * Y + qx * Y + qy, mask=q_valid, other=0.0)
            delta = tl.load(DELTA + bh * X * Y + qx * Y + qy, mask=q_valid, other=0.0)
            # Key-major (keys, queries) tiles: the products with Q and dO need no transposed copies.
            s_t = _local_scores(
                k,
                q,
                k_row,
                k_col,
                q_row,
                q_col,
                q_valid,
                -a,
                -b,
                rel_bias,
                qk_scale,
                W,
                C,
                EXACT,
                HAS_REL_BIAS,
                DOT_PRECISION,
                KEY_MAJOR=True,
            )
            dk_part, dv_part = key_major_grads(s_t, lse, delta, do, q, v, q_valid, DOT_PRECISION)
            dk += dk_part
            dv += dv_part

    base = bh * X * Y * HEAD_DIM
    _store_tile(DK + base, Y * HEAD_DIM, HEAD_DIM, kx, ky, k_valid, dk * scale, HEAD_DIM, BLOCK_D)
    _store_tile(DV + base, Y * HEAD_DIM, HEAD_DIM, kx, ky, k_valid, dv, HEAD_DIM, BLOCK_D)


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
    LSE,
    DELTA,
    NEIGHBOURS,
    COUNTS,
    DQ,
    DGK_PART,
    DGV_PART,
    DGB_PART,
    DRB_PART,
    s_qb,
    s_qh,
    s_qx,
    s_qy,
    s_kb,
    s_kh,
    s_kx,
    s_ky,
    s_vb,
    s_vh,
    s_vx,
    s_vy,
    s_db,
    s_dh,
    s_dx,
    s_dy,
    s_gkb,
    s_gkh,
    s_gkg,
    s_gvb,
    s_gvh,
    s_gvg,
    B,
    H,
    X,
    Y,
    MY,
    N_CHUNKS,
    G,
    BATCH_PER_PROGRAM,
    qk_scale,
    scale,
    W: tl.constexpr,
    C: tl.constexpr,
    P: tl.constexpr,
    DIL: tl.constexpr,
    EXACT: tl.constexpr,
    N_OFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BT: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_REL_BIAS: tl.constexpr,
    HAS_GLOBAL_BIAS: tl.constexpr,
    BQI: tl.constexpr,
    BKI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ of a query tile for BATCH_PER_PROGRAM batch entries, plus this program's partial sums:
    DGK_PART/DGV_PART (B, H, tiles, G, HEAD_DIM) per batch entry, DGB_PART (groups, H, tiles, BLOCK_G) and
    DRB_PART (groups, H, tiles, BT, BT) summed over its batch entries. DQ is contiguous."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    group = tl.program_id(2)
    n_tiles = tl.num_programs(0)
    first_row, chunk, res_i, res_j = _split_tile_index(tile, N_CHUNKS, P, BQI, DIL)

    q_row, q_col, qx, qy, q_valid = _tile(chunk, first_row, res_i, res_j, X, Y, MY, C, P, BQI, DIL)
    rel_bias = REL_BIAS + h * (4 * W - 1) * (4 * W - 1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dgb = tl.zeros([BLOCK_G], tl.float32)
    drb = tl.zeros([BT, BT], tl.float32)

    for i in range(BATCH_PER_PROGRAM):
        b_idx = (group * BATCH_PER_PROGRAM + i).to(tl.int64)
        if b_idx < B:
            bh = b_idx * H + h
            q = _load_tile(Q + b_idx * s_qb + h * s_qh, s_qx, s_qy, qx, qy, q_valid, HEAD_DIM, BLOCK_D)
            do = _load_tile(DO + b_idx * s_db + h * s_dh, s_dx, s_dy, qx, qy, q_valid, HEAD_DIM, BLOCK_D)
            lse = tl.load(LSE + bh * X * Y + qx * Y + qy, mask=q_valid, other=0.0)
            delta = tl.load(DELTA + bh * X * Y + qx * Y + qy, mask=q_valid, other=0.0)
            dq = tl.zeros([BQI * P, BLOCK_D], tl.float32)
            if HAS_GLOBAL:
                gk = load_globals(GK + b_idx * s_gkb + h * s_gkh, s_gkg, G, HEAD_DIM, BLOCK_D, BLOCK_G)
                gv = load_globals(GV + b_idx * s_gvb + h * s_gvh, s_gvg, G, HEAD_DIM, BLOCK_D, BLOCK_G)
                s_g = global_scores(q, gk, GLOBAL_BIAS + h * G, G, qk_scale, BLOCK_G, HAS_GLOBAL_BIAS, DOT_PRECISION)
                p_g, ds_g = softmax_grad(s_g, lse, delta, do, gv, q_valid, DOT_PRECISION)
                dq += dot(ds_g.to(gk.dtype), gk, DOT_PRECISION)
                dgb += tl.sum(ds_g, 0)
                part = ((bh * n_tiles + tile) * G + g[:, None]) * HEAD_DIM + d[None, :]
                part_mask = (g[:, None] < G) & (d[None, :] < HEAD_DIM)
                dgk = dot(tl.trans(ds_g.to(q.dtype)), q, DOT_PRECISION)
                tl.store(DGK_PART + part, dgk, mask=part_mask)
                dgv = dot(tl.trans(p_g.to(do.dtype)), do, DOT_PRECISION)
                tl.store(DGV_PART + part, dgv, mask=part_mask)

            for o in range(tl.load(COUNTS + chunk)):
                key_chunk, a, b = _neighbour(NEIGHBOURS, chunk, o, N_OFF)
                for kb in tl.static_range(P // BKI):
                    k, v, s = _key_tile(
                        K + b_idx * s_kb + h * s_kh,
                        V + b_idx * s_vb + h * s_vh,
                        s_kx,
                        s_ky,
                        s_vx,
                        s_vy,
                        key_chunk,
                        kb * BKI,
                        res_i,
                        res_j,
                        X,
                        Y,
                        MY,
                        q,
                        q_row,
                        q_col,
                        a,
                        b,
                        rel_bias,
                        qk_scale,
                        W,
                        C,
                        P,
                        BKI,
                        DIL,
                        EXACT,
                        HEAD_DIM,
                        BLOCK_D,
                        HAS_REL_BIAS,
                        DOT_PRECISION,
                    )
                    p, ds = softmax_grad(s, lse, delta, do, v, q_valid, DOT_PRECISION)
                    dq += dot(ds.to(k.dtype), k, DOT_PRECISION)
                    if HAS_REL_BIAS:  # the (4W-1)^2 table as (row offset, column offset) bins
                        drb += offset_sums(
                            ds,
                            first_row - kb * BKI - a * C + 2 * W - 1,
                            -b * C + 2 * W - 1,
                            P,
                            BQI,
                            BKI,
                            BT,
                            BT,
                            k.dtype,
                        )
            _store_tile(
                DQ + bh * X * Y * HEAD_DIM, Y * HEAD_DIM, HEAD_DIM, qx, qy, q_valid, dq * scale, HEAD_DIM, BLOCK_D
            )

    slot = (group.to(tl.int64) * H + h) * n_tiles + tile  # times BT^2 it can pass 2^31
    if HAS_GLOBAL_BIAS:
        tl.store(DGB_PART + slot * BLOCK_G + g, dgb)
    if HAS_REL_BIAS:
        t = tl.arange(0, BT)
        tl.store(DRB_PART + (slot * BT + t[:, None]) * BT + t[None, :], drb)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Geometry:
    """The lattice, chunks and neighbour tables of one (map size, window, SW_EXACT, mode, dilation), built by the
    caller: with SW_EXACT 1 chunks have ``chunk_pad(W)`` tokens a side (their 3x3 neighbours cover every exact
    window of radius W), otherwise W; chunks tile the lattice of each of the ``dilation^2`` sub-lattices."""

    window: int  # W: chunk size (SW_EXACT 0, -1) or window radius (SW_EXACT 1)
    chunk: int  # C: tokens per chunk side
    chunk_pad: int  # P: the power of two >= C that tiles are laid out in
    dilation: int
    exact: int
    chunk_cols: int  # MY
    num_chunks: int
    # (chunks, slots, 3) int32 rows (key chunk, a, b): the chunks each chunk reads and the offsets of their slots,
    # present slots first, and (chunks,) their counts (see present_first)
    neighbours: torch.Tensor
    counts: torch.Tensor
    # the same for the query chunks that read each chunk
    neighbours_t: torch.Tensor
    counts_t: torch.Tensor
    key_tiles: int  # the sum of counts: the key tiles the chunks of one sub-lattice read, as a number on the host

    @property
    def num_slots(self):
        return self.neighbours.shape[1]

    def tiles(self, rows_per_tile):
        """Programs along the map for tiles of ``rows_per_tile`` chunk rows (all sub-lattices)."""
        return self.dilation**2 * self.num_chunks * (self.chunk_pad // rows_per_tile)


def present_first(table, offsets):
    """A ``(chunks, slots)`` table of the chunk each chunk reaches through each slot (-1: none) and the slots'
    ``(slots, 2)`` offsets (a, b) -> the kernels' ``(chunks, slots, 3)`` int32 rows (chunk, a, b), each chunk's
    present slots first in slot order, and the ``(chunks,)`` int32 counts of present slots."""
    present = table >= 0
    order = torch.argsort((~present).to(torch.int8), dim=1, stable=True)
    rows = torch.cat([table.unsqueeze(-1), offsets.expand(table.shape[0], -1, -1)], dim=-1)
    rows = rows.gather(1, order.unsqueeze(-1).expand(-1, -1, 3))
    return rows.to(torch.int32).contiguous(), present.sum(1).to(torch.int32)


def chunk_pad(window):
    """P, the power of two >= the chunk side that tiles are laid out in."""
    return max(4, flash.next_power_of_2(window))


def _tile_shapes(chunk_pad):
    """Candidate (query rows, key rows) per program: whole chunk rows up to 128 tokens, and half that. Every tile
    has at least 16 tokens (Triton's smallest product) and the bias-gradient regrouping at least 16 row pairs."""
    rows = min(chunk_pad, 128 // chunk_pad)
    shapes = [(q, k) for q in (rows, rows // 2) for k in (rows, rows // 2)]
    return [(q, k) for q, k in shapes if q * chunk_pad >= 16 and k * chunk_pad >= 16 and q * k >= 16]


def num_warps(query_rows, chunk_pad):
    """Warps per program: 4 for tiles of up to 64 queries, 8 above."""
    return 4 if query_rows * chunk_pad <= 64 else 8


# Stages of the software pipelining of the tiles' loads: Triton's default on NVIDIA GPUs, and none, the last resort
# of wide heads in 16 x 16 chunks, whose pipelined buffers pass the GPU's shared memory with every tile shape
# (bfloat16, head_dim 128, (4, 4) tiles, sm_90: 282-428 KiB pipelined, 48-80 KiB not; float32 448-514 and 128-192).
PIPELINED = 3
UNPIPELINED = 1


@cache
def _candidates(chunk_pad):
    """(query rows, key rows, warps, pipelining stages) per program: each tile shape pipelined, then the smallest
    without pipelining."""
    shapes = _tile_shapes(chunk_pad)
    pipelined = tuple((bq, bk, num_warps(bq, chunk_pad), PIPELINED) for bq, bk in shapes)
    bq, bk = shapes[-1]
    return (*pipelined, (bq, bk, num_warps(bq, chunk_pad), UNPIPELINED))


def _global_block(num_global):
    """BLOCK_G, the global keys the programs hold at once: all of them, at least 16 (Triton's smallest product). It
    sets the programs' registers and shared memory, so the tuning keys hold it."""
    return max(16, flash.next_power_of_2(num_global))


def _strides4(t):
    return t.stride()[:4]


def _check_inputs(tensors, window):
    """One sentence (``ValueError``) unless ``tensors`` (by name: q, k, v, global_k, global_v, the bias tables, and in
    the backward do, o and lse; None: absent) have the shapes the kernels take, given q's, and the dtypes, laid out as
    they read them (:func:`flash.check_inputs`), and the head_dim, window, GPU and batch x heads are ones they take
    (:func:`check_supported`)."""
    q = tensors["q"]
    B, H, X, Y, D = q.shape
    G = 0 if tensors["global_k"] is None else tensors["global_k"].shape[2]
    rows = dict.fromkeys(("q", "k", "v", "do", "o"), (B, H, X, Y, D)) | dict(
        global_k=(B, H, G, D), global_v=(B, H, G, D)
    )
    flash.check_inputs(tensors, rows, dict(rel_bias=(H, (4 * window - 1) ** 2), global_bias=(H, G), lse=(B, H, X * Y)))
    check_supported(D, window, q.dtype, q.device, B * H)


@flash.on_the_inputs_device
def forward(q, k, v, global_k, global_v, rel_bias, global_bias, geo, scale):
    """Output and base-2 log-sum-exp; q, k, v (B, H, X, Y, D), global_k and global_v (B, H, G, D), each with unit
    stride along D, and contiguous bias tables, checked by :func:`_check_inputs`; ``global_k``, ``global_v`` and the
    bias tables may be None."""
    B, H, X, Y, D = q.shape
    G = 0 if global_k is None else global_k.shape[2]
    _check_inputs(flash.by_name(q, k, v, global_k, global_v, rel_bias, global_bias), geo.window)
    o = flash.new_output(q.shape, dtype=q.dtype, device=q.device)
    lse = flash.new_output((B, H, X * Y), dtype=torch.float32, device=q.device)
    dummy = q.new_empty(0)
    BLOCK_G = _global_block(G)
    key = (q.device, geo.chunk_pad, D, q.dtype, geo.num_slots, geo.exact, G and BLOCK_G, rel_bias is not None)

    def launch(bq, bk, warps, stages):
        _fwd_kernel[(geo.tiles(bq), B * H)](
            q,
            k,
            v,
            global_k if G else dummy,
            global_v if G else dummy,
            dummy if rel_bias is None else rel_bias,
            dummy if global_bias is None else global_bias,
            geo.neighbours,
            geo.counts,
            o,
            lse,
            *_strides4(q),
            *_strides4(k),
            *_strides4(v),
            *_strides4(o),
            *flash.global_strides(global_k, global_v),
            H,
            X,
            Y,
            geo.chunk_cols,
            geo.num_chunks,
            G,
            scale * LOG2E,
            W=geo.window,
            C=geo.chunk,
            P=geo.chunk_pad,
            DIL=geo.dilation,
            EXACT=geo.exact,
            N_OFF=geo.num_slots,
            HEAD_DIM=D,
            BLOCK_D=flash.next_power_of_2(D),
            BLOCK_G=BLOCK_G,
            HAS_GLOBAL=G > 0,
            HAS_REL_BIAS=rel_bias is not None,
            HAS_GLOBAL_BIAS=global_bias is not None,
            BQI=bq,
            BKI=bk,
            DOT_PRECISION=flash.dot_precision(q.dtype),
            num_warps=warps,
            num_stages=stages,
        )

    flash.tuned_launch("forward", key, _candidates(geo.chunk_pad), launch)
    return o, lse


@flash.on_the_inputs_device
def backward(do, q, k, v, global_k, global_v, rel_bias, global_bias, o, lse, geo, scale):
    """The gradients of :func:`forward`, as a dict by the names of :data:`flash.GRADIENTS` (None for absent inputs);
    ``lse`` (B, H, X * Y) contiguous, the other tensors laid out as :func:`forward` takes them."""
    B, H, X, Y, D = q.shape
    G = 0 if global_k is None else global_k.shape[2]
    _check_inputs(flash.by_name(q, k, v, global_k, global_v, rel_bias, global_bias, do=do, o=o, lse=lse), geo.window)
    BLOCK_D, BLOCK_G = flash.next_power_of_2(D), _global_block(G)
    BT = max(16, flash.next_power_of_2(4 * geo.window - 1))
    dummy = q.new_empty(0)
    precision = flash.dot_precision(q.dtype)
    common = dict(
        W=geo.window,
        C=geo.chunk,
        P=geo.chunk_pad,
        DIL=geo.dilation,
        EXACT=geo.exact,
        N_OFF=geo.num_slots,
        HEAD_DIM=D,
        BLOCK_D=BLOCK_D,
        HAS_REL_BIAS=rel_bias is not None,
        DOT_PRECISION=precision,
    )
    key = (q.device, geo.chunk_pad, D, q.dtype, geo.num_slots, geo.exact, G and BLOCK_G, rel_bias is not None)
    rel = dummy if rel_bias is None else rel_bias

    delta = flash.delta(o.flatten(2, 3), do.flatten(2, 3)).flatten(1)

    dk = flash.new_output(k.shape, dtype=k.dtype, device=k.device)
    dv = flash.new_output(v.shape, dtype=v.dtype, device=v.device)

    def launch_dkdv(bq, bk, warps, stages):
        _bwd_dkdv_kernel[(geo.tiles(bk), B * H)](
            q,
            k,
            v,
            do,
            rel,
            lse,
            delta,
            geo.neighbours_t,
            geo.counts_t,
            dk,
            dv,
            *_strides4(q),
            *_strides4(k),
            *_strides4(v),
            *_strides4(do),
            H,
            X,
            Y,
            geo.chunk_cols,
            geo.num_chunks,
            scale * LOG2E,
            scale,
            BQI=bq,
            BKI=bk,
            num_warps=warps,
            num_stages=stages,
            **common,
        )

    flash.tuned_launch("backward_dkdv", key, _candidates(geo.chunk_pad), launch_dkdv)

    dq = flash.new_output(q.shape, dtype=q.dtype, device=q.device)
    result = {}

    def launch_dq(bq, bk, warps, stages):
        tiles = geo.tiles(bq)
        per_program, groups = flash.program_split(B, tiles * H)  # each program adds up its batch entries
        dgk = flash.new_output((B, H, tiles, G, D), dtype=torch.float32, device=q.device) if G else dummy
        dgv = flash.new_output((B, H, tiles, G, D), dtype=torch.float32, device=q.device) if G else dummy
        dgb = (
            flash.new_output((groups, H, tiles, BLOCK_G), dtype=torch.float32, device=q.device)
            if global_bias is not None
            else dummy
        )
        drb = (
            flash.new_output((groups, H, tiles, BT, BT), dtype=torch.float32, device=q.device)
            if rel_bias is not None
            else dummy
        )
        _bwd_dq_kernel[(tiles, H, groups)](
            q,
            k,
            v,
            global_k if G else dummy,
            global_v if G else dummy,
            do,
            rel,
            dummy if global_bias is None else global_bias,
            lse,
            delta,
            geo.neighbours,
            geo.counts,
            dq,
            dgk,
            dgv,
            dgb,
            drb,
            *_strides4(q),
            *_strides4(k),
            *_strides4(v),
            *_strides4(do),
            *flash.global_strides(global_k, global_v),
            B,
            H,
            X,
            Y,
            geo.chunk_cols,
            geo.num_chunks,
            G,
            per_program,
            scale * LOG2E,
            scale,
            BLOCK_G=BLOCK_G,
            BT=BT,
            HAS_GLOBAL=G > 0,
            HAS_GLOBAL_BIAS=global_bias is not None,
            BQI=bq,
            BKI=bk,
            num_warps=warps,
            num_stages=stages,
            **common,
        )
        result.update(grad_global_k=dgk, grad_global_v=dgv, grad_global_bias=dgb, grad_rel_bias=drb)

    flash.tuned_launch("backward_dq", key, _candidates(geo.chunk_pad), launch_dq)

    grads = dict(dict.fromkeys(flash.GRADIENTS), grad_q=dq, grad_k=dk, grad_v=dv)
    if G:
        grads["grad_global_k"] = (result["grad_global_k"].sum(2) * scale).to(global_k.dtype)
        grads["grad_global_v"] = result["grad_global_v"].sum(2).to(global_v.dtype)
    if global_bias is not None:
        grads["grad_global_bias"] = result["grad_global_bias"].sum((0, 2))[:, :G].to(global_bias.dtype)
    if rel_bias is not None:
        T = 4 * geo.window - 1
        grads["grad_rel_bias"] = result["grad_rel_bias"].sum((0, 2))[:, :T, :T].reshape(H, T * T).to(rel_bias.dtype)
    return grads


def check_supported(head_dim, window, dtype=None, device=None, batch_heads=1):
    """Raise ``ValueError`` with one sentence if the kernels cannot take these inputs (``dtype`` and ``device``
    are checked where given)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"The triton backend takes head_dim {', '.join(map(str, HEAD_DIMS))}, got {head_dim}.")
    if window > MAX_WINDOW:
        raise ValueError(f"The triton backend takes windows 1..{MAX_WINDOW}, got {window}.")
    flash.check_device(dtype, device, batch_heads)
