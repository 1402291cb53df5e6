"""transformers' Longformer against the same model after ``vil.accelerate_longformer``: time and peak memory of
training and inference steps, per sequence length, for one self-attention layer and for a whole model.

    python tools/benchmark_longformer.py [--lengths 1024 2048 4096 8192 16384] [--layers 2] [--rounds 3]
        [--markdown FILE] [--plot PREFIX]

Sizes are longformer-base's (hidden 768 = 12 heads x 64, attention_window 512, intermediate 3072), batch 1, float32,
one global token (the first), no dropout (transformers' attention dropout has no place in the op; the accelerated
layers run transformers' attention while it is on). The layer is transformers' ``LongformerSelfAttention``, called
as its encoder calls it; the model is a ``LongformerModel`` of ``--layers`` layers (longformer-base has 12) on
random token ids. A training step is the forward and the backward of the sum of squares of the output; an inference
step the forward without gradients. For the model, a third run times the training and inference of what the two
share, the accelerated model with each self-attention reduced to its q, k and v projections: transformers' time over
it bounds what any attention can gain. The contenders alternate in one process, ``--rounds`` times (the median of
each); peak memory is what torch's allocator holds during one training step (``vil.profiling.PeakMemory``).
``--what autocast`` adds the layer under CPU autocast in bfloat16 and float16: how far each contender's output is
from transformers' float32 output, whether it is finite, and its inference time.
"""

import argparse
import copy
import statistics
import time

import torch
import transformers
from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

import vil
from vil.cli import check_outputs, positive_int
from vil.cpu import cpu_description
from vil.files import atomic_write
from vil.plots import agg_pyplot
from vil.profiling import PeakMemory

CONTENDERS = ("transformers", "accelerated")
SHARED = "shared parts"  # the model with no attention: what bounds its speed-up


class SharedPartsOnly(LongformerSelfAttention):
    """What both contenders compute around the attention, and no attention: the layer's q, k, v projections (summed,
    so that a training step runs the backward of each)."""

    def forward(self, hidden_states, *args, **kwargs):
        return (self.query(hidden_states) + self.key(hidden_states) + self.value(hidden_states),)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--what", nargs="+", default=["layer", "model"], choices=["layer", "model", "autocast"])
    p.add_argument("--layers", type=positive_int, default=2, help="layers of the whole model (longformer-base: 12)")
    p.add_argument("--hidden", type=positive_int, default=768, help="hidden size (12 heads of hidden / 12)")
    p.add_argument("--window", type=positive_int, default=512, help="attention_window (keys on both sides together)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--plot", metavar="PREFIX", help="also draw PREFIX_time.png and PREFIX_memory.png")
    args = p.parse_args(argv)
    if args.window % 2:
        p.error(f"--window must be even (transformers splits it into two sides), got {args.window}.")
    if args.hidden % 12:
        p.error(f"--hidden must be a multiple of the 12 heads, got {args.hidden}.")
    uneven = [n for n in args.lengths if n % args.window]
    if uneven and set(args.what) & {"layer", "autocast"}:
        p.error(
            f"--what layer and autocast time transformers' layer alone, which takes lengths that are multiples of "
            f"--window {args.window} (the model pads to one), got {', '.join(map(str, uneven))}."
        )
    if args.plot and args.what == ["autocast"]:
        p.error("--plot draws the timed studies (--what layer, model); --what autocast alone has none.")
    check_outputs(p, [args.markdown], args.plot, ("time", "memory"))
    return args


def config(args, length):
    """The sizes asked for, with position embeddings for ``length`` tokens (not more: their gradient counts in the
    training peak)."""
    return transformers.LongformerConfig(
        hidden_size=args.hidden,
        num_attention_heads=12,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        attention_window=[args.window] * args.layers,
        max_position_embeddings=length + 2,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )


def layer_calls(args, length):
    """{contender: a function that runs the layer on one sequence}, both with the same weights and input."""
    torch.manual_seed(0)
    layer = LongformerSelfAttention(config(args, length), layer_id=0)
    x = torch.randn(1, length, args.hidden, requires_grad=True)
    mask = torch.zeros(1, length)
    mask[0, 0] = 10000.0  # the encoder's encoding: < 0 padding, 0 local, > 0 global
    inputs = dict(attention_mask=mask, is_index_masked=mask < 0, is_index_global_attn=mask > 0, is_global_attn=True)
    layers = {"transformers": layer, "accelerated": vil.accelerate_longformer(copy.deepcopy(layer))}
    return {name: (lambda m=m: m(x, **inputs)[0]) for name, m in layers.items()}


def layer_steps(args, length):
    """{contender: a function of ``training`` that runs one step of the layer}."""
    return {name: (lambda training, c=call: step(c, training)) for name, call in layer_calls(args, length).items()}


def model_steps(args, length):
    torch.manual_seed(0)
    model = transformers.LongformerModel(config(args, length), add_pooling_layer=False)
    ids = torch.randint(5, model.config.vocab_size, (1, length))
    global_mask = torch.zeros_like(ids)
    global_mask[0, 0] = 1
    models = {"transformers": model, "accelerated": vil.accelerate_longformer(copy.deepcopy(model))}
    models[SHARED] = vil.accelerate_longformer(copy.deepcopy(model))
    for module in models[SHARED].modules():
        if isinstance(module, LongformerSelfAttention):
            module.__class__ = SharedPartsOnly
    return {
        name: (lambda training, m=m: step(lambda: m(ids, global_attention_mask=global_mask)[0], training))
        for name, m in models.items()
    }


def step(forward, training):
    if not training:
        with torch.no_grad():
            forward()
        return
    forward().square().sum().backward()


def seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args, timed):
    """{(what, length, contender): (training s, inference s, training peak MiB)} for ``timed`` ("layer", "model"),
    with the model's shared parts (no peak memory: None)."""
    results = {}
    for what in timed:
        for length in args.lengths:
            steps = (layer_steps if what == "layer" else model_steps)(args, length)
            peaks = {}
            for name in CONTENDERS:
                with PeakMemory("cpu") as peak:
                    steps[name](True)
                peaks[name] = peak.mib
            times = {(name, training): [] for name in steps for training in (True, False)}
            for _ in range(args.rounds):
                for name, run in steps.items():
                    for training in (True, False):
                        times[name, training].append(seconds(lambda r=run, t=training: r(t)))
            for name in steps:
                train, infer = (statistics.median(times[name, training]) for training in (True, False))
                results[what, length, name] = (train, infer, peaks.get(name))
    return results


def autocast_rows(args):
    """The layer under CPU autocast in bfloat16 and float16: each contender's largest deviation from transformers'
    float32 output (relative to that output's largest magnitude), whether every output is finite, inference time."""
    lines = [
        "| tokens | autocast | transformers: deviation, finite, infer (ms) "
        "| accelerated: deviation, finite, infer (ms) |",
        "|---|---|---|---|",
    ]
    for length in args.lengths:
        calls = layer_calls(args, length)
        with torch.no_grad():
            want = calls["transformers"]()
            for dtype in (torch.bfloat16, torch.float16):
                cells = []
                for call in calls.values():
                    with torch.autocast("cpu", dtype=dtype):
                        got = call()
                        took = statistics.median(seconds(call) for _ in range(args.rounds))
                    deviation = ((got.float() - want).abs().max() / want.abs().max()).item()
                    cells.append(f"{deviation:.1e}, {bool(got.isfinite().all())}, {took * 1e3:.0f}")
                lines.append(f"| {length} | {str(dtype).replace('torch.', '')} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def table(results):
    lines = [
        "| what | tokens | transformers train / infer (ms) | accelerated train / infer (ms) | speed-up train / infer "
        "| training peak MiB: transformers -> accelerated (ratio) "
        "| shared parts train / infer (ms): bound on the speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for what, length in dict.fromkeys((w, n) for w, n, _ in results):
        (t_train, t_infer, t_peak), (a_train, a_infer, a_peak) = (results[what, length, c] for c in CONTENDERS)
        bound = "-"
        if (what, length, SHARED) in results:
            s_train, s_infer, _ = results[what, length, SHARED]
            bound = f"{s_train * 1e3:.0f} / {s_infer * 1e3:.0f}: {t_train / s_train:.2f}x / {t_infer / s_infer:.2f}x"
        lines.append(
            f"| {what} | {length} | {t_train * 1e3:.0f} / {t_infer * 1e3:.0f} | {a_train * 1e3:.0f} / "
            f"{a_infer * 1e3:.0f} | {t_train / a_train:.2f}x / {t_infer / a_infer:.2f}x | {t_peak:.0f} -> "
            f"{a_peak:.0f} ({a_peak / t_peak:.2f}x) | {bound} |"
        )
    return "\n".join(lines)


def plot(results, prefix):
    plt = agg_pyplot()
    for index, quantity, unit in ((0, "time", "training step (ms)"), (2, "memory", "training peak memory (MiB)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for what in dict.fromkeys(w for w, _, _ in results):
            for contender in CONTENDERS:
                points = sorted((n, r[index]) for (w, n, c), r in results.items() if w == what and c == contender)
                scale = 1e3 if index == 0 else 1.0
                ax.plot(
                    [n for n, _ in points], [v * scale for _, v in points], marker="o", label=f"{what}, {contender}"
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(unit)
        ax.legend()
        fig.tight_layout()
        atomic_write(f"{prefix}_{quantity}.png", lambda f, fig=fig: fig.savefig(f, format="png"))
        plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    machine = f"CPU: {cpu_description()}; transformers {transformers.__version__}; model layers: {args.layers}"
    print(machine, flush=True)
    timed = [what for what in args.what if what != "autocast"]
    results = measure(args, timed)
    text = "\n\n".join(([table(results)] if timed else []) + ([autocast_rows(args)] if "autocast" in args.what else []))
    print(text)
    if args.markdown:
        atomic_write(args.markdown, lambda f: f.write((machine + "\n\n" + text + "\n").encode()))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
