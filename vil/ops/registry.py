"""The table of local attention backends, built from their declarations, and the default choice among them.

The op functions (``vil/ops/local_attention.py``), its operators (``vil/ops/operators.py``), the Longformer layers'
operator (``vil/models/longformer.py``), the model's ATTN_TYPE names (``vil/model_config.py``) and the benchmark
tools find backends here; only the tools that study one backend's kernels (``tools/compile_kernels.py``,
``tools/benchmark_precision.py``) import its file. Adding a backend is a file in ``vil/ops/backends/`` that declares
it, and its line in :data:`BACKENDS` (with its name in the import).
"""

import logging
from typing import Optional, Union

import torch

from .backends import (
    chunk_rows,
    chunks,
    flex,
    fused_cpu,
    loop,
    reference,
    sliding_chunk,
    sliding_chunk_autograd,
    triton,
    unfold,
    unfold_nnf,
)
from .neighborhood import Neighborhood1d, Neighborhood2d

# Each backend file declares BACKEND; this order is that of available_backends() and of the messages that list them.
BACKENDS = {
    module.BACKEND.name: module.BACKEND
    for module in (
        sliding_chunk,
        sliding_chunk_autograd,
        triton,
        fused_cpu,
        flex,
        unfold,
        unfold_nnf,
        chunk_rows,
        loop,
        chunks,
        reference,
    )
}
# The fastest backends measured by tools/benchmark_attention.py (see BENCHMARKS.md), in order, per device type and
# window dims; ``backend=None`` takes the first whose declaration fits the request and that can run here. On CUDA the
# Triton kernels lead in 2D and 1D (measured on an H200).
FASTEST = {
    ("cpu", 2): ("fused_cpu", "sliding_chunk"),
    ("cpu", 1): ("fused_cpu", "sliding_chunk"),
    ("cuda", 2): ("triton", "sliding_chunk"),
    ("cuda", 1): ("triton", "sliding_chunk"),
}
FASTEST_ELSEWHERE = ("sliding_chunk",)
_log = logging.getLogger(__name__)
_warned_passed_over = set()


def available_backends(dims: int = 2) -> list[str]:
    """Names accepted by ``local_attention_2d`` (``dims=2``) or ``local_attention_1d`` (``dims=1``)."""
    return [name for name, b in BACKENDS.items() if b.computes(dims)]


def declaration(backend, dims: int):
    """The declaration of the backend named ``backend``; one sentence if there is none or it does not compute
    ``dims``-D windows."""
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a backend's name or None, got a {type(backend).__name__}: {backend!r}.")
    if backend not in BACKENDS:
        able = ", ".join(available_backends(dims))
        raise ValueError(f"Unknown local attention backend {backend!r}; available: {able}.")
    b = BACKENDS[backend]
    if not b.computes(dims):
        able = ", ".join(available_backends(dims))
        raise ValueError(f"The {backend} backend does not compute {dims}D windows; {dims}D backends: {able}.")
    return b


def fastest(device_type: str, dims: int = 2) -> tuple[str, ...]:
    """The backends ``backend=None`` tries for ``dims``-D windows on ``device_type``, fastest first."""
    return FASTEST.get((device_type, dims), FASTEST_ELSEWHERE)


def default_backend(
    device: Union[str, torch.device],
    dtype: torch.dtype,
    dims: int = 2,
    hood: Optional[Union[Neighborhood1d, Neighborhood2d]] = None,
    q: Optional[torch.Tensor] = None,
) -> str:
    """The backend ``backend=None`` uses for tensors on ``device`` with ``dtype``: the fastest measured that
    computes ``dims``-D windows there (see BENCHMARKS.md) and, given the request's neighbourhood ``hood`` and
    queries ``q``, takes them. On the CPU that is ``fused_cpu`` (every dtype; half precision in and out, multiplied
    in half precision where the CPU has the instructions and they outrun float32's, else in float32), or
    ``sliding_chunk`` where its C++ kernel cannot be built; on CUDA ``triton`` (``sliding_chunk`` where its kernels
    cannot take the request, e.g. a head_dim under 16); elsewhere ``sliding_chunk``. Each reason to pass over a
    faster backend is logged once, as a warning."""
    device = torch.device(device)
    passed_over = []
    for name in fastest(device.type, dims):
        b = BACKENDS[name]
        if not b.computes(dims) or not b.runs_on(device.type):
            continue
        refusal = b.dtype_refusal(dtype)
        if refusal is not None:
            passed_over.append(refusal)
            continue
        try:
            if b.available is not None:
                b.available()
            if b.check is not None and hood is not None and q is not None:
                b.check(hood, q.shape[-1], q)
        except ValueError as error:
            passed_over.append(str(error))
            continue
        for reason in passed_over:
            if not torch.compiler.is_compiling() and reason not in _warned_passed_over:
                _warned_passed_over.add(reason)
                _log.warning("%s Using %s instead.", reason, name)
        return name
    return FASTEST_ELSEWHERE[0]
