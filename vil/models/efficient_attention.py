"""The efficient attention mechanisms that the original release compares ViL's attention with:
``ATTN_TYPE linformer``, ``srformer`` and ``performer``.

Each replaces the attention of the stages with ``s1`` and works on all of the stage's tokens, ``[G global tokens,
nx*ny local tokens row-major]``, takes its one number from the stage's ``f`` field, has no relative position bias
and ends with ``proj``. Parameter and buffer names are the original release's, so its checkpoints load.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module

from .attention import merge_heads, split_heads


def _in_stage(stage):
    return "" if stage is None else f" in stage {stage}"


@register_notrace_module  # a leaf for torch.fx: it checks the token count
class LinformerAttention(nn.Module):
    """Linformer (Wang et al., 2020): keys and values, all heads at once, are projected along the token axis to
    ``k`` rows (``proj_k^T K``, ``proj_v^T V``), then ordinary softmax attention of the queries over them.

    ``proj_k`` and ``proj_v`` are ``(seq_len, k)`` for the tokens of the ``grid`` (rows, columns) of the image size
    the model is built for, global tokens first, so the layer takes only that map. With ``share_kv`` they are one
    parameter under two names.
    """

    def __init__(self, dim, heads, num_global, grid, k, share_kv=True, drop=0.0, stage=None):
        super().__init__()
        self.heads, self.grid, self.stage = heads, tuple(grid), stage
        seq_len = num_global + grid[0] * grid[1]
        self.query = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        bound = 1 / math.sqrt(k)
        self.proj_k = nn.Parameter(torch.empty(seq_len, k).uniform_(-bound, bound))
        self.proj_v = self.proj_k if share_kv else nn.Parameter(torch.empty(seq_len, k).uniform_(-bound, bound))

    def forward(self, x, nx, ny):
        if (nx, ny) != self.grid:  # the token count alone would let a transposed map through
            rows, cols = self.grid
            raise ValueError(
                f"Linformer attention{_in_stage(self.stage)} is built for a {rows}x{cols} map (the image size the "
                f"model was built for) and got {nx}x{ny}; give images of the size the model was built for, or build "
                "it (img_size, INPUT.IMAGE_SIZE) for this size."
            )
        q = split_heads(self.query(x), self.heads)
        keys, values = self.kv(x).chunk(2, dim=-1)
        keys = torch.einsum("bnc,nk->bkc", keys, self.proj_k)
        values = torch.einsum("bnc,nk->bkc", values, self.proj_v)
        out = F.scaled_dot_product_attention(q, split_heads(keys, self.heads), split_heads(values, self.heads))
        return self.proj_drop(self.proj(merge_heads(out)))


@register_notrace_module
class SpatialReductionAttention(nn.Module):
    """Spatial-reduction attention (as in PVT, Wang et al., 2021): the local tokens, as a map, go through a
    ``ratio x ratio`` convolution of stride ``ratio`` and an instance norm without parameters; keys and values are
    ``kv`` of the global tokens followed by the reduced map's tokens; every query (``query`` of all tokens) attends
    to them with an ordinary softmax. ``grid``: the map of the image size the model is built for, refused at once
    where it reduces to too few positions."""

    def __init__(self, dim, heads, num_global, ratio, drop=0.0, stage=None, grid=None):
        super().__init__()
        self.heads, self.num_global, self.ratio, self.stage = heads, num_global, ratio, stage
        if grid is not None:
            self._check_map(*grid)
        self.query = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        self.proj_sr = nn.Conv2d(dim, dim, kernel_size=ratio, stride=ratio, bias=False)
        self.norm = nn.InstanceNorm2d(dim)

    def _check_map(self, nx, ny):
        r = self.ratio
        if (nx // r) * (ny // r) < 2:
            raise ValueError(
                f"Spatial-reduction attention{_in_stage(self.stage)} reduces its {nx}x{ny} map by {r} to "
                f"{nx // r}x{ny // r}, and its instance norm needs at least 2 positions; use a smaller reduction "
                f"(the stage's f field) or larger images."
            )

    def forward(self, x, nx, ny):
        B, _, C = x.shape
        G = self.num_global
        self._check_map(nx, ny)
        q = split_heads(self.query(x), self.heads)
        local = x[:, G:].transpose(1, 2).reshape(B, C, nx, ny)
        reduced = self.norm(self.proj_sr(local)).flatten(2).transpose(1, 2)
        keys, values = split_heads(self.kv(torch.cat([x[:, :G], reduced], dim=1)), 2 * self.heads).chunk(2, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values)
        return self.proj_drop(self.proj(merge_heads(out)))


def orthogonal_random_features(num_features, dim, device=None):
    """``(num_features, dim)`` Gaussian orthogonal random features: stacked blocks of random orthogonal ``dim x
    dim`` matrices (Haar-distributed: QR of a Gaussian matrix, signs fixed by R's diagonal), the last one cut to
    size, each row rescaled by the norm of a ``dim``-dimensional Gaussian vector."""
    gaussian = torch.randn(-(-num_features // dim), dim, dim, dtype=torch.float64, device=device)
    q, r = torch.linalg.qr(gaussian)
    blocks = (q * r.diagonal(dim1=-2, dim2=-1).sign()[:, None, :]).transpose(1, 2)  # each block's rows orthonormal
    norms = torch.randn(num_features, dim, dtype=torch.float64, device=device).norm(dim=1)
    return (norms[:, None] * blocks.reshape(-1, dim)[:num_features]).float()


class FavorFeatures(nn.Module):
    """FAVOR+ (Choromanski et al., 2021): softmax attention approximated with ``num_features`` positive random
    features, linear in the token count. ``projection_matrix`` is a buffer (in the state dict) that
    :meth:`redraw_if` replaces."""

    def __init__(self, head_dim, num_features):
        super().__init__()
        self.head_dim, self.num_features = head_dim, num_features
        self.register_buffer("projection_matrix", orthogonal_random_features(num_features, head_dim))

    @torch.no_grad()
    def redraw_if(self, due):
        """Replace the projection with a fresh draw where ``due`` (a bool tensor) is true. Drawing every time and
        selecting keeps the decision in the graph under torch.compile, as the neighbour draw of MODE > 0 does."""
        fresh = orthogonal_random_features(self.num_features, self.head_dim, self.projection_matrix.device)
        self.projection_matrix.copy_(torch.where(due, fresh, self.projection_matrix))

    def _features(self, x, is_query):
        """phi(x) = m^-1/2 (exp(c x.W^T - c^2 |x|^2 / 2 - max) + 1e-4) with c = head_dim^-1/4; the maximum is taken
        per row for queries and over the whole tensor for keys (the original's stabiliser)."""
        c = self.head_dim**-0.25
        projected = c * x @ self.projection_matrix.to(x.dtype).t()
        squared = (c * c / 2) * x.pow(2).sum(dim=-1, keepdim=True)
        if is_query:
            peak = projected.amax(dim=-1, keepdim=True)
        elif projected.numel() == 0:  # an empty batch: no key, no maximum (amax refuses empty tensors)
            peak = projected.new_zeros(())
        else:  # the dimensions are named: ONNX's translation of amax needs them
            peak = projected.amax(dim=tuple(range(projected.dim())))
        return self.num_features**-0.5 * (torch.exp(projected - squared - peak) + 1e-4)

    def forward(self, q, k, v):
        """(B, heads, N, D) queries, keys and values -> outputs: phi(q) (phi(K)^T V) / (phi(q) . sum_j phi(k_j))."""
        q, k = self._features(q, True), self._features(k, False)
        context = k.transpose(-2, -1) @ v  # (B, heads, m, D)
        normaliser = q @ k.sum(dim=-2)[..., None]  # (B, heads, N, 1)
        return (q @ context) / normaliser


@register_notrace_module
class PerformerAttention(nn.Module):
    """Multi-head attention with FAVOR+ (:class:`FavorFeatures`, the submodule ``fast_attention``) in place of the
    softmax; no score scale. The model redraws the features during training (see
    :meth:`vil.models.MsViT.set_feature_redraw_interval`)."""

    def __init__(self, dim, heads, num_features, drop=0.0):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        self.fast_attention = FavorFeatures(dim // heads, num_features)

    def forward(self, x, nx, ny):
        q, k, v = split_heads(self.qkv(x), 3 * self.heads).chunk(3, dim=1)
        return self.proj_drop(self.proj(merge_heads(self.fast_attention(q, k, v))))
