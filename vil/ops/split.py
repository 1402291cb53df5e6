"""A local attention request run as pieces a backend can take: dilated windows per sub-lattice (2D) or residue class
(1D), where the backend computes only undilated ones, and different dilations per head by groups of heads.

``attend(q, k, v, hood, extras)`` computes one piece with the chosen backend; the op functions and the generic
operator (``vil/ops/operators.py``) both run requests through here.
"""

from dataclasses import replace

import torch

from .base import Backend, Extras, compute_dtype, static_sizes
from .neighborhood import Neighborhood1d, Neighborhood2d


def _sizes(hood, q):
    """q's map (rows, cols) or sequence length (length,); ``None`` where they are symbolic (torch.export with
    dynamic sizes, ``torch.compile(dynamic=True)``)."""
    sizes = tuple(q.shape[2:4] if hood.dims == 2 else q.shape[2:3])
    return sizes if static_sizes(sizes) else None


def fitted(hood, q, extras: Extras):
    """``(hood, extras)`` fitted to q's map or sequence where its sizes are numbers (not symbolic):
    ``Neighborhood2d.fitted``, ``Neighborhood1d.fitted``, and a relative position bias table cut to the fitted
    window's (:meth:`Neighborhood2d.bias_of_window`), whose rows are the same offsets'."""
    sizes = _sizes(hood, q)
    if sizes is None:
        return hood, extras
    small = hood.fitted(*sizes)
    if extras.rel_bias is None or small.window == hood.window:
        return small, extras
    return small, replace(extras, rel_bias=hood.bias_of_window(extras.rel_bias, small.window))


def splits_by_size(b: Backend, hood, q) -> bool:
    """Whether running ``b`` on this request splits it into pieces whose number depends on q's sizes while those are
    symbolic: the pieces would fix the sizes, so the request must run where the tensors are real (the op's generic
    operator)."""
    return hood.dilated and b.dilation(hood.dims) == "split" and _sizes(hood, q) is None


def run_2d(attend, b: Backend, q, k, v, hood: Neighborhood2d, extras: Extras):
    """``attend`` on the whole map, or per sub-lattice where ``b`` splits dilated windows or the dilation reaches
    past a side of the map (which leaves too little of it for a backend's own dilated windows)."""
    sizes = _sizes(hood, q)
    if hood.dilated and (b.dilation(2) == "split" or (sizes is not None and hood.dilation >= min(sizes))):
        return _per_sub_lattice(attend, q, k, v, hood, _piece_extras(b, extras))
    return attend(q, k, v, hood, extras)


def _per_sub_lattice(attend, q, k, v, hood, piece_extras):
    """The positions whose row and column have the same residues modulo the dilation form a map of their own, on
    which the window is the undilated one."""
    d, out = hood.dilation, None
    for r in range(min(d, q.shape[2])):
        for c in range(min(d, q.shape[3])):
            part = (slice(None), slice(None), slice(r, None, d), slice(c, None, d))
            pieces = (q[part].contiguous(), k[part].contiguous(), v[part].contiguous())
            out = _placed(out, q, part, attend(*pieces, hood.with_dilation(1), piece_extras()))
    return out


def _piece_extras(b: Backend, extras: Extras):
    """A function giving each piece the inputs all pieces share (global keys and values, bias tables), taken from
    float32 copies made once, so that autograd sums the pieces' gradients in float32 (summed in bfloat16, pieces that
    are large and cancel lose their sum): the copies themselves where ``b`` takes them in float32, else each piece's
    own cast to the dtypes they came in."""
    shared = extras.cast(lambda t: t.to(compute_dtype(t)))
    if b.extras_in_float32:
        return lambda: shared
    dtypes = [t.dtype for t in extras.differentiable if t is not None]

    def in_given_dtypes():
        given = iter(dtypes)
        return shared.cast(lambda t: t.to(next(given)))

    return in_given_dtypes


def _placed(out, q, index, piece):
    """``out[index] = piece``, ``out`` made at the first piece: q's shape in the piece's dtype (under autocast a
    backend may return another dtype than q's)."""
    if out is None:
        out = q.new_empty(q.shape, dtype=piece.dtype)
    out[index] = piece
    return out


def run_1d(attend, b: Backend, q, k, v, hood: Neighborhood1d, extras: Extras):
    """``attend`` on the whole sequence; by head, where ``b`` cannot take different dilations per head in one call;
    by residue class, where it has no dilated windows of its own (the positions ``r, r+d, r+2d, ...`` are a
    sequence of their own, on which the window is the undilated one)."""
    if hood.per_head and not b.per_head_dilation:
        out, dilations = None, hood.dilation
        for d in sorted(set(dilations)):
            heads = torch.tensor([h for h, x in enumerate(dilations) if x == d], device=q.device)
            pieces = (q[:, heads], k[:, heads], v[:, heads])
            piece = run_1d(attend, b, *pieces, hood.with_dilation(d), extras.of_heads(heads))
            out = _placed(out, q, (slice(None), heads), piece)
        return out
    if hood.dilated and b.dilation(1) == "split":
        d, out, piece_extras = hood.dilation, None, _piece_extras(b, extras)
        mask = extras.key_padding_mask
        for r in range(min(d, q.shape[2])):
            part = replace(piece_extras(), key_padding_mask=None if mask is None else mask[:, r::d])
            piece = attend(q[:, :, r::d], k[:, :, r::d], v[:, :, r::d], hood.with_dilation(1), part)
            out = _placed(out, q, (slice(None), slice(None), slice(r, None, d)), piece)
        return out
    return attend(q, k, v, hood, extras)
