"""Multi-Scale Vision Longformer. Importing the package registers the ViL presets with timm."""

from . import models  # noqa: F401  (registers vil_tiny, vil_small, ... with timm)
