"""The weights a run starts from or a tool evaluates: ``MODEL.MODEL_PATH`` resolved to a checkpoint file (a path,
the same path under ``DATA.DATA_DIR``, or a pretrained tag) and loaded into a model.

Kept apart from :mod:`vil.checkpoint` (reading and writing checkpoint files), which the models import: this needs
the models, for their pretrained tags and the conversion of position tables."""

import logging
import os

from .checkpoint import ema_state, load_model_state, model_state, read_checkpoint, recorded_classes, stored_config
from .config import config_value
from .model_config import mechanism_of
from .models import pretrained_checkpoint
from .models.convert import MODEL_DEFINING_KEYS, fit_to_model, infer_image_size, trained_with

log = logging.getLogger("vil")


def resolve_model_path(cfg):
    """``MODEL.MODEL_PATH`` (a checkpoint file, a ``.safetensors`` file or a Hub folder); when that does not exist,
    the same path under ``DATA.DATA_DIR`` (as the original release looked it up), or the checkpoint of a pretrained
    tag (``vil_small.in1k``), downloaded once."""
    path = cfg.MODEL.MODEL_PATH
    for candidate in (path, os.path.join(cfg.DATA.DATA_DIR, path)):
        if path and os.path.exists(candidate):
            return candidate
    downloaded = pretrained_checkpoint(path)
    if downloaded:
        return downloaded
    raise FileNotFoundError(
        f"Checkpoint {path} does not exist (nor under DATA.DATA_DIR {cfg.DATA.DATA_DIR}), and is "
        "not a pretrained tag (timm.list_pretrained('vil*') lists them)."
    )


def load_weights(model, cfg, new_classifier=False):
    """Load the weights of ``MODEL.MODEL_PATH`` (this project's checkpoint, the original release's, a bare state
    dict; its EMA weights with ``MODEL.LOAD_EMA``) into ``model``, position tables resized to the model's image
    size. ``new_classifier``: a run starts from these weights (fine-tuning); a classifier of another class count
    stays the model's fresh one, and a checkpoint trained with other :data:`MODEL_DEFINING_KEYS` values is used
    with the config's, both said in the log. Otherwise (evaluating, predicting, exporting) both are refused in one
    sentence, with the rest of a checkpoint that does not fit."""
    path, checkpoint = read_model_checkpoint(cfg)
    load_read_weights(model, cfg, path, checkpoint, cfg.MODEL.LOAD_EMA, new_classifier)
    return path


def read_model_checkpoint(cfg):
    """``(path, checkpoint dict)`` of ``MODEL.MODEL_PATH``."""
    path = resolve_model_path(cfg)
    return path, read_checkpoint(path)


def check_trained_classes(checkpoint, path, classes):
    """Refuse data whose classes (names in label order) are the checkpoint's training classes in another order, or
    share a class with them under another label: its labels would be scored against the wrong outputs. Classes named
    otherwise (another naming of the same labels, say) are scored label by label, said once in the log. A checkpoint
    that records no classes is not checked, nor one of another class count (its classifier is refused, or replaced
    when fine-tuning)."""
    trained = recorded_classes(checkpoint)
    if trained is None or len(trained) != len(classes) or trained == list(classes):
        return
    first = next(i for i, (a, b) in enumerate(zip(trained, classes)) if a != b)
    theirs, ours = trained[first], classes[first]
    if sorted(trained) == sorted(classes):
        raise ValueError(
            f"Checkpoint {path} was trained with the same classes in another order: its label {first} is {theirs!r}, "
            f"the data's {ours!r}; set DATA.CLASSES to the checkpoint's order (its 'classes' entry)."
        )
    moved = next((i for i, name in enumerate(classes) if name in trained and trained.index(name) != i), None)
    if moved is not None:
        name = classes[moved]
        raise ValueError(
            f"Checkpoint {path} was trained with class {name!r} as its label {trained.index(name)}, but the data "
            f"labels it {moved}, so it would be scored against another class's output; set "
            "DATA.CLASSES so that the classes both have keep the checkpoint's labels (its 'classes' entry)."
        )
    log.warning(
        f"Checkpoint {path} was trained on classes named otherwise than the data's (its label {first} is {theirs!r}, "
        f"the data's {ours!r}); the data's labels are scored as the checkpoint's labels of the same number."
    )


def _check_classifier_parts(head, path):
    """Refuse, naming them, classifier entries (``head``: name -> shape) that are not a linear classifier's: names
    other than head.weight and head.bias, or one of the two without the other. (A classifier of another class count
    may be replaced; one that is not a classifier is another model's, or a damaged file.)"""
    parts = {"head.weight", "head.bias"}
    odd, missing = sorted(set(head) - parts), sorted(parts - set(head)) if head else []
    if odd or missing:
        found = f"{', '.join(odd)}, which" if odd else f"no {', '.join(missing)}, which"
        raise ValueError(
            f"Checkpoint {path} has {found} a linear classifier (head.weight and head.bias) "
            f"{'does not have' if odd else 'needs'}; use a checkpoint of a ViL classification model."
        )
    if head and (
        len(head["head.weight"]) != 2 or len(head["head.bias"]) != 1 or head["head.weight"][0] != head["head.bias"][0]
    ):
        raise ValueError(
            f"Checkpoint {path} has a head.weight of shape {tuple(head['head.weight'])} and a head.bias of shape "
            f"{tuple(head['head.bias'])}, which are not a linear classifier's (classes x features and classes); use "
            "a checkpoint of a ViL classification model."
        )


def _listed(differences):
    return ", ".join(f"{key} {saved!r} (now {now!r})" for key, (saved, now) in differences.items())


def _other_mechanism(stored, cfg):
    """``{"MODEL.VIT.MSVIT.ATTN_TYPE": (the ``stored`` config's, cfg's)}`` where the two name different attention
    mechanisms (whose layers have other parameters; backends of one mechanism share them), else ``{}``."""
    key = "MODEL.VIT.MSVIT.ATTN_TYPE"
    if stored is None:
        return {}
    then, now = config_value(stored, key), config_value(cfg, key)
    mechanisms = mechanism_of(then), mechanism_of(now)
    differ = None not in mechanisms and mechanisms[0] != mechanisms[1]  # a name this version does not know: not said
    return {key: (then, now)} if differ else {}


def _and_its_classes(checkpoint, head):
    """For the refusal of a classifier of another class count: the classes the checkpoint records, where they are as
    many as its classifier's outputs (trained on some of the data's classes, it is evaluated on those alone)."""
    trained = recorded_classes(checkpoint)
    if trained is None or "head.weight" not in head or len(trained) != head["head.weight"][0]:
        return ""
    shown = ", ".join(repr(name) for name in trained[:10]) + (", ..." if len(trained) > 10 else "")
    return f" and DATA.CLASSES to the classes it was trained on ([{shown}])"


def load_read_weights(model, cfg, path, checkpoint, ema, new_classifier=False):
    """:func:`load_weights` of the checkpoint dict already read from ``path`` (its EMA weights with ``ema``)."""
    differences = trained_with(checkpoint, path, {key: config_value(cfg, key) for key in MODEL_DEFINING_KEYS})
    listed = _listed(differences)
    if differences and not new_classifier:
        raise ValueError(f"Checkpoint {path} was trained with {listed}; set those values to use it as it was trained.")
    stored = stored_config(checkpoint, path)
    chosen = (ema_state if ema else model_state)(checkpoint, path)
    try:
        state = fit_to_model(chosen, model, path)
    except ValueError:
        changed = {**differences, **_other_mechanism(stored, cfg)}
        if not changed:
            raise
        raise ValueError(
            f"Checkpoint {path} was trained with {_listed(changed)}, and its weights do not fit the model of the "
            "new values; set those values to use it."
        ) from None
    head = {k: v.shape for k, v in state.items() if k.startswith("head.")}
    _check_classifier_parts(head, path)
    if head != {k: v.shape for k, v in model.state_dict().items() if k.startswith("head.")}:
        found = f"a classifier for {head['head.weight'][0]} classes" if "head.weight" in head else "no classifier"
        if not new_classifier:
            raise ValueError(
                f"Checkpoint {path} has {found}, not one for the DATA.NUM_CLASSES {model.num_classes} classes of "
                f"this model; set DATA.NUM_CLASSES to its count{_and_its_classes(checkpoint, head)}, or fine-tune it "
                "(tools/train.py with MODEL.MODEL_PATH) for these classes."
            )
        log.info(f"Checkpoint {path} has {found}: this run trains a new one for DATA.NUM_CLASSES {model.num_classes}.")
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    load_model_state(model, state, path, may_miss=("head.",))
    say = log.info if new_classifier else log.warning  # a run trains on; figures at another size are others
    built = f"this model is built for {model.img_size[0]}x{model.img_size[1]}, its position tables resized"
    if stored is not None and (stored.INPUT.IMAGE_SIZE,) * 2 != tuple(model.img_size):
        say(f"Checkpoint {path} was trained on {stored.INPUT.IMAGE_SIZE}x{stored.INPUT.IMAGE_SIZE} images; {built}.")
    elif stored is None:  # the original release's layout, a bare state dict: its tables tell the maps they were for
        made_for = infer_image_size(chosen, model.stage_specs)
        if made_for not in (None, infer_image_size(model.state_dict(), model.stage_specs)):
            say(f"Checkpoint {path} holds position tables made for {made_for[0]}x{made_for[1]} images; {built}.")
    if differences:  # said once the weights fit
        log.warning(
            f"Checkpoint {path} was trained with {listed}: this run starts from its weights with the new values."
        )
