"""Multi-Scale Vision Longformer. Importing the package registers the ViL presets with timm."""

from typing import Optional

import torch
from torch import nn
from torch.torch_version import Version

# The oldest torch whose compile, export and ONNX paths run everything the package offers (pyproject.toml says
# which API needs which version); its pre-releases and nightlies count as that release.
MIN_TORCH = "2.10"
if Version(torch.__version__).release < Version(MIN_TORCH).release:
    raise ImportError(
        f"vil needs torch {MIN_TORCH} or later, and this is torch {torch.__version__}: "
        f"pip install -U 'torch>={MIN_TORCH}'."
    )

from . import models  # noqa: E402, F401  (registers vil_tiny, vil_small, ... with timm; after the version check)

__all__ = ["accelerate_longformer"]


def accelerate_longformer(model: nn.Module, backend: Optional[str] = None) -> nn.Module:
    """transformers' Longformer and LED models on this project's sliding-window op, in place, with the same
    parameters and outputs (:func:`vil.transformers_longformer.accelerate_longformer`); needs the package's
    ``transformers`` extra."""
    try:
        from .transformers_longformer import accelerate_longformer as accelerate
    except ImportError as error:
        raise ImportError(
            f"vil.accelerate_longformer needs transformers 4.57 or later ({error}); install it with "
            "pip install -U 'vil[transformers]'."
        ) from error
    return accelerate(model, backend)
