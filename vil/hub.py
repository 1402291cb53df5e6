"""A trained model as a Hugging Face Hub folder, in timm's layout: ``model.safetensors`` (the weights alone),
``config.json`` (the architecture, its arguments and the ``pretrained_cfg``: class count and names, mean, std, input
size, crop, interpolation) and a ``README.md`` model card. ``timm.create_model("local-dir:DIR")`` rebuilds the model
from it; every place of this project that takes a checkpoint takes the folder too.
"""

import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Optional

import safetensors.torch
import timm
import torch
from timm.data import ImageNetInfo
from timm.models._hub import save_config_for_hf  # timm's writer of config.json (save_for_hf without the weights)
from torchvision.datasets.folder import find_classes

from .checkpoint import SAFETENSORS_NAME, hub_record, read_checkpoint, recorded_classes
from .data import INTERPOLATIONS
from .files import OutputError, atomic_write, check_writable_folder
from .model_config import model_kwargs
from .models import stage_map_sizes
from .profiling import flop_counter
from .shards import INDEX, ShardDataset
from .weights import load_read_weights, resolve_model_path

log = logging.getLogger("vil")

# What a model is built from, as config.json records it (the rest of model_kwargs is training's: dropout rates,
# and the backend, which the loading machine chooses).
_TRAINING_ONLY = ("drop_rate", "drop_path_rate", "attn_backend")

CITATION = (  # the original release's
    "@article{zhang2021multi,\n"
    "  title={Multi-Scale Vision Longformer: A New Vision Transformer for High-Resolution Image Encoding},\n"
    "  author={Zhang, Pengchuan and Dai, Xiyang and Yang, Jianwei and Xiao, Bin and Yuan, Lu and Zhang, Lei and "
    "Gao, Jianfeng},\n"
    "  journal={arXiv preprint arXiv:2103.15358},\n"
    "  year={2021}\n"
    "}"
)


def hub_model_args(cfg) -> dict:
    """The arguments of the registered model ``vil_arch`` that rebuild the model ``cfg`` describes."""
    return {k: v for k, v in model_kwargs(cfg).items() if k not in _TRAINING_ONLY}


def class_names(cfg, checkpoint=None) -> list:
    """The names of the classes of ``cfg``'s model, by class index: those ``checkpoint`` (a checkpoint dict)
    records where they are as many, else those of the config's training data (:func:`data_class_names`), else
    ImageNet's (timm's) for 1000 classes, else the indices as text."""
    recorded = None if checkpoint is None else recorded_classes(checkpoint)
    if recorded is not None and len(recorded) == cfg.DATA.NUM_CLASSES:
        return recorded
    return data_class_names(cfg) or default_class_names(cfg.DATA.NUM_CLASSES)


def data_class_names(cfg) -> Optional[list]:
    """The names of the classes of ``cfg``'s training data, by class index: ``DATA.CLASSES`` when set, the digits,
    the class folders of ``DATA.PATH/train`` when they are there (the classes its ``index.json`` lists, for shards);
    None where the config names none."""
    if cfg.DATA.CLASSES:
        return _of_the_class_count(list(cfg.DATA.CLASSES), "DATA.CLASSES", cfg.DATA.NUM_CLASSES)
    if cfg.DATA.TRAIN[0] == "digits":
        return _of_the_class_count([str(d) for d in range(10)], "The digits data set", cfg.DATA.NUM_CLASSES)
    folder = os.path.join(cfg.DATA.PATH, "train")
    names = None
    if cfg.DATA.FORMAT == "folder" and os.path.isdir(folder):
        names = find_classes(folder)[0]
    elif cfg.DATA.FORMAT == "shards" and os.path.isfile(os.path.join(folder, INDEX)):
        try:
            names = ShardDataset(folder).classes
        except ValueError as e:  # a split that cannot be read names no classes
            log.warning(f"The classes are not named after {folder}: {e}")
    return _of_the_class_count(names, folder, cfg.DATA.NUM_CLASSES)


def _of_the_class_count(names, source, num_classes):
    """``names`` where they are ``num_classes``, else None, said once (``source``: where they are from)."""
    if names is not None and len(names) != num_classes:
        log.warning(f"{source} names {len(names)} classes, not DATA.NUM_CLASSES {num_classes}: they name none here.")
        return None
    return names


def default_class_names(num_classes: int) -> list:
    """ImageNet's synsets (timm's) for 1000 classes, else the class indices as text."""
    return list(ImageNetInfo().label_names()) if num_classes == 1000 else [str(i) for i in range(num_classes)]


def export_hub_folder(cfg, out: str) -> dict:
    """Write the Hub folder of ``MODEL.MODEL_PATH`` (its EMA weights with ``MODEL.LOAD_EMA``) under ``cfg`` to
    ``out``, with the class names of :func:`class_names`; returns what the model card states. A
    checkpoint that does not fit ``cfg``'s model, or was trained with other model options, is refused as evaluation
    refuses it (:func:`~vil.weights.load_weights`)."""
    path = resolve_model_path(cfg)
    checkpoint = read_checkpoint(path)
    ema = cfg.MODEL.LOAD_EMA
    args = hub_model_args(cfg)
    model = timm.create_model("vil_arch", **args).eval()
    load_read_weights(model, cfg, path, checkpoint, ema)
    _check_not_others(out)
    check_writable_folder(out, "--out")  # after the checkpoint: a refused one leaves no empty folder behind
    size = cfg.INPUT.IMAGE_SIZE
    data_config = dict(  # timm's names
        input_size=(3, size, size),
        crop_pct=cfg.INPUT.CROP_PCT,
        interpolation=INTERPOLATIONS[cfg.INPUT.INTERPOLATION],
        mean=tuple(cfg.INPUT.MEAN),
        std=tuple(cfg.INPUT.STD),
    )
    names = class_names(cfg, checkpoint)
    card = dict(
        arch=args["arch"],
        weights="EMA" if ema else "model",
        parameters=sum(p.numel() for p in model.parameters()),
        gmacs=_gmacs(model, size),
        top1=_recorded(checkpoint.get("best_acc")),
        epoch=checkpoint.get("epoch"),
        classes=len(names),
        **data_config,
    )
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}  # no shared storage
    atomic_write(os.path.join(out, SAFETENSORS_NAME), lambda f: f.write(safetensors.torch.save(tensors)))
    pool = stage_map_sizes(model.stage_specs, (size, size), model.dynamic_img_pad)[-1]
    model.pretrained_cfg = dict(model.pretrained_cfg, **data_config, pool_size=pool)  # config.json's
    with tempfile.TemporaryDirectory() as scratch:
        config_path = Path(scratch, "config.json")
        save_config_for_hf(model, config_path, model_config=dict(label_names=names), model_args=args)
        config = config_path.read_bytes()
    atomic_write(os.path.join(out, "config.json"), lambda f: f.write(config))
    atomic_write(os.path.join(out, "README.md"), lambda f: f.write(model_card(card).encode()))
    return card


def _check_not_others(out):
    """Refuse an ``out`` whose README.md, config.json or model.safetensors an export would replace, unless they are a
    Hub folder of this project's (its previous export): files of the user's would be lost. Other files (a clone's
    .git, say) stay as they are."""
    ours = (SAFETENSORS_NAME, "config.json", "README.md")
    taken = [name for name in ours if os.path.exists(os.path.join(out, name))]
    if not taken:
        return
    try:
        previous = hub_record(out) is not None
    except ValueError:  # an unreadable config.json: not one this project wrote
        previous = False
    if not previous:
        raise OutputError(
            f"--out {out} holds {', '.join(taken)}, which the export would replace, and is not a Hub folder of this "
            "project; move them away or choose another folder."
        )


def _recorded(best):
    """A checkpoint's best top-1, or None before its run's first evaluation (-inf)."""
    return best if best is not None and math.isfinite(best) else None


def _gmacs(model, size):
    with torch.no_grad(), flop_counter() as counter:
        model(torch.zeros(1, 3, size, size))
    return counter.get_total_flops() / 2e9


def model_card(card: dict) -> str:
    """The folder's README.md: Hub metadata, then what the model is and how to use it."""
    # The run evaluates its model weights for its best top-1; the EMA weights' own is only logged.
    whose = ", its model weights', not these EMA weights'" if card["weights"] == "EMA" else ""
    top1 = "not recorded" if card["top1"] is None else f"{card['top1']:.2f}% (the run's best{whose})"
    return f"""---
tags:
- image-classification
- timm
- vil
library_name: timm
license: mit
---
# ViL: a Multi-Scale Vision Longformer

- Architecture string: `{card["arch"]}`
- Parameters: {card["parameters"] / 1e6:.2f}M; GMACs at {card["input_size"][-1]}x{card["input_size"][-1]}: \
{card["gmacs"]:.2f}
- Classes: {card["classes"]} (their names in config.json, `label_names`)
- Weights: the checkpoint's {card["weights"]} weights{"" if card["epoch"] is None else f", after epoch {card['epoch']}"}
- Top-1 on the run's evaluation data: {top1}
- Preprocessing: resize to {card["input_size"][-1]} / {card["crop_pct"]}, center crop {card["input_size"][-1]}, \
{card["interpolation"]} interpolation, mean {list(card["mean"])}, std {list(card["std"])}

## Use

```python
import timm
import vil  # registers the ViL models with timm

model = timm.create_model("local-dir:path/to/this/folder", pretrained=True).eval()
config = timm.data.resolve_data_config({{}}, model=model)
transform = timm.data.create_transform(**config)
```

Or `vil-predict --model local-dir:path/to/this/folder images/`.

## License

MIT, as the original release of ViL.

## Citation

```bibtex
{CITATION}
```
"""
