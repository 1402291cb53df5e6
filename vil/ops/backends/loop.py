"""Longformer-loop: the band one diagonal at a time.

For each window offset ``a`` the keys ``i + d*a`` of all queries are one shifted view of the (padded) keys, so
a diagonal of scores is an elementwise product and a sum over the channels. The scores are ``L x (2w+1)``
(or ``w+1`` causal) and autograd keeps only views beside them: memory grows with L x w, time with the number
of diagonals, each a pass over the whole sequence. Slow on purpose: the plainest correct implementation,
as the Longformer paper's testing loop.
"""

import torch
import torch.nn.functional as F

from ..base import Backend, softmax_or_zeros
from ..geometry import pair_in_band


def _shifted(x, dilation, offset, pad, length):
    """The positions ``i + dilation * offset`` for every ``i``: a view of ``x`` padded by ``pad``, the smaller of
    ``dilation * window`` and ``length``. A shift of ``length`` or more sees padding only, so it is taken as one of
    ``pad``: padding by the whole shift took memory for up to ``2 * dilation * window`` positions."""
    start = pad + max(-pad, min(pad, dilation * offset))
    return x[:, :, start : start + length]


def softmax_with_globals(scores, queries, global_k, global_bias):
    """The probabilities of the global keys (first) and of the window keys whose ``scores (B, H, L, n)`` are given
    (-inf where hidden), from scaled ``queries``; zeros for a query that sees no key."""
    if global_k is not None:
        global_scores = torch.matmul(queries, global_k.transpose(-1, -2))
        if global_bias is not None:
            global_scores = global_scores + global_bias[:, None, :]
        scores = torch.cat([global_scores, scores], dim=-1)
    return softmax_or_zeros(scores)  # a NaN score is seen: NaN goes on as NaN


def attention_1d(q, k, v, hood, extras):
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    key_padding_mask = extras.key_padding_mask
    B, H, L, D = q.shape
    w, d = hood.window, hood.dilation
    pad = min(d * w, L)
    keys, values = F.pad(k, (0, 0, pad, pad)), F.pad(v, (0, 0, pad, pad))
    key_ok = torch.zeros(1 if key_padding_mask is None else B, L + 2 * pad, dtype=torch.bool, device=q.device)
    key_ok[:, pad : pad + L] = True if key_padding_mask is None else ~key_padding_mask
    positions = torch.arange(L, device=q.device)
    queries = q * extras.scale
    diagonals = []
    for a in hood.offsets:
        allowed, row = pair_in_band(positions, positions + d * a, w, d, hood.causal)
        scores = (queries * _shifted(keys, d, a, pad, L)).sum(-1)
        if rel_bias is not None:
            scores = scores + rel_bias[:, row[0], None]
        visible = _shifted(key_ok[:, None, :, None], d, a, pad, L)[..., 0] & allowed
        diagonals.append(scores.masked_fill(~visible, float("-inf")))
    probs = softmax_with_globals(torch.stack(diagonals, dim=-1), queries, global_k, global_bias)
    G = 0 if global_k is None else global_k.shape[2]
    out = torch.matmul(probs[..., :G], global_v) if G else torch.zeros_like(q)
    for n, a in enumerate(hood.offsets):
        out = out + probs[..., G + n, None] * _shifted(values, d, a, pad, L)
    return out


BACKEND = Backend("loop", attention_1d=attention_1d)
