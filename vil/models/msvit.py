"""Multi-Scale Vision Longformer (ViL).

Module and parameter names follow the original release (``layer1.0.proj.weight``, ``layer1.1.attn.query``,
...), so its checkpoints load without conversion: stage k is ``layer<k>``, a sequence of a patch embedding
(index 0) followed by, per transformer layer, an attention block and an MLP block.
"""

from functools import partial

import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp, trunc_normal_
from torch.utils.checkpoint import checkpoint

from .arch import PRESETS, parse_arch
from ..ops import check_window_options
from .attention import FullAttention, LongformerAttention


class PatchEmbed(nn.Module):
    """Conv patch embedding, optional LayerNorm, G global tokens prepended, absolute position embedding."""

    def __init__(self, in_chans, dim, patch, nx, ny, num_global, ape, norm_embed, norm_layer, drop):
        super().__init__()
        self.nx, self.ny, self.num_global, self.ape = nx, ny, num_global, ape
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
        x = self.proj(x)
        B, C, nx, ny = x.shape
        x = x.flatten(2).transpose(1, 2)
        if self.norm_embed is not None:
            x = self.norm_embed(x)
        if self.num_global:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        if self.ape:
            grid = torch.cat(
                [self.x_pos_embed[:, :, None].expand(-1, -1, ny, -1), self.y_pos_embed[:, None].expand(-1, nx, -1, -1)], dim=3
            )
            x = x + torch.cat([self.cls_pos_embed, grid.flatten(1, 2)], dim=1)
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


class MsViT(nn.Module):
    """Multi-Scale Vision Longformer for images of ``img_size x img_size``.

    Args:
        arch: the architecture string (see :mod:`vil.models.arch`).
        full_attention: full attention in every stage (ATTN_TYPE full); otherwise only in s0 stages.
        attn_backend: the :func:`vil.ops.local_attention_2d` backend of the local stages (None: the fastest).
        sw_exact, mode, share_w, only_global: the longformer options of ``MODEL.VIT.MSVIT``.
    """

    def __init__(self, arch, img_size=224, in_chans=3, num_classes=1000, drop_rate=0.0, drop_path_rate=0.1,
                 norm_embed=True, avg_pool=False, full_attention=False, attn_backend=None, share_w=True, only_global=False,
                 sw_exact=0, mode=0, ln_eps=1e-6):
        super().__init__()
        self.stage_specs = parse_arch(arch)
        self.img_size, self.num_classes, self.avg_pool = img_size, num_classes, avg_pool
        stride = 1
        for spec in self.stage_specs:
            stride *= spec.patch
        if img_size % stride:
            raise ValueError(
                f"Image size {img_size} is not a multiple of the model's total stride {stride} (the product of the "
                f"stages' patch sizes); use a multiple of {stride}, e.g. {max(stride, img_size // stride * stride)}."
            )
        norm_layer = partial(nn.LayerNorm, eps=ln_eps)
        rates = torch.linspace(0, drop_path_rate, sum(s.depth for s in self.stage_specs)).tolist()

        in_dim, size, layer = in_chans, img_size, 0
        for spec in self.stage_specs:
            size //= spec.patch
            blocks = [PatchEmbed(in_dim, spec.dim, spec.patch, size, size, spec.num_global, spec.ape, norm_embed, norm_layer, drop_rate)]
            for _ in range(spec.depth):
                if spec.local and not full_attention:
                    attn = LongformerAttention(
                        spec.dim, spec.heads, spec.num_global, spec.window, rpe=not spec.ape, exact=sw_exact, mode=mode,
                        share_w=share_w, only_global=only_global, backend=attn_backend, drop=drop_rate,
                    )
                else:
                    attn = FullAttention(spec.dim, spec.heads, spec.num_global, size, size, rpe=not spec.ape, drop=drop_rate)
                blocks.append(AttnBlock(spec.dim, attn, norm_layer, rates[layer]))
                blocks.append(MlpBlock(spec.dim, norm_layer, drop_rate, rates[layer]))
                layer += 1
            self.add_module(f"layer{spec.index}", Stage(*blocks))
            in_dim = spec.dim
        self.num_features = in_dim
        self.norm = norm_layer(in_dim)
        self.head = nn.Linear(in_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self):
        """Names of the parameters trained without weight decay (position embeddings, tokens, norms, biases tables)."""
        keywords = ("pos_embed", "cls_token", "norm.weight", "norm.bias", "norm_embed", "head.bias", "relative_position")
        return {name for name, _ in self.named_parameters() if any(k in name for k in keywords)}

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable=True):
        """Recompute each block's activations in backward instead of keeping them (less memory, more time)."""
        for spec in self.stage_specs:
            getattr(self, f"layer{spec.index}").grad_checkpointing = enable

    def reset_vil_mode(self, mode):
        """Set the neighbour mode of every longformer attention layer (e.g. 0 when random shifting ends)."""
        layers = [m for m in self.modules() if isinstance(m, LongformerAttention)]
        for m in layers:
            check_window_options(m.exact, mode)
        for m in layers:
            m.mode = mode

    def forward_features(self, x):
        """Images (B, C, H, W) -> the final normalised tokens (B, G + N, C) of the last stage."""
        if x.dim() != 4 or x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(
                f"This model takes images of shape (B, C, {self.img_size}, {self.img_size}); got {tuple(x.shape)}."
            )
        for i, spec in enumerate(self.stage_specs):
            x, (nx, ny) = getattr(self, f"layer{spec.index}")(x)
            if i + 1 < len(self.stage_specs):  # drop the global tokens; the local ones form the next stage's image
                x = x[:, spec.num_global :].transpose(1, 2).reshape(x.shape[0], -1, nx, ny)
        return self.norm(x)

    def forward_head(self, x):
        pooled = x[:, 0] if self.stage_specs[-1].num_global and not self.avg_pool else x.mean(dim=1)
        return self.head(pooled)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


# Attention implementations by MODEL.VIT.MSVIT.ATTN_TYPE: the local_attention_2d backend, or "full".
ATTN_TYPES = {
    "full": "full",
    "longformerhand": "sliding_chunk",
    "longformerauto": "sliding_chunk_autograd",
    "longformer_triton": "triton",
    "longformer_cuda": "triton",  # the original release's name for its custom kernel
    "longformer_flex": "flex",
    "longformer_unfold": "unfold",
    "longformer_unfold_nnf": "unfold_nnf",
    "longformer_chunk_rows": "chunk_rows",
}


def build_model(cfg):
    """The model ``cfg`` (a config from :func:`vil.config.load_cfg`) describes."""
    if cfg.MODEL.ARCH != "msvit":
        raise ValueError(f"MODEL.ARCH {cfg.MODEL.ARCH!r} is not a model of this project; it must be 'msvit'.")
    vit, msvit = cfg.MODEL.VIT, cfg.MODEL.VIT.MSVIT
    if msvit.ATTN_TYPE not in ATTN_TYPES:
        raise ValueError(f"Unknown MODEL.VIT.MSVIT.ATTN_TYPE {msvit.ATTN_TYPE!r}; known: {', '.join(ATTN_TYPES)}.")
    backend = ATTN_TYPES[msvit.ATTN_TYPE]
    check_window_options(msvit.SW_EXACT, msvit.MODE)  # also where no layer is a longformer one
    return MsViT(
        msvit.ARCH, img_size=cfg.INPUT.IMAGE_SIZE, num_classes=cfg.DATA.NUM_CLASSES, drop_rate=vit.DROP,
        drop_path_rate=vit.DROP_PATH, norm_embed=vit.NORM_EMBED, avg_pool=vit.AVG_POOL,
        full_attention=backend == "full", attn_backend=None if backend == "full" else backend,
        share_w=msvit.SHARE_W, only_global=msvit.ONLY_GLOBAL, sw_exact=msvit.SW_EXACT, mode=msvit.MODE, ln_eps=msvit.LN_EPS,
    )


def vil_tiny(**kwargs):
    return MsViT(PRESETS["vil_tiny"], **kwargs)


def vil_small(**kwargs):
    return MsViT(PRESETS["vil_small"], **kwargs)


def vil_medium_deep(**kwargs):
    return MsViT(PRESETS["vil_medium_deep"], **kwargs)


def vil_medium_wide(**kwargs):
    return MsViT(PRESETS["vil_medium_wide"], **kwargs)


def vil_base_deep(**kwargs):
    return MsViT(PRESETS["vil_base_deep"], **kwargs)


def vil_base_wide(**kwargs):
    return MsViT(PRESETS["vil_base_wide"], **kwargs)
