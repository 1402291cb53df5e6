"""Windows gathered by unfolding: every query's keys are copied next to it, then one batched product.

``unfold`` gathers them with ``Tensor.unfold`` (a strided view, copied by the product); ``unfold_nnf.py`` computes
the same with ``torch.nn.functional.unfold`` (im2col). The exact window (SW_EXACT 1) unfolds ``(2w+1) x (2w+1)`` tokens
around every token; ViL's chunked windows (SW_EXACT 0, -1) unfold the ``3w x 3w`` tokens of the 3x3 chunks
around every chunk, with stride w, from a map padded by one chunk (zeros, or wrapped around for -1). Which
unfolded keys are real (not padding, not a second copy under wrap-around, in the mode's chunks) is unfolded
from a map of ones the same way. Backward is autograd's, which keeps the unfolded keys and values: these
backends take tokens x window x head_dim memory, the baseline the fused and chunked backends improve on.
"""

from functools import partial

import torch
import torch.nn.functional as F

from ..base import ONE_SIZE_EXPORT, Backend, softmax_or_zeros, static_sizes
from ..geometry import (
    NEIGHBOURS,
    exact_window_bias_index,
    neighbour_offsets,
    rel_bias_row,
    unfolded_window_offsets,
    unfolded_window_tables,
)


def _pad_map(x, window, exact):
    """(N, C, X, Y) -> padded for unfolding: by w (exact 1), or to multiples of w and then one chunk on every
    side (zeros for SW_EXACT 0, wrapped around for -1)."""
    w = window
    if exact == 1:
        return F.pad(x, (w, w, w, w))
    X, Y = x.shape[-2:]
    x = F.pad(x, (0, _chunks(Y, w) * w - Y, 0, _chunks(X, w) * w - X))
    return F.pad(x, (w, w, w, w), mode="circular" if exact == -1 else "constant")


def _chunks(side, window):
    """The chunks of ``window`` positions along a side, the last one padded: by floor division, so that under
    torch.export the padded map and its reshapes into chunks have sizes torch knows to be equal."""
    return (side + window - 1) // window


def _tensor_unfold(x, size, step):
    """(N, C, Xp, Yp) -> (N, C, n_rows, n_cols, size * size), with Tensor.unfold."""
    patches = x.unfold(2, size, step).unfold(3, size, step)
    return patches.reshape(*patches.shape[:4], size * size)


def _window_tables(rows, cols, window, exact, mode, device):
    """``(allowed, bias_index)`` of the unfolded windows (see :func:`unfolded_window_tables`); the exact window
    needs no ``allowed`` (real tokens are checked separately) and has one bias row per window position."""
    w = window
    if exact == 1:
        return None, exact_window_bias_index(w).to(device)
    if static_sizes((rows, cols)):
        return unfolded_window_tables(rows, cols, window, exact, mode, device)
    # Symbolic sizes (torch.export): with zero padding every chunk has the mode's slots, as the middle chunk of
    # a 3x3 grid does; which keys are padding is checked separately.
    if exact == -1:
        if torch.jit.is_tracing():
            raise ValueError(
                "SW_EXACT -1 (windows wrapping around the map) needs a fixed map size, which torch.jit.trace (and "
                f"torch.onnx.export with dynamo=False) records as a variable; trace with torch.export instead: "
                f"{ONE_SIZE_EXPORT}."
            )
        raise ValueError(
            f"SW_EXACT -1 (windows wrapping around the map) needs a fixed map size; {ONE_SIZE_EXPORT}, "
            "or use SW_EXACT 0 or 1."
        )
    return _inner_chunk_tables(window, exact, mode, device)


def _inner_chunk_tables(window, exact, mode, device):
    """:func:`unfolded_window_tables` of a chunk whose 9 neighbours are all in the map, from plain tensor
    operations that torch.export traces into the graph."""
    slot, di, dj = unfolded_window_offsets(window, device)
    allowed = torch.zeros_like(slot, dtype=torch.bool)
    for ab in neighbour_offsets(exact, mode):
        allowed = allowed | (slot == NEIGHBOURS.index(ab))
    return allowed.view(1, 1, 1, -1), rel_bias_row(di, dj, window)


def unfolded_attention(unfold, q, k, v, hood, extras):
    """The attention of every query to its window, the windows gathered by ``unfold(x, size, step)``: ``(N, C, Xp,
    Yp) -> (N, C, n_rows, n_cols, size * size)``."""
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    scale = extras.scale
    B, H, X, Y, D = q.shape
    window, exact, mode = hood.window, hood.exact, hood.mode
    w = window
    size, step = (2 * w + 1, 1) if exact == 1 else (3 * w, w)

    def windows(x):  # (B, H, X, Y, D) -> (B*H, D, n_rows, n_cols, K)
        return unfold(_pad_map(x.reshape(B * H, X, Y, D).permute(0, 3, 1, 2), w, exact), size, step)

    ones = torch.ones(1, 1, X, Y, device=q.device, dtype=q.dtype)
    real = unfold(_pad_map(ones, w, exact), size, step)[0, 0] > 0  # (n_rows, n_cols, K)
    allowed, bias_index = _window_tables(X, Y, w, exact, mode, q.device)
    keys, values = windows(k), windows(v)

    if exact == 1:
        queries = q.reshape(B * H, X, Y, 1, D)  # one query per unfolded window
        valid = real[:, :, None, :]
    else:
        S, n_rows, n_cols = w * w, _chunks(X, w), _chunks(Y, w)
        grid = F.pad(q, (0, 0, 0, n_cols * w - Y, 0, n_rows * w - X))  # queries by chunk: (B*H, mx, my, S, D)
        queries = (
            grid.reshape(B * H, n_rows, w, n_cols, w, D).permute(0, 1, 3, 2, 4, 5).reshape(B * H, n_rows, n_cols, S, D)
        )
        valid = real[:, :, None, :] & allowed
    queries = queries * scale  # before the products: in half precision q.k itself may exceed the dtype's range
    # (B*H, n_rows, n_cols, queries per window, K)
    scores = torch.einsum("nijqd,ndijk->nijqk", queries, keys)
    if rel_bias is not None:
        scores = scores + rel_bias[:, bias_index].repeat(B, 1, 1)[:, None, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    if global_k is not None:
        g_scores = torch.einsum("nijqd,ngd->nijqg", queries, global_k.reshape(B * H, -1, D))
        if global_bias is not None:
            g_scores = g_scores + global_bias.repeat(B, 1)[:, None, None, None, :]
        scores = torch.cat([g_scores, scores], dim=-1)
    probs = softmax_or_zeros(scores)
    G = 0 if global_k is None else global_k.shape[2]
    out = torch.einsum("nijqk,ndijk->nijqd", probs[..., G:], values)
    if G:
        out = out + torch.einsum("nijqg,ngd->nijqd", probs[..., :G], global_v.reshape(B * H, G, D))
    if exact == 1:
        return out.reshape(B, H, X, Y, D)
    out = out.reshape(B * H, n_rows, n_cols, w, w, D).permute(0, 1, 3, 2, 4, 5).reshape(B, H, n_rows * w, n_cols * w, D)
    # The map's rows and columns out of the padded chunks, gathered: a slice would be contiguous exactly where the
    # map fills its chunks, which torch.export would turn into a guard holding only at the traced size's kind.
    rows, cols = torch.arange(X, device=q.device), torch.arange(Y, device=q.device)
    return out.index_select(2, rows).index_select(3, cols)


BACKEND = Backend("unfold", attention_2d=partial(unfolded_attention, _tensor_unfold), dilation_2d="split")
