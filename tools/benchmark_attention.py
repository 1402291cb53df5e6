"""Forward+backward time and peak memory of one local attention layer, per backend and map size (or sequence
length, ``--dim 1``), next to ``torch.nn.functional.scaled_dot_product_attention`` over all tokens.

Default problem: one attention layer of ViL-Small's first stage (batch 4, 3 heads x 32, w=7, one global
token), fp32. Every size runs in a fresh process, so that one size cannot leave memory or caches to another.
There each backend is called once to warm up (compilation, kernel tuning and cached tables allocate scratch
memory of their own) and once to take its peak memory; then ``--repeats`` rounds call the backends in turn, so
that a swing in the machine's speed reaches all of them alike, and the time is each one's best. Peak memory is
what torch's allocator holds for tensors at most during one forward+backward, over what it held before
(``vil.profiling.PeakMemory``: on the CPU counted from the profiler's allocation events, on CUDA
``torch.cuda.max_memory_allocated``). It includes the output, its gradient and the inputs' gradients, not the
inputs. The working memory is that peak less the output, its gradient and the inputs' gradients, which every
implementation holds; the memory ratio puts the inputs plus the peak over the inputs, outputs and their
gradients (1.0: no memory beyond them). The last column is the warm-up call's time: compilation and kernel
tuning for the backends that have them (``triton``, compiled ``flex``), in a process that has compiled nothing
yet (Triton's and Inductor's on-disk caches aside).

    python tools/benchmark_attention.py                      # CPU, maps 28, 56, 84
    python tools/benchmark_attention.py --device cuda --dtype bfloat16 --batch 64 --rel-bias --sizes 28 56 112

The default backends are every backend of the registry (``vil/ops/registry.py``) that trains on the device,
``backend=None``'s choices first; on CUDA ``flex`` is compiled. ``--plot PREFIX`` also draws time and peak memory
against the map size (log scales, one line per backend, as the original paper's implementation study):
``PREFIX_time.png`` and ``PREFIX_memory.png``. ``--profile`` also prints, after each size's rows, torch.profiler's
table of one forward+backward per backend: where its time goes, operator by operator (and kernel by kernel on CUDA);
the rows are written first, so that a time limit that stops the profiles keeps them.
``--host-time`` (CUDA) also reports the host's time per call, with calls queued without waiting for the GPU, beside
the time per call of the whole queue: where they are close, the host sets the pace.
Each backend's first call is reported on stderr as it ends ("progress: triton at 28x28: first call 12.3 s"), so that
a long compilation shows where it is.

    python tools/benchmark_attention.py --sizes 14 28 42 56 84 --exact 0 --plot docs/study_exact0

``--dim 1`` measures ``local_attention_1d`` over sequences instead, with Longformer's settings: batch 1, 12 heads
x 64, a window of 256 keys on each side, no global keys (``--num-global``), ``--dilation`` and ``--causal``
(full attention then gets ``is_causal=True``); the sizes are sequence lengths, 1024 to 32768 by default. On the
CPU, full attention and ``loop`` are skipped above 16384 and 2048 tokens and ``reference`` above 4096. The plots
put time and peak memory against the sequence length, as Figure 1 of the Longformer paper.

    python tools/benchmark_attention.py --dim 1 --markdown docs/study_1d.md --plot docs/study_1d
    python tools/benchmark_attention.py --dim 1 --causal --markdown docs/study_1d_causal.md --plot docs/study_1d_causal

On the CPU, glibc's allocator hands large blocks back to the system when enough memory at the top of its heap is
free, and the next allocation of that size faults its pages in again. Whether a backend's scratch blocks hit that
depends on their sizes and on what the process allocated before, so the blocked backends' times swing by up to
1.5x from one process to another. ``--steady-malloc`` runs the workers with glibc keeping what it frees (as jemalloc
and tcmalloc do): the times then compare the implementations rather than the page faults of the allocator.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch
import torch.nn.functional as F

from vil.cli import check_outputs, non_negative_int, positive_int
from vil.cpu import cpu_description
from vil.files import atomic_write
from vil.ops import available_backends, default_backend, local_attention_1d, local_attention_2d
from vil.ops.registry import BACKENDS, fastest
from vil.plots import agg_pyplot
from vil.profiling import PeakMemory, time_table

SDPA = "sdpa (full attention)"
PROGRESS = "progress: "  # how a worker's lines on stderr that the study passes on begin
ANSWER = "answer: "  # how the worker's line on stderr that holds its results (JSON) begins
# Per --dim (1: sequences, 2: maps), the tokens above which a point is skipped:
REFERENCE_MAX_TOKENS = {2: 56 * 56, 1: 4096}  # the naive masked reference needs tokens^2 memory
SDPA_MAX_TOKENS = {2: 112 * 112, 1: 16384}  # on the CPU, full attention's time grows with tokens^2
LOOP_MAX_TOKENS = 2048  # on the CPU, the 1D loop takes one pass over the sequence per window offset (11 s at 2048)
UNFOLD_MAX_BYTES = 6 * 2**30  # the unfold backends keep the unfolded keys and values: skipped above this
# --steady-malloc: blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, which is never trimmed.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
DEFAULTS = {  # per dim, for the options left out; 2: ViL-Small's first stage, 1: Longformer's settings
    2: dict(sizes=[28, 56, 84], batch=4, heads=3, head_dim=32, window=7, num_global=1, exact=0),
    1: dict(
        sizes=[1024, 2048, 4096, 8192, 16384, 32768],
        batch=1,
        heads=12,
        head_dim=64,
        window=256,
        num_global=0,
        dilation=1,
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dim", type=int, default=2, choices=[1, 2], help="2: maps (local_attention_2d), 1: sequences")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument(
        "--sizes",
        type=positive_int,
        nargs="+",
        help="feature-map sides (default 28 56 84) or, with --dim 1, sequence lengths (default 1024 to 32768)",
    )
    p.add_argument("--backends", nargs="+", help="local attention backends (default: those for the device)")
    p.add_argument("--batch", type=positive_int, help="default 4; 1 with --dim 1")
    p.add_argument("--heads", type=positive_int, help="default 3; 12 with --dim 1")
    p.add_argument("--head-dim", type=positive_int, help="default 32; 64 with --dim 1")
    p.add_argument("--window", type=positive_int, help="default 7; with --dim 1 keys on each side, default 256")
    p.add_argument("--num-global", type=non_negative_int, help="global keys: default 1; 0 with --dim 1")
    p.add_argument("--exact", type=int, choices=[1, 0, -1], help="SW_EXACT (default 0); --dim 2 only")
    p.add_argument("--dilation", type=positive_int, help="window dilation (default 1); --dim 1 only")
    p.add_argument("--causal", action="store_true", help="keys at or before the query only; --dim 1 only")
    p.add_argument("--rel-bias", action="store_true", help="add a relative position bias table")
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument(
        "--steady-malloc",
        action="store_true",
        help="glibc keeps the memory it frees (below 32 MiB a block) for reuse, as jemalloc and tcmalloc do",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print, per size and backend, torch.profiler's table of one forward+backward (the operators and, "
        "on CUDA, the kernels that take the most time)",
    )
    p.add_argument(
        "--host-time",
        action="store_true",
        help="also print, per size and backend, the host's time per call, with calls queued back to back without "
        "waiting for the GPU, and the time per call of the whole queue (CUDA only)",
    )
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--plot", metavar="PREFIX", help="also draw PREFIX_time.png and PREFIX_memory.png")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure the backends at one size, print JSON
    args = p.parse_args(argv)
    if args.dim == 2 and (args.dilation is not None or args.causal):
        p.error("--dilation and --causal are options of the 1D study (--dim 1)")
    if args.dim == 1 and args.exact is not None:
        p.error("--exact is an option of the 2D study (--dim 2)")
    if args.host_time and args.device != "cuda":
        p.error("--host-time times the calls queued for a GPU: give --device cuda with it")
    check_outputs(p, [args.markdown], args.plot, ("time", "memory"))
    for name, value in DEFAULTS[args.dim].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def point_name(size, dim):
    """How a map side (dim 2) or a sequence length (dim 1) is written in the table and on the plots' axis."""
    return f"{size}x{size}" if dim == 2 else str(size)


def prepare(args, backend, size):
    """One forward+backward at map side or sequence length ``size``, as a function, and the sizes of what every
    implementation holds: ``(run, input_bytes, io_bytes)``."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    B, H, D, G = args.batch, args.heads, args.head_dim, args.num_global

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    if backend == SDPA:
        tokens = size**args.dim + G
        leaves = [rand(B, H, tokens, D) for _ in range(3)]
        out_numel = leaves[0].numel()

        def step():
            out = F.scaled_dot_product_attention(*leaves, is_causal=args.causal)
            out.backward(torch.ones(B, H, tokens, D, device=device, dtype=dtype))
    else:
        q, k, v = (rand(B, H, *(size,) * args.dim, D) for _ in range(3))
        gk, gv = (rand(B, H, G, D), rand(B, H, G, D)) if G else (None, None)
        if args.dim == 2:
            op, geometry, bias_rows = local_attention_2d, dict(exact=args.exact), (4 * args.window - 1) ** 2
        else:
            op, geometry = local_attention_1d, dict(dilation=args.dilation, causal=args.causal)
            bias_rows = 2 * args.window + 1
        rel = rand(H, bias_rows) if args.rel_bias else None
        leaves = [t for t in (q, k, v, gk, gv, rel) if t is not None]
        out_numel = q.numel()

        def step():
            out = op(q, k, v, args.window, **geometry, global_k=gk, global_v=gv, rel_bias=rel, backend=backend)
            out.backward(torch.ones_like(out))

    def run(wait=True):  # the gradients are freed at the end, so that the next call's peak memory counts them
        step()
        if wait and device.type == "cuda":
            torch.cuda.synchronize()
        for t in leaves:
            t.grad = None

    input_bytes = sum(t.numel() for t in leaves) * leaves[0].element_size()
    io_bytes = 2 * input_bytes + 2 * out_numel * leaves[0].element_size()  # inputs, output, their gradients
    return run, input_bytes, io_bytes


def host_time(backend, run, point):
    """The line that says the host's time per call (launches, checks, autograd), with 20 calls queued
    without waiting for the GPU, against the time per call until the GPU has run them all: where the two are
    close, the host sets the pace."""
    calls = 20
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run(wait=False)
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    done = time.perf_counter() - start
    return (
        f"{PROGRESS}{backend} at {point}: host {queued / calls * 1e3:.3f} ms per call, "
        f"{done / calls * 1e3:.3f} ms per call back to back"
    )


def measure(args, backends, size):
    """``{backend: (seconds, peak MiB, memory / (inputs, outputs, gradients), working MiB, first call's seconds)}``
    at ``size``, here, or a string saying why a backend failed, and ``{backend: its call}`` for those that ran. Each
    backend is warmed up (compilation, tuning and cached tables allocate memory of their own; the first call's time
    is kept) and its peak memory taken; then ``--repeats`` rounds call the backends in turn, so that a swing in the
    machine's speed reaches every backend alike, and the time is each one's best."""
    ready, results = {}, {}
    for backend in backends:
        try:
            run, input_bytes, io_bytes = prepare(args, backend, size)
            start = time.perf_counter()
            run()
            first_call = time.perf_counter() - start
            point = point_name(size, args.dim)
            print(f"{PROGRESS}{backend} at {point}: first call {first_call:.1f} s", file=sys.stderr)
            with PeakMemory(args.device) as peak:
                run()
        except Exception as error:  # one backend's failure is its row of the table, not the end of the study
            results[backend] = f"failed: {str(error).splitlines()[0][:80]}"
            continue
        working = peak.mib - (io_bytes - input_bytes) / 2**20
        ready[backend] = run
        results[backend] = [[], peak.mib, (input_bytes + peak.mib * 2**20) / io_bytes, working, first_call]
    for _ in range(args.repeats):
        for backend, run in ready.items():
            start = time.perf_counter()
            run()
            results[backend][0].append(time.perf_counter() - start)
    for backend in ready:
        results[backend][0] = min(results[backend][0])
    if args.host_time and args.device == "cuda":
        for backend, run in ready.items():
            print(host_time(backend, run, point_name(size, args.dim)), file=sys.stderr)
    return results, ready


def print_profiles(args, ready, size):
    """``--profile``: torch.profiler's table of one forward+backward of each backend that ran."""
    for backend, run in ready.items():
        print(f"\n{backend} at {point_name(size, args.dim)}, one forward+backward:", flush=True)
        print(time_table(run, args.device), flush=True)


def skip_reason(args, backend, size):
    """Why a point is not measured, or None."""
    tokens = size**args.dim
    if backend == "reference" and tokens > REFERENCE_MAX_TOKENS[args.dim]:
        return "skipped (tokens^2 memory)"
    if backend == SDPA and args.device == "cpu" and tokens > SDPA_MAX_TOKENS[args.dim]:
        return "skipped (tokens^2 time)"
    if backend == "loop" and args.device == "cpu" and tokens > LOOP_MAX_TOKENS:
        return "skipped (one pass per window offset: time)"
    if backend.startswith("unfold"):
        window_keys = (2 * args.window + 1) ** 2 if args.exact == 1 else 9 * args.window**2
        unfolded = 4 * args.batch * args.heads * tokens * window_keys * args.head_dim * 4  # K, V and gradients
        if unfolded > UNFOLD_MAX_BYTES:
            return "skipped (tokens x window x head_dim memory)"
    return None


def run_size(args, backends, size, report):
    """Measure ``backends`` at one size in a fresh process: ``{backend: (seconds, MiB, ...) or why not}``, handed to
    ``report`` as soon as the worker has measured them, before ``--profile``'s tables (so that a time limit that
    stops the profiles keeps the rows), and returned."""
    results = {name: skip_reason(args, name, size) for name in backends}
    measured = [name for name, reason in results.items() if reason is None]
    if not measured:
        report(results)
        return results
    options = {
        "--dim": args.dim,
        "--device": args.device,
        "--dtype": args.dtype,
        "--batch": args.batch,
        "--heads": args.heads,
        "--head-dim": args.head_dim,
        "--window": args.window,
        "--num-global": args.num_global,
        "--repeats": args.repeats,
    }
    options.update({"--exact": args.exact} if args.dim == 2 else {"--dilation": args.dilation})
    switches = (
        ("--rel-bias", args.rel_bias),
        ("--causal", args.causal),
        ("--profile", args.profile),
        ("--host-time", args.host_time),
    )
    flags = [flag for flag, on in switches if on]
    argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps([measured, size])]
    argv += [str(x) for item in options.items() for x in item] + flags
    env = dict(os.environ, **STEADY_MALLOC) if args.steady_malloc else None
    answered = None
    with tempfile.TemporaryFile("w+") as stdout:  # stdout: --profile's tables
        worker = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
        last = ""
        for line in worker.stderr:  # progress lines pass through as they come; the last other line is the error
            if line.startswith(ANSWER):
                answers = json.loads(line[len(ANSWER) :])
                answered = dict(results, **{name: a if isinstance(a, str) else tuple(a) for name, a in answers.items()})
                report(answered)
            elif line.startswith(PROGRESS):
                print(line.rstrip(), file=sys.stderr, flush=True)
            elif line.strip():
                last = line.strip()
        code = worker.wait()
        stdout.seek(0)
        printed = stdout.read().strip()
    if printed:
        print(printed, flush=True)
    why = last or (f"killed by signal {-code}" if code < 0 else f"exit status {code}")
    if answered is None:
        answered = dict(results, **{name: f"failed: {why[:80]}" for name in measured})
        report(answered)
    elif code:
        print(f"The profiles at {point_name(size, args.dim)} stopped: {why}", flush=True)
    return answered


def machine():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_description()


def default_backends(dim, device):
    """Every backend that computes ``dim``-D windows and trains on ``device``, those ``backend=None`` prefers
    there first."""
    able = [name for name in available_backends(dim) if BACKENDS[name].trains_on_device(device)]
    first = [name for name in fastest(device, dim) if name in able]
    return first + [name for name in able if name not in first]


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        backends, size = json.loads(args.worker)
        results, ready = measure(args, backends, size)
        print(ANSWER + json.dumps(results), file=sys.stderr, flush=True)
        if args.profile:
            print_profiles(args, ready, size)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda was asked for, but torch sees no CUDA device here.")
    able = available_backends(args.dim)
    if args.backends is None:
        args.backends = default_backends(args.dim, args.device)
    for backend in args.backends:
        if backend not in able:
            sys.exit(f"Unknown {args.dim}D backend {backend!r}; available: {', '.join(able)}.")
        if not BACKENDS[backend].trains_on_device(args.device):
            sys.exit(
                f"The {backend} backend does not train on {args.device}, and this study times forward and backward; "
                f"give backends that do: {', '.join(default_backends(args.dim, args.device))}."
            )
    default = default_backend(torch.device(args.device), getattr(torch, args.dtype), dims=args.dim)
    if args.dim == 2:
        geometry = f"w={args.window}, {args.num_global} global, SW_EXACT {args.exact}, "
    else:
        geometry = (
            f"sequences, w={args.window} on each side, dilation {args.dilation}, "
            f"{'causal, ' if args.causal else ''}{args.num_global} global, "
        )
    lines = [
        f"Machine: {machine()}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}",
        f"One layer, forward+backward: batch {args.batch}, {args.heads} heads x {args.head_dim}, {geometry}"
        f"{'relative bias, ' if args.rel_bias else ''}{args.dtype} on {args.device}; "
        f"best of {args.repeats}{'; --steady-malloc' if args.steady_malloc else ''}; backend=None picks {default!r}",
        "",
        f"| {'map' if args.dim == 2 else 'length'} | backend | time (ms) | peak memory (MiB) | working memory (MiB) | "
        "vs SDPA | memory / (inputs, outputs, gradients) | first call (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    summary, study = [], {}

    def write_table():
        """The rows so far (a run stopped by a time limit leaves them, not an earlier run's table)."""
        if args.markdown:
            atomic_write(args.markdown, lambda f: f.write(("\n".join(lines + [""] + summary) + "\n").encode()))

    def report(size, results):
        """The rows and summary lines of one size, printed and written as soon as its worker has measured it."""
        sdpa = results[SDPA]
        point = point_name(size, args.dim)
        best_local = None
        for name, result in results.items():
            if isinstance(result, str):
                row = f"| {point} | {name} | {result} | | | | | |"
            else:
                speedup = f"{sdpa[0] / result[0]:.2f}x" if not isinstance(sdpa, str) else ""
                row = (
                    f"| {point} | {name} | {result[0] * 1e3:.1f} | {result[1]:.1f} | {result[3]:.1f} | {speedup} "
                    f"| {result[2]:.2f} | {result[4]:.2f} |"
                )
                if name not in (SDPA, "reference") and (best_local is None or result[0] < best_local[1][0]):
                    best_local = (name, result)
            lines.append(row)
            print(row, flush=True)
        if best_local and not isinstance(sdpa, str):
            summary.append(
                f"{point}: fastest local backend {best_local[0]} runs at {sdpa[0] / best_local[1][0]:.2f}x SDPA's speed"
            )
        chunked = results.get("sliding_chunk")
        for name in ("fused_cpu", "chunk_rows"):  # the two that save no scores for the backward
            lean = results.get(name)
            if all(isinstance(r, tuple) for r in (lean, chunked, sdpa)):
                summary.append(
                    f"{point}: {name}'s peak memory is {lean[1] / chunked[1]:.2f}x sliding_chunk's and "
                    f"{lean[1] / sdpa[1]:.2f}x SDPA's; its working memory {lean[3] / chunked[3]:.2f}x and "
                    f"{lean[3] / sdpa[3]:.2f}x"
                )
        fused = results.get("triton")
        if isinstance(fused, tuple):
            others = [
                f"{result[0] / fused[0]:.2f}x {name}"
                for name, result in results.items()
                if name != "triton" and isinstance(result, tuple)
            ]
            summary.append(
                f"{point}: triton's speed-up over {', '.join(others)}; its memory is {fused[2]:.2f}x "
                f"the inputs, outputs and gradients"
            )
        write_table()

    write_table()
    for size in args.sizes:
        study[size] = run_size(args, [SDPA] + args.backends, size, partial(report, size))
    print("\n" + "\n".join(summary))
    if args.plot:
        plot_study(study, args.plot, lines[1], args.dim)


def plot_study(study, prefix, title, dim=2):
    """``study[size][backend]`` = (seconds, MiB, ...) or a reason -> PREFIX_time.png, PREFIX_memory.png, against
    the map side (``dim`` 2) or the sequence length (``dim`` 1)."""
    plt = agg_pyplot()
    import matplotlib.ticker

    backends = list(dict.fromkeys(name for results in study.values() for name in results))
    for column, what, unit in ((0, "time", "forward + backward time (ms)"), (1, "memory", "peak memory (MiB)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in backends:
            points = [
                (size, results[name][column] * (1e3 if column == 0 else 1))
                for size, results in sorted(study.items())
                if isinstance(results.get(name), tuple)
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(sorted(study), [point_name(s, dim) for s in sorted(study)])
        ax.set_xlabel("feature map" if dim == 2 else "sequence length")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=7, wrap=True)
        ax.legend(fontsize=8)
        fig.tight_layout()
        atomic_write(f"{prefix}_{what}.png", partial(fig.savefig, format="png", dpi=110))
        plt.close(fig)


if __name__ == "__main__":
    main()
