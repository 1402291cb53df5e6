"""One file per way of computing local attention. Each declares a :class:`Backend`: what it computes (1D, 2D),
what it supports, and its functions; the dispatcher in ``vil/ops/local_attention.py`` reads nothing else.

A backend's functions receive validated inputs and a neighbourhood (``vil/ops/neighborhood.py``):

    attention_2d(q, k, v, hood, *, global_k, global_v, rel_bias, global_bias, scale)
        q, k, v (B, heads, X, Y, head_dim); hood a Neighborhood2d
    attention_1d(q, k, v, hood, *, global_k, global_v, rel_bias, global_bias, key_padding_mask, scale)
        q, k, v (B, heads, L, head_dim); hood a Neighborhood1d; key_padding_mask (B, L) bool or None

``global_k``/``global_v`` (B, heads, G >= 1, head_dim) or None, bias tables in q's dtype or None.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Backend:
    """What one backend computes and supports.

    ``dilation_2d``, ``dilation_1d``: ``"native"`` (dilated windows in the backend), ``"split"`` (the op runs the
    backend once per sub-lattice of positions with equal residues modulo the dilation, where the window is the
    undilated one), or None (refused). ``per_head_dilation``: 1D, different dilations per head in one call (otherwise
    the op runs the heads of each dilation together). ``devices``: device types it runs on (None: any); ``trains_on``:
    device types where it has a backward (None: wherever it runs). ``available``:
    raises ``ValueError`` with one sentence where the backend cannot run on this machine (a build, an import).
    ``check``: ``(hood, head_dim)`` raises for options the backend cannot take. ``traced_as_is``: torch.compile
    and torch.export trace it as it is: it is its own pair of operators (forward, hand-written backward;
    ``vil/ops/operators.py``), or FlexAttention, which the compiler knows; the op layer runs the others there as
    one generic operator whose backward recomputes their forward with autograd.
    """

    name: str
    attention_2d: Optional[Callable] = None
    attention_1d: Optional[Callable] = None
    dilation_2d: Optional[str] = "native"
    dilation_1d: Optional[str] = "native"
    per_head_dilation: bool = False
    devices: Optional[tuple] = None  # None: any device torch runs on
    trains_on: Optional[tuple] = None
    dtypes: tuple = FLOATS
    available: Optional[Callable] = None
    check: Optional[Callable] = None
    traced_as_is: bool = False

    def computes(self, dims):
        return (self.attention_1d if dims == 1 else self.attention_2d) is not None

    def dilation(self, dims):
        return self.dilation_1d if dims == 1 else self.dilation_2d
