"""ViL as a detection and segmentation backbone.

- :class:`ViLBackbone`: the stage outputs as NCHW maps (strides 4, 8, 16, 32 for the presets), optionally
  LayerNorm'd per level, with the first stages frozen if asked.
- :func:`build_fpn_backbone`: that backbone with torchvision's feature pyramid, which torchvision's
  ``MaskRCNN``, ``FasterRCNN`` and ``RetinaNet`` take as their ``backbone``.
- :func:`export_state` / :func:`backbone_state`: backbone checkpoints in the layouts of torchvision,
  detectron2 and mmdetection, and back, with the model options the backbone must be built with.
"""

import inspect
import math
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from timm.layers import LayerNorm2d, to_2tuple
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, FeaturePyramidNetwork, LastLevelMaxPool
from yacs.config import CfgNode

from .checkpoint import check_finite, load_model_state, model_state, read_checkpoint, stored_config
from .config import config_value
from .model_config import mechanism_of, model_kwargs
from .models import MECHANISMS, PRESETS, MsViT, arch_string, parse_arch, stage_map_sizes
from .models.convert import (
    MODEL_DEFINING_KEYS,
    backbone_specs,
    check_convertible,
    convert_classification_state,
    infer_image_size,
    option_name,
    resize_tables,
)
from .models.msvit import check_global_tokens, is_integer

# Export format -> (the key holding the state dict, the prefix of the backbone's keys in a whole detector).
EXPORT_FORMATS: dict[str, tuple[str, str]] = {
    "torchvision": ("model", "backbone.body."),  # as torchvision's detection reference scripts save
    "detectron2": ("model", "backbone.bottom_up."),  # as the original ViL detection release
    "mmdet": ("state_dict", "backbone."),
}
# The MODEL_DEFINING_KEYS a backbone keeps from the classification model it is made from, by the MsViT argument each
# sets. Not the arch (converted, and checked on its own), the classifier's pooling, nor the patch embeddings'
# padding (the backbone's own choice; its tables are converted).
# And the attention mechanism, which ATTN_TYPE names beside a backend (every backend of one mechanism computes it).
BACKBONE_OPTIONS: dict[str, str] = {
    **{
        option_name(key): key
        for key in MODEL_DEFINING_KEYS
        if key not in ("MODEL.VIT.MSVIT.ARCH", "MODEL.VIT.AVG_POOL", "MODEL.VIT.DYNAMIC_IMG_PAD")
    },
    "attention": "MODEL.VIT.MSVIT.ATTN_TYPE",
}
BACKBONE_DEFAULTS: dict[str, Any] = {
    name: inspect.signature(MsViT).parameters[name].default for name in BACKBONE_OPTIONS
}


class ViLBackbone(MsViT):
    """A ViL model without classifier whose forward returns its stage outputs as NCHW maps.

    Args:
        arch: the architecture string; other :class:`~vil.models.MsViT` arguments by keyword.
        out_indices: the stages to return (0-based; negative from the end), in stage order whatever their order
            here; an int n: the last n stages (timm's convention); None: every stage.
        level_norm: a LayerNorm over channels on each returned map.
        global_tokens: ``"drop"``, or ``"average"`` (the mean of the stage's global tokens added everywhere).
        frozen_stages: the first k stages get no gradients and stay in eval mode (see :meth:`freeze`).
        dynamic_img_pad: patch embeddings pad images to a multiple of their patch size (the default here,
            unlike the classification model, which drops the remainder as the original release did).

    Attributes:
        model_options: the :data:`BACKBONE_OPTIONS` values it is built with (a checkpoint's must be the same).
        pruned_specs: the specs of the stages after the last of ``out_indices``, which it does not have.
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
        check_global_tokens(global_tokens)
        self.model_options = {name: kwargs.get(name, default) for name, default in BACKBONE_DEFAULTS.items()}
        built = self.stage_specs
        self.out_indices = self.prune_intermediate_layers(out_indices, prune_norm=True)
        self.pruned_specs = built[len(self.stage_specs) :]  # the stages after the last of out_indices
        self.global_tokens = global_tokens
        self.out_channels_list = [self.feature_info[i]["num_chs"] for i in self.out_indices]
        self.level_norms = nn.ModuleList(
            LayerNorm2d(c) if level_norm else nn.Identity() for c in self.out_channels_list
        )
        self.frozen_stages = 0
        self.freeze(frozen_stages)

    def freeze(self, stages: int) -> None:
        """The first ``stages`` stages (of those the backbone keeps) get no gradients and stay in eval mode; the
        others get gradients and follow the backbone's mode (a smaller number than before unfreezes stages)."""
        kept = len(self.stage_specs)
        if not is_integer(stages) or not 0 <= stages <= kept:
            raise ValueError(
                f"frozen_stages {stages!r} is not a number of stages from 0 to {kept}, the stages this backbone keeps."
            )
        self.frozen_stages = stages = int(stages)
        for i, spec in enumerate(self.stage_specs):
            getattr(self, f"layer{spec.index}").requires_grad_(i >= stages)
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
        entry per returned stage, in stage order, named by its position among them."""
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
            options below say) or a backbone checkpoint from ``tools/export_backbone.py``. Where it says the
            :data:`BACKBONE_OPTIONS` its model was trained with (this project's config stored in it, or an export's
            options), the backbone is built with them; a config or keyword asking for other values is refused.
        out_indices: the stages that feed the pyramid, as :class:`ViLBackbone` takes them; None: every stage.
        extra_blocks: torchvision's extra pyramid block; None: ``LastLevelMaxPool`` (Mask/Faster R-CNN). RetinaNet
            takes ``LastLevelP6P7(out_channels, out_channels)`` and ``out_indices=(1, 2, 3)``.
        level_norm, global_tokens: see :class:`ViLBackbone`.
        full_attention_to_local: full-attention stages become longformer stages (cheaper on large images).
        num_global, global_init: another number of global tokens for stages that have them, initialised as
            ``"copy"`` or ``"average"`` of the learned ones (unrelated to ``global_tokens="average"``).
        model_overrides: other :class:`~vil.models.MsViT` arguments (``drop_path_rate``, ``attn_backend``, ...).
    """
    kwargs = {**_model_arguments(name_or_cfg), **model_overrides}
    if not is_integer(out_channels) or out_channels < 1:
        raise ValueError(f"out_channels must be a positive number of channels, got {out_channels!r}.")
    out_channels = int(out_channels)
    read = None
    if checkpoint is not None:
        read = read_checkpoint(checkpoint)
        trained = trained_options(read, checkpoint) or {}
        check_options(trained, model_overrides if isinstance(name_or_cfg, str) else kwargs, checkpoint)
        kwargs = {**trained, **kwargs}
    source_arch = kwargs.pop("arch")
    specs = backbone_specs(parse_arch(source_arch), full_attention_to_local, num_global)
    kwargs["attention"] = backbone_attention(
        kwargs.get("attention", BACKBONE_DEFAULTS["attention"]), full_attention_to_local
    )
    body = ViLBackbone(
        arch_string(specs), out_indices=out_indices, level_norm=level_norm, global_tokens=global_tokens, **kwargs
    )
    kept = len(body.stage_specs)
    trainable = kept if trainable_stages is None else trainable_stages
    if not is_integer(trainable) or not 0 <= trainable <= kept:
        raise ValueError(
            f"trainable_stages {trainable_stages!r} is not a number of stages from 0 to {kept}, the stages the "
            f"backbone keeps for out_indices {body.out_indices}."
        )
    body.freeze(kept - trainable)
    if read is not None:
        conversion = dict(
            full_attention_to_local=full_attention_to_local, num_global=num_global, global_init=global_init
        )
        _load_read_checkpoint(body, read, checkpoint, source_arch, conversion)
    return ViLWithFPN(body, out_channels, extra_blocks)


def export_state(
    state: Mapping[str, torch.Tensor],
    fmt: str,
    arch: str,
    image_size: Sequence[int],
    options: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """A backbone state dict in ``fmt``'s layout: keys prefixed as in a whole detector of that framework,
    under its usual key, with the arch string, the image size and the ``options`` (:data:`BACKBONE_OPTIONS`
    values) other than :class:`~vil.models.MsViT`'s defaults alongside."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"Export format {fmt!r} does not exist; use one of {', '.join(EXPORT_FORMATS)}.")
    container, prefix = EXPORT_FORMATS[fmt]
    info = {"arch": arch, "image_size": list(image_size)}
    options = options or {}
    changed = {k: options[k] for k in BACKBONE_OPTIONS if k in options and options[k] != BACKBONE_DEFAULTS[k]}
    if changed:
        info["options"] = changed
    exported = {container: {prefix + k: v for k, v in state.items()}}
    if fmt == "mmdet":
        exported["meta"] = {"vil": info}
    else:
        exported["vil"] = info
    return exported


def export_info(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """What :func:`export_state` stored beside the weights (arch, image size, options): under ``"vil"``, or under
    ``"meta"``'s ``"vil"`` in mmdetection's layout; empty where neither holds it."""
    for holder in (checkpoint, checkpoint.get("meta")):
        if isinstance(holder, Mapping) and isinstance(holder.get("vil"), Mapping):
            return holder["vil"]
    return {}


def backbone_state(checkpoint: Mapping[str, Any]) -> Optional[dict[str, torch.Tensor]]:
    """The backbone state dict of an exported checkpoint (any of :data:`EXPORT_FORMATS`), or None when the
    checkpoint is not one."""
    for container, prefix in EXPORT_FORMATS.values():
        state = checkpoint.get(container)
        if isinstance(state, dict) and state and any(k.startswith(prefix) for k in state):
            return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    return None


def config_options(cfg: CfgNode) -> dict[str, Any]:
    """The :data:`BACKBONE_OPTIONS` values of a config, by MsViT argument (the attention by its mechanism)."""
    options = {name: config_value(cfg, key) for name, key in BACKBONE_OPTIONS.items()}
    return dict(options, attention=mechanism_of(options["attention"]) or options["attention"])


def backbone_attention(attention: str, full_attention_to_local: bool) -> str:
    """The attention mechanism of a backbone made from a classification model of ``attention``: the same, or
    with ``full_attention_to_local`` longformer (a model of full attention, or ViL's, whose full-attention stages
    become longformer ones); a model of another mechanism is refused, its stages' weights being no full
    attention's."""
    if not full_attention_to_local:
        return attention
    if attention not in ("full", "longformer"):
        raise ValueError(
            f"full_attention_to_local (--full-attention-to-local) turns full-attention stages into longformer ones, "
            f"but this model's attention is {attention}, whose weights are not full attention's; make its backbone "
            "without it."
        )
    return "longformer"


def _compared(name: str, value: Any) -> Any:
    """A :data:`BACKBONE_OPTIONS` value as it acts on what the model computes (the attention is a mechanism's name
    already, :func:`config_options`)."""
    return value if name == "attention" else MODEL_DEFINING_KEYS[BACKBONE_OPTIONS[name]](value)


def trained_options(checkpoint: Mapping[str, Any], path: Union[str, os.PathLike] = "The checkpoint") -> Optional[dict]:
    """The :data:`BACKBONE_OPTIONS` values the model of a checkpoint was trained with: an exported backbone's (the
    options it stores, the others at their defaults), or those of this project's config stored in a classification
    checkpoint; None where the checkpoint does not say (the original release's, a bare state dict)."""
    if backbone_state(checkpoint) is None:
        cfg = stored_config(checkpoint, path)
        return None if cfg is None else config_options(cfg)
    options = export_info(checkpoint).get("options", {})
    if not (
        isinstance(options, Mapping)
        and all(
            k in BACKBONE_OPTIONS and isinstance(v, (bool, int, float)) for k, v in options.items() if k != "attention"
        )
        and options.get("attention", "longformer") in MECHANISMS
    ):
        raise ValueError(
            f"{path} stores the backbone options {options!r}, which are not numbers or booleans by the names "
            f"{', '.join(BACKBONE_OPTIONS)} (the attention one of {', '.join(MECHANISMS)}); export the backbone "
            "again with tools/export_backbone.py."
        )
    return {**BACKBONE_DEFAULTS, **options}


def check_options(
    trained: Mapping[str, Any], asked: Mapping[str, Any], path: Union[str, os.PathLike] = "The checkpoint"
) -> None:
    """Refuse, in one sentence naming them, the :data:`BACKBONE_OPTIONS` in ``asked`` that compute otherwise than
    the ``trained`` ones (compared as :data:`~vil.models.convert.MODEL_DEFINING_KEYS` compares them)."""
    differ = [
        f"{name} {trained[name]!r} ({BACKBONE_OPTIONS[name]}), not {asked[name]!r}"
        for name in BACKBONE_OPTIONS
        if name in trained and name in asked and _compared(name, trained[name]) != _compared(name, asked[name])
    ]
    if differ:
        raise ValueError(
            f"Checkpoint {path} was trained with {', '.join(differ)}; leave those options out or give the trained "
            "values to build the model it holds."
        )


def classification_backbone_state(
    state: Mapping[str, torch.Tensor],
    source: Mapping[str, Any],
    pad: bool,
    new_image_size: Optional[Sequence[int]] = None,
    **conversion: Any,
) -> tuple[dict[str, torch.Tensor], list, tuple[int, int]]:
    """A classification model's state as a backbone's whose patch embeddings ``pad`` (or not), for images of
    ``new_image_size`` (None: the source's): :func:`~vil.models.convert.convert_classification_state` with
    ``conversion``, the position tables first remade from the maps the source model made them for (``source``: its
    ``arch``, ``img_size`` and ``dynamic_img_pad``) to those of the backbone. Returns ``(state, arch specs, image
    size)``."""
    specs = parse_arch(source["arch"])
    old_size = tuple(to_2tuple(source["img_size"]))
    size = tuple(to_2tuple(new_image_size)) if new_image_size is not None else old_size
    stride = math.prod(spec.patch for spec in specs)
    if min(size) < stride:
        raise ValueError(
            f"The new image size {size[0]}x{size[1]} is smaller than the model's total stride {stride} (the product "
            f"of its stages' patch sizes); give {stride} or more."
        )
    old_maps = stage_map_sizes(specs, old_size, source.get("dynamic_img_pad", False))
    state = _resize_stage_tables(state, specs, old_maps, stage_map_sizes(specs, size, pad))
    return convert_classification_state(state, source["arch"], size, pad=pad, **conversion)


def _resize_stage_tables(
    state: Mapping[str, torch.Tensor], specs: Sequence, old_maps: Sequence, new_maps: Sequence
) -> dict[str, torch.Tensor]:
    """Position tables made for the maps ``old_maps`` ((rows, columns), one per stage of ``specs``), remade for
    ``new_maps`` by :func:`~vil.models.convert.resize_tables`, a stage at a time (a stage taken with patch size 1
    has the map of the size it is given)."""
    state = dict(state)
    for spec, old, new in zip(specs, old_maps, new_maps):
        state = resize_tables(state, [replace(spec, patch=1)], old, new)
    return state


def load_backbone_checkpoint(
    body: ViLBackbone, path: Union[str, os.PathLike], source_arch: str, **conversion: Any
) -> None:
    """Load into ``body`` an exported backbone checkpoint, or a classification checkpoint of a model of
    ``source_arch`` converted by :func:`classification_backbone_state` with ``conversion`` (position tables
    remade for the body's image size from the one the export stored, or else the one the tables show). The weights
    of the stages the body pruned are left out; the per-level norms are in neither and keep their initial values. A
    checkpoint trained with other :data:`BACKBONE_OPTIONS` than the body's is refused."""
    _load_read_checkpoint(body, read_checkpoint(path), path, source_arch, conversion)


def _load_read_checkpoint(body, checkpoint, path, source_arch, conversion):
    """:func:`load_backbone_checkpoint` of the checkpoint dict already read from ``path``."""
    state = backbone_state(checkpoint)
    trained = trained_options(checkpoint, path) or {}
    if state is None and "attention" in trained:  # what the conversion makes of the classification model's
        trained["attention"] = backbone_attention(trained["attention"], conversion.get("full_attention_to_local"))
    check_options(trained, body.model_options, path)
    specs = body.stage_specs
    if state is not None:  # exports hold tables for the maps of patch embeddings that pad
        check_finite(state, path)
        check_convertible(state, path)
        info, built_arch = export_info(checkpoint), arch_string([*specs, *body.pruned_specs])
        if isinstance(info.get("arch"), str) and arch_string(parse_arch(info["arch"])) != built_arch:
            raise ValueError(
                f"{path} holds a backbone of arch {info['arch']!r} (as tools/export_backbone.py wrote it), not this "
                f"model's {built_arch!r}; build the backbone with that arch string."
            )
        stored = info.get("image_size")
        size = tuple(stored) if stored else infer_image_size(state, specs)
        if size:
            new_maps = stage_map_sizes(specs, body.img_size, body.dynamic_img_pad)
            state = _resize_stage_tables(state, specs, stage_map_sizes(specs, size, True), new_maps)
    else:
        classification = model_state(checkpoint, path)
        check_convertible(classification, path)
        cfg = stored_config(checkpoint, path)
        trained_arch = cfg and arch_string(parse_arch(cfg.MODEL.VIT.MSVIT.ARCH))
        if trained_arch and trained_arch != arch_string(parse_arch(source_arch)):
            raise ValueError(
                f"{path} holds a model of arch {trained_arch} (its stored config says so), not "
                f"{arch_string(parse_arch(source_arch))}; build the backbone with that arch string."
            )
        source = dict(
            arch=source_arch,
            img_size=checkpoint_image_size(checkpoint, source_arch, path) or body.img_size,
            dynamic_img_pad=cfg is not None and cfg.MODEL.VIT.DYNAMIC_IMG_PAD,
        )
        state, _, _ = classification_backbone_state(
            classification, source, body.dynamic_img_pad, body.img_size, **conversion
        )
    pruned = tuple(f"layer{spec.index}." for spec in body.pruned_specs)
    state = {k: v for k, v in state.items() if not k.startswith(pruned)}
    load_model_state(body, state, path, may_miss=("level_norms.",))


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
    "BACKBONE_OPTIONS",
    "EXPORT_FORMATS",
    "ViLBackbone",
    "ViLWithFPN",
    "backbone_attention",
    "backbone_state",
    "build_fpn_backbone",
    "check_options",
    "checkpoint_image_size",
    "classification_backbone_state",
    "config_options",
    "export_info",
    "export_state",
    "load_backbone_checkpoint",
    "stored_config",
    "trained_options",
]
