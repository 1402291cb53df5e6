"""Efficiency of the attention mechanisms that the original release compares in ViL-Small-sized models: forward
time, training-step time, training peak memory and forward GMACs against the image size, next to the ImageNet
top-1 the release reports for each model.

    python tools/benchmark_mechanisms.py                                  # CPU, images 224, 448, 672, 896
    python tools/benchmark_mechanisms.py --markdown docs/study_mechanisms.md --plot docs/study_mechanisms
    python tools/benchmark_mechanisms.py --device cuda --batch 8 --sizes 224 448 672 896 1120
    python tools/benchmark_mechanisms.py --mechanisms full longformer linformer --placements partial --sizes 224 448

The models (``MODELS``): ViL-Small's stages with one mechanism in all four stages (``all``) or in stages 1-2 only,
full attention after (``partial``): ``longformer`` (ViL's own attention, window 7, one global token; the fastest
backend; partial is ViL-Small itself), ``linformer`` (256 projected keys), ``srformer`` (the release's srformer/32:
reduction ratios 8, 4, 2 in stages 1-3, stage 4 full; partial 8, 4), ``performer`` (256 random features),
``global`` (global-memory attention: local queries attend only to the stage's 64 global tokens) and ``full``
attention, which is the same model in both placements and is measured once. Every model is built for the image
size it is measured at (linformer's projections are as long as the token count).

Measured per image size, for ``--batch`` images of ``--device`` in fp32: the forward time in eval mode without
gradients; the training-step time (train mode, forward, cross-entropy, backward; no optimizer step); the peak
memory of a training step (``vil.profiling.PeakMemory``: what torch's allocator holds for tensors at most during
the step, over what it held before, parameters excluded, their gradients included); the forward GMACs of one
image (``vil.profiling.flop_counter``: torch's counter, multiply-adds, with the formulas of ``vil.ops`` for local
attention and of this project for the CPU kernel of ``scaled_dot_product_attention``) and the parameters.

Each image size runs in a fresh process, so that no size leaves memory or caches to the next. There every model
is built, its GMACs counted, and it takes one warm-up forward and training step and one training step under
``PeakMemory``; then ``--repeats`` rounds time a forward and a training step of each model in turn, so that a
swing in the machine's speed reaches all of them alike, and the times are each one's best. A model that fails at a
size (out of memory, or an image its attention does not take, as srformer's reduced map needs 2 positions) has
that reason in its row; if the whole process dies, each model of that size is tried again in a process of its
own. Points are measured from the smallest size up, and one whose training step is estimated to take more than
``--max-step-seconds`` is skipped with its estimate in the table: the model's step time at the largest size
measured, grown by the token ratio to the power its time grew with between the two largest sizes measured (2,
quadratic, before there are two; at least 1). Full attention's training step at 896x896 (50,176 tokens in
stage 1, CPU flash attention: memory linear, time quadratic in the tokens) is the point this guard is for.

The second table gives, per model, the exponent of the growth of each cost with the token count between the two
largest sizes where the model was measured, ``log(cost ratio) / log(token ratio)``: 1 is linear, 2 quadratic.
``--plot PREFIX`` draws ``PREFIX_time.png`` (training-step time), ``PREFIX_memory.png`` and ``PREFIX_flops.png``
against the image size, log-log, one line per model (solid: all stages, dashed: stages 1-2).
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from vil.cli import check_outputs, positive_int
from vil.files import atomic_write
from vil.models import COMPARISONS, PRESETS, MsViT, parse_arch, small_arch, stage_map_sizes
from vil.models.msvit import PRETRAINED
from vil.plots import agg_pyplot
from vil.profiling import PeakMemory, flop_counter

try:  # installed, or an editable checkout: the tools are the package vil_tools
    from vil_tools.benchmark_attention import machine
except ImportError:  # python tools/benchmark_mechanisms.py without the package installed
    from benchmark_attention import machine

MECHANISMS = ("full", "longformer", "linformer", "srformer", "performer", "global")
PLACEMENTS = ("all", "partial")
# "mechanism/placement" -> (arch string, MsViT arguments); full attention is the same model in both placements.
MODELS = {
    "full/all": COMPARISONS["vil_small_full"],
    "longformer/all": (small_arch(4), dict(attention="longformer")),
    "longformer/partial": (PRESETS["vil_small"], dict(attention="longformer")),
    "linformer/all": COMPARISONS["vil_small_linformer"],
    "linformer/partial": COMPARISONS["vil_small_linformer_partial"],
    "srformer/all": COMPARISONS["vil_small_srformer32"],
    "srformer/partial": COMPARISONS["vil_small_srformer32_partial"],
    "performer/all": COMPARISONS["vil_small_performer"],
    "performer/partial": COMPARISONS["vil_small_performer_partial"],
    "global/all": COMPARISONS["vil_small_global"],
    "global/partial": COMPARISONS["vil_small_global_partial"],
}
# ImageNet-1k top-1 (%) the original release reports for these models at 224x224: those of its published
# checkpoints (PRETRAINED), and of the global-memory models, which it did not publish; None: not reported.
RELEASE_TOP1 = {
    name: PRETRAINED[f"{tag}.in1k"][1]
    for name, tag in {
        "full/all": "vil_small_full",
        "longformer/partial": "vil_small",
        "linformer/all": "vil_small_linformer",
        "linformer/partial": "vil_small_linformer_partial",
        "srformer/all": "vil_small_srformer32",
        "srformer/partial": "vil_small_srformer32_partial",
        "performer/all": "vil_small_performer",
        "performer/partial": "vil_small_performer_partial",
    }.items()
} | {"longformer/all": None, "global/all": 79.0, "global/partial": 81.4}
RELEASE_NOTE = (
    "The release also reports srformer/64 (ratios 16, 8, 4, 2 in all four stages): "
    f"{PRETRAINED['vil_small_srformer64.in1k'][1]}."
)
NUM_CLASSES = 1000
# A measured point: (forward s, training step s, training peak MiB, forward GMACs of one image, parameters in M).
FORWARD, TRAIN, MEMORY, GMACS, PARAMS = range(5)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--sizes",
        type=positive_int,
        nargs="+",
        default=[224, 448, 672, 896],
        help="image sides (default 224 448 672 896)",
    )
    p.add_argument(
        "--mechanisms",
        nargs="+",
        default=list(MECHANISMS),
        choices=MECHANISMS,
        metavar="MECHANISM",
        help=f"some of {', '.join(MECHANISMS)} (default: all)",
    )
    p.add_argument(
        "--placements",
        nargs="+",
        default=list(PLACEMENTS),
        choices=PLACEMENTS,
        help="all: the mechanism in all four stages; partial: in stages 1-2, full attention after",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="images a step (default 1; GMACs are for one image)")
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed rounds (default 3); each time is the best round"
    )
    p.add_argument(
        "--max-step-seconds",
        type=float,
        default=20.0,
        help="skip a point whose training step is estimated to take longer (default 20; 0: no limit)",
    )
    p.add_argument("--markdown", help="also write the tables to this file")
    p.add_argument("--plot", metavar="PREFIX", help="also draw PREFIX_time.png, PREFIX_memory.png and PREFIX_flops.png")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure some models at one size, print JSON
    args = p.parse_args(argv)
    if not args.max_step_seconds >= 0:  # NaN too
        p.error(f"--max-step-seconds must be 0 (no limit) or more, got {args.max_step_seconds:g}.")
    check_outputs(p, [args.markdown], args.plot, [name for name, _, _ in PLOTS])
    args.sizes = sorted(set(args.sizes))
    return args


def model_names(mechanisms, placements):
    """The ``MODELS`` keys of these mechanisms and placements; full attention's one model stands for both."""
    return [
        name
        for name in MODELS
        if name.split("/")[0] in mechanisms and (name.split("/")[1] in placements or name.startswith("full/"))
    ]


def stage1_tokens(name, size):
    """The local tokens of stage 1 of model ``name`` for ``size x size`` images."""
    rows, cols = stage_map_sizes(parse_arch(MODELS[name][0]), (size, size))[0]
    return rows * cols


def forward_gmacs(model, image):
    """Multiply-adds (in G) of one eval forward of ``image`` (one image)."""
    with torch.no_grad(), flop_counter() as counter:
        model(image)
    return counter.get_total_flops() / 2 / 1e9


def reason(error):
    """A table cell for an exception: the model refusing the input (ValueError) or failing."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0].split("; ")[0]
    return f"{'refused' if isinstance(error, ValueError) else 'failed'}: {first[:160]}"


def prepare(name, size, args):
    """Model ``name`` built for ``size``: (forward, training step, parameters in M, forward GMACs)."""
    device = torch.device(args.device)
    arch, kwargs = MODELS[name]
    model = MsViT(arch, img_size=size, num_classes=NUM_CLASSES, **kwargs).to(device)
    images = torch.randn(args.batch, 3, size, size, device=device)
    labels = torch.randint(0, NUM_CLASSES, (args.batch,), device=device)

    def synced(step):
        def run():
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run

    @synced
    def forward():
        model.eval()
        with torch.no_grad():
            model(images)

    @synced
    def train_step():
        model.train()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        model.zero_grad(set_to_none=True)  # between steps a model holds only its parameters

    model.eval()
    gmacs = forward_gmacs(model, images[:1])
    return forward, train_step, sum(p.numel() for p in model.parameters()) / 1e6, gmacs


def measure(names, size, args):
    """``{name: [forward s, step s, MiB, GMACs, M parameters]}`` or the reason a model was not measured, here."""
    ready, results = {}, {}
    for name in names:
        try:
            forward, train_step, params, gmacs = prepare(name, size, args)
            forward()
            train_step()
            with PeakMemory(args.device) as peak:
                train_step()
        except Exception as error:  # one model's failure is its row of the table, not the end of the study
            results[name] = reason(error)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        ready[name] = forward, train_step
        results[name] = [[], [], peak.mib, gmacs, params]
    for _ in range(args.repeats):
        for name, steps in ready.items():
            for column, step in zip((FORWARD, TRAIN), steps):
                start = time.perf_counter()
                step()
                results[name][column].append(time.perf_counter() - start)
    for name in ready:
        results[name][FORWARD], results[name][TRAIN] = min(results[name][FORWARD]), min(results[name][TRAIN])
    return results


def estimated_step(history, name, size):
    """The training-step seconds of model ``name`` at ``size`` extrapolated from ``history`` (``{size: results}``,
    smaller sizes), or None before it was measured once."""
    measured = [(s, r[name][TRAIN]) for s, r in sorted(history.items()) if s < size and isinstance(r.get(name), tuple)]
    if not measured:
        return None
    exponent = growth(name, *measured[-2:]) if len(measured) > 1 else math.nan
    exponent = 2.0 if math.isnan(exponent) else min(2.0, max(1.0, exponent))
    last, seconds = measured[-1]
    return seconds * (stage1_tokens(name, size) / stage1_tokens(name, last)) ** exponent


def growth(name, smaller, larger):
    """The exponent of a cost's growth with the token count from ``smaller`` to ``larger``, each (size, cost); nan
    where a cost is not positive or the two sizes give the same token count."""
    ratio = stage1_tokens(name, larger[0]) / stage1_tokens(name, smaller[0])
    if ratio == 1 or smaller[1] <= 0 or larger[1] <= 0:
        return math.nan
    return math.log(larger[1] / smaller[1]) / math.log(ratio)


def run_worker(names, size, args):
    """Measure ``names`` at ``size`` in a fresh process: ``{name: tuple or reason}``, or why the process died."""
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        json.dumps([names, size]),
        "--device",
        args.device,
        "--batch",
        str(args.batch),
        "--repeats",
        str(args.repeats),
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        if done.returncode < 0:
            why = f"worker killed by signal {signal.Signals(-done.returncode).name}"
            return why + (" (out of memory?)" if done.returncode == -signal.SIGKILL else "")
        return (done.stderr.strip().splitlines() or [f"worker exited with status {done.returncode}"])[-1][:140]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: a if isinstance(a, str) else tuple(a) for name, a in answers.items()}


def run_size(args, names, size, history):
    """Every model of ``names`` at ``size``: measured in one fresh process, skipped by the time estimate, or, if
    that process dies, each in a process of its own."""
    results = {}
    for name in names:
        estimate = estimated_step(history, name, size)
        if args.max_step_seconds and estimate is not None and estimate > args.max_step_seconds:
            results[name] = (
                f"skipped: training step estimated at {estimate:.0f} s > --max-step-seconds {args.max_step_seconds:g}"
            )
    measured = [name for name in names if name not in results]
    if measured:
        answers = run_worker(measured, size, args)
        if isinstance(answers, str) and len(measured) > 1:
            answers = {}
            for name in measured:
                alone = run_worker([name], size, args)
                answers[name] = alone[name] if isinstance(alone, dict) else f"failed: {alone}"
        elif isinstance(answers, str):
            answers = {measured[0]: f"failed: {answers}"}
        results.update(answers)
    return {name: results[name] for name in names}


def top1(name):
    value = RELEASE_TOP1.get(name)
    return "" if value is None else f"{value:.1f}"


def tables(study, names):
    """The markdown rows of the study (``{size: {name: tuple or reason}}``) and of the growth exponents."""
    rows = [
        "| image | tokens (stage 1) | mechanism | placement | params (M) | GMACs | forward (ms) | training step (ms) | "
        "training peak memory (MiB) | release top-1 (%) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, results in study.items():
        for name, r in results.items():
            mechanism, placement = name.split("/")
            head = f"| {size}x{size} | {stage1_tokens(name, size)} | {mechanism} | {placement} |"
            if isinstance(r, str):
                rows.append(f"{head} {r} | | | | | {top1(name)} |")
            else:
                rows.append(
                    f"{head} {r[PARAMS]:.2f} | {r[GMACS]:.4g} | {r[FORWARD] * 1e3:.1f} | {r[TRAIN] * 1e3:.1f} | "
                    f"{r[MEMORY]:.1f} | {top1(name)} |"
                )
    growth_rows = [
        "| mechanism | placement | release top-1 (%) | between | training time exponent | "
        "forward time exponent | memory exponent | GMACs exponent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        points = [(size, r[name]) for size, r in study.items() if isinstance(r.get(name), tuple)]
        cells = ["", "", "", "", ""]
        if len(points) > 1:
            (small, a), (large, b) = points[-2:]
            exponents = [growth(name, (small, a[i]), (large, b[i])) for i in (TRAIN, FORWARD, MEMORY, GMACS)]
            cells = [f"{small} and {large}"] + ["" if math.isnan(e) else f"{e:.2f}" for e in exponents]
        growth_rows.append(f"| {' | '.join(name.split('/'))} | {top1(name)} | {' | '.join(cells)} |")
    return rows, growth_rows


PLOTS = (
    ("time", TRAIN, "training step (s)"),
    ("memory", MEMORY, "training peak memory (MiB)"),
    ("flops", GMACS, "forward GMACs per image"),
)


def plot_study(study, prefix, title):
    """``study[size][name]`` -> PREFIX_time.png, PREFIX_memory.png and PREFIX_flops.png: one line per model
    (colour: mechanism; solid: all stages, dashed: stages 1-2) against the image side, log-log."""
    plt = agg_pyplot()
    import matplotlib.ticker

    names = list(dict.fromkeys(name for results in study.values() for name in results))
    colours = {mechanism: f"C{i}" for i, mechanism in enumerate(MECHANISMS)}
    sizes = sorted(study)
    for what, column, label in PLOTS:
        fig, ax = plt.subplots(figsize=(7.5, 5), layout="tight")
        for name in names:
            measured = [
                (size, study[size][name][column])
                for size in sizes
                if isinstance(study[size].get(name), tuple) and study[size][name][column] > 0
            ]
            if not measured:
                continue
            mechanism, placement = name.split("/")
            ax.plot(
                *zip(*measured),
                marker="o",
                color=colours[mechanism],
                label=name,
                linestyle="--" if placement == "partial" else "-",
            )
        ax.set(xscale="log", yscale="log", xlabel="image side (pixels)", ylabel=label)
        ax.set_xticks(sizes, [str(size) for size in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(title, fontsize=7, wrap=True)
        ax.legend(fontsize=7, ncol=2)
        atomic_write(f"{prefix}_{what}.png", partial(fig.savefig, format="png", dpi=110))
        plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        names, size = json.loads(args.worker)
        print(json.dumps(measure(names, size, args)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda was asked for, but torch sees no CUDA device here.")
    names = model_names(args.mechanisms, args.placements)
    limit = (
        f"points over {args.max_step_seconds:g} s a training step skipped" if args.max_step_seconds else "no time limit"
    )
    lines = [
        f"Machine: {machine()}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}",
        f"ViL-Small-sized models, batch {args.batch}, float32 on {args.device}; best of {args.repeats} rounds; "
        f"{limit}; GMACs: forward, one image",
        "",
    ]
    print("\n".join(lines), flush=True)
    study = {}
    for size in args.sizes:
        study[size] = run_size(args, names, size, study)
        rows, _ = tables({size: study[size]}, names)
        print("\n".join(rows[2:] if size != args.sizes[0] else rows), flush=True)
    rows, growth_rows = tables(study, names)
    tail = (
        [
            "",
            "Growth of each cost with the token count between the two largest sizes measured "
            "(log cost ratio / log token ratio: 1 linear, 2 quadratic):",
            "",
        ]
        + growth_rows
        + ["", RELEASE_NOTE]
    )
    print("\n".join(tail))
    lines += rows + tail
    if args.markdown:
        atomic_write(args.markdown, lambda f: f.write(("\n".join(lines) + "\n").encode()))
    if args.plot and not any(isinstance(result, tuple) for results in study.values() for result in results.values()):
        print(f"No model was measured at any size: no plots written to {args.plot}_*.png.")
    elif args.plot:
        plot_study(study, args.plot, lines[1])


if __name__ == "__main__":
    main()
