"""ViL as a detection and segmentation backbone.

- :class:`ViLBackbone`: the stage outputs as NCHW maps (strides 4, 8, 16, 32 for the presets), optionally
  LayerNorm'd per level, with the first stages frozen if asked.
- :func:`build_fpn_backbone`: that backbone with torchvision's feature pyramid, which torchvision's
  ``MaskRCNN``, ``FasterRCNN`` and ``RetinaNet`` take as their ``backbone``.
- :func:`export_state` / :func:`backbone_state`: backbone checkpoints in the layouts of torchvision,
  detectron2 and mmdetection, and back.
"""

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from timm.layers import LayerNorm2d
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, FeaturePyramidNetwork, LastLevelMaxPool
from yacs.config import CfgNode

from .checkpoint import load_model_state, model_state, read_checkpoint
from .config import config_from_text
from .model_config import model_kwargs
from .models import PRESETS, MsViT, arch_string, parse_arch
from .models.convert import backbone_specs, convert_classification_state, infer_image_size, resize_tables

# Export format -> (the key holding the state dict, the prefix of the backbone's keys in a whole detector).
EXPORT_FORMATS: dict[str, tuple[str, str]] = {
    "torchvision": ("model", "backbone.body."),  # as torchvision's detection reference scripts save
    "detectron2": ("model", "backbone.bottom_up."),  # as the original ViL detection release
    "mmdet": ("state_dict", "backbone."),
}
GLOBAL_TOKENS: tuple[str, ...] = ("drop", "average")


class ViLBackbone(MsViT):
    """A ViL model without classifier whose forward returns its stage outputs as NCHW maps.

    Args:
        arch: the architecture string; other :class:`~vil.models.MsViT` arguments by keyword.
        out_indices: the stages to return (0-based; negative from the end); None: every stage.
        level_norm: a LayerNorm over channels on each returned map.
        global_tokens: ``"drop"``, or ``"average"`` (the mean of the stage's global tokens added everywhere).
        frozen_stages: the first k stages get no gradients and stay in eval mode.
        dynamic_img_pad: patch embeddings pad images to a multiple of their patch size (the default here,
            unlike the classification model, which drops the remainder as the original release did).
    """

    def __init__(
        self,
        arch: str,
        out_indices: Optional[Sequence[int]] = None,
        level_norm: bool = True,
        global_tokens: str = "drop",
        frozen_stages: int = 0,
        dynamic_img_pad: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(arch, num_classes=0, dynamic_img_pad=dynamic_img_pad, **kwargs)
        if global_tokens not in GLOBAL_TOKENS:
            raise ValueError(
                f"global_tokens {global_tokens!r} is not an option; use one of {', '.join(GLOBAL_TOKENS)}."
            )
        self.out_indices = self.prune_intermediate_layers(out_indices, prune_norm=True)
        self.global_tokens = global_tokens
        self.out_channels_list = [self.feature_info[i]["num_chs"] for i in self.out_indices]
        self.level_norms = nn.ModuleList(
            LayerNorm2d(c) if level_norm else nn.Identity() for c in self.out_channels_list
        )
        self.frozen_stages = 0
        self.freeze(frozen_stages)

    def freeze(self, stages: int) -> None:
        """The first ``stages`` stages (of those the backbone keeps) get no gradients and stay in eval mode."""
        kept = len(self.stage_specs)
        if isinstance(stages, bool) or not isinstance(stages, int) or not 0 <= stages <= kept:
            raise ValueError(
                f"frozen_stages {stages!r} is not a number of stages from 0 to {kept}, the stages this backbone keeps."
            )
        self.frozen_stages = stages
        for stage in self._frozen():
            stage.requires_grad_(False)
        self.train(self.training)

    def _frozen(self) -> list[nn.Module]:
        return [getattr(self, f"layer{spec.index}") for spec in self.stage_specs[: self.frozen_stages]]

    def train(self, mode: bool = True) -> "ViLBackbone":
        super().train(mode)
        for stage in self._frozen():
            stage.eval()
        return self

    def forward(self, images: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        """Images (B, C, H, W) of any size of at least the total stride -> ``{"0": map, "1": map, ...}``, one
        entry per returned stage, named by its position in ``out_indices``."""
        maps = self.forward_intermediates(
            images, indices=self.out_indices, intermediates_only=True, stop_early=True, global_tokens=self.global_tokens
        )
        return OrderedDict((str(i), norm(m)) for i, (norm, m) in enumerate(zip(self.level_norms, maps)))


class ViLWithFPN(nn.Module):
    """A :class:`ViLBackbone` (``body``) followed by torchvision's ``FeaturePyramidNetwork`` (``fpn``), with the
    ``out_channels`` attribute torchvision's detectors read, like torchvision's ``BackboneWithFPN``."""

    def __init__(
        self, body: ViLBackbone, out_channels: int = 256, extra_blocks: Optional[ExtraFPNBlock] = None
    ) -> None:
        super().__init__()
        self.body = body
        self.fpn = FeaturePyramidNetwork(
            body.out_channels_list, out_channels, extra_blocks=extra_blocks or LastLevelMaxPool()
        )
        self.out_channels = out_channels

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.fpn(self.body(images))


def _model_arguments(name_or_cfg: Union[str, CfgNode]) -> dict[str, Any]:
    """MsViT keyword arguments (``arch`` included) from a preset name, an arch string or a config."""
    if not isinstance(name_or_cfg, str):
        kwargs = model_kwargs(name_or_cfg)
        for classification_only in ("num_classes", "avg_pool", "dynamic_img_pad"):
            kwargs.pop(classification_only)
        return kwargs
    if name_or_cfg in PRESETS:
        return dict(arch=PRESETS[name_or_cfg])
    if "," in name_or_cfg:
        return dict(arch=arch_string(parse_arch(name_or_cfg)))
    raise ValueError(f"{name_or_cfg!r} is neither a ViL preset ({', '.join(PRESETS)}) nor an arch string nor a config.")


def build_fpn_backbone(
    name_or_cfg: Union[str, CfgNode],
    out_channels: int = 256,
    trainable_stages: Optional[int] = None,
    checkpoint: Optional[Union[str, os.PathLike]] = None,
    out_indices: Optional[Sequence[int]] = None,
    extra_blocks: Optional[ExtraFPNBlock] = None,
    level_norm: bool = True,
    global_tokens: str = "drop",
    full_attention_to_local: bool = False,
    num_global: Optional[int] = None,
    global_init: str = "copy",
    **model_overrides: Any,
) -> ViLWithFPN:
    """A ViL backbone with a feature pyramid for torchvision's detectors.

    Args:
        name_or_cfg: a preset name (``"vil_small"``, ``"vil_tiny_rpb"``, ...), an arch string, or a config from
            :func:`vil.config.load_cfg` (its arch, image size, ATTN_TYPE and longformer options).
        out_channels: channels of every pyramid level.
        trainable_stages: how many of the last stages the backbone keeps (those up to the last of ``out_indices``)
            train, the others frozen; None: all.
        checkpoint: a classification checkpoint (this project's or the original release's; converted as the
            options below say) or a backbone checkpoint from ``tools/export_backbone.py``.
        out_indices: the stages that feed the pyramid; None: every stage.
        extra_blocks: torchvision's extra pyramid block; None: ``LastLevelMaxPool`` (Mask/Faster R-CNN). RetinaNet
            takes ``LastLevelP6P7(out_channels, out_channels)`` and ``out_indices=(1, 2, 3)``.
        level_norm, global_tokens: see :class:`ViLBackbone`.
        full_attention_to_local: full-attention stages become longformer stages (cheaper on large images).
        num_global, global_init: another number of global tokens for stages that have them (``"copy"`` or
            ``"average"`` the learned ones).
        model_overrides: other :class:`~vil.models.MsViT` arguments (``drop_path_rate``, ``attn_backend``, ...).
    """
    kwargs = {**_model_arguments(name_or_cfg), **model_overrides}
    source_arch = kwargs.pop("arch")
    specs = backbone_specs(parse_arch(source_arch), full_attention_to_local, num_global)
    if full_attention_to_local and kwargs.get("attention") == "full":
        kwargs["attention"] = "longformer"
    if isinstance(out_channels, bool) or not isinstance(out_channels, int) or out_channels < 1:
        raise ValueError(f"out_channels must be a positive number of channels, got {out_channels!r}.")
    body = ViLBackbone(
        arch_string(specs), out_indices=out_indices, level_norm=level_norm, global_tokens=global_tokens, **kwargs
    )
    kept = len(body.stage_specs)
    trainable = kept if trainable_stages is None else trainable_stages
    if isinstance(trainable, bool) or not isinstance(trainable, int) or not 0 <= trainable <= kept:
        raise ValueError(
            f"trainable_stages {trainable_stages!r} is not a number of stages from 0 to {kept}, the stages the "
            f"backbone keeps for out_indices {body.out_indices}."
        )
    body.freeze(kept - trainable)
    if checkpoint is not None:
        load_backbone_checkpoint(
            body,
            checkpoint,
            source_arch,
            full_attention_to_local=full_attention_to_local,
            num_global=num_global,
            global_init=global_init,
        )
    return ViLWithFPN(body, out_channels, extra_blocks)


def export_state(state: Mapping[str, torch.Tensor], fmt: str, arch: str, image_size: Sequence[int]) -> dict[str, Any]:
    """A backbone state dict in ``fmt``'s layout: keys prefixed as in a whole detector of that framework,
    under its usual key, with the arch string and image size alongside."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"Export format {fmt!r} does not exist; use one of {', '.join(EXPORT_FORMATS)}.")
    container, prefix = EXPORT_FORMATS[fmt]
    info = {"arch": arch, "image_size": list(image_size)}
    exported = {container: {prefix + k: v for k, v in state.items()}}
    if fmt == "mmdet":
        exported["meta"] = {"vil": info}
    else:
        exported["vil"] = info
    return exported


def backbone_state(checkpoint: Mapping[str, Any]) -> Optional[dict[str, torch.Tensor]]:
    """The backbone state dict of an exported checkpoint (any of :data:`EXPORT_FORMATS`), or None when the
    checkpoint is not one."""
    for container, prefix in EXPORT_FORMATS.values():
        state = checkpoint.get(container)
        if isinstance(state, dict) and state and any(k.startswith(prefix) for k in state):
            return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    return None


def load_backbone_checkpoint(
    body: ViLBackbone, path: Union[str, os.PathLike], source_arch: str, **conversion: Any
) -> None:
    """Load into ``body`` an exported backbone checkpoint, or a classification checkpoint of a model of
    ``source_arch`` converted by :func:`~vil.models.convert.convert_classification_state` with ``conversion``
    (position tables resized to the body's image size, from the one the export stored or else the one the tables
    show). The per-level norms are in neither and keep their initial values."""
    checkpoint = read_checkpoint(path)
    state = backbone_state(checkpoint)
    if state is not None:
        stored = checkpoint.get("vil", {}).get("image_size") if isinstance(checkpoint.get("vil"), dict) else None
        size = tuple(stored) if stored else infer_image_size(state, body.stage_specs)
        if size and tuple(size) != tuple(body.img_size):
            state = resize_tables(state, body.stage_specs, size, body.img_size, body.dynamic_img_pad)
    else:
        size = checkpoint_image_size(checkpoint, source_arch, path) or body.img_size
        state, _, _ = convert_classification_state(
            checkpoint, source_arch, size, new_image_size=body.img_size, pad=body.dynamic_img_pad, **conversion
        )
    load_model_state(body, state, path, may_miss=("level_norms.",))


def stored_config(checkpoint: Mapping[str, Any], path: Union[str, os.PathLike] = "The checkpoint") -> Optional[CfgNode]:
    """The config this project's trainer stores in its checkpoints, checked as config files are (crafted
    metadata is refused in one sentence); None for other checkpoints."""
    if "config" not in checkpoint:
        return None
    return config_from_text(checkpoint["config"], f"the config stored in {path}")


def checkpoint_image_size(
    checkpoint: Mapping[str, Any], arch: str, path: Union[str, os.PathLike] = "The checkpoint"
) -> Optional[tuple[int, int]]:
    """The image size (H, W) a classification checkpoint was trained for: from its config (this project's
    checkpoints), else from its position tables (taken as square); None when neither tells."""
    cfg = stored_config(checkpoint, path)
    if cfg is not None:
        return (cfg.INPUT.IMAGE_SIZE,) * 2
    return infer_image_size(model_state(checkpoint), parse_arch(arch))


__all__ = [
    "EXPORT_FORMATS",
    "ViLBackbone",
    "ViLWithFPN",
    "backbone_state",
    "build_fpn_backbone",
    "checkpoint_image_size",
    "export_state",
    "load_backbone_checkpoint",
    "stored_config",
]
