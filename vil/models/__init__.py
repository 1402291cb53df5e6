"""ViL models: ``build_model(cfg)``, a preset by name (``vil_small(num_classes=10)``), or through timm
(``timm.create_model("vil_small")``: importing :mod:`vil` registers every preset with timm)."""

from .arch import COMPARISONS, PRESETS, arch_string, parse_arch, small_arch, stage_map_sizes
from .msvit import (
    ATTN_TYPES,
    MECHANISMS,
    MsViT,
    build_model,
    pretrained_checkpoint,
    vil_base_deep,
    vil_base_deep_rpb,
    vil_base_wide,
    vil_base_wide_rpb,
    vil_medium_deep,
    vil_medium_deep_rpb,
    vil_medium_wide,
    vil_medium_wide_rpb,
    vil_small,
    vil_small_full,
    vil_small_linformer,
    vil_small_linformer_partial,
    vil_small_srformer64,
    vil_small_srformer32,
    vil_small_srformer32_partial,
    vil_small_performer,
    vil_small_performer_partial,
    vil_small_global,
    vil_small_global_partial,
    vil_small_rpb,
    vil_tiny,
    vil_tiny_rpb,
)

__all__ = [
    "ATTN_TYPES", "COMPARISONS", "MECHANISMS", "MsViT", "PRESETS", "arch_string", "build_model", "parse_arch",
    "pretrained_checkpoint", "small_arch", "stage_map_sizes",
    "vil_base_deep", "vil_base_deep_rpb", "vil_base_wide", "vil_base_wide_rpb", "vil_medium_deep",
    "vil_medium_deep_rpb", "vil_medium_wide", "vil_medium_wide_rpb", "vil_small", "vil_small_rpb", "vil_tiny",
    "vil_tiny_rpb",
    # the attention comparison's models
    "vil_small_full", "vil_small_global", "vil_small_global_partial", "vil_small_linformer",
    "vil_small_linformer_partial", "vil_small_performer", "vil_small_performer_partial", "vil_small_srformer32",
    "vil_small_srformer32_partial", "vil_small_srformer64",
]
