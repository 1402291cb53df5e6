"""ViL models: ``build_model(cfg)``, or a preset by name (``vil_small(num_classes=10)``)."""

from .arch import PRESETS, parse_arch
from .msvit import (
    ATTN_TYPES,
    MsViT,
    build_model,
    vil_base_deep,
    vil_base_wide,
    vil_medium_deep,
    vil_medium_wide,
    vil_small,
    vil_tiny,
)

__all__ = [
    "ATTN_TYPES", "MsViT", "PRESETS", "build_model", "parse_arch", "vil_base_deep", "vil_base_wide",
    "vil_medium_deep", "vil_medium_wide", "vil_small", "vil_tiny",
]
