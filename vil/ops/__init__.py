"""Local attention, usable on its own: ``from vil.ops import local_attention_2d, local_attention_1d``."""

from .local_attention import (
    check_backend,
    check_backend_1d,
    check_window_options,
    local_attention_1d,
    local_attention_2d,
)
from .neighborhood import Neighborhood1d, Neighborhood2d
from .registry import available_backends, default_backend

__all__ = [
    "Neighborhood1d",
    "Neighborhood2d",
    "available_backends",
    "check_backend",
    "check_backend_1d",
    "check_window_options",
    "default_backend",
    "local_attention_1d",
    "local_attention_2d",
]
