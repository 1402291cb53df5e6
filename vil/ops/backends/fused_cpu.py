"""The fused CPU kernels of ``kernels/local_attention_cpu.cpp``: one query chunk (2D) or block (1D) at a time, its
scores in cache.

The C++ source is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and the ``ninja``
package; the build is cached by torch, under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), for the
x86-64 level of the CPU, and with AVX512-BF16 where it has it (one build name per target, see ``_builds``). The
forward saves q, k, v, the output and the log-sum-exp; the backward recomputes the scores, so training memory
grows with tokens x head_dim, as with ``chunk_rows``. The 1D kernels also write k and v once per call into the
layouts their products read (as large as k and v, in the products' dtype), freed when the call returns; their
backward sums the key and value gradients of one residue class at a time per thread in float32 (for half-precision
inputs, two of the class's length x head_dim; four with half-precision products).

q, k and v go in as they come (strided views of the projections included, as long as the elements of a token are
contiguous) and in their dtype, so nothing of q's size is cast or copied around the kernels. Their matrix products
run one of two ways:

- **half precision** (bfloat16, and float16 where the CPU multiplies it): the products read the half-precision
  values and sum in float32 on the CPU's matrix instructions (torch's ``brgemm`` micro-kernel, oneDNN's: AMX tiles
  where the CPU has them, AVX512-BF16 dot products otherwise); scores, softmax and every sum stay float32;
- **float32** (float64 for float64): everything else, and half precision on CPUs without such instructions or
  whose instructions are not fast enough to pay (below), converted to float32 as the kernel copies a chunk into its
  buffers.

``VIL_FUSED_CPU_PRODUCTS`` chooses: ``auto`` (the default: half precision wherever the CPU has the instructions for
the dtype and multiplies it at least ``HALF_RATE_THAT_PAYS`` times as fast as float32, which the instructions alone
do not tell: an Intel Xeon whose hypervisor hides its AMX tiles multiplies bfloat16 on AVX512-BF16 at half float32's
rate), ``half`` (half precision, or one sentence saying why this CPU cannot) or ``float32``. Which instructions
oneDNN uses for the half-precision products can be capped with its own ``ONEDNN_MAX_CPU_ISA`` (e.g.
``AVX512_CORE_BF16`` on a CPU with AMX), set before the process starts. The first half-precision call of a process
checks the products against float32 ones on a small problem; if they disagree, it says so once and computes in
float32.
"""

import logging
import os
import platform
import subprocess
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import Optional

import torch

from ...cpu import cpu_multiplies_natively, half_precision_rate
from ..base import LOG2E, Backend, Extras, FusedPasses, compute_dtype, kept_tables
from ..geometry import neighbour_table
from ..neighborhood import Neighborhood2d

_log = logging.getLogger(__name__)
# The x86-64 level the loops are compiled for, by the capability torch detects on this CPU.
_X86_LEVELS = {"AVX2": "x86-64-v3", "AVX512": "x86-64-v4"}
# The compiler flags of every build, to which _builds adds the instruction set; the last two let the loops vectorise.
COMPILER_FLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
PRODUCTS_VARIABLE = "VIL_FUSED_CPU_PRODUCTS"
PRODUCTS = ("auto", "half", "float32")
# How much faster than float32 the CPU must multiply a half-precision dtype (vil.cpu.half_precision_rate) for the
# kernels' half-precision products to win, which copy their operands into layouts of their own: at 2.2x (an AMD
# EPYC's bfloat16) they took 0.56x-0.68x of the float32 products' time, at 1.0x (an Intel Xeon's float16) 1.3x-1.7x
# and at 0.53x (its bfloat16) 1.3x-1.6x (BENCHMARKS.md). A rate near 1 is a coin toss between processes; 1.5 is not.
HALF_RATE_THAT_PAYS = 1.5
HALF_DTYPES = (torch.bfloat16, torch.float16)


def _kernels():
    """The ``torch.ops`` namespace of the C++ kernels; ``ValueError`` with one sentence where they cannot be built."""
    built = _build()
    if isinstance(built, str):
        raise ValueError(built)
    return built


@cache
def _build():
    """Builds the C++ kernels (or loads torch's cached build) once per process. Returns their ``torch.ops``
    namespace, or the sentence that says why they cannot be built: a failed build is not tried again."""
    try:
        source = kernel_source()
        cpp_logger = logging.getLogger("torch.utils.cpp_extension")
        level = cpp_logger.level
        cpp_logger.setLevel(logging.ERROR)  # its import warns about CUDA_HOME, which a CPU build does not use
        try:
            from torch.utils import cpp_extension
        finally:
            cpp_logger.setLevel(level)
    except ImportError as error:
        return _build_failure(error)

    builds = _builds(COMPILER_FLAGS)
    _log.info("fused_cpu: loading the C++ kernel (compiled on first use, then cached by torch).")
    for (name, build_flags, target), following in zip(builds, builds[1:] + [None]):
        try:
            cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=build_flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
            return torch.ops.vil_local_attention_cpu
        except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as error:  # the last: a compiler
            failure = error  # that fails torch's check of its version
            if following is not None:
                _log.warning("fused_cpu: the build for %s failed; building for %s instead.", target, following[2])
    return _build_failure(failure)


def kernel_source():
    """The path of the C++ kernels' source (``kernels/local_attention_cpu.cpp``)."""
    import vil_kernels

    return Path(vil_kernels.__file__).with_name("local_attention_cpu.cpp")


def _builds(flags):
    """The builds to try, best first: (name, compiler flags, the CPUs it is for). Each has its own name, so that a
    build cache shared with other CPUs never hands them a build for instructions they lack."""
    builds = [("vil_local_attention_cpu", flags, "any CPU of this kind")]
    x86_level = _X86_LEVELS.get(torch.backends.cpu.get_cpu_capability())
    if platform.machine() not in ("x86_64", "AMD64") or not x86_level:
        return builds
    # The vector width of the softmax loops (BLAS picks its own); older compilers lack the level's name.
    name, level_flags = f"vil_local_attention_cpu_{x86_level.replace('-', '_')}", flags + [f"-march={x86_level}"]
    builds.insert(0, (name, level_flags, x86_level))
    if x86_level == "x86-64-v4" and torch.cpu._is_avx512_bf16_supported():
        # Rounds to bfloat16 with the one conversion instruction of AVX512-BF16.
        builds.insert(0, (f"{name}_bf16", level_flags + ["-mavx512bf16"], f"{x86_level} with AVX512-BF16"))
    return builds


def _scored_pairs(q, hood, num_global):
    """The (query, key) scores the 2D kernel computes, per batch item: in every head, every real query of a chunk
    against the real keys of the chunks its slots read (SW_EXACT 1 masks some of them afterwards) and the global
    keys. (The op runs dilated windows per sub-lattice, so the dilation is 1.)"""
    H, X, Y = q.shape[1:4]
    window = hood.window
    mx, my = -(-X // window), -(-Y // window)
    rows = (X - window * torch.arange(mx)).clamp(max=window)
    cols = (Y - window * torch.arange(my)).clamp(max=window)
    tokens = (rows[:, None] * cols[None, :]).flatten()  # per chunk, row-major
    neighbour = _slot_table(X, Y, window, hood.exact, hood.mode)[..., 0]
    keys = torch.where(neighbour >= 0, tokens[neighbour.clamp(min=0)], 0).sum(1) + num_global
    return H * int((tokens * keys).sum())


def _scored_pairs_1d(q, hood, num_global):
    """The (query, key) scores the 1D kernel computes, per batch: every query of a block against the span of keys
    its block's windows cover, from an even position (the band and the masks apply afterwards), and the global keys."""
    H, L = q.shape[1:3]
    window, causal, block = hood.window, hood.causal, _block_1d(hood.window, _multiplies_in_half(q))
    pairs = 0
    for d in hood.dilations(H):
        for r in range(min(d, L)):
            n = -(-(L - r) // d)  # the length of residue class r
            t0 = torch.arange(0, n, block)
            queries = (n - t0).clamp(max=block)
            keys = (t0 + queries + (0 if causal else window)).clamp(max=n) - (t0 - window).clamp(min=0) // 2 * 2
            pairs += int((queries * (keys + num_global)).sum())
    return pairs


def _build_failure(error):
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"The fused_cpu backend could not build its C++ kernel ({first_line}); it needs a C++ compiler and the "
        "ninja package, or choose another backend such as sliding_chunk."
    )


@torch.compiler.assume_constant_result  # built, or not, once per process: torch.compile need not trace the build
def _build_failure_sentence():
    built = _build()
    return built if isinstance(built, str) else ""


def check_fused_cpu():
    """Raise ``ValueError`` with one sentence if the kernel cannot be built here."""
    failure = _build_failure_sentence()
    if failure:
        raise ValueError(failure)


@kept_tables(64)
def _slot_table(rows, cols, window, exact, mode):
    """(C, n, 3) int64: for each chunk (row-major) and neighbour slot, the chunk read (-1: none) and the slot's
    chunk offset (a, b)."""
    table, _, offsets = neighbour_table(-(-rows // window), -(-cols // window), exact, mode)
    return torch.cat([table[..., None], offsets.expand(table.shape[0], -1, -1)], dim=-1)


# Set by the check of half-precision products, which runs the passes both ways; else half_products decides.
_forced_products: ContextVar[Optional[bool]] = ContextVar("fused_cpu_forced_products", default=None)


def _multiplies_in_half(q):
    forced = _forced_products.get()
    return half_products(q.dtype) if forced is None else forced


def half_products(dtype: torch.dtype) -> bool:
    """Whether the kernels multiply ``dtype`` inputs in half precision on the CPU's matrix instructions (else in
    float32), as ``VIL_FUSED_CPU_PRODUCTS`` and the CPU decide."""
    choice = os.environ.get(PRODUCTS_VARIABLE, "auto")
    if choice not in PRODUCTS:
        raise ValueError(f"{PRODUCTS_VARIABLE} must be one of {', '.join(PRODUCTS)}, got {choice!r}.")
    if dtype not in HALF_DTYPES or choice == "float32":
        return False
    missing = half_products_missing(dtype)
    if missing and choice == "half":
        raise ValueError(f"{PRODUCTS_VARIABLE}=half asks for {_name(dtype)} products, but {missing}; unset it.")
    return not missing and (choice == "half" or half_products_pay(dtype))


@cache
def half_products_pay(dtype):
    """Whether this CPU multiplies ``dtype`` at least ``HALF_RATE_THAT_PAYS`` times as fast as float32
    (``vil.cpu.half_precision_rate``), which ``auto`` asks before it multiplies in half precision; where it does not,
    it says so once (as info: the float32 products it takes instead are the faster ones)."""
    rate = half_precision_rate(dtype)
    pays = rate >= HALF_RATE_THAT_PAYS
    if not pays:
        _log.info(
            "fused_cpu: this CPU multiplies %s at %.2fx the rate of float32 (under %sx), so the kernels multiply %s "
            "inputs in float32 (%s=half multiplies them in %s).",
            _name(dtype),
            rate,
            HALF_RATE_THAT_PAYS,
            _name(dtype),
            PRODUCTS_VARIABLE,
            _name(dtype),
        )
    return pays


def _name(dtype):
    return str(dtype).split(".")[-1]


@cache
def half_products_missing(dtype):
    """Why this process cannot multiply ``dtype`` in half precision (a clause), or "" where it can. Checked once; a
    micro-kernel that fails or disagrees with float32 products is said once, as a warning."""
    if not cpu_multiplies_natively(dtype):
        instructions = "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AVX512-FP16 or AMX-FP16"
        return f"this CPU has no {_name(dtype)} matrix instructions ({instructions})"
    fault = half_products_fault(dtype)
    if fault:
        _log.warning("fused_cpu: %s; computing %s in float32 instead.", fault, _name(dtype))
    return fault


# How far half-precision products may be from float32 ones on the check's problem: the probabilities and score
# gradients are rounded to bfloat16 (8 significant bits) there, 6e-3 on this problem; a layout that the micro-kernel
# reads otherwise is off by the size of the values.
AGREEMENT = 0.05


def half_products_fault(dtype: torch.dtype) -> str:
    """What is wrong with half-precision products of ``dtype`` here (a clause), or "": their outputs and gradients
    against float32 ones on a small 2D problem with a global key and both bias tables (head_dim 40 and chunks of up to
    81 keys: the layouts' 16 x 16 blocks, their tails and padding)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 7, 9, 40, generator=gen).to(dtype) for _ in range(4))
    global_k, global_v = (torch.randn(1, 2, 1, 40, generator=gen).to(dtype) for _ in range(2))
    extras = Extras(
        0.25, global_k.float(), global_v.float(), torch.randn(2, 121, generator=gen), torch.randn(2, 1, generator=gen)
    )
    hood = Neighborhood2d(3)
    try:
        results = [_check_problem(q, k, v, hood, extras, grad_out, half) for half in (False, True)]
    except RuntimeError as error:
        return f"torch's {_name(dtype)} micro-kernel fails here ({str(error).strip().splitlines()[0]})"
    error = max(
        float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1))
        for got, want in zip(results[1], results[0])
    )
    if not error <= AGREEMENT:  # NaN too
        return f"its {_name(dtype)} products disagree with float32 ones on this CPU (relative error {error:.2g})"
    return ""


def _kernel_inputs(q, extras, half):
    """What the kernels take: the global keys and values in q's dtype (half-precision products) or the compute
    dtype, empty where absent; the bias tables in base 2, in the compute dtype."""
    global_k, global_v, rel_bias, global_bias = extras.differentiable
    compute = compute_dtype(q)
    kernel_global = q.dtype if half else compute
    if global_k is None:
        global_k = global_v = q.new_empty(*q.shape[:2], 0, q.shape[-1], dtype=kernel_global)
    global_k, global_v = (t.to(kernel_global).contiguous() for t in (global_k, global_v))
    biases = [
        q.new_empty(0, dtype=compute) if t is None else (t * LOG2E).to(compute).contiguous()
        for t in (rel_bias, global_bias)
    ]
    return global_k, global_v, biases


def _outputs(q):
    """The output, laid out as q is (a head view of a (B, L, heads * head_dim) projection gives an output that is
    such a view too, with no copy to go back), and the log-sum-exp of every query (in the compute dtype)."""
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=compute_dtype(q))


def _gradient_buffers(q, k, v):
    """The gradients of q, k and v to fill, each laid out as its input is; the kernels write every element (they
    sum k's and v's from zero, in the compute dtype)."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sums(q, shape):
    """Zeroed sums of ``shape`` in the compute dtype, which the backward kernels add gradients into; empty for None
    (an absent input)."""
    return q.new_empty(0, dtype=compute_dtype(q)) if shape is None else q.new_zeros(shape, dtype=compute_dtype(q))


def _token_rows(t):
    """t as the kernels read it: the elements of each token contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward_2d(q, k, v, hood, extras):
    half = _multiplies_in_half(q)
    slots = _slot_table(q.shape[2], q.shape[3], hood.window, hood.exact, hood.mode)
    global_k, global_v, biases = _kernel_inputs(q, extras, half)
    out, lse = _outputs(q)
    _kernels().forward(
        q, k, v, global_k, global_v, *biases, slots, out, lse, hood.window, hood.exact, extras.scale, half
    )
    return out, lse


def _backward_2d(q, k, v, hood, extras, out, lse, grad_out):
    half = _multiplies_in_half(q)
    B, H, X, Y = q.shape[:4]
    slots = _slot_table(X, Y, hood.window, hood.exact, hood.mode)
    rel_bias, global_bias, has_global = extras.rel_bias, extras.global_bias, extras.num_global > 0
    global_k, global_v, biases = _kernel_inputs(q, extras, half)
    grad_q, grad_k, grad_v = _gradient_buffers(q, k, v)
    grad_global_k, grad_global_v = (_sums(q, global_k.shape) for _ in range(2))
    # Per (batch, head) partial sums of the bias gradients, added up here.
    grad_rel = _sums(q, None if rel_bias is None else (B, H, rel_bias.shape[1]))
    grad_glob = _sums(q, None if global_bias is None else (B, H, global_bias.shape[1]))
    _kernels().backward(
        q,
        k,
        v,
        global_k,
        global_v,
        *biases,
        slots,
        out,
        _token_rows(grad_out),
        lse,
        grad_q,
        grad_k,
        grad_v,
        grad_global_k,
        grad_global_v,
        grad_rel,
        grad_glob,
        hood.window,
        hood.exact,
        extras.scale,
        half,
    )
    return (
        grad_q,
        grad_k,
        grad_v,
        grad_global_k if has_global else None,
        grad_global_v if has_global else None,
        None if rel_bias is None else grad_rel.sum(0),
        None if global_bias is None else grad_glob.sum(0),
    )


def _block_1d(window, half):
    """Queries per block of the 1D kernel, with half-precision products (``half``) or float32 ones. Larger blocks
    make larger products, but score more keys outside the band (a block of n queries scores n + 2w keys per query,
    of which 2w + 1 are in its window) in a larger score matrix. The kernel reads each block's keys from layouts
    written once per call and adds its key and value gradients in place, so that smaller blocks copy nothing more.
    Half-precision products run fastest on blocks of 16, whose scores stay in the core's first-level cache; BLAS's
    float32 products on blocks of 32 (BENCHMARKS.md, "The 1D backward's key and value gradients added in place")."""
    return 16 if half else min(32, max(16, window))


def _masks_1d(q, key_padding_mask):
    return q.new_empty(0, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.contiguous()


def _forward_1d(q, k, v, hood, extras):
    half = _multiplies_in_half(q)
    global_k, global_v, biases = _kernel_inputs(q, extras, half)
    out, lse = _outputs(q)
    _kernels().forward_1d(
        q,
        k,
        v,
        global_k,
        global_v,
        *biases,
        _masks_1d(q, extras.key_padding_mask),
        out,
        lse,
        hood.dilations(q.shape[1]),
        hood.window,
        hood.causal,
        _block_1d(hood.window, half),
        extras.scale,
        half,
    )
    return out, lse


def _backward_1d(q, k, v, hood, extras, out, lse, grad_out):
    half = _multiplies_in_half(q)
    B, H, L = q.shape[:3]
    dilations = hood.dilations(H)
    rel_bias, global_bias, has_global = extras.rel_bias, extras.global_bias, extras.num_global > 0
    global_k, global_v, biases = _kernel_inputs(q, extras, half)
    grad_q, grad_k, grad_v = _gradient_buffers(q, k, v)
    # Per (batch, head, residue class) partial sums of the global key, value and bias gradients, added up here.
    residues = max(min(d, L) for d in dilations)
    grad_global_k, grad_global_v = (_sums(q, (B, H, residues, *global_k.shape[2:])) for _ in range(2))
    grad_rel = _sums(q, None if rel_bias is None else (B, H, residues, rel_bias.shape[1]))
    grad_glob = _sums(q, None if global_bias is None else (B, H, residues, global_bias.shape[1]))
    _kernels().backward_1d(
        q,
        k,
        v,
        global_k,
        global_v,
        *biases,
        _masks_1d(q, extras.key_padding_mask),
        out,
        _token_rows(grad_out),
        lse,
        grad_q,
        grad_k,
        grad_v,
        grad_global_k,
        grad_global_v,
        grad_rel,
        grad_glob,
        dilations,
        hood.window,
        hood.causal,
        _block_1d(hood.window, half),
        extras.scale,
        half,
    )
    return (
        grad_q,
        grad_k,
        grad_v,
        grad_global_k.sum(2) if has_global else None,
        grad_global_v.sum(2) if has_global else None,
        None if rel_bias is None else grad_rel.sum((0, 2)),
        None if global_bias is None else grad_glob.sum((0, 2)),
    )


def _check_problem(q, k, v, hood, extras, grad_out, half):
    """The output and every gradient of one 2D problem, through the passes with half-precision products or not."""
    forced = _forced_products.set(half)
    try:
        out, lse = _forward_2d(q, k, v, hood, extras)
        return (out, *_backward_2d(q, k, v, hood, extras, out, lse, grad_out))
    finally:
        _forced_products.reset(forced)


def _as_the_kernels_read(q, k, v, hood, extras):
    """q, k and v as they come (each token's elements contiguous); the small inputs in the compute dtype (the
    kernels read the global keys and values in q's dtype again for half-precision products)."""
    compute = compute_dtype(q)
    return _token_rows(q), _token_rows(k), _token_rows(v), extras.cast(lambda t: t.to(compute).contiguous())


BACKEND = Backend(
    "fused_cpu",
    passes_2d=FusedPasses(_forward_2d, _backward_2d, _scored_pairs),
    passes_1d=FusedPasses(_forward_1d, _backward_1d, _scored_pairs_1d),
    prepare=_as_the_kernels_read,
    extras_in_float32=True,
    twice_differentiable=False,
    function_transforms=False,
    dilation_2d="split",
    per_head_dilation=True,
    devices=("cpu",),
    trains_on=("cpu",),
    available=check_fused_cpu,
)
