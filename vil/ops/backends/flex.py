"""torch's FlexAttention: the window as a ``BlockMask``, both bias tables in a ``score_mod``.

Queries are the map's tokens row-major; keys are the G global keys, then the map's tokens. Which key a query
sees and which relative-bias row applies are computed from the two indices inside ``mask_mod`` and ``score_mod``
(:func:`vil.ops.geometry.pair_in_window_2d`), so nothing of size tokens x window is stored. On CUDA the attention is
compiled with ``torch.compile`` (FlexAttention's fused kernels); on the CPU it runs eagerly, forward only: torch's
FlexAttention has no CPU backward.
"""

from functools import lru_cache

import torch

from ..base import Backend, tracing
from ..geometry import pair_in_band, pair_in_window_2d


@lru_cache(maxsize=32)  # one per map size, window and mode (random-shift training draws 8 modes)
def _block_mask(rows, cols, hood, num_global, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < num_global) | pair_in_window_2d(q_idx, kv_idx, hood, rows, cols, num_global)[0]

    return create_block_mask(mask_mod, None, None, rows * cols, num_global + rows * cols, device=device)


def _block_mask_for(q, *args):
    """The cached block mask, or under torch.compile / torch.export a new one, traced (a cached one holds real
    tensors)."""
    if tracing(q):
        return _block_mask.__wrapped__(*args)
    return _block_mask(*args)


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _no_grad_on_cpu(q, k, v, extras):
    """FlexAttention refuses tensors that require grad on the CPU, also under no_grad (the op has refused to
    train there already)."""
    if q.device.type != "cpu":
        return q, k, v, extras
    return q.detach(), k.detach(), v.detach(), extras.cast(torch.Tensor.detach)


def attention_2d(q, k, v, hood, extras):
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v, extras = _no_grad_on_cpu(q, k, v, extras)
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    B, H, X, Y, D = q.shape
    G = extras.num_global
    keys, values = k.reshape(B, H, X * Y, D), v.reshape(B, H, X * Y, D)
    if G:
        keys, values = torch.cat([global_k, keys], dim=2), torch.cat([global_v, values], dim=2)

    def score_mod(score, b, h, q_idx, kv_idx):
        if rel_bias is not None:
            _, row = pair_in_window_2d(q_idx, kv_idx, hood, X, Y, G)
            score = torch.where(kv_idx >= G, score + rel_bias[h, row], score)
        if global_bias is not None:
            score = torch.where(kv_idx < G, score + global_bias[h, kv_idx.clamp(max=G - 1)], score)
        return score

    attend = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    out = attend(
        q.reshape(B, H, X * Y, D),
        keys,
        values,
        score_mod=score_mod,
        block_mask=_block_mask_for(q, X, Y, hood, G, q.device),
        scale=extras.scale,
    )
    return out.reshape(B, H, X, Y, D)


def attention_1d(q, k, v, hood, extras):
    """The band as a block mask over the G global keys and the sequence; per-head dilations and the key padding
    mask are read inside ``mask_mod`` by head and batch index."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, extras = _no_grad_on_cpu(q, k, v, extras)
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    B, H, L, D = q.shape
    G = extras.num_global
    keys, values = (k, v) if not G else (torch.cat([global_k, k], dim=2), torch.cat([global_v, v], dim=2))
    dilations = torch.tensor(hood.dilations(H), device=q.device)
    padding = extras.key_padding_mask

    def band(b, h, q_idx, kv_idx):
        local = kv_idx - G
        allowed, row = pair_in_band(q_idx, local, hood.window, dilations[h], hood.causal)
        if padding is not None:
            allowed = allowed & ~padding[b, local.clamp(0, L - 1)]
        return allowed & (local >= 0), row

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < G) | band(b, h, q_idx, kv_idx)[0]

    def score_mod(score, b, h, q_idx, kv_idx):
        if rel_bias is not None:
            score = torch.where(kv_idx >= G, score + rel_bias[h, band(b, h, q_idx, kv_idx)[1]], score)
        if global_bias is not None:
            score = torch.where(kv_idx < G, score + global_bias[h, kv_idx.clamp(max=G - 1)], score)
        return score

    # Batch and head dimensions of the mask only where it differs between them.
    block_mask = create_block_mask(
        mask_mod, None if padding is None else B, H if hood.per_head else None, L, G + L, device=q.device
    )
    attend = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    return attend(q, keys, values, score_mod=score_mod, block_mask=block_mask, scale=extras.scale)


# torch's FlexAttention has no CPU backward: forward only there.
BACKEND = Backend(
    "flex",
    attention_2d=attention_2d,
    attention_1d=attention_1d,
    per_head_dilation=True,
    devices=("cpu", "cuda"),
    trains_on=("cuda",),
    traceable=True,
)
