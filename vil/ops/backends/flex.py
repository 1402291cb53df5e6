"""torch's FlexAttention: the window as a ``BlockMask``, both bias tables in a ``score_mod``.

Queries are the map's tokens row-major; keys are the G global keys, then the map's tokens. Which key a query
sees and which relative-bias row applies are computed from the two indices inside ``mask_mod`` and
``score_mod`` (:func:`_window`), so nothing of size tokens x window is stored. On CUDA the attention is compiled
with ``torch.compile`` (FlexAttention's fused kernels); on the CPU it runs eagerly, forward only: torch's
FlexAttention has no CPU backward.
"""

from functools import lru_cache

import torch

from ..chunks import neighbour_offsets


def _window(q_idx, kv_idx, cols, window, exact, mode, dilation, num_global, chunk_rows, chunk_cols):
    """For query ``q_idx`` and key ``kv_idx`` (index tensors): may the query see the key, and the row of the
    relative bias table, following the definition of the window (the reference backend's rules)."""
    w, d = window, dilation
    local = kv_idx - num_global
    qi, qj = q_idx // cols, q_idx % cols
    ki, kj = local // cols, local % cols
    if exact == 1:
        di, dj = qi - ki, qj - kj
        allowed = (di.abs() <= w * d) & (dj.abs() <= w * d) & (di % d == 0) & (dj % d == 0)
        di, dj = di // d, dj // d
    else:
        ci, cj = qi // w, qj // w
        # The offset through which the key's chunk is reached; the one wrapping around the fewest axes.
        best = torch.full_like(qi, 3)
        a_sel, b_sel = torch.zeros_like(qi), torch.zeros_like(qi)
        for a, b in neighbour_offsets(exact, mode):
            na, nb = ci + a, cj + b
            wraps = ((na < 0) | (na >= chunk_rows)).int() + ((nb < 0) | (nb >= chunk_cols)).int()
            if exact == -1:
                hit = (ki // w == na % chunk_rows) & (kj // w == nb % chunk_cols)
            else:
                hit = (ki // w == na) & (kj // w == nb) & (wraps == 0)
            take = hit & (wraps < best)
            best = torch.where(take, wraps, best)
            a_sel = torch.where(take, a, a_sel)
            b_sel = torch.where(take, b, b_sel)
        allowed = best < 3
        di = qi - ((ci + a_sel) * w + ki % w)
        dj = qj - ((cj + b_sel) * w + kj % w)
    row = (di + 2 * w - 1) * (4 * w - 1) + (dj + 2 * w - 1)
    return allowed & (local >= 0), row.clamp(0, (4 * w - 1) ** 2 - 1)


@lru_cache(maxsize=32)  # one per map size, window and mode (random-shift training draws 8 modes)
def _block_mask(rows, cols, window, exact, mode, dilation, num_global, device):
    from torch.nn.attention.flex_attention import create_block_mask

    geometry = _geometry(rows, cols, window, exact, mode, dilation, num_global)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < num_global) | _window(q_idx, kv_idx, **geometry)[0]

    return create_block_mask(mask_mod, None, None, rows * cols, num_global + rows * cols, device=device)


def _geometry(rows, cols, window, exact, mode, dilation, num_global):
    return dict(cols=cols, window=window, exact=exact, mode=mode, dilation=dilation, num_global=num_global,
                chunk_rows=-(-rows // window), chunk_cols=-(-cols // window))


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale, dilation=1):
    from torch.nn.attention.flex_attention import flex_attention

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, global_k, global_v, rel_bias, global_bias)
    )
    if q.device.type == "cpu" and needs_grad:
        raise ValueError(
            "The flex backend cannot train on the CPU: torch's FlexAttention has no CPU backward; use backend "
            "'sliding_chunk' there, or flex on a CUDA GPU."
        )
    if not needs_grad:  # FlexAttention refuses tensors that require grad on the CPU, also under no_grad
        q, k, v, global_k, global_v, rel_bias, global_bias = (
            None if t is None else t.detach() for t in (q, k, v, global_k, global_v, rel_bias, global_bias)
        )
    B, H, X, Y, D = q.shape
    G = 0 if global_k is None else global_k.shape[2]
    keys, values = k.reshape(B, H, X * Y, D), v.reshape(B, H, X * Y, D)
    if G:
        keys, values = torch.cat([global_k, keys], dim=2), torch.cat([global_v, values], dim=2)
    geometry = _geometry(X, Y, window, exact, mode, dilation, G)

    def score_mod(score, b, h, q_idx, kv_idx):
        if rel_bias is not None:
            _, row = _window(q_idx, kv_idx, **geometry)
            score = torch.where(kv_idx >= G, score + rel_bias[h, row], score)
        if global_bias is not None:
            score = torch.where(kv_idx < G, score + global_bias[h, kv_idx.clamp(max=G - 1)], score)
        return score

    attend = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    out = attend(
        q.reshape(B, H, X * Y, D), keys, values, score_mod=score_mod,
        block_mask=_block_mask(X, Y, window, exact, mode, dilation, G, q.device), scale=scale,
    )
    return out.reshape(B, H, X, Y, D)
