"""``local_attention_2d``: ViL's conv-like local attention over a 2D map, with one switch for how it is computed.

Every backend computes the same function (see :func:`local_attention_2d` and the README); they differ in
speed and memory only. A backend is a plain function
``fn(q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale)`` that receives
validated arguments; backends that compute dilated windows themselves also take ``dilation``.
"""

import logging

import torch

from .backends.chunk_rows import chunk_rows
from .backends.flex import flex
from .backends.fused_cpu import check_fused_cpu, fused_cpu
from .backends.fused_triton import check_fused_triton, fused_triton
from .backends.reference import reference
from .backends.sliding_chunk import sliding_chunk
from .backends.sliding_chunk_autograd import sliding_chunk_autograd
from .backends.unfold import unfold, unfold_nnf

_BACKENDS = {
    "sliding_chunk": sliding_chunk,
    "sliding_chunk_autograd": sliding_chunk_autograd,
    "triton": fused_triton,
    "fused_cpu": fused_cpu,
    "flex": flex,
    "unfold": unfold,
    "unfold_nnf": unfold_nnf,
    "chunk_rows": chunk_rows,
    "reference": reference,
}
# Backends that take ``dilation``; the others run once per sub-lattice of equal residues (see _per_sub_lattice).
_DILATION_BACKENDS = {"triton", "flex", "reference"}
# The fastest backends measured by tools/benchmark_attention.py (see BENCHMARKS.md): on the CPU the fused C++
# kernel, or sliding chunks where it cannot be built; elsewhere sliding chunks.
_CPU_DEFAULT, _FALLBACK = "fused_cpu", "sliding_chunk"
_log = logging.getLogger(__name__)
_logged_choices = set()


def available_backends():
    """Names accepted by ``local_attention_2d(..., backend=name)``."""
    return list(_BACKENDS)


def default_backend(device, dtype):
    """The backend ``backend=None`` uses for tensors on ``device`` with ``dtype``, the fastest measured (see
    BENCHMARKS.md): on the CPU ``fused_cpu`` (every dtype; half precision is computed in float32), or
    ``sliding_chunk`` with a warning where its C++ kernel cannot be built; elsewhere ``sliding_chunk``. The
    Triton kernels are chosen explicitly (``backend="triton"``, ATTN_TYPE ``longformer_triton``) until GPU
    measurements make them the default there."""
    if torch.device(device).type != "cpu":
        return _FALLBACK
    try:
        check_fused_cpu()
    except ValueError as error:
        if "fallback" not in _logged_choices:
            _logged_choices.add("fallback")
            _log.warning("%s Using %s on the CPU instead, about 2x slower.", error, _FALLBACK)
        return _FALLBACK
    return _CPU_DEFAULT


def _log_choice(device, dtype, backend):
    if (device.type, dtype, backend) not in _logged_choices:
        _logged_choices.add((device.type, dtype, backend))
        _log.info("local_attention_2d: backend %r for %s on %s (backend=None).", backend, dtype, device.type)


def local_attention_2d(
    q,
    k,
    v,
    window,
    *,
    exact=0,
    mode=0,
    global_k=None,
    global_v=None,
    rel_bias=None,
    global_bias=None,
    scale=None,
    dilation=1,
    backend=None,
):
    """Local attention of every position of a 2D map to its window, plus G global keys in the same softmax.

    Args:
        q, k, v: ``(B, heads, X, Y, head_dim)``; the result has the same shape.
        window: chunk size ``w`` (SW_EXACT 0 / -1) or window radius (SW_EXACT 1).
        exact: SW_EXACT: 0 = the 3x3 chunks around the query's chunk, zero padded at the border;
            -1 = the same, wrapping around cyclically; 1 = the exact ``(2w+1)^2`` window.
        mode: 0 = all 9 chunks, -1 = the own chunk only, 1..8 = the own chunk plus one neighbour
            (1:(-1,-1) 2:(-1,0) 3:(-1,+1) 4:(0,-1) 5:(0,+1) 6:(+1,-1) 7:(+1,0) 8:(+1,+1)); only with exact 0/-1.
        global_k, global_v: ``(B, heads, G, head_dim)``: keys every query also attends to.
        rel_bias: ``(heads, (4w-1)**2)``: bias for query (qi, qj) and key (ki, kj) at row
            ``(qi-ki + 2w-1) * (4w-1) + (qj-kj + 2w-1)``, offsets taken as if neighbour chunks were adjacent.
        global_bias: ``(heads, G)``: bias added to the scores of the global keys.
            Both bias tables may have another floating dtype than q (e.g. float32 parameters under
            autocast); they are cast to q's dtype.
        scale: factor of the scores; ``head_dim ** -0.5`` when None.
        dilation: with exact 1, keys at ``(qi + dilation*a, qj + dilation*b)``, ``|a|, |b| <= w``, as in dilated
            neighborhood attention; the bias row uses ``(a, b)`` as the offsets.
        backend: one of :func:`available_backends`; None: :func:`default_backend`.
    """
    _check_inputs(q, k, v, window, exact, mode, dilation, global_k, global_v, rel_bias, global_bias)
    if backend is None:
        backend = default_backend(q.device, q.dtype)
        _log_choice(q.device, q.dtype, backend)
    if backend not in _BACKENDS:
        raise ValueError(f"Unknown local attention backend {backend!r}; available: {', '.join(_BACKENDS)}.")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if global_k is not None and global_k.shape[2] == 0:
        global_k = global_v = global_bias = None
    # Bias tables are parameters, often float32 next to half-precision activations (autocast).
    rel_bias = None if rel_bias is None else rel_bias.to(q.dtype)
    global_bias = None if global_bias is None else global_bias.to(q.dtype)
    if q.numel() == 0:  # nothing to compute: the reference handles empty batches and maps
        backend = "reference"
    fn = _BACKENDS[backend]
    args = (window, exact, mode, global_k, global_v, rel_bias, global_bias, scale)
    if dilation == 1:
        return fn(q, k, v, *args)
    if backend in _DILATION_BACKENDS:
        return fn(q, k, v, *args, dilation=dilation)
    return _per_sub_lattice(fn, q, k, v, dilation, args)


def _per_sub_lattice(fn, q, k, v, dilation, args):
    """Dilated exact windows for a backend without them: the positions whose row and column have the same
    residues modulo ``dilation`` form a map of their own, on which the window is the undilated one."""
    out = torch.empty_like(q)
    for r in range(dilation):
        for c in range(dilation):
            part = (slice(None), slice(None), slice(r, None, dilation), slice(c, None, dilation))
            out[part] = fn(q[part].contiguous(), k[part].contiguous(), v[part].contiguous(), *args)
    return out


def check_backend(backend, head_dim, window, exact=0, mode=0, dilation=1):
    """Raise ``ValueError`` with one sentence if ``backend`` cannot compute these options (device and dtype
    are checked when it runs)."""
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"Unknown local attention backend {backend!r}; available: {', '.join(_BACKENDS)}.")
    check_window_options(exact, mode, dilation)
    if backend == "triton":
        check_fused_triton(head_dim, window)
    if backend == "fused_cpu":
        check_fused_cpu()


def check_window_options(exact, mode, dilation=1):
    """Raise ``ValueError`` unless ``exact`` (SW_EXACT), ``mode`` (MODE) and ``dilation`` are valid together."""
    if exact not in (1, 0, -1):
        raise ValueError(f"exact (SW_EXACT) must be 1, 0 or -1, got {exact!r}.")
    if mode not in range(-1, 9):
        raise ValueError(f"mode (MODE) must be 0, -1 or one of 1..8, got {mode!r}.")
    if exact == 1 and mode != 0:
        raise ValueError(f"mode (MODE) {mode} needs chunked windows (SW_EXACT 0 or -1); the exact window (SW_EXACT 1) takes mode 0 only.")
    if not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be a positive integer, got {dilation!r}.")
    if dilation > 1 and exact != 1:
        raise ValueError(f"dilation {dilation} needs the exact window (SW_EXACT 1); chunked windows take dilation 1.")


def _check_inputs(q, k, v, window, exact, mode, dilation, global_k, global_v, rel_bias, global_bias):
    if q.dim() != 5:
        raise ValueError(f"q must have shape (B, heads, X, Y, head_dim), got {tuple(q.shape)}.")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}.")
    for name, t in (("k", k), ("v", v), ("global_k", global_k), ("global_v", global_v)):
        if t is not None and (t.dtype != q.dtype or t.device != q.device):
            raise ValueError(
                f"{name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; all must match."
            )
    if not q.is_floating_point():
        raise ValueError(f"q, k and v must be floating point, got {q.dtype}.")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}.")
    check_window_options(exact, mode, dilation)
    B, H, X, Y, D = q.shape
    if (global_k is None) != (global_v is None):
        raise ValueError("global_k and global_v go together: give both or neither.")
    G = 0
    if global_k is not None:
        G = global_k.shape[2] if global_k.dim() == 4 else -1
        for name, t in (("global_k", global_k), ("global_v", global_v)):
            if t.dim() != 4 or t.shape[:2] != (B, H) or t.shape[3] != D or t.shape[2] != G:
                raise ValueError(f"{name} must have shape (B, heads, G, head_dim) = ({B}, {H}, G, {D}), got {tuple(t.shape)}.")
    if global_bias is not None and global_k is None:
        raise ValueError("global_bias needs global_k and global_v.")
    for name, t, shape in (("rel_bias", rel_bias, (H, (4 * window - 1) ** 2)), ("global_bias", global_bias, (H, G))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape (heads, {'(4w-1)**2' if name == 'rel_bias' else 'G'}) = {shape}, got {tuple(t.shape)}.")
        if t.device != q.device or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor on {q.device}, got {t.dtype} on {t.device}.")
