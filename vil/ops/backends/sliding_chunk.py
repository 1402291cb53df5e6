"""Sliding chunks with a hand-written backward that saves only the inputs, the output and one
log-sum-exp per query.

Both passes walk over blocks of (batch, chunks) whose score matrices stay near ``BLOCK_BYTES``: on the CPU
the working set then stays in cache and in memory the allocator reuses, which is several times faster
than one huge batched product; the peak memory of attention is one block, whatever the map size.

The softmax is written out: the forward normalises the ``S x D`` output rather than the ``L x S``
probabilities and keeps the log-sum-exp. The backward appends a column to its operands (ones to the
keys and values, ``-lse`` to the queries, ``-rowsum(dO * O)`` to the output gradient), so that one
product gives ``scores - lse``, whose ``exp2`` is the probabilities, and one gives ``dP - rowsum(P * dP)``,
the softmax backward's bracket. The G global keys are a separate small product in the same softmax, so
the large products see only the local keys.

Scores are computed in base 2 (queries and biases times log2(e), ``exp2`` for ``exp``): on the CPU
``torch.exp`` goes through MKL's vector math, whose speed depends on the data (-inf entries make it
2x, underflowing ones 4x slower), while ``torch.exp2`` is a plain vectorised kernel.
"""

import math

import torch

from ..chunks import add_rel_bias_grad_, chunk_plan, from_chunks, gather_windows, global_scores, scatter_windows_, to_chunks, window_bias, window_scores

# Scores per block: small enough for the CPU's caches and allocator, large enough to fill a GPU.
BLOCK_BYTES = {"cpu": 8 << 20, "cuda": 1 << 30}
LOG2E = math.log2(math.e)


def _blocks(x, plan):
    """(group, batch slice, chunk slice within the group, the same chunks in ``x``) covering ``x (B, C, H, S, D)``
    group by group; every block is a contiguous slice of ``x``."""
    B, _, H, S = x.shape[:4]
    budget = BLOCK_BYTES.get(x.device.type, BLOCK_BYTES["cuda"])
    for group in plan.groups:
        C = group.num_chunks
        per_chunk = H * S * group.window_len * x.element_size()
        chunks_per_block = max(1, min(C, budget // per_chunk))
        chunks_per_block = -(-C // -(-C // chunks_per_block))  # even blocks: no small remainder
        batch_per_block = max(1, budget // (per_chunk * C)) if chunks_per_block == C else 1
        batch_per_block = -(-B // -(-B // batch_per_block))
        for b in range(0, B, batch_per_block):
            for c in range(0, C, chunks_per_block):
                stop = min(C, c + chunks_per_block)
                yield group, slice(b, min(B, b + batch_per_block)), slice(c, stop), slice(group.start + c, group.start + stop)


def _row_max(scores, group):
    """``scores (..., L, S)`` -> ``(..., 1, S)``, the max over the keys. Reduced over the slots first: a
    reduction over dim -2 of rows only S long is several times slower than one over (n, S*S)."""
    per_slot = scores.unflatten(-2, (group.num_slots, -1)).amax(-3)
    return per_slot.amax(-2, keepdim=True)


def _base2(bias):
    return None if bias is None else bias * LOG2E


class SlidingChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, global_k, global_v, rel_bias, global_bias, plan, scale):
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
            weights = scores.sub_(row_max).exp2_()  # unnormalised probabilities, in place
            total = weights.sum(-2, keepdim=True)
            block_out = torch.matmul(weights.transpose(-1, -2), gather_windows(values, group, b, c), out=out[b, cx])
            if global_k is not None:
                weights_g = scores_g.sub_(row_max).exp2_()
                total += weights_g.sum(-2, keepdim=True)
                block_out += torch.matmul(weights_g.transpose(-1, -2), global_v[b, None])
            block_out /= total.transpose(-1, -2)
            lse[b, cx] = (row_max + total.log2()).squeeze(-2)
        ctx.save_for_backward(q, k, v, global_k, global_v, rel_bias, global_bias, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return from_chunks(out, plan)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, global_k, global_v, rel_bias, global_bias, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
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
        return from_chunks(grad_queries, plan), grad_k, grad_v, grad_global_k, grad_global_v, grad_rel_bias, grad_global_bias, None, None


def sliding_chunk(q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale):
    plan = chunk_plan(q.shape[2], q.shape[3], window, exact, mode, q.device)
    inputs = (q, k, v, global_k, global_v, rel_bias, global_bias)
    compute = torch.promote_types(q.dtype, torch.float32)
    if compute != q.dtype:
        # Half precision is computed in float32: the recomputed probabilities need an exact log-sum-exp.
        inputs = tuple(None if t is None else t.to(compute) for t in inputs)
    with torch.autocast(q.device.type, enabled=False):  # the dtypes are chosen here, not by autocast
        return SlidingChunkAttention.apply(*inputs, plan, scale).to(q.dtype)
