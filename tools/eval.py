"""Evaluate a checkpoint: ``python tools/eval.py --config-file F MODEL.MODEL_PATH ckpt [KEY VALUE ...]``.

Top-1/top-5 on the evaluation data of the config (the val folder, or the held-out digits), for this
project's checkpoints and the original release's (``MODEL.LOAD_EMA True``: the checkpoint's EMA weights). The
last line reads ``top-1 NN.NN top-5 NN.NN``; the numbers also go to ``OUTPUT_DIR/eval.json``, with every
class's with ``OUTPUT_PERCLASS_ACC True``. Works under ``torchrun`` too.
"""

import sys

from vil.config import config_from_command_line
from vil.engine import evaluate_checkpoint


def main():
    try:
        top1, top5 = evaluate_checkpoint(config_from_command_line(__doc__.split("\n\n")[0]))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"top-1 {top1:.2f} top-5 {top5:.2f}")


if __name__ == "__main__":
    main()
