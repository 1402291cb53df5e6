"""Sliding chunks with a hand-written backward that saves only the inputs, the output and one
log-sum-exp per query.

Both passes walk over blocks of (batch, chunks) whose score matrices stay near ``BLOCK_BYTES``: on the CPU
the working set then stays in cache and in memory the allocator reuses, which is several times faster
than one huge batched product; the peak memory of attention is one block, whatever the map size.

The softmax is written out: the forward normalises the ``S x D`` output rather than the ``L x S``
probabilities and keeps the log-sum-exp. The 2D backward appends a column to its operands (ones to the
keys and values, ``-lse`` to the queries, ``-rowsum(dO * O)`` to the output gradient), so that one
product gives ``scores - lse``, whose ``exp2`` is the probabilities, and one gives ``dP - rowsum(P * dP)``,
the softmax backward's bracket; the 1D backward subtracts ``lse`` and ``rowsum(dO * O)`` from its products
instead. The G global keys are a separate small product in the same softmax, so the large products see only
the local keys.

Scores are computed in base 2 (queries and biases times log2(e), ``exp2`` for ``exp``): on the CPU
``torch.exp`` goes through MKL's vector math, whose speed depends on the data (-inf entries make it
2x, underflowing ones 4x slower), while ``torch.exp2`` is a plain vectorised kernel.
"""

import torch
import torch.nn.functional as F

from ..base import LOG2E, Backend, FusedPasses, in_float32_or_wider, items_per_block, safe_max
from ..geometry import band_block_tables, chunk_plan
from .band_blocks import (
    band_blocks,
    band_global_scores,
    band_masks,
    band_scores,
    band_windows,
    scatter_band_windows_,
)
from .chunk_windows import (
    add_rel_bias_grad_,
    from_chunks,
    gather_windows,
    global_scores,
    scatter_windows_,
    to_chunks,
    window_bias,
    window_scores,
)


def _blocks(x, plan):
    """(group, batch slice, chunk slice within the group, the same chunks in ``x``) covering ``x (B, C, H, S, D)``
    group by group; every block is a contiguous slice of ``x``."""
    B, _, H, S = x.shape[:4]
    for group in plan.groups:
        C = group.num_chunks
        per_chunk = H * S * group.window_len * x.element_size()
        chunks_per_block = min(C, items_per_block(per_chunk, x.device))
        chunks_per_block = -(-C // -(-C // chunks_per_block))  # even blocks: no small remainder
        batch_per_block = items_per_block(per_chunk * C, x.device) if chunks_per_block == C else 1
        batch_per_block = -(-B // -(-B // batch_per_block))
        for b in range(0, B, batch_per_block):
            for c in range(0, C, chunks_per_block):
                stop = min(C, c + chunks_per_block)
                yield (
                    group,
                    slice(b, min(B, b + batch_per_block)),
                    slice(c, stop),
                    slice(group.start + c, group.start + stop),
                )


def _row_max(scores, group):
    """``scores (..., L, S)`` -> ``(..., 1, S)``, the max over the keys. Reduced over the slots first: a
    reduction over dim -2 of rows only S long is several times slower than one over (n, S*S)."""
    per_slot = scores.unflatten(-2, (group.num_slots, -1)).amax(-3)
    return per_slot.amax(-2, keepdim=True)


def _base2(bias):
    return None if bias is None else bias * LOG2E


def _plan(q, hood):
    return chunk_plan(q.shape[2], q.shape[3], hood.window, hood.exact, hood.mode, q.device)


def _forward_2d(q, k, v, hood, extras):
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    scale = extras.scale
    plan = _plan(q, hood)
    queries = to_chunks(q * (scale * LOG2E), plan)
    keys, values = to_chunks(k, plan), to_chunks(v, plan)
    biases = {group: window_bias(group, _base2(rel_bias), q.dtype) for group in plan.groups}
    global_bias2 = _base2(global_bias)
    out = torch.empty_like(queries)
    lse = queries.new_empty(queries.shape[:-1])  # base 2
    for group, b, c, cx in _blocks(queries, plan):
        block_queries = queries[b, cx]
        scores = window_scores(block_queries, gather_windows(keys, group, b, c), group, biases[group], c)
        row_max = _row_max(scores, group)
        if global_k is not None:
            scores_g = global_scores(block_queries, global_k[b], global_bias2)
            row_max = torch.maximum(row_max, scores_g.amax(-2, keepdim=True))
        row_max = safe_max(row_max)
        weights = scores.sub_(row_max).exp2_()  # unnormalised probabilities, in place
        total = weights.sum(-2, keepdim=True)
        block_out = torch.matmul(weights.transpose(-1, -2), gather_windows(values, group, b, c), out=out[b, cx])
        if global_k is not None:
            weights_g = scores_g.sub_(row_max).exp2_()
            total += weights_g.sum(-2, keepdim=True)
            block_out += torch.matmul(weights_g.transpose(-1, -2), global_v[b, None])
        block_out /= total.transpose(-1, -2).clamp(min=torch.finfo(total.dtype).tiny)
        lse[b, cx] = torch.where(total > 0, row_max + total.log2(), float("inf")).squeeze(-2)  # +inf: sees no key
    return from_chunks(out, plan), from_chunks(lse[..., None], plan)[..., 0]


def _backward_2d(q, k, v, hood, extras, out, lse, grad_out):
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    scale = extras.scale
    plan = _plan(q, hood)
    out, lse = to_chunks(out, plan), to_chunks(lse[..., None], plan)[..., 0]
    # The extra columns of the module docstring: two passes over each block's scores fewer.
    keys, values = to_chunks(k, plan, extra_column=1.0), to_chunks(v, plan, extra_column=1.0)
    queries_lse = to_chunks(q * (scale * LOG2E), plan, extra_column=0.0)
    queries_lse[..., -1] = -lse
    grad_outc_row = to_chunks(grad_out, plan, extra_column=0.0)
    queries, grad_outc = queries_lse[..., :-1], grad_outc_row[..., :-1]
    # The softmax backward's row term sum_j P_ij dP_ij equals dO_i . O_i.
    row_term = (grad_outc * out).sum(-1)
    grad_outc_row[..., -1] = -row_term
    biases = {group: window_bias(group, _base2(rel_bias), q.dtype) for group in plan.groups}
    global_bias2 = _base2(global_bias)
    grad_queries = torch.empty_like(out)
    grad_keys, grad_values = torch.zeros_like(out), torch.zeros_like(out)
    grad_rel_bias = None if rel_bias is None else torch.zeros_like(rel_bias)
    grad_global_bias = None if global_bias is None else torch.zeros_like(global_bias)
    grad_global_k = grad_global_v = None
    if global_k is not None:
        grad_global_k, grad_global_v = torch.zeros_like(global_k), torch.zeros_like(global_v)

    for group, b, c, cx in _blocks(queries, plan):
        block_keys, block_values = gather_windows(keys, group, b, c), gather_windows(values, group, b, c)
        block_queries2, block_grad_out = queries[b, cx], grad_outc[b, cx]
        block_queries = block_queries2 / LOG2E  # scale * q: the gradients are those of the natural scores
        block_lse, block_row_term = lse[b, cx, :, None], row_term[b, cx, :, None]
        probs = window_scores(queries_lse[b, cx], block_keys, group, biases[group], c).exp2_()
        scatter_windows_(grad_values, torch.matmul(probs, block_grad_out), group, b, c)
        grad_scores = torch.matmul(block_values, grad_outc_row[b, cx].transpose(-1, -2)).mul_(probs)
        del probs
        block_grad_q = torch.matmul(grad_scores.transpose(-1, -2), block_keys[..., :-1], out=grad_queries[b, cx])
        scatter_windows_(grad_keys, torch.matmul(grad_scores, block_queries), group, b, c)
        if rel_bias is not None:
            add_rel_bias_grad_(grad_rel_bias, grad_scores, group, c)
        if global_k is not None:
            probs_g = global_scores(block_queries2, global_k[b], global_bias2).sub_(block_lse).exp2_()
            grad_global_v[b] += torch.matmul(probs_g, block_grad_out).sum(1)
            grad_scores_g = torch.matmul(global_v[b, None], block_grad_out.transpose(-1, -2))
            grad_scores_g.sub_(block_row_term).mul_(probs_g)
            block_grad_q += torch.matmul(grad_scores_g.transpose(-1, -2), global_k[b, None])
            grad_global_k[b] += torch.matmul(grad_scores_g, block_queries).sum(1)
            if global_bias is not None:
                grad_global_bias += grad_scores_g.sum(dim=(0, 1, 4))
        block_grad_q *= scale

    grad_k, grad_v = from_chunks(grad_keys, plan), from_chunks(grad_values, plan)
    return (
        from_chunks(grad_queries, plan),
        grad_k,
        grad_v,
        grad_global_k,
        grad_global_v,
        grad_rel_bias,
        grad_global_bias,
    )


def _scored_pairs(q, hood, num_global):
    """The (query, key) scores per batch item: in every head, every query position of a chunk (padding included)
    against its group's window keys and the global keys. (The op runs dilated windows per sub-lattice: the
    dilation is 1.)"""
    pairs = sum(g.num_chunks * hood.window**2 * (g.window_len + num_global) for g in _plan(q, hood).groups)
    return q.shape[1] * pairs


# --- 1D: Longformer's band over a sequence ---------------------------------------------------------------------
#
# The sequence is cut into blocks of w queries; the band of a block lies in the 3w keys of the blocks before, at
# and after it (``band_block_tables``). The keys and values are padded by one block in front and enough blocks
# behind, so that block m's window is padded blocks m..m+2; a position is a key where ``key_ok`` (inside the
# sequence and not masked by the key padding mask).


def _band_block_ranges(q, window, blocks):
    """Ranges of query blocks whose scores stay near ``BLOCK_BYTES``."""
    B, H = q.shape[:2]
    step = items_per_block(B * H * window * 3 * window * 4, q.device)
    for start in range(0, blocks, step):
        yield start, min(blocks, start + step)


def _forward_1d(q, k, v, hood, extras):
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    B, H, L, D = q.shape
    w, blocks = hood.window, -(-L // hood.window)
    queries = band_blocks(q * (extras.scale * LOG2E), w, blocks)
    keys, values = band_blocks(k, w, blocks), band_blocks(v, w, blocks)
    masks = _band_masks(q, hood, extras, blocks)
    global_bias2 = _base2(global_bias)
    out = q.new_empty(B, H, blocks, w, D)
    lse = q.new_empty(B, H, blocks, w)  # base 2; +inf where a query sees no key
    for start, stop in _band_block_ranges(q, w, blocks):
        block_queries = queries[:, :, start + 1 : stop + 1]
        scores = band_scores(block_queries, band_windows(keys, start, stop, 3), masks, start, stop)
        row_max = scores.amax(-1, keepdim=True)
        if global_k is not None:
            scores_g = band_global_scores(block_queries, global_k, global_bias2)
            row_max = torch.maximum(row_max, scores_g.amax(-1, keepdim=True))
        row_max = safe_max(row_max)
        weights = scores.sub_(row_max).exp2_()
        total = weights.sum(-1, keepdim=True)
        block_out = torch.matmul(weights, band_windows(values, start, stop, 3))
        if global_k is not None:
            weights_g = scores_g.sub_(row_max).exp2_()
            total += weights_g.sum(-1, keepdim=True)
            block_out += torch.matmul(weights_g, global_v[:, :, None])
        out[:, :, start:stop] = block_out / total.clamp(min=torch.finfo(total.dtype).tiny)
        lse[:, :, start:stop] = torch.where(total > 0, row_max + total.log2(), float("inf")).squeeze(-1)
    return out.flatten(2, 3)[:, :, :L], lse.flatten(2)[:, :, :L]


def _backward_1d(q, k, v, hood, extras, out, lse, grad_out):
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    w, scale = hood.window, extras.scale
    B, H, L, D = q.shape
    blocks = -(-L // w)
    lse = F.pad(lse, (0, blocks * w - L)).unflatten(2, (blocks, w))
    queries = band_blocks(q * scale, w, blocks)  # natural-scale queries; base 2 below where scores are made
    keys, values = band_blocks(k, w, blocks), band_blocks(v, w, blocks)
    grad_outb = band_blocks(grad_out, w, blocks)
    row_term = band_blocks((grad_out * out).sum(-1, keepdim=True), w, blocks)[..., 0]  # rowsum(dO * O)
    masks = _band_masks(q, hood, extras, blocks)
    global_bias2 = _base2(global_bias)
    grad_q = q.new_empty(B, H, blocks, w, D)
    grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
    grad_bias = None if rel_bias is None else q.new_zeros(H, w, 3 * w)
    grad_global_k = grad_global_v = grad_global_bias = None
    if global_k is not None:
        grad_global_k, grad_global_v = torch.zeros_like(global_k), torch.zeros_like(global_v)
        grad_global_bias = None if global_bias is None else torch.zeros_like(global_bias)
    for start, stop in _band_block_ranges(q, w, blocks):
        block_queries = queries[:, :, start + 1 : stop + 1]
        block_keys, block_values = band_windows(keys, start, stop, 3), band_windows(values, start, stop, 3)
        block_grad_out = grad_outb[:, :, start + 1 : stop + 1]
        block_lse, block_row_term = lse[:, :, start:stop, :, None], row_term[:, :, start + 1 : stop + 1, :, None]
        probs = band_scores(block_queries * LOG2E, block_keys, masks, start, stop).sub_(block_lse).exp2_()
        scatter_band_windows_(grad_values, torch.matmul(probs.transpose(-1, -2), block_grad_out), start, stop)
        grad_scores = torch.matmul(block_grad_out, block_values.transpose(-1, -2)).sub_(block_row_term).mul_(probs)
        del probs
        block_grad_q = torch.matmul(grad_scores, block_keys)
        scatter_band_windows_(grad_keys, torch.matmul(grad_scores.transpose(-1, -2), block_queries), start, stop)
        if grad_bias is not None:
            grad_bias += grad_scores.sum((0, 2))
        if global_k is not None:
            probs_g = band_global_scores(block_queries * LOG2E, global_k, global_bias2).sub_(block_lse).exp2_()
            grad_global_v += torch.matmul(probs_g.transpose(-1, -2), block_grad_out).sum(2)
            grad_scores_g = torch.matmul(block_grad_out, global_v[:, :, None].transpose(-1, -2))
            grad_scores_g.sub_(block_row_term).mul_(probs_g)
            block_grad_q += torch.matmul(grad_scores_g, global_k[:, :, None])
            grad_global_k += torch.matmul(grad_scores_g.transpose(-1, -2), block_queries).sum(2)
            if grad_global_bias is not None:
                grad_global_bias += grad_scores_g.sum((0, 2, 3))
        grad_q[:, :, start:stop] = block_grad_q * scale
    grad_rel_bias = None
    if grad_bias is not None:
        row = band_block_tables(w, hood.causal, q.device)[1]
        grad_rel_bias = torch.zeros_like(rel_bias).index_add_(1, row.flatten(), grad_bias.flatten(1))
    grad_k, grad_v = (x.flatten(2, 3)[:, :, w : w + L] for x in (grad_keys, grad_values))  # less the padding
    return grad_q.flatten(2, 3)[:, :, :L], grad_k, grad_v, grad_global_k, grad_global_v, grad_rel_bias, grad_global_bias


def _band_masks(q, hood, extras, blocks):
    B, _, L = q.shape[:3]
    allowed, bias_row = band_block_tables(hood.window, hood.causal, q.device)
    return band_masks(allowed, bias_row, _base2(extras.rel_bias), extras.key_padding_mask, B, L, hood.window, blocks)


def _scored_pairs_1d(q, hood, num_global):
    """The (query, key) scores per batch item: every query position of a block of w (padding included) against
    the 3w keys of its window and the global keys, in every head."""
    H, L = q.shape[1:3]
    w = hood.window
    return H * -(-L // w) * w * (3 * w + num_global)


# Half precision is computed in float32: the backward recomputes probabilities from a saved log-sum-exp, which must
# be exact.
BACKEND = Backend(
    "sliding_chunk",
    passes_2d=FusedPasses(_forward_2d, _backward_2d, _scored_pairs),
    passes_1d=FusedPasses(_forward_1d, _backward_1d, _scored_pairs_1d),
    prepare=in_float32_or_wider,
    extras_in_float32=True,
    twice_differentiable=False,
    function_transforms=False,
    dilation_2d="split",
    dilation_1d="split",
)
