"""The fused Triton kernels of ``kernels/`` (package ``vil_kernels``): flash-style, O(tokens x head_dim) memory.

Triton is imported on first use, so that ``import vil`` stays light and ``TRITON_INTERPRET`` (read when the
kernels are defined) can still be set before that.
"""


def _kernels():
    try:
        from vil_kernels import local_attention
    except ImportError as error:
        raise ValueError(f"The triton backend needs the triton package, which does not import here ({error}).") from error
    return local_attention


def fused_triton(q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale, dilation=1):
    return _kernels().local_attention_2d_triton(
        q, k, v, window, exact, mode, global_k, global_v, rel_bias, global_bias, scale, dilation=dilation
    )


def check_fused_triton(head_dim, window):
    """Raise ``ValueError`` with one sentence if the kernels cannot take this head_dim or window."""
    _kernels().check_supported(head_dim, window)
