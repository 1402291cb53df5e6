"""Compile the Triton kernels for NVIDIA GPU architectures, without a GPU, and print their shared memory.

Catches what the CPU interpreter cannot (types that differ between branches, layouts the compiler rejects,
shared memory beyond a GPU's limit) for each variant the launcher can ask for: dtypes, head dims, windows,
SW_EXACT, globals and bias tables, and every candidate tile shape.

    python tools/compile_kernels.py                                  # sm_80 and sm_90, a few variants
    python tools/compile_kernels.py --arch 90 --variant bfloat16,32,7,0
    python tools/compile_kernels.py --arch 90 --all                  # every dtype, head dim, tile (slow)
"""

import argparse
import itertools
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels cannot be compiled
    del os.environ["TRITON_INTERPRET"]

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from vil.ops.backends.fused_triton import kernel_geometry  # noqa: E402
from vil_kernels import local_attention as kernels  # noqa: E402

POINTERS = {"LSE": "fp32", "DELTA": "fp32", "NEIGHBOURS": "i32", "NEIGHBOURS_T": "i32", "OFFSETS": "i32",
            "DGK_PART": "fp32", "DGV_PART": "fp32", "DGB_PART": "fp32", "DRB_PART": "fp32"}
TENSORS = {"Q", "K", "V", "GK", "GV", "O", "DO", "DQ", "DK", "DV", "REL_BIAS", "GLOBAL_BIAS"}
FLOATS = {"qk_scale", "scale"}
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


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
    """(dtype, head_dim, window, exact) to compile; each with globals and both bias tables."""
    if args.all:
        return list(itertools.product(DTYPES, kernels.HEAD_DIMS, (3, 7, 12), (0, 1)))
    if args.variant:
        return [(dtype, int(d), int(w), int(e)) for dtype, d, w, e in (v.split(",") for v in args.variant)]
    return [("bfloat16", 32, 7, 0), ("float16", 64, 7, 1), ("float32", 48, 3, -1)]


def compile_variant(arch, dtype, head_dim, window, exact):
    """Compile the four kernels for every candidate tile shape; yields (kernel, shape, shared bytes)."""
    geo = kernel_geometry(14, 14, window, exact, 0, 1, "cpu")
    precision = "tf32x3" if dtype == "float32" else "tf32"
    base = dict(W=window, C=geo.chunk, P=geo.chunk_pad, DIL=1, EXACT=exact, N_OFF=geo.num_slots, HEAD_DIM=head_dim,
                BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_G=16, BT=max(16, triton.next_power_of_2(4 * window - 1)),
                HAS_GLOBAL=True, HAS_REL_BIAS=True, HAS_GLOBAL_BIAS=True, DOT_PRECISION=precision, BLOCK_N=64)
    target = GPUTarget("cuda", arch, 32)
    jobs = [(kernels._bwd_delta_kernel, None)] + [
        (kernel, shape) for shape in kernels._tile_shapes(geo.chunk_pad)
        for kernel in (kernels._fwd_kernel, kernels._bwd_dkdv_kernel, kernels._bwd_dq_kernel)
    ]
    for kernel, shape in jobs:
        constants = dict(base, **({} if shape is None else dict(BQI=shape[0], BKI=shape[1])))
        constants = {name: value for name, value in constants.items() if name in kernel.arg_names}
        source = triton.compiler.ASTSource(fn=kernel, signature=signature(kernel, constants, DTYPES[dtype]),
                                           constexprs=constants)
        warps = 4 if shape is None else kernels.num_warps(shape[0], geo.chunk_pad)
        compiled = triton.compile(source, target=target, options={"num_warps": warps})
        yield kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, shape, compiled.metadata.shared


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities, e.g. 80 90")
    p.add_argument("--all", action="store_true", help="every dtype, head dim and chunk tile size")
    p.add_argument("--variant", nargs="+", help="dtype,head_dim,window,exact, e.g. bfloat16,32,7,0")
    args = p.parse_args(argv)
    print("| arch | dtype | head_dim | w | SW_EXACT | kernel | tile (query rows, key rows) | shared memory (KiB) |")
    print("|---|---|---|---|---|---|---|---|")
    failures = 0
    for arch, (dtype, head_dim, window, exact) in itertools.product(args.arch, variants(args)):
        try:
            for name, shape, shared in compile_variant(arch, dtype, head_dim, window, exact):
                print(f"| sm_{arch} | {dtype} | {head_dim} | {window} | {exact} | {name} | {shape or ''} | {shared / 1024:.1f} |",
                      flush=True)
        except Exception as error:  # report every failing variant, then fail
            failures += 1
            print(f"| sm_{arch} | {dtype} | {head_dim} | {window} | {exact} | FAILED: {str(error).splitlines()[-1][:150]} | | |")
    if failures:
        sys.exit(f"{failures} variant(s) did not compile.")


if __name__ == "__main__":
    main()
