"""The window geometry of local attention: every index formula the backends share (which keys a query sees,
through which neighbour slot, and which row of the relative-position bias table applies), in 2D and 1D.

The ``reference`` backend alone does not use this module: it is written from the definition, as the oracle.

2D (ViL). The map is padded at the bottom and right to multiples of the chunk size ``w`` and cut into
``C = mx * my`` chunks of ``S = w * w`` tokens. Every query of a chunk looks at the same key chunks ("slots":
the 9 neighbour chunks, or 1 or 2 in the random-shift modes). The relative position of a query and a key is
taken as if neighbour chunks were adjacent (:func:`rel_bias_row`). Chunks whose neighbours lie outside the map
(zero padding) read fewer slots; under wrap-around (SW_EXACT -1) a chunk reached through two offsets is read
once, through the offset that wraps around the fewest axes.

1D (Longformer). Query ``i`` sees keys ``i + d*a``, ``-w <= a <= w`` (``a <= 0`` causal), inside the sequence;
the bias row is ``a + w`` (:func:`pair_in_band`, :func:`band_block_tables`).
"""

import operator
from dataclasses import dataclass
from functools import reduce

import torch

from .base import kept_tables

# The 3x3 neighbour chunks (row offset, column offset), row-major.
NEIGHBOURS = tuple((a, b) for a in (-1, 0, 1) for b in (-1, 0, 1))
# Random-shift mode i in 1..8 adds the i-th neighbour other than the own chunk.
MODE_NEIGHBOUR = {i + 1: ab for i, ab in enumerate(n for n in NEIGHBOURS if n != (0, 0))}


def neighbour_offsets(exact, mode):
    """The chunk offsets whose keys a query sees, for SW_EXACT ``exact`` and random-shift ``mode``."""
    if exact == 1 or mode == 0:
        return NEIGHBOURS
    if mode == -1:
        return ((0, 0),)
    return ((0, 0), MODE_NEIGHBOUR[mode])


@dataclass(frozen=True, eq=False)
class ChunkGroup:
    """Chunks that read the same number of neighbour slots: a contiguous range ``start:stop`` of the planned
    chunk order."""

    window: int
    start: int
    stop: int
    slots: torch.Tensor  # (c, n) long: the chunk (in plan order) each slot reads
    hidden: torch.Tensor  # (c, L, S) bool: this query (column) does not see this key (row)
    bias_index: torch.Tensor  # (c, L, S) long: row of the (4w-1)^2 relative bias table
    masked_runs: tuple  # (start, stop) within the group of the runs of chunks where ``hidden`` is somewhere True

    @property
    def num_chunks(self):
        return self.stop - self.start

    @property
    def num_slots(self):
        return self.slots.shape[1]

    @property
    def window_len(self):
        """L, the number of local keys each query of a chunk is scored against."""
        return self.num_slots * self.window**2


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """How one (map size, window, SW_EXACT, mode) is cut into chunks and grouped.

    Chunks whose window reaches outside the map (at the border, with zero padding) do not read the missing
    neighbour chunks at all: chunks are grouped by the number of slots they use (9 inside, 6 on an edge, 4
    in a corner), and :func:`to_chunks` orders them group by group, so that every group is a contiguous
    range of chunks with a common window length.
    """

    window: int
    rows: int  # nx
    cols: int  # ny
    chunk_rows: int  # mx
    chunk_cols: int  # my
    order: torch.Tensor  # (C,) long: the natural (row-major) index of each planned chunk
    groups: tuple


def neighbour_slots(mx, my, exact, mode):
    """Which chunk each chunk of an ``mx x my`` grid reads through each of its neighbour offsets.

    Returns ``(offsets, neighbour, used)``: the offsets (:func:`neighbour_offsets`), the row-major index of the
    chunk each chunk reaches through each offset (wrapped around cyclically), ``(C, n)``, and whether that slot
    is read, ``(C, n)`` bool: not outside the grid (zero padding), and not a second way to the same chunk
    (wrap-around with fewer than 3 chunks along an axis), so that every key is counted once."""
    C = mx * my
    offsets = neighbour_offsets(exact, mode)
    n = len(offsets)
    off = torch.tensor(offsets)  # (n, 2)
    ci = torch.arange(mx).repeat_interleave(my)  # chunk row of each flat chunk
    cj = torch.arange(my).repeat(mx)
    nbr_i = ci[:, None] + off[None, :, 0]  # (C, n), nominal neighbour chunk row
    nbr_j = cj[:, None] + off[None, :, 1]
    wrapped_i, wrapped_j = nbr_i % mx, nbr_j % my
    neighbour = wrapped_i * my + wrapped_j
    if exact == -1:
        # Several offsets reaching the same chunk: keep the one that wraps around the fewest axes (the direct
        # one where there is one).
        wraps = (nbr_i != wrapped_i).long() + (nbr_j != wrapped_j).long()
        used = torch.ones(C, n, dtype=torch.bool)
        for s in range(n):
            same = neighbour == neighbour[:, s : s + 1]
            rank_before = (wraps < wraps[:, s : s + 1]) | ((wraps == wraps[:, s : s + 1]) & (torch.arange(n) < s))
            used[:, s] = ~(same & rank_before).any(dim=1)
    else:
        used = (nbr_i >= 0) & (nbr_i < mx) & (nbr_j >= 0) & (nbr_j < my)
    return offsets, neighbour, used


@kept_tables(64)
def chunk_plan(rows, cols, window, exact, mode, device):
    w, S = window, window * window
    mx, my = -(-rows // w), -(-cols // w)
    C = mx * my
    offsets, neighbour, slot_used = neighbour_slots(mx, my, exact, mode)
    off = torch.tensor(offsets)  # (n, 2)
    wrapped_i, wrapped_j = neighbour // my, neighbour % my

    # Group the chunks by the number of slots they use, most first.
    counts = slot_used.sum(1)
    order = torch.argsort(-counts, stable=True)
    position = torch.empty(C, dtype=torch.long)
    position[order] = torch.arange(C)

    # Position inside a chunk of every key and every query; real keys are inside the unpadded map.
    r = torch.arange(S)
    ri, rj = r // w, r % w
    groups, start = [], 0
    for m in counts.unique(sorted=True).flip(0).tolist():
        chunks = order[start : start + int((counts == m).sum())]
        c = len(chunks)
        # The used slots of each chunk, in slot order: (c, m) indices into the n offsets.
        used = torch.argsort((~slot_used[chunks]).int(), dim=1, stable=True)[:, :m]
        g_off = off[used]  # (c, m, 2)
        g_i, g_j = wrapped_i[chunks].gather(1, used), wrapped_j[chunks].gather(1, used)
        key_real = (g_i[:, :, None] * w + ri < rows) & (g_j[:, :, None] * w + rj < cols)
        allowed = key_real.reshape(c, m * S, 1).expand(c, m * S, S)
        # Row/column distance query - key, as if neighbour chunks were adjacent: (c, L, S), keys along dim 1.
        di = (ri[None, None, None, :] - ri[None, None, :, None] - g_off[:, :, 0, None, None] * w).reshape(c, m * S, S)
        dj = (rj[None, None, None, :] - rj[None, None, :, None] - g_off[:, :, 1, None, None] * w).reshape(c, m * S, S)
        if exact == 1:
            allowed = allowed & ((di.abs() <= w) & (dj.abs() <= w))
        hidden = ~allowed
        masked = hidden.flatten(1).any(1).tolist()
        runs = tuple(
            (i, j + 1)
            for i, j in zip(
                [i for i in range(c) if masked[i] and (i == 0 or not masked[i - 1])],
                [j for j in range(c) if masked[j] and (j == c - 1 or not masked[j + 1])],
            )
        )
        groups.append(
            ChunkGroup(
                window=w,
                start=start,
                stop=start + c,
                slots=position[neighbour[chunks].gather(1, used)].to(device),
                hidden=hidden.contiguous().to(device),
                bias_index=rel_bias_row(di, dj, w).to(device),
                masked_runs=runs,
            )
        )
        start += c
    return ChunkPlan(
        window=w, rows=rows, cols=cols, chunk_rows=mx, chunk_cols=my, order=order.to(device), groups=tuple(groups)
    )


@kept_tables(16)
def unfolded_window_tables(rows, cols, window, exact, mode, device):
    """For the 3x3-chunk window of every chunk unfolded as ``3w x 3w`` tokens (row-major): ``allowed``
    (mx, my, 1 or S, 9S) bool: slots of the mode, each key once under wrap-around, and the distance for SW_EXACT
    1 (whether a key is a real token is checked separately); ``bias_index`` (S, 9S): the relative bias row of
    each (query, key), neighbour chunks taken as adjacent."""
    w = window
    mx, my = -(-rows // w), -(-cols // w)
    offsets, _, used = neighbour_slots(mx, my, exact, mode)
    slot_used = torch.zeros(mx * my, 9, dtype=torch.bool)
    for s, ab in enumerate(offsets):
        slot_used[:, NEIGHBOURS.index(ab)] = used[:, s]
    slot, di, dj = unfolded_window_offsets(w)
    allowed = slot_used[:, slot].view(mx, my, 1, 9 * w * w)
    if exact == 1:
        allowed = allowed & ((di.abs() <= w) & (dj.abs() <= w))
    bias_index = rel_bias_row(di, dj, w)
    return allowed.to(device), bias_index.to(device)


def unfolded_window_offsets(window, device=None):
    """For the ``3w x 3w`` keys (row-major) of the 3x3 chunks around a chunk and that chunk's ``w x w`` queries:
    the neighbour slot of each key ``(9S,)`` and the query-minus-key offsets ``di, dj`` ``(S, 9S)``. Plain tensor
    operations, not cached, so that torch.export can trace them."""
    w = window
    r = torch.arange(3 * w, device=device)
    slot = ((r[:, None] // w) * 3 + (r[None, :] // w)).flatten()
    q = torch.arange(w * w, device=device)
    di = (q // w)[:, None] + w - r.repeat_interleave(3 * w)[None, :]
    dj = (q % w)[:, None] + w - r.repeat(3 * w)[None, :]
    return slot, di, dj


def rel_bias_row(di, dj, window):
    """Row of the ``(4w-1)^2`` 2D bias table for query-minus-key offsets ``(di, dj)`` (ints or tensors)."""
    return (di + 2 * window - 1) * (4 * window - 1) + (dj + 2 * window - 1)


def neighbour_table(mx, my, exact, mode):
    """The slot tables the fused kernels read, for an ``mx x my`` chunk grid: ``(table, table_t, offsets)``.
    ``table (C, n)``: the chunk (row-major) each chunk reads through each slot, -1 for none; ``table_t (C, n)``:
    the chunk that reads each chunk through each slot, -1 for none; ``offsets (n, 2)``: each slot's (a, b)."""
    offsets, neighbour, used = neighbour_slots(mx, my, exact, mode)
    table = torch.where(used, neighbour, -1)
    # For slot s the map from reading chunk to read chunk is one-to-one, so it can be inverted slot by slot.
    table_t = torch.full_like(table, -1)
    for s in range(table.shape[1]):
        reads = table[:, s] >= 0
        table_t[table[reads, s], s] = torch.arange(table.shape[0])[reads]
    return table, table_t, torch.tensor(offsets)


def _chunk_offset(delta, chunks, cyclic):
    """Along one axis of ``chunks`` chunks, the neighbour offset (-1, 0 or 1) that moves a query's chunk onto the
    chunk ``delta`` away: ``delta`` itself, or, cyclic, the offset that wraps around onto it; 2 where none does."""
    if not cyclic:
        return delta
    wrapped = torch.where(delta == chunks - 1, -1, torch.where(delta == 1 - chunks, 1, 2))
    return torch.where(delta.abs() <= 1, delta, wrapped)


def pair_in_window_2d(q_idx, kv_idx, hood, rows, cols, num_global=0):
    """For query ``q_idx`` and key ``kv_idx`` (index tensors, row-major over a ``rows x cols`` map, keys after
    ``num_global`` global keys): may the query see the key in the neighbourhood ``hood`` (a
    :class:`~vil.ops.neighborhood.Neighborhood2d`), and the row of the relative bias table. Pair by pair, for code
    that sees one pair at a time (FlexAttention's mask and score modifiers)."""
    w, d, exact = hood.window, hood.dilation, hood.exact
    chunk_rows, chunk_cols = -(-rows // w), -(-cols // w)
    local = kv_idx - num_global
    qi, qj = q_idx // cols, q_idx % cols
    ki, kj = local // cols, local % cols
    if exact == 1:
        di, dj = qi - ki, qj - kj
        allowed = (di.abs() <= w * d) & (dj.abs() <= w * d) & (di % d == 0) & (dj % d == 0)
        di, dj = di // d, dj // d
    elif exact == 0 or hood.mode == 0:
        # The offset from the query's chunk to the key's, along each axis on its own: cyclic chunks see all nine
        # neighbours here, so the offset wrapping around the fewest axes is the one that wraps along neither or
        # along each axis only where it must.
        ci, cj = qi // w, qj // w
        a = _chunk_offset(ki // w - ci, chunk_rows, exact == -1)
        b = _chunk_offset(kj // w - cj, chunk_cols, exact == -1)
        offsets = neighbour_offsets(exact, hood.mode)
        if len(offsets) == len(NEIGHBOURS):
            allowed = (a.abs() <= 1) & (b.abs() <= 1)
        else:
            allowed = reduce(operator.or_, [(a == oa) & (b == ob) for oa, ob in offsets])
        di = qi - ((ci + a) * w + ki % w)
        dj = qj - ((cj + b) * w + kj % w)
    else:
        # Cyclic chunks, the own one and one neighbour: with two chunks or fewer along an axis, the neighbour may
        # reach the key's chunk by wrapping around where the plain difference is another offset.
        ci, cj = qi // w, qj // w
        best = torch.full_like(qi, 3)  # the fewest axes wrapped around so far; 3: the key's chunk not reached
        a_sel, b_sel = torch.zeros_like(qi), torch.zeros_like(qi)
        for a, b in neighbour_offsets(exact, hood.mode):
            na, nb = ci + a, cj + b
            wraps = ((na < 0) | (na >= chunk_rows)).int() + ((nb < 0) | (nb >= chunk_cols)).int()
            hit = (ki // w == na % chunk_rows) & (kj // w == nb % chunk_cols)
            take = hit & (wraps < best)
            best = torch.where(take, wraps, best)
            a_sel = torch.where(take, a, a_sel)
            b_sel = torch.where(take, b, b_sel)
        allowed = best < 3
        di = qi - ((ci + a_sel) * w + ki % w)
        dj = qj - ((cj + b_sel) * w + kj % w)
    return allowed & (local >= 0), rel_bias_row(di, dj, w).clamp(0, (4 * w - 1) ** 2 - 1)


def exact_window_bias_index(window):
    """``(1, (2w+1)^2)``: the bias row of each key of an exact window unfolded row-major around its query."""
    a = torch.arange(-window, window + 1)
    return rel_bias_row(-a[:, None], -a[None, :], window).reshape(1, -1)


def pair_in_band(q_idx, kv_idx, window, dilation, causal):
    """For query ``q_idx`` and key ``kv_idx`` of a sequence (index tensors; ``dilation`` an int or a tensor that
    broadcasts with them): is the key in the query's band, and the row ``a + w`` of the ``2w+1`` bias table,
    where ``kv_idx = q_idx + dilation * a``."""
    step = kv_idx - q_idx
    a = torch.div(step, dilation, rounding_mode="floor")
    allowed = (step - a * dilation == 0) & (a >= -window) & (a <= (0 if causal else window))
    return allowed, (a + window).clamp(0, 2 * window)


@kept_tables(16)
def band_block_tables(window, causal, device):
    """The band seen from a block of ``w`` consecutive queries and the ``3w`` keys of the blocks before, at and
    after it (key column ``c`` is ``c - w`` positions after the block's start): ``allowed (w, 3w)`` bool and
    ``bias_row (w, 3w)`` long, the row ``a + w`` of the bias table (``a = c - w - r`` for query row ``r``)."""
    r = torch.arange(window)[:, None]
    c = torch.arange(3 * window)[None, :]
    allowed, row = pair_in_band(r + window, c, window, 1, causal)
    return allowed.to(device), row.to(device)


@kept_tables(16)
def band_chunk_tables(window, causal, device):
    """The band seen from one of Longformer's chunks: ``2w`` consecutive positions, scored against themselves
    (row ``r`` and column ``c`` are positions of the chunk, the key at offset ``a = c - r``). Each query lies in
    two chunks, once in the first half (it takes its keys at offsets ``0..w`` there) and once in the second half
    (offsets ``-w..-1``), so that every key is counted once: ``allowed (2w, 2w)`` bool and ``bias_row (2w, 2w)``
    long, the row ``a + w`` of the bias table."""
    r = torch.arange(2 * window)[:, None]
    c = torch.arange(2 * window)[None, :]
    allowed, row = pair_in_band(r, c, window, 1, causal)
    allowed = allowed & ((c >= r) == (r < window))
    return allowed.to(device), row.to(device)
