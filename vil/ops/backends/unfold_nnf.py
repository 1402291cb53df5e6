"""The windows of ``unfold.py`` gathered with ``torch.nn.functional.unfold`` (im2col) instead of ``Tensor.unfold``."""

from functools import partial

import torch.nn.functional as F

from ..base import Backend
from .unfold import unfolded_attention


def _functional_unfold(x, size, step):
    """(N, C, Xp, Yp) -> (N, C, n_rows, n_cols, size * size), with torch.nn.functional.unfold."""
    N, C, Xp, Yp = x.shape
    rows, cols = (Xp - size) // step + 1, (Yp - size) // step + 1
    patches = F.unfold(x, size, stride=step)  # (N, C * size * size, rows * cols)
    return patches.view(N, C, size * size, rows, cols).permute(0, 1, 3, 4, 2)


BACKEND = Backend("unfold_nnf", attention_2d=partial(unfolded_attention, _functional_unfold), dilation_2d="split")
