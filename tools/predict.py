"""Label images with a model: ``python tools/predict.py --model NAME|local-dir:DIR IMAGES...`` or ``python
tools/predict.py --config-file F MODEL.MODEL_PATH ckpt [KEY VALUE ...] IMAGES...`` (console script ``vil-predict``).

IMAGES are image files, folders (their images, recursively) and globs (quoted, ``"photos/**/*.jpg"``). ``--model``
takes a registered model with its published weights (``vil_small``, ``vil_small.in1k``) or a Hub folder that
``tools/export_hub.py`` wrote (``local-dir:DIR``), with the preprocessing its pretrained_cfg records;
``--config-file`` a run's config and checkpoint, with the config's evaluation preprocessing. Every image gets the
model's top-k classes (the names the checkpoint records, else the config's class names, else ImageNet's classes
for 1000 classes, else the class indices; ImageNet's class ids shown as their descriptions) and their
probabilities: one line each on stdout, and with ``--output`` a CSV or JSON file (one record per image). An
image that cannot be read is named in a warning and skipped.
"""

import argparse
import csv
import io
import json
import logging
import os
import re
import sys

import safetensors
import timm
import torch
from timm.data import create_transform, resolve_data_config
from timm.models import parse_model_name

from vil.checkpoint import SAFETENSORS_NAME, hub_record, recorded_classes
from vil.cli import non_negative_int, positive_int
from vil.config import EMPTY_CONFIG_FILE, did_you_mean, get_cfg, load_cfg
from vil.data import build_transform
from vil.files import atomic_write, check_writable_file, not_a_folder
from vil.hub import class_names, data_class_names, default_class_names
from vil.model_config import build_model
from vil.predict import RunAs, image_paths, predict, readable_names
from vil.training.setup import amp_context, memory_format
from vil.weights import check_trained_classes, load_read_weights, read_model_checkpoint

CONFIG_KEY = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Z0-9_]+)+$")  # MODEL.MODEL_PATH: a config override, not an image


def is_override(token):
    """Whether ``token`` is a config key (``MODEL.MODEL_PATH``, ``SEED``) rather than an image (``IMG_0001.JPG``):
    not an existing file, and a key of the config's top level or of a key's form beginning with a section of the
    config or a near miss of one (``INPT``: the config then names the key it meant)."""
    cfg = get_cfg()
    if os.path.exists(token):
        return False
    if token in cfg and not isinstance(cfg[token], dict):
        return True
    section = token.split(".")[0]
    near = section in cfg or did_you_mean(section, cfg)
    return bool(CONFIG_KEY.match(token)) and bool(near)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a registered model (vil_small, vil_small.in1k) or local-dir:DIR")
    source.add_argument("--config-file", help="a run's config (YAML file or preset name), with MODEL.MODEL_PATH")
    p.add_argument("--top-k", type=positive_int, default=5)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--workers", type=non_negative_int, default=0, help="image loading processes")
    p.add_argument("--output", help="also write the records to this .csv or .json file")
    p.add_argument("inputs", nargs="+", help="images, folders, globs; with --config-file also KEY VALUE overrides")
    args = p.parse_intermixed_args(argv)  # options after the images and overrides too
    args.overrides, args.images = [], []
    tokens = iter(args.inputs)
    for token in tokens:
        if is_override(token):
            args.overrides += [token, next(tokens, "")]
        else:
            args.images.append(token)
    if args.config_file == "":  # as from an unset $CFG: not the defaults
        p.error(EMPTY_CONFIG_FILE)
    if not args.images:
        p.error("give the images to label: image files, folders or globs.")
    if args.overrides and args.model:
        p.error(f"config overrides ({args.overrides[0]} ...) go with --config-file, not with --model.")
    if args.output and not args.output.endswith((".csv", ".json")):
        p.error(f"--output {args.output} must end in .csv or .json.")
    return args


def check_model_name(name):
    """Refuse, in one sentence, a ``--model`` that is neither a registered model (with or without a pretrained tag)
    nor a source-prefixed one (``local-dir:DIR``, ``hf-hub:REPO``)."""
    source, model_name = parse_model_name(name)
    if source is None and not timm.is_model(model_name):
        raise ValueError(
            f"--model {name} is not a registered model: give one of {', '.join(timm.list_models('vil_*'))} "
            "(with a pretrained tag such as vil_small.in1k to load published weights; timm.list_pretrained('vil*') "
            "lists them) or a Hub folder that tools/export_hub.py wrote, as local-dir:DIR."
        )


def check_hub_folder(folder):
    """Refuse, in one sentence, a ``local-dir:`` folder that is not a readable Hub folder: no folder, no config.json,
    or a config.json or model.safetensors header that cannot be read (timm would stop with its own error)."""
    if what := not_a_folder(folder):
        raise ValueError(
            f"--model local-dir:{folder}: {folder} {what}; give a Hub folder, as tools/export_hub.py writes."
        )
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(
            f"--model local-dir:{folder}: {folder} has no config.json, so it is not a Hub folder; give one that "
            "tools/export_hub.py wrote."
        )
    hub_record(folder)  # this project's config.json read, or refused in one sentence
    weights = os.path.join(folder, SAFETENSORS_NAME)
    if os.path.isfile(weights):
        try:
            with safetensors.safe_open(weights, framework="pt"):
                pass
        except Exception as e:  # safetensors' own error types
            raise ValueError(
                f"{weights} is not a readable safetensors file ({e}); export the folder again with tools/export_hub.py."
            ) from None


def model_and_preprocessing(args):
    """(model, its evaluation transform, its class names, how it runs: a :class:`~vil.predict.RunAs` of the config's
    AMP keys, as evaluation takes them, or float32 for ``--model``)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model:
        check_model_name(args.model)
        source, folder = parse_model_name(args.model)
        if source == "local-dir":
            check_hub_folder(folder)
        try:
            model = timm.create_model(args.model, pretrained=True)
        except (KeyError, TypeError, RuntimeError) as e:  # timm's, on a config.json it cannot build from
            if source != "local-dir":
                raise
            raise ValueError(
                f"--model {args.model}: timm cannot build the model that {folder}/config.json describes "
                f"({type(e).__name__}: {e}); export the folder again with tools/export_hub.py."
            ) from None
        transform = create_transform(**resolve_data_config({}, model=model))
        names = model.pretrained_cfg.get("label_names") or default_class_names(model.num_classes)
        run_as = RunAs()
    else:
        cfg = load_cfg(args.config_file, args.overrides)
        if not cfg.MODEL.MODEL_PATH:
            raise ValueError("Give the checkpoint to predict with: MODEL.MODEL_PATH path/to/checkpoint.pth.")
        model = build_model(cfg)
        # The class names the checkpoint records; those of the config's data are checked against them, as
        # evaluation checks them (the same classes in another order are refused).
        path, checkpoint = read_model_checkpoint(cfg)
        if recorded_classes(checkpoint) is not None and (data_names := data_class_names(cfg)) is not None:
            check_trained_classes(checkpoint, path, data_names)
        load_read_weights(model, cfg, path, checkpoint, cfg.MODEL.LOAD_EMA)
        transform, names = build_transform(cfg, train=False), class_names(cfg, checkpoint)
        run_as = RunAs(amp_context(cfg, device)[0], memory_format(cfg))
    return model.to(device, memory_format=run_as.layout), transform, readable_names(names), run_as


def table(records, top_k):
    """The records as CSV: path, then the name and probability of each of the top k classes."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["path"] + [f"{what}_{i + 1}" for i in range(top_k) for what in ("class", "probability")])
    for record in records:
        cells = [x for pair in zip(record["classes"], record["probabilities"]) for x in pair]
        writer.writerow([record["path"]] + [f"{x:.6f}" if isinstance(x, float) else x for x in cells])
    return out.getvalue()


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        paths = image_paths(args.images)
        if args.output:  # before the work: a path that cannot be written is refused now
            check_writable_file(args.output, "--output")
        model, transform, names, run_as = model_and_preprocessing(args)
        records = predict(model, transform, paths, names, args.top_k, args.batch_size, args.workers, run_as)
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    if not records:
        sys.exit(f"error: none of the {len(paths)} images could be read (the warnings above say why); nothing written.")
    for record in records:
        shown = ", ".join(f"{n} ({p:.3f})" for n, p in zip(record["classes"], record["probabilities"]))
        print(f"{record['path']}\t{shown}")
    if args.output:
        top_k = min(args.top_k, len(names))  # as many as the records have
        text = table(records, top_k) if args.output.endswith(".csv") else json.dumps(records, indent=2) + "\n"
        try:
            # A file name that is not UTF-8 is written as the bytes it has (Python reads them as surrogates).
            atomic_write(args.output, lambda f: f.write(text.encode(errors="surrogateescape")))
        except OSError as e:
            sys.exit(f"error: {e}")
    print(f"{len(records)} of {len(paths)} images labelled.", file=sys.stderr)


if __name__ == "__main__":
    main()
