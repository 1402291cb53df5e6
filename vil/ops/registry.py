"""The table of local attention backends, built from their declarations, and the default choice among them.

The op functions (``vil/ops/local_attention.py``), its operators (``vil/ops/operators.py``), the model's ATTN_TYPE
names (``vil/model_config.py``) and the benchmark tools read backends from here and nowhere else. Adding a backend
is a file in ``vil/ops/backends/`` that declares it, and its line in :data:`BACKENDS` (with its name in the import).
"""

import logging
from typing import Union

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
# The fastest backends measured by tools/benchmark_attention.py (see BENCHMARKS.md), in order, per device type;
# ``backend=None`` takes the first whose declaration fits the request and that can run here.
FASTEST = {"cpu": ("fused_cpu", "sliding_chunk")}
FASTEST_ELSEWHERE = ("sliding_chunk",)
_log = logging.getLogger(__name__)
_warned_unavailable = set()


def available_backends(dims: int = 2) -> list[str]:
    """Names accepted by ``local_attention_2d`` (``dims=2``) or ``local_attention_1d`` (``dims=1``)."""
    return [name for name, b in BACKENDS.items() if b.computes(dims)]


def default_backend(device: Union[str, torch.device], dtype: torch.dtype, dims: int = 2) -> str:
    """The backend ``backend=None`` uses for tensors on ``device`` with ``dtype``: the fastest measured that
    computes ``dims``-D windows there (see BENCHMARKS.md). On the CPU that is ``fused_cpu`` (every dtype; half
    precision in and out, computed in float32), or ``sliding_chunk`` with one warning where its C++ kernel cannot be
    built; elsewhere ``sliding_chunk``. The Triton kernels are chosen explicitly (``backend="triton"``) until GPU
    measurements make them the default there."""
    device_type = torch.device(device).type
    preferred = FASTEST.get(device_type, FASTEST_ELSEWHERE)
    for name in preferred:
        b = BACKENDS[name]
        if not b.computes(dims) or not b.runs_on(device_type) or dtype not in b.dtypes:
            continue
        try:
            if b.available is not None:
                b.available()
        except ValueError as error:
            if not torch.compiler.is_compiling() and name not in _warned_unavailable:
                _warned_unavailable.add(name)
                _log.warning("%s Using %s on the CPU instead, about 2x slower.", error, preferred[-1])
            continue
        return name
    return FASTEST_ELSEWHERE[0]
