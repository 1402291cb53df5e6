"""Local attention in float32 and in bfloat16 (and float16, ``--dtypes``) on the CPU: against SDPA in the same
dtype, and against the CPU's own matrix products in the dtype it multiplies in (the roofline).

    python tools/benchmark_precision.py [--sizes 56 84] [--tokens 4096] [--rounds 5] [--dtypes float32 bfloat16]
                                        [--markdown FILE]

The problems, each in inference (no gradients) and training (forward + backward):

- 2D: one attention layer of ViL-Small's first stage: batch 4, 3 heads x 32, w=7, SW_EXACT 0, one global token, a
  relative position bias table; q, k, v and the global key and value are views of one qkv tensor, as the model's
  projections give them; ``local_attention_2d`` with ``backend=None``, next to
  ``scaled_dot_product_attention`` over all tokens;
- 1D: Longformer-base's attention: batch 1, 12 heads x 64, w=256 keys on each side; ``local_attention_1d``
  next to ``scaled_dot_product_attention`` over the whole sequence.

The tensors are in the dtype of the row (the bias table stays float32, as a parameter does under autocast).
Contenders alternate in one process (``--rounds`` rounds, the median of each). GFLOP/s: the local op's products as
torch's FLOP counter counts them (``vil.profiling.flop_counter``) over its time, next to the same run's
``--matmul``-sided square matrix product in the dtype the op multiplies in: the row's, or float32 for a
half-precision dtype that the fused kernels multiply in float32 (on a CPU without matrix instructions for it, whose
product is plain loops, or whose instructions are slower than float32's). A second table gives each half-precision
dtype's speed against float32's. Where the CPU has the instructions for a half-precision dtype, a third table times
its rows again with the fused kernels' other way of multiplying (``VIL_FUSED_CPU_PRODUCTS``: float32 products where
``auto`` takes half-precision ones here, else half-precision ones): what half-precision products gain, or lose, on
this CPU.
"""

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from vil.cli import check_outputs, positive_int
from vil.cpu import cpu_description
from vil.files import atomic_write
from vil.models.attention import split_globals
from vil.ops import default_backend, local_attention_1d, local_attention_2d
from vil.ops.backends.fused_cpu import PRODUCTS_VARIABLE, half_products, half_products_missing
from vil.profiling import flop_counter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_2D = dict(batch=4, heads=3, head_dim=32, window=7, num_global=1)
LAYER_1D = dict(batch=1, heads=12, head_dim=64, window=256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[56, 84], help="2D map sides")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[4096], help="1D sequence lengths")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--matmul", type=positive_int, default=2048, help="side of the square matrix product (default 2048)")
    p.add_argument("--markdown", help="also write the table to this file")
    args = p.parse_args(argv)
    check_outputs(p, [args.markdown])
    return args


def layer_2d(side, dtype):
    """(local attention, SDPA) over one map, each a function of no arguments returning the output."""
    B, H, D, w, G = (LAYER_2D[k] for k in ("batch", "heads", "head_dim", "window", "num_global"))
    qkv = torch.randn(B, G + side * side, 3, H, D, dtype=dtype, requires_grad=True)
    rel_bias = torch.randn(H, (4 * w - 1) ** 2, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, G + tokens, D) views
    grid = (B, H, side, side, D)

    def local():
        (_, q_local), (k_global, k_local), (v_global, v_local) = (split_globals(t, G, dim=2) for t in (q, k, v))
        return local_attention_2d(
            q_local.reshape(grid),
            k_local.reshape(grid),
            v_local.reshape(grid),
            w,
            global_k=k_global,
            global_v=v_global,
            rel_bias=rel_bias,
        )

    return local, lambda: F.scaled_dot_product_attention(q, k, v)


def layer_1d(tokens, dtype):
    B, H, D, w = (LAYER_1D[k] for k in ("batch", "heads", "head_dim", "window"))
    qkv = torch.randn(B, tokens, 3, H, D, dtype=dtype, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return lambda: local_attention_1d(q, k, v, w), lambda: F.scaled_dot_product_attention(q, k, v)


def step(attend, training):
    """One inference or training step of ``attend`` (a function of no arguments returning the output)."""
    if not training:
        with torch.no_grad():
            return attend()
    out = attend()
    out.backward(torch.ones_like(out))


def seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def counted_flops(attend, training):
    with flop_counter() as counter:
        step(attend, training)
    return counter.get_total_flops()


def matmul_gflops(side, dtype):
    """The best of 4 products, the first included (only the first where it takes over a second: CPUs without
    bfloat16 instructions multiply it in plain loops, a minute at 2048)."""
    a, b = (torch.randn(side, side, dtype=dtype) for _ in range(2))
    best = seconds(lambda: a @ b)  # includes the first call's set-up
    for _ in range(3 if best < 1 else 0):
        best = min(best, seconds(lambda: a @ b))
    return 2 * side**3 / best / 1e9


@contextmanager
def products(choice):
    """The fused CPU kernels' products as ``choice`` says (``VIL_FUSED_CPU_PRODUCTS``) inside the block."""
    before = os.environ.get(PRODUCTS_VARIABLE)
    os.environ[PRODUCTS_VARIABLE] = choice
    try:
        yield
    finally:
        if before is None:
            del os.environ[PRODUCTS_VARIABLE]
        else:
            os.environ[PRODUCTS_VARIABLE] = before


def problems(args):
    """{(problem name, dtype name): (local, SDPA)} for every size and dtype asked for."""
    found = {}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for side in args.sizes:
            found[f"2D {side}x{side}", dtype_name] = layer_2d(side, dtype)
        for tokens in args.tokens:
            found[f"1D {tokens} tokens", dtype_name] = layer_1d(tokens, dtype)
    return found


def contenders(cases):
    """{(problem, dtype, which): step(attend, training)}: the local op and SDPA, and for a half-precision dtype that
    the CPU can multiply in half precision, the local op again with the products ``auto`` does not take here (which
    2), its backward included."""

    def with_other_products(dtype, attend, training):
        with products("float32" if half_products(dtype) else "half"):
            step(attend, training)

    found = {}
    for key, (local, sdpa) in cases.items():
        dtype = DTYPES[key[1]]
        found[(*key, 0)] = partial(step, local)
        found[(*key, 1)] = partial(step, sdpa)
        if dtype != torch.float32 and not half_products_missing(dtype):
            found[(*key, 2)] = partial(with_other_products, dtype, local)
    return found


def measure(args):
    """{(problem, dtype, mode): (local s, SDPA s, local FLOPs, local s with the other products or None)} and {dtype:
    matmul GFLOP/s}, the contenders alternating."""
    cases = problems(args)
    steps = contenders(cases)
    modes = {"inference": False, "training": True}
    times = {(*key, mode): [] for key in steps for mode in modes}
    for run in steps.values():  # warm-up: builds, first allocations
        run(True)
    for _ in range(args.rounds):
        for key, run in steps.items():
            for mode, training in modes.items():
                times[(*key, mode)].append(seconds(lambda r=run, t=training: r(t)))

    def median(problem, dtype, which, mode):
        found = times.get((problem, dtype, which, mode))
        return statistics.median(found) if found else None

    results = {
        (*key, mode): (
            median(*key, 0, mode),
            median(*key, 1, mode),
            counted_flops(cases[key][0], training),
            median(*key, 2, mode),
        )
        for key in cases
        for mode, training in modes.items()
    }
    products = {products_dtype(name) for name in args.dtypes}
    return results, {name: matmul_gflops(args.matmul, DTYPES[name]) for name in products}


def products_dtype(dtype_name):
    """The dtype the local op multiplies ``dtype_name`` inputs in: their own, or float32 where the fused kernels
    multiply half precision in float32."""
    dtype = DTYPES[dtype_name]
    return dtype_name if dtype == torch.float32 or half_products(dtype) else "float32"


def table(results, matmul, matmul_side):
    lines = [
        f"| problem | dtype | mode | local (ms) | SDPA (ms) | local vs SDPA | local GFLOP/s "
        f"| matmul {matmul_side}^2 GFLOP/s, in the op's products' dtype | of matmul |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (problem, dtype, mode), (local, sdpa, flops, _) in results.items():
        rate, roof = flops / local / 1e9, matmul[products_dtype(dtype)]
        lines.append(
            f"| {problem} | {dtype} | {mode} | {local * 1e3:.1f} | {sdpa * 1e3:.1f} | {sdpa / local:.2f}x "
            f"| {rate:.1f} | {roof:.1f} | {rate / roof:.0%} |"
        )
    return "\n".join(lines)


def dtype_ratios(results):
    """float32 time over a half-precision dtype's time of the local op, per problem and mode: how much the dtype
    gains."""
    lines = ["| problem | mode | dtype | vs float32 |", "|---|---|---|---|"]
    for (problem, dtype, mode), (local, *_) in results.items():
        if dtype != "float32" and (problem, "float32", mode) in results:
            lines.append(f"| {problem} | {mode} | {dtype} | {results[problem, 'float32', mode][0] / local:.2f}x |")
    return "\n".join(lines) if len(lines) > 2 else ""


def products_table(results):
    """The half-precision rows with half-precision and with float32 products in the fused kernels, and which
    ``auto`` takes here (the local op's rows above)."""
    takes, lines = {}, []
    for (problem, dtype, mode), (local, _, _, other) in results.items():
        if other is not None:
            half = takes[dtype] = products_dtype(dtype) == dtype
            in_half, in_float32 = (local, other) if half else (other, local)
            lines.append(
                f"| {problem} | {dtype} | {mode} | {in_half * 1e3:.1f} | {in_float32 * 1e3:.1f} "
                f"| {in_float32 / in_half:.2f}x |"
            )
    if not lines:
        return ""
    choices = ", ".join(f"{'half-precision' if half else 'float32'} ones for {dtype}" for dtype, half in takes.items())
    return "\n".join(
        [
            f"The fused kernels' products (auto takes {choices} here):",
            "",
            "| problem | dtype | mode | half-precision products (ms) | float32 products (ms) | "
            "half-precision products' speed-up |",
            "|---|---|---|---|---|---|",
            *lines,
        ]
    )


def main(argv=None):
    args = parse_args(argv)
    try:  # VIL_FUSED_CPU_PRODUCTS, which the kernels read, checked before anything is measured
        for name in args.dtypes:
            half_products(DTYPES[name])
    except ValueError as e:
        sys.exit(f"error: {e}")
    machine = f"CPU: {cpu_description()}; local attention backend: {default_backend('cpu', torch.float32)}"
    print(machine, flush=True)
    results, matmul = measure(args)
    text = table(results, matmul, args.matmul)
    for extra in (dtype_ratios(results), products_table(results)):
        if extra:
            text += "\n\n" + extra
    print(text)
    if args.markdown:
        atomic_write(args.markdown, lambda f: f.write((machine + "\n\n" + text + "\n").encode()))


if __name__ == "__main__":
    main()
