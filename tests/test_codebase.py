"""Rules the package keeps about its own shape, read from its source with ``ast``: no import cycle in ``vil/``
(imports inside functions included), no function with more than 8 parameters outside the boundaries where
arguments must travel flat; and the README's example of a new backend, which takes one file and one line."""

import ast
import types
from pathlib import Path

import pytest
import timm
import torch
from test_local_attention import make_inputs

from vil.ops import available_backends, local_attention_2d, registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vil"
MAX_PARAMETERS = 8


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    """{module name: (path, its syntax tree)} of every module of the package."""
    return {_module_name(path): (path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(name, path, tree, known):
    """The package's modules that ``name`` imports anywhere in its code, relative imports resolved; ``from X import
    y`` imports the module ``X.y`` where there is one, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known and module != name}


def _cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _imported(name, path, tree, modules) for name, (path, tree) in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_lazy_cycle():
    """The check above can fail: a lazy import inside a function closes a cycle it reports."""
    a = ast.parse("from . import b\n")
    b = ast.parse("def f():\n    from .a import x\n")
    known = {"vil.p.a", "vil.p.b"}
    graph = {
        "vil.p.a": _imported("vil.p.a", PACKAGE / "p" / "a.py", a, known),
        "vil.p.b": _imported("vil.p.b", PACKAGE / "p" / "b.py", b, known),
    }
    assert _cycle(graph) == ["vil.p.a", "vil.p.b", "vil.p.a"]


# Where arguments must be flat: torch.library's custom operators and their fake, autograd and FLOP-counter
# registrations take tensors, not values holding them; the public functions and model constructors keep the
# keyword arguments their users and timm pass.
FLAT_BY_NECESSITY = {
    "vil/ops/operators.py": "custom operators and their registrations",
    "vil/ops/local_attention.py:local_attention_2d": "the public op, called with keyword arguments",
    "vil/ops/local_attention.py:local_attention_1d": "the public op, called with keyword arguments",
    "vil/models/msvit.py:MsViT.__init__": "timm's create_model passes the model's keyword arguments",
    "vil/detection.py:build_fpn_backbone": "the public backbone builder, called with keyword arguments",
}


def _parameters(function):
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args]
    count = len(names) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (names[:1] in (["self"], ["cls"], ["ctx"]))


def _functions(tree, prefix=""):
    """(qualified name, node) of every function of a module, methods as ``Class.method``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def test_no_function_takes_more_than_eight_parameters():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for name, node in _functions(ast.parse(path.read_text())):
            flat = where in FLAT_BY_NECESSITY or f"{where}:{name}" in FLAT_BY_NECESSITY
            if _parameters(node) > MAX_PARAMETERS and not flat:
                offenders.append(f"{where}:{node.lineno} {name} ({_parameters(node)})")
    assert not offenders, offenders


def _readme_backend():
    """The backend of the README's "Adding a backend", run as the module it shows."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Adding a backend") :]
    start = section.index("```python\n") + len("```python\n")
    module = types.ModuleType("dense")
    exec(compile(section[start : section.index("```\n", start)], "README.md", "exec"), module.__dict__)
    return module.BACKEND


@pytest.fixture
def dense(monkeypatch):
    """The README's backend, in the table as its line there puts it."""
    backend = _readme_backend()
    monkeypatch.setitem(registry.BACKENDS, backend.name, backend)
    return backend


@pytest.mark.parametrize("exact,mode,dilation", [(0, 0, 1), (-1, 3, 1), (1, 0, 2), (0, -1, 1)])
def test_the_readme_backend_computes_the_reference(dense, exact, mode, dilation):
    assert dense.name in available_backends(2)
    inputs = make_inputs(7, 9, 2, 1, rel=True, glob_bias=True, D=8)
    q, k, v, *optional = inputs.values()
    results = []
    for backend in ("reference", dense.name):
        window = dict(exact=exact, mode=mode, dilation=dilation, backend=backend)
        out = local_attention_2d(q, k, v, 2, **window, **dict(zip(list(inputs)[3:], optional)))
        results.append((out, *torch.autograd.grad(out.square().sum(), list(inputs.values()))))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want)


def test_the_readme_backend_serves_timm_models_by_its_name(dense):
    torch.manual_seed(0)
    model = timm.create_model("vil_tiny", img_size=64, num_classes=3, attn_backend=dense.name).eval()
    reference = timm.create_model("vil_tiny", img_size=64, num_classes=3, attn_backend="reference").eval()
    reference.load_state_dict(model.state_dict())
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(images), reference(images), rtol=1e-5, atol=1e-5)
