"""Turn a classification checkpoint into a detection backbone checkpoint.

    python tools/export_backbone.py IN OUT --format {torchvision,detectron2,mmdet} [options]

IN is this project's checkpoint (its architecture and image size are read from the config stored in it; an
``--arch`` or ``--config-file`` of another architecture is refused) or the original release's (give ``--arch`` or
``--config-file``). Its weights are checked against that architecture as loading them into the model would be:
those of another model are refused, naming the keys and shapes that do not fit. The classifier and the final norm
are dropped; the backbone's keys are written as a whole detector of the framework names them: ``backbone.body.``
under ``"model"`` (torchvision), ``backbone.bottom_up.`` under ``"model"`` (detectron2, as the original detection
release), ``backbone.`` under ``"state_dict"`` (mmdetection). The arch string and image size of the exported
backbone are stored beside them and printed. OUT is written atomically.
"""

import argparse
import sys

import torch

from vil.checkpoint import model_state, read_checkpoint
from vil.config import load_cfg
from vil.detection import EXPORT_FORMATS, checkpoint_image_size, export_state, stored_config
from vil.files import atomic_write, check_writable_file
from vil.models import PRESETS, MsViT, arch_string, parse_arch
from vil.models.convert import GLOBAL_INITS, convert_classification_state, fit_to_model


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
        help="the YAML config IN was trained with (its arch and image size; the config stored in IN goes first)",
    )
    parser.add_argument(
        "--image-size", type=int, nargs="+", help="image size IN was trained for, N or H W (default: from IN)"
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
        "--new-image-size", type=int, nargs="+", help="resize the position tables for images of N or H W"
    )
    return parser.parse_args(argv)


def _size(values, flag):
    if values is None:
        return None
    if len(values) not in (1, 2) or min(values) < 1:
        raise ValueError(f"{flag} takes one or two positive integers (N, or H W), not {' '.join(map(str, values))}.")
    return (values[0], values[-1])


def source_model(args, checkpoint):
    """The arch string and image size (H, W) of the classification model in IN. Where IN stores its config, that
    says both, and an arch given by --arch or --config-file must be the stored one."""
    given = size = None
    if args.config_file:
        cfg = load_cfg(args.config_file)
        given, size = cfg.MODEL.VIT.MSVIT.ARCH, (cfg.INPUT.IMAGE_SIZE,) * 2
    if args.arch:
        given = PRESETS.get(args.arch, args.arch)
    stored = stored_config(checkpoint, args.input)
    if stored:
        arch, size = stored.MODEL.VIT.MSVIT.ARCH, (stored.INPUT.IMAGE_SIZE,) * 2
    elif given is None:
        raise ValueError(
            f"{args.input} does not say which architecture it holds; "
            "give --arch (a preset or arch string) or --config-file."
        )
    else:
        arch = given
    arch = arch_string(parse_arch(arch))
    if given is not None and arch_string(parse_arch(given)) != arch:
        flag, value = ("--arch", args.arch) if args.arch else ("--config-file", args.config_file)
        raise ValueError(
            f"{args.input} holds a model of arch {arch} (its stored config says so), not "
            f"{arch_string(parse_arch(given))} ({flag} {value}); leave {flag} out to export it as it is."
        )
    size = (
        _size(args.image_size, "--image-size")
        or size
        or checkpoint_image_size(checkpoint, arch, args.input)
        or (224, 224)
    )
    return arch, size


def source_state(checkpoint, path, arch, size):
    """The model weights in IN, checked against the classification model of ``arch`` at ``size`` as loading them
    into it is (keys and shapes; position tables made for another size resized), so that weights of another model
    are refused rather than exported under ``arch``."""
    model = MsViT(arch, img_size=size, num_classes=0, dynamic_img_pad=True)
    return fit_to_model(model_state(checkpoint, path), model, path)


def main(argv=None):
    args = parse_args(argv)
    try:
        check_writable_file(args.output)
        checkpoint = read_checkpoint(args.input)
        arch, size = source_model(args, checkpoint)
        state, specs, new_size = convert_classification_state(
            source_state(checkpoint, args.input, arch, size),
            arch,
            size,
            full_attention_to_local=args.full_attention_to_local,
            num_global=args.num_global,
            global_init=args.global_init,
            new_image_size=_size(args.new_image_size, "--new-image-size"),
        )
        new_arch = arch_string(specs)
        exported = export_state(state, args.format, new_arch, new_size)
        atomic_write(args.output, lambda f: torch.save(exported, f))
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"{args.output}: {len(state)} backbone tensors in the {args.format} layout")
    print(f"arch {new_arch}")
    print(f"image size {new_size[0]}x{new_size[1]}")


if __name__ == "__main__":
    main()
