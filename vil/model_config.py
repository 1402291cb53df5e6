"""The model a config describes: :func:`build_model`, from the MsViT arguments of ``MODEL.*`` (:func:`model_kwargs`).

``MODEL.VIT.MSVIT.ATTN_TYPE`` names the attention of the ``s1`` stages: ``longformer`` (ViL's local attention, each
call computed by the fastest backend for it), the name of a local attention backend (``vil.ops.available_backends()``:
ViL's attention computed by that backend), a name of earlier configs for one (:data:`ATTN_TYPE_ALIASES`), or one of
the other mechanisms (``full``, ``linformer``, ``srformer``, ``performer``).
"""

from typing import Any, Optional

from yacs.config import CfgNode

from .config import MODEL_ARGUMENT_KEYS, config_value, did_you_mean
from .models.msvit import MECHANISMS, MsViT
from .ops import available_backends

# ATTN_TYPE names of the original release's configs -> the backend each means. Earlier configs of this project
# name a backend ``longformer_<backend>``, which every backend takes (:func:`attention_of`).
ATTN_TYPE_ALIASES: dict[str, str] = {
    "longformerhand": "sliding_chunk",
    "longformerauto": "sliding_chunk_autograd",
    "longformer_cuda": "triton",  # the original release's custom kernel
}
BACKEND_PREFIX = "longformer_"


def attn_types() -> list[str]:
    """Every name ``MODEL.VIT.MSVIT.ATTN_TYPE`` takes."""
    backends = available_backends(2)
    return [*MECHANISMS, *backends, *ATTN_TYPE_ALIASES, *(BACKEND_PREFIX + name for name in backends)]


def attention_of(attn_type: str) -> tuple[str, Optional[str]]:
    """``(attention, attn_backend)``, the :class:`MsViT` arguments an ATTN_TYPE stands for."""
    if attn_type in MECHANISMS:
        return attn_type, None
    backend = ATTN_TYPE_ALIASES.get(attn_type, attn_type.removeprefix(BACKEND_PREFIX))
    if backend not in available_backends(2):
        raise ValueError(
            f"Unknown MODEL.VIT.MSVIT.ATTN_TYPE {attn_type!r}{did_you_mean(attn_type, attn_types())}; known: "
            f"{', '.join(attn_types())}."
        )
    return "longformer", backend


def mechanism_of(attn_type: str) -> Optional[str]:
    """The attention mechanism an ATTN_TYPE names (``longformer`` for every backend of ViL's attention, which
    compute the same model); None for a name this version does not know."""
    try:
        return attention_of(attn_type)[0]
    except ValueError:
        return None


def model_kwargs(cfg: CfgNode) -> dict[str, Any]:
    """The :class:`MsViT` arguments (``arch`` included) that ``cfg`` (from :func:`vil.config.load_cfg`) describes."""
    if cfg.MODEL.ARCH != "msvit":
        raise ValueError(f"MODEL.ARCH {cfg.MODEL.ARCH!r} is not a model of this project; it must be 'msvit'.")
    msvit = cfg.MODEL.VIT.MSVIT
    attention, backend = attention_of(msvit.ATTN_TYPE)
    arguments = {name: config_value(cfg, key) for name, key in MODEL_ARGUMENT_KEYS.items()}
    return dict(arguments, attention=attention, attn_backend=backend)


def build_model(cfg: CfgNode) -> MsViT:
    """The model ``cfg`` (a config from :func:`vil.config.load_cfg`) describes."""
    return MsViT(**model_kwargs(cfg))
