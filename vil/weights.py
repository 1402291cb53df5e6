"""The weights a run starts from or a tool evaluates: ``MODEL.MODEL_PATH`` resolved to a checkpoint file (a path,
the same path under ``DATA.DATA_DIR``, or a pretrained tag) and loaded into a model.

Kept apart from :mod:`vil.checkpoint` (reading and writing checkpoint files), which the models import: this needs
the models, for their pretrained tags and the conversion of position tables."""

import logging
import os

from .checkpoint import ema_state, load_model_state, model_state, read_checkpoint
from .models import pretrained_checkpoint
from .models.convert import fit_to_model

log = logging.getLogger("vil")


def resolve_model_path(cfg):
    """``MODEL.MODEL_PATH`` (a checkpoint file, a ``.safetensors`` file or a Hub folder); when that does not exist,
    the same path under ``DATA.DATA_DIR`` (as the original release looked it up), or the checkpoint of a pretrained
    tag (``vil_small.in1k``), downloaded once."""
    path = cfg.MODEL.MODEL_PATH
    for candidate in (path, os.path.join(cfg.DATA.DATA_DIR, path)):
        if path and os.path.exists(candidate):
            return candidate
    downloaded = pretrained_checkpoint(path)
    if downloaded:
        return downloaded
    raise FileNotFoundError(
        f"Checkpoint {path} does not exist (nor under DATA.DATA_DIR {cfg.DATA.DATA_DIR}), and is "
        "not a pretrained tag (timm.list_pretrained('vil*') lists them)."
    )


def fitted_state(checkpoint, path, model, ema=False):
    """The model weights of the checkpoint dict read from ``path`` (its EMA weights with ``ema``), position tables
    resized to ``model``'s image size."""
    return fit_to_model((ema_state if ema else model_state)(checkpoint, path), model, path)


def load_weights(model, cfg, new_classifier=False):
    """Load the weights of ``MODEL.MODEL_PATH`` (this project's checkpoint, the original release's, a bare state
    dict; its EMA weights with ``MODEL.LOAD_EMA``) into ``model``, position tables resized to the model's image
    size. With ``new_classifier``, a classifier of another class count stays the model's fresh one, and the
    log says so; otherwise it is refused with the rest of a checkpoint that does not fit."""
    path = resolve_model_path(cfg)
    state = fitted_state(read_checkpoint(path), path, model, cfg.MODEL.LOAD_EMA)
    head = {k: v.shape for k, v in state.items() if k.startswith("head.")}
    if head != {k: v.shape for k, v in model.state_dict().items() if k.startswith("head.")}:
        found = f"a classifier for {head['head.weight'][0]} classes" if "head.weight" in head else "no classifier"
        if not new_classifier:
            raise ValueError(
                f"Checkpoint {path} has {found}, "
                f"not one for the DATA.NUM_CLASSES {model.num_classes} classes of this model."
            )
        log.info(f"Checkpoint {path} has {found}: this run trains a new one for DATA.NUM_CLASSES {model.num_classes}.")
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    load_model_state(model, state, path, may_miss=("head.",))
    return path
