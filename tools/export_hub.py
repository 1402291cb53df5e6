"""Write a checkpoint as a Hugging Face Hub folder: ``python tools/export_hub.py --config-file F --out DIR
MODEL.MODEL_PATH ckpt [KEY VALUE ...]`` (console script ``vil-export-hub``; the options and the overrides in any
order).

DIR gets ``model.safetensors`` (the weights alone: the checkpoint's model weights, or with ``MODEL.LOAD_EMA True``
its EMA weights, as evaluation reads them), ``config.json`` in timm's layout (architecture ``vil_arch`` with the
config's arch string and model arguments, the class count and names, and the ``pretrained_cfg`` with mean, std,
input size, crop and interpolation from INPUT) and a ``README.md`` model card. ``timm.create_model("local-dir:DIR")``
(after ``import vil``) rebuilds the model; ``MODEL.MODEL_PATH DIR`` and every tool that takes a checkpoint read it.
Upload it with ``huggingface-cli upload``.
"""

import argparse
import sys

from vil.config import load_cfg
from vil.hub import export_hub_folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True, help="the run's config: a YAML file or a preset's name")
    parser.add_argument(
        "--out",
        required=True,
        help="the folder to write (created if needed; its own README.md, config.json or model.safetensors are refused, "
        "a previous export's rewritten)",
    )
    parser.add_argument("opts", nargs="*", metavar="KEY VALUE", help="config overrides, MODEL.MODEL_PATH among them")
    args = parser.parse_intermixed_args(argv)  # --out after the overrides too
    try:
        cfg = load_cfg(args.config_file, args.opts)
        if not cfg.MODEL.MODEL_PATH:
            raise ValueError("Give the checkpoint to export: MODEL.MODEL_PATH path/to/checkpoint.pth.")
        card = export_hub_folder(cfg, args.out)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(
        f"{args.out}: {card['arch']}, {card['parameters'] / 1e6:.2f}M parameters, {card['classes']} classes, "
        f"{card['weights']} weights; load it with timm.create_model('local-dir:{args.out}', pretrained=True)."
    )


if __name__ == "__main__":
    main()
