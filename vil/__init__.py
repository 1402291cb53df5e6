"""Multi-Scale Vision Longformer. Importing the package registers the ViL presets with timm."""

from typing import Optional

from torch import nn

from . import models  # noqa: F401  (registers vil_tiny, vil_small, ... with timm)

__all__ = ["accelerate_longformer"]


def accelerate_longformer(model: nn.Module, backend: Optional[str] = None) -> nn.Module:
    """transformers' Longformer and LED models on this project's sliding-window op, in place, with the same
    parameters and outputs (:func:`vil.transformers_longformer.accelerate_longformer`); needs the package's
    ``transformers`` extra."""
    try:
        from .transformers_longformer import accelerate_longformer as accelerate
    except ImportError as error:
        raise ImportError(
            f"vil.accelerate_longformer needs transformers ({error}); install it with pip install 'vil[transformers]'."
        ) from error
    return accelerate(model, backend)
