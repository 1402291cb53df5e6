"""The naive oracle: full attention over all tokens with the window as a boolean mask, in 2D and 1D.

It is written from the definition of the window (token positions and chunk indices, sequence offsets), on
purpose apart from the geometry module the fast backends share, so that tests can hold those backends
against it. Memory grows with tokens squared: use it on small problems only.
"""

import torch

from ..base import Backend, kept_tables, softmax_or_zeros


@kept_tables(4)  # tokens^2 entries each
def window_pairs(rows, cols, window, exact, mode, device, dilation=1):
    """For every (query, key) pair of an ``rows x cols`` map: may the query see the key, and which row
    of the ``(4w-1)^2`` relative bias table applies. Returns ``(allowed, bias_index)``, both ``(N, N)``."""
    w, d = window, dilation
    pos = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    qi, qj = pos[:, 0, None], pos[:, 1, None]  # queries along dim 0
    ki, kj = pos[None, :, 0], pos[None, :, 1]  # keys along dim 1
    if exact == 1:
        # Keys at qi + d*a, |a| <= w; the bias is indexed by a (offsets in units of the dilation).
        allowed = ((qi - ki).abs() <= w * d) & ((qj - kj).abs() <= w * d) & ((qi - ki) % d == 0) & ((qj - kj) % d == 0)
        di, dj = (qi - ki).div(d, rounding_mode="floor"), (qj - kj).div(d, rounding_mode="floor")
    else:
        mx, my = -(-rows // w), -(-cols // w)
        if mode == 0:
            offsets = [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1)]
        elif mode == -1:
            offsets = [(0, 0)]
        else:
            offsets = [(0, 0), [(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1)][mode - 1]]
        n = rows * cols
        best_wraps = torch.full((n, n), 3)  # 3 = not reachable
        di = torch.zeros(n, n, dtype=torch.long)
        dj = torch.zeros(n, n, dtype=torch.long)
        for a, b in offsets:
            # The nominal neighbour chunk of each query; cyclic mode wraps it into the grid.
            na, nb = qi // w + a, qj // w + b
            wraps = ((na < 0) | (na >= mx)).long() + ((nb < 0) | (nb >= my)).long()
            if exact == -1:
                hit = (ki // w == na % mx) & (kj // w == nb % my)
            else:
                hit = (ki // w == na) & (kj // w == nb) & (wraps == 0)
            take = hit & (wraps < best_wraps)
            best_wraps = torch.where(take, wraps, best_wraps)
            # Positions as if the neighbour chunk sat next to the query's chunk.
            di = torch.where(take, qi - (na * w + ki % w), di)
            dj = torch.where(take, qj - (nb * w + kj % w), dj)
        allowed = best_wraps < 3
    bias_index = ((di + 2 * w - 1) * (4 * w - 1) + (dj + 2 * w - 1)).clamp(0, (4 * w - 1) ** 2 - 1)
    return allowed.to(device), bias_index.to(device)


def band_pairs(length, window, dilations, causal, device):
    """For every head and (query i, key j) pair of a sequence: may the query see the key (``j = i + d*a`` with
    ``|a| <= w``, ``a <= 0`` when causal), and the row ``a + w`` of the ``2w+1`` bias table. ``(H, L, L)`` each."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    d = torch.tensor(dilations, device=device)[:, None, None]
    a = (j - i).div(d, rounding_mode="floor")
    allowed = ((j - i) % d == 0) & (a.abs() <= window)
    if causal:
        allowed = allowed & (a <= 0)
    return allowed, (a + window).clamp(0, 2 * window)


def _attend(q, k, v, allowed, bias, extras):
    """Softmax attention of q ``(B, H, N, D)`` over the keys ``allowed`` ``(.., N, N)`` with ``bias`` added, and
    over the global keys; a query that sees no key outputs zeros (and gets zero gradients). q is scaled before the
    products, which in half precision could overflow where the scaled scores do not."""
    global_k, global_v, global_bias = extras.global_k, extras.global_v, extras.global_bias
    q = q * extras.scale
    scores = torch.matmul(q, k.transpose(-1, -2))
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    if global_k is not None:
        global_scores = torch.matmul(q, global_k.transpose(-1, -2))
        if global_bias is not None:
            global_scores = global_scores + global_bias[:, None, :]
        scores = torch.cat([global_scores, scores], dim=-1)
        v = torch.cat([global_v, v], dim=2)
    return torch.matmul(softmax_or_zeros(scores), v)


def attention_2d(q, k, v, hood, extras):
    B, H, X, Y, D = q.shape
    allowed, bias_index = window_pairs(X, Y, hood.window, hood.exact, hood.mode, q.device, hood.dilation)
    bias = None if extras.rel_bias is None else extras.rel_bias[:, bias_index]
    flat = [t.reshape(B, H, X * Y, D) for t in (q, k, v)]
    return _attend(*flat, allowed, bias, extras).reshape(B, H, X, Y, D)


def attention_1d(q, k, v, hood, extras):
    B, H, L, D = q.shape
    allowed, bias_row = band_pairs(L, hood.window, hood.dilations(H), hood.causal, q.device)
    allowed = allowed[None]
    if extras.key_padding_mask is not None:
        allowed = allowed & ~extras.key_padding_mask[:, None, None, :]
    bias = None if extras.rel_bias is None else extras.rel_bias.gather(1, bias_row.flatten(1)).view(H, L, L)
    return _attend(q, k, v, allowed, bias, extras)


BACKEND = Backend("reference", attention_2d=attention_2d, attention_1d=attention_1d, per_head_dilation=True)
