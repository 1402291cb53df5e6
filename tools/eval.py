"""Evaluate a checkpoint: ``python tools/eval.py --config-file F MODEL.MODEL_PATH ckpt [KEY VALUE ...]``.

Top-1/top-5 on the evaluation data of the config (the val folder, or the held-out digits), for this
project's checkpoints and the original release's (``MODEL.LOAD_EMA True``: the checkpoint's EMA weights). The
last line on stdout reads ``top-1 NN.NN top-5 NN.NN``; the numbers also go to ``OUTPUT_DIR/eval.json``, with every
class's with ``OUTPUT_PERCLASS_ACC True``. Works under ``torchrun`` too.
"""

import sys

from vil.config import config_from_command_line
from vil.training.evaluation import evaluate_checkpoint, write_eval_report


def main():
    try:
        cfg = config_from_command_line(__doc__.split("\n\n")[0])
        report = evaluate_checkpoint(cfg)
        if report:  # the main process
            print(f"top-1 {report['top1']:.2f} top-5 {report['top5']:.2f}", flush=True)
            write_eval_report(cfg, report)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
