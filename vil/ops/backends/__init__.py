"""The ways of computing local attention, one file per backend, each named for its backend and declaring it as
``BACKEND`` (:class:`vil.ops.base.Backend`); the table of backends is ``vil/ops/registry.py``. A backend's functions
receive validated inputs: q, k, v, the neighbourhood (``vil/ops/neighborhood.py``) and the optional inputs as one
:class:`vil.ops.base.Extras`.

Backends: ``fused_cpu``, ``triton`` (fused kernels of ``kernels/``), ``sliding_chunk`` (hand-written backward),
``sliding_chunk_autograd``, ``chunk_rows``, ``unfold``, ``unfold_nnf``, ``flex`` (torch's FlexAttention), ``chunks``
and ``loop`` (1D only), ``reference`` (the test oracle). Pieces several backends share: ``chunk_windows.py`` (2D
chunked tensors and windows) and ``band_blocks.py`` (1D sequences in blocks).
"""
