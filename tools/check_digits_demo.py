"""Check the digits demo's promise: at least 95% top-1 on the held-out digits within 10 minutes.

    python tools/check_digits_demo.py [--seeds 0 1 2]

For each seed it runs ``tools/train.py --config-file configs/vil_digits.yaml`` from scratch in a fresh output
folder, times it, evaluates the final checkpoint with ``tools/eval.py``, and prints one row per seed; it
exits non-zero when any seed misses the bar.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "vil_digits.yaml")
TARGET_TOP1, TARGET_SECONDS = 95.0, 600.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print("| seed | training time (s) | held-out top-1 | top-5 | passes |\n|---|---|---|---|---|", flush=True)
    failed = False
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train.py"), "--config-file", CONFIG,
                            "SEED", str(seed), "OUTPUT_DIR", out], check=True, cwd=ROOT, stderr=subprocess.DEVNULL)
            seconds = time.perf_counter() - start
            done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "eval.py"), "--config-file", CONFIG,
                                   "MODEL.MODEL_PATH", os.path.join(out, "checkpoint_last.pth"), "OUTPUT_DIR", out],
                                  check=True, cwd=ROOT, capture_output=True, text=True)
        _, top1, _, top5 = done.stdout.strip().splitlines()[-1].split()
        passes = float(top1) >= TARGET_TOP1 and seconds <= TARGET_SECONDS
        failed |= not passes
        print(f"| {seed} | {seconds:.0f} | {top1} | {top5} | {'yes' if passes else 'no'} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
