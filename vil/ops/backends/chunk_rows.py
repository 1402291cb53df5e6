"""The memory-lean path: one row of chunks at a time, scores recomputed in backward.

For chunk row ``r`` the keys and values of chunk rows ``r-1 .. r+1`` (zero padded, or wrapped around for
SW_EXACT -1) are copied into a band and unfolded into the 3x3-chunk window of every chunk of the row
(``torch.nn.functional.unfold``, kernel 3w, stride w); the row's scores, softmax and output follow. The forward
saves only q, k, v and the log-sum-exp; the backward recomputes one row's scores at a time, takes the softmax's row
term from them (in float32 or wider, not from the output rounded to q's dtype) and sends the window gradients back
through the band with autograd (``F.fold``, the unfold's adjoint). So training memory is the inputs, outputs and
gradients plus one row's windows: it grows with tokens x head_dim, not tokens x window. SW_EXACT 1 uses the same
chunks (they hold every exact window) and masks by distance.
"""

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..base import Backend, compute_dtype, kept_tables, safe_max
from ..geometry import unfolded_window_tables

# Scores per block. A block's working memory is a few times this (scores, probabilities, their gradients,
# the unfolded windows), which is all the memory this backend needs beyond its inputs, outputs and gradients.
_BLOCK_BYTES = 2**20


@kept_tables(16)
def _geometry(rows, cols, window, exact, mode, device):
    """The band geometry and window tables of one map size and window, built once."""
    return _Geometry(rows, cols, window, exact, mode, device)


class _Geometry:
    def __init__(self, rows, cols, window, exact, mode, device):
        self.rows, self.cols, self.w, self.exact = rows, cols, window, exact
        self.mx, self.my = -(-rows // window), -(-cols // window)
        self.allowed, self.bias_index = unfolded_window_tables(rows, cols, window, exact, mode, device)
        ones = torch.ones(1, 1, rows, cols, device=device)
        real = [self.windows(self.gather(ones, r), r)[0, :, :, 0] > 0 for r in range(self.mx)]  # (my, 9S) per row
        # Per chunk row, (my, S or 1, 9S): where a query may not see a window key.
        self.hidden = [~(self.allowed[r] & real[r][:, None, :]) for r in range(self.mx)]

    def blocks(self, batch, heads):
        """(chunk row, batch entry, slice of heads) to process together: about ``_BLOCK_BYTES`` of scores."""
        row_bytes = self.my * self.w**2 * 9 * self.w**2 * 4
        per_block = max(1, min(heads, _BLOCK_BYTES // row_bytes))
        for r in range(self.mx):
            for b in range(batch):
                for start in range(0, heads, per_block):
                    yield r, b, slice(start, min(heads, start + per_block))

    def band_rows(self, r, device):
        """Map rows of chunk rows r-1..r+1 (wrapped around for SW_EXACT -1; clamped where outside the map) and
        whether each is inside the map."""
        w = self.w
        rows = torch.arange((r - 1) * w, (r + 2) * w, device=device)
        if self.exact == -1:
            rows = rows % (self.mx * w)
        return rows.clamp(0, self.rows - 1), (rows >= 0) & (rows < self.rows)

    def windows(self, gathered, r):
        """Rows of ``band_rows(r)``, (N, C, 3w, Y) -> (N, my, 9S, C): the 3x3-chunk window of every chunk of
        row r, after zeroing the rows outside the map and padding one chunk column on either side."""
        w = self.w
        inside = self.band_rows(r, gathered.device)[1]
        band = gathered if bool(inside.all()) else gathered * inside.view(1, 1, -1, 1).to(gathered.dtype)
        band = F.pad(band, (0, self.my * w - self.cols))
        band = F.pad(band, (w, w, 0, 0), mode="circular" if self.exact == -1 else "constant")
        unfolded = F.unfold(band, 3 * w, stride=w)  # (N, C * 9S, my)
        return unfolded.view(gathered.shape[0], gathered.shape[1], 9 * w * w, self.my).permute(0, 3, 2, 1)

    def gather(self, x, r):
        """(N, C, X, Y) -> the rows of ``band_rows(r)``, (N, C, 3w, Y)."""
        return x.index_select(2, self.band_rows(r, x.device)[0])

    def queries(self, x, r):
        """(N, X, Y, C) -> (N, my, S, C): the tokens of chunk row r, zero padded."""
        w = self.w
        rows = x[:, r * w : (r + 1) * w]
        rows = F.pad(rows, (0, 0, 0, self.my * w - self.cols, 0, w - rows.shape[1]))
        return (
            rows.reshape(x.shape[0], w, self.my, w, -1).permute(0, 2, 1, 3, 4).reshape(x.shape[0], self.my, w * w, -1)
        )

    def put_row(self, out, values, r):
        """Write (N, my, S, C) back into chunk row r of out (N, X, Y, C)."""
        w = self.w
        grid = (
            values.reshape(out.shape[0], self.my, w, w, -1)
            .permute(0, 2, 1, 3, 4)
            .reshape(out.shape[0], w, self.my * w, -1)
        )
        height = min(w, self.rows - r * w)
        out[:, r * w : r * w + height] = grid[:, :height, : self.cols]


def _row_scores(geo, r, queries, keys, global_k, rel_bias, global_bias, scale):
    """Scores of chunk row r, (n, my, S, G + 9S), -inf where a key is not in the window. ``rel_bias``
    (n, S, 9S) and ``global_bias`` (n, G) are those of the block's entries."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)  # keys: (n, my, 9S, D)
    if rel_bias is not None:
        scores += rel_bias[:, None]
    scores.masked_fill_(geo.hidden[r], float("-inf"))
    if global_k is None:
        return scores
    g_scores = torch.matmul(queries, global_k.transpose(-1, -2)[:, None]) * scale
    if global_bias is not None:
        g_scores += global_bias[:, None, None, :]
    return torch.cat([g_scores, scores], dim=-1)


class _ChunkRows(torch.autograd.Function):
    """Inputs stay as they are (any strides, any float dtype): each block reads its slice and computes in
    float32 or wider, so no whole-size copy of q, k or v is made. ``tensors``: q, k, v and the extras' global keys,
    global values, relative and global bias (None where absent)."""

    @staticmethod
    def forward(ctx, geo, scale, *tensors):
        q, k, v, global_k, global_v, rel_bias, global_bias = tensors
        B, H, X, Y, D = q.shape
        G = 0 if global_k is None else global_k.shape[2]
        dtype = compute_dtype(q)
        kc, vc = k.permute(0, 1, 4, 2, 3), v.permute(0, 1, 4, 2, 3)  # (B, H, D, X, Y) views, for the unfold
        out = q.new_empty(q.shape)
        lse = torch.empty(B, H, X, Y, 1, dtype=dtype, device=q.device)
        for r, b, h in geo.blocks(B, H):
            keys = geo.windows(geo.gather(kc[b, h].to(dtype), r), r)
            scores = _row_scores(
                geo,
                r,
                geo.queries(q[b, h].to(dtype), r),
                keys,
                _part(global_k, (b, h), dtype),
                _bias_rows(rel_bias, h, geo, dtype),
                _part(global_bias, h, dtype),
                scale,
            )
            # Normalised by the sum, not by exp(scores - logsumexp): where every score is about -1e8 or below, the
            # log-sum-exp rounds to the maximum and the probabilities would each come out 1.
            row_max = safe_max(scores.amax(dim=-1, keepdim=True))  # 0 where no key: probabilities 0
            weights = torch.exp(scores - row_max)
            total = weights.sum(dim=-1, keepdim=True)
            probs = weights / total.clamp_min(1.0)  # at least 1 (the maximum's own term) where a key is seen
            row_lse = torch.where(total > 0, row_max + total.log(), float("inf"))  # +inf: sees no key
            row_out = torch.matmul(probs[..., G:], geo.windows(geo.gather(vc[b, h].to(dtype), r), r))
            if G:
                row_out += torch.matmul(probs[..., :G], global_v[b, h, None].to(dtype))
            geo.put_row(out[b, h], row_out, r)
            geo.put_row(lse[b, h], row_lse, r)
        ctx.save_for_backward(q, k, v, global_k, global_v, rel_bias, global_bias, lse)
        ctx.geo, ctx.scale = geo, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, global_k, global_v, rel_bias, global_bias, lse = ctx.saved_tensors
        geo, scale = ctx.geo, ctx.scale
        B, H, X, Y, D = q.shape
        G = 0 if global_k is None else global_k.shape[2]
        dtype = compute_dtype(q)
        kc, vc = k.permute(0, 1, 4, 2, 3), v.permute(0, 1, 4, 2, 3)
        grad_q = q.new_empty(q.shape)  # written once per chunk row
        # dK and dV gather up to three band contributions per token: summed in the compute dtype.
        grad_k, grad_v = (torch.zeros(q.shape, dtype=dtype, device=q.device) for _ in range(2))
        dkc, dvc = grad_k.permute(0, 1, 4, 2, 3), grad_v.permute(0, 1, 4, 2, 3)
        grad_global_k = None if global_k is None else torch.zeros(global_k.shape, dtype=dtype, device=q.device)
        grad_global_v = None if global_v is None else torch.zeros(global_v.shape, dtype=dtype, device=q.device)
        d_rel = None if rel_bias is None else torch.zeros(H, geo.bias_index.numel(), dtype=dtype, device=q.device)
        grad_global_bias = None if global_bias is None else torch.zeros(H, G, dtype=dtype, device=q.device)
        for r, b, h in geo.blocks(B, H):
            queries, row_dout = geo.queries(q[b, h].to(dtype), r), geo.queries(grad_out[b, h].to(dtype), r)
            row_lse = geo.queries(lse[b, h], r)
            rows = geo.band_rows(r, q.device)[0]
            with torch.enable_grad():
                # The band's masking, padding and unfold, recorded so that autograd folds window gradients back.
                k_band = geo.gather(kc[b, h].to(dtype), r).requires_grad_()
                v_band = geo.gather(vc[b, h].to(dtype), r).requires_grad_()
                keys, values = geo.windows(k_band, r), geo.windows(v_band, r)
            head_global_k = _part(global_k, (b, h), dtype)
            scores = _row_scores(
                geo,
                r,
                queries,
                keys.detach(),
                head_global_k,
                _bias_rows(rel_bias, h, geo, dtype),
                _part(global_bias, h, dtype),
                scale,
            )
            probs = torch.exp(scores - row_lse)
            d_probs = torch.matmul(row_dout, values.detach().transpose(-1, -2))
            if G:
                head_global_v = global_v[b, h].to(dtype)
                d_probs = torch.cat([torch.matmul(row_dout, head_global_v.transpose(-1, -2)[:, None]), d_probs], dim=-1)
            # The softmax backward's row term sum_j P_ij dP_ij, from the rows in the compute dtype: rowsum(dO * O)
            # from the output rounded to a half type leaves each row of dS summing to that rounding error.
            row_delta = (probs * d_probs).sum(-1, keepdim=True)
            d_scores = probs * (d_probs - row_delta)
            local = d_scores[..., G:]
            row_dq = torch.matmul(local, keys.detach()) * scale
            d_keys = torch.matmul(local.transpose(-1, -2), queries) * scale
            d_values = torch.matmul(probs[..., G:].transpose(-1, -2), row_dout)
            dk_band, dv_band = torch.autograd.grad((keys, values), (k_band, v_band), (d_keys, d_values))
            dkc[b, h].index_add_(2, rows, dk_band)
            dvc[b, h].index_add_(2, rows, dv_band)
            if G:
                d_global_scores = d_scores[..., :G]
                row_dq += torch.matmul(d_global_scores, head_global_k[:, None]) * scale
                grad_global_k[b, h] += torch.einsum("nmsg,nmsd->ngd", d_global_scores, queries) * scale
                grad_global_v[b, h] += torch.einsum("nmsg,nmsd->ngd", probs[..., :G], row_dout)
                if grad_global_bias is not None:
                    grad_global_bias[h] += d_global_scores.sum((1, 2))
            if d_rel is not None:
                d_rel[h] += local.sum(1).flatten(1)
            geo.put_row(grad_q[b, h], row_dq, r)
        grad_rel_bias = None
        if d_rel is not None:
            grad_rel_bias = torch.zeros(rel_bias.shape, dtype=dtype, device=q.device).index_add_(
                1, geo.bias_index.flatten(), d_rel
            )
        grads = (grad_q, grad_k, grad_v, grad_global_k, grad_global_v, grad_rel_bias, grad_global_bias)
        inputs = (q, k, v, global_k, global_v, rel_bias, global_bias)
        return (None, None, *(None if g is None else g.to(t.dtype) for g, t in zip(grads, inputs)))


def _part(t, index, dtype):
    """``t[index]`` in the compute dtype; None for None."""
    return None if t is None else t[index].to(dtype)


def _bias_rows(rel_bias, h, geo, dtype):
    """The relative bias of every (query, window key) of a chunk, for heads ``h``: (h, S, 9S)."""
    return None if rel_bias is None else rel_bias[h][:, geo.bias_index].to(dtype)


def attention_2d(q, k, v, hood, extras):
    geo = _geometry(q.shape[2], q.shape[3], hood.window, hood.exact, hood.mode, q.device)
    return _ChunkRows.apply(geo, extras.scale, q, k, v, *extras.differentiable)


BACKEND = Backend(
    "chunk_rows",
    attention_2d=attention_2d,
    dilation_2d="split",
    twice_differentiable=False,
    function_transforms=False,
    vmap=False,
)
