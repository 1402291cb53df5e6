"""torch's FlexAttention: the window as a ``BlockMask``, both bias tables in a ``score_mod``.

Queries are the map's tokens row-major; keys are the G global keys, then the map's tokens. Which key a query
sees and which relative-bias row applies are computed from the two indices inside ``mask_mod`` and ``score_mod``
(:func:`vil.ops.geometry.pair_in_window_2d`), so nothing of size tokens x window is stored. The 1D band's block
mask is read from the band's shape, without the (tokens x keys) mask that ``create_block_mask`` evaluates; both
kinds are cached per shape. On CUDA the attention is
compiled with ``torch.compile`` (FlexAttention's fused kernels); on the CPU it runs eagerly, forward only: torch's
FlexAttention has no CPU backward.
"""

from functools import lru_cache

import torch

from ..base import Backend, built_outside_inference_mode, static_sizes, tracing
from ..geometry import pair_in_band, pair_in_window_2d


@lru_cache(maxsize=32)  # one per map size, window and mode (random-shift training draws 8 modes)
@built_outside_inference_mode
def _block_mask(rows, cols, hood, num_global, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < num_global) | pair_in_window_2d(q_idx, kv_idx, hood, rows, cols, num_global)[0]

    return create_block_mask(mask_mod, None, None, rows * cols, num_global + rows * cols, device=device)


def _cached(function, q, *args):
    """``function(*args)``, cached, or under torch.compile / torch.export computed anew (a cached one holds real
    tensors)."""
    return function.__wrapped__(*args) if tracing(q) else function(*args)


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


def _refuse_dynamic_export(q):
    """The block mask is built from the map or sequence size, so an exported program could only keep the traced
    size: refused where torch.export gives symbolic sizes, which would otherwise fail in torch's own words."""
    if torch.compiler.is_exporting() and not static_sizes(q.shape[2:-1]):
        raise ValueError(
            "The flex backend builds its block mask from the map or sequence size, so torch.export cannot give it "
            "dynamic sizes; export the sizes as static or use another backend (fused_cpu on the CPU, triton on CUDA)."
        )


def attention_2d(q, k, v, hood, extras):
    from torch.nn.attention.flex_attention import flex_attention

    _refuse_dynamic_export(q)
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
        block_mask=_cached(_block_mask, q, X, Y, hood, G, q.device),
        scale=extras.scale,
    )
    return out.reshape(B, H, X, Y, D)


BAND_BLOCK = 128  # queries and keys per block of the 1D block mask (FlexAttention's default)


@lru_cache(maxsize=32)
@built_outside_inference_mode
def _band_blocks(length, num_global, reach, causal, device):
    """The key blocks each block of queries needs, as FlexAttention's ``(kv_num_blocks, kv_indices)`` of one batch
    entry and head: the global keys' blocks, then those of the band (keys within ``reach`` of a query of the block,
    before it only where ``causal``). Read from the band's shape, so that no (length x keys) mask is formed, as
    ``create_block_mask`` would (33 GiB at 32k tokens); ``mask_mod`` decides within the blocks."""
    global_blocks = -(-num_global // BAND_BLOCK)
    key_blocks = -(-(num_global + length) // BAND_BLOCK)
    rows = []
    for start in range(0, length, BAND_BLOCK):
        first = max((num_global + max(start - reach, 0)) // BAND_BLOCK, global_blocks)
        last = (num_global + min(start + BAND_BLOCK - 1 + (0 if causal else reach), length - 1)) // BAND_BLOCK
        rows.append([*range(global_blocks), *range(first, last + 1)])
    counts = torch.tensor([len(row) for row in rows], dtype=torch.int32, device=device)
    indices = torch.tensor([row + [0] * (key_blocks - len(row)) for row in rows], dtype=torch.int32, device=device)
    return counts[None, None], indices[None, None]


@lru_cache(maxsize=32)
@built_outside_inference_mode
def _dilations(dilations, device):
    return torch.tensor(dilations, device=device)


def attention_1d(q, k, v, hood, extras):
    """The band as a block mask over the G global keys and the sequence; per-head dilations and the key padding
    mask are read inside ``mask_mod`` by head and batch index."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    _refuse_dynamic_export(q)
    q, k, v, extras = _no_grad_on_cpu(q, k, v, extras)
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    B, H, L, D = q.shape
    G = extras.num_global
    keys, values = (k, v) if not G else (torch.cat([global_k, k], dim=2), torch.cat([global_v, v], dim=2))
    dilations = _cached(_dilations, q, hood.dilations(H), q.device)
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

    reach = hood.window * max(hood.dilations(H))
    counts, indices = _cached(_band_blocks, q, L, G, reach, hood.causal, q.device)
    block_mask = BlockMask.from_kv_blocks(
        counts, indices, BLOCK_SIZE=BAND_BLOCK, mask_mod=mask_mod, seq_lengths=(L, G + L)
    )
    attend = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    return attend(q, keys, values, score_mod=score_mod, block_mask=block_mask, scale=extras.scale)


# torch's FlexAttention has no CPU backward: forward only there; torch.func.vmap fails inside it, and it
# uses vmap itself.
BACKEND = Backend(
    "flex",
    attention_2d=attention_2d,
    attention_1d=attention_1d,
    per_head_dilation=True,
    devices=("cpu", "cuda"),
    trains_on=("cuda",),
    traceable=True,
    function_transforms=False,
    vmap=False,
    in_compiled_operators=False,
)
