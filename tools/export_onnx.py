"""Export a classification model to ONNX and check it: ``python tools/export_onnx.py --config-file F --output
model.onnx [--static] [MODEL.MODEL_PATH ckpt] [KEY VALUE ...]``.

The file takes any batch and any image size that is a multiple of the model's total stride (32 for the
presets) from twice the stride (64); it is traced at ``INPUT.IMAGE_SIZE`` (rounded down to a multiple of the
stride), which must be at least that, and large enough that every chunked local stage has at least two chunks per
side (the tool says which size otherwise). With ``--static`` the file takes only images of ``INPUT.IMAGE_SIZE``
(any batch), which SW_EXACT -1 needs. Its input is ``images`` (B, 3, H, W), its output ``logits``. Without
``MODEL.MODEL_PATH`` the model keeps its initial weights. The output is checked to be writable before the export
starts. Before the file is written, onnxruntime runs it at the traced size and at a second size (another
batch for a file of one input size), and the tool prints the largest difference from the PyTorch model's logits,
computed with the local attention backend this machine runs fastest (any backend computes the same function; the
file holds none). Only a file that passes (1e-4) is written (atomically); where onnxruntime fails or the difference
is larger the tool exits with an error and writes nothing. Needs the ``onnx`` extra (``pip install 'vil[onnx]'``).
"""

import argparse
import sys

import torch

from vil.config import load_cfg
from vil.export import onnx_model, onnx_outputs
from vil.files import atomic_write, check_writable_file
from vil.model_config import build_model, model_kwargs
from vil.models import MsViT
from vil.weights import load_weights, resolve_model_path

TOLERANCE = 1e-4


def check(onnx_file, output, model, cfg, size, one_size):
    """Run ``onnx_file`` (the bytes to become ``output``) with onnxruntime at ``size`` and at a second size (another
    batch for a file of ``one_size``), print the largest difference from ``model``'s logits at each, and exit with
    an error where onnxruntime fails or a difference is above ``TOLERANCE`` or not a number."""
    here = MsViT(**{**model_kwargs(cfg), "attn_backend": None}).eval()
    here.load_state_dict(model.state_dict())
    stride = model.total_stride
    checks = [(2, size, size), (3, size, size) if one_size else (2, size + stride, size + 2 * stride)]
    for batch, height, width in checks:
        images = torch.randn(batch, model.in_chans, height, width)
        try:
            logits = onnx_outputs(onnx_file, images)
        except (ValueError, OSError):
            raise
        except Exception as e:  # onnxruntime's own error types
            sys.exit(
                f"error: onnxruntime cannot run the exported file at {height}x{width} ({str(e).splitlines()[0]}); "
                f"{output} was not written."
            )
        with torch.no_grad():
            difference = (logits - here(images)).abs().max().item()
        print(f"{height}x{width}: largest difference from PyTorch {difference:.2e}", flush=True)
        if not difference <= TOLERANCE:  # NaN too
            sys.exit(
                f"error: at {height}x{width} the ONNX file's logits differ from the model's by {difference:.2e}, "
                f"more than {TOLERANCE}; {output} was not written."
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config-file", required=True, help="a YAML file, or a preset's name (vil_tiny, vil_small, ...)"
    )
    parser.add_argument("--output", required=True, help="the ONNX file to write")
    parser.add_argument(
        "--static",
        action="store_true",
        help="export for images of INPUT.IMAGE_SIZE only (any batch), not any multiple of the total stride: "
        "needed for SW_EXACT -1, whose windows wrap around a map of one size",
    )
    parser.add_argument("opts", nargs="*", metavar="KEY VALUE", help="config overrides")
    args = parser.parse_intermixed_args(argv)  # options after the overrides too
    try:
        cfg = load_cfg(args.config_file, args.opts)
        check_writable_file(args.output, source=resolve_model_path(cfg) if cfg.MODEL.MODEL_PATH else None)
        model = build_model(cfg).eval()
        if cfg.MODEL.MODEL_PATH:
            load_weights(model, cfg)
        else:
            print("No MODEL.MODEL_PATH: the file holds the model's initial, untrained weights.", flush=True)
        stride, size = model.total_stride, cfg.INPUT.IMAGE_SIZE
        if not args.static and not model.fixed_input_size:  # a linformer model takes its one size only
            size -= size % stride
            if size < 2 * stride:
                raise ValueError(
                    f"INPUT.IMAGE_SIZE {cfg.INPUT.IMAGE_SIZE} is too small to export: it is traced at {size} (rounded "
                    f"down to a multiple of the total stride {stride}), and tracing needs at least {2 * stride}; set "
                    f"INPUT.IMAGE_SIZE to {2 * stride} or more."
                )
        onnx_file = onnx_model(model, size, size, dynamic_size=not args.static)
        check(onnx_file, args.output, model, cfg, size, one_size=model.fixed_input_size or args.static)
        atomic_write(args.output, lambda f: f.write(onnx_file))  # only a file that passed its check
        print(f"wrote {args.output}", flush=True)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    except Exception as e:  # torch.onnx wraps what the model raised while it was traced
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if cause is e or not isinstance(cause, ValueError):
            raise
        sys.exit(f"error: {cause}")


if __name__ == "__main__":
    main()
