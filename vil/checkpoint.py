"""Checkpoints: this project's and the original ViL release's.

Both are ``torch.save``d dicts whose key ``"net"`` holds the model's state dict (the original release's
layout, which this project's models share, so no conversion is needed); keys may carry the ``module.``
prefix of a DistributedDataParallel wrapper. This project adds ``"arch"`` (``MODEL.ARCH``, ``"msvit"``; the
arch string is in the stored ``"config"``), ``"epoch"`` and whatever else the trainer stores. A bare state dict
is accepted too, and so are a ``.safetensors`` file of one and a folder that holds ``model.safetensors`` (a
Hugging Face Hub folder, as ``tools/export_hub.py`` writes).
"""

import argparse
import json
import os
import warnings
import zipfile
from collections.abc import Mapping
from typing import Any, Optional, Union

import safetensors.torch
import torch
from yacs.config import CfgNode

from .config import config_from_model_arguments, config_from_text
from .files import SAFETENSORS_NAME, atomic_write

# A buffer the original release saved beside each relative position bias table (the table's name in the same module),
# which this project derives from the shapes instead.
_DERIVED_KEY, _ITS_TABLE = "relative_position_index", "local_relative_position_bias_table"


def save_checkpoint(path, model, entries=None, **extra):
    """Write ``{"net": model.state_dict(), **extra}`` to ``path`` atomically; ``entries``: state-dict entries to
    write instead of the model's current ones."""
    state = {"net": {**_unwrap(model).state_dict(), **(entries or {})}, **extra}
    atomic_write(path, lambda f: torch.save(state, f))


def download_checkpoint(url, file_name):
    """The file at ``url``, kept in torch hub's checkpoint cache (``$TORCH_HOME/hub/checkpoints``) as
    ``file_name``: downloaded once, with a progress bar, written whole or not at all. Returns its path."""
    folder = os.path.join(torch.hub.get_dir(), "checkpoints")
    path = os.path.join(folder, file_name)
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        try:
            torch.hub.download_url_to_file(url, path, progress=True)  # to a temporary file, then renamed
        except OSError as e:  # URLError and HTTPError are OSErrors
            raise ValueError(
                f"Cannot download {url} ({getattr(e, 'reason', e)}); download it by hand and give its path instead."
            ) from None
    return path


def read_checkpoint(path):
    """The checkpoint dict at ``path``, loaded with ``weights_only=True`` (checkpoints are untrusted input); the
    state dict of a ``.safetensors`` file; a Hub folder's ``model.safetensors`` with what its ``config.json``
    records (:func:`with_hub_config`)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, SAFETENSORS_NAME)):
            raise FileNotFoundError(
                f"{path} is a folder without {SAFETENSORS_NAME}; give a checkpoint file, or a folder that "
                "tools/export_hub.py wrote."
            )
        return with_hub_config(read_checkpoint(os.path.join(path, SAFETENSORS_NAME)), path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if os.path.getsize(path) == 0:
        raise ValueError(
            f"{path} is empty (0 bytes), not a checkpoint; its write was interrupted, or it is the wrong file."
        )
    if str(path).endswith(".safetensors"):
        try:
            return safetensors.torch.load_file(path, device="cpu")
        except Exception as e:
            raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}).") from None
    try:
        with warnings.catch_warnings():  # a pickle of another protocol than torch.save's: its failure is said below
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            with torch.serialization.safe_globals([argparse.Namespace]):  # the args timm's train.py saves
                checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if not _saved_by_torch(path):
            raise ValueError(
                f"{path} is not a PyTorch checkpoint (torch.save writes a zip archive or a pickle, and this file is "
                "neither); give the checkpoint file of the run."
            ) from None
        if _zip_without_torch_records(path):
            raise ValueError(
                f"{path} is a zip archive, but not one torch.save wrote (it holds no data.pkl); give the checkpoint "
                "file of the run."
            ) from None
        raise ValueError(f"{path} is not a readable PyTorch checkpoint of tensors ({_load_failure(e)}).") from None
    _check_records(path)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    return checkpoint


_FOLDER_ATTRIBUTE = 0x10  # MS-DOS's, in a zip record's external attributes


def _check_records(path):
    """Refuses a zip archive of ``torch.save`` whose records no longer match the CRC-32 it wrote with each: torch.load
    does not check them, so a copy altered in place would load as other weights. Pickles (older files) and archives
    written without checksums (``torch.serialization.set_crc32_options(False)``: every CRC 0) have none to check."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # as torch.load tells its archives from pickles
            return
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            if all(record.CRC == 0 for record in records):
                return
            damaged = next((record.filename for record in records if not _reads_back(archive, record)), None)
    except Exception as e:  # zipfile's own errors (BadZipFile, NotImplementedError, ...) on an altered directory
        detail = next(iter(str(e).splitlines()), "").rstrip(".")
        raise ValueError(
            f"{path} is damaged: torch.load read it, but its zip archive does not read back ({type(e).__name__}: "
            f"{detail}); copy it again from where the run wrote it."
        ) from None
    if damaged is not None:
        raise ValueError(
            f"{path} is damaged: its record {damaged} no longer reads back as torch.save wrote it (its checksum or "
            "its header does not match; the file was altered after it was written, e.g. in a copy); copy it again "
            "from where the run wrote it."
        )


def _reads_back(archive, record):
    """Whether a record of the archive reads to its end as its header describes it, checksum included, and is not
    marked as a folder (torch.save marks none; torch.load leaves a tensor so marked uninitialised)."""
    if record.is_dir() or record.external_attr & _FOLDER_ATTRIBUTE:
        return False
    try:
        with archive.open(record) as data:
            while data.read(1 << 20):
                pass
    except Exception:  # BadZipFile for a checksum, and whatever an altered header leads zipfile to
        return False
    return True


def stored_config(checkpoint: Mapping[str, Any], path: Union[str, os.PathLike] = "The checkpoint") -> Optional[CfgNode]:
    """The config this project's trainer stores in its checkpoints, checked as config files are (crafted
    metadata is refused in one sentence); None for other checkpoints."""
    if not isinstance(checkpoint, dict) or "config" not in checkpoint:
        return None
    return config_from_text(checkpoint["config"], f"the config stored in {path}")


def hub_record(folder):
    """What the ``config.json`` of a Hub folder of this project (``tools/export_hub.py``'s) records, as a dict;
    None for a folder without one, or with another model's."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} is not readable JSON ({e}); export the folder again with tools/export_hub.py."
        ) from None
    return record if isinstance(record, dict) and record.get("architecture") == "vil_arch" else None


def with_hub_config(state, folder):
    """A Hub folder's weights as a checkpoint of this project's: ``{"net": state, "config": ..., "classes": ...}``,
    the config of the model's arguments and the class names that the folder's ``config.json`` records, so that the
    checks of a checkpoint's model options and classes apply to the folder too. A folder without such a record
    (another model's, or no ``config.json``) gives the weights alone."""
    record = hub_record(folder)
    if record is None:
        return state
    path = os.path.join(folder, "config.json")
    cfg = config_from_model_arguments(record.get("model_args", {}), f"the model_args of {path}")
    checkpoint = {"net": state, "config": cfg.dump(), "classes": record.get("label_names")}
    if recorded_classes(checkpoint) is None:
        del checkpoint["classes"]
    return checkpoint


def recorded_classes(checkpoint):
    """The class names, in label order, that a checkpoint records (``classes``: this project's trainer writes them,
    a Hub folder's ``label_names`` give them), or None where it records no list of names."""
    names = checkpoint.get("classes") if isinstance(checkpoint, dict) else None
    return names if isinstance(names, list) and all(isinstance(name, str) for name in names) else None


def classifier_classes(checkpoint, source):
    """The class count of the classifier (``head.weight``) in ``checkpoint`` (as :func:`read_checkpoint` gives it,
    read from ``source``): 0 for weights without one (a model of ``num_classes=0``), None where it holds no weights
    this can read (the load that follows says what is wrong with it)."""
    try:
        head = model_state(checkpoint, source).get("head.weight")
    except (ValueError, AttributeError):
        return None
    return 0 if head is None else head.shape[0]


def _saved_by_torch(path):
    """Whether the file begins as ``torch.save`` writes: a zip archive, or a pickle (older files; protocol 2 and up
    open with 0x80, protocols 0 and 1 with torch's magic number as text)."""
    with open(path, "rb") as f:
        head = f.read(5)
    return head.startswith((b"PK\x03\x04", b"\x80", b"L1195"))


def _zip_without_torch_records(path):
    """Whether the file is a zip archive without the ``<name>/data.pkl`` record that torch.save writes in each."""
    try:
        with zipfile.ZipFile(path) as archive:
            return not any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _load_failure(error):
    """What ``torch.load`` with ``weights_only=True`` failed on, without its advice to load with ``weights_only=False``
    (which runs whatever code the file holds): the weights unpickler's own reason where it gives one."""
    text = str(error)
    if not text.startswith("Weights only load failed"):
        # Its first sentence: torch's zip reader goes on with advice about its own internals.
        detail = next(iter(text.splitlines()), "").split(". ")[0].rstrip(".")
        return f"{type(error).__name__}{': ' + detail if detail else ''}"
    marker = "WeightsUnpickler error:"
    after = text.split(marker, 1)[1] if marker in text else text.split("\n\n", 1)[-1]
    chunks = [chunk.strip() for chunk in after.split("\n\n") if chunk.strip()]
    reason = chunks[0].split(". ")[0].rstrip(".") if chunks else "an object it does not take"
    if reason.startswith("Unsupported operand"):  # a pickle instruction torch.save does not write (protocol 4's)
        return f"{reason}: a pickle that torch.save did not write; save the weights with torch.save"
    return (
        f"{reason}; checkpoints are read with weights_only=True, which takes tensors, numbers, strings and "
        "containers of them, no other objects"
    )


# Where checkpoints keep the EMA weights: this project's trainer, and timm's.
_EMA_KEYS = ("ema", "state_dict_ema", "model_ema")


def _ema(checkpoint):
    return next((checkpoint[k] for k in _EMA_KEYS if isinstance(checkpoint.get(k), dict)), None)


def ema_state(checkpoint, path="checkpoint"):
    """The EMA weights of a checkpoint dict, as :func:`model_state` returns model weights."""
    ema = _ema(checkpoint)
    if ema is None:
        raise ValueError(
            f"{path} holds no EMA weights (it was trained without MODEL.EMA); "
            "set MODEL.LOAD_EMA False to use its model weights."
        )
    return model_state(ema, path)


# Where checkpoints keep the model weights: this project's trainer, timm's train.py, DeiT's and Swin's main.py.
_MODEL_KEYS = ("net", "state_dict", "model")


def model_state(checkpoint, path="checkpoint"):
    """The model state dict inside a checkpoint dict: its ``"net"`` entry (timm's ``"state_dict"``, DeiT's
    ``"model"``), or the dict itself; without ``module.`` prefixes and without the derived buffers of the original
    release. Weights that are not finite are refused in one sentence: nothing evaluates, exports or trains on."""
    state = next((checkpoint[k] for k in _MODEL_KEYS if isinstance(checkpoint.get(k), dict)), checkpoint)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"{path} has no model state dict: expected a dict of tensors, or one under the key 'net', 'state_dict' "
            "or 'model'."
        )
    check_finite(state, path)
    for prefix in ("module.", "_orig_mod."):  # DistributedDataParallel, torch.compile
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return {k: v for k, v in state.items() if not _derived(k, state)}


def check_finite(state, path="checkpoint"):
    """Refuses, in one sentence naming a tensor, a state dict whose weights are not finite: nothing evaluates,
    exports or trains on them (entries that are not tensors are left to the checks of the keys)."""
    broken = [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()]
    if broken:
        raise ValueError(
            f"Checkpoint {path} holds values that are not finite (NaN or infinite) in {len(broken)} tensors, "
            f"e.g. {broken[0]}; use a checkpoint written before the training diverged."
        )


def _derived(key, state):
    """Whether ``key`` is a buffer the original release saved beside a bias table of ``state`` (elsewhere, such a
    name is a key the model does not have, and is named as one)."""
    module, _, name = key.rpartition(".")
    return name == _DERIVED_KEY and f"{module}.{_ITS_TABLE}" in state


def load_checkpoint(model, path, strict=True):
    """Load the weights of the checkpoint at ``path`` into ``model``; returns the checkpoint dict.

    Strict by default: keys missing from the checkpoint, keys the model does not have, and tensors of the
    wrong shape are all named in one ``ValueError``. With ``strict=False`` only matching tensors are loaded.
    """
    checkpoint = read_checkpoint(path)
    load_model_state(model, model_state(checkpoint, path), path, strict)
    return checkpoint


def load_model_state(model, state, path, strict=True, may_miss=()):
    """Load a state dict into ``model`` as :func:`load_checkpoint` does; keys starting with one of ``may_miss``
    may be absent from ``state`` (parameters the checkpoint cannot have, which keep their initial values). A tensor
    the model holds under several names may come under one (:func:`with_shared_names`)."""
    target = _unwrap(model)
    state = with_shared_names(state, target)
    if strict:
        check_fits(state, target, path, may_miss)
    check_shared(state, target, path)
    expected = target.state_dict()
    fitting = {k: v for k, v in state.items() if k in expected and v.shape == expected[k].shape}
    target.load_state_dict(fitting, strict=False)  # what is missing or does not fit was refused above if strict


def check_fits(state, model, path, may_miss=()):
    """Raise one ``ValueError`` naming the keys ``model`` lacks in ``state`` (except those starting with one of
    ``may_miss``), the keys it does not have, and the tensors of another shape."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.startswith(tuple(may_miss))]
    unexpected = [k for k in state if k not in expected]
    mis_shaped = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    # Loading casts floating tensors to the model's precision; integers, booleans or complex numbers where the model
    # has real numbers (or the other way round) are not weights it was trained with.
    of_another_kind = [
        f"{k} {state[k].dtype} vs {v.dtype}" for k, v in expected.items() if k in state and _kind(state[k]) != _kind(v)
    ]
    if missing or unexpected or mis_shaped or of_another_kind:
        problems = [
            f"{len(items)} {what}: {_sample(items)}"
            for what, items in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("mis-shaped (checkpoint vs model)", mis_shaped),
                ("of another kind of number (checkpoint vs model)", of_another_kind),
            )
            if items
        ]
        raise ValueError(
            f"Checkpoint {path} does not fit this model's architecture ({'; '.join(problems)}); use a checkpoint of "
            "this architecture, or build the model it was trained as (its arch string and attention)."
        )


def _shared_names(model):
    """The groups of state-dict names that are one tensor in ``model`` (``query`` and ``query_global`` with SHARE_W
    True, linformer's ``proj_k`` and ``proj_v`` with SHARE_KV True)."""
    names_by_tensor = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_by_tensor.setdefault(tensor, []).append(name)
    return [names for names in names_by_tensor.values() if len(names) > 1]


def with_shared_names(state, model):
    """``state`` with the names it lacks of a tensor that ``model`` holds under several, taken from a name it has:
    safetensors' ``save_model`` (and ``save_file`` after it) keeps one name of each such tensor."""
    filled = dict(state)
    for names in _shared_names(_unwrap(model)):
        present = next((n for n in names if n in state), None)
        if present is not None:
            for name in names:
                filled.setdefault(name, state[present])
    return filled


def check_shared(state, model, path):
    """Names that are one tensor in the model (see :func:`_shared_names`) must hold equal tensors in the
    checkpoint: otherwise one would silently overwrite the other."""
    for names in _shared_names(model):
        present = [n for n in names if n in state]
        for other in present[1:]:
            if state[other].shape == state[present[0]].shape and not torch.equal(state[other], state[present[0]]):
                option = "MODEL.VIT.MSVIT.SHARE_KV" if other.endswith("proj_v") else "MODEL.VIT.MSVIT.SHARE_W"
                raise ValueError(
                    f"Checkpoint {path} holds different tensors under {present[0]} and {other}, which are one "
                    f"tensor in this model ({option} True); build the model with {option} False to load it."
                )


def _unwrap(model):
    return model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model


def _kind(tensor):
    """What kind of numbers a tensor holds: complex, floating point, or whole numbers and booleans."""
    return "complex" if tensor.is_complex() else "floating" if tensor.is_floating_point() else "whole"


def _sample(items):
    """The first 6 of ``items``, and how many more there are."""
    shown = ", ".join(items[:6])
    return shown + (f", ... ({len(items) - 6} more)" if len(items) > 6 else "")
