"""What every layer of the local attention op shares: the optional inputs of a call as one value (:class:`Extras`),
what a backend declares about itself (:class:`Backend`, with its :class:`FusedPasses`), and whether a call is being
traced or exported. It imports nothing else of the package, so that every other module of it may import it.
"""

import math
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass, replace
from functools import wraps
from typing import Callable, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

LOG2E = math.log2(math.e)  # scores in base 2: exp(x) = exp2(x * LOG2E)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tracing(q: Tensor) -> bool:
    """Under torch.compile or torch.export: fake tensors, perhaps symbolic sizes."""
    return torch.compiler.is_compiling() or is_fake(q)


def static_sizes(sizes) -> bool:
    """Whether ``sizes`` are numbers, not symbolic (torch.export with dynamic sizes, ``dynamic=True``)."""
    return all(isinstance(n, int) for n in sizes)


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a call on these tensors (None for absent ones): a gradient is on and one needs it."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_recording_for_onnx = False  # set by recording_for_onnx


@contextmanager
def recording_for_onnx():
    """While tracing a model for an ONNX file (:func:`vil.export.export_onnx`), or for a program of standard
    operators (:func:`vil.export.export_program`): the op layer records standard operators. A plain flag, so that
    every trace (torch.export's too, strict or not) reads it as set."""
    global _recording_for_onnx
    _recording_for_onnx = True
    try:
        yield
    finally:
        _recording_for_onnx = False


# Where a program or file of one image size comes from, for refusals of exports that need one.
ONE_SIZE_EXPORT = (
    "export at one image size (dynamic_size=False in vil.export.export_program and vil.export.export_onnx, "
    "--static in tools/export_onnx.py)"
)


def exporting_to_onnx() -> bool:
    """ONNX exports (either exporter, and :func:`recording_for_onnx`) and TorchScript's tracer record standard
    operators only."""
    return _recording_for_onnx or torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()


@dataclass(frozen=True, eq=False)
class Extras:
    """The optional inputs of one local attention call, validated by the op: ``global_k``, ``global_v``
    ``(B, heads, G >= 1, head_dim)`` or None; ``rel_bias`` ``(heads, rows)`` and ``global_bias`` ``(heads, G)`` in
    q's dtype or None; ``key_padding_mask`` ``(B, L)`` bool or None (1D only); ``scale``, the factor of the scores."""

    scale: float
    global_k: Optional[Tensor] = None
    global_v: Optional[Tensor] = None
    rel_bias: Optional[Tensor] = None
    global_bias: Optional[Tensor] = None
    key_padding_mask: Optional[Tensor] = None

    @property
    def num_global(self) -> int:
        return 0 if self.global_k is None else self.global_k.shape[2]

    @property
    def differentiable(self) -> tuple:
        """``(global_k, global_v, rel_bias, global_bias)``: the inputs with gradients besides q, k and v, in the
        order of the operators' arguments and of :attr:`FusedPasses.backward`'s results."""
        return self.global_k, self.global_v, self.rel_bias, self.global_bias

    def cast(self, convert: Callable[[Tensor], Tensor]) -> "Extras":
        """The same inputs with ``convert`` applied to each differentiable tensor present."""
        return self.with_differentiable([None if t is None else convert(t) for t in self.differentiable])

    def with_differentiable(self, tensors) -> "Extras":
        """The same inputs with ``tensors`` in place of :attr:`differentiable` (in its order)."""
        return replace(self, **dict(zip(("global_k", "global_v", "rel_bias", "global_bias"), tensors)))

    def of_heads(self, heads: Tensor) -> "Extras":
        """The inputs of the heads ``heads`` (an index tensor)."""
        return replace(
            self,
            global_k=None if self.global_k is None else self.global_k[:, heads],
            global_v=None if self.global_v is None else self.global_v[:, heads],
            rel_bias=None if self.rel_bias is None else self.rel_bias[heads],
            global_bias=None if self.global_bias is None else self.global_bias[heads],
        )


def built_outside_inference_mode(build: Callable) -> Callable:
    """``build`` run outside ``torch.inference_mode()``: tables built inside it would be inference tensors, and a
    cache would hand them to later calls that train, whose backward cannot save them. (Not while a compiler traces:
    dynamo cannot read the mode.)"""

    @wraps(build)
    def tables(*args):
        if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
            return build(*args)
        with torch.inference_mode(False):
            return build(*args)

    return tables


def kept_tables(maxsize: int) -> Callable:
    """``functools.lru_cache(maxsize)`` for functions that build index and mask tables from numbers, except that
    tables built while an export traces the op layer's standard operators (as fake tensors) are not kept: a later
    call with real tensors would get them, and tables are built outside inference mode
    (:func:`built_outside_inference_mode`). Under torch.compile the builder is traced as it is."""

    def wrap(build: Callable) -> Callable:
        kept, lock = OrderedDict(), threading.Lock()
        build_outside = built_outside_inference_mode(build)

        @wraps(build)
        def tables(*args):
            if torch.compiler.is_compiling():
                return build(*args)
            with lock:
                if args in kept:
                    kept.move_to_end(args)
                    return kept[args]
            result = build_outside(*args)
            if not any(is_fake(t) for t in _tensors_in(result)):
                with lock:
                    kept[args] = result
                    if len(kept) > maxsize:
                        kept.popitem(last=False)
            return result

        tables.cache_clear = kept.clear
        return tables

    return wrap


def _tensors_in(value):
    """The tensors in ``value``: itself, or those in its items or dataclass fields, at any depth."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors_in(item)
    elif is_dataclass(value):
        for field in fields(value):
            yield from _tensors_in(getattr(value, field.name))


# Scores per block of the blocked backends (sliding_chunk, chunks): small enough for the CPU's caches and
# allocator, large enough to fill a GPU.
BLOCK_BYTES = {"cpu": 8 << 20, "cuda": 1 << 30}


def items_per_block(item_bytes: int, device: torch.device) -> int:
    """How many items of ``item_bytes`` bytes of scores a block holds: about ``BLOCK_BYTES``, at least one."""
    return max(1, BLOCK_BYTES.get(device.type, BLOCK_BYTES["cuda"]) // item_bytes)


def safe_max(row_max):
    """The maximum to subtract from a row's scores: 0 for rows that see no key (maximum -inf), whose exponentials
    are then all 0 instead of NaN."""
    return row_max.masked_fill(row_max == float("-inf"), 0.0)


def softmax_or_zeros(scores: Tensor, dim: int = -1) -> Tensor:
    """Softmax over ``dim``, zeros (and zero gradients) for a query whose every score there is -inf: one that sees
    no key, hidden by the window, by padding or by -inf biases. The fused backends give the same."""
    sees_any = (scores != float("-inf")).any(dim, keepdim=True)
    return torch.softmax(scores.masked_fill(~sees_any, 0.0), dim) * sees_any


def listed(names) -> str:
    """``names`` as a sentence lists them: "a", "a or b", "a, b or c"."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype the backends compute q's dtype in: float32 for half precision (softmax sums and log-sum-exps need
    its range and precision), float32 and float64 themselves."""
    return torch.promote_types(q.dtype, torch.float32)


def in_float32_or_wider(q: Tensor, k: Tensor, v: Tensor, hood, extras: Extras) -> tuple:
    """A :attr:`Backend.prepare` for passes that compute half precision in float32: q, k, v and the extras' tensors
    in :func:`compute_dtype`."""
    compute = compute_dtype(q)
    return q.to(compute), k.to(compute), v.to(compute), extras.cast(lambda t: t.to(compute))


@dataclass(frozen=True)
class FusedPasses:
    """A backend's own forward and hand-written backward. The op runs them as its ``torch.library`` operators
    (``vil/ops/operators.py``): torch.compile and torch.export see one opaque operator and never trace the passes,
    and autograd calls the backward.

    ``forward(q, k, v, hood, extras) -> (out, lse)``: ``lse`` one float per query (``q.shape[:-1]``, in q's dtype
    promoted to float32) that only the backward reads. ``backward(q, k, v, hood, extras, out, lse, grad_out)`` -> the
    gradients of ``q, k, v`` and of ``extras.differentiable`` (None for absent inputs). ``scored_pairs(q, hood,
    num_global)``: how many (query, key) scores the forward computes per batch item over all heads, for torch's FLOP
    counter (two products over them forward, five backward).
    """

    forward: Callable
    backward: Callable
    scored_pairs: Callable


@dataclass(frozen=True)
class Backend:
    """What one way of computing local attention computes and supports; the op layer (and the Longformer layers'
    operator, ``in_compiled_operators``) reads nothing else of it.

    A backend computes 2D windows, 1D bands or both, each either as a function ``attention_2d`` / ``attention_1d``
    ``(q, k, v, hood, extras) -> out`` whose backward is autograd's, or as :class:`FusedPasses` ``passes_2d`` /
    ``passes_1d``. ``prepare(q, k, v, hood, extras) -> (q, k, v, extras)``: the tensors as the passes take them (their
    compute dtype, their memory layout); it may raise ``ValueError`` for inputs they cannot take.

    ``dilation_2d``, ``dilation_1d``: ``"native"`` (dilated windows in the backend), ``"split"`` (the op runs the
    backend once per sub-lattice of positions with equal residues modulo the dilation, where the window is the
    undilated one). ``per_head_dilation``: 1D, different dilations per head in one call
    (otherwise the op runs the heads of each dilation together). ``devices``: device types it runs on (None: any);
    ``trains_on``: device types where it has a backward (None: wherever it runs). ``available()``: raises
    ``ValueError`` with one sentence where the backend cannot run on this machine (a build, an import).
    ``check(hood, head_dim, q=None)``: raises for options the backend cannot take (and, given the queries ``q``, for
    their dtype, device or shape). ``traceable``: torch.compile and torch.export trace its functions as they are
    (FlexAttention, which the compiler knows); under them, the op runs a backend that has neither passes nor this
    as one generic operator whose backward recomputes its forward. ``twice_differentiable``: the backward of its
    functions is autograd's (gradients of gradients, ``create_graph=True``); False where a backward is hand-written
    (passes, or a function's own autograd.Function), so that a second backward is refused in one sentence.
    ``function_transforms``: forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``) and
    ``torch.func.grad`` differentiate its functions (standard operators all through); False where passes, kernels or
    an autograd.Function of its own compute (they would see no tangent), so that such a call is refused in one
    sentence. ``vmap``: ``torch.func.vmap`` maps its calls (False where an autograd.Function of its own loops over
    the batch, which vmap cannot batch, or where torch's FlexAttention fails under it: refused in one sentence).
    ``extras_in_float32``: it takes the global keys and values and bias tables in float32 beside half-precision q
    (its passes compute them in float32), so that pieces of a split request can share float32 copies.
    ``in_compiled_operators``: it runs inside a custom operator of a torch.compile graph (False for FlexAttention,
    which maps its masks and scores with vmap: torch checks an operator's first call in a compiled graph under a
    dispatch mode that refuses vmap's tensors).
    """

    name: str
    attention_2d: Optional[Callable] = None
    attention_1d: Optional[Callable] = None
    passes_2d: Optional[FusedPasses] = None
    passes_1d: Optional[FusedPasses] = None
    prepare: Optional[Callable] = None
    dilation_2d: str = "native"
    dilation_1d: str = "native"
    per_head_dilation: bool = False
    devices: Optional[tuple] = None
    trains_on: Optional[tuple] = None
    dtypes: tuple = FLOATS
    available: Optional[Callable] = None
    check: Optional[Callable] = None
    traceable: bool = False
    twice_differentiable: bool = True
    function_transforms: bool = True
    vmap: bool = True
    extras_in_float32: bool = False
    in_compiled_operators: bool = True

    def function(self, dims: int) -> Optional[Callable]:
        return self.attention_1d if dims == 1 else self.attention_2d

    def passes(self, dims: int) -> Optional[FusedPasses]:
        return self.passes_1d if dims == 1 else self.passes_2d

    def computes(self, dims: int) -> bool:
        return self.function(dims) is not None or self.passes(dims) is not None

    def dilation(self, dims: int) -> str:
        return self.dilation_1d if dims == 1 else self.dilation_2d

    def runs_on(self, device_type: str) -> bool:
        return self.devices is None or device_type in self.devices

    def trains_on_device(self, device_type: str) -> bool:
        return self.runs_on(device_type) and (self.trains_on is None or device_type in self.trains_on)

    def dtype_refusal(self, dtype: torch.dtype) -> Optional[str]:
        """The sentence that says this backend does not take ``dtype`` inputs; None where it does."""
        if dtype in self.dtypes:
            return None
        return (
            f"The {self.name} backend takes {listed(str(t).split('.')[-1] for t in self.dtypes)} inputs, got {dtype}."
        )
