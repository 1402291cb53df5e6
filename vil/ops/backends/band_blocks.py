"""The 1D pieces the ``sliding_chunk`` and ``chunks`` backends are built from: a sequence in blocks of w positions.

A sequence of L positions is ``blocks = ceil(L / w)`` blocks of w, zero padded by one block in front and to
``blocks + 2`` blocks behind: padded block j holds positions (j - 1)w .. jw - 1. A window of ``span``
consecutive padded blocks starting at j is the keys of query block j (sliding_chunk, span 3) or chunk j
(chunks, span 2). Both also share the scores of the global keys and the maximum their softmax subtracts.
"""

import torch
import torch.nn.functional as F


def band_blocks(x, window, blocks, extra_column=False):
    """(B, H, L, ...) -> (B, H, blocks + 2, w, ...): zero padded by one block in front and to ``blocks + 2`` behind;
    with ``extra_column``, ``x (B, H, L, D)`` gets a column of zeros after its last in the same copy (D + 1)."""
    L = x.shape[2]
    pad = [0, 0] * (x.dim() - 3) + [window, (blocks + 1) * window - L]
    if extra_column:
        pad[0:2] = [0, 1]
    return F.pad(x, pad).unflatten(2, (blocks + 2, window))


def band_windows(blocks, start, stop, span):
    """The windows of ``span`` consecutive padded blocks starting at start..stop-1: (B, H, n, span * w, ...)."""
    return torch.cat([blocks[:, :, start + j : stop + j] for j in range(span)], dim=3)


def scatter_band_windows_(grad_blocks, grad, start, stop):
    """The adjoint of :func:`band_windows`: adds ``grad (B, H, n, span * w, ...)`` into ``grad_blocks``."""
    span = grad.shape[3] // grad_blocks.shape[3]
    for j, part in enumerate(grad.chunk(span, dim=3)):
        grad_blocks[:, :, start + j : stop + j] += part


def band_key_hidden(key_padding_mask, B, L, window, blocks, span, device):
    """``(B or 1, n, span * w)`` bool: which keys of every window of ``span`` padded blocks are no keys at all
    (outside the sequence, or masked by ``key_padding_mask``)."""
    key_ok = torch.zeros(1 if key_padding_mask is None else B, (blocks + 2) * window, dtype=torch.bool, device=device)
    key_ok[:, window : window + L] = True if key_padding_mask is None else ~key_padding_mask
    return ~key_ok.unfold(1, span * window, window)


def band_masks(allowed, bias_row, rel_bias, key_padding_mask, B, L, window, blocks):
    """What :func:`band_scores` adds and masks, for windows of ``span`` padded blocks whose band is ``allowed
    (rows, span * w)`` with bias rows ``bias_row``: ``table (H, rows, span * w)``, ``rel_bias`` (base 2) in the band,
    the same in every window (None without ``rel_bias``); ``outside``, ``~allowed``; ``key_hidden (B or 1, 1, n, 1,
    span * w)``; and ``masked``, per window, whether it may have hidden keys: every window with a key padding mask,
    otherwise those that reach past either end of the sequence."""
    span = allowed.shape[-1] // window
    table = None if rel_bias is None else rel_bias[:, bias_row]
    key_hidden = band_key_hidden(key_padding_mask, B, L, window, blocks, span, allowed.device)
    # Window j holds padded positions jw .. (j + span)w - 1, the sequence is w .. w + L - 1.
    masked = [
        key_padding_mask is not None or j == 0 or (j + span) * window > window + L for j in range(key_hidden.shape[1])
    ]
    return table, ~allowed, key_hidden[:, None, :, None, :], masked


def band_scores(queries, keys, masks, start, stop, rows=slice(None)):
    """Scores of windows start..stop-1, ``(B, H, n, rows, span * w)``, from queries (the window's query ``rows``)
    and keys of the windows and :func:`band_masks`: the band's bias added, then -inf outside the band and for hidden
    keys, set rather than added, so that a NaN or infinite key stays hidden from the queries that do not see it.
    The keys are masked only in the windows that have hidden keys."""
    table, outside, key_hidden, masked = masks
    scores = torch.matmul(queries, keys.transpose(-1, -2))
    if table is not None:
        scores += table[:, None, rows].to(scores.dtype)
    scores.masked_fill_(outside[rows], float("-inf"))
    if any(masked[start:stop]):
        scores.masked_fill_(key_hidden[:, :, start:stop], float("-inf"))
    return scores


def band_global_scores(queries, global_k, global_bias):
    """Base-2 scores of queries ``(B, H, ..., D)`` (scaled to base 2) against the global keys ``(B, H, G, D)``,
    plus ``global_bias (H, G)`` (base 2) where given: ``(B, H, ..., G)``."""
    scores = torch.matmul(queries.flatten(2, -2), global_k.transpose(-1, -2))
    if global_bias is not None:
        scores += global_bias[:, None, :]
    return scores.unflatten(2, queries.shape[2:-1])
