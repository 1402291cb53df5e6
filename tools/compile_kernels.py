"""Compile the Triton kernels for NVIDIA GPU architectures, without a GPU, and print their shared memory.

Catches what the CPU interpreter cannot (types that differ between branches, layouts the compiler rejects,
shared memory beyond a GPU's limit) for each variant the launchers can ask for: dtypes, head dims, windows,
SW_EXACT (2D) or causal (1D), globals, bias tables and the key padding mask, and every candidate tile shape.

    python tools/compile_kernels.py                                  # sm_80 and sm_90, a few variants
    python tools/compile_kernels.py --arch 90 --variant bfloat16,32,7,0 --variant-1d bfloat16,64,256,0
    python tools/compile_kernels.py --arch 90 --first-tile           # only the tile shape the interpreter runs
    python tools/compile_kernels.py --arch 90 --all                  # every dtype, head dim, tile (slow)
"""

import argparse
import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # whatever its value: the interpreter's kernels cannot be compiled

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from vil.ops.backends.triton import kernel_geometry  # noqa: E402
from vil_kernels import flash  # noqa: E402
from vil_kernels import local_attention as kernels
from vil_kernels import local_attention_1d as kernels_1d

POINTERS = {
    "LSE": "fp32",
    "DELTA": "fp32",
    "NEIGHBOURS": "i32",
    "NEIGHBOURS_T": "i32",
    "COUNTS": "i32",
    "COUNTS_T": "i32",
    "DGK_PART": "fp32",
    "DGV_PART": "fp32",
    "DGB_PART": "fp32",
    "DRB_PART": "fp32",
    "MASK": "u8",
    "DILATIONS": "i32",
}
TENSORS = {"Q", "K", "V", "GK", "GV", "Out", "DO", "DQ", "DK", "DV", "REL_BIAS", "GLOBAL_BIAS"}
FLOATS = {"qk_scale", "scale"}
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def alignment_hints(kernel, constants, head_dim):
    """The divisibility by 16 that Triton's JIT assumes for a call with contiguous inputs: every pointer (torch's
    allocations are aligned), and every stride where head_dim is a multiple of 16 (each stride is a multiple of
    it). Without the hints the compiler cannot vectorise the loads of a tile, and does not pipeline them."""
    args = [name for name in kernel.arg_names if name not in constants]
    hinted = {name for name in args if name in TENSORS or name in POINTERS}
    if head_dim % 16 == 0:
        hinted |= {name for name in args if name.startswith("s_")}
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in hinted}


def signature(kernel, constants, dtype):
    sig = {}
    for name in kernel.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in TENSORS:
            sig[name] = "*" + dtype
        elif name in POINTERS:
            sig[name] = "*" + POINTERS[name]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def variants(args):
    """(dims, dtype, head_dim, window, exact or causal) to compile; each with globals, both bias tables and (1D)
    the key padding mask."""
    if args.all:
        return list(itertools.product([2], DTYPES, kernels.HEAD_DIMS, (3, 7, 12), (0, 1))) + list(
            itertools.product([1], DTYPES, (16, 32, 64, 128), (7, 256, 512), (0, 1))
        )
    if args.variant or args.variant_1d:
        return [
            (dims, dtype, int(d), int(w), int(e))
            for dims, given in ((2, args.variant), (1, args.variant_1d))
            for dtype, d, w, e in (v.split(",") for v in given or [])
        ]
    return [
        (2, "bfloat16", 32, 7, 0),
        (2, "float16", 64, 7, 1),
        (2, "float32", 48, 3, -1),
        (1, "bfloat16", 64, 256, 0),
        (1, "float16", 128, 512, 1),
        (1, "float32", 24, 7, 0),
    ]


def _jobs_2d(head_dim, window, exact, first_tile):
    """(kernel, tile shape or None, warps, pipelining stages or None: Triton's default, constants) of the 2D kernels:
    every candidate tile shape and pipelining, with and without the global keys and both bias tables (without, the
    compiler pipelines otherwise, and a kernel may need more shared memory)."""
    geo = kernel_geometry(14, 14, window, exact, 0, 1, "cpu")
    base = dict(
        W=window,
        C=geo.chunk,
        P=geo.chunk_pad,
        DIL=1,
        EXACT=exact,
        N_OFF=geo.num_slots,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=16,
        BT=max(16, triton.next_power_of_2(4 * window - 1)),
    )
    for bq, bk, warps, stages in kernels._candidates(geo.chunk_pad)[: 1 if first_tile else None]:
        for extras in (True, False):
            tables = dict(HAS_GLOBAL=extras, HAS_REL_BIAS=extras, HAS_GLOBAL_BIAS=extras)
            for kernel in (kernels._fwd_kernel, kernels._bwd_dkdv_kernel, kernels._bwd_dq_kernel):
                yield kernel, (bq, bk), warps, stages, dict(base, BQI=bq, BKI=bk, **tables)


def _jobs_1d(head_dim, window, causal, first_tile):
    """The same for the 1D kernels."""
    base = dict(
        W=window,
        CAUSAL=bool(causal),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=kernels_1d.BLOCK_G,
        BLOCK_N=kernels_1d.BLOCK_N,
        HAS_GLOBAL=True,
        HAS_REL_BIAS=True,
        HAS_GLOBAL_BIAS=True,
        HAS_MASK=True,
    )
    yield kernels_1d._bwd_global_kernel, None, 4, None, base
    for bm, bn, warps in kernels_1d.TILE_SHAPES[: 1 if first_tile else None]:
        kb, before, bt_rows, bt_cols = kernels_1d.bias_bins(bm, bn, window)
        constants = dict(base, BM=bm, BN=bn, KB=kb, BEFORE=before, BT_ROWS=bt_rows, BT_COLS=bt_cols)
        for kernel in (kernels_1d._fwd_kernel, kernels_1d._bwd_dkdv_kernel, kernels_1d._bwd_dq_kernel):
            yield kernel, (bm, bn), warps, None, constants


def compile_variant(arch, dims, dtype, head_dim, window, option, first_tile=False):
    """Compile the kernels of one variant for every candidate tile shape (or the first); yields (kernel and what it
    leaves out, shape and pipelining, shared bytes)."""
    precision = "tf32x3" if dtype == "float32" else "tf32"
    target = GPUTarget("cuda", arch, 32)
    delta = dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=flash.DELTA_BLOCK_N)
    jobs = itertools.chain(
        [(flash.delta_kernel, None, 4, None, delta)],
        (_jobs_1d if dims == 1 else _jobs_2d)(head_dim, window, option, first_tile),
    )
    for kernel, shape, warps, stages, constants in jobs:
        constants = dict(constants, DOT_PRECISION=precision)
        constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
        source = triton.compiler.ASTSource(
            fn=kernel,
            signature=signature(kernel, constants, DTYPES[dtype]),
            constexprs=constants,
            attrs=alignment_hints(kernel, constants, head_dim),
        )
        options = {"num_warps": warps} | ({} if stages is None else {"num_stages": stages})
        compiled = triton.compile(source, target=target, options=options)
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
        if constants.get("HAS_GLOBAL") is False:
            name += ", no globals or bias tables"
        tile = f"{shape}, unpipelined" if stages == kernels.UNPIPELINED else shape
        yield name, tile, compiled.metadata.shared


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities, e.g. 80 90")
    p.add_argument("--all", action="store_true", help="every dtype, head dim and chunk tile size")
    p.add_argument("--variant", nargs="+", help="2D: dtype,head_dim,window,exact, e.g. bfloat16,32,7,0")
    p.add_argument("--variant-1d", nargs="+", help="1D: dtype,head_dim,window,causal, e.g. bfloat16,64,256,0")
    p.add_argument("--first-tile", action="store_true", help="only the first candidate tile shape (the interpreter's)")
    args = p.parse_args(argv)
    print(
        "| arch | windows | dtype | head_dim | w | SW_EXACT (2D) / causal (1D) | kernel | tile (2D: query rows, key "
        "rows; 1D: queries, keys) | shared memory (KiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for arch, (dims, dtype, head_dim, window, option) in itertools.product(args.arch, variants(args)):
        row = f"| sm_{arch} | {dims}D | {dtype} | {head_dim} | {window} | {option} |"
        try:
            for name, shape, shared in compile_variant(arch, dims, dtype, head_dim, window, option, args.first_tile):
                print(f"{row} {name} | {shape or ''} | {shared / 1024:.1f} |", flush=True)
        except Exception as error:  # report every failing variant, then fail
            failures += 1
            print(f"{row} FAILED: {str(error).splitlines()[-1][:150]} | | |")
    if failures:
        sys.exit(f"{failures} variant(s) did not compile.")


if __name__ == "__main__":
    main()
