"""``python -m vil <command> [arguments]``: the command-line tools, as the console scripts ``vil-train``,
``vil-eval``, ``vil-predict``, ``vil-export``, ``vil-export-onnx``, ``vil-export-hub``, ``vil-benchmark`` and
``vil-make-shards`` run them, and ``timm-train`` (timm's own ``train.py`` with the ViL models registered), which has
no console script."""

import importlib
import sys

# command -> module of vil_tools (the tools/ folder)
COMMANDS = {
    "train": "train",
    "eval": "eval",
    "predict": "predict",
    "export": "export_backbone",
    "export-onnx": "export_onnx",
    "export-hub": "export_hub",
    "benchmark": "benchmark_model",
    "make-shards": "make_shards",
    "timm-train": "timm_train",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        commands = "\n".join(f"  {name:12} tools/{module}.py" for name, module in COMMANDS.items())
        print(f"usage: python -m vil <command> [arguments]; <command> --help says more\n\ncommands:\n{commands}")
        return
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command given"
        sys.exit(
            f"error: {given}; use python -m vil {{{','.join(COMMANDS)}}} [arguments], e.g. "
            "python -m vil train --config-file vil_tiny DATA.PATH /data/imagenet."
        )
    tool = importlib.import_module(f"vil_tools.{COMMANDS[argv[0]]}")
    sys.argv = [f"vil {argv[0]}", *argv[1:]]
    tool.main()


if __name__ == "__main__":
    main()
