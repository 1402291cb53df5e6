"""Longformer's self-attention layer (Beltagy et al., 2020) on the sliding-window op ``local_attention_1d``.

Parameter names follow Hugging Face transformers' ``LongformerSelfAttention``, so its state dicts load unchanged.

Sequences of one batch may have different numbers of global tokens, at any positions: the computation depends on
the data (which tokens are global, how many per sequence). Eagerly it runs as it is. Under torch.compile and
torch.export it runs as one operator (``vil::longformer_attention``) whose backward recomputes its forward with
autograd, so the compiler sees no data-dependent shape and adds no graph break. An ONNX export records the same
function from standard operators, densely (every query against every key, as the op's own ONNX decomposition does).
"""

import logging
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as nn_module

from ..ops import Neighborhood1d, check_backend_1d, local_attention_1d
from ..ops.base import exporting_to_onnx, tracing
from ..ops.geometry import pair_in_band
from ..ops.operators import autograd_gradients, fake_gradients, laid_out_as, operator_gradients
from ..ops.registry import declaration

_log = logging.getLogger(__name__)


class Band(NamedTuple):
    """How the layer's op call attends: ``window`` keys on each side, one dilation per head, causal or not, the
    op's backend (None: its default); ``projected``: the global projections come as their outputs for every token
    rather than as weights and biases (see :meth:`SlidingWindowSelfAttention.attend`)."""

    window: int
    dilations: list
    causal: bool
    backend: Optional[str]
    projected: bool


class SlidingWindowSelfAttention:
    """Longformer's self-attention computed with ``local_attention_1d``, for a module that has the projections
    ``query``, ``key``, ``value``, ``query_global``, ``key_global``, ``value_global`` (``nn.Linear``, dim -> dim)
    and the attributes ``num_heads``, ``head_dim``, ``window``, ``dilation``, ``causal`` and ``backend``: this
    project's :class:`LongformerSelfAttention`, and transformers' layers that :func:`vil.accelerate_longformer`
    converts."""

    def attend(self, x: Tensor, padding: Tensor, is_global: Tensor) -> Tensor:
        """``x`` ``(B, L, dim)``; ``padding``, ``is_global`` ``(B, L)`` bool, checked by the caller. Returns
        ``(B, L, dim)``, zeros at padded positions.

        Where the global projections are plain ``nn.Linear`` modules without hooks, the global keys and values are
        not formed for every token while a sequence's global tokens are few (:func:`folding_pays`): their weights
        fold into the global queries' products. Any other module
        there (a low-rank adapter, a quantized linear layer, one with hooks) is called on every token of
        the batch, once per call, with ``(B, L, dim)`` inputs, and said once: slower, the same result. (transformers
        calls them only where a batch has global tokens, with sequence-first inputs, and ``query_global`` only on
        the global tokens: hooks that count calls or read shapes see that difference.)"""
        B, L, dim = x.shape
        q, k, v = (self._heads(proj(x)) for proj in (self.query, self.key, self.value))
        tensors = [x, q, k, v, padding, is_global]
        projections = (self.query_global, self.key_global, self.value_global)
        projected = not all(map(_plain_linear, projections))
        if projected:
            _say_projected(projections)
            tensors += [proj(x) for proj in projections]
        else:
            for proj in projections:
                tensors += [proj.weight, proj.bias]
        dilations = list(Neighborhood1d(self.window, self.dilation, self.causal).dilations(self.num_heads))
        band = Band(self.window, dilations, self.causal, self.backend, projected)
        if exporting_to_onnx():
            out = dense_attention(tensors, band)
        elif tracing(q) and _runs_in_operators(self.backend):
            out = _longformer_attention(tensors, *band)
        else:
            out = sliding_window_attention(tensors, band)
        return out.transpose(1, 2).reshape(B, L, dim)

    def _heads(self, x):
        """(B, L, dim) -> (B, heads, L, head_dim)."""
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)


def _runs_in_operators(name):
    """Whether the layers' operator may run the backend ``name`` under torch.compile; the others are traced as the
    layers' Python code (torch.export's programs run the operator with any)."""
    return name is None or torch.compiler.is_exporting() or declaration(name, 1).in_compiled_operators


def _plain_linear(module) -> bool:
    """Whether ``module`` computes exactly ``F.linear(x, module.weight, module.bias)``, forward and backward: no hook
    of its own or of every module, forward or backward, and no ``forward`` set on the instance (as wrappers such as
    accelerate's hooks do)."""
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
        nn_module._global_forward_hooks,
        nn_module._global_forward_pre_hooks,
        nn_module._global_backward_hooks,
        nn_module._global_backward_pre_hooks,
    )
    plain = type(module) is nn.Linear and module.bias is not None and "forward" not in vars(module)
    return plain and not any(hooks)


_said_projected = set()


def _kind(module) -> str:
    """A global projection as the warning names it: its class with the module that defines it (adapters' classes
    are often called ``Linear`` too), or, for an ``nn.Linear``, what keeps it from being plain."""
    cls = type(module)
    if cls is not nn.Linear:
        return f"{cls.__module__}.{cls.__qualname__}"
    if module.bias is None:
        return "nn.Linear without bias"
    if "forward" in vars(module):
        return "nn.Linear with a forward of its own"
    return "nn.Linear" if _plain_linear(module) else "nn.Linear with hooks"


def _say_projected(projections):
    """Log once per kind of module that the global projections run on every token."""
    kinds = tuple(map(_kind, projections))
    if kinds not in _said_projected and not torch.compiler.is_compiling():
        _said_projected.add(kinds)
        _log.warning(
            "The global projections (%s) are not all plain nn.Linear modules without hooks, so Longformer's "
            "attention calls them on every token (as transformers does) instead of folding their weights into "
            "the global queries' products: the same result, more time and memory.",
            ", ".join(kinds),
        )


def sliding_window_attention(tensors: list, band: Band) -> Tensor:
    """The layer's attention ``(B, heads, L, head_dim)``, zeros at padded positions, from ``tensors``: ``x (B, L,
    dim)``, ``q, k, v (B, heads, L, head_dim)``, ``padding``, ``is_global`` ``(B, L)`` bool, then the weight and the
    bias of ``query_global``, ``key_global`` and ``value_global`` (``band.projected``: their outputs ``(B, L,
    dim)``). Every tensor in q's dtype but the masks, whatever autocast does around it; scores and softmax of the
    global queries in float32 or wider."""
    x, q, k, v, padding, is_global, *projections = tensors
    if (padding & is_global).any():
        raise ValueError("global_mask marks padded positions; a padding token cannot have global attention.")
    counts = is_global.sum(1)
    sizes = counts.unique().tolist()
    if band.causal and any(sizes):
        raise ValueError("A causal layer takes no global tokens: Longformer defines no causal global attention.")
    cast = [x.to(q.dtype)] + [t.to(q.dtype) for t in projections]
    if len(sizes) == 1:
        out = _same_count_attention([cast[0], q, k, v, padding, is_global, *cast[1:]], sizes[0], band)
    else:
        out = torch.empty_like(q)  # laid out as q, as the op's output is
        for g in sizes:
            rows = (counts == g).nonzero().squeeze(1)
            group = [t[rows] for t in (cast[0], q, k, v, padding, is_global)]
            projections = [t[rows] for t in cast[1:]] if band.projected else cast[1:]
            out[rows] = _same_count_attention(group + projections, g, band)
    return out.masked_fill(padding[:, None, :, None], 0.0) if padding.any() else out


def _same_count_attention(tensors, g, band):
    """:func:`sliding_window_attention` of sequences that all have ``g`` global tokens."""
    x, q, k, v, padding, is_global, *projections = tensors
    B, H, L, D = q.shape
    scale = D**-0.5
    positions = is_global.nonzero()[:, 1].view(B, g)  # each sequence's global tokens, in order
    index = positions[:, None, :, None].expand(B, H, g, D)
    out = local_attention_1d(
        q,
        k,
        v,
        band.window,
        dilation=tuple(band.dilations),
        causal=band.causal,
        key_padding_mask=padding | is_global,
        global_k=k.gather(2, index),
        global_v=v.gather(2, index),
        scale=scale,
        backend=band.backend,
    )
    if not g:
        return out
    chosen = positions[..., None].expand(B, g, x.shape[-1])
    folded = False
    if band.projected:
        global_q, global_k, global_v = projections
        global_q = global_q.gather(1, chosen)
    else:
        query_weight, query_bias, *key_value = projections
        global_q = F.linear(x.gather(1, chosen), query_weight, query_bias)
        folded = folding_pays(g, H, x.shape[-1])
        if not folded:
            global_k, global_v = (F.linear(x, weight, bias) for weight, bias in zip(key_value[::2], key_value[1::2]))
    global_q = global_q.view(B, g, H, D).transpose(1, 2)
    if folded:
        global_out = _global_attention(x, global_q * scale, padding, key_value)
    else:
        global_k, global_v = (t.view(B, L, H, D).transpose(1, 2) for t in (global_k, global_v))
        global_out = _masked_attention(global_q, global_k, global_v, ~padding[:, None, None, :])
    if out.requires_grad or global_out.requires_grad:
        return out.scatter(2, index, global_out)
    return out.scatter_(2, index, global_out)  # nothing saved the op's output for a backward: no copy


def folding_pays(g, heads, dim) -> bool:
    """Whether :func:`_global_attention`'s folded products cost less than projecting every token with
    ``key_global`` and ``value_global``: per sequence of L tokens, about ``2 L g heads dim`` multiply-adds folded
    against ``2 L dim^2 + 2 L g dim`` projected, so up to ``g (heads - 1) < dim`` global tokens (69 at
    longformer-base's 768 = 12 x 64)."""
    return g * (heads - 1) < dim


def _global_attention(x, global_q, padding, key_value):
    """The global queries' full attention over every token that is not padding, ``(B, heads, g, head_dim)``,
    without projecting all L tokens with ``key_global`` and ``value_global`` (``key_value``: their weights and
    biases): per head, ``q . (W_k x + b_k) = (W_k^T q) . x + q . b_k``, and since each softmax row sums to 1,
    ``P (W_v x + b_v)^T = W_v (P x) + b_v``, so the L x dim x dim products become L x dim x g ones (g global
    queries)."""
    B, H, g, D = global_q.shape
    key_weight, key_bias, value_weight, value_bias = key_value
    folded = torch.einsum("bhgd,hdc->bhgc", global_q, key_weight.view(H, D, -1)).reshape(B, H * g, -1)
    scores = (folded @ x.transpose(1, 2)).view(B, H, g, -1) + (global_q * key_bias.view(H, 1, D)).sum(-1, True)
    probs = _softmax(scores.masked_fill(padding[:, None, None, :], float("-inf")))
    mixed = (probs.view(B, H * g, -1) @ x).view(B, H, g, -1)  # (B, heads, g, dim), x shared by the heads
    return torch.einsum("bhgc,hdc->bhgd", mixed, value_weight.view(H, D, -1)) + value_bias.view(H, 1, D)


def _softmax(scores):
    """Softmax over the last dimension in float32 or wider, returned in the scores' dtype."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(-1).to(scores.dtype)


def dense_attention(tensors: list, band: Band) -> Tensor:
    """:func:`sliding_window_attention` from standard operators with shapes that depend on the input's shape only,
    for ONNX: every query scores every key (L x L per head) and masks what it may not see. It does not check the
    masks (no data-dependent error in an exported graph)."""
    x, q, k, v, padding, is_global, *projections = tensors
    B, H, L, D = q.shape
    index = torch.arange(L, device=q.device)
    dilation = torch.tensor(band.dilations, device=q.device)[:, None, None]
    in_band, _ = pair_in_band(index[:, None], index[None, :], band.window, dilation, band.causal)  # (H, L, L)
    local_keys = in_band & ~(padding | is_global)[:, None, None, :]
    out = _masked_attention(q, k, v, local_keys | is_global[:, None, None, :])
    x, *projections = (t.to(q.dtype) for t in [x] + projections)
    if not band.projected:
        projections = [F.linear(x, weight, bias) for weight, bias in zip(projections[::2], projections[1::2])]
    global_q, global_k, global_v = (t.view(B, L, H, D).transpose(1, 2) for t in projections)
    global_out = _masked_attention(global_q, global_k, global_v, ~padding[:, None, None, :])
    out = torch.where(is_global[:, None, :, None], global_out, out)
    return out.masked_fill(padding[:, None, :, None], 0.0)


def _masked_attention(q, k, v, seen):
    """Softmax attention of every query over the keys ``seen`` (broadcast to ``(B, heads, L, L)``); a query that
    sees no key (a padded one) gives NaN, which the caller replaces."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return _softmax(scores.masked_fill(~seen, float("-inf"))) @ v


# --- Under torch.compile and torch.export: one operator --------------------------------------------------------


@torch.library.custom_op("vil::longformer_attention", mutates_args=())
def _longformer_attention(
    tensors: list[Tensor], window: int, dilations: list[int], causal: bool, backend: Optional[str], projected: bool
) -> Tensor:
    band = Band(window, dilations, causal, backend, projected)
    with torch.no_grad():
        return laid_out_as(sliding_window_attention(tensors, band), tensors[1])


@_longformer_attention.register_fake
def _(tensors, window, dilations, causal, backend, projected):
    return torch.empty_like(tensors[1])


@torch.library.custom_op("vil::longformer_attention_backward", mutates_args=())
def _longformer_attention_backward(
    tensors: list[Tensor],
    grad_out: Tensor,
    window: int,
    dilations: list[int],
    causal: bool,
    backend: Optional[str],
    projected: bool,
) -> list[Tensor]:
    x, q, k, v, padding, is_global, *projections = tensors
    band = Band(window, dilations, causal, backend, projected)

    def forward(leaves):
        x, q, k, v, *projections = leaves
        return sliding_window_attention([x, q, k, v, padding, is_global, *projections], band)

    differentiable = [x, q, k, v, *projections]
    return operator_gradients(differentiable, autograd_gradients(forward, differentiable, grad_out))


@_longformer_attention_backward.register_fake
def _(tensors, grad_out, window, dilations, causal, backend, projected):
    x, q, k, v, padding, is_global, *projections = tensors
    return fake_gradients([x, q, k, v, *projections])


def _setup_longformer_attention(ctx, inputs, output):
    tensors, *band = inputs
    ctx.save_for_backward(*tensors)
    ctx.band = band


def _backward_longformer_attention(ctx, grad_out):
    tensors = list(ctx.saved_tensors)
    x, q, k, v, *projections = _longformer_attention_backward(tensors, grad_out, *ctx.band)
    return [x, q, k, v, None, None, *projections], None, None, None, None, None


_longformer_attention.register_autograd(_backward_longformer_attention, setup_context=_setup_longformer_attention)


class LongformerSelfAttention(SlidingWindowSelfAttention, nn.Module):
    """Multi-head self-attention of a sequence: a sliding window for every token, full attention for a few
    global ones. No output projection (Longformer's self-attention layer has none) and no attention dropout
    (the op computes the softmax inside).

    A token that is not global attends, in one softmax, to the keys of its window (``query``, ``key``, ``value``
    projections; keys ``i + d*a``, ``|a| <= window``, ``a <= 0`` when ``causal``) from which padding and global
    tokens are removed, and to every global token of its sequence (the same ``key`` and ``value`` projections).
    A global token attends with ``query_global`` to the ``key_global``, ``value_global`` projections of every token
    that is not padding. Scores are scaled by ``head_dim ** -0.5``. Padded positions output zeros; a padded token
    cannot be global.

    Sequences may have different numbers of global tokens. The op's global keys have one count for the whole batch
    and its global bias is per head, so a missing global slot of one sequence cannot be masked; the batch is
    instead split into groups of sequences with the same number of global tokens, one op call per group (a single
    call when all sequences have the same number, the usual case).

    Args:
        dim: features of a token.
        num_heads: attention heads; ``dim`` must divide by it.
        window: keys on each side of a query (Hugging Face's ``attention_window // 2``).
        dilation: an int, or one int per head.
        causal: only keys at or before the query. Longformer defines no causal global attention, so a causal
            layer refuses global tokens (an all-False ``global_mask`` is fine).
        backend: the op's backend (``vil.ops.available_backends(1)``); None: its default.
    """

    def __init__(self, dim, num_heads, window, dilation=1, causal=False, backend=None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}).")
        check_backend_1d(backend, num_heads, dim // num_heads, window, dilation, causal)  # raises for bad values
        dilation = Neighborhood1d.of_heads(window, dilation, causal, num_heads).dilation
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.window, self.dilation, self.causal, self.backend = window, dilation, causal, backend
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.query_global = nn.Linear(dim, dim)
        self.key_global = nn.Linear(dim, dim)
        self.value_global = nn.Linear(dim, dim)

    def forward(self, x, key_padding_mask=None, global_mask=None):
        """``x`` ``(B, L, dim)``; ``key_padding_mask``, ``global_mask`` ``(B, L)`` bool, True for padding and for
        tokens with global attention. Returns ``(B, L, dim)``."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, L, dim={self.dim}), got {tuple(x.shape)}.")
        B, L, _ = x.shape
        for name, mask in (("key_padding_mask", key_padding_mask), ("global_mask", global_mask)):
            if mask is not None and (
                tuple(mask.shape) != (B, L) or mask.dtype != torch.bool or mask.device != x.device
            ):
                raise ValueError(
                    f"{name} must be a bool tensor of shape (B, L) = ({B}, {L}) on {x.device}, got "
                    f"{mask.dtype} of shape {tuple(mask.shape)} on {mask.device}."
                )
        padding = torch.zeros(B, L, dtype=torch.bool, device=x.device) if key_padding_mask is None else key_padding_mask
        return self.attend(x, padding, torch.zeros_like(padding) if global_mask is None else global_mask)
