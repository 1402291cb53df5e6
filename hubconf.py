"""torch.hub's entry points, one per registered model (each is its timm registration: ``pretrained``, then timm's
keyword arguments): ``torch.hub.load("OWNER/REPO", "vil_small", pretrained=True)``, or from a checkout,
``torch.hub.load("path/to/checkout", "vil_small", source="local")``."""

import timm

import vil  # noqa: F401  (registers the models with timm)

dependencies = ["torch", "torchvision", "timm", "yacs", "safetensors"]

# Every registered model by its name: torch.hub lists the public functions of this module (nothing else here is one).
globals().update({name: timm.models.model_entrypoint(name) for name in timm.list_models("vil_*")})
