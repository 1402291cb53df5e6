"""Longformer-chunks: the sequence cut into overlapping chunks of 2w positions (overlap w), one batched matrix
product per chunk, and the band read off the chunks' score matrices.

Chunk ``c`` holds positions ``(c-1)w .. (c+1)w - 1`` (one zero block in front), so query ``i`` in block
``m = i // w`` finds its keys at offsets ``0..w`` in the first half of chunk ``m + 1`` (row ``i - mw``) and at
offsets ``-w..-1`` in the second half of chunk ``m``. The ``2w x 2w`` product of a chunk
computes about twice the scores the band needs, which is what this layout trades for one dense product: about
twice the memory of the band, as the Longformer paper says. The probabilities are put back into chunk layout
for the product with the values. Undilated windows only (as the paper's chunks); backward is autograd's.
"""

import torch
import torch.nn.functional as F

from . import Backend
from ..geometry import pair_in_band
from .loop_1d import softmax_with_globals


def _diagonals(half, count):
    """``half (..., w, 2w)`` -> ``(..., w, count)``: entry ``(r, a)`` is ``half[r, r + a]``. Row r of the flattened
    matrix read with row length 2w + 1 starts r places further right: the skew is a pad and a view."""
    w = half.shape[-2]
    flat = F.pad(half.flatten(-2), (0, w))
    return flat.unflatten(-1, (w, 2 * w + 1))[..., :count]


def _undiagonals(diagonals):
    """The adjoint of :func:`_diagonals`: ``(..., w, count)`` -> ``(..., w, 2w)`` with zeros off the diagonals."""
    w, count = diagonals.shape[-2:]
    flat = F.pad(diagonals, (0, 2 * w + 1 - count)).flatten(-2)
    return flat[..., : 2 * w * w].unflatten(-1, (w, 2 * w))


def _chunks(x, window, blocks):
    """(B, H, L, D) -> (B, H, blocks + 1, 2w, D): chunk c holds positions (c-1)w .. (c+1)w - 1, zero padded."""
    x = F.pad(x, (0, 0, window, (blocks + 1) * window - x.shape[2]))
    return x.unfold(2, 2 * window, window).transpose(-1, -2)


def attention_1d(q, k, v, hood, *, global_k, global_v, rel_bias, global_bias, key_padding_mask, scale):
    B, H, L, D = q.shape
    w = hood.window
    blocks = -(-L // w)
    chunk_scores = torch.matmul(_chunks(q * scale, w, blocks), _chunks(k, w, blocks).transpose(-1, -2))
    upper = _diagonals(chunk_scores[:, :, 1:, :w], w + 1)  # offsets 0..w
    lower = _diagonals(chunk_scores[:, :, :-1, w:], w)  # offsets -w..-1, as columns r..r+w-1 of the second half
    band = torch.cat([lower, upper], dim=-1).flatten(2, 3)  # (B, H, blocks * w, 2w + 1): offsets -w..w

    positions = torch.arange(blocks * w, device=q.device)[:, None]
    keys = positions + torch.arange(-w, w + 1, device=q.device)[None, :]
    allowed, row = pair_in_band(positions, keys, w, 1, hood.causal)
    visible = allowed & (keys >= 0) & (keys < L)
    if key_padding_mask is not None:
        visible = visible & ~F.pad(key_padding_mask, (w, keys.shape[0] + w - L))[:, keys + w][:, None]
    if rel_bias is not None:
        band = band + rel_bias[:, None, :]
    queries = F.pad(q, (0, 0, 0, blocks * w - L)) * scale
    probs = softmax_with_globals(band.masked_fill(~visible, float("-inf")), queries, global_k, global_bias)
    G = 0 if global_k is None else global_k.shape[2]

    # Back into chunk layout: block m's offsets 0..w into the first half of chunk m + 1, -w..-1 into the second
    # half of chunk m.
    band_probs = probs[..., G:].unflatten(2, (blocks, w))
    first, second = _undiagonals(band_probs[..., w:]), _undiagonals(band_probs[..., :w])
    chunk_probs = torch.cat([F.pad(first, (0, 0, 0, 0, 1, 0)), F.pad(second, (0, 0, 0, 0, 0, 1))], dim=-2)
    chunk_out = torch.matmul(chunk_probs, _chunks(v, w, blocks))  # (B, H, blocks + 1, 2w, D)
    out = (chunk_out[:, :, 1:, :w] + chunk_out[:, :, :-1, w:]).flatten(2, 3)
    if G:
        out = out + torch.matmul(probs[..., :G], global_v)
    return out[:, :, :L]


BACKEND = Backend("chunks", attention_1d=attention_1d, dilation_1d=None)
