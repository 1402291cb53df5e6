"""The 2D pieces the sliding-chunk backends are built from: chunked tensors, the windows of a chunk group gathered
and scattered, and the scores of a group (the chunk geometry itself is in ``vil/ops/geometry.py``).

Scores are kept key-major, ``(..., L, S)``: on the CPU the products ``K Q^T`` and ``V dO^T`` that produce
them run about 1.5x faster than ``Q K^T`` and ``dO V^T``, so softmax statistics are reductions over dim
-2. Chunked tensors are ``(B, C, heads, S, D)``, so that a block of consecutive chunks is one contiguous
slice and the matrix products read it in place. Gathers move whole ``S x D`` chunks: a token-granular
gather is several times slower. The G global keys are not chunked: they are one small extra product per
chunk (:func:`global_scores`), which the backends combine with the local scores in the same softmax.
"""

import torch
import torch.nn.functional as F

from ..base import kept_tables


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


@kept_tables(256)
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


def window_bias(group, rel_bias, dtype):
    """``(c, H, L, S)``, added to the local scores of a group: the relative position bias; None without
    ``rel_bias``. (:func:`window_scores` hides the pairs outside the window.)"""
    if rel_bias is None:
        return None
    return rel_bias[:, group.bias_index].transpose(0, 1).to(dtype)


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
    gathered ``keys (b, c, H, L, D)`` and ``bias`` from :func:`window_bias` (or None). The pairs outside the
    window are set to -inf, not added -inf, so that a NaN or infinite key stays hidden from the queries that do not
    see it; only the chunks that have such pairs are touched: in the interior of the map there are none, and a full
    pass over the scores costs about a third of the product that makes them."""
    scores = torch.matmul(keys, queries.transpose(-1, -2))
    if bias is not None:
        scores += bias[chunks]
    first, last, _ = chunks.indices(group.num_chunks)
    for start, stop in group.masked_runs:
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            scores[:, lo - first : hi - first].masked_fill_(group.hidden[lo:hi, None], float("-inf"))
    return scores
