"""Sliding chunks, all chunks of a group at once, backward left to autograd (it keeps every intermediate)."""

import torch

from ..base import Backend, softmax_or_zeros
from ..geometry import chunk_plan
from .chunk_windows import from_chunks, gather_windows, global_scores, to_chunks, window_bias, window_scores


def attention_2d(q, k, v, hood, extras):
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    plan = chunk_plan(q.shape[2], q.shape[3], hood.window, hood.exact, hood.mode, q.device)
    queries = to_chunks(q, plan) * extras.scale
    keys, values = to_chunks(k, plan), to_chunks(v, plan)
    outputs = []
    for group in plan.groups:
        group_queries = queries[:, group.start : group.stop]
        scores = window_scores(group_queries, gather_windows(keys, group), group, window_bias(group, rel_bias, q.dtype))
        group_values = gather_windows(values, group)  # (B, c, H, L, D)
        if global_k is not None:
            scores = torch.cat([global_scores(group_queries, global_k, global_bias), scores], dim=-2)
            group_values = torch.cat([global_v[:, None].expand(-1, group.num_chunks, -1, -1, -1), group_values], dim=-2)
        probs = softmax_or_zeros(scores, dim=-2)  # over the keys, dim -2
        outputs.append(torch.matmul(probs.transpose(-1, -2), group_values))
    return from_chunks(torch.cat(outputs, dim=1), plan)


BACKEND = Backend("sliding_chunk_autograd", attention_2d=attention_2d, dilation_2d="split")
