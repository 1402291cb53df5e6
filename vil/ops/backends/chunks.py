"""Longformer-chunks: the sequence cut into overlapping chunks of 2w positions (overlap w), one matrix product per
chunk, the scores outside the band masked, and a hand-written backward that saves only the inputs, the output
and one log-sum-exp per query.

Chunk ``c`` holds the positions ``(c-1)w .. (c+1)w - 1`` (padded blocks ``c`` and ``c + 1``, see
``band_blocks.py``), and its ``2w x 2w`` product scores every pair inside it. Query block ``m`` is the first
half of chunk ``m + 1``, where it takes its keys at offsets ``0..w``, and the second half of chunk ``m``, where it
takes those at ``-w..-1`` (``geometry.band_chunk_tables``). A chunk scores ``4w`` keys per query where the band
has ``2w + 1``: the chunk layout pays twice the scores of the band for one dense product, as the Longformer paper
says of its chunks (and a third more than sliding_chunk's ``3w``). The first and last chunks hold queries in one
half only; they score that half alone.

The softmax of a query spans its two chunk rows and the global keys. The forward keeps a running maximum, sum of
exponentials and unnormalised output per query and merges each chunk row into it, so the chunks run in groups
whose scores stay near ``BLOCK_BYTES``, as in sliding_chunk. With the log-sum-exp known, the backward's chunks are
independent. Scores are in base 2 (see sliding_chunk). The backward appends a column to its operands (``-lse`` to the
queries and ones to the keys, ``-rowsum(dO * O)`` to the output gradient and ones to the values), so that its two
score products give ``scores - lse`` and ``dP - rowsum(P * dP)`` without a pass of their own over the scores.
Undilated windows only, as the paper's chunks.
"""

import torch
from torch.autograd.function import once_differentiable

from ..base import LOG2E, Backend, in_float32_or_wider, items_per_block, safe_max
from ..geometry import band_chunk_tables
from .band_blocks import (
    band_blocks,
    band_global_scores,
    band_masks,
    band_scores,
    band_windows,
    scatter_band_windows_,
)

SPAN = 2  # padded blocks per chunk


def _chunk_groups(q, window, blocks):
    """``(start, stop, halves)``: groups of chunks start..stop-1 and the halves of them that hold queries. The
    middle chunks run in groups whose scores stay near ``BLOCK_BYTES``, with both halves; chunk 0 holds queries in
    its second half only and chunk ``blocks`` in its first half only (the other halves are padding), so they run
    alone, with the half that counts."""
    B, H = q.shape[:2]
    step = items_per_block(B * H * (SPAN * window) ** 2 * q.element_size(), q.device)
    yield 0, 1, range(1, 2)
    for start in range(1, blocks, step):
        yield start, min(blocks, start + step), range(0, 2)
    yield blocks, blocks + 1, range(0, 1)


def _chunk_masks(rel_bias, key_padding_mask, B, L, window, blocks, causal, device):
    """The chunk's band table with the base-2 bias, and the hidden keys (``band_blocks.band_masks``)."""
    allowed, bias_row = band_chunk_tables(window, causal, device)
    rel_bias2 = None if rel_bias is None else rel_bias * LOG2E
    return band_masks(allowed, bias_row, rel_bias2, key_padding_mask, B, L, window, blocks)


def _merge_(state, rows, part_max, part_sum, part_out):
    """Adds one part of the softmax of the query rows ``rows`` (a slice of padded blocks) to the running
    ``state = (maximum, sum, output)``, in place: the part's sum and output are taken against its own maximum (0
    where that is -inf), and both sides are rescaled to the larger maximum."""
    run_max, run_sum, run_out = (x[:, :, rows] for x in state)
    new_max = torch.maximum(run_max, part_max)
    top = safe_max(new_max)
    old, new = (run_max - top).exp2_(), (part_max - top).exp2_()  # 0 for a side that sees no key yet
    run_sum.mul_(old).add_(part_sum * new)
    run_out.mul_(old[..., None]).add_(part_out * new[..., None])
    run_max.copy_(new_max)


class ChunksAttention1d(torch.autograd.Function):
    """``tensors``: q, k, v, the global keys and values, the relative and global bias and the key padding mask
    (None where absent)."""

    @staticmethod
    def forward(ctx, hood, scale, *tensors):
        q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask = tensors
        window, causal = hood.window, hood.causal
        B, H, L, D = q.shape
        w, blocks = window, -(-L // window)
        masks = _chunk_masks(rel_bias, key_padding_mask, B, L, w, blocks, causal, q.device)
        # Padded copies; the queries scaled in place (large inputs: every new tensor costs page faults).
        queries_b, keys_b, values_b = (band_blocks(x, w, blocks) for x in (q, k, v))
        queries = queries_b.mul_(scale * LOG2E).flatten(2, 3)[:, :, w : w + L]
        # The running softmax of every query row (padded blocks): maximum, sum of exponentials, unnormalised output.
        state = [
            q.new_full((B, H, blocks + 2, w), float("-inf")),
            q.new_zeros(B, H, blocks + 2, w),
            q.new_zeros(B, H, blocks + 2, w, D),
        ]
        if global_k is not None:
            scores_g = band_global_scores(queries, global_k, None if global_bias is None else global_bias * LOG2E)
            max_g = scores_g.amax(-1)
            weights_g = scores_g.sub_(safe_max(max_g)[..., None]).exp2_()
            for x, part in zip(state, (max_g, weights_g.sum(-1), torch.matmul(weights_g, global_v))):
                x.flatten(2, 3)[:, :, w : w + L] = part
        for start, stop, halves in _chunk_groups(q, w, blocks):
            rows = slice(halves.start * w, halves.stop * w)
            chunk_queries = band_windows(queries_b, start + halves.start, stop + halves.start, len(halves))
            scores = band_scores(chunk_queries, band_windows(keys_b, start, stop, SPAN), masks, start, stop, rows)
            chunk_max = scores.amax(-1)
            weights = scores.sub_(safe_max(chunk_max)[..., None]).exp2_()
            chunk_sum = weights.sum(-1)
            chunk_out = torch.matmul(weights, band_windows(values_b, start, stop, SPAN))
            # Half j of chunk c is padded block c + j.
            for i, j in enumerate(halves):
                half = slice(i * w, (i + 1) * w)
                _merge_(
                    state,
                    slice(start + j, stop + j),
                    chunk_max[..., half],
                    chunk_sum[..., half],
                    chunk_out[..., half, :],
                )
        row_max, total, out = (x[:, :, 1 : blocks + 1].flatten(2, 3)[:, :, :L] for x in state)
        out = out.div_(total.clamp(min=torch.finfo(total.dtype).tiny)[..., None])
        lse = torch.where(total > 0, safe_max(row_max) + total.log2(), float("inf"))  # base 2; +inf: sees no key
        ctx.save_for_backward(q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, out, lse)
        ctx.options = window, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, out, lse = ctx.saved_tensors
        w, causal, scale = ctx.options
        B, H, L, D = q.shape
        blocks = -(-L // w)
        masks = _chunk_masks(rel_bias, key_padding_mask, B, L, w, blocks, causal, q.device)
        row_term = (grad_out * out).sum(-1)  # rowsum(dO * O) = rowsum(P * dP)
        # Padded copies with one more column (the module docstring), scaled in place: natural-scale queries and
        # base-2 keys, whose query gradient is then LOG2E too large (undone at the end).
        queries_b, keys_b, values_b, grad_out_b = (
            band_blocks(x, w, blocks, extra_column=True) for x in (q, k, v, grad_out)
        )
        queries_b[..., :D].mul_(scale)
        keys_b[..., :D].mul_(LOG2E)
        keys_b[..., D] = values_b[..., D] = 1.0
        # -lse, and -inf for queries past the end of the sequence (their output gradient is 0): zero probabilities.
        queries_b.flatten(2, 3)[:, :, w : w + L, D] = -lse
        queries_b.flatten(2, 3)[:, :, w + L :, D] = float("-inf")
        grad_out_b.flatten(2, 3)[:, :, w : w + L, D] = -row_term
        grad_queries_b, grad_keys_b, grad_values_b = (q.new_zeros(queries_b.shape[:-1] + (D,)) for _ in range(3))
        grad_bias = None if rel_bias is None else q.new_zeros(H, SPAN * w, SPAN * w)
        for start, stop, halves in _chunk_groups(q, w, blocks):
            rows = slice(halves.start * w, halves.stop * w)
            query_blocks = (start + halves.start, stop + halves.start, len(halves))
            chunk_keys, chunk_values = (band_windows(x, start, stop, SPAN) for x in (keys_b, values_b))
            chunk_queries, chunk_grad_out = (band_windows(x, *query_blocks) for x in (queries_b, grad_out_b))
            probs = band_scores(chunk_queries, chunk_keys, masks, start, stop, rows).exp2_()
            grad_values = torch.matmul(probs.transpose(-1, -2), chunk_grad_out[..., :D])
            scatter_band_windows_(grad_values_b, grad_values, start, stop)
            grad_scores = torch.matmul(chunk_grad_out, chunk_values.transpose(-1, -2)).mul_(probs)
            del probs
            scatter_band_windows_(grad_queries_b, torch.matmul(grad_scores, chunk_keys[..., :D]), *query_blocks[:2])
            grad_keys = torch.matmul(grad_scores.transpose(-1, -2), chunk_queries[..., :D])
            scatter_band_windows_(grad_keys_b, grad_keys, start, stop)
            if grad_bias is not None:
                grad_bias[:, rows] += grad_scores.sum((0, 2))
        grad_q, grad_k, grad_v = (
            x.flatten(2, 3)[:, :, w : w + L] for x in (grad_queries_b, grad_keys_b, grad_values_b)
        )
        grad_q.mul_(scale / LOG2E)

        grad_global_k = grad_global_v = grad_global_bias = None
        if global_k is not None:
            queries = queries_b[..., :D].flatten(2, 3)[:, :, w : w + L]
            scores_g = band_global_scores(
                queries * LOG2E, global_k, None if global_bias is None else global_bias * LOG2E
            )
            probs_g = scores_g.sub_(lse[..., None]).exp2_()
            grad_global_v = torch.matmul(probs_g.transpose(-1, -2), grad_out)
            grad_scores_g = torch.matmul(grad_out, global_v.transpose(-1, -2)).sub_(row_term[..., None]).mul_(probs_g)
            grad_q.add_(torch.matmul(grad_scores_g, global_k), alpha=scale)
            grad_global_k = torch.matmul(grad_scores_g.transpose(-1, -2), queries)
            grad_global_bias = None if global_bias is None else grad_scores_g.sum((0, 2))
        grad_rel_bias = None
        if grad_bias is not None:
            bias_row = band_chunk_tables(w, causal, q.device)[1]
            grad_rel_bias = torch.zeros_like(rel_bias).index_add_(1, bias_row.flatten(), grad_bias.flatten(1))
        return None, None, grad_q, grad_k, grad_v, grad_global_k, grad_global_v, grad_rel_bias, grad_global_bias, None


def attention_1d(q, k, v, hood, extras):
    """Half precision is computed in float32 (the op runs function backends with autocast off): the backward
    recomputes probabilities from a saved log-sum-exp, which must be exact."""
    inputs = in_float32_or_wider(q, k, v, hood, extras)
    tensors = (*inputs[:3], *inputs[3].differentiable, extras.key_padding_mask)
    return ChunksAttention1d.apply(hood, extras.scale, *tensors).to(q.dtype)


BACKEND = Backend(
    "chunks",
    attention_1d=attention_1d,
    dilation_1d="split",
    twice_differentiable=False,
    function_transforms=False,
    vmap=False,
)
