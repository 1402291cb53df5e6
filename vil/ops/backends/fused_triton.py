"""The fused Triton kernels of ``kernels/`` (package ``vil_kernels``): flash-style, O(tokens x head_dim) memory, for
2D windows (``local_attention.py``) and 1D bands (``local_attention_1d.py``).

This file builds the 2D kernels' neighbour tables from the window geometry and registers each kernel family's two
passes with the operators of ``vil/ops/operators.py``; the kernels and their launchers know nothing of this
package.
Triton is imported on first use, so that ``import vil`` stays light and ``TRITON_INTERPRET`` (read when the
kernels are defined) can still be set before that.
"""

import os
from functools import lru_cache

import torch

from .. import operators
from ..geometry import neighbour_table
from . import Backend


def _kernels(dims=2):
    """The kernel module of ``dims``-D windows; ``ValueError`` with one sentence where Triton does not import."""
    try:
        from vil_kernels import local_attention, local_attention_1d
    except ImportError as error:
        raise ValueError(
            f"The triton backend needs the triton package, which does not import here ({error})."
        ) from error
    return local_attention_1d if dims == 1 else local_attention


@lru_cache(maxsize=64)
def kernel_geometry(rows, cols, window, exact, mode, dilation, device):
    """The kernels' :class:`Geometry` of one map size and neighbourhood. With SW_EXACT 1 the chunks are the
    kernels' tile side (their 3x3 neighbours hold every exact window of radius ``window``), otherwise ViL's
    chunks of ``window``; dilated windows tile each sub-lattice."""
    kernels = _kernels()
    chunk_pad = kernels.chunk_pad(window)
    chunk = chunk_pad if exact == 1 else window
    lattice_rows, lattice_cols = -(-rows // dilation), -(-cols // dilation)
    mx, my = -(-lattice_rows // chunk), -(-lattice_cols // chunk)
    table, table_t, offsets = neighbour_table(mx, my, exact, mode)
    return kernels.Geometry(
        window=window,
        chunk=chunk,
        chunk_pad=chunk_pad,
        dilation=dilation,
        exact=exact,
        chunk_cols=my,
        num_chunks=mx * my,
        neighbours=table.to(device, torch.int32).contiguous(),
        neighbours_t=table_t.to(device, torch.int32).contiguous(),
        offsets=offsets.to(device, torch.int32).contiguous(),
    )


def _forward_2d(q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale):
    geo = kernel_geometry(q.shape[2], q.shape[3], window, exact, mode, dilation, q.device)
    out, lse = _kernels().forward(q, k, v, global_k, global_v, rel_bias, global_bias, geo, scale)
    return out, lse.view(q.shape[:-1])


def _backward_2d(
    q, k, v, global_k, global_v, rel_bias, global_bias, out, lse, grad_out, window, exact, mode, dilation, scale
):
    geo = kernel_geometry(q.shape[2], q.shape[3], window, exact, mode, dilation, q.device)
    g = _kernels().backward(
        grad_out, q, k, v, global_k, global_v, rel_bias, global_bias, out, lse.flatten(2), geo, scale
    )
    return g["dq"], g["dk"], g["dv"], g["dgk"], g["dgv"], g["drb"], g["dgb"]


def _kernel_inputs(q, k, v, global_k, global_v, rel_bias, global_bias):
    """The kernels take rows of unit stride along head_dim and contiguous bias tables."""
    rows = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, global_k, global_v))
    return (*rows, *(None if t is None else t.contiguous() for t in (rel_bias, global_bias)))


def attention_2d(q, k, v, hood, *, global_k, global_v, rel_bias, global_bias, scale):
    _kernels().check_supported(q.shape[-1], hood.window, q.dtype, q.device, q.shape[0] * q.shape[1])
    inputs = _kernel_inputs(q, k, v, global_k, global_v, rel_bias, global_bias)
    return operators.attention_2d("triton", *inputs, hood.window, hood.exact, hood.mode, hood.dilation, float(scale))


def _forward_1d(q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale):
    return _kernels(1).forward(
        q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, dilations, window, causal, scale
    )


def _backward_1d(
    q,
    k,
    v,
    global_k,
    global_v,
    rel_bias,
    global_bias,
    key_padding_mask,
    out,
    lse,
    grad_out,
    window,
    dilations,
    causal,
    scale,
):
    g = _kernels(1).backward(
        grad_out,
        q,
        k,
        v,
        global_k,
        global_v,
        rel_bias,
        global_bias,
        key_padding_mask,
        out,
        lse,
        dilations,
        window,
        causal,
        scale,
    )
    return g["dq"], g["dk"], g["dv"], g["dgk"], g["dgv"], g["drb"], g["dgb"]


def attention_1d(q, k, v, hood, *, global_k, global_v, rel_bias, global_bias, key_padding_mask, scale):
    _kernels(1).check_supported(q.shape[-1], hood.window, q.dtype, q.device, q.shape[0] * q.shape[1])
    inputs = _kernel_inputs(q, k, v, global_k, global_v, rel_bias, global_bias)
    return operators.attention_1d(
        "triton", *inputs, key_padding_mask, hood.window, hood.dilations(q.shape[1]), hood.causal, float(scale)
    )


def _check(hood, head_dim):
    """Raise ``ValueError`` with one sentence if the kernels cannot take this head_dim or window."""
    _kernels(hood.dims).check_supported(head_dim, hood.window)


def _scored_pairs(q, num_global, window, exact, mode, dilation):
    """The (query, key) scores per (batch, head): on every sub-lattice, every token of a chunk's padded ``P x P``
    tile against the padded tiles of the chunks its slots read and the global keys."""
    geo = kernel_geometry(q.shape[2], q.shape[3], window, exact, mode, dilation, q.device)
    tile = geo.chunk_pad**2
    return dilation**2 * geo.num_chunks * tile * (geo.num_slots * tile + num_global)


def _scored_pairs_1d(q, num_global, window, dilations, causal):
    return _kernels(1).scored_pairs(q.shape[2], window, dilations, causal, num_global)


operators.register_2d("triton", _forward_2d, _backward_2d, _scored_pairs)
operators.register_1d("triton", _forward_1d, _backward_1d, _scored_pairs_1d)
# CUDA GPUs; the CPU only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
BACKEND = Backend(
    "triton",
    attention_2d=attention_2d,
    attention_1d=attention_1d,
    per_head_dilation=True,
    devices=("cuda", "cpu") if os.environ.get("TRITON_INTERPRET", "0") == "1" else ("cuda",),
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    check=_check,
    traced_as_is=True,
)
