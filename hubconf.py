"""torch.hub's entry points, one per registered model (each is its timm registration: ``pretrained``, then timm's
keyword arguments): ``torch.hub.load("OWNER/REPO", "vil_small", pretrained=True)``, or from a checkout,
``torch.hub.load("path/to/checkout", "vil_small", source="local")``."""

import importlib.util
import os
import sys


def _kernels_of_this_checkout():
    """``kernels/`` as ``vil_kernels``, the name vil imports it by, where pip has not installed the project (a
    checkout that torch.hub downloaded, or one given by path): pip's install maps the name to that folder."""
    if importlib.util.find_spec("vil_kernels") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
    spec = importlib.util.spec_from_file_location(
        "vil_kernels", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    sys.modules["vil_kernels"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_kernels_of_this_checkout()

import timm  # noqa: E402

import vil  # noqa: E402, F401  (registers the models with timm)

dependencies = ["torch", "torchvision", "timm", "yacs", "safetensors"]

# Every registered model by its name: torch.hub lists the public functions of this module (nothing else here is one).
globals().update({name: timm.models.model_entrypoint(name) for name in timm.list_models("vil_*")})
