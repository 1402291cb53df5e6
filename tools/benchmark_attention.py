"""Forward+backward time and peak memory of one local attention layer, per backend and map size, next to
``torch.nn.functional.scaled_dot_product_attention`` over all tokens.

Default problem: one attention layer of ViL-Small's first stage (batch 4, 3 heads x 32, w=7, one global
token), fp32. Every point runs in a fresh process, so that one point cannot leave memory or caches to another.
Peak memory is what torch's allocator holds for tensors at most during one forward+backward, over what it held
before (``vil.profiling.PeakMemory``: on the CPU counted from the profiler's allocation events, on CUDA
``torch.cuda.max_memory_allocated``), taken after one warm-up call (compilation and kernel tuning allocate
scratch memory of their own). It includes the output, its gradient and the inputs' gradients, not the inputs.
The working memory is that peak less the output, its gradient and the inputs' gradients, which every
implementation holds; the last column puts the inputs plus the peak over the inputs, outputs and their
gradients (1.0: no memory beyond them). Time is the best of ``--repeats`` calls.

    python tools/benchmark_attention.py                      # CPU, maps 28, 56, 84
    python tools/benchmark_attention.py --device cuda --dtype bfloat16 --batch 64 --rel-bias --sizes 28 56 112

On CUDA the default backends are ``triton``, ``flex`` (compiled) and ``sliding_chunk``; on the CPU, every backend
that trains there. ``--plot PREFIX`` also draws time and peak memory against the map size (log scales, one line
per backend, as the original paper's implementation study): ``PREFIX_time.png`` and ``PREFIX_memory.png``.

    python tools/benchmark_attention.py --sizes 14 28 42 56 84 --exact 0 --plot docs/study_exact0
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from vil.checkpoint import atomic_write
from vil.ops import available_backends, default_backend, local_attention_2d
from vil.profiling import PeakMemory

SDPA = "sdpa (full attention)"
REFERENCE_MAX_TOKENS = 56 * 56  # the naive masked reference needs tokens^2 memory: skipped above this
SDPA_MAX_TOKENS = 112 * 112  # full attention's time grows with tokens^2: skipped above this on the CPU
UNFOLD_MAX_BYTES = 6 * 2**30  # the unfold backends keep the unfolded keys and values: skipped above this
CPU_BACKENDS = ["fused_cpu", "sliding_chunk", "sliding_chunk_autograd", "chunk_rows", "unfold", "unfold_nnf", "reference"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--sizes", type=int, nargs="+", default=[28, 56, 84], help="feature-map sides")
    p.add_argument("--backends", nargs="+", help="local attention backends (default: those for the device)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--window", type=int, default=7)
    p.add_argument("--num-global", type=int, default=1)
    p.add_argument("--exact", type=int, default=0, choices=[1, 0, -1], help="SW_EXACT")
    p.add_argument("--rel-bias", action="store_true", help="add a relative position bias table")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--plot", metavar="PREFIX", help="also draw PREFIX_time.png and PREFIX_memory.png")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one point, print JSON
    return p.parse_args(argv)


def measure(args, backend, size):
    """Time (s) and peak memory (MiB) of one forward+backward at map ``size``, in this process."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    B, H, D, G = args.batch, args.heads, args.head_dim, args.num_global

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    if backend == SDPA:
        leaves = [rand(B, H, size * size + G, D) for _ in range(3)]
        out_numel = leaves[0].numel()

        def step():
            F.scaled_dot_product_attention(*leaves).backward(torch.ones(B, H, size * size + G, D, device=device, dtype=dtype))
    else:
        q, k, v = (rand(B, H, size, size, D) for _ in range(3))
        gk, gv = (rand(B, H, G, D), rand(B, H, G, D)) if G else (None, None)
        rel = rand(H, (4 * args.window - 1) ** 2) if args.rel_bias else None
        leaves = [t for t in (q, k, v, gk, gv, rel) if t is not None]
        out_numel = q.numel()

        def step():
            out = local_attention_2d(q, k, v, args.window, exact=args.exact, global_k=gk, global_v=gv, rel_bias=rel, backend=backend)
            out.backward(torch.ones_like(out))

    def run():
        for t in leaves:
            t.grad = None
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    run()  # compilation, tuning and cached tables first: they allocate memory of their own
    with PeakMemory(device) as peak:
        run()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    input_bytes = sum(t.numel() for t in leaves) * leaves[0].element_size()
    io_bytes = 2 * input_bytes + 2 * out_numel * leaves[0].element_size()  # inputs, output, their gradients
    working = peak.mib - (io_bytes - input_bytes) / 2**20
    return min(times), peak.mib, (input_bytes + peak.mib * 2**20) / io_bytes, working


def run_point(args, backend, size):
    """Measure one point in a fresh process; returns (seconds, MiB) or a string saying why not."""
    if backend == "reference" and size * size > REFERENCE_MAX_TOKENS:
        return "skipped (tokens^2 memory)"
    if backend == SDPA and args.device == "cpu" and size * size > SDPA_MAX_TOKENS:
        return "skipped (tokens^2 time)"
    window_keys = (2 * args.window + 1) ** 2 if args.exact == 1 else 9 * args.window**2
    unfolded = 4 * args.batch * args.heads * size * size * window_keys * args.head_dim * 4  # K, V and gradients
    if backend.startswith("unfold") and unfolded > UNFOLD_MAX_BYTES:
        return "skipped (tokens x window x head_dim memory)"
    options = {"--device": args.device, "--dtype": args.dtype, "--batch": args.batch, "--heads": args.heads,
               "--head-dim": args.head_dim, "--window": args.window, "--num-global": args.num_global,
               "--exact": args.exact, "--repeats": args.repeats}
    argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps([backend, size])]
    argv += [str(x) for item in options.items() for x in item] + (["--rel-bias"] if args.rel_bias else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return f"failed: {last[:80]}"
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def machine():
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def main():
    args = parse_args()
    if args.worker:
        backend, size = json.loads(args.worker)
        print(json.dumps(measure(args, backend, size)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda was asked for, but torch sees no CUDA device here.")
    if args.backends is None:
        args.backends = ["triton", "flex", "sliding_chunk"] if args.device == "cuda" else CPU_BACKENDS
    for backend in args.backends:
        if backend not in available_backends():
            sys.exit(f"Unknown backend {backend!r}; available: {', '.join(available_backends())}.")
    default = default_backend(torch.device(args.device), getattr(torch, args.dtype))
    lines = [
        f"Machine: {machine()}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}",
        f"One layer, forward+backward: batch {args.batch}, {args.heads} heads x {args.head_dim}, w={args.window}, "
        f"{args.num_global} global, SW_EXACT {args.exact}, {'relative bias, ' if args.rel_bias else ''}{args.dtype} on {args.device}; "
        f"best of {args.repeats}; backend=None picks {default!r}",
        "",
        "| map | backend | time (ms) | peak memory (MiB) | working memory (MiB) | vs SDPA | memory / (inputs, outputs, gradients) |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    summary, study = [], {}
    for size in args.sizes:
        results = study[size] = {name: run_point(args, name, size) for name in [SDPA] + args.backends}
        sdpa = results[SDPA]
        best_local = None
        for name, result in results.items():
            if isinstance(result, str):
                row = f"| {size}x{size} | {name} | {result} | | | | |"
            else:
                speedup = f"{sdpa[0] / result[0]:.2f}x" if not isinstance(sdpa, str) else ""
                row = f"| {size}x{size} | {name} | {result[0] * 1e3:.1f} | {result[1]:.1f} | {result[3]:.1f} | {speedup} | {result[2]:.2f} |"
                if name not in (SDPA, "reference") and (best_local is None or result[0] < best_local[1][0]):
                    best_local = (name, result)
            lines.append(row)
            print(row, flush=True)
        if best_local and not isinstance(sdpa, str):
            summary.append(f"{size}x{size}: fastest local backend {best_local[0]} is {sdpa[0] / best_local[1][0]:.2f}x faster than SDPA")
        chunked = results.get("sliding_chunk")
        for name in ("fused_cpu", "chunk_rows"):  # the two that save no scores for the backward
            lean = results.get(name)
            if all(isinstance(r, tuple) for r in (lean, chunked, sdpa)):
                summary.append(f"{size}x{size}: {name}'s peak memory is {lean[1] / chunked[1]:.2f}x sliding_chunk's and "
                               f"{lean[1] / sdpa[1]:.2f}x SDPA's; its working memory {lean[3] / chunked[3]:.2f}x and {lean[3] / sdpa[3]:.2f}x")
        fused = results.get("triton")
        if isinstance(fused, tuple):
            others = [f"{result[0] / fused[0]:.2f}x {name}" for name, result in results.items()
                      if name != "triton" and isinstance(result, tuple)]
            summary.append(f"{size}x{size}: triton's speed-up over {', '.join(others)}; its memory is {fused[2]:.2f}x "
                           f"the inputs, outputs and gradients")
    lines += [""] + summary
    print("\n" + "\n".join(summary))
    if args.markdown:
        atomic_write(args.markdown, lambda f: f.write(("\n".join(lines) + "\n").encode()))
    if args.plot:
        plot_study(study, args.plot, lines[1])


def plot_study(study, prefix, title):
    """``study[size][backend]`` = (seconds, MiB, ...) or a reason -> PREFIX_time.png, PREFIX_memory.png."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(dict.fromkeys(name for results in study.values() for name in results))
    for column, what, unit in ((0, "time", "forward + backward time (ms)"), (1, "memory", "peak memory (MiB)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in backends:
            points = [(size, results[name][column] * (1e3 if column == 0 else 1))
                      for size, results in sorted(study.items()) if isinstance(results.get(name), tuple)]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(sorted(study), [f"{s}x{s}" for s in sorted(study)])
        ax.set_xlabel("feature map")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=7, wrap=True)
        ax.legend(fontsize=8)
        fig.tight_layout()
        atomic_write(f"{prefix}_{what}.png", lambda f: fig.savefig(f, format="png", dpi=110))
        plt.close(fig)


if __name__ == "__main__":
    main()
