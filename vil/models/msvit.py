"""Multi-Scale Vision Longformer (ViL).

Module and parameter names follow the original release (``layer1.0.proj.weight``, ``layer1.1.attn.query``,
...), so its checkpoints load without conversion: stage k is ``layer<k>``, a sequence of a patch embedding
(index 0) followed by, per transformer layer, an attention block and an MLP block.
"""

import contextlib
import inspect
import math
import numbers
import os
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    Mlp,
    get_device_dtype,
    register_notrace_function,
    register_notrace_module,
    to_2tuple,
    trunc_normal_,
)
from timm.models import (
    FeatureGraphNet,
    build_model_with_cfg,
    generate_default_cfgs,
    get_pretrained_cfg,
    register_model,
    resolve_pretrained_cfg,
)
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.utils.checkpoint import checkpoint

from ..checkpoint import (
    SAFETENSORS_NAME,
    classifier_classes,
    download_checkpoint,
    read_checkpoint,
    with_hub_config,
)
from ..config import LARGEST_SIZE
from ..ops import check_window_options
from .arch import COMPARISONS, PRESETS, parse_arch, stage_map_sizes
from .attention import FullAttention, LongformerAttention, LongformerOptions
from .convert import check_trained_options, checkpoint_filter_fn
from .efficient_attention import LinformerAttention, PerformerAttention, SpatialReductionAttention
from .tables import resize_position_embedding

PREVIOUS_GROUP = (99999,)  # timm group_matcher suffix (its MATCH_PREV_GROUP): in the group of the one before


@register_notrace_module  # a leaf for torch.fx: the map size it returns is data
class PatchEmbed(nn.Module):
    """Conv patch embedding, optional LayerNorm, G global tokens prepended, absolute position embedding: those of the
    stage ``spec`` (:class:`~vil.models.arch.StageSpec`), whose map at the built image size is ``grid`` (nx, ny).

    Inputs of any size: rows and columns that do not fill a patch are dropped (the original release's
    convolution), or, with ``pad``, the image is padded at the bottom and right to a multiple of the patch
    size (timm's ``dynamic_img_pad``); the position embedding, made for an ``nx x ny`` map, is interpolated
    for maps of another size.
    """

    def __init__(self, in_chans, spec, grid, norm_layer, drop, norm_embed=True, pad=False):
        super().__init__()
        dim, patch, num_global, ape, (nx, ny) = spec.dim, spec.patch, spec.num_global, spec.ape, grid
        self.patch, self.num_global, self.ape, self.pad = patch, num_global, ape, pad
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)
        self.norm_embed = norm_layer(dim) if norm_embed else None
        if num_global:
            self.cls_token = nn.Parameter(torch.zeros(1, num_global, dim))
            trunc_normal_(self.cls_token, std=0.02)
        if ape:
            # Created even with no global tokens, as in the original release.
            self.cls_pos_embed = nn.Parameter(torch.zeros(1, num_global, dim))
            self.x_pos_embed = nn.Parameter(torch.zeros(1, nx, dim // 2))
            self.y_pos_embed = nn.Parameter(torch.zeros(1, ny, dim // 2))
            for p in (self.cls_pos_embed, self.x_pos_embed, self.y_pos_embed):
                trunc_normal_(p, std=0.02)
        self.pos_drop = nn.Dropout(drop)

    def forward(self, x):
        # A patch of one position never pads; F.pad by a symbolic zero of the previous stage's permuted map would
        # leave torch.export a guard on its strides that it cannot prove for every size.
        if self.pad and self.patch > 1:
            # Unconditional, by sizes rounded up with floor division: a branch on the remainder, or Python's %
            # of symbolic sizes, would fix the padding at the traced size under torch.export, ONNX and compile.
            rows, cols = x.shape[-2:]
            x = F.pad(
                x,
                (
                    0,
                    (cols + self.patch - 1) // self.patch * self.patch - cols,
                    0,
                    (rows + self.patch - 1) // self.patch * self.patch - rows,
                ),
            )
        x = self.proj(x)
        B, C, nx, ny = x.shape
        x = x.flatten(2).transpose(1, 2)
        if self.norm_embed is not None:
            x = self.norm_embed(x)
        if self.ape:
            x_pos = resize_position_embedding(self.x_pos_embed, nx)
            y_pos = resize_position_embedding(self.y_pos_embed, ny)
            grid = torch.cat([x_pos[:, :, None].expand(-1, -1, ny, -1), y_pos[:, None].expand(-1, nx, -1, -1)], dim=3)
            x = x + grid.flatten(1, 2)
        if self.num_global or self.ape:
            # The class tokens with their positions, added before they join the map's tokens: the table's gradient is
            # then summed over the batch, laid out as the table (a slice of torch.cat's gradient is not, which
            # DistributedDataParallel warns about). A stage without global tokens has an empty table all the same.
            cls = self.cls_token.expand(B, -1, -1) if self.num_global else x[:, :0]
            if self.ape:
                cls = cls + self.cls_pos_embed
            x = torch.cat([cls, x], dim=1)
        return self.pos_drop(x), (nx, ny)


class AttnBlock(nn.Module):
    """x + drop_path(attn(norm(x)))."""

    def __init__(self, dim, attn, norm_layer, drop_path):
        super().__init__()
        self.norm = norm_layer(dim)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, nx, ny):
        return x + self.drop_path(self.attn(self.norm(x), nx, ny))


class MlpBlock(nn.Module):
    """x + drop_path(mlp(norm(x)))."""

    def __init__(self, dim, norm_layer, drop, drop_path):
        super().__init__()
        self.norm = norm_layer(dim)
        self.mlp = Mlp(dim, hidden_features=4 * dim, act_layer=nn.GELU, drop=drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, nx, ny):
        return x + self.drop_path(self.mlp(self.norm(x)))


class Stage(nn.Sequential):
    """A patch embedding followed by alternating attention and MLP blocks."""

    grad_checkpointing = False

    def forward(self, x):
        embed, *blocks = self
        x, (nx, ny) = embed(x)
        for block in blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, nx, ny, use_reentrant=False)
            else:
                x = block(x, nx, ny)
        return x, (nx, ny)


class StageMap(nn.Module):
    """A stage's tokens (B, G + nx*ny, C) -> its local ones as a map (B, C, nx, ny), without the global ones: the
    next stage's input and the stage's feature map. ``feature_info`` names these modules, so timm's hook and FX
    feature extractors return maps."""

    def __init__(self, num_global):
        super().__init__()
        self.num_global = num_global

    def forward(self, tokens, nx, ny):
        local = tokens[:, self.num_global :]
        return local.transpose(1, 2).reshape(local.shape[0], local.shape[-1], nx, ny)  # also for a batch of 0


def check_global_tokens(global_tokens) -> None:
    """What forward_intermediates may do with the global tokens of each map it returns: drop them, or add their
    mean to every position."""
    if global_tokens not in ("drop", "average"):
        raise ValueError(f"global_tokens {global_tokens!r} is not an option; use 'drop' or 'average'.")


def is_integer(value) -> bool:
    """An integer (Python's or numpy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_num_classes(num_classes) -> int:
    if not is_integer(num_classes) or num_classes < 0:
        raise ValueError(f"num_classes must be 0 (no classifier) or a positive number of classes, got {num_classes!r}.")
    return int(num_classes)


@register_notrace_function  # a leaf for torch.fx: it checks sizes and types
def check_images(x, in_chans, total_stride, dtype):
    """Refuse, in one sentence, what the first convolution would refuse in torch's words, or take as images wrongly:
    ``x`` must be ``(B, in_chans, H, W)`` floating-point images of the weights' ``dtype`` (under autocast, which casts
    both, any but float64, for weights of any but float64), of at least ``total_stride`` pixels a side."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"This model takes a tensor of images (B, {in_chans}, H, W), got a {type(x).__name__}.")
    if not x.is_floating_point():
        raise ValueError(
            f"This model takes floating-point images, normalised as its transform does, got {x.dtype} ones; "
            "give them through the model's transform (pixels / 255, then the mean and std of its config)."
        )
    kind = x.device.type
    autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    if x.dtype != dtype and not (autocast and torch.float64 not in (x.dtype, dtype)):  # autocast casts all but float64
        tail = (
            "; torch.autocast casts any floating dtype but float64" if autocast else ", or run it under torch.autocast"
        )
        raise ValueError(
            f"The images are {x.dtype} and the model's weights {dtype}; give images of the weights' dtype "
            f"(images.to({dtype})){tail}."
        )
    if x.dim() != 4 or x.shape[1] != in_chans:
        raise ValueError(f"This model takes images of shape (B, {in_chans}, H, W); got {tuple(x.shape)}.")
    if min(x.shape[-2:]) < total_stride:
        raise ValueError(
            f"Images of {x.shape[-2]}x{x.shape[-1]} are smaller than the model's total stride {total_stride} (the "
            f"product of its stages' patch sizes); give images of at least {total_stride}x{total_stride}."
        )


class MsViT(nn.Module):
    """Multi-Scale Vision Longformer.

    The model is built for images of ``img_size`` (an int or (H, W)), which sets the sizes of the position
    tables, and takes images of any size of at least the total stride (see :class:`PatchEmbed` and
    :class:`~vil.models.attention.FullAttention`); at ``img_size`` the tables are used as they are.

    Args:
        arch: the architecture string (see :mod:`vil.models.arch`).
        global_pool: ``"token"`` (the first global token of the last stage), ``"avg"`` (mean over all tokens)
            or ``""`` (no pooling); None: ``"token"`` when the last stage has global tokens and not ``avg_pool``.
        attention: the attention of the s1 stages (s0 stages have full attention): ``"longformer"`` (ViL's),
            ``"full"``, or one of the mechanisms the original release compares with, ``"linformer"``,
            ``"srformer"``, ``"performer"`` (:mod:`vil.models.efficient_attention`; the stage's f is their number).
        attn_backend: the :func:`vil.ops.local_attention_2d` backend of longformer stages (None: the fastest).
        share_kv: linformer's key and value projections are one parameter.
        dynamic_img_pad: patch embeddings pad images to a multiple of their patch size instead of dropping
            the remainder (see :class:`PatchEmbed`); the position tables then have ``ceil(size / stride)`` rows.
        sw_exact, mode, share_w, only_global: the longformer options of ``MODEL.VIT.MSVIT``.
        output_stride: accepted only as the total stride (timm's ``features_only`` argument): the stages'
            strides are their patch sizes, there are no dilated stages.
    """

    output_fmt = "NHWC"  # forward_features' layout: the last stage's map, channels last, as timm's Swin

    def __init__(
        self,
        arch: str,
        img_size: Union[int, tuple[int, int]] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: Optional[str] = None,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        norm_embed: bool = True,
        avg_pool: bool = False,
        attention: str = "longformer",
        attn_backend: Optional[str] = None,
        share_w: bool = True,
        share_kv: bool = True,
        only_global: bool = False,
        sw_exact: int = 0,
        mode: int = 0,
        ln_eps: float = 1e-6,
        dynamic_img_pad: bool = False,
        output_stride: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.dynamic_img_pad = dynamic_img_pad
        self.stage_specs = parse_arch(arch)
        self.img_size = to_2tuple(img_size)
        if len(self.img_size) != 2 or not all(is_integer(side) and side > 0 for side in self.img_size):
            raise ValueError(f"img_size must be a positive int or an (H, W) pair of them, got {img_size!r}.")
        self.img_size = tuple(int(side) for side in self.img_size)
        self.num_classes = num_classes = _checked_num_classes(num_classes)
        if not is_integer(in_chans) or in_chans < 1:
            raise ValueError(f"in_chans must be a positive number of image channels, got {in_chans!r}.")
        self.in_chans = in_chans = int(in_chans)
        if not 0 <= drop_path_rate < 1:
            raise ValueError(f"drop_path_rate must be a probability in [0, 1), got {drop_path_rate!r}.")
        if not (math.isfinite(ln_eps) and ln_eps > 0):
            raise ValueError(f"ln_eps must be a positive number, got {ln_eps!r}.")
        self.feature_info, stride = [], 1
        for spec in self.stage_specs:
            stride *= spec.patch
            self.feature_info.append(
                dict(num_chs=spec.dim, reduction=stride, module=f"stage_maps.{len(self.feature_info)}")
            )
        self.total_stride = stride
        if output_stride not in (None, stride):
            raise ValueError(
                f"output_stride {output_stride} is not available: this architecture's stages have fixed "
                f"strides (its patch sizes), so its output stride is {stride}; leave output_stride out."
            )
        if max(self.img_size) > LARGEST_SIZE:
            raise ValueError(f"Image size {img_size} has a side above {LARGEST_SIZE}; build it for a smaller one.")
        if min(self.img_size) < stride:
            raise ValueError(
                f"Image size {img_size} is smaller than the model's total stride {stride} (the product of the "
                f"stages' patch sizes); build it for images of at least {stride}x{stride} (INPUT.IMAGE_SIZE, img_size)."
            )
        if global_pool is None:
            global_pool = "token" if self.stage_specs[-1].num_global and not avg_pool else "avg"
        elif avg_pool and global_pool == "token":
            raise ValueError("avg_pool=True pools by the mean, but global_pool is 'token'; give one of the two.")
        self.global_pool = self._checked_pool(global_pool)
        if attention not in MECHANISMS:
            raise ValueError(
                f"attention {attention!r} is not a mechanism of this model; use one of {', '.join(MECHANISMS)}."
            )
        check_window_options(sw_exact, mode)  # also where no stage is local
        local = [spec for spec in self.stage_specs if spec.local]
        a_local_stage, with_global = "a local stage (s1)", "a local stage (s1) with global tokens (g1 or more)"
        for name, value, default, owner, stages, what in (
            ("sw_exact", sw_exact, 0, "longformer", local, a_local_stage),
            ("mode", mode, 0, "longformer", local, a_local_stage),
            ("share_w", share_w, True, "longformer", [spec for spec in local if spec.num_global], with_global),
            ("only_global", only_global, False, "longformer", local, a_local_stage),
            ("share_kv", share_kv, True, "linformer", local, a_local_stage),
        ):
            if value != default and attention != owner:
                raise ValueError(
                    f"{name.upper()} ({name}) {value!r} is an option of {owner} attention, not of {attention!r}: it "
                    f"would change nothing; leave it at {default!r}."
                )
            if value != default and not stages:
                raise ValueError(
                    f"{name.upper()} ({name}) {value!r} acts on {what}, which this architecture has none of: it would "
                    f"change nothing; leave it at {default!r}."
                )
        if attn_backend is not None and attention != "longformer":
            raise ValueError(
                f"attn_backend {attn_backend!r} computes longformer attention, not {attention!r}: it would change "
                "nothing; leave it None."
            )
        if only_global:  # the local queries attend to the global keys only: no window to shape
            for name, value in (("sw_exact", sw_exact), ("mode", mode)):
                if value != 0:
                    raise ValueError(
                        f"{name.upper()} ({name}) {value!r} shapes the local windows, which ONLY_GLOBAL True "
                        "(only_global) leaves out: it would change nothing; leave it at 0."
                    )
        norm_layer = partial(nn.LayerNorm, eps=ln_eps)
        longformer = LongformerOptions(sw_exact, mode, share_w, only_global, attn_backend)
        rates = torch.linspace(0, drop_path_rate, sum(s.depth for s in self.stage_specs), device="cpu").tolist()

        in_dim, layer = in_chans, 0
        for spec, (nx, ny) in zip(self.stage_specs, stage_map_sizes(self.stage_specs, self.img_size, dynamic_img_pad)):
            blocks = [PatchEmbed(in_dim, spec, (nx, ny), norm_layer, drop_rate, norm_embed, dynamic_img_pad)]
            for _ in range(spec.depth):
                attn = self._attention(
                    spec, (nx, ny), attention if spec.local else "full", drop_rate, longformer, share_kv
                )
                blocks.append(AttnBlock(spec.dim, attn, norm_layer, rates[layer]))
                blocks.append(MlpBlock(spec.dim, norm_layer, drop_rate, rates[layer]))
                layer += 1
            self.add_module(f"layer{spec.index}", Stage(*blocks))
            in_dim = spec.dim
        self.stage_maps = nn.ModuleList(StageMap(spec.num_global) for spec in self.stage_specs)
        self.num_features = self.head_hidden_size = in_dim
        self.norm = norm_layer(in_dim)
        self.head = nn.Linear(in_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)
        self._traits = {"fixed_input_size": self.fixed_input_size}  # timm keeps what a model declares
        if any(isinstance(m, PerformerAttention) for m in self.modules()):
            # Training forwards since the features were last drawn (the original release's buffer), and every how
            # many the features are drawn anew (a tensor, so that changing it compiles nothing new).
            self.register_buffer("calls_since_last_redraw", torch.tensor(0))
            self.register_buffer("feature_redraw_interval", torch.tensor(1), persistent=False)

    @staticmethod
    def _attention(spec, grid, attention, drop, longformer, share_kv):
        """The attention module of one layer of the stage ``spec`` (a ``grid`` of nx x ny positions at the built image
        size): ``attention`` with the :class:`LongformerOptions` ``longformer`` or linformer's ``share_kv``."""
        dim, heads, G, f, (nx, ny) = spec.dim, spec.heads, spec.num_global, spec.window, grid
        if attention == "full":
            return FullAttention(dim, heads, G, nx, ny, rpe=not spec.ape, drop=drop)
        if attention == "longformer":
            return LongformerAttention(dim, heads, G, f, rpe=not spec.ape, options=longformer, drop=drop)
        if attention == "linformer":
            return LinformerAttention(dim, heads, G, (nx, ny), f, share_kv=share_kv, drop=drop, stage=spec.index)
        if attention == "srformer":
            return SpatialReductionAttention(dim, heads, G, f, drop=drop, stage=spec.index, grid=(nx, ny))
        return PerformerAttention(dim, heads, f, drop=drop)

    @property
    def least_image_side(self) -> int:
        """The side of the smallest square image it takes: its total stride, or more for spatial-reduction stages,
        whose maps must reduce to at least 2x2 positions."""
        srformer = any(isinstance(m, SpatialReductionAttention) for m in self.modules())
        return _smallest_image(self.stage_specs, {"attention": "srformer" if srformer else None}) or self.total_stride

    @property
    def fixed_input_size(self) -> bool:
        """True when the model takes only images of ``img_size`` (linformer attention: its projections are made for
        one token count)."""
        return any(isinstance(m, LinformerAttention) for m in self.modules())

    def set_feature_redraw_interval(self, interval: int) -> None:
        """Performer models: draw new random features every ``interval`` training forwards (the original
        release's schedule sets ``1 + 5 * epoch`` at the start of each epoch; the default is 1)."""
        if not hasattr(self, "calls_since_last_redraw"):
            raise ValueError("This model has no performer attention, so it has no random features to redraw.")
        if interval < 1:
            raise ValueError(f"The feature redraw interval must be at least 1 forward, got {interval}.")
        self.feature_redraw_interval.fill_(interval)

    def init_non_persistent_buffers(self) -> None:
        """What no state dict holds, as built (timm's ``reinit_non_persistent_buffers`` calls it, e.g. after a model
        built on the meta device gets real memory): a performer model's redraw interval."""
        if hasattr(self, "feature_redraw_interval"):
            self.feature_redraw_interval.fill_(1)

    def _count_training_forward(self):
        """Every training forward of a performer model counts; one that finds ``feature_redraw_interval`` of them
        since the last draw first draws new features for every layer, from torch's random state. (The original
        release reset its counter without counting the forward that redrew, so it redrew every interval + 1
        forwards.) In a distributed run each process draws its own; DistributedDataParallel's buffer broadcast
        at the next forward makes them rank 0's again."""
        due = self.calls_since_last_redraw >= self.feature_redraw_interval
        for module in self.modules():
            if isinstance(module, PerformerAttention) and module.training:  # not in stages kept in eval mode
                module.fast_attention.redraw_if(due)
        with torch.no_grad():
            self.calls_since_last_redraw.copy_(torch.where(due, 0, self.calls_since_last_redraw) + 1)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def _checked_pool(self, global_pool):
        if global_pool not in ("token", "avg", ""):
            raise ValueError(f"global_pool {global_pool!r} is not a pooling of this model; use 'token', 'avg' or ''.")
        if global_pool == "token" and not self.stage_specs[-1].num_global:
            raise ValueError("global_pool 'token' needs global tokens in the last stage, which has g0; use 'avg'.")
        return global_pool

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Names of the parameters trained without weight decay (position embeddings, tokens, norms, biases tables)."""
        keywords = (
            "pos_embed",
            "cls_token",
            "norm.weight",
            "norm.bias",
            "norm_embed",
            "head.bias",
            "relative_position",
        )
        return {name for name, _ in self.named_parameters() if any(k in name for k in keywords)}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for layer-wise learning-rate decay: the first patch embedding, then each stage
        (``coarse``) or each transformer layer, then the final norm (with the last). A stage's modules are its patch
        embedding, then each layer's attention (odd index) and MLP (even index) halves: the two halves are one
        layer, and a later stage's patch embedding goes with its first layer, as timm groups Swin's downsampling."""
        if coarse:
            blocks = [(r"^layer(\d+)\.", None)]
        else:
            blocks = [
                (r"^layer([2-4])\.(0)\.", None),  # a later stage's patch embedding
                (r"^layer([2-4])\.(1)\.", PREVIOUS_GROUP),  # its first attention half
                (r"^layer(\d+)\.(\d*[02468])\.", PREVIOUS_GROUP),  # an MLP half, with its attention half
                (r"^layer(\d+)\.(\d+)\.", None),  # an attention half: a new layer
            ]
        return dict(stem=r"^layer1\.0\.", blocks=blocks + [(r"^norm\.", PREVIOUS_GROUP)])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in backward instead of keeping them (less memory, more time)."""
        for spec in self.stage_specs:
            getattr(self, f"layer{spec.index}").grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new, freshly initialised classifier for ``num_classes`` (0: none); optionally another pooling."""
        num_classes = _checked_num_classes(num_classes)
        if global_pool is not None:
            self.global_pool = self._checked_pool(global_pool)
        self.num_classes = num_classes
        made = get_device_dtype(self)  # the model's device and dtype (a bfloat16 model on a GPU: the head too)
        self.head = nn.Linear(self.num_features, num_classes, **made) if num_classes > 0 else nn.Identity()
        self.head.apply(self._init_weights)

    @property
    def vil_mode(self) -> int:
        """The neighbour mode of the longformer attention layers (0 where there are none)."""
        return next((m.mode for m in self.modules() if isinstance(m, LongformerAttention)), 0)

    def reset_vil_mode(self, mode: int) -> None:
        """Set the neighbour mode of every longformer attention layer (e.g. 0 when random shifting ends)."""
        layers = [m for m in self.modules() if isinstance(m, LongformerAttention)]
        for exact in {m.exact for m in layers} or {0}:  # a bad mode is refused also where no layer is local
            check_window_options(exact, mode)
        for m in layers:
            m.mode = mode

    def _stages(self, x):
        """Yields every stage's tokens (B, G + nx*ny, C) and map size (nx, ny). Between stages the global tokens
        are dropped and the local ones, as an image, are the next stage's input."""
        check_images(x, self.in_chans, self.total_stride, self.layer1[0].proj.weight.dtype)
        if self.training and hasattr(self, "calls_since_last_redraw") and not is_fx_symbolic_tracing():
            self._count_training_forward()  # not while torch.fx traces symbolically; torch.export keeps the redraw
        for spec, to_map in zip(self.stage_specs, self.stage_maps):
            tokens, (nx, ny) = getattr(self, f"layer{spec.index}")(x)
            yield tokens, (nx, ny)
            x = to_map(tokens, nx, ny)

    def _take_indices(self, indices):
        """Stage indices to return: None all, an int n the last n, a sequence those (negative from the end)."""
        count = len(self.stage_specs)
        if indices is None:
            indices = count
        if not all(is_integer(i) for i in (indices if isinstance(indices, Sequence) else [indices])):
            raise ValueError(f"Stage indices must be an int or a sequence of ints, got {indices!r}.")
        if isinstance(indices, numbers.Integral):
            if not 0 < indices <= count:
                raise ValueError(f"Asked for the last {indices} stages of a model with {count}; ask for 1 to {count}.")
            return list(range(count - indices, count))
        bad = [i for i in indices if not -count <= i < count]
        if bad or not indices:
            raise ValueError(
                f"Stage indices {list(indices)} are out of range for a model with {count} stages; use indices "
                f"0..{count - 1} (or -{count}..-1)."
            )
        return sorted({i % count for i in indices})

    def _final(self, tokens, nx, ny):
        """The last stage's tokens, normalised, as a map (B, nx, ny, C). Global tokens have no place on a map: where
        the last stage has them, they go along as the map's attribute ``global_tokens`` (B, G, C), which
        :meth:`forward_head` pools from (a tensor attribute survives torch.compile, torch.export and torch.fx)."""
        tokens = self.norm(tokens)
        G = self.stage_specs[-1].num_global
        final_map = tokens[:, G:].reshape(tokens.shape[0], nx, ny, tokens.shape[-1])
        if G:
            final_map.global_tokens = tokens[:, :G]
        return final_map

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, Sequence[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        global_tokens: str = "drop",
    ) -> Union[list[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]:
        """Images (B, C, H, W) -> the stage outputs as maps (at strides 4, 8, 16, 32 for the presets).

        Args:
            indices: the stages to return: None all, an int n the last n, a sequence those.
            norm: apply the final norm to the last stage's map.
            stop_early: with ``intermediates_only``, stop after the last stage asked for.
            output_fmt: ``"NCHW"`` or ``"NHWC"``, the layout of the maps.
            global_tokens: ``"drop"``, or ``"average"``: add the mean of the stage's global tokens to every position.

        Returns:
            The list of maps with ``intermediates_only``, otherwise ``(forward_features(x), maps)``.
        """
        if output_fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"output_fmt {output_fmt!r} is not a layout of these maps; use 'NCHW' or 'NHWC'.")
        check_global_tokens(global_tokens)
        take = self._take_indices(indices)
        last = len(self.stage_specs) - 1
        maps = []
        for i, (tokens, (nx, ny)) in enumerate(self._stages(x)):
            if i in take:
                G = self.stage_specs[i].num_global
                normed = self.norm(tokens) if norm and i == last else tokens
                if global_tokens == "average" and G:  # added to the tokens: torch.export then takes every map size
                    normed = normed + normed[:, :G].mean(dim=1, keepdim=True)
                stage_map = self.stage_maps[i](normed, nx, ny)
                maps.append(stage_map.permute(0, 2, 3, 1) if output_fmt == "NHWC" else stage_map)
            if intermediates_only and stop_early and i == take[-1]:
                break
        if intermediates_only:
            return maps
        return self._final(tokens, nx, ny), maps

    def prune_intermediate_layers(
        self, indices: Optional[Union[int, Sequence[int]]] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Remove the stages after the last of ``indices`` (and with them the final norm, the classifier and its
        pooling, made for the last stage's features; ``num_features`` becomes the new last stage's), the final norm
        if ``prune_norm``, the classifier and pooling if ``prune_head``; returns the stage indices to ask
        :meth:`forward_intermediates` for."""
        take = self._take_indices(indices)
        keep = take[-1] + 1
        cut = keep < len(self.stage_specs)
        for spec in self.stage_specs[keep:]:
            delattr(self, f"layer{spec.index}")
        self.stage_maps = self.stage_maps[:keep]
        if prune_norm or cut:
            self.norm = nn.Identity()
        self.stage_specs, self.feature_info = self.stage_specs[:keep], self.feature_info[:keep]
        self.total_stride = self.feature_info[-1]["reduction"]  # the stages left: the smallest image they take
        self.num_features = self.head_hidden_size = self.feature_info[-1]["num_chs"]
        if prune_head or cut:  # the classifier and its pooling were made for the last stage's features: they go
            self.global_pool = ""
            self.reset_classifier(0)
        return take

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> the last stage's normalised map (B, H', W', C); its global tokens, if it has any,
        in the map's attribute ``global_tokens``."""
        tokens, (nx, ny) = deque(self._stages(x), maxlen=1).pop()  # the last stage's
        return self._final(tokens, nx, ny)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The map of :meth:`forward_features` -> pooled features (``pre_logits``) or logits. ``"token"`` takes the
        first global token, ``"avg"`` averages every token (global ones included), ``""`` returns ``x`` as it is."""
        if self.global_pool == "":
            return x if pre_logits else self.head(x)
        tokens = x.flatten(1, 2)
        if self.stage_specs[-1].num_global:
            global_tokens = getattr(x, "global_tokens", None)
            if global_tokens is None:
                raise ValueError(
                    f"global_pool {self.global_pool!r} pools this model's global tokens, which forward_head finds in "
                    "the attribute global_tokens of forward_features' output; pass that output as it is."
                )
            tokens = global_tokens if self.global_pool == "token" else torch.cat([global_tokens, tokens], dim=1)
        pooled = tokens[:, 0] if self.global_pool == "token" else tokens.mean(dim=1)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# The attention of s1 stages (MsViT's attention argument).
MECHANISMS: tuple[str, ...] = ("longformer", "full", "linformer", "srformer", "performer")


# --- Registration with timm: timm.create_model("vil_small"), features_only, pretrained_cfg_overlay=dict(file=...) ---


def _smallest_image(specs, attention):
    """The side of the smallest square image an srformer model of stage ``specs`` takes (a multiple of its total
    stride): each stage reduces its map by its f to at least 2x2 positions for its instance norm. None for the other
    mechanisms."""
    if attention.get("attention") != "srformer":
        return None
    stride, side = 1, 1
    for spec in specs:
        stride *= spec.patch
        if spec.local:
            side = max(side, 2 * spec.window * stride)
    return -(-side // stride) * stride


def _input_fields(arch, attention, input_size, pad=False):
    """The ``pretrained_cfg`` fields that follow from the architecture and the attention, for images of
    ``input_size`` (C, H, W); ``pad``: the patch embeddings pad their input (``dynamic_img_pad``)."""
    specs = parse_arch(arch)
    smallest = _smallest_image(specs, attention)
    # Linformer's projections, in its local stages, are made for one map (MsViT.fixed_input_size).
    fixed = attention.get("attention") == "linformer" and any(spec.local for spec in specs)
    return {
        **({"min_input_size": (3, smallest, smallest)} if smallest else {}),
        "pool_size": stage_map_sizes(specs, input_size[1:], pad)[-1],  # forward_features' map at input_size
        "fixed_input_size": fixed,
    }


def _cfg(name, url="", size=224, num_classes=1000, description=None):
    arch, attention = VARIANTS[name]
    return {
        **_input_fields(arch, attention, (3, size, size)),
        "url": url,
        "num_classes": num_classes,
        "input_size": (3, size, size),
        "crop_pct": 0.875 if size == 224 else 0.922,  # the original recipes' evaluation crops (224 and 384)
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "layer1.0.proj",
        "classifier": "head",
        "license": "mit",
        "paper_ids": "arXiv:2103.15358",
        "origin_url": "https://github.com/microsoft/vision-longformer",
        "description": description,
    }


# The original release's checkpoints (its README): tag -> (file under ORIGINAL_RELEASE_URL, ImageNet-1K top-1, top-5
# as published). The first tag of a preset is its default. in22k: the ImageNet-22K pre-training (21,841 classes);
# in22k_ft_in1k_384: that, fine-tuned on ImageNet-1K at 384x384.
ORIGINAL_RELEASE_URL = "https://penzhanwu2.blob.core.windows.net/imagenet/msvit/"
PRETRAINED = {
    "vil_tiny.in1k": ("visionlongformer/msvit_tiny_longformersw_1191_train/model_best.pth", 76.3, 93.3),
    "vil_tiny_rpb.in1k": (
        "visionlongformer/longtiny1191_ape0_exact0_nglo1_mode1_swith075/model_best.pth",
        76.65,
        93.55,
    ),
    "vil_small.in1k": ("visionlongformer/msvit_small_longformersw_1281_train/model_best.pth", 82.0, 95.8),
    "vil_small_rpb.in1k": ("visionlongformer/small1281_relative/model_best.pth", 82.39, 95.92),
    "vil_medium_deep.in1k": ("visionlongformer/deepmedium_14161_lr8e-4/model_best.pth", 83.3, 96.3),
    "vil_medium_deep.in22k_ft_in1k_384": (
        "IN384_IN22kpretrained/msvitdeepmedium_imagenet384_finetune_bsz256_lr001_wd0/model_best.pth",
        85.6,
        97.7,
    ),
    "vil_medium_deep.in22k": ("IN22kpretrained/deepmedium/model_best.pth", None, None),
    "vil_medium_deep_rpb.in1k": (
        "visionlongformer/longdeepmedium_ape0_exact0_mode1_switch075/model_best.pth",
        83.52,
        96.52,
    ),
    "vil_medium_deep_rpb.in22k_ft_in1k_384": (
        "IN384_IN22kpretrained/msvitdeepmedium_imagenet384_finetune_bsz256_lr001_wd1e-7_ape0/model_best.pth",
        85.73,
        97.8,
    ),
    "vil_medium_deep_rpb.in22k": ("IN22kpretrained/deepmedium_relative/model_best.pth", None, None),
    "vil_medium_wide.in1k": ("visionlongformer/wide_medium_1281/model_best.pth", 82.9, 96.4),
    "vil_medium_wide.in22k_ft_in1k_384": (
        "IN384_IN22kpretrained/msvitwidemedium_imagenet384_finetune_bsz512_lr004_wd0/model_best.pth",
        84.7,
        97.3,
    ),
    "vil_medium_wide.in22k": ("IN22kpretrained/widemedium/model_best.pth", None, None),
    "vil_base_deep.in22k_ft_in1k_384": (
        "IN384_IN22kpretrained/msvitdeepbase_imagenet384_finetune_bsz640_lr003_wd0/model_best.pth",
        86.0,
        97.9,
    ),
    "vil_base_deep.in22k": ("IN22kpretrained/deepbase/model_best.pth", None, None),
    "vil_base_deep_rpb.in22k_ft_in1k_384": (
        "IN384_IN22kpretrained/msvitdeepbase_imagenet384_finetune_bsz320_lr0015_wd0_ape0/model_best.pth",
        86.11,
        97.89,
    ),
    "vil_base_deep_rpb.in22k": ("IN22kpretrained/deepbase_relative/model_best.pth", None, None),
    "vil_base_wide.in22k_ft_in1k_384": (
        "IN384_IN22kpretrained/msvitwidebase_imagenet384_finetune_bsz768_lr001_wd1e-7/model_best.pth",
        86.2,
        98.0,
    ),
    "vil_base_wide.in22k": ("IN22kpretrained/widebase/model_best.pth", None, None),
    # The attention comparison (COMPARISONS). The global-memory checkpoints are not tags: their number of global
    # tokens is not known here. The performer's 256 features fit its published parameter counts (24.8M, 24.7M), which
    # include the projections.
    "vil_small_full.in1k": ("fullMSA/small1281/model_best.pth", 81.9, 95.8),
    "vil_small_linformer.in1k": ("linformer/small1281_full/model_best.pth", 81.0, 95.4),
    "vil_small_linformer_partial.in1k": ("linformer/small1281_partial/model_best.pth", 81.8, 95.9),
    "vil_small_srformer64.in1k": ("srformer/srformerfull1281/model_best.pth", 76.4, 92.9),
    "vil_small_srformer32.in1k": ("srformer/srformerfull8_1281/model_best.pth", 79.9, 94.9),
    "vil_small_srformer32_partial.in1k": ("srformer/srformerpartial1281/model_best.pth", 81.6, 95.7),
    "vil_small_performer.in1k": ("performer/fullperformer1281/model_best.pth", 78.7, 94.3),
    "vil_small_performer_partial.in1k": ("performer/partialperformer1281/model_best.pth", 81.7, 95.7),
}
# Every registered model: name -> (arch string, its attention's MsViT arguments). vil_arch: any arch string (its
# argument ``arch``), ViL-Small's by default: the models trained from a config, as Hub folders rebuild them.
VARIANTS = {
    **{name: (arch, {}) for name, arch in PRESETS.items()},
    **COMPARISONS,
    "vil_arch": (PRESETS["vil_small"], {}),
}


def _tag_cfg(tag, file, top1, top5):
    name, kind = tag.split(".")
    about = (
        f"The original release's checkpoint: ImageNet-1K top-1 {top1}, top-5 {top5} as published."
        if top1
        else "The original release's ImageNet-22K pre-training."
    )
    return _cfg(
        name,
        ORIGINAL_RELEASE_URL + file,
        size=384 if kind.endswith("_384") else 224,
        num_classes=21841 if kind == "in22k" else 1000,
        description=about,
    )


default_cfgs = generate_default_cfgs(
    {
        **{tag: _tag_cfg(tag, *published) for tag, published in PRETRAINED.items()},
        **{name: _cfg(name) for name in VARIANTS if not any(t.startswith(name + ".") for t in PRETRAINED)},
    }
)


def _feature_cfg(kwargs, stages):
    """timm's feature extractor for ``features_only`` (by default, the maps of all ``stages``), taking
    ``feature_cls`` and ``output_fmt`` out of ``kwargs``. The stages return tokens, so only the extractors that read
    the maps work: ``"getter"`` (the default; NCHW or NHWC maps), and ``"hook"`` and ``"fx"``, which catch the
    :class:`StageMap` outputs (NCHW)."""
    feature_cfg = dict(feature_cls="getter", out_indices=tuple(range(stages)))
    if not kwargs.get("features_only"):
        return feature_cfg
    feature_cls, output_fmt = kwargs.pop("feature_cls", "getter"), kwargs.pop("output_fmt", "NCHW")
    if isinstance(feature_cls, str) and feature_cls not in ("getter", "hook", "fx"):
        raise ValueError(
            f"feature_cls {feature_cls!r} does not give this model's maps (its stages return tokens); "
            "use 'getter' (the default), 'hook' or 'fx'."
        )
    if output_fmt not in ("NCHW", "NHWC"):
        raise ValueError(f"output_fmt {output_fmt!r} is not a layout of feature maps; use 'NCHW' or 'NHWC'.")
    if output_fmt != "NCHW" and feature_cls != "getter":
        raise ValueError(
            f"feature_cls {feature_cls!r} returns NCHW maps; for output_fmt {output_fmt!r} use "
            "feature_cls 'getter' (the default)."
        )
    return dict(feature_cfg, feature_cls=feature_cls, output_fmt=output_fmt)


def _downloaded(cfg):
    return download_checkpoint(cfg.url, f"{cfg.architecture}.{cfg.tag}.pth")


def pretrained_checkpoint(name: str) -> Optional[str]:
    """The checkpoint file of the pretrained tag ``name`` (``"vil_small.in1k"``; ``"vil_small"``: its default
    tag), downloaded once into torch hub's cache; None when ``name`` is no published tag."""
    try:
        cfg = get_pretrained_cfg(name, allow_unregistered=True)
    except RuntimeError:  # a preset with a tag it does not have
        return None
    return _downloaded(cfg) if cfg is not None and cfg.url else None


def _create_vil(variant, pretrained=False, **kwargs):
    """The preset ``variant`` at its pretrained tag's image size; with ``pretrained``, a published checkpoint is
    downloaded into torch hub's cache under its tag's name (the original release names every file
    model_best.pth, which the cache, keyed by file name, would mix up) and converted on load. A
    ``pretrained_cfg_overlay`` file may be a Hub folder (tools/export_hub.py): its weights are loaded. The file's
    classifier sets the overlay's ``num_classes``, so that a model of that many classes (the default) keeps it.
    ``device`` and ``dtype`` are timm's: on the meta device the model is built without memory (weights come later,
    e.g. ``load_state_dict(..., assign=True)``); on any other it is built and loaded on the CPU, then moved."""
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    on_meta = device is not None and torch.device(device).type == "meta"
    if pretrained and on_meta:
        raise ValueError(
            "pretrained weights cannot be loaded into a model on the meta device; build it with pretrained=False "
            "and load the weights with load_state_dict(..., assign=True), or build it on a real device."
        )
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    if pretrained and overlay.get("file") and not os.path.exists(overlay["file"]):
        raise FileNotFoundError(
            f"Checkpoint {overlay['file']} does not exist; give pretrained_cfg_overlay's file as a .pth or "
            ".safetensors file, or a Hub folder (tools/export_hub.py)."
        )
    folder = overlay.get("file") if os.path.isdir(overlay.get("file") or "") else None
    if folder:
        overlay = kwargs["pretrained_cfg_overlay"] = dict(overlay, file=os.path.join(folder, SAFETENSORS_NAME))
    cfg = resolve_pretrained_cfg(
        variant,
        pretrained_cfg=kwargs.get("pretrained_cfg"),
        pretrained_cfg_overlay=kwargs.get("pretrained_cfg_overlay"),
    )
    kwargs.setdefault("img_size", cfg.input_size[-1])
    arch, attention = VARIANTS[variant]
    arch = kwargs.pop("arch", arch)
    traced = kwargs.get("feature_cls") == "fx" or (
        isinstance(kwargs.get("feature_cls"), type) and issubclass(kwargs["feature_cls"], FeatureGraphNet)
    )
    if traced and kwargs.get("attention", attention.get("attention")) == "performer":
        raise ValueError(
            "feature_cls 'fx' cannot extract a performer model's features: tracing drops the redraw of its "
            "random features; use feature_cls 'getter' (the default) or 'hook'."
        )
    if pretrained and cfg.url and not (cfg.file or cfg.state_dict):
        kwargs["pretrained_cfg_overlay"] = dict(overlay, file=_downloaded(cfg))
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    folder = folder or (cfg.file if cfg.file and os.path.isdir(cfg.file) else None)  # also timm's local-dir:
    local = folder or overlay.get("file") or cfg.file
    if pretrained and local:
        # Read as load_checkpoint reads it, so that a damaged file, or one that holds no weights, is refused in one
        # sentence before timm loads it (timm checks neither).
        checkpoint = read_checkpoint(local)
        if overlay.get("file") and "num_classes" not in overlay:
            # timm keeps a classifier only of the pretrained config's class count: the file's
            classes = classifier_classes(checkpoint, local)
            if classes is not None:
                kwargs["pretrained_cfg_overlay"] = dict(overlay, num_classes=classes)
    source = overlay.get("file") or cfg.file or cfg.hf_hub_id or variant
    defaults = {name: p.default for name, p in inspect.signature(MsViT).parameters.items()}
    options = {**defaults, **attention, **kwargs, "arch": arch}  # what the model is built with
    if pretrained and folder:  # timm reads the folder's weights alone: its config.json's model options are checked here
        check_trained_options(with_hub_config({}, folder), options, folder)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = build_model_with_cfg(
            MsViT,
            variant,
            pretrained,
            arch=arch,
            pretrained_filter_fn=partial(checkpoint_filter_fn, source=source, options=options),
            feature_cfg=_feature_cfg(kwargs, len(parse_arch(arch))),
            **{**attention, **kwargs},
        )
    if (device is not None and not on_meta) or dtype is not None:
        model.to(device=None if on_meta else device, dtype=dtype)
    # The fields of the model as built: its arch, attention, padding and (where it takes one size only) image size.
    built = {"attention": options["attention"]}
    input_size = model.pretrained_cfg["input_size"]
    if _input_fields(arch, built, input_size)["fixed_input_size"]:  # the one size, which timm's data config resolves
        input_size = (options["in_chans"], *to_2tuple(options["img_size"]))
    fields = _input_fields(arch, built, input_size, options["dynamic_img_pad"])
    rest = {k: v for k, v in model.pretrained_cfg.items() if k != "min_input_size"}
    model.pretrained_cfg = model.default_cfg = {**rest, **fields, "input_size": input_size}
    return model


@register_model
def vil_arch(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """A ViL of the architecture string ``arch`` (ViL-Small's when not given)."""
    return _create_vil("vil_arch", pretrained, **kwargs)


@register_model
def vil_tiny(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Tiny, absolute position embedding."""
    return _create_vil("vil_tiny", pretrained, **kwargs)


@register_model
def vil_tiny_rpb(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Tiny, relative position bias."""
    return _create_vil("vil_tiny_rpb", pretrained, **kwargs)


@register_model
def vil_small(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small, absolute position embedding."""
    return _create_vil("vil_small", pretrained, **kwargs)


@register_model
def vil_small_rpb(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small, relative position bias."""
    return _create_vil("vil_small_rpb", pretrained, **kwargs)


@register_model
def vil_medium_deep(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Medium-Deep, absolute position embedding."""
    return _create_vil("vil_medium_deep", pretrained, **kwargs)


@register_model
def vil_medium_deep_rpb(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Medium-Deep, relative position bias."""
    return _create_vil("vil_medium_deep_rpb", pretrained, **kwargs)


@register_model
def vil_medium_wide(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Medium-Wide, absolute position embedding."""
    return _create_vil("vil_medium_wide", pretrained, **kwargs)


@register_model
def vil_medium_wide_rpb(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Medium-Wide, relative position bias."""
    return _create_vil("vil_medium_wide_rpb", pretrained, **kwargs)


@register_model
def vil_base_deep(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Base-Deep, absolute position embedding."""
    return _create_vil("vil_base_deep", pretrained, **kwargs)


@register_model
def vil_base_deep_rpb(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Base-Deep, relative position bias."""
    return _create_vil("vil_base_deep_rpb", pretrained, **kwargs)


@register_model
def vil_base_wide(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Base-Wide, absolute position embedding."""
    return _create_vil("vil_base_wide", pretrained, **kwargs)


@register_model
def vil_base_wide_rpb(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Base-Wide, relative position bias."""
    return _create_vil("vil_base_wide_rpb", pretrained, **kwargs)


@register_model
def vil_small_full(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small with full attention in every stage (the comparison's baseline)."""
    return _create_vil("vil_small_full", pretrained, **kwargs)


@register_model
def vil_small_linformer(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, linformer attention (256 projected tokens) in all four stages."""
    return _create_vil("vil_small_linformer", pretrained, **kwargs)


@register_model
def vil_small_linformer_partial(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, linformer attention in stages 1-2, full attention after."""
    return _create_vil("vil_small_linformer_partial", pretrained, **kwargs)


@register_model
def vil_small_srformer64(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, spatial-reduction attention in all four stages (ratios 16, 8, 4, 2)."""
    return _create_vil("vil_small_srformer64", pretrained, **kwargs)


@register_model
def vil_small_srformer32(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, spatial-reduction attention in stages 1-3 (ratios 8, 4, 2), full in stage 4."""
    return _create_vil("vil_small_srformer32", pretrained, **kwargs)


@register_model
def vil_small_srformer32_partial(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, spatial-reduction attention in stages 1-2 (ratios 8, 4), full after."""
    return _create_vil("vil_small_srformer32_partial", pretrained, **kwargs)


@register_model
def vil_small_performer(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, performer attention (256 random features) in all four stages."""
    return _create_vil("vil_small_performer", pretrained, **kwargs)


@register_model
def vil_small_performer_partial(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, performer attention in stages 1-2, full attention after."""
    return _create_vil("vil_small_performer_partial", pretrained, **kwargs)


@register_model
def vil_small_global(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, global-memory attention (ONLY_GLOBAL, 64 global tokens) in all four stages."""
    return _create_vil("vil_small_global", pretrained, **kwargs)


@register_model
def vil_small_global_partial(pretrained: bool = False, **kwargs: Any) -> MsViT:
    """ViL-Small-sized, global-memory attention in stages 1-2, full attention after."""
    return _create_vil("vil_small_global_partial", pretrained, **kwargs)
