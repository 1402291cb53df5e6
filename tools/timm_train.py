"""Train ViL with timm's own training script: ``python tools/timm_train.py path/to/timm/train.py --model vil_tiny
[timm's options, e.g. --torchcompile] DATA_DIR``.

timm's ``train.py`` (in the pytorch-image-models repository, not in the pip package) builds models by name from
timm's registry, and ViL's models are registered when ``vil`` is imported. This imports ``vil``, then runs the
script as ``python path/to/timm/train.py ...`` would, with the rest of the command line as its arguments.

With ``--model-ema``, the script's EMA (``timm.utils.ModelEmaV3``) averages a ViL model as ``tools/train.py``'s
does (:func:`vil.optim.model_ema`): each parameter once, buffers copied.
"""

import os
import runpy
import sys

import timm.utils

import vil  # noqa: F401  (registers vil_tiny, vil_small, ... with timm)
from vil.models import MsViT


class ModelEmaOfViL(timm.utils.ModelEmaV3):
    """timm's ``ModelEmaV3``, with ``exclude_buffers`` for ViL models and modules that hold one (timm's feature
    distillation averages the student with its projection): by default it averages every state-dict entry, and a
    shared weight (SHARE_W's ``query`` and ``query_global``) is two entries of one tensor, which would then move as
    if at decay d^2. Other models are averaged as timm does."""

    def __init__(self, model, *args, **kwargs):
        if any(isinstance(module, MsViT) for module in model.modules()):
            kwargs["exclude_buffers"] = True
        super().__init__(model, *args, **kwargs)


def use_vil_ema():
    """Puts ``ModelEmaOfViL`` wherever timm's ``train.py`` takes ``ModelEmaV3`` from: ``timm.utils`` (timm 1.0.26) and
    ``timm.task.task``, whose ``setup_ema`` builds the EMA from timm 1.0.27 on and imported the class by name."""
    try:
        import timm.task.task  # noqa: F401  (loaded now, so that its name is replaced too)
    except ImportError:  # timm before 1.0.27
        pass
    timms = ModelEmaOfViL.__base__
    for name, module in list(sys.modules.items()):
        if name.startswith("timm.") and getattr(module, "ModelEmaV3", None) is timms:
            module.ModelEmaV3 = ModelEmaOfViL


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    if not argv or not argv[0].endswith(".py"):
        sys.exit(
            "error: Give the path of timm's train.py first, then its arguments: "
            "python tools/timm_train.py path/to/timm/train.py --model vil_tiny DATA_DIR."
        )
    script = argv[0]
    if not os.path.isfile(script):
        sys.exit(
            f"error: {script} is not a file; give the path of train.py in a clone of timm "
            "(github.com/huggingface/pytorch-image-models)."
        )
    use_vil_ema()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python would, for the script's own imports
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
