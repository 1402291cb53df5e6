"""Local 2D attention, usable on its own: ``from vil.ops import local_attention_2d``."""

from .local_attention import (
    available_backends,
    check_backend,
    check_window_options,
    default_backend,
    local_attention_2d,
)

__all__ = ["available_backends", "check_backend", "check_window_options", "default_backend", "local_attention_2d"]
