"""The memory-lean path: one row of chunks at a time, scores recomputed in backward.

For chunk row ``r`` the keys and values of chunk rows ``r-1 .. r+1`` (zero padded, or wrapped around for
SW_EXACT -1) are copied into a band and unfolded into the 3x3-chunk window of every chunk of the row
(``torch.nn.functional.unfold``, kernel 3w, stride w); the row's scores, softmax and output follow. The forward
saves only q, k, v, the output and the log-sum-exp; the backward recomputes one row's scores at a time and
sends the window gradients back through the band with autograd (``F.fold``, the unfold's adjoint). So training
memory is the inputs, outputs and gradients plus one row's windows: it grows with tokens x head_dim, not
tokens x window. SW_EXACT 1 uses the same chunks (they hold every exact window) and masks by distance.
"""

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..chunks import unfolded_window_tables


_BLOCK_BYTES = 8 * 2**20  # scores per block: cache-sized, as in the sliding-chunk backend


def _at(t, n):
    return None if t is None else t[n]


@lru_cache(maxsize=16)
def _geometry(rows, cols, window, exact, mode, device):
    """The band geometry and window tables of one map size and window, built once."""
    return _Geometry(rows, cols, window, exact, mode, device)


class _Geometry:
    def __init__(self, rows, cols, window, exact, mode, device):
        self.rows, self.cols, self.w, self.exact = rows, cols, window, exact
        self.mx, self.my = -(-rows // window), -(-cols // window)
        self.allowed, self.bias_index = unfolded_window_tables(rows, cols, window, exact, mode, device)
        ones = torch.ones(1, 1, rows, cols, device=device)
        self.real = [self.windows(self.gather(ones, r), r)[0, :, :, 0] > 0 for r in range(self.mx)]  # (my, 9S) per row

    def blocks(self, batch, heads):
        """(chunk row, slice of batch x heads) to process together: whole batch entries, about 8 MB of scores."""
        row_bytes = heads * self.my * self.w**2 * 9 * self.w**2 * 4
        per_block = max(1, min(batch, _BLOCK_BYTES // row_bytes))
        for r in range(self.mx):
            for b0 in range(0, batch, per_block):
                yield r, slice(b0 * heads, min(batch, b0 + per_block) * heads)

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
        band = gathered * inside.view(1, 1, -1, 1).to(gathered.dtype)
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
        return rows.reshape(x.shape[0], w, self.my, w, -1).permute(0, 2, 1, 3, 4).reshape(x.shape[0], self.my, w * w, -1)

    def put_row(self, out, values, r):
        """Write (N, my, S, C) back into chunk row r of out (N, X, Y, C)."""
        w = self.w
        grid = values.reshape(out.shape[0], self.my, w, w, -1).permute(0, 2, 1, 3, 4).reshape(out.shape[0], w, self.my * w, -1)
        height = min(w, self.rows - r * w)
        out[:, r * w : r * w + height] = grid[:, :height, : self.cols]


def _row_scores(geo, r, queries, keys, gk, rel_bias, global_bias, scale, H):
    """Scores of chunk row r, (N, my, S, G + 9S), -inf where a key is not in the window."""
    N = queries.shape[0]
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # keys: (N, my, 9S, D)
    if rel_bias is not None:
        scores += rel_bias[:, geo.bias_index].repeat(N // H, 1, 1)[:, None]
    valid = geo.allowed[r] & geo.real[r][:, None, :]
    scores = scores.masked_fill(~valid, float("-inf"))
    if gk is None:
        return scores
    g_scores = torch.matmul(queries, gk.transpose(-1, -2)[:, None]) * scale
    if global_bias is not None:
        g_scores += global_bias.repeat(N // H, 1)[:, None, None, :]
    return torch.cat([g_scores, scores], dim=-1)


class _ChunkRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gk, gv, rel_bias, global_bias, geo, scale):
        B, H, X, Y, D = q.shape
        G = 0 if gk is None else gk.shape[2]
        qf, kc, vc, gkf, gvf, rel, glob = _flat(q, k, v, gk, gv, rel_bias, global_bias)
        out = torch.empty_like(qf, dtype=q.dtype)
        lse = torch.empty(B * H, X, Y, 1, dtype=qf.dtype, device=q.device)
        for r, n in geo.blocks(B, H):
            keys = geo.windows(geo.gather(kc[n], r), r)
            scores = _row_scores(geo, r, geo.queries(qf[n], r), keys, _at(gkf, n), rel, glob, scale, H)
            row_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            probs = torch.exp(scores - row_lse)
            row_out = torch.matmul(probs[..., G:], geo.windows(geo.gather(vc[n], r), r))
            if G:
                row_out += torch.matmul(probs[..., :G], gvf[n, None])
            geo.put_row(out[n], row_out, r)
            geo.put_row(lse[n], row_lse, r)
        ctx.save_for_backward(q, k, v, gk, gv, rel_bias, global_bias, out, lse)
        ctx.geo, ctx.scale = geo, scale
        return out.view(B, H, X, Y, D)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, gk, gv, rel_bias, global_bias, out, lse = ctx.saved_tensors
        geo, scale = ctx.geo, ctx.scale
        B, H, X, Y, D = q.shape
        G = 0 if gk is None else gk.shape[2]
        N = B * H
        qf, kc, vc, gkf, gvf, rel, glob = _flat(q, k, v, gk, gv, rel_bias, global_bias)
        dout = grad_out.reshape(N, X, Y, D).to(qf.dtype)
        delta = (dout * out.to(qf.dtype)).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        dk, dv = torch.zeros_like(qf), torch.zeros_like(qf)
        dkc, dvc = dk.permute(0, 3, 1, 2), dv.permute(0, 3, 1, 2)  # (N, D, X, Y) views, as kc and vc
        dgk = None if gk is None else torch.zeros_like(gkf)
        dgv = None if gv is None else torch.zeros_like(gvf)
        d_rel = None if rel_bias is None else torch.zeros(N, *geo.bias_index.shape, dtype=qf.dtype, device=q.device)
        d_glob = None if global_bias is None else torch.zeros(N, G, dtype=qf.dtype, device=q.device)
        for r, n in geo.blocks(B, H):
            queries, row_dout = geo.queries(qf[n], r), geo.queries(dout[n], r)
            row_lse, row_delta = geo.queries(lse[n], r), geo.queries(delta[n], r)
            rows = geo.band_rows(r, q.device)[0]
            with torch.enable_grad():
                # The band's masking, padding and unfold, recorded so that autograd folds window gradients back.
                k_band, v_band = geo.gather(kc[n], r).requires_grad_(), geo.gather(vc[n], r).requires_grad_()
                keys, values = geo.windows(k_band, r), geo.windows(v_band, r)
            scores = _row_scores(geo, r, queries, keys.detach(), _at(gkf, n), rel, glob, scale, H)
            probs = torch.exp(scores - row_lse)
            d_probs = torch.matmul(row_dout, values.detach().transpose(-1, -2))
            if G:
                d_probs = torch.cat([torch.matmul(row_dout, gvf[n].transpose(-1, -2)[:, None]), d_probs], dim=-1)
            d_scores = probs * (d_probs - row_delta)
            local = d_scores[..., G:]
            row_dq = torch.matmul(local, keys.detach()) * scale
            d_keys = torch.matmul(local.transpose(-1, -2), queries) * scale
            d_values = torch.matmul(probs[..., G:].transpose(-1, -2), row_dout)
            dk_band, dv_band = torch.autograd.grad((keys, values), (k_band, v_band), (d_keys, d_values))
            dkc[n].index_add_(2, rows, dk_band)
            dvc[n].index_add_(2, rows, dv_band)
            if G:
                d_global_scores = d_scores[..., :G]
                row_dq += torch.matmul(d_global_scores, gkf[n, None]) * scale
                dgk[n] += torch.einsum("nmsg,nmsd->ngd", d_global_scores, queries) * scale
                dgv[n] += torch.einsum("nmsg,nmsd->ngd", probs[..., :G], row_dout)
                if d_glob is not None:
                    d_glob[n] += d_global_scores.sum((1, 2))
            if d_rel is not None:
                d_rel[n] += local.sum(1)
            geo.put_row(dq[n], row_dq, r)
        grads = [dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), None, None, None, None]
        if G:
            grads[3], grads[4] = dgk.view(gk.shape), dgv.view(gv.shape)
        if d_rel is not None:
            per_head = d_rel.view(B, H, -1).sum(0)  # (H, S * 9S)
            grads[5] = torch.zeros_like(rel).index_add_(1, geo.bias_index.flatten(), per_head)
        if d_glob is not None:
            grads[6] = d_glob.view(B, H, G).sum(0)
        dtypes = (q.dtype, k.dtype, v.dtype, *(None if t is None else t.dtype for t in (gk, gv, rel_bias, global_bias)))
        return (*(None if g is None else g.to(dt) for g, dt in zip(grads, dtypes)), None, None)


def _flat(q, k, v, gk, gv, rel_bias, global_bias):
    """Batch and heads merged, half precision widened to float32; k and v as (N, D, X, Y) for the unfold."""
    B, H, X, Y, D = q.shape
    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qf = q.reshape(B * H, X, Y, D).to(dtype)
    kc, vc = (t.reshape(B * H, X, Y, D).to(dtype).permute(0, 3, 1, 2) for t in (k, v))
    gkf, gvf = (None if t is None else t.reshape(B * H, -1, D).to(dtype) for t in (gk, gv))
    rel, glob = (None if t is None else t.to(dtype) for t in (rel_bias, global_bias))
    return qf, kc, vc, gkf, gvf, rel, glob


def chunk_rows(q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale):
    geo = _geometry(q.shape[2], q.shape[3], window, exact, mode, q.device)
    return _ChunkRows.apply(q, k, v, global_k, global_v, rel_bias, global_bias, geo, scale)
