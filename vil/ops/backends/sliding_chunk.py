"""Sliding chunks with a hand-written backward that saves only the inputs and the output.

Both passes walk over blocks of (batch, chunks) whose score matrices stay near ``block_bytes``: on the CPU
the working set then stays in cache and in memory the allocator reuses, which is several times faster
than one huge batched product; the peak memory of attention is one block, whatever the map size. The
backward recomputes each block's probabilities and takes the softmax-backward row term from the output
(``rowsum(dO * O)``), so it never needs the scores of more than one block.
"""

import torch

from ..chunks import chunk_layout, from_chunks, gather_windows, scatter_windows_, to_chunks, window_bias, window_bias_grad, window_probs

# Scores per block: small enough for the CPU's caches and allocator, large enough to fill a GPU.
BLOCK_BYTES = {"cpu": 8 << 20, "cuda": 1 << 30}


def _blocks(x, layout):
    """(batch slice, chunk slice) pairs covering the batch and the chunks of ``x (B, H, C, S, D)``."""
    B, H = x.shape[:2]
    C = layout.num_chunks
    per_chunk = H * x.shape[3] * layout.window_len * x.element_size()
    budget = BLOCK_BYTES.get(x.device.type, BLOCK_BYTES["cuda"])
    chunks_per_block = max(1, min(C, budget // per_chunk))
    batch_per_block = max(1, budget // (per_chunk * C)) if chunks_per_block == C else 1
    for b in range(0, B, batch_per_block):
        for c in range(0, C, chunks_per_block):
            yield slice(b, b + batch_per_block), slice(c, c + chunks_per_block)


class SlidingChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, global_k, global_v, rel_bias, global_bias, layout, scale):
        queries = to_chunks(q, layout)
        keys, values = to_chunks(k, layout, global_k), to_chunks(v, layout, global_v)
        bias = window_bias(layout, rel_bias, global_bias, q.dtype)
        out = torch.empty_like(queries)
        for b, c in _blocks(queries, layout):
            probs = window_probs(queries[b, :, c], gather_windows(keys[b], layout, c), bias[:, c], scale)
            out[b, :, c] = torch.matmul(probs, gather_windows(values[b], layout, c))
        ctx.save_for_backward(q, k, v, global_k, global_v, rel_bias, global_bias, out)
        ctx.layout, ctx.scale = layout, scale
        return from_chunks(out, layout)[0]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, global_k, global_v, rel_bias, global_bias, out = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        queries = to_chunks(q, layout)
        keys, values = to_chunks(k, layout, global_k), to_chunks(v, layout, global_v)
        grad_outc = to_chunks(grad_out, layout)
        bias = window_bias(layout, rel_bias, global_bias, q.dtype)
        # The softmax backward's row term sum_j P_ij dP_ij equals dO_i . O_i.
        row_term = (grad_outc * out).sum(-1, keepdim=True)
        grad_queries = torch.empty_like(queries)
        grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
        learn_bias = rel_bias is not None or global_bias is not None
        if learn_bias:
            grad_bias = q.new_zeros(bias.shape[0], *bias.shape[2:], dtype=torch.promote_types(q.dtype, torch.float32))

        for b, c in _blocks(queries, layout):
            block_keys, block_values = gather_windows(keys[b], layout, c), gather_windows(values[b], layout, c)
            block_queries, block_grad_out = queries[b, :, c], grad_outc[b, :, c]
            probs = window_probs(block_queries, block_keys, bias[:, c], scale)
            scatter_windows_(grad_values[b], torch.matmul(probs.transpose(-1, -2), block_grad_out), layout, c)
            grad_scores = torch.matmul(block_grad_out, block_values.transpose(-1, -2))
            grad_scores.sub_(row_term[b, :, c]).mul_(probs)
            grad_queries[b, :, c] = torch.matmul(grad_scores, block_keys).mul_(scale)
            scatter_windows_(grad_keys[b], torch.matmul(grad_scores.transpose(-1, -2), block_queries * scale), layout, c)
            if learn_bias:
                grad_bias += grad_scores.sum(dim=(0, 2))

        grad_k, grad_global_k = from_chunks(grad_keys, layout)
        grad_v, grad_global_v = from_chunks(grad_values, layout)
        grad_rel_bias = grad_global_bias = None
        if learn_bias:
            grad_rel_bias, grad_global_bias = window_bias_grad(grad_bias, layout, rel_bias, global_bias)
        grad_q = from_chunks(grad_queries, layout)[0]
        return grad_q, grad_k, grad_v, grad_global_k, grad_global_v, grad_rel_bias, grad_global_bias, None, None


def sliding_chunk(q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale):
    G = 0 if global_k is None else global_k.shape[2]
    layout = chunk_layout(q.shape[2], q.shape[3], window, exact, mode, G, q.device)
    return SlidingChunkAttention.apply(q, k, v, global_k, global_v, rel_bias, global_bias, layout, scale)
