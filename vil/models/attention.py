"""ViL's two attention modules: full attention, and longformer (local 2D) attention with global tokens.

Tokens are always ``[G global tokens, nx*ny local tokens row-major]``. Parameter names follow the original
release, so its checkpoints load unchanged.
"""

from dataclasses import astuple, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module, trunc_normal_

from ..ops import Neighborhood2d, check_backend, local_attention_2d
from .tables import full_bias, resize_full_bias_table


def split_heads(x, heads):
    """(B, N, heads * D) -> (B, heads, N, D)."""
    B, N, C = x.shape
    return x.view(B, N, heads, C // heads).transpose(1, 2)


def split_globals(x, num_global, dim=1):
    """``(global tokens, local tokens)`` of ``x`` along ``dim`` (None and ``x`` without global tokens). One split
    rather than two slices: autograd joins the two parts' gradients in one copy, where each slice's gradient would be
    a zero tensor the size of ``x`` and the two would then be added (BENCHMARKS.md)."""
    if not num_global:
        return None, x
    return x.split([num_global, x.shape[dim] - num_global], dim)


def merge_heads(x):
    """(B, heads, N, D) -> (B, N, heads * D)."""
    B, H, N, D = x.shape
    return x.transpose(1, 2).reshape(B, N, H * D)


# On the CPU, torch's flash kernel behind scaled_dot_product_attention costs more than the attention written out
# when a head has few scores: ViL's global queries (a few queries against every token) and its last stages at 224
# train 1.6x-3x faster written out in bfloat16, and as fast in float32 (BENCHMARKS.md). Above this many scores per
# head the written-out scores would cost memory that the flash kernel does not.
WRITTEN_OUT_SCORES = 2**16


def softmax_attention(q, k, v, bias=None):
    """Every query against every key (``(B, heads, L, D)`` each), with ``bias`` (broadcast to the scores) added:
    ``scaled_dot_product_attention``, or the same written out in q's dtype (as timm's attention without SDPA; torch's
    CPU softmax sums half precision in float32) on the CPU where a head has at most ``WRITTEN_OUT_SCORES`` scores,
    and during an ONNX export, where the exporter's decomposition of it with a mask returns other strides than
    torch.export recorded and merging the heads then fails (pytorch/pytorch#136543). With symbolic sizes
    (torch.export, ``dynamic=True``) the CPU writes them out at every size: the count would be a guard that
    refuses other image sizes."""
    scores_per_head = q.shape[-2] * k.shape[-2]
    few_scores = q.device.type == "cpu" and (
        not isinstance(scores_per_head, int) or scores_per_head <= WRITTEN_OUT_SCORES
    )
    if not (few_scores or torch.onnx.is_in_onnx_export()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    return (scores if bias is None else scores + bias).softmax(dim=-1) @ v


class _Attention(nn.Module):
    """What both attention modules share: the biases between global and local tokens used with relative
    position bias (a0). ``g2g[h, t, u]`` is added for global query t -> global key u, ``g2l[0][h, t]`` for
    global query t -> every local key, ``g2l[1][h, t]`` for every local query -> global key t."""

    def _init_relative_bias(self, table_rows, heads, num_global):
        self.local_relative_position_bias_table = nn.Parameter(torch.zeros(table_rows, heads))
        trunc_normal_(self.local_relative_position_bias_table, std=0.02)
        if num_global:
            self.g2l_relative_position_bias = nn.Parameter(torch.zeros(2, heads, num_global))
            self.g2g_relative_position_bias = nn.Parameter(torch.zeros(heads, num_global, num_global))
            trunc_normal_(self.g2l_relative_position_bias, std=0.02)
            trunc_normal_(self.g2g_relative_position_bias, std=0.02)

    def _global_query_bias(self, num_local):
        """(heads, G, G + N): the bias of the global queries' scores."""
        g2l = self.g2l_relative_position_bias[0]
        return torch.cat([self.g2g_relative_position_bias, g2l[:, :, None].expand(-1, -1, num_local)], dim=2)


@register_notrace_module  # a leaf for torch.fx: its sizes are data
class FullAttention(_Attention):
    """Multi-head self-attention over all tokens (stages with s0, or ATTN_TYPE full).

    With relative position bias (``rpe``), a ``(2nx-1)(2ny-1) x heads`` table indexed by the row and column
    offsets of a local query and key, plus the global-token biases when there are global tokens. ``nx x ny``
    is the map the table is made for; on a map of another size the table is resized first
    (:func:`vil.models.tables.resize_full_bias_table`).
    """

    def __init__(self, dim, heads, num_global, nx, ny, rpe=False, drop=0.0):
        super().__init__()
        self.heads, self.num_global, self.nx, self.ny = heads, num_global, nx, ny
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        self.rpe = rpe
        if rpe:
            self._init_relative_bias((2 * nx - 1) * (2 * ny - 1), heads, num_global)

    def _bias(self, nx, ny):
        """(heads, G + N, G + N), the relative position bias of every score on an nx x ny map."""
        table = resize_full_bias_table(self.local_relative_position_bias_table, (self.nx, self.ny), (nx, ny))
        local = full_bias(table, nx, ny)
        if not self.num_global:
            return local
        N = local.shape[-1]
        g2l = self.g2l_relative_position_bias[1]  # local query -> global key
        local_rows = torch.cat([g2l[:, None, :].expand(-1, N, -1), local], dim=2)
        return torch.cat([self._global_query_bias(N), local_rows], dim=1)

    def forward(self, x, nx, ny):
        B, N, C = x.shape
        q, k, v = split_heads(self.qkv(x), 3 * self.heads).chunk(3, dim=1)
        bias = self._bias(nx, ny).to(q.dtype)[None] if self.rpe else None
        out = softmax_attention(q, k, v, bias)
        return self.proj_drop(self.proj(merge_heads(out)))


@dataclass(frozen=True)
class LongformerOptions:
    """The options of ViL's local attention (``MODEL.VIT.MSVIT``).

    ``exact`` (SW_EXACT): 0 the 3x3 chunks around the query's chunk, zero padded; -1 the same, wrapping around; 1
    the exact window. ``mode`` (MODE): 0 all 9 chunks, -1 the own chunk, > 0 a random neighbour chunk per training
    forward (1..8, uniformly) and all 9 in evaluation. ``share_w`` (SHARE_W): the global tokens use the local
    tokens' projections. ``only_global`` (ONLY_GLOBAL): local queries attend to the global keys only. ``backend``:
    the :func:`vil.ops.local_attention_2d` backend (None: the fastest for each call).
    """

    exact: int = 0
    mode: int = 0
    share_w: bool = True
    only_global: bool = False
    backend: Optional[str] = None


@register_notrace_module
class LongformerAttention(_Attention):
    """Conv-like local attention on the ``nx x ny`` map with G global tokens.

    Local queries attend, in one softmax, to the global keys and to the keys of their window
    (:func:`vil.ops.local_attention_2d`); global queries attend to all tokens. ``query``/``kv``/``proj`` act on
    local queries, all keys and local outputs; ``query_global``/``kv_global``/``proj_global`` on global
    queries, the global queries' keys and their outputs, and are the same modules when ``share_w``.

    ``window``: the chunk size (SW_EXACT 0, -1) or window radius (SW_EXACT 1); ``rpe``: relative position bias
    instead of none; ``options``: :class:`LongformerOptions`.
    """

    def __init__(self, dim, heads, num_global, window, rpe=False, options=None, drop=0.0):
        super().__init__()
        options = options or LongformerOptions()
        exact, mode, share_w, only_global, backend = astuple(options)
        check_backend(None if only_global else backend, dim // heads, window, exact, mode)
        if only_global and num_global == 0:
            raise ValueError("ONLY_GLOBAL needs global tokens, but a longformer stage has g0; give it g1 or more.")
        self.heads, self.num_global, self.window = heads, num_global, window
        self.exact, self.mode, self.only_global, self.backend = exact, mode, only_global, backend
        self.query = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        if num_global:
            self.query_global = self.query if share_w else nn.Linear(dim, dim)
            self.kv_global = self.kv if share_w else nn.Linear(dim, 2 * dim)
            self.proj_global = self.proj if share_w else nn.Linear(dim, dim)
        self.rpe = rpe
        if rpe:
            self._init_relative_bias(Neighborhood2d(window, exact, mode).bias_rows, heads, num_global)

    def current_mode(self):
        """The neighbour mode of this forward: a fresh random one in training when ``mode > 0``, as a tensor, so
        that torch.compile keeps the draw in its graph."""
        if self.mode > 0:
            return torch.randint(1, 9, ()) if self.training else 0
        return self.mode

    def forward(self, x, nx, ny):
        B, N, C = x.shape
        G, H = self.num_global, self.heads
        x_global, x_local = split_globals(x, G)
        k, v = split_heads(self.kv(x), 2 * H).chunk(2, dim=1)  # (B, H, G + nx*ny, D), globals first
        (k_global, k_local), (v_global, v_local) = split_globals(k, G, dim=2), split_globals(v, G, dim=2)
        q = split_heads(self.query(x_local), H)

        local_bias_g = self.g2l_relative_position_bias[1] if self.rpe and G else None
        if self.only_global:  # no bias: the original release's only_glo branch adds none (its g2l[1] stays unused)
            local_out = softmax_attention(q, k_global, v_global, None)
        else:
            grid = (B, H, nx, ny, C // H)
            local_out = local_attention_2d(
                q.reshape(grid),
                k_local.reshape(grid),
                v_local.reshape(grid),
                self.window,
                exact=self.exact,
                mode=self.current_mode(),
                global_k=k_global,
                global_v=v_global,
                rel_bias=self.local_relative_position_bias_table.t() if self.rpe else None,
                global_bias=local_bias_g,
                backend=self.backend,
            ).reshape(B, H, nx * ny, C // H)
        local_out = self.proj(merge_heads(local_out))
        if not G:
            return self.proj_drop(local_out)

        kv_global = k, v
        if self.kv_global is not self.kv:
            kv_global = split_heads(self.kv_global(x), 2 * H).chunk(2, dim=1)
        q_global = split_heads(self.query_global(x_global), H)
        mask = self._global_query_bias(N - G)[None].to(q.dtype) if self.rpe else None
        global_out = softmax_attention(q_global, *kv_global, mask)
        global_out = self.proj_global(merge_heads(global_out))
        return self.proj_drop(torch.cat([global_out, local_out], dim=1))
