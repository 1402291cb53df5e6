"""Triton kernels of this project, installed as the package ``vil_kernels`` (not ``kernels``: a published
package owns that name)."""
