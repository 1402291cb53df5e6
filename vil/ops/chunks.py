"""Chunk geometry of ViL's local attention, and the pieces the sliding-chunk backends are built from.

The feature map is padded at the bottom and right to multiples of the chunk size ``w`` and cut into
``C = mx * my`` chunks of ``S = w * w`` queries. Every query of a chunk looks at the same key chunks
("slots": the 9 neighbour chunks, or 1 or 2 in the random-shift modes), so one chunk's local scores are
an ``L x S`` matrix, ``L = slots * S``, and many chunks together are one batched matrix product. Chunks
whose neighbours lie outside the map (at the border, with zero padding) use fewer slots: a
:class:`ChunkPlan` orders the chunks into groups (:class:`ChunkGroup`) of equal slot count (inside, edges,
corners), so that no product is spent on keys that do not exist.

Scores are kept key-major, ``(..., L, S)``: on the CPU the products ``K Q^T`` and ``V dO^T`` that produce
them run about 1.5x faster than ``Q K^T`` and ``dO V^T``, so softmax statistics are reductions over dim
-2. Chunked tensors are ``(B, C, heads, S, D)``, so that a block of consecutive chunks is one contiguous
slice and the matrix products read it in place. Gathers move whole ``S x D`` chunks: a token-granular
gather is several times slower.

What differs between chunks (the border, padding, wrap-around) is a boolean mask per chunk; the relative
position of a query and a key depends on the slot's offset and the positions inside the chunks. The G
global keys are not chunked: they are one small extra product per chunk (:func:`global_scores`), which
the backends combine with the local scores in the same softmax.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

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
    allowed: torch.Tensor  # (c, L, S) bool: may this query (column) see this key (row)
    bias_index: torch.Tensor  # (c, L, S) long: row of the (4w-1)^2 relative bias table
    masked_runs: tuple  # (start, stop) within the group of the runs of chunks where ``allowed`` is not all True

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
    """How one (map size, window, masking method) is cut into chunks and grouped.

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


@lru_cache(maxsize=64)
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
        masked = (~allowed).flatten(1).any(1).tolist()
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
                allowed=allowed.contiguous().to(device),
                bias_index=((di + 2 * w - 1) * (4 * w - 1) + (dj + 2 * w - 1)).to(device),
                masked_runs=runs,
            )
        )
        start += c
    return ChunkPlan(window=w, rows=rows, cols=cols, chunk_rows=mx, chunk_cols=my, order=order.to(device), groups=tuple(groups))


def to_chunks(x, plan, extra_column=None):
    """(B, H, X, Y, D) -> (B, C, H, S, D) in the plan's chunk order, zero-padded at the bottom and right.
    With ``extra_column``, a column of that value is appended in the same copy: (B, C, H, S, D + 1)."""
    B, H, X, Y, D = x.shape
    w, mx, my = plan.window, plan.chunk_rows, plan.chunk_cols
    if mx * w != X or my * w != Y:
        x = F.pad(x, (0, 0, 0, my * w - Y, 0, mx * w - X))
    grid = x.view(B, H, mx, w, my, w, D).permute(0, 2, 4, 1, 3, 5, 6)
    chunks = x.new_empty(B, mx, my, H, w, w, D + (extra_column is not None))
    chunks[..., :D] = grid
    if extra_column is not None:
        chunks[..., D] = extra_column
    return chunks.view(B, mx * my, H, w * w, -1).index_select(1, plan.order)


def from_chunks(x, plan):
    """The inverse of :func:`to_chunks`: (B, C, H, S, D) -> (B, H, X, Y, D)."""
    B, C, H, S, D = x.shape
    w, mx, my = plan.window, plan.chunk_rows, plan.chunk_cols
    natural = x.new_empty(x.shape).index_copy_(1, plan.order, x)
    grid = natural.view(B, mx, my, H, w, w, D).permute(0, 3, 1, 4, 2, 5, 6).reshape(B, H, mx * w, my * w, D)
    return grid[:, :, : plan.rows, : plan.cols]


def _window_index(group, shape, batches, chunks):
    """Row of ``x.view(B * C * H, S * D)`` that each (batch in ``batches``, chunk of the group in ``chunks``,
    head, slot) reads, flattened; ``shape`` is ``x.shape``. One index over the flattened batch makes every gather a
    dim-0 ``index_select``, which is about 1.4x faster than one along an inner dimension."""
    B, C, H = shape[:3]
    return _cached_window_index(group, B, C, H, batches.indices(B), chunks.indices(C))


@lru_cache(maxsize=256)
def _cached_window_index(group, B, C, H, batches, chunks):
    slots = group.slots[slice(*chunks)]
    batch = torch.arange(B, device=slots.device)[slice(*batches)]
    head = torch.arange(H, device=slots.device)
    return ((batch[:, None, None, None] * C + slots[None, :, None, :]) * H + head[None, None, :, None]).reshape(-1)


def gather_windows(x, group, batches=slice(None), chunks=slice(None)):
    """The keys (or values) the queries of each chunk of a group see, for the batches and chunks given:
    ``x (B, C, H, S, D)`` from :func:`to_chunks` -> ``(b, c, H, L, D)``."""
    B, C, H, S, D = x.shape
    index = _window_index(group, x.shape, batches, chunks)
    return x.view(-1, S * D).index_select(0, index).view(-1, group.slots[chunks].shape[0], H, group.window_len, D)


def scatter_windows_(grad_x, grad, group, batches=slice(None), chunks=slice(None)):
    """The adjoint of :func:`gather_windows`: adds ``grad (b, c, H, L, D)`` into ``grad_x (B, C, H, S, D)``."""
    S, D = grad_x.shape[3:]
    index = _window_index(group, grad_x.shape, batches, chunks)
    grad_x.view(-1, S * D).index_add_(0, index, grad.reshape(-1, S * D))


@lru_cache(maxsize=64)
def _window_mask(group, dtype):
    return torch.zeros(group.allowed.shape, dtype=dtype, device=group.allowed.device).masked_fill_(
        ~group.allowed, float("-inf")
    )


def window_bias(group, rel_bias, dtype):
    """``(c, H, L, S)``, added to the local scores of a group: the relative position bias, and -inf where a
    query does not see a key; None without ``rel_bias`` (:func:`window_scores` then adds the mask alone)."""
    if rel_bias is None:
        return None
    return _window_mask(group, dtype)[:, None] + rel_bias[:, group.bias_index].transpose(0, 1).to(dtype)


def add_rel_bias_grad_(grad_rel_bias, grad_scores, group, chunks):
    """Adds to ``grad_rel_bias (H, (4w-1)^2)`` the part that the local score gradients ``(b, c, H, L, S)`` of
    the ``chunks`` of a group give."""
    per_pair = grad_scores.sum(0).transpose(0, 1).reshape(grad_scores.shape[2], -1)
    grad_rel_bias.index_add_(1, group.bias_index[chunks].reshape(-1), per_pair.to(grad_rel_bias.dtype))


def global_scores(queries, global_k, global_bias):
    """Scores of the global keys, ``(B, c, H, G, S)``, from scaled ``queries (B, c, H, S, D)`` and
    ``global_k (B, H, G, D)``."""
    scores = torch.matmul(global_k[:, None], queries.transpose(-1, -2))
    if global_bias is not None:
        scores = scores + global_bias[:, :, None]
    return scores


def window_scores(queries, keys, group, bias, chunks=slice(None)):
    """Local scores ``(b, c, H, L, S)`` of the ``chunks`` of a group, from scaled ``queries (b, c, H, S, D)``,
    gathered ``keys (b, c, H, L, D)`` and ``bias`` from :func:`window_bias`. Without a bias only the chunks
    that have masked pairs are touched: in the interior of the map there are none, and a full pass over
    the scores costs about a third of the product that makes them."""
    scores = torch.matmul(keys, queries.transpose(-1, -2))
    if bias is not None:
        scores += bias[chunks]
        return scores
    mask = _window_mask(group, scores.dtype)
    first, last, _ = chunks.indices(group.num_chunks)
    for start, stop in group.masked_runs:
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            scores[:, lo - first : hi - first] += mask[lo:hi, None]
    return scores


@lru_cache(maxsize=16)
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
    r = torch.arange(3 * w)
    slot = ((r[:, None] // w) * 3 + (r[None, :] // w)).flatten()  # slot of each of the 9S window keys
    q = torch.arange(w * w)
    di = (q // w)[:, None] + w - r.repeat_interleave(3 * w)[None, :]  # query row - key row: (S, 9S)
    dj = (q % w)[:, None] + w - r.repeat(3 * w)[None, :]
    allowed = slot_used[:, slot].view(mx, my, 1, 9 * w * w)
    if exact == 1:
        allowed = allowed & ((di.abs() <= w) & (dj.abs() <= w))
    bias_index = (di + 2 * w - 1) * (4 * w - 1) + (dj + 2 * w - 1)
    return allowed.to(device), bias_index.to(device)
