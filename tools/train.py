"""Train ViL: ``python tools/train.py --config-file F [KEY VALUE ...]``.

Config overrides follow the file, as in the original release. With ``torchrun --nproc_per_node N`` it trains
with DistributedDataParallel. Running the same command again resumes from ``OUTPUT_DIR/checkpoint_last.pth``.
``MODEL.MODEL_PATH`` gives the weights a new run starts from (fine-tuning); with ``EVALUATE True`` the tool
evaluates that checkpoint instead, as ``tools/eval.py`` does, and exits.
"""

import sys

from vil.config import config_from_command_line
from vil.training.evaluation import evaluate_checkpoint, write_eval_report
from vil.training.loop import train


def main():
    try:
        cfg = config_from_command_line(__doc__.split("\n\n")[0])
        if cfg.EVALUATE:
            report = evaluate_checkpoint(cfg)
            if report:
                print(f"top-1 {report['top1']:.2f} top-5 {report['top5']:.2f}", flush=True)
                write_eval_report(cfg, report)
        else:
            train(cfg)
    except (ValueError, OSError, FloatingPointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
