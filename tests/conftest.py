"""Test-session setup: the Triton kernels run under Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when kernels are defined, so it is set here, before anything imports them. The
interpreter also checks every 32-bit integer operation for overflow, which makes it several times slower;
the test problems are far too small to overflow, so that check is switched off.
"""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from triton.runtime import interpreter
except ImportError:  # no triton: its tests say so
    interpreter = None

if interpreter is not None and hasattr(interpreter, "interpreter_builder"):
    options = interpreter.interpreter_builder.options
    if hasattr(options, "sanitize_overflow"):
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
