"""Triton kernels of this project, installed as the package ``vil_kernels`` (not ``kernels``: a published
package owns that name)."""

import os

# The values Triton reads as true in TRITON_INTERPRET (its runtime's interpret knob), in any case.
_TRUE = ("1", "true", "on", "yes", "y")


def interpreting():
    """Whether Triton runs kernels with its CPU interpreter: ``TRITON_INTERPRET`` set to a value Triton takes as true
    (``1``, ``true``, ``on``, ...). Read without importing Triton, so that ``import vil`` stays light."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE
