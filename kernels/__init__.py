"""Triton kernels of this project, installed as the package ``vil_kernels`` (not ``kernels``, a name a
published package owns). The attention backends in ``vil.ops.backends`` import them from there."""
