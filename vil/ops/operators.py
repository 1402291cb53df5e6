"""How a chosen backend runs: eagerly, as torch operators registered through ``torch.library``, or as standard tensor
operators in an ONNX export.

``vil::local_attention_2d`` and ``vil::local_attention_1d`` (each with its ``_backward`` operator) run the
:class:`~vil.ops.base.FusedPasses` of the backend they are given by name (plain eager calls run the same passes
under an autograd function, without the operators' dispatch); ``vil::recomputed_local_attention_2d`` /
``_1d`` run any other backend under torch.compile and torch.export. To ``torch.compile`` and ``torch.export`` a
call is one opaque operator: its fake implementation gives the output shapes from the input shapes and autograd is
registered on it, so nothing inside a backend (tables built from the map size, loops over blocks, C++ or Triton
launches) is traced, and symbolic sizes never reach the backend: it runs with the real tensors.

The operators' arguments are flat, as custom operators take them: the backend's name, the tensors, then the
neighbourhood's numbers and the scale. Everything else here takes a request as the op layer holds it (a backend,
q, k, v, a neighbourhood and :class:`~vil.ops.base.Extras`). A fused forward returns the output and one float per
query that only its own backward reads (a log-sum-exp, in the backend's base). ONNX exports and TorchScript's
tracer record the same function in standard tensor operators instead (:func:`decomposed_attention`).
"""

from contextlib import contextmanager
from functools import partial
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import split
from .base import Backend, Extras, compute_dtype, listed, needs_grad, static_sizes, tracing
from .neighborhood import Neighborhood1d, Neighborhood2d
from .registry import BACKENDS

# --- A request, run ------------------------------------------------------------------------------------------------


def run_eagerly(b: Backend, q: Tensor, k: Tensor, v: Tensor, hood, extras: Extras) -> Tensor:
    """``b``'s output for a request, split into the pieces it can take (``vil/ops/split.py``); a request with no
    element (no batch entry, head or map position: ``local_attention_1d`` refuses empty sequences) has nothing to
    compute (:func:`_nothing_to_attend`). Every backend computes in q's dtype, autocast or not: the operators
    that torch.compile and torch.export record run below autocast, so the eager call must not depend on it (the
    fused passes switch it off themselves)."""
    if q.numel() == 0:
        return _nothing_to_attend(q, k, v, extras)
    run = split.run_1d if hood.dims == 1 else split.run_2d
    fused = b.passes(hood.dims) is not None
    attend = partial(fused_attention, b) if fused else b.function(hood.dims)
    if fused:
        out = run(attend, b, q, k, v, hood, extras)
    elif _autocast_may_reach_backward(q, k, v, *extras.differentiable):
        out = _BackwardWithoutAutocast.apply(
            partial(run, attend, b, hood=hood), extras, q, k, v, *extras.differentiable
        )
    else:
        with torch.autocast(q.device.type, enabled=False):
            out = run(attend, b, q, k, v, hood, extras)
    if not fused and not b.twice_differentiable and out.requires_grad:  # the passes refuse themselves
        out = _FirstOrderOnly.apply(out, b.name, hood.dims)
    return out


def _nothing_to_attend(q, k, v, extras: Extras) -> Tensor:
    """The output of a request with no element: empty, of q's shape, on autograd's graph of every input, whose
    gradients are then zeros (empty for q, k, v). No backend runs: the reference's tables of (query, key) pairs grow
    with the square of the positions, whatever the batch (an empty batch of 8192 tokens took 40 s and 7 GB)."""
    out = q * 0
    for t in (k, v, extras.global_k, extras.global_v, extras.rel_bias, extras.global_bias):
        if t is not None and t.requires_grad:
            out = out + t.sum() * 0
    return out


def _autograd_backends(dims, device_type, declared):
    """The names of the backends whose functions autograd differentiates on ``device_type`` and that declare
    ``declared`` (a :class:`~vil.ops.base.Backend` field)."""
    return listed(
        name
        for name, b in BACKENDS.items()
        if b.function(dims) and getattr(b, declared) and b.trains_on_device(device_type)
    )


def refuse_second_order(backend, dims, device_type):
    """Raise, in one sentence naming those that can, for gradients of the gradients of ``backend``'s output."""
    if torch.is_grad_enabled():  # in a backward: create_graph=True
        able = _autograd_backends(dims, device_type, "twice_differentiable")
        raise RuntimeError(
            f"The {backend} backend's backward is not differentiable, so gradients of its gradients "
            f"(create_graph=True) cannot be taken; use a backend whose backward is autograd's: {able}."
        )


def refuse_function_transforms(b: Backend, dims: int, tensors) -> None:
    """Raise, in one sentence naming those that can, where forward-mode AD (``torch.autograd.forward_ad``,
    ``torch.func.jvp``) or ``torch.func.grad`` would differentiate a call of ``b`` that it cannot see through
    (:attr:`~vil.ops.base.Backend.function_transforms`): its output would carry no tangent, a missing or zero
    derivative, or torch would fail inside it; and ``torch.func.vmap`` of a backend that declares it cannot be mapped
    (:attr:`~vil.ops.base.Backend.vmap`)."""
    if b.function_transforms and b.vmap:
        return
    stack = torch._C._functorch.get_interpreter_stack() or ()
    kinds = {interpreter.key() for interpreter in stack}
    TransformType = torch._C._functorch.TransformType
    if not b.vmap and TransformType.Vmap in kinds:
        device = tensors[0].device.type
        able = listed(
            n for n, other in BACKENDS.items() if other.computes(dims) and other.vmap and other.runs_on(device)
        )
        raise RuntimeError(f"torch.func.vmap cannot map the {b.name} backend; use another backend: {able}.")
    if b.function_transforms:
        return
    transform = (
        "torch.func.grad"
        if TransformType.Grad in kinds
        else "forward-mode AD (torch.func.jvp)"
        if TransformType.Jvp in kinds
        else None
    )
    if transform is None and torch.autograd.forward_ad._current_level >= 0:
        present = [t for t in tensors if t is not None]
        if any(torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in present):
            transform = "forward-mode AD (torch.autograd.forward_ad)"
    if transform is not None:
        able = _autograd_backends(dims, tensors[0].device.type, "function_transforms")
        raise RuntimeError(
            f"{transform} cannot differentiate the {b.name} backend, which computes outside autograd; "
            f"use a backend built from standard operators: {able}."
        )


def _autocast_may_reach_backward(*tensors) -> bool:
    """Whether an eager call of a backend built from autograd's operators needs :class:`_BackwardWithoutAutocast`:
    autograd records it under autocast, so its backward may be called inside the autocast region too. (Function
    transforms and forward-mode AD differentiate the backend's operators themselves.)"""
    return (
        needs_grad(*tensors)
        and torch.is_autocast_enabled(tensors[0].device.type)
        and not torch._C._are_functorch_transforms_active()
        and torch.autograd.forward_ad._current_level < 0
    )


class _BackwardWithoutAutocast(torch.autograd.Function):
    """A backend built from autograd's operators, recorded on a graph of its own whose backward runs with autocast off:
    autograd runs each node in the autocast state of the ``backward()`` call, so that a backward inside the autocast
    region of the forward would compute the backend's float32 gradients in half precision. The first backward uses
    the recorded graph; a second one (``retain_graph=True``) or one that builds a graph (``create_graph=True``)
    recomputes the forward from the inputs."""

    @staticmethod
    def forward(ctx, run, extras, q, k, v, *differentiable):
        inputs = (q, k, v, *differentiable)
        ctx.request = run, extras
        ctx.save_for_backward(*inputs)
        ctx.recorded = _recorded_without_autocast(run, extras, inputs, detach=True)
        return ctx.recorded[0].detach()

    @staticmethod
    def backward(ctx, grad_out):
        create_graph = torch.is_grad_enabled()
        if ctx.recorded is None or create_graph:
            out, leaves = _recorded_without_autocast(*ctx.request, ctx.saved_tensors, detach=not create_graph)
        else:
            (out, leaves), ctx.recorded = ctx.recorded, None
        present = [x for x in leaves if x is not None and x.requires_grad]
        with torch.autocast(grad_out.device.type, enabled=False):
            grads = iter(torch.autograd.grad(out, present, grad_out, allow_unused=True, create_graph=create_graph))
        return (None, None, *(next(grads) if x is not None and x.requires_grad else None for x in leaves))


def _recorded_without_autocast(run, extras, inputs, detach):
    """``run``'s output for ``inputs`` (q, k, v and ``extras.differentiable``) recorded by autograd with autocast off,
    and the tensors it was recorded from: ``inputs`` themselves, or leaves detached from them."""
    if detach:
        inputs = [None if x is None else x.detach().requires_grad_(x.requires_grad) for x in inputs]
    q, k, v, *differentiable = inputs
    with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
        out = run(q, k, v, extras=extras.with_differentiable(differentiable))
    return out, inputs


class _FirstOrderOnly(torch.autograd.Function):
    """The identity, whose backward refuses a second-order backward (:func:`refuse_second_order`) before it reaches
    a hand-written backward that would compute it wrong (``once_differentiable`` catches that only where the
    incoming gradient itself requires grad)."""

    @staticmethod
    def forward(ctx, out, backend, dims):
        ctx.request = backend, dims
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_second_order(*ctx.request, grad_out.device.type)
        return grad_out, None, None


def fused_attention(b: Backend, q: Tensor, k: Tensor, v: Tensor, hood, extras: Extras) -> Tensor:
    """``b``'s passes: the inputs as they take them (``b.prepare``), autocast off (the passes choose their dtypes),
    the output in q's dtype. Through its operator where anything watches or transforms operators
    (:func:`_operators_watched`); otherwise through :class:`_EagerPasses`, the same passes without the operator's
    dispatch, whose Python layers cost about as much host time as the passes themselves, or, where nothing needs a
    gradient, the forward pass alone."""
    inputs = b.prepare(q, k, v, hood, extras) if b.prepare is not None else (q, k, v, extras)
    with torch.autocast(q.device.type, enabled=False):
        if _operators_watched(inputs[0]):
            out = _fused_operator(b.name, *inputs, hood)
        else:
            q_in, k_in, v_in, ex = inputs
            tensors = (q_in, k_in, v_in, *ex.differentiable)
            if needs_grad(*tensors):
                out = _EagerPasses.apply(b.name, hood, ex.scale, ex.key_padding_mask, *tensors)
            else:  # nothing to differentiate: the forward pass alone
                out = _forward(b.name, q_in, k_in, v_in, hood, ex)[0]
    return out.to(q.dtype)


def _operators_watched(q: Tensor) -> bool:
    """Whether something here records or transforms operators: torch.compile and torch.export, the profiler,
    dispatch modes (FlopCounterMode, fake tensors, selective checkpointing), functorch's transforms, a tensor
    subclass. Each of them gets the registered operator."""
    return (
        type(q) is not Tensor
        or tracing(q)
        or torch.autograd._profiler_enabled()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._are_functorch_transforms_active()
    )


class _EagerPasses(torch.autograd.Function):
    """One request's fused passes under autograd, as the operators run them (:func:`_forward`, :func:`_backward`)."""

    @staticmethod
    def forward(ctx, backend, hood, scale, key_padding_mask, q, k, v, *differentiable):
        extras = Extras(scale, *differentiable, key_padding_mask)
        out, lse = _forward(backend, q, k, v, hood, extras)
        ctx.save_for_backward(q, k, v, *differentiable, key_padding_mask, out, lse)
        ctx.request = backend, hood, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        backend, hood, scale = ctx.request
        *inputs, key_padding_mask, out, lse = ctx.saved_tensors
        refuse_second_order(backend, hood.dims, out.device.type)
        extras = Extras(scale, *inputs[3:], key_padding_mask)
        grads = _backward(backend, *inputs[:3], hood, extras, out, lse, grad_out)
        return (None, None, None, None, *gradients_or_none(grads, inputs))


def _forward(backend, q, k, v, hood, extras):
    """The fused forward of ``backend``: the output laid out as q, and the per-query residual."""
    out, lse = _passes(backend, hood.dims).forward(q, k, v, hood, extras)
    return laid_out_as(out, q), lse.contiguous()


def _backward(backend, q, k, v, hood, extras, out, lse, grad_out):
    """The fused backward of ``backend``: the gradients of q, k, v and ``extras.differentiable``, autocast off (a
    backward may run inside the autocast region of its forward)."""
    with torch.autocast(q.device.type, enabled=False):
        return _passes(backend, hood.dims).backward(q, k, v, hood, extras, out, lse, laid_out_as(grad_out, out))


def _fused_operator(name, q, k, v, extras, hood):
    tensors = _dense_where_symbolic(q, k, v, *extras.differentiable)
    if hood.dims == 2:
        return _attention_2d(name, *tensors, *_numbers_2d(hood), extras.scale)[0]
    return _attention_1d(name, *tensors, extras.key_padding_mask, *_numbers_1d(hood, q), extras.scale)[0]


def recomputed_attention(b: Backend, q: Tensor, k: Tensor, v: Tensor, hood, extras: Extras, drawn_mode=None):
    """``b``'s output through the generic operator, which runs ``b`` with the real tensors and recomputes its forward
    with autograd for the backward. ``drawn_mode``: a 0-dim tensor holding the 2D neighbour mode, drawn in the
    graph; the operator reads it when it runs."""
    tensors = _dense_where_symbolic(q, k, v, *extras.differentiable)
    if hood.dims == 1:
        return _recomputed_1d(b.name, *tensors, extras.key_padding_mask, *_numbers_1d(hood, q), extras.scale)
    window, exact, mode, dilation = _numbers_2d(hood)
    mode = torch.as_tensor(mode) if drawn_mode is None else drawn_mode
    return _recomputed_2d(b.name, *tensors, window, exact, mode, dilation, extras.scale)


def _dense_where_symbolic(*tensors):
    """The operators' tensors, contiguous where their sizes are symbolic (torch.export, ``dynamic=True``): the layout
    of the outputs and gradients the fake implementations promise (``torch.empty_like``) follows how the strides of
    a strided view compare, which torch decides with guards on the sizes, so that a program of a model whose q, k, v
    are views of a padded map would take only some sizes."""
    return tuple(t.contiguous() if t is not None and not static_sizes(t.shape) else t for t in tensors)


def decomposed_attention(q: Tensor, k: Tensor, v: Tensor, hood, extras: Extras) -> Tensor:
    """The same function from standard tensor operators, for ONNX exports: the unfold_nnf backend's computation in
    2D, the reference's masked attention in 1D."""
    b = BACKENDS["unfold_nnf" if hood.dims == 2 else "reference"]
    run = split.run_1d if hood.dims == 1 else split.run_2d
    return run(b.function(hood.dims), b, q, k, v, hood, extras)


def _numbers_2d(hood):
    return hood.window, hood.exact, hood.mode, hood.dilation


def _numbers_1d(hood, q):
    return hood.window, list(hood.dilations(q.shape[1])), hood.causal


def _hood_2d(window, exact, mode, dilation):
    return Neighborhood2d(window, exact, int(mode), dilation)


def _hood_1d(window, dilations, causal):
    return Neighborhood1d(window, tuple(dilations), causal)


def _passes(name, dims):
    return BACKENDS[name].passes(dims)


# --- The operators' shared pieces --------------------------------------------------------------------------------


def laid_out_as(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (of ``like``'s shape) with the strides ``torch.empty_like(like)`` has, copied only if it has others: an
    operator's output is laid out as its q, a gradient as its input, as the fake implementations promise. ``like``'s
    own strides where it is dense, so that the output of q's head view of a (B, L, heads * head_dim) projection is
    such a view too, and going back to (B, L, dim) copies nothing."""
    if t.stride() == torch.empty_like(like, device="meta").stride():
        return t
    return torch.empty_like(like, dtype=t.dtype).copy_(t)


def _fake_outputs(q):
    """The output and the per-query residual (one value per query, in the dtype the backends compute in)."""
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=compute_dtype(q))


def operator_gradients(inputs, grads):
    """Gradients laid out as their inputs, as the fake implementations promise; operators cannot return None, so
    absent gradients travel as empty tensors."""
    return [
        laid_out_as(g, x) if g is not None else x.new_empty(0) if x is not None else torch.empty(0)
        for x, g in zip(inputs, grads)
    ]


def fake_gradients(inputs):
    return operator_gradients(inputs, [None if x is None else torch.empty_like(x) for x in inputs])


def gradients_or_none(grads, inputs):
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
    extras = Extras(scale, global_k, global_v, rel_bias, global_bias)
    return _forward(backend, q, k, v, _hood_2d(window, exact, mode, dilation), extras)


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
    hood, extras = _hood_2d(window, exact, mode, dilation), Extras(scale, *inputs[3:])
    grads = _backward(backend, q, k, v, hood, extras, out, lse, grad_out)
    return operator_gradients(inputs, grads)


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
    return fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


def _setup_2d(ctx, inputs, output):
    backend, *tensors, window, exact, mode, dilation, scale = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.options = backend, window, exact, mode, dilation, scale


def _backward_2d(ctx, grad_out, grad_lse):
    backend, window, exact, mode, dilation, scale = ctx.options
    *inputs, out, lse = ctx.saved_tensors
    grads = _attention_2d_backward(backend, *inputs, out, lse, grad_out, window, exact, mode, dilation, scale)
    return (None, *gradients_or_none(grads, inputs), None, None, None, None, None)


_attention_2d.register_autograd(_backward_2d, setup_context=_setup_2d)


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
    extras = Extras(scale, global_k, global_v, rel_bias, global_bias, key_padding_mask)
    return _forward(backend, q, k, v, _hood_1d(window, dilations, causal), extras)


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
    hood, extras = _hood_1d(window, dilations, causal), Extras(scale, *inputs[3:], key_padding_mask)
    grads = _backward(backend, q, k, v, hood, extras, out, lse, grad_out)
    return operator_gradients(inputs, grads)


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
    return fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


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
    return (None, *gradients_or_none(grads, inputs), None, None, None, None, None)


_attention_1d.register_autograd(_backward_1d, setup_context=_setup_1d)


# --- Backends without passes under torch.compile and torch.export ------------------------------------------------
# They run as one generic operator: the forward with the real tensors and no graph, the backward by recomputing the
# forward with autograd (as activation checkpointing does), so nothing of theirs is traced. Eager calls never come
# here.


def _request_2d(backend, tensors, window, exact, mode, dilation, scale):
    """The output of ``backend`` for the flat arguments of a 2D operator (``tensors``: q, k, v and the four
    differentiable extras), with the real tensors."""
    q, k, v, *rest = tensors
    extras = Extras(scale, *rest)
    hood, extras = split.fitted(_hood_2d(window, exact, mode, dilation), q, extras)
    return run_eagerly(BACKENDS[backend], q, k, v, hood, extras)


def _request_1d(backend, tensors, key_padding_mask, window, dilations, causal, scale):
    q, k, v, *rest = tensors
    extras = Extras(scale, *rest, key_padding_mask)
    hood, extras = split.fitted(_hood_1d(window, dilations, causal), q, extras)
    return run_eagerly(BACKENDS[backend], q, k, v, hood, extras)


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


def autograd_gradients(forward, inputs, grad_out):
    """The gradients of ``forward(inputs)`` (None for absent inputs, zeros for inputs it does not use, as the fake
    implementations promise: a tensor of the input's shape), recomputing it with autograd."""
    leaves = [None if x is None else x.detach().requires_grad_() for x in inputs]
    with _autograd_inside_an_operator():
        out = forward(leaves)
        present = [x for x in leaves if x is not None]
        grads = iter(torch.autograd.grad(out, present, grad_out, allow_unused=True, materialize_grads=True))
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
    tensors = (q, k, v, global_k, global_v, rel_bias, global_bias)
    with torch.no_grad():
        return laid_out_as(_request_2d(backend, tensors, window, exact, mode, dilation, scale), q)


@_recomputed_2d.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale):
    return torch.empty_like(q)


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
    forward = partial(_request_2d, backend, window=window, exact=exact, mode=mode, dilation=dilation, scale=scale)
    return operator_gradients(inputs, autograd_gradients(forward, inputs, grad_out))


@_recomputed_2d_backward.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, grad_out, window, exact, mode, dilation, scale):
    return fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


def _setup_recomputed_2d(ctx, inputs, output):
    backend, *tensors, window, exact, mode, dilation, scale = inputs
    ctx.save_for_backward(*tensors, mode)
    ctx.options = backend, window, exact, dilation, scale


def _backward_recomputed_2d(ctx, grad_out):
    backend, window, exact, dilation, scale = ctx.options
    *inputs, mode = ctx.saved_tensors
    grads = _recomputed_2d_backward(backend, *inputs, grad_out, window, exact, mode, dilation, scale)
    return (None, *gradients_or_none(grads, inputs), None, None, None, None, None)


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
    tensors = (q, k, v, global_k, global_v, rel_bias, global_bias)
    with torch.no_grad():
        return laid_out_as(_request_1d(backend, tensors, key_padding_mask, window, dilations, causal, scale), q)


@_recomputed_1d.register_fake
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, key_padding_mask, window, dilations, causal, scale):
    return torch.empty_like(q)


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
    forward = partial(
        _request_1d,
        backend,
        key_padding_mask=key_padding_mask,
        window=window,
        dilations=dilations,
        causal=causal,
        scale=scale,
    )
    return operator_gradients(inputs, autograd_gradients(forward, inputs, grad_out))


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
    return fake_gradients((q, k, v, global_k, global_v, rel_bias, global_bias))


def _setup_recomputed_1d(ctx, inputs, output):
    backend, *tensors, window, dilations, causal, scale = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = backend, window, dilations, causal, scale


def _backward_recomputed_1d(ctx, grad_out):
    backend, window, dilations, causal, scale = ctx.options
    *inputs, key_padding_mask = ctx.saved_tensors
    grads = _recomputed_1d_backward(backend, *inputs, key_padding_mask, grad_out, window, dilations, causal, scale)
    return (None, *gradients_or_none(grads, inputs), None, None, None, None, None)


_recomputed_1d.register_autograd(_backward_recomputed_1d, setup_context=_setup_recomputed_1d)


# --- FLOPs (torch.utils.flop_counter): two products over the scored pairs forward, five backward ---------------


def _flops(products, backend, q, global_k, hood):
    num_global = 0 if global_k is None else global_k.shape[2]
    pairs = _passes(backend, hood.dims).scored_pairs(q, hood, num_global)
    return products * 2 * q.shape[0] * pairs * q.shape[-1]


@register_flop_formula(torch.ops.vil.local_attention_2d, get_raw=True)
def _(backend, q, k, v, global_k, global_v, rel_bias, global_bias, window, exact, mode, dilation, scale, **kwargs):
    return _flops(2, backend, q, global_k, _hood_2d(window, exact, mode, dilation))


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
    return _flops(5, backend, q, global_k, _hood_2d(window, exact, mode, dilation))


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
    return _flops(2, backend, q, global_k, _hood_1d(window, dilations, causal))


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
    return _flops(5, backend, q, global_k, _hood_1d(window, dilations, causal))
