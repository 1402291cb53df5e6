"""Train ViL: ``python tools/train.py --config-file F [KEY VALUE ...]``.

Config overrides follow the file, as in the original release. With ``torchrun --nproc_per_node N`` it trains
with DistributedDataParallel. Running the same command again resumes from ``OUTPUT_DIR/checkpoint_last.pth``.
"""

import argparse
import sys

from vil.config import load_cfg
from vil.engine import train


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True, help="a YAML file, e.g. configs/vil_digits.yaml")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides: KEY VALUE ...")
    args = parser.parse_args()
    try:
        train(load_cfg(args.config_file, args.opts))
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
