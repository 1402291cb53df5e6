"""Check the digits demo's promises, both steps, over several seeds:

1. ``configs/vil_digits.yaml`` trains from scratch to at least 95% held-out top-1 within 10 minutes;
2. ``configs/vil_digits_finetune.yaml`` fine-tunes step 1's ``model_best.pth`` for the digits 0-4 at 24x24
   to at least 98% held-out top-1 within 2 minutes.

A step passes with at least one held-out image of margin over its bar (343 of 359 digits for step 1, 178 of 180
for step 2), so that a machine whose arithmetic differs a little still keeps the promise.

    python tools/check_digits_demo.py [--seeds 0 1 2]

For each seed and step it runs ``python -m vil train`` (``tools/train.py``) with the step's preset in a fresh output
folder, times it, evaluates the final checkpoint with ``python -m vil eval``, and prints one row; it exits non-zero
when any row misses its bar. From an install: ``python -m vil_tools.check_digits_demo``.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

# (preset, top-1 bar, seconds bar); the tools run as `python -m vil`, from a checkout and from an install alike
STEPS = {
    "train": ("vil_digits", 95.0, 600.0),
    "fine-tune": ("vil_digits_finetune", 98.0, 120.0),
}


def run_step(config, out, overrides):
    """Train, then evaluate the last checkpoint; returns (seconds, top-1, top-5, held-out images)."""
    start = time.perf_counter()
    run_tool("train", "--config-file", config, "OUTPUT_DIR", out, *overrides)
    seconds = time.perf_counter() - start
    checkpoint = os.path.join(out, "checkpoint_last.pth")
    done = run_tool("eval", "--config-file", config, "MODEL.MODEL_PATH", checkpoint, "OUTPUT_DIR", out)
    _, top1, _, top5 = done.stdout.strip().splitlines()[-1].split()
    with open(os.path.join(out, "eval.json")) as f:
        images = json.load(f)["images"]
    return seconds, float(top1), float(top5), images


def run_tool(command, *args):
    """``python -m vil COMMAND args``, its output captured; a failure ends the check with the tool's last line of
    errors."""
    done = subprocess.run([sys.executable, "-m", "vil", command, *args], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
        last = lines[-1] if lines else "no message"
        raise SystemExit(f"python -m vil {command} failed (exit status {done.returncode}): {last}")
    return done


def passes_with_margin(top1, images, bar):
    """At least one image more right than the bar asks: bar 98% of 180 images wants 177, this 178."""
    right = round(top1 * images / 100)
    return right >= math.ceil(bar * images / 100 - 1e-9) + 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print(
        "| seed | step | training time (s) | held-out top-1 | top-5 | passes |\n|---|---|---|---|---|---|", flush=True
    )
    failed = False
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as folder:
            trained = os.path.join(folder, "train")
            for step, (config, top1_bar, seconds_bar) in STEPS.items():
                overrides = ["SEED", str(seed)]
                if step == "fine-tune":
                    overrides += ["MODEL.MODEL_PATH", os.path.join(trained, "model_best.pth")]
                seconds, top1, top5, images = run_step(config, os.path.join(folder, step), overrides)
                passes = passes_with_margin(top1, images, top1_bar) and seconds <= seconds_bar
                failed |= not passes
                print(
                    f"| {seed} | {step} | {seconds:.0f} | {top1:.2f} | {top5:.2f} | {'yes' if passes else 'no'} |",
                    flush=True,
                )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
