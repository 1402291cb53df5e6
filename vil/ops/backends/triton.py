"""The fused Triton kernels of ``kernels/`` (package ``vil_kernels``): flash-style, O(tokens x head_dim) memory, for
2D windows (``local_attention.py``) and 1D bands (``local_attention_1d.py``).

This file builds the 2D kernels' neighbour tables from the window geometry and declares each kernel family's two
passes; the kernels and their launchers know nothing of this package. Triton is imported on first use, so that
``import vil`` stays light. ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) has to be set before ``vil`` is
imported: the backend's devices are fixed from it then (CUDA, and the CPU only under the interpreter), and Triton
reads it again when it defines the kernels, on first use.
"""

from dataclasses import replace

import torch

from vil_kernels import interpreting

from ..base import Backend, FusedPasses, kept_tables
from ..geometry import neighbour_table


def _kernels(dims=2):
    """The kernel module of ``dims``-D windows; ``ValueError`` with one sentence where Triton does not import."""
    try:
        from vil_kernels import local_attention, local_attention_1d
    except ImportError as error:
        raise ValueError(
            f"The triton backend needs the triton package, which does not import here ({error}); install it "
            "(pip install triton, on a machine with a CUDA GPU) or choose another backend, such as sliding_chunk."
        ) from error
    return local_attention_1d if dims == 1 else local_attention


def _in_order(gradients):
    """The kernels' gradients (a dict by name) as the op's backward returns them, in the order of its inputs."""
    from vil_kernels.flash import GRADIENTS

    return tuple(gradients[name] for name in GRADIENTS)


@kept_tables(64)
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
    neighbours, counts = (t.to(device) for t in kernels.present_first(table, offsets))
    neighbours_t, counts_t = (t.to(device) for t in kernels.present_first(table_t, offsets))
    return kernels.Geometry(
        window=window,
        chunk=chunk,
        chunk_pad=chunk_pad,
        dilation=dilation,
        exact=exact,
        chunk_cols=my,
        num_chunks=mx * my,
        neighbours=neighbours,
        counts=counts,
        neighbours_t=neighbours_t,
        counts_t=counts_t,
        key_tiles=int((table >= 0).sum()),
    )


def _geometry(q, hood):
    return kernel_geometry(q.shape[2], q.shape[3], hood.window, hood.exact, hood.mode, hood.dilation, q.device)


def _forward_2d(q, k, v, hood, extras):
    out, lse = _kernels().forward(q, k, v, *extras.differentiable, _geometry(q, hood), extras.scale)
    return out, lse.view(q.shape[:-1])


def _backward_2d(q, k, v, hood, extras, out, lse, grad_out):
    inputs = (q, k, v, *extras.differentiable)
    g = _kernels().backward(grad_out, *inputs, out, lse.flatten(2), _geometry(q, hood), extras.scale)
    return _in_order(g)


def _scored_pairs(q, hood, num_global):
    """The (query, key) scores per batch item: in every head and on every sub-lattice, every token of a chunk's
    padded ``P x P`` tile against the padded tiles of the chunks its present slots read (border chunks read fewer)
    and the global keys."""
    geo = _geometry(q, hood)
    tile = geo.chunk_pad**2
    return q.shape[1] * hood.dilation**2 * tile * (geo.key_tiles * tile + geo.num_chunks * num_global)


def _band_options(q, hood, extras):
    return extras.key_padding_mask, hood.dilations(q.shape[1]), hood.window, hood.causal, extras.scale


def _forward_1d(q, k, v, hood, extras):
    return _kernels(1).forward(q, k, v, *extras.differentiable, *_band_options(q, hood, extras))


def _backward_1d(q, k, v, hood, extras, out, lse, grad_out):
    inputs = (q, k, v, *extras.differentiable)
    mask, *options = _band_options(q, hood, extras)
    g = _kernels(1).backward(grad_out, *inputs, mask, out, lse, *options)
    return _in_order(g)


def _scored_pairs_1d(q, hood, num_global):
    return _kernels(1).scored_pairs(q.shape[2], hood.window, hood.dilations(q.shape[1]), hood.causal, num_global)


def _rows_of_unit_stride(q, k, v, hood, extras):
    """The kernels take rows of unit stride along head_dim and contiguous bias tables."""
    q, k, v, global_k, global_v = (
        t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, *extras.differentiable[:2])
    )
    rel_bias, global_bias = (None if t is None else t.contiguous() for t in (extras.rel_bias, extras.global_bias))
    return q, k, v, replace(extras, global_k=global_k, global_v=global_v, rel_bias=rel_bias, global_bias=global_bias)


def _check(hood, head_dim, q=None):
    """Raise ``ValueError`` with one sentence if the kernels cannot take this head_dim or window, or, given the
    queries ``q``, their dtype, device or batch x heads."""
    if q is None:
        _kernels(hood.dims).check_supported(head_dim, hood.window)
    else:
        _kernels(hood.dims).check_supported(head_dim, hood.window, q.dtype, q.device, q.shape[0] * q.shape[1])


# CUDA GPUs; the CPU only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
BACKEND = Backend(
    "triton",
    passes_2d=FusedPasses(_forward_2d, _backward_2d, _scored_pairs),
    passes_1d=FusedPasses(_forward_1d, _backward_1d, _scored_pairs_1d),
    prepare=_rows_of_unit_stride,
    twice_differentiable=False,
    function_transforms=False,
    per_head_dilation=True,
    devices=("cuda", "cpu") if interpreting() else ("cuda",),
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    available=_kernels,
    check=_check,
)
