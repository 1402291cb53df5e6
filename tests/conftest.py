"""Test-session setup: without a CUDA GPU, the Triton kernels run under Triton's CPU interpreter; with one, they
are compiled for it (``TRITON_INTERPRET=1`` forces the interpreter there too).

``TRITON_INTERPRET`` is read when kernels are defined, so it is set here, before anything imports them. It is not
set where CUDA is, because Inductor's own Triton kernels (compiled FlexAttention) would then run interpreted on
the GPU's tensors too. The interpreter also checks every 32-bit integer operation for overflow, which makes it
several times slower; the test problems are far too small to overflow, so that check is switched off.

With pytest-xdist's workers (``-n 2``, the README's command) each worker, and each process its tests start, takes
its share of the cores: a worker's torch threads on every core would wait for each other's.
"""

import dataclasses
import logging
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # the processes a test starts too: the same sums, to the bit
    torch.set_num_threads(_threads)

try:
    import triton.language as tl
    from triton.runtime import interpreter
except ImportError:  # no triton: its tests say so
    interpreter = None

if interpreter is not None and hasattr(interpreter, "_patch_lang_tensor"):
    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor_with_squeezed_index(tensor, scope):
        """A scalar is an array of shape (1,) in the interpreter, and a loop bound that is not a constexpr turns it
        into an int. Triton 3.6 does that with int(array), which NumPy 2.4 refuses; 3.7 squeezes the array first,
        as this does, so the kernels run under 3.6 (the triton of torch 2.10 and 2.11) too."""
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = _patch_lang_tensor_with_squeezed_index

if interpreter is not None and hasattr(interpreter, "interpreter_builder"):
    options = interpreter.interpreter_builder.options
    if hasattr(options, "sanitize_overflow"):
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


class _PatchLanguageOncePerLaunch:
    """The interpreter patches the ``triton.language`` modules a kernel sees with its own functions when the kernel
    launches (and restores them after), and again at every call of a device function inside the kernel, though
    they are patched already: a third of the interpreted kernels' time. This skips a device function's patch
    when every language module it sees has been patched in this launch."""

    def __init__(self):
        self.patched = None  # the language modules patched in the running launch; None: no launch
        self.real_patch = interpreter._patch_lang
        self.real_launch = interpreter.GridExecutor.__call__

    def patch(self, fn):
        seen = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if self.patched is not None and seen <= self.patched:
            return interpreter._LangPatchScope()
        scope = self.real_patch(fn)
        if self.patched is not None:
            self.patched |= seen
        return scope

    def launch(self, executor, *args, **kwargs):
        self.patched = set()
        try:
            return self.real_launch(executor, *args, **kwargs)
        finally:
            self.patched = None

    def install(self):
        interpreter._patch_lang = self.patch
        launch = self.launch
        interpreter.GridExecutor.__call__ = lambda executor, *args, **kwargs: launch(executor, *args, **kwargs)


if interpreter is not None and all(
    hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")
):
    _PatchLanguageOncePerLaunch().install()


@pytest.fixture(autouse=True)
def vil_logger_as_it_was():
    """Training and evaluation set the "vil" logger up for the rest of the process (handlers of their own, a level,
    no propagation to the root logger, where pytest before 9.1 has caplog listen): each test gets it back as it was,
    so that a test reading the log sees its messages whatever ran before it in the same worker."""
    logger = logging.getLogger("vil")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    for handler in [h for h in logger.handlers if h not in handlers]:
        logger.removeHandler(handler)
        handler.close()  # a run's log.txt
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


@pytest.fixture
def data(tmp_path):
    """An image folder of two classes, 6 training and 6 evaluation images each, and one unreadable training image."""
    from test_data import make_folder  # imports vil, which must come after TRITON_INTERPRET is set

    return make_folder(tmp_path / "data", per_class=6)


@pytest.fixture
def poisoned_triton_outputs(monkeypatch):
    """Every buffer the Triton kernels write starts as NaN (or the smallest integer), so that an element a kernel
    fails to write fails its test; the tile-shape cache starts empty, and on a GPU each pass takes its first
    candidate tile shape that fits the GPU, as the interpreter takes the first (tests that force a shape or time them
    say so)."""
    from vil_kernels import flash

    def poisoned(*shape, dtype=None, device=None):
        out = torch.empty(*shape, dtype=dtype, device=device)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(torch.iinfo(out.dtype).min)

    monkeypatch.setattr(flash, "new_output", poisoned)
    monkeypatch.setattr(flash, "_TUNED", {})
    monkeypatch.setattr(flash, "TUNE_TILES", False)


@pytest.fixture
def compiled_flex(monkeypatch):
    """FlexAttention compiled for every configuration a test asks for: dynamo's caches start empty, and a test
    that passes its recompile limit (after which torch runs flex_attention uncompiled) fails instead."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
