"""Train ViL: ``python tools/train.py --config-file F [KEY VALUE ...]``.

Config overrides follow the file, as in the original release. With ``torchrun --nproc_per_node N`` it trains
with DistributedDataParallel. Running the same command again resumes from ``OUTPUT_DIR/checkpoint_last.pth``.
"""

import sys

from vil.config import config_from_command_line
from vil.engine import train


def main():
    try:
        train(config_from_command_line(__doc__.split("\n\n")[0]))
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
