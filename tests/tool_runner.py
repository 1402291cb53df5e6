"""The command-line tools under ``tools/``, loaded as modules and run in this process: a fresh interpreter per
run would spend seconds importing torch before the tool does anything."""

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name):
    """``tools/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(name, *args):
    """``python tools/<name>.py args...`` in this process: (exit status, stdout, stderr). A ``sys.exit`` message
    goes to stderr with status 1, as the interpreter would print it."""
    tool = load_tool(name)
    out, err, status = io.StringIO(), io.StringIO(), 0
    argv, sys.argv = sys.argv, [str(ROOT / "tools" / f"{name}.py"), *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            tool.main()
    except SystemExit as done:
        if isinstance(done.code, str):
            err.write(done.code + "\n")
            status = 1
        else:
            status = done.code or 0
    finally:
        sys.argv = argv
    return status, out.getvalue(), err.getvalue()
