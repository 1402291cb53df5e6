"""The public API is annotated: every function exported by ``vil``, ``vil.ops``, ``vil.models`` and
``vil.detection``, and every public method and property the package defines on the classes they export, has an
annotation on each of its parameters (``self`` and ``cls`` aside; ``*args`` and ``**kwargs`` included) and a return
annotation (``__init__`` aside)."""

import inspect
from typing import Any

import vil
import vil.detection
import vil.models
import vil.ops

MODULES = (vil, vil.ops, vil.models, vil.detection)


def _unannotated(function, name):
    """``name(parameter)`` for every parameter of ``function`` without an annotation, and ``name -> ?`` when it has
    no return annotation."""
    signature = inspect.signature(function)
    missing = [
        f"{name}({p.name})"
        for i, p in enumerate(signature.parameters.values())
        if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))
    ]
    if signature.return_annotation is inspect.Signature.empty and not name.endswith(".__init__"):
        missing.append(f"{name} -> ?")
    return missing


def _methods(cls):
    """(name, function) of the constructor and the public methods and properties of ``cls`` that this package
    defines, on the class or on its bases (not those inherited from torch or timm), each as the class that defines
    it (the one ``cls`` uses) names it."""
    seen = set()
    for klass in cls.__mro__:
        for name, member in vars(klass).items():
            if name in seen or (name.startswith("_") and name != "__init__"):
                continue
            seen.add(name)
            if not klass.__module__.startswith("vil."):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member):
                yield f"{klass.__qualname__}.{name}", member


def _public_functions():
    """(name, function) of every exported function and of the methods of every exported class."""
    for module in MODULES:
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value):
                yield from _methods(value)
            elif inspect.isfunction(value) and value.__module__.split(".")[0] == "vil":
                yield f"{module.__name__}.{name}", value


def test_the_public_api_is_annotated():
    functions = dict(_public_functions())
    for expected in (
        "vil.accelerate_longformer",
        "vil.ops.local_attention_2d",
        "Neighborhood1d.offsets",
        "MsViT.forward_intermediates",
        "ViLBackbone.forward",
        "vil.models.vil_small",
        "vil.detection.build_fpn_backbone",
    ):
        assert expected in functions, expected
    missing = [m for name, function in functions.items() for m in _unannotated(function, name)]
    assert not missing, missing


def test_the_checker_finds_missing_annotations():
    def partly(x: int, y, *args, **kwargs: Any):
        return x

    assert _unannotated(partly, "partly") == ["partly(y)", "partly(args)", "partly -> ?"]
