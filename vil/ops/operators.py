"""Local attention as torch operators, registered through ``torch.library``: ``vil::local_attention_2d`` and
``vil::local_attention_1d`` (each with its ``_backward`` operator) for the backends that have a backward of their
own, and ``vil::recomputed_local_attention_2d`` / ``_1d`` for the others under torch.compile and torch.export.

To ``torch.compile`` and ``torch.export`` a call is one opaque operator: its fake implementation gives the output
shapes from the input shapes and autograd is registered on it, so nothing inside a backend (tables built from the
map size, loops over blocks, C++ or Triton launches) is traced, and symbolic sizes never reach the backend: it
runs with the real tensors. The operator takes the backend's name; a backend file registers its pair of
functions with :func:`register_2d` / :func:`register_1d`.

A forward returns the output and one float per query that only its own backward reads (a log-sum-exp, in the
backend's base). ONNX exports and TorchScript's tracer record the same function in standard tensor operators
instead (:func:`_decomposed_2d`, :func:`_decomposed_1d`).
"""

from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from .backends import reference, unfold
from .neighborhood import Neighborhood1d, Neighborhood2d

_FORWARD_2D, _BACKWARD_2D, _FORWARD_1D, _BACKWARD_1D, _PAIRS_2D, _PAIRS_1D = {}, {}, {}, {}, {}, {}


def register_2d(name, forward, backward, scored_pairs):
    """``forward(q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale) ->
    (out, lse)``, ``lse`` ``(B, heads, X, Y)``; ``backward(q, k, v, global_k, global_v, rel_bias, global_bias, out,
    lse, grad_out, window, exact, mode, dilation, scale)`` -> the seven inputs' gradients (None for absent inputs);
    ``scored_pairs(q, num_global, window, exact, mode, dilation)``: how many (query, key) scores the forward computes
    per (batch, head), for ``torch.utils.flop_counter`` (the forward makes two products over them, the backward five).
    """
    _FORWARD_2D[name], _BACKWARD_2D[name], _PAIRS_2D[name] = forward, backward, scored_pairs


def register_1d(name, forward, backward, scored_pairs):
    """As :func:`register_2d`, with ``key_padding_mask`` after ``global_bias`` and ``(window, dilations, causal,
    scale)`` as options; ``lse`` is ``(B, heads, L)``; ``scored_pairs(q, num_global, window, dilations, causal)``
    counts per batch, over all heads."""
    _FORWARD_1D[name], _BACKWARD_1D[name], _PAIRS_1D[name] = forward, backward, scored_pairs


def tracing(q):
    """Under torch.compile or torch.export: fake tensors, perhaps symbolic sizes."""
    return torch.compiler.is_compiling() or is_fake(q)


def exporting_to_onnx():
    """ONNX exports (either exporter) and TorchScript's tracer record standard operators only."""
    return torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()


def _fake_outputs(q):
    """The output and the per-query residual (one value per query, in the dtype the backends compute in)."""
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))


def _gradients(inputs, grads):
    """Contiguous gradients, as the fake implementations promise; operators cannot return None, so absent
    gradients travel as empty tensors."""
    return [
        g.contiguous() if g is not None else x.new_empty(0) if x is not None else torch.empty(0)
        for x, g in zip(inputs, grads)
    ]


def _fake_gradients(inputs):
    return _gradients(inputs, [None if x is None else x.new_empty(x.shape) for x in inputs])


def _or_none(grads, inputs):
    return tuple(None if x is None else g for x, g in zip(inputs, grads))


# --- 2D -------------------------------------------------------------------------------------------------------


@torch.library.custom_op("vil::local_attention_2d", mutates_args=())
def _attention_2d(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    window: int,
    exact: int,
    mode: int,
    dilation: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    out, lse = _FORWARD_2D[backend](
        q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale
    )
    return out.contiguous(), lse.contiguous()


@_attention_2d.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale):
    return _fake_outputs(q)


@torch.library.custom_op("vil::local_attention_2d_backward", mutates_args=())
def _attention_2d_backward(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    window: int,
    exact: int,
    mode: int,
    dilation: int,
    scale: float,
) -> list[Tensor]:
    inputs = (q, k, v, global_k, global_v, rel_bias, global_bias)
    grads = _BACKWARD_2D[backend](*inputs, out, lse, grad_out.contiguous(), window, exact, mode, dilation, scale)
    return _gradients(inputs, grads)


@_attention_2d_backward.register_fake
def _(
    backend,
    q,
    k,
    v,
    global_k,
    global_v,
    rel_bias,
    global_bias,
    out,
    lse,
    grad_out,
    window,
    exact,
    mode,
    dilation,
    scale,
):
    return _fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


def _setup_2d(ctx, inputs, output):
    backend, *tensors, window, exact, mode, dilation, scale = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.options = backend, window, exact, mode, dilation, scale


def _backward_2d(ctx, grad_out, grad_lse):
    backend, window, exact, mode, dilation, scale = ctx.options
    *inputs, out, lse = ctx.saved_tensors
    grads = _attention_2d_backward(backend, *inputs, out, lse, grad_out, window, exact, mode, dilation, scale)
    return (None, *_or_none(grads, inputs), None, None, None, None, None)


_attention_2d.register_autograd(_backward_2d, setup_context=_setup_2d)


def attention_2d(backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale):
    """The output of ``backend``'s registered 2D forward through the operator, or of any other backend through
    the generic one; a ``mode`` drawn in the graph (a tensor) goes to the generic one, which reads it when it runs."""
    drawn = isinstance(mode, Tensor)
    if exporting_to_onnx():
        if drawn:
            raise ValueError(
                "A neighbour chunk drawn at random (MODE > 0 in training) cannot be exported to ONNX; "
                "export the model in evaluation mode (model.eval())."
            )
        return _decomposed_2d(q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale)
    if drawn or backend not in _FORWARD_2D:
        return _recomputed_2d(
            backend,
            q,
            k,
            v,
            global_k,
            global_v,
            rel_bias,
            global_bias,
            window,
            exact,
            torch.as_tensor(mode),
            dilation,
            scale,
        )
    return _attention_2d(
        backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale
    )[0]


# --- 1D -------------------------------------------------------------------------------------------------------


@torch.library.custom_op("vil::local_attention_1d", mutates_args=())
def _attention_1d(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    window: int,
    dilations: list[int],
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    out, lse = _FORWARD_1D[backend](
        q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale
    )
    return out.contiguous(), lse.contiguous()


@_attention_1d.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale):
    return _fake_outputs(q)


@torch.library.custom_op("vil::local_attention_1d_backward", mutates_args=())
def _attention_1d_backward(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    window: int,
    dilations: list[int],
    causal: bool,
    scale: float,
) -> list[Tensor]:
    inputs = (q, k, v, global_k, global_v, rel_bias, global_bias)
    grads = _BACKWARD_1D[backend](
        *inputs, key_padding_mask, out, lse, grad_out.contiguous(), window, dilations, causal, scale
    )
    return _gradients(inputs, grads)


@_attention_1d_backward.register_fake
def _(
    backend,
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
    return _fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


def _setup_1d(ctx, inputs, output):
    backend, *tensors, window, dilations, causal, scale = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.options = backend, window, dilations, causal, scale


def _backward_1d(ctx, grad_out, grad_lse):
    backend, window, dilations, causal, scale = ctx.options
    *inputs, key_padding_mask, out, lse = ctx.saved_tensors
    grads = _attention_1d_backward(
        backend, *inputs, key_padding_mask, out, lse, grad_out, window, dilations, causal, scale
    )
    return (None, *_or_none(grads, inputs), None, None, None, None, None)


_attention_1d.register_autograd(_backward_1d, setup_context=_setup_1d)


def attention_1d(
    backend, q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale
):
    """The output of ``backend``'s registered 1D forward through the operator, or of any other backend through
    the generic one."""
    if exporting_to_onnx():
        return _decomposed_1d(
            q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale
        )
    if backend not in _FORWARD_1D:
        return _recomputed_1d(
            backend,
            q,
            k,
            v,
            global_k,
            global_v,
            rel_bias,
            global_bias,
            key_padding_mask,
            window,
            list(dilations),
            causal,
            scale,
        )
    return _attention_1d(
        backend,
        q,
        k,
        v,
        global_k,
        global_v,
        rel_bias,
        global_bias,
        key_padding_mask,
        window,
        list(dilations),
        causal,
        scale,
    )[0]


# --- Backends whose backward is autograd's ------------------------------------------------------------------
# Under torch.compile and torch.export they run as one generic operator: the forward with the real tensors and no
# graph, the backward by recomputing the forward with autograd (as activation checkpointing does), so nothing of
# theirs is traced. Eager calls never come here.


def _eager_2d(backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale):
    from .local_attention import local_attention_2d  # the op layer, which imports this file

    return local_attention_2d(
        q,
        k,
        v,
        window,
        exact=exact,
        mode=mode,
        global_k=global_k,
        global_v=global_v,
        rel_bias=rel_bias,
        global_bias=global_bias,
        scale=scale,
        dilation=dilation,
        backend=backend,
    )


def _eager_1d(
    backend, q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale
):
    from .local_attention import local_attention_1d

    return local_attention_1d(
        q,
        k,
        v,
        window,
        dilation=dilations,
        causal=causal,
        key_padding_mask=key_padding_mask,
        global_k=global_k,
        global_v=global_v,
        rel_bias=rel_bias,
        global_bias=global_bias,
        scale=scale,
        backend=backend,
    )


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)


@contextmanager
def _autograd_inside_an_operator():
    """An operator's implementation runs below autograd (its dispatch keys excluded), so autograd would record
    nothing there; this lets it record again, and restores the exclusion after."""
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in _AUTOGRAD_KEYS]
    for key in _AUTOGRAD_KEYS:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for key, was in zip(_AUTOGRAD_KEYS, excluded):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def _autograd_gradients(forward, inputs, grad_out):
    """The gradients of ``forward(*inputs)`` (None for absent inputs), recomputing it with autograd."""
    leaves = [None if x is None else x.detach().requires_grad_() for x in inputs]
    with _autograd_inside_an_operator():
        out = forward(*leaves)
        present = [x for x in leaves if x is not None]
        grads = iter(torch.autograd.grad(out, present, grad_out, allow_unused=True))
    return [None if x is None else next(grads) for x in leaves]


@torch.library.custom_op("vil::recomputed_local_attention_2d", mutates_args=())
def _recomputed_2d(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    window: int,
    exact: int,
    mode: Tensor,
    dilation: int,
    scale: float,
) -> Tensor:
    with torch.no_grad():
        return _eager_2d(
            backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, int(mode), dilation, scale
        ).contiguous()


@_recomputed_2d.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("vil::recomputed_local_attention_2d_backward", mutates_args=())
def _recomputed_2d_backward(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    grad_out: Tensor,
    window: int,
    exact: int,
    mode: Tensor,
    dilation: int,
    scale: float,
) -> list[Tensor]:
    inputs = (q, k, v, global_k, global_v, rel_bias, global_bias)
    grads = _autograd_gradients(
        lambda *xs: _eager_2d(backend, *xs, window, exact, int(mode), dilation, scale), inputs, grad_out
    )
    return _gradients(inputs, grads)


@_recomputed_2d_backward.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, grad_out, window, exact, mode, dilation, scale):
    return _fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


def _setup_recomputed_2d(ctx, inputs, output):
    backend, *tensors, window, exact, mode, dilation, scale = inputs
    ctx.save_for_backward(*tensors, mode)
    ctx.options = backend, window, exact, dilation, scale


def _backward_recomputed_2d(ctx, grad_out):
    backend, window, exact, dilation, scale = ctx.options
    *inputs, mode = ctx.saved_tensors
    grads = _recomputed_2d_backward(backend, *inputs, grad_out, window, exact, mode, dilation, scale)
    return (None, *_or_none(grads, inputs), None, None, None, None, None)


_recomputed_2d.register_autograd(_backward_recomputed_2d, setup_context=_setup_recomputed_2d)


@torch.library.custom_op("vil::recomputed_local_attention_1d", mutates_args=())
def _recomputed_1d(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    window: int,
    dilations: list[int],
    causal: bool,
    scale: float,
) -> Tensor:
    with torch.no_grad():
        return _eager_1d(
            backend,
            q,
            k,
            v,
            global_k,
            global_v,
            rel_bias,
            global_bias,
            key_padding_mask,
            window,
            dilations,
            causal,
            scale,
        ).contiguous()


@_recomputed_1d.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("vil::recomputed_local_attention_1d_backward", mutates_args=())
def _recomputed_1d_backward(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    global_k: Optional[Tensor],
    global_v: Optional[Tensor],
    rel_bias: Optional[Tensor],
    global_bias: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    grad_out: Tensor,
    window: int,
    dilations: list[int],
    causal: bool,
    scale: float,
) -> list[Tensor]:
    inputs = (q, k, v, global_k, global_v, rel_bias, global_bias)
    grads = _autograd_gradients(
        lambda *xs: _eager_1d(backend, *xs, key_padding_mask, window, dilations, causal, scale), inputs, grad_out
    )
    return _gradients(inputs, grads)


@_recomputed_1d_backward.register_fake
def _(
    backend,
    q,
    k,
    v,
    global_k,
    global_v,
    rel_bias,
    global_bias,
    key_padding_mask,
    grad_out,
    window,
    dilations,
    causal,
    scale,
):
    return _fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


def _setup_recomputed_1d(ctx, inputs, output):
    backend, *tensors, window, dilations, causal, scale = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = backend, window, dilations, causal, scale


def _backward_recomputed_1d(ctx, grad_out):
    backend, window, dilations, causal, scale = ctx.options
    *inputs, key_padding_mask = ctx.saved_tensors
    grads = _recomputed_1d_backward(backend, *inputs, key_padding_mask, grad_out, window, dilations, causal, scale)
    return (None, *_or_none(grads, inputs), None, None, None, None, None)


_recomputed_1d.register_autograd(_backward_recomputed_1d, setup_context=_setup_recomputed_1d)


# --- FLOPs (torch.utils.flop_counter): two products over the scored pairs forward, five backward ---------------


def _flops_2d(products, backend, q, global_k, window, exact, mode, dilation):
    pairs = _PAIRS_2D[backend](q, 0 if global_k is None else global_k.shape[2], window, exact, mode, dilation)
    return products * 2 * q.shape[0] * q.shape[1] * pairs * q.shape[-1]


def _flops_1d(products, backend, q, global_k, window, dilations, causal):
    num_global = 0 if global_k is None else global_k.shape[2]
    return products * 2 * q.shape[0] * _PAIRS_1D[backend](q, num_global, window, dilations, causal) * q.shape[-1]


@register_flop_formula(torch.ops.vil.local_attention_2d, get_raw=True)
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale, **kwargs):
    return _flops_2d(2, backend, q, global_k, window, exact, mode, dilation)


@register_flop_formula(torch.ops.vil.local_attention_2d_backward, get_raw=True)
def _(
    backend,
    q,
    k,
    v,
    global_k,
    global_v,
    rel_bias,
    global_bias,
    out,
    lse,
    grad_out,
    window,
    exact,
    mode,
    dilation,
    scale,
    **kwargs,
):
    return _flops_2d(5, backend, q, global_k, window, exact, mode, dilation)


@register_flop_formula(torch.ops.vil.local_attention_1d, get_raw=True)
def _(
    backend,
    q,
    k,
    v,
    global_k,
    global_v,
    rel_bias,
    global_bias,
    key_padding_mask,
    window,
    dilations,
    causal,
    scale,
    **kwargs,
):
    return _flops_1d(2, backend, q, global_k, window, dilations, causal)


@register_flop_formula(torch.ops.vil.local_attention_1d_backward, get_raw=True)
def _(
    backend,
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
    **kwargs,
):
    return _flops_1d(5, backend, q, global_k, window, dilations, causal)


# torch has no formula for its CPU kernel of scaled_dot_product_attention, which would count as no work: every full
# attention (the model's s0 stages, global tokens, other libraries' models) is counted as its CUDA kernels are.


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, get_raw=True)
def _(query, key, value, *args, **kwargs):
    return sdpa_flop_count(query.shape, key.shape, value.shape)


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward, get_raw=True)
def _(grad_out, query, key, value, *args, **kwargs):
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# --- Decompositions -------------------------------------------------------------------------------------------


def _decomposed_2d(q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale):
    """The same output from standard tensor operators (the unfold_nnf backend's computation)."""
    return unfold.UNFOLD_NNF.attention_2d(
        q,
        k,
        v,
        Neighborhood2d(window, exact, mode, dilation),
        global_k=global_k,
        global_v=global_v,
        rel_bias=rel_bias,
        global_bias=global_bias,
        scale=scale,
    )


def _decomposed_1d(
    q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale
):
    """The same output from standard tensor operators (the reference backend's masked attention)."""
    hood = Neighborhood1d(window, tuple(dilations) if len(set(dilations)) > 1 else dilations[0], causal)
    return reference.BACKEND.attention_1d(
        q,
        k,
        v,
        hood,
        global_k=global_k,
        global_v=global_v,
        rel_bias=rel_bias,
        global_bias=global_bias,
        key_padding_mask=key_padding_mask,
        scale=scale,
    )
