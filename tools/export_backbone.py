"""Turn a classification checkpoint into a detection backbone checkpoint.

    python tools/export_backbone.py IN OUT --format {torchvision,detectron2,mmdet} [options]

IN is this project's checkpoint (its architecture, image size and model options are read from the config stored
in it; an ``--arch`` or ``--config-file`` of another architecture, or a ``--config-file`` of other model options, is
refused) or the original release's (give ``--arch`` or ``--config-file``). Its weights are checked against that
model as loading them into it would be: those of another model are refused, naming the keys and shapes that do not
fit. The classifier and the final norm are dropped; the position tables are remade from the maps the model made them
for to those of the backbone, whose patch embeddings pad; the backbone's keys are written as a whole detector of the
framework names them: ``backbone.body.`` under ``"model"`` (torchvision), ``backbone.bottom_up.`` under ``"model"``
(detectron2, as the original detection release), ``backbone.`` under ``"state_dict"`` (mmdetection). The arch
string, image size and model options (``vil.detection.BACKBONE_OPTIONS`` other than the defaults) of the exported
backbone are stored beside them and printed. OUT is written atomically; an existing OUT is replaced only where it
is a backbone export (a checkpoint named as OUT by mistake is refused).
"""

import argparse
import os
import sys

import torch

from vil.checkpoint import model_state, read_checkpoint
from vil.config import load_cfg
from vil.detection import (
    BACKBONE_DEFAULTS,
    EXPORT_FORMATS,
    backbone_attention,
    backbone_state,
    check_options,
    checkpoint_image_size,
    classification_backbone_state,
    config_options,
    export_info,
    export_state,
    stored_config,
)
from vil.files import OutputError, atomic_write, check_writable_file
from vil.model_config import model_kwargs
from vil.models import PRESETS, MsViT, arch_string, parse_arch
from vil.models.convert import GLOBAL_INITS, check_convertible, fit_to_model


def _side(text):
    """An argparse type: an image side. The hint is for IN and OUT given after a size option, which takes them as
    sizes."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes image sides (N, or H W), got {text!r}; give IN and OUT before it, or end its values with --"
        ) from None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="classification checkpoint")
    parser.add_argument("output", help="backbone checkpoint to write")
    parser.add_argument(
        "--format", required=True, choices=list(EXPORT_FORMATS), help="the detection framework's layout"
    )
    parser.add_argument(
        "--arch", help="preset name or arch string of IN (default: the config stored in IN, which it must match)"
    )
    parser.add_argument(
        "--config-file",
        help="the YAML config IN was trained with (its arch, image size and model options; the config stored in IN "
        "goes first, and must agree with it)",
    )
    parser.add_argument(
        "--image-size",
        type=_side,
        nargs="+",
        help="image size IN was trained for, N or H W (default: the config stored in IN or given by "
        "--config-file, else read from IN's position tables, else 224)",
    )
    parser.add_argument(
        "--full-attention-to-local",
        action="store_true",
        help="turn full-attention stages into longformer stages (qkv split into query/kv and their _global twins)",
    )
    parser.add_argument("--num-global", type=int, help="global tokens per stage that has them (0 removes them)")
    parser.add_argument(
        "--global-init",
        choices=GLOBAL_INITS,
        default="copy",
        help="new global tokens: the learned ones repeated (copy) or their mean (average)",
    )
    parser.add_argument(
        "--new-image-size", type=_side, nargs="+", help="resize the position tables for images of N or H W"
    )
    return parser.parse_args(argv)


def _size(values, flag):
    if values is None:
        return None
    if len(values) not in (1, 2) or min(values) < 1:
        raise ValueError(f"{flag} takes one or two positive integers (N, or H W), not {' '.join(map(str, values))}.")
    return (values[0], values[-1])


def source_model(args, checkpoint):
    """The MsViT arguments of the classification model in IN, ``arch`` and ``img_size`` (H, W) included, without a
    classifier. Where IN stores its config, that says them, and an arch given by --arch or --config-file must be the
    stored one, and model options given by --config-file the stored ones; else --config-file's (its arch replaced by
    --arch's where given), else --arch's with the model's defaults."""
    given_cfg = load_cfg(args.config_file) if args.config_file is not None else None
    given = PRESETS.get(args.arch, args.arch) if args.arch else given_cfg and given_cfg.MODEL.VIT.MSVIT.ARCH
    stored = stored_config(checkpoint, args.input)
    cfg = stored or given_cfg
    if cfg is None and given is None:
        raise ValueError(
            f"{args.input} does not say which architecture it holds; "
            "give --arch (a preset or arch string) or --config-file."
        )
    kwargs = model_kwargs(cfg) if cfg is not None else {}
    arch = arch_string(parse_arch(stored.MODEL.VIT.MSVIT.ARCH if stored else given))
    if given is not None and arch_string(parse_arch(given)) != arch:
        flag, value = ("--arch", args.arch) if args.arch else ("--config-file", args.config_file)
        raise ValueError(
            f"{args.input} holds a model of arch {arch} (its stored config says so), not "
            f"{arch_string(parse_arch(given))} ({flag} {value}); leave {flag} out to export it as it is."
        )
    if stored and given_cfg:
        check_options(config_options(stored), config_options(given_cfg), args.input)
    size = (
        _size(args.image_size, "--image-size")
        or (cfg and (cfg.INPUT.IMAGE_SIZE,) * 2)
        or checkpoint_image_size(checkpoint, arch, args.input)
        or (224, 224)
    )
    return {**kwargs, "arch": arch, "img_size": size, "num_classes": 0}


def source_state(checkpoint, path, source):
    """The model weights in IN, checked against the classification model ``source`` describes (its MsViT arguments)
    as loading them into it is (keys and shapes; position tables made for another size resized), so that weights of
    another model are refused rather than exported under its arch."""
    return fit_to_model(model_state(checkpoint, path), MsViT(**source), path)


def check_replaceable(path):
    """Raise where OUT is a file other than a backbone export (an earlier one is replaced): a checkpoint named as OUT
    by mistake would be lost."""
    if not os.path.isfile(path):
        return
    try:
        earlier = backbone_state(read_checkpoint(path))
    except (ValueError, OSError):
        earlier = None
    if earlier is None:
        raise OutputError(
            f"OUT {path} is a file that is not a backbone export, which writing OUT would lose; choose another path, "
            "or remove the file first."
        )


def main(argv=None):
    args = parse_args(argv)
    try:
        check_writable_file(args.output, source=args.input)
        check_replaceable(args.output)
        checkpoint = read_checkpoint(args.input)
        if backbone_state(checkpoint) is not None:
            raise ValueError(
                f"{args.input} is a backbone export already (tools/export_backbone.py wrote it); give the "
                "classification checkpoint it was made from, or load it as it is (build_fpn_backbone)."
            )
        check_convertible(model_state(checkpoint, args.input), args.input)  # before its tables tell the image size
        source = source_model(args, checkpoint)
        attention = backbone_attention(
            source.get("attention", BACKBONE_DEFAULTS["attention"]), args.full_attention_to_local
        )
        state, specs, new_size = classification_backbone_state(
            source_state(checkpoint, args.input, source),
            source,
            pad=True,
            new_image_size=_size(args.new_image_size, "--new-image-size"),
            full_attention_to_local=args.full_attention_to_local,
            num_global=args.num_global,
            global_init=args.global_init,
        )
        new_arch = arch_string(specs)
        exported = export_state(state, args.format, new_arch, new_size, dict(source, attention=attention))
        atomic_write(args.output, lambda f: torch.save(exported, f))
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"{args.output}: {len(state)} backbone tensors in the {args.format} layout")
    print(f"arch {new_arch}")
    print(f"image size {new_size[0]}x{new_size[1]}")
    options = export_info(exported).get("options")
    if options:
        print("options " + ", ".join(f"{name} {value!r}" for name, value in options.items()))


if __name__ == "__main__":
    main()
