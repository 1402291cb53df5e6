"""The op layer's public functions: ``local_attention_2d`` (ViL's windows on a map) and ``local_attention_1d``
(Longformer's band over a sequence), with one switch for how they are computed.

Every backend computes the same function; they differ in speed, memory and what they support, which each
declares (:class:`vil.ops.base.Backend`; the table is ``vil/ops/registry.py``). This module validates the inputs
once, builds the neighbourhood (``vil/ops/neighborhood.py``) and the optional inputs as one
:class:`~vil.ops.base.Extras`, picks or checks the backend from its declaration, and hands the request to
``vil/ops/operators.py``, which runs it.

Three limits hold for every backend, as for torch's ``scaled_dot_product_attention``:

- Values must be finite at every position, padded ones and those outside every window included: a value a query does
  not attend to meets a probability of 0 there, and 0 x NaN is NaN. Which rows a NaN or inf in ``v`` reaches differs
  between backends (the keys each one multiplies by zero); where every value is finite, none of them matters.
- In float16 the fused backends (``fused_cpu``, ``sliding_chunk``, ``chunks``, ``chunk_rows``, ``triton``, ``flex``)
  compute scores and softmax in float32; the backends built from autograd's operators (``unfold``, ``unfold_nnf``,
  ``sliding_chunk_autograd``, ``loop``, ``reference``) compute them in float16, as the original release's unfold did,
  so that a scaled score beyond float16's largest value (65504) overflows and its query's row is NaN. bfloat16 has
  float32's range.
- A finite bias so large that it outweighs the scores (``torch.finfo(dtype).min``, say) masks its keys as it does in
  the reference, and a query whose keys all have it averages their values as the reference does; the gradients of
  such a query's output are the reference's only from the backends whose backward keeps probabilities
  (``unfold``, ``unfold_nnf``, ``sliding_chunk_autograd``, ``loop``, ``reference``): the others recompute them from
  a log-sum-exp that so large a value leaves without its fractional part. Mask with -inf or ``key_padding_mask``.
"""

import logging
import math
import numbers
from collections.abc import Sequence
from typing import Optional, Union

import torch

from . import operators, split
from .base import LOG2E, Extras, exporting_to_onnx, listed, needs_grad, tracing
from .neighborhood import Neighborhood1d, Neighborhood2d
from .registry import BACKENDS, available_backends, declaration, default_backend

_log = logging.getLogger(__name__)
_logged_choices = set()
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def local_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    exact: int = 0,
    mode: Union[int, torch.Tensor] = 0,
    global_k: Optional[torch.Tensor] = None,
    global_v: Optional[torch.Tensor] = None,
    rel_bias: Optional[torch.Tensor] = None,
    global_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dilation: int = 1,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Local attention of every position of a 2D map to its window, plus G global keys in the same softmax.

    Args:
        q, k, v: ``(B, heads, X, Y, head_dim)``; the result has the same shape.
        window: chunk size ``w`` (SW_EXACT 0 / -1) or window radius (SW_EXACT 1).
        exact: SW_EXACT: 0 = the 3x3 chunks around the query's chunk, zero padded at the border;
            -1 = the same, wrapping around cyclically; 1 = the exact ``(2w+1)^2`` window.
        mode: 0 = all 9 chunks, -1 = the own chunk only, 1..8 = the own chunk plus one neighbour
            (1:(-1,-1) 2:(-1,0) 3:(-1,+1) 4:(0,-1) 5:(0,+1) 6:(+1,-1) 7:(+1,0) 8:(+1,+1)); only with exact 0/-1.
            Also a 0-dim integer tensor holding one of these values, typically a neighbour 1..8 drawn at random in
            the same program, which torch.compile and torch.export keep in their graph instead of fixing one value.
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
    if isinstance(mode, torch.Tensor):
        if mode.dim() != 0 or mode.dtype not in _INTEGER_DTYPES:  # metadata: torch.compile does not break on it
            raise ValueError(
                f"mode must be an int or a 0-dim integer tensor, got a {mode.dtype} tensor of shape "
                f"{tuple(mode.shape)}."
            )
        if exact == 1:
            raise ValueError(
                "mode as a tensor draws a neighbour chunk, which needs chunked windows (exact 0 or -1); "
                "the exact window (exact 1) takes mode 0 only."
            )
        if not tracing(q) and not exporting_to_onnx():  # an exporter would keep the value drawn now for good
            mode = int(mode)
    drawn_mode = mode if isinstance(mode, torch.Tensor) else None  # read by the operator when it runs
    hood = Neighborhood2d(window, exact, mode if drawn_mode is None else 1, dilation)  # 1: any neighbour, to check
    optional = dict(global_k=global_k, global_v=global_v, rel_bias=rel_bias, global_bias=global_bias)
    _check_types(q, dict(k=k, v=v, **optional), scale)
    if q.dim() != 5:
        raise ValueError(f"q must have shape (B, heads, X, Y, head_dim), got {tuple(q.shape)}.")
    _check_tensors(q, k, v, optional, hood)
    extras = _extras(q, optional, scale)
    hood, extras = split.fitted(hood, q, extras)
    b = _choose(backend, hood, q, needs_grad(q, k, v, *optional.values())) if not exporting_to_onnx() else None
    return _run(b, q, k, v, hood, extras, drawn_mode)


def local_attention_1d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    dilation: Union[int, Sequence[int], torch.Tensor] = 1,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    global_k: Optional[torch.Tensor] = None,
    global_v: Optional[torch.Tensor] = None,
    rel_bias: Optional[torch.Tensor] = None,
    global_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Longformer's sliding-window attention over a sequence, plus G global keys in the same softmax.

    Query ``i`` attends to the global keys and to the window keys ``i + d*a``, ``-w <= a <= w`` (``a <= 0`` when
    ``causal``), that lie in ``[0, L)`` and are not masked by ``key_padding_mask``. A query that sees no key (its
    whole window masked or hidden by -inf biases, no global keys) outputs zeros and gets zero gradients.

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
        backend: one of ``available_backends(dims=1)``; None: :func:`default_backend`.
    """
    optional = dict(global_k=global_k, global_v=global_v, rel_bias=rel_bias, global_bias=global_bias)
    _check_types(q, dict(k=k, v=v, key_padding_mask=key_padding_mask, **optional), scale)
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, heads, L, head_dim), got {tuple(q.shape)}.")
    B, H, L, _ = q.shape
    if isinstance(dilation, torch.Tensor) and tracing(q):  # its values set the shapes: the trace cannot take data
        raise ValueError(
            "Under torch.compile and torch.export give dilation as Python ints (one per head), not a tensor."
        )
    hood = Neighborhood1d.of_heads(window, dilation, causal, H)
    if L == 0:
        raise ValueError("q has length 0; local_attention_1d needs a sequence of at least one position.")
    _check_tensors(q, k, v, optional, hood)
    extras = _extras(q, optional, scale, key_padding_mask)
    hood, extras = split.fitted(hood, q, extras)
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
    b = _choose(backend, hood, q, needs_grad(q, k, v, *optional.values())) if not exporting_to_onnx() else None
    return _run(b, q, k, v, hood, extras)


def _run(b, q, k, v, hood, extras, drawn_mode=None):
    """The request computed by ``b``: eagerly; under torch.compile and torch.export through its own operators (or
    its functions, where the compiler knows them) or else through the generic operator, which also reads a neighbour
    mode drawn in the graph; in an ONNX export (``b`` None: whatever the backend, none runs), as standard tensor
    operators."""
    if exporting_to_onnx():
        if drawn_mode is not None:
            raise ValueError(
                "A neighbour chunk drawn at random (MODE > 0 in training) cannot be exported to ONNX; "
                "export the model in evaluation mode (model.eval())."
            )
        return operators.decomposed_attention(q, k, v, hood, extras)
    if not tracing(q):
        operators.refuse_function_transforms(b, hood.dims, (q, k, v, *extras.differentiable))
    if drawn_mode is not None or (
        tracing(q) and ((b.passes(hood.dims) is None and not b.traceable) or split.splits_by_size(b, hood, q))
    ):
        return operators.recomputed_attention(b, q, k, v, hood, extras, drawn_mode)
    return operators.run_eagerly(b, q, k, v, hood, extras)


def _extras(q, optional, scale, key_padding_mask=None):
    """The optional inputs as the backends take them: no empty global keys, bias tables in q's dtype (they are
    parameters, often float32 next to half-precision activations under autocast), a numeric scale."""
    global_k, global_v, rel_bias, global_bias = optional.values()
    if global_k is not None and global_k.shape[2] == 0:
        global_k = global_v = global_bias = None
    return Extras(
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        global_k=global_k,
        global_v=global_v,
        rel_bias=None if rel_bias is None else _within_base2_range(rel_bias.to(q.dtype)),
        global_bias=None if global_bias is None else _within_base2_range(global_bias.to(q.dtype)),
        key_padding_mask=key_padding_mask,
    )


def _within_base2_range(table):
    """``table`` with its finite biases beyond the dtype's largest value over log2(e) brought to that bound, their
    gradients passed on unchanged. The backends that compute in base 2 multiply the biases by log2(e), which would
    turn such a bias (``torch.finfo(dtype).min``, a common masking value) into -inf, a key the query does not see,
    where the others add a finite value; a bias at the bound outweighs any score just as much. -inf stays -inf."""
    bound = torch.finfo(table.dtype).max / LOG2E
    within = table + (table.clamp(-bound, bound) - table).detach()
    return torch.where(table.isinf(), table, within)


def _choose(backend, hood, q, trains):
    """The backend declaration for this request; one sentence naming the backends that can run it otherwise."""
    dims = hood.dims
    defaulted = backend is None
    if defaulted:
        backend = default_backend(q.device, q.dtype, dims, hood, q)
        if not torch.compiler.is_compiling() and (q.device.type, q.dtype, backend, dims) not in _logged_choices:
            _logged_choices.add((q.device.type, q.dtype, backend, dims))
            _log.info(
                "local_attention_%dd: backend %r for %s on %s (backend=None).", dims, backend, q.dtype, q.device.type
            )
    b = declaration(backend, dims)
    device = q.device.type
    if not b.runs_on(device):
        serves = (lambda n: BACKENDS[n].trains_on_device(device)) if trains else (lambda n: BACKENDS[n].runs_on(device))
        others = [n for n in available_backends(dims) if serves(n)]
        raise ValueError(
            f"The {backend} backend runs on {listed(b.devices)} tensors, but q is on {q.device}; "
            f"backends that {'train' if trains else 'run'} there: {', '.join(others)}."
        )
    if device == "meta":
        raise ValueError(
            "q is on the meta device, which holds no values to attend over; give tensors on a real device."
        )
    if trains and not b.trains_on_device(device):
        others = [n for n in available_backends(dims) if BACKENDS[n].trains_on_device(device)]
        raise ValueError(
            f"The {backend} backend cannot train on the {device.upper()} (it has no backward there); "
            f"backends that can: {', '.join(others)}."
        )
    refusal = b.dtype_refusal(q.dtype)
    if refusal is not None:
        raise ValueError(refusal)
    if defaulted:  # default_backend has checked that the backend it picked is available and takes the request
        return b
    if b.available is not None:
        b.available()
    if b.check is not None:
        b.check(hood, q.shape[-1], q)
    return b


def check_backend(backend: Optional[str], head_dim: int, window: int, exact: int = 0, mode: int = 0) -> None:
    """Raise ``ValueError`` with one sentence if ``backend`` cannot compute these 2D options (device and dtype
    are checked when it runs)."""
    _check_options(backend, Neighborhood2d(window, exact, mode), head_dim)


def check_backend_1d(
    backend: Optional[str],
    heads: int,
    head_dim: int,
    window: int,
    dilation: Union[int, Sequence[int], torch.Tensor] = 1,
    causal: bool = False,
) -> None:
    """Raise ``ValueError`` with one sentence if ``backend`` cannot compute these 1D options of ``heads`` heads
    (device and dtype are checked when it runs); ``dilation`` in any form :func:`local_attention_1d` takes."""
    _check_options(backend, Neighborhood1d.of_heads(window, dilation, causal, heads), head_dim)


def _check_options(backend, hood, head_dim):
    if backend is None:
        return
    b = declaration(backend, hood.dims)
    if b.available is not None:
        b.available()
    if b.check is not None:
        b.check(hood, head_dim)


def check_window_options(exact: int, mode: int) -> None:
    """Raise ``ValueError`` unless ``exact`` (SW_EXACT) and ``mode`` (MODE) are valid together."""
    Neighborhood2d(1, exact, mode)


def _check_types(q, tensors, scale):
    """Dense tensors where tensors belong (not lists, numpy arrays or sparse tensors; q, k and v not None), a finite
    number as the scale."""
    for name, t in dict(q=q, **tensors).items():
        if t is None and name in ("q", "k", "v"):
            raise ValueError(f"{name} must be a torch.Tensor, got None.")
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor, got a {type(t).__name__}; convert it with torch.as_tensor."
            )
        if t is not None and t.layout != torch.strided:
            raise ValueError(
                f"{name} must be a dense (strided) tensor, got layout {t.layout}; convert it with .to_dense()."
            )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        shown = f"a tensor of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else repr(scale)
        raise ValueError(f"scale must be a number (or None for head_dim ** -0.5), got {shown}.")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}.")
    if q.dim() and q.shape[-1] == 0:  # a 0-dim q is refused by the shape checks after this
        raise ValueError(f"q has head_dim 0 (shape {tuple(q.shape)}); attention needs at least one feature per head.")


def _check_tensors(q, k, v, optional, hood):
    """Shapes, dtypes and devices of q, k, v and the ``optional`` tensors (global keys and values, bias tables)."""
    global_k, global_v, rel_bias, global_bias = optional.values()
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
    rows_name = "(4w-1)**2" if hood.dims == 2 else "2w+1"
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
