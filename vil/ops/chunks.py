"""Chunk geometry of ViL's local attention, and the pieces the sliding-chunk backends are built from.

The feature map is padded at the bottom and right to multiples of the chunk size ``w`` and cut into
``C = mx * my`` chunks of ``S = w * w`` queries. Every query of a chunk looks at the same key chunks
("slots"), so one chunk's scores are an ``(S, L)`` matrix and all chunks together are one batched
matrix product. The slots of a chunk are first ``P = ceil(G / S)`` "global chunks" that hold the G
global keys (padded with zero rows), then its ``n`` neighbour chunks (9, or 1 or 2 in the random-shift
modes): keeping the global keys in chunks of their own makes every gather and its adjoint move whole
chunks, with no concatenation. What differs between chunks (the border, padding, wrap-around) is a
boolean mask per chunk; what is the same for all chunks (the relative position of a query and a key,
the exact ``(2w+1)^2`` window) depends only on the positions inside the chunks.
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
class ChunkLayout:
    """Everything about one (map size, window, masking method, G) that does not depend on the data."""

    window: int
    rows: int  # nx
    cols: int  # ny
    chunk_rows: int  # mx
    chunk_cols: int  # my
    num_global: int  # G
    global_chunks: int  # P = ceil(G / S)
    slots: torch.Tensor  # (C, P + n) long: the chunk each slot reads, global chunks numbered C..C+P-1
    allowed: torch.Tensor  # (C, S, (P + n) * S) bool: may this query see this key
    bias_index: torch.Tensor  # (S, n * S) long: row of the (4w-1)^2 relative bias table

    @property
    def num_chunks(self):
        return self.chunk_rows * self.chunk_cols

    @property
    def window_len(self):
        """L, the number of key columns of one chunk's scores."""
        return self.slots.shape[1] * self.window**2


@lru_cache(maxsize=64)
def chunk_layout(rows, cols, window, exact, mode, num_global, device):
    w, S = window, window * window
    mx, my = -(-rows // w), -(-cols // w)
    C = mx * my
    P = -(-num_global // S)
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
        # With fewer than 3 chunks along an axis, several offsets reach the same chunk: keep each key once,
        # seen through the offset that wraps around the fewest axes (the direct one where there is one).
        wraps = (nbr_i != wrapped_i).long() + (nbr_j != wrapped_j).long()
        slot_used = torch.ones(C, n, dtype=torch.bool)
        for s in range(n):
            same = neighbour == neighbour[:, s : s + 1]
            rank_before = (wraps < wraps[:, s : s + 1]) | ((wraps == wraps[:, s : s + 1]) & (torch.arange(n) < s))
            slot_used[:, s] = ~(same & rank_before).any(dim=1)
    else:
        slot_used = (nbr_i >= 0) & (nbr_i < mx) & (nbr_j >= 0) & (nbr_j < my)

    # Position inside a chunk of every query and every key slot; real keys are inside the unpadded map.
    r = torch.arange(S)
    ri, rj = r // w, r % w
    key_real = (wrapped_i[:, :, None] * w + ri < rows) & (wrapped_j[:, :, None] * w + rj < cols)
    local_ok = (slot_used[:, :, None] & key_real).reshape(C, 1, n * S)
    # Row/column distance query - key, as if neighbour chunks were adjacent.
    di = (ri[:, None, None] - ri[None, None, :] - off[None, :, 0, None] * w).reshape(S, n * S)
    dj = (rj[:, None, None] - rj[None, None, :] - off[None, :, 1, None] * w).reshape(S, n * S)
    local_allowed = local_ok.expand(C, S, n * S)
    if exact == 1:
        local_allowed = local_allowed & ((di.abs() <= w) & (dj.abs() <= w))
    global_allowed = (torch.arange(P * S) < num_global).expand(C, S, P * S)

    slots = torch.cat([torch.arange(C, C + P).expand(C, P), neighbour], dim=1)
    return ChunkLayout(
        window=w,
        rows=rows,
        cols=cols,
        chunk_rows=mx,
        chunk_cols=my,
        num_global=num_global,
        global_chunks=P,
        slots=slots.to(device),
        allowed=torch.cat([global_allowed, local_allowed], dim=2).to(device),
        bias_index=((di + 2 * w - 1) * (4 * w - 1) + (dj + 2 * w - 1)).to(device),
    )


def to_chunks(x, layout, global_x=None):
    """(B, H, X, Y, D) -> (B, H, C, S, D), zero-padded at the bottom and right; with ``global_x (B, H, G, D)``,
    followed by the P global chunks: (B, H, C + P, S, D)."""
    B, H, X, Y, D = x.shape
    w, mx, my = layout.window, layout.chunk_rows, layout.chunk_cols
    x = F.pad(x, (0, 0, 0, my * w - Y, 0, mx * w - X))
    x = x.view(B, H, mx, w, my, w, D).transpose(3, 4).reshape(B, H, mx * my, w * w, D)
    if global_x is None:
        return x
    padded = F.pad(global_x, (0, 0, 0, layout.global_chunks * w * w - layout.num_global))
    return torch.cat([x, padded.view(B, H, layout.global_chunks, w * w, D)], dim=2)


def from_chunks(x, layout):
    """The inverse of :func:`to_chunks`: ``(x (B, H, X, Y, D), global_x (B, H, G, D) or None)``."""
    B, H, _, S, D = x.shape
    w, mx, my, C = layout.window, layout.chunk_rows, layout.chunk_cols, layout.num_chunks
    grid = x[:, :, :C].reshape(B, H, mx, my, w, w, D).transpose(3, 4).reshape(B, H, mx * w, my * w, D)
    global_x = x[:, :, C:].reshape(B, H, -1, D)[:, :, : layout.num_global] if x.shape[2] > C else None
    return grid[:, :, : layout.rows, : layout.cols], global_x


def gather_windows(x, layout, chunks=slice(None)):
    """The keys (or values) the queries of each chunk in ``chunks`` see:
    ``x (B, H, C + P, S, D)`` from :func:`to_chunks` -> ``(B, H, c, L, D)``."""
    B, H, T, S, D = x.shape
    index = layout.slots[chunks]
    return x.reshape(B, H, T, S * D).index_select(2, index.reshape(-1)).view(B, H, index.shape[0], -1, D)


def scatter_windows_(grad_x, grad, layout, chunks=slice(None)):
    """The adjoint of :func:`gather_windows`: adds ``grad (B, H, c, L, D)`` into ``grad_x (B, H, C + P, S, D)``."""
    B, H, T, S, D = grad_x.shape
    index = layout.slots[chunks].reshape(-1)
    grad_x.view(B, H, T, S * D).index_add_(2, index, grad.reshape(B, H, index.shape[0], S * D))


@lru_cache(maxsize=64)
def _window_mask(layout, dtype):
    return torch.zeros(layout.allowed.shape, dtype=dtype, device=layout.allowed.device).masked_fill_(
        ~layout.allowed, float("-inf")
    )


def window_bias(layout, rel_bias, global_bias, dtype):
    """``(H or 1, C, S, L)``, added to the scores: the global bias, the relative position bias, and -inf
    where a query does not see a key."""
    mask = _window_mask(layout, dtype)
    if rel_bias is None and global_bias is None:
        return mask[None]
    H = (rel_bias if rel_bias is not None else global_bias).shape[0]
    S, PS = layout.window**2, layout.global_chunks * layout.window**2
    bias = mask.new_zeros(H, S, layout.window_len)
    if global_bias is not None:
        bias[:, :, : layout.num_global] = global_bias[:, None, :]
    if rel_bias is not None:
        bias[:, :, PS:] = rel_bias[:, layout.bias_index]
    return bias[:, None] + mask


def window_bias_grad(grad_bias, layout, rel_bias, global_bias):
    """Gradients of ``rel_bias`` and ``global_bias`` from ``grad_bias (H, S, L)``, the gradient of the scores
    summed over batch and chunks."""
    grad_rel = grad_global = None
    PS = layout.global_chunks * layout.window**2
    if rel_bias is not None:
        per_slot = grad_bias[:, :, PS:].reshape(grad_bias.shape[0], -1).to(rel_bias.dtype)
        grad_rel = torch.zeros_like(rel_bias).index_add_(1, layout.bias_index.reshape(-1), per_slot)
    if global_bias is not None:
        grad_global = grad_bias[:, :, : layout.num_global].sum(1).to(global_bias.dtype)
    return grad_rel, grad_global


def window_probs(queries, keys, bias, scale):
    """softmax(scale * queries @ keys^T + bias) over each chunk's window: (..., S, D) x (..., L, D) -> (..., S, L)."""
    scores = torch.matmul(queries * scale, keys.transpose(-1, -2))
    scores += bias
    return torch.softmax(scores, dim=-1)
