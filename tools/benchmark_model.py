"""Training and inference speed, peak memory, parameters and FLOPs of a model, on the CPU or a GPU.

    python tools/benchmark_model.py --config-file configs/vil_small.yaml [--batch 8] [--device cuda] [KEY VALUE ...]
    python tools/benchmark_model.py --config-file configs/vil_tiny.yaml --batch 4 --compile \
        [--timm swin_tiny_patch4_window7_224]

FLOPs are counted by ``vil.profiling.flop_counter`` (torch's counter, CPU SDPA included) for one 224x224
(``INPUT.IMAGE_SIZE``) image, forward, as multiply-adds (the convention of the paper's 1.43G / 5.12G). Peak
memory: how far what torch's allocator holds for tensors rises during the first training step
(``vil.profiling.PeakMemory``; on the CPU counted from the allocations the profiler records, not the resident
set). A training step is the model's forward and backward and a step of the optimizer ``tools/train.py`` builds
from the config (``OPTIM``; torch's fused AdamW for the presets). Every step of every contender runs under the
autocast training uses (``AMP.ENABLED``, and on the CPU ``AMP.ON_CPU``; ``AMP.DTYPE`` bfloat16 by default).

``--compile`` and ``--timm NAME`` add a second table: training and inference images/s of the model, of the model
under ``torch.compile`` (Inductor, after its compilation, whose time is printed) and of timm's model ``NAME``, in
one process, in alternating rounds (``--rounds``), best round of each, with each one's ratio to the eager model.
``--profile`` then also prints, for each of them, where two training steps spend their time (``torch.profiler``,
the operators with the most time of their own).
"""

import argparse
import logging
import time

import timm
import torch
from timm.models import parse_model_name

from vil.cli import positive_int
from vil.config import load_cfg
from vil.cpu import cpu_description
from vil.model_config import build_model
from vil.ops import default_backend
from vil.optim import build_optimizer
from vil.profiling import PeakMemory, flop_counter, time_table
from vil.training.setup import amp_context, amp_dtype, amp_enabled


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps after one warm-up step")
    parser.add_argument("--compile", action="store_true", help="also time the model under torch.compile")
    parser.add_argument("--timm", default=None, help="also time this timm model (e.g. swin_tiny_patch4_window7_224)")
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="alternating rounds of the side-by-side comparison"
    )
    parser.add_argument(
        "--profile", action="store_true", help="with --compile or --timm: profile two training steps of each"
    )
    parser.add_argument("opts", nargs="*", metavar="KEY VALUE", help="config overrides")
    args = parser.parse_intermixed_args()  # options after the overrides too
    if args.timm and parse_model_name(args.timm)[0] is None and not timm.is_model(args.timm):
        parser.error(f"--timm {args.timm} is not a timm model; give one that timm.list_models() lists.")
    if args.profile and not (args.compile or args.timm):
        parser.error("--profile profiles the side-by-side comparison: give --compile or --timm with it.")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA device here.")
    try:
        cfg = load_cfg(args.config_file, args.opts)
        model = build_model(cfg).to(device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if cfg.MODEL.COMPILE:
        parser.error("MODEL.COMPILE is not read here (the first table is the eager model's); give --compile instead.")
    size = cfg.INPUT.IMAGE_SIZE
    params = sum(p.numel() for p in model.parameters())
    other = _timm_model(args.timm, model, device) if args.timm else None  # refused, if at all, before measuring
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the op layer names the backends it picks
    dtype = amp_dtype(cfg) if amp_enabled(cfg, device) else torch.float32
    print(
        f"Machine: {torch.cuda.get_device_name(device) if device.type == 'cuda' else cpu_description()}; "
        f"torch {torch.__version__}; local attention backend (backend=None): {default_backend(device, dtype)}",
        flush=True,
    )

    model.eval()
    with torch.no_grad(), flop_counter() as counter:
        model(torch.randn(1, 3, size, size, device=device))
    macs = counter.get_total_flops() / 2

    images = torch.randn(args.batch, 3, size, size, device=device)
    labels = torch.randint(0, cfg.DATA.NUM_CLASSES, (args.batch,), device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    amp, scaler = amp_context(cfg, device)

    def steps(net, module=None):
        """(training step, inference step) of ``net`` (``module`` under ``torch.compile``), with its own
        optimizer, the one ``tools/train.py`` builds from the config, under the config's AMP."""
        optimizer = build_optimizer(cfg, module or net)

        def train_step():
            net.train()
            with amp():
                loss = torch.nn.functional.cross_entropy(net(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        def infer_step():
            net.eval()
            with torch.no_grad(), amp():
                net(images)

        return train_step, infer_step

    def timed(step):
        step()  # warm-up
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        return args.batch * args.steps / (time.perf_counter() - start)

    train_step, infer_step = steps(model)
    with PeakMemory(device) as peak:
        train_step()
    train_speed, infer_speed = timed(train_step), timed(infer_step)
    precision = f"autocast {cfg.AMP.DTYPE}" if amp_enabled(cfg, device) else "float32"
    print(
        "| model | ATTN_TYPE | device | precision | batch | params | GMACs | train img/s | infer img/s "
        "| train peak memory (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.config_file} | {cfg.MODEL.VIT.MSVIT.ATTN_TYPE} | {args.device} | {precision} | {args.batch} "
        f"| {params / 1e6:.2f}M | {macs / 1e9:.2f} | {train_speed:.1f} | {infer_speed:.1f} | {peak.mib:.0f} |"
    )
    if args.compile or args.timm:
        compare(args, model, other, steps, timed, device)


def _timm_model(name, model, device):
    """timm's ``name`` for ``model``'s images and classes: built for their size where it takes ``img_size``, and
    refused in one sentence where it does not take them."""
    size = model.img_size
    try:
        try:
            other = timm.create_model(name, num_classes=model.num_classes, img_size=size)
        except TypeError:  # a model of any image size, without the argument
            other = timm.create_model(name, num_classes=model.num_classes)
    except Exception as e:  # a Hub model not reachable or not cached, a file that is not a model's, ...
        why = next(iter(str(e).splitlines()), "")
        raise SystemExit(
            f"error: --timm {name} could not be built ({type(e).__name__}: {why}); give a model timm can create here."
        ) from None
    other = other.to(device).eval()
    try:
        with torch.no_grad():
            other(torch.randn(1, model.in_chans, *size, device=device))
    except (AssertionError, RuntimeError, ValueError) as e:
        raise SystemExit(
            f"error: --timm {name} does not take {size[0]}x{size[1]} images (INPUT.IMAGE_SIZE): "
            f"{str(e).splitlines()[0]}; give an INPUT.IMAGE_SIZE it takes."
        ) from None
    return other.train()


def compare(args, model, other, steps, timed, device):
    """The side-by-side table of the module docstring; ``other``: the ``--timm`` model, or None."""
    contenders = {"eager": steps(model)}
    if args.compile:
        compiled = steps(torch.compile(model), model)
        start = time.perf_counter()
        for step in compiled:  # compiles the training and the inference graph
            step()
        print(f"\ntorch.compile: {time.perf_counter() - start:.0f} s to compile training and inference")
        contenders["torch.compile"] = compiled
    if other is not None:
        contenders[f"timm {args.timm}"] = steps(other)
    best = {name: [0.0, 0.0] for name in contenders}
    for _ in range(args.rounds):
        for name, pair in contenders.items():
            for i, step in enumerate(pair):
                best[name][i] = max(best[name][i], timed(step))
    print(
        f"\n| {args.batch} images, best of {args.rounds} alternating rounds | train img/s | infer img/s "
        "| train vs eager | infer vs eager |"
    )
    print("|---|---|---|---|---|")
    for name, (train, infer) in best.items():
        print(
            f"| {name} | {train:.1f} | {infer:.1f} | {train / best['eager'][0]:.2f}x "
            f"| {infer / best['eager'][1]:.2f}x |"
        )
    if args.profile:
        for name, (train_step, _) in contenders.items():
            print(f"\n{name}, two training steps:")
            print(time_table(train_step, device, calls=2))


if __name__ == "__main__":
    main()
