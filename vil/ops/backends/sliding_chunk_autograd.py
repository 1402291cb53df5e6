"""Sliding chunks over all chunks at once, backward left to autograd (it keeps every intermediate)."""

import torch

from ..chunks import chunk_layout, from_chunks, gather_windows, to_chunks, window_bias, window_probs


def sliding_chunk_autograd(q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale):
    G = 0 if global_k is None else global_k.shape[2]
    layout = chunk_layout(q.shape[2], q.shape[3], window, exact, mode, G, q.device)
    keys = gather_windows(to_chunks(k, layout, global_k), layout)
    values = gather_windows(to_chunks(v, layout, global_v), layout)
    probs = window_probs(to_chunks(q, layout), keys, window_bias(layout, rel_bias, global_bias, q.dtype), scale)
    return from_chunks(torch.matmul(probs, values), layout)[0]
