"""The op layer: ``local_attention_2d`` (ViL's windows on a map) and ``local_attention_1d`` (Longformer's band over
a sequence), with one switch for how they are computed.

Every backend computes the same function; they differ in speed, memory and what they support, which each
declares (:class:`vil.ops.backends.Backend`). This module validates the inputs once, builds the neighbourhood
(``vil/ops/neighborhood.py``), picks or checks the backend from its declaration, and splits a request the
backend cannot take whole (dilation by sub-lattice, per-head dilations by head) into ones it can.
"""

import logging
import numbers

import torch

from . import operators
from .backends import (
    chunk_rows,
    chunks_1d,
    flex,
    fused_cpu,
    fused_triton,
    loop_1d,
    reference,
    sliding_chunk,
    sliding_chunk_autograd,
    unfold,
)
from .neighborhood import Neighborhood1d, Neighborhood2d

_BACKENDS = {
    b.name: b
    for b in (
        sliding_chunk.BACKEND,
        sliding_chunk_autograd.BACKEND,
        fused_triton.BACKEND,
        fused_cpu.BACKEND,
        flex.BACKEND,
        unfold.UNFOLD,
        unfold.UNFOLD_NNF,
        chunk_rows.BACKEND,
        loop_1d.BACKEND,
        chunks_1d.BACKEND,
        reference.BACKEND,
    )
}
# The fastest backends measured by tools/benchmark_attention.py (see BENCHMARKS.md), in order, per device type;
# ``backend=None`` takes the first whose declaration fits the request and that can run here.
_FASTEST = {"cpu": ("fused_cpu", "sliding_chunk")}
_FASTEST_ELSEWHERE = ("sliding_chunk",)
_log = logging.getLogger(__name__)
_logged_choices = set()


def available_backends(dims=2):
    """Names accepted by ``local_attention_2d`` (``dims=2``) or ``local_attention_1d`` (``dims=1``)."""
    return [name for name, b in _BACKENDS.items() if b.computes(dims)]


def default_backend(device, dtype, dims=2):
    """The backend ``backend=None`` uses for tensors on ``device`` with ``dtype``: the fastest measured that
    computes ``dims``-D windows there (see BENCHMARKS.md). On the CPU that is ``fused_cpu`` (every dtype; half
    precision is computed in float32), or ``sliding_chunk`` with one warning where its C++ kernel cannot be
    built; elsewhere ``sliding_chunk``. The Triton kernels are chosen explicitly (``backend="triton"``) until GPU
    measurements make them the default there."""
    device_type = torch.device(device).type
    for name in _FASTEST.get(device_type, _FASTEST_ELSEWHERE):
        b = _BACKENDS[name]
        if not b.computes(dims) or not _runs_on(b.devices, device_type) or dtype not in b.dtypes:
            continue
        try:
            if b.available is not None:
                b.available()
        except ValueError as error:
            if not torch.compiler.is_compiling() and ("unavailable", name) not in _logged_choices:
                _logged_choices.add(("unavailable", name))
                fallback = _FASTEST[device_type][-1]
                _log.warning("%s Using %s on the CPU instead, about 2x slower.", error, fallback)
            continue
        return name
    return _FASTEST_ELSEWHERE[0]


def _choose(backend, hood, q, trains):
    """The backend declaration for this request; one sentence naming the backends that can run it otherwise."""
    dims = hood.dims
    if backend is None:
        backend = default_backend(q.device, q.dtype, dims)
        if not torch.compiler.is_compiling() and (q.device.type, q.dtype, backend, dims) not in _logged_choices:
            _logged_choices.add((q.device.type, q.dtype, backend, dims))
            _log.info(
                "local_attention_%dd: backend %r for %s on %s (backend=None).", dims, backend, q.dtype, q.device.type
            )
    able = available_backends(dims)
    if backend not in _BACKENDS:
        raise ValueError(f"Unknown local attention backend {backend!r}; available: {', '.join(able)}.")
    b = _BACKENDS[backend]
    if not b.computes(dims):
        raise ValueError(
            f"The {backend} backend does not compute {dims}D windows; {dims}D backends: {', '.join(able)}."
        )
    if hood.dilated and b.dilation(dims) is None:
        others = [n for n in able if _BACKENDS[n].dilation(dims) is not None]
        raise ValueError(
            f"The {backend} backend computes undilated windows only; backends with dilation: {', '.join(others)}."
        )
    device = q.device.type
    if not _runs_on(b.devices, device):
        others = [n for n in able if _runs_on(_BACKENDS[n].devices, device)]
        raise ValueError(
            f"The {backend} backend runs on {_listed(b.devices)} tensors, but q is on {q.device}; "
            f"backends that run there: {', '.join(others)}."
        )
    if device == "meta":
        raise ValueError(
            "q is on the meta device, which holds no values to attend over; give tensors on a real device."
        )
    if trains and not _runs_on(b.trains_on, device):
        others = [
            n for n in able if _runs_on(_BACKENDS[n].devices, device) and _runs_on(_BACKENDS[n].trains_on, device)
        ]
        raise ValueError(
            f"The {backend} backend cannot train on the {device.upper()} (it has no backward there); "
            f"backends that can: {', '.join(others)}."
        )
    if q.dtype not in b.dtypes:
        raise ValueError(
            f"The {backend} backend takes {_listed([str(t).split('.')[-1] for t in b.dtypes])} inputs, got {q.dtype}."
        )
    if b.available is not None:
        b.available()
    if b.check is not None:
        b.check(hood, q.shape[-1])
    return b


def _runs_on(devices, device_type):
    return devices is None or device_type in devices


def _listed(names):
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
            Also a 0-dim integer tensor holding one of 1..8: a neighbour drawn at random in the same program, which
            torch.compile and torch.export keep in their graph instead of fixing one value.
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
    if isinstance(mode, torch.Tensor) and not operators.tracing(q):
        mode = int(mode)
    drawn_mode = mode if isinstance(mode, torch.Tensor) else None  # read by the operator when it runs
    hood = Neighborhood2d(window, exact, mode if drawn_mode is None else 1, dilation)  # 1: any neighbour, to check
    _check_types(
        q=q, k=k, v=v, global_k=global_k, global_v=global_v, rel_bias=rel_bias, global_bias=global_bias, scale=scale
    )
    if q.dim() != 5:
        raise ValueError(f"q must have shape (B, heads, X, Y, head_dim), got {tuple(q.shape)}.")
    _check_tensors(q, k, v, global_k, global_v, rel_bias, global_bias, hood, "(4w-1)**2")
    rows, cols = q.shape[2:4]
    static = isinstance(rows, int) and isinstance(cols, int)  # not symbolic sizes under torch.compile/export
    if rel_bias is None and static:
        hood = hood.fitted(rows, cols)
    b = _choose(backend, hood, q, _needs_grad(q, k, v, global_k, global_v, rel_bias, global_bias))
    inputs = _common_inputs(q, global_k, global_v, rel_bias, global_bias, scale)
    if drawn_mode is not None or _traced_as_one_operator(b, q):
        return operators.attention_2d(
            b.name,
            q,
            k,
            v,
            *_tensor_inputs(inputs),
            hood.window,
            hood.exact,
            hood.mode if drawn_mode is None else drawn_mode,
            hood.dilation,
            inputs["scale"],
        )
    if q.numel() == 0:  # nothing to compute: the reference handles empty batches and maps
        b = reference.BACKEND
    # A dilation beyond a side of the map leaves too little of it for a backend's own dilated windows.
    if hood.dilated and (b.dilation(2) == "split" or (static and hood.dilation >= min(rows, cols))):
        return _per_sub_lattice(b.attention_2d, q, k, v, hood, inputs)
    return b.attention_2d(q, k, v, hood, **inputs)


def local_attention_1d(
    q,
    k,
    v,
    window,
    *,
    dilation=1,
    causal=False,
    key_padding_mask=None,
    global_k=None,
    global_v=None,
    rel_bias=None,
    global_bias=None,
    scale=None,
    backend=None,
):
    """Longformer's sliding-window attention over a sequence, plus G global keys in the same softmax.

    Query ``i`` attends to the global keys and to the window keys ``i + d*a``, ``-w <= a <= w`` (``a <= 0`` when
    ``causal``), that lie in ``[0, L)`` and are not masked by ``key_padding_mask``. A query that sees no key (its
    whole window masked, no global keys) outputs zeros and gets zero gradients.

    Args:
        q, k, v: ``(B, heads, L, head_dim)``; the result has the same shape.
        window: ``w >= 1``, keys on each side of the query (one-sided).
        dilation: an int, or one int per head (Longformer's per-head dilation).
        causal: only keys at or before the query (``a <= 0``).
        key_padding_mask: ``(B, L)`` bool, True where a position is never a window key.
        global_k, global_v: ``(B, heads, G, head_dim)``: keys every query also attends to.
        rel_bias: ``(heads, 2w+1)``: row ``a + w`` is added for the key at offset ``a`` (in steps of the
            dilation, so the table means the same under any dilation).
        global_bias: ``(heads, G)``: bias added to the scores of the global keys.
        scale: factor of the scores; ``head_dim ** -0.5`` when None.
        backend: one of ``available_backends(dims=1)``; None: ``default_backend(device, dtype, dims=1)``.
    """
    _check_types(
        q=q,
        k=k,
        v=v,
        key_padding_mask=key_padding_mask,
        global_k=global_k,
        global_v=global_v,
        rel_bias=rel_bias,
        global_bias=global_bias,
        scale=scale,
    )
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, heads, L, head_dim), got {tuple(q.shape)}.")
    B, H, L, _ = q.shape
    if isinstance(dilation, torch.Tensor):
        dilation = dilation.tolist()
    if isinstance(dilation, (list, tuple)):
        if len(dilation) != H:
            raise ValueError(f"dilation must be one int or one int per head ({H}), got {len(dilation)} values.")
        dilation = tuple(dilation)
    hood = Neighborhood1d(window, dilation, causal)
    if L == 0:
        raise ValueError("q has length 0; local_attention_1d needs a sequence of at least one position.")
    _check_tensors(q, k, v, global_k, global_v, rel_bias, global_bias, hood, "2w+1")
    if rel_bias is None and isinstance(L, int):
        hood = hood.fitted(L)
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (B, L) or key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be a bool tensor of shape (B, L) = ({B}, {L}), got "
                f"{key_padding_mask.dtype} of shape {tuple(key_padding_mask.shape)}."
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}; both must match."
            )
    b = _choose(backend, hood, q, _needs_grad(q, k, v, global_k, global_v, rel_bias, global_bias))
    inputs = _common_inputs(q, global_k, global_v, rel_bias, global_bias, scale)
    if _traced_as_one_operator(b, q):
        return operators.attention_1d(
            b.name,
            q,
            k,
            v,
            *_tensor_inputs(inputs),
            key_padding_mask,
            hood.window,
            hood.dilations(H),
            hood.causal,
            inputs["scale"],
        )
    if q.numel() == 0:
        b = reference.BACKEND
    return _run_1d(b, q, k, v, hood, dict(inputs, key_padding_mask=key_padding_mask))


def _traced_as_one_operator(b, q):
    """Under torch.compile and torch.export (fake tensors, symbolic sizes) a backend that is not traced as it is
    runs as one generic operator (``vil/ops/operators.py``), so that its tables and loops see real sizes; an
    ONNX export records the operators' decomposition, whatever the backend."""
    return operators.exporting_to_onnx() or (not b.traced_as_is and operators.tracing(q))


def _tensor_inputs(inputs):
    return inputs["global_k"], inputs["global_v"], inputs["rel_bias"], inputs["global_bias"]


def _common_inputs(q, global_k, global_v, rel_bias, global_bias, scale):
    """The keyword inputs of a backend: no empty global keys, bias tables in q's dtype, a numeric scale."""
    if global_k is not None and global_k.shape[2] == 0:
        global_k = global_v = global_bias = None
    # Bias tables are parameters, often float32 next to half-precision activations (autocast).
    return dict(
        global_k=global_k,
        global_v=global_v,
        rel_bias=None if rel_bias is None else rel_bias.to(q.dtype),
        global_bias=None if global_bias is None else global_bias.to(q.dtype),
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
    )


def _per_sub_lattice(fn, q, k, v, hood, inputs):
    """Dilated exact windows for a backend without them: the positions whose row and column have the same
    residues modulo the dilation form a map of their own, on which the window is the undilated one."""
    d, out = hood.dilation, torch.empty_like(q)
    for r in range(min(d, q.shape[2])):
        for c in range(min(d, q.shape[3])):
            part = (slice(None), slice(None), slice(r, None, d), slice(c, None, d))
            out[part] = fn(
                q[part].contiguous(), k[part].contiguous(), v[part].contiguous(), hood.with_dilation(1), **inputs
            )
    return out


def _run_1d(b, q, k, v, hood, inputs):
    """Runs a 1D backend, split by head where it cannot take different dilations per head, and by residue class
    where it has no dilated windows of its own (the positions ``r, r+d, r+2d, ...`` are a sequence of their own
    on which the window is the undilated one)."""
    if hood.per_head and not b.per_head_dilation:
        out = torch.empty_like(q)
        dilations = hood.dilation
        for d in sorted(set(dilations)):
            heads = torch.tensor([h for h, x in enumerate(dilations) if x == d], device=q.device)
            part = {name: _select_heads(name, t, heads) for name, t in inputs.items()}
            out[:, heads] = _run_1d(b, q[:, heads], k[:, heads], v[:, heads], hood.with_dilation(d), part)
        return out
    if hood.dilated and b.dilation(1) == "split":
        d, out = hood.dilation, torch.empty_like(q)
        mask = inputs["key_padding_mask"]
        for r in range(min(d, q.shape[2])):
            part = dict(inputs, key_padding_mask=None if mask is None else mask[:, r::d])
            out[:, :, r::d] = b.attention_1d(q[:, :, r::d], k[:, :, r::d], v[:, :, r::d], hood.with_dilation(1), **part)
        return out
    return b.attention_1d(q, k, v, hood, **inputs)


def _select_heads(name, t, heads):
    if t is None or name in ("scale", "key_padding_mask"):
        return t
    return t[heads] if name in ("rel_bias", "global_bias") else t[:, heads]


def check_backend(backend, head_dim, window, exact=0, mode=0, dilation=1):
    """Raise ``ValueError`` with one sentence if ``backend`` cannot compute these 2D options (device and dtype
    are checked when it runs)."""
    hood = Neighborhood2d(window, exact, mode, dilation)
    if backend is None:
        return
    if backend not in _BACKENDS or not _BACKENDS[backend].computes(2):
        raise ValueError(f"Unknown local attention backend {backend!r}; available: {', '.join(available_backends(2))}.")
    b = _BACKENDS[backend]
    if b.available is not None:
        b.available()
    if b.check is not None:
        b.check(hood, head_dim)


def check_window_options(exact, mode, dilation=1):
    """Raise ``ValueError`` unless ``exact`` (SW_EXACT), ``mode`` (MODE) and ``dilation`` are valid together."""
    Neighborhood2d(1, exact, mode, dilation)


def _check_types(scale, **tensors):
    """Tensors where tensors belong (not lists or numpy arrays), a number as the scale."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor, got a {type(t).__name__}; convert it with torch.as_tensor."
            )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise ValueError(f"scale must be a number (or None for head_dim ** -0.5), got {scale!r}.")
    q = tensors["q"]
    if q.shape[-1] == 0:
        raise ValueError(f"q has head_dim 0 (shape {tuple(q.shape)}); attention needs at least one feature per head.")


def _check_tensors(q, k, v, global_k, global_v, rel_bias, global_bias, hood, rows_name):
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}.")
    for name, t in (("k", k), ("v", v), ("global_k", global_k), ("global_v", global_v)):
        if t is not None and (t.dtype != q.dtype or t.device != q.device):
            raise ValueError(f"{name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; all must match.")
    if not q.is_floating_point():
        raise ValueError(f"q, k and v must be floating point, got {q.dtype}.")
    B, H, D = q.shape[0], q.shape[1], q.shape[-1]
    if (global_k is None) != (global_v is None):
        raise ValueError("global_k and global_v go together: give both or neither.")
    G = 0
    if global_k is not None:
        G = global_k.shape[2] if global_k.dim() == 4 else -1
        for name, t in (("global_k", global_k), ("global_v", global_v)):
            if t.dim() != 4 or t.shape[:2] != (B, H) or t.shape[3] != D or t.shape[2] != G:
                raise ValueError(
                    f"{name} must have shape (B, heads, G, head_dim) = ({B}, {H}, G, {D}), got {tuple(t.shape)}."
                )
    if global_bias is not None and global_k is None:
        raise ValueError("global_bias needs global_k and global_v.")
    for name, t, shape, shape_name in (
        ("rel_bias", rel_bias, (H, hood.bias_rows), rows_name),
        ("global_bias", global_bias, (H, G), "G"),
    ):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape (heads, {shape_name}) = {shape}, got {tuple(t.shape)}.")
        if t.device != q.device or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor on {q.device}, got {t.dtype} on {t.device}.")
