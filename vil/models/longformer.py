"""Longformer's self-attention layer (Beltagy et al., 2020) on the sliding-window op ``local_attention_1d``.

Parameter names follow Hugging Face transformers' ``LongformerSelfAttention``, so its state dicts load unchanged.
"""

import torch
import torch.nn as nn

from ..ops import Neighborhood1d, local_attention_1d


class SlidingWindowSelfAttention:
    """Longformer's self-attention computed with ``local_attention_1d``, for a module that has the projections
    ``query``, ``key``, ``value``, ``query_global``, ``key_global``, ``value_global`` (``nn.Linear``, dim -> dim)
    and the attributes ``num_heads``, ``head_dim``, ``window``, ``dilation``, ``causal`` and ``backend``: this
    project's :class:`LongformerSelfAttention`, and transformers' layers that :func:`vil.accelerate_longformer`
    converts."""

    def attend(self, x: torch.Tensor, padding: torch.Tensor, is_global: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, L, dim)``; ``padding``, ``is_global`` ``(B, L)`` bool, checked by the caller. Returns
        ``(B, L, dim)``, zeros at padded positions."""
        B, L, dim = x.shape
        if (padding & is_global).any():
            raise ValueError("global_mask marks padded positions; a padding token cannot have global attention.")
        counts = is_global.sum(1)
        sizes = counts.unique().tolist()
        if self.causal and any(sizes):
            raise ValueError("A causal layer takes no global tokens: Longformer defines no causal global attention.")
        q, k, v = (self._heads(proj(x)) for proj in (self.query, self.key, self.value))
        out = torch.empty_like(q)
        for g in sizes:
            rows = slice(None) if len(sizes) == 1 else (counts == g).nonzero().squeeze(1)
            out[rows] = self._attend(x[rows], q[rows], k[rows], v[rows], padding[rows], is_global[rows], g)
        return out.transpose(1, 2).reshape(B, L, dim).masked_fill(padding[..., None], 0.0)

    def _heads(self, x):
        """(B, L, dim) -> (B, heads, L, head_dim)."""
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)

    def _attend(self, x, q, k, v, padding, is_global, g):
        """The outputs ``(B, heads, L, head_dim)`` of sequences that all have ``g`` global tokens."""
        B, H, L, D = q.shape
        scale = D**-0.5
        positions = is_global.nonzero()[:, 1].view(B, g)  # each sequence's global tokens, in order
        index = positions[:, None, :, None].expand(B, H, g, D)
        out = local_attention_1d(
            q,
            k,
            v,
            self.window,
            dilation=self.dilation,
            causal=self.causal,
            key_padding_mask=padding | is_global,
            global_k=k.gather(2, index),
            global_v=v.gather(2, index),
            scale=scale,
            backend=self.backend,
        )
        if not g:
            return out
        global_q = self._heads(self.query_global(x.gather(1, positions[..., None].expand(B, g, x.shape[-1]))))
        return out.scatter(2, index, self._global_attention(x, global_q * scale, padding))

    def _global_attention(self, x, global_q, padding):
        """The global queries' full attention over every token that is not padding, ``(B, heads, g, head_dim)``,
        without projecting all L tokens with ``key_global`` and ``value_global``: per head, ``q . (W_k x + b_k) =
        (W_k^T q) . x + q . b_k``, and since each softmax row sums to 1, ``P (W_v x + b_v)^T = W_v (P x) + b_v``, so
        the L x dim x dim products become L x dim x g ones (g global queries)."""
        B, H, g, D = global_q.shape
        key_weight, value_weight = (p.weight.view(H, D, -1) for p in (self.key_global, self.value_global))
        folded = torch.einsum("bhgd,hdc->bhgc", global_q, key_weight).reshape(B, H * g, -1)  # (B, heads*g, dim)
        key_bias = (global_q * self.key_global.bias.view(H, 1, D)).sum(-1, True)
        scores = (folded @ x.transpose(1, 2)).view(B, H, g, -1) + key_bias  # x shared by the heads, not copied
        probs = scores.masked_fill(padding[:, None, None, :], float("-inf")).softmax(-1)
        mixed = (probs.view(B, H * g, -1) @ x).view(B, H, g, -1)  # (B, heads, g, dim)
        return torch.einsum("bhgc,hdc->bhgd", mixed, value_weight) + self.value_global.bias.view(H, 1, D)


class LongformerSelfAttention(SlidingWindowSelfAttention, nn.Module):
    """Multi-head self-attention of a sequence: a sliding window for every token, full attention for a few
    global ones. No output projection (Longformer's self-attention layer has none) and no attention dropout
    (the op computes the softmax inside).

    A token that is not global attends, in one softmax, to the keys of its window (``query``, ``key``, ``value``
    projections; keys ``i + d*a``, ``|a| <= window``, ``a <= 0`` when ``causal``) from which padding and global
    tokens are removed, and to every global token of its sequence (the same ``key`` and ``value`` projections).
    A global token attends with ``query_global`` to the ``key_global``, ``value_global`` projections of every token
    that is not padding. Scores are scaled by ``head_dim ** -0.5``. Padded positions output zeros; a padded token
    cannot be global.

    Sequences may have different numbers of global tokens. The op's global keys have one count for the whole batch
    and its global bias is per head, so a missing global slot of one sequence cannot be masked; the batch is
    instead split into groups of sequences with the same number of global tokens, one op call per group (a single
    call when all sequences have the same number, the usual case).

    Args:
        dim: features of a token.
        num_heads: attention heads; ``dim`` must divide by it.
        window: keys on each side of a query (Hugging Face's ``attention_window // 2``).
        dilation: an int, or one int per head.
        causal: only keys at or before the query. Longformer defines no causal global attention, so a causal
            layer refuses global tokens (an all-False ``global_mask`` is fine).
        backend: the op's backend (``vil.ops.available_backends(1)``); None: its default.
    """

    def __init__(self, dim, num_heads, window, dilation=1, causal=False, backend=None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}).")
        if isinstance(dilation, (list, tuple)):
            if len(dilation) != num_heads:
                raise ValueError(
                    f"dilation must be one int or one int per head ({num_heads}), got {len(dilation)} values."
                )
            dilation = tuple(dilation)
        Neighborhood1d(window, dilation, causal)  # raises for a bad window, dilation or causal
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.window, self.dilation, self.causal, self.backend = window, dilation, causal, backend
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.query_global = nn.Linear(dim, dim)
        self.key_global = nn.Linear(dim, dim)
        self.value_global = nn.Linear(dim, dim)

    def forward(self, x, key_padding_mask=None, global_mask=None):
        """``x`` ``(B, L, dim)``; ``key_padding_mask``, ``global_mask`` ``(B, L)`` bool, True for padding and for
        tokens with global attention. Returns ``(B, L, dim)``."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, L, dim={self.dim}), got {tuple(x.shape)}.")
        B, L, _ = x.shape
        for name, mask in (("key_padding_mask", key_padding_mask), ("global_mask", global_mask)):
            if mask is not None and (
                tuple(mask.shape) != (B, L) or mask.dtype != torch.bool or mask.device != x.device
            ):
                raise ValueError(
                    f"{name} must be a bool tensor of shape (B, L) = ({B}, {L}) on {x.device}, got "
                    f"{mask.dtype} of shape {tuple(mask.shape)} on {mask.device}."
                )
        padding = torch.zeros(B, L, dtype=torch.bool, device=x.device) if key_padding_mask is None else key_padding_mask
        return self.attend(x, padding, torch.zeros_like(padding) if global_mask is None else global_mask)
