"""State-dict conversions: a classification checkpoint into a backbone of another shape.

Each function takes a state dict with the model's key layout (this project's, which is the original
release's) and the stage specs of the model it belongs to, and returns the converted state dict (and the
new specs where they change). Nothing here builds a model, so the export tool and the backbone builder share
the same code.
"""

import math
import re
from dataclasses import replace

import torch

from ..checkpoint import check_fits, check_shared, model_state, stored_config, with_shared_names
from ..config import MODEL_ARGUMENT_KEYS, config_value
from .arch import parse_arch, stage_map_sizes
from .tables import full_bias_to_local, resize_full_bias_table, resize_position_embedding

GLOBAL_INITS = ("copy", "average")
_STAGE_KEY = re.compile(r"^layer(\d+)\.")
_FULL_TABLE = ".attn.local_relative_position_bias_table"


def _stage_position(key, specs):
    """The position in ``specs`` of the stage a key belongs to, or None for the final norm and the head."""
    match = _STAGE_KEY.match(key)
    if not match:
        return None
    index = int(match.group(1))
    return next((i for i, spec in enumerate(specs) if spec.index == index), None)


def _is_full_table(key, state):
    """A relative-bias table of a full-attention block (one with a ``qkv`` projection)."""
    return key.endswith(_FULL_TABLE) and key[: -len("local_relative_position_bias_table")] + "qkv.weight" in state


def drop_classifier(state):
    """The state without the final norm and the classifier, which a backbone does not have."""
    return {k: v for k, v in state.items() if not k.startswith(("head.", "norm."))}


def infer_image_size(state, specs):
    """The square image size a state dict's position tables were made for (stage 1's absolute position
    embedding, or a full-attention table), or None when it has neither."""
    stride = 1
    for spec in specs:
        stride *= spec.patch
        prefix = f"layer{spec.index}."
        rows, cols = state.get(prefix + "0.x_pos_embed"), state.get(prefix + "0.y_pos_embed")
        if rows is not None and cols is not None:
            return rows.shape[1] * stride, cols.shape[1] * stride
        for key, value in state.items():
            if key.startswith(prefix) and _is_full_table(key, state):
                side = math.isqrt(value.shape[0])
                if side * side == value.shape[0] and side % 2:
                    return (side + 1) // 2 * stride, (side + 1) // 2 * stride
    return None


def resize_tables(state, specs, old_size, new_size, pad=False):
    """Position embeddings and full-attention bias tables made for images of ``old_size`` (H, W), remade for
    ``new_size`` by the interpolation the model itself uses on inputs of another size (``pad``: the maps of
    patch embeddings that pad, see :func:`~vil.models.arch.stage_map_sizes`)."""
    old_maps, new_maps = stage_map_sizes(specs, old_size, pad), stage_map_sizes(specs, new_size, pad)
    resized = {}
    for key, value in state.items():
        i = _stage_position(key, specs)
        if i is not None and key.endswith(".x_pos_embed"):
            value = resize_position_embedding(value, new_maps[i][0])
        elif i is not None and key.endswith(".y_pos_embed"):
            value = resize_position_embedding(value, new_maps[i][1])
        elif i is not None and _is_full_table(key, state):
            value = resize_full_bias_table(value, old_maps[i], new_maps[i])
        resized[key] = value
    return resized


def backbone_specs(specs, full_attention_to_local=False, num_global=None):
    """The stage specs after the conversions below: every stage local, and/or ``num_global`` global tokens in
    the stages that have some."""
    if full_attention_to_local:
        specs = [replace(spec, local=True) for spec in specs]
    if num_global is not None:
        specs = [replace(spec, num_global=num_global if spec.num_global else 0) for spec in specs]
    return specs


def full_to_local(state, specs, image_size, pad=True):
    """Full-attention blocks turned into longformer blocks, as the original detection code did: ``qkv`` split
    into ``query`` and ``kv`` (and their ``_global`` twins where the stage has global tokens), and the
    relative-bias table re-indexed by offset into a ``(4w-1)^2`` table. Returns ``(state, specs)`` with every
    stage local (s1)."""
    maps = stage_map_sizes(specs, image_size, pad)
    converted = {}
    for key, value in state.items():
        i = _stage_position(key, specs)
        if i is None:
            converted[key] = value
            continue
        spec = specs[i]
        twins = spec.num_global > 0
        if ".attn.qkv." in key:
            block, kind = key.split(".qkv.")
            dim = value.shape[0] // 3
            for name in ("query", "query_global") if twins else ("query",):
                converted[f"{block}.{name}.{kind}"] = value[:dim].clone()
            for name in ("kv", "kv_global") if twins else ("kv",):
                converted[f"{block}.{name}.{kind}"] = value[dim:].clone()
        elif _is_full_table(key, state):
            converted[key] = full_bias_to_local(value, maps[i], spec.window)
        elif ".attn.proj." in key and key.split(".proj.")[0] + ".qkv.weight" in state and twins:
            converted[key] = value
            converted[key.replace(".proj.", ".proj_global.")] = value.clone()
        else:
            converted[key] = value
    return converted, backbone_specs(specs, full_attention_to_local=True)


def set_num_global(state, specs, num_global, init="copy"):
    """Every stage that has global tokens gets ``num_global`` of them (0 removes them); stages without keep
    none. The tokens, their position embeddings and their bias entries are the learned ones repeated in turn
    (``copy``) or their mean (``average``). Returns ``(state, specs)``."""
    if init not in GLOBAL_INITS:
        raise ValueError(f"Global-token initialisation {init!r} does not exist; use one of {', '.join(GLOBAL_INITS)}.")
    if num_global < 0:
        raise ValueError(f"The number of global tokens must be 0 or more, not {num_global}.")

    def pick(value, dim, old):
        if init == "copy":
            return value.index_select(dim, torch.arange(num_global) % old)
        shape = list(value.shape)
        shape[dim] = num_global
        return value.mean(dim=dim, keepdim=True).expand(shape).clone()

    converted = {}
    for key, value in state.items():
        i = _stage_position(key, specs)
        old = specs[i].num_global if i is not None else 0
        if not old:
            converted[key] = value
        elif key.endswith((".cls_token", ".cls_pos_embed")):
            converted[key] = pick(value, 1, old)
        elif key.endswith(".g2l_relative_position_bias"):
            converted[key] = pick(value, 2, old)
        elif key.endswith(".g2g_relative_position_bias"):
            converted[key] = pick(pick(value, 1, old), 2, old)
        else:
            converted[key] = value
    if num_global == 0:  # no tokens, no projections of theirs; the tokens' position embedding stays, empty
        converted = {
            k: v
            for k, v in converted.items()
            if not (k.endswith((".cls_token", "_relative_position_bias")) or "_global." in k)
        }
    return converted, backbone_specs(specs, num_global=num_global)


# The config keys that change what the same weights compute (no tensor's shape shows them), each with the form in
# which two values compute the same: architecture strings as parsed, MODE as the mode evaluation uses. Image size,
# class count, dropout and the attention implementation (ATTN_TYPE's backends) may differ.
MODEL_DEFINING_KEYS = {
    "MODEL.VIT.MSVIT.ARCH": parse_arch,
    "MODEL.VIT.MSVIT.SW_EXACT": int,
    "MODEL.VIT.MSVIT.MODE": lambda mode: min(mode, 0),
    "MODEL.VIT.MSVIT.ONLY_GLOBAL": bool,
    "MODEL.VIT.MSVIT.SHARE_W": bool,
    "MODEL.VIT.MSVIT.LN_EPS": float,
    "MODEL.VIT.NORM_EMBED": bool,
    "MODEL.VIT.AVG_POOL": bool,
    "MODEL.VIT.DYNAMIC_IMG_PAD": bool,
}


# The number of dimensions of the tensors the conversions resize, split or repeat, by the ends of their names.
_CONVERTED_DIMS = {
    ".x_pos_embed": 3,
    ".y_pos_embed": 3,
    ".cls_token": 3,
    ".cls_pos_embed": 3,
    ".g2l_relative_position_bias": 3,
    ".g2g_relative_position_bias": 3,
    ".local_relative_position_bias_table": 2,
    ".qkv.weight": 2,
    ".qkv.bias": 1,
}


def check_convertible(state, path):
    """Refuse, in one sentence naming it, a table, token or projection that the conversions cannot take: one of
    other numbers than floating-point ones, or with another number of dimensions than a ViL model's. What else does
    not fit the model (other tensors of another kind of number included) is named once the state is converted."""
    for key, value in state.items():
        dims = next((d for end, d in _CONVERTED_DIMS.items() if key.endswith(end)), None)
        if dims is not None and (not value.is_floating_point() or value.dim() != dims):
            raise ValueError(
                f"Checkpoint {path} holds {key} as {value.dtype} of shape {tuple(value.shape)}, where a ViL model "
                f"holds floating-point numbers in {dims} dimensions; use a checkpoint of a ViL model."
            )


def fit_to_model(state, model, path, adapted=()):
    """A model state dict for ``model`` (an :class:`~vil.models.MsViT`): position tables resized when the model
    was built for another image size than the state's (taken as square, as both releases train). A state of
    another architecture, or with different tensors under names that are one tensor in the model, is refused in
    one sentence naming the keys; the classifier, and the keys in ``adapted``, may differ."""
    check_convertible(state, path)
    state, expected = with_shared_names(state, model), model.state_dict()
    if any(k in expected and expected[k].shape != v.shape for k, v in state.items()):
        source = infer_image_size(state, model.stage_specs)
        if source:
            state = resize_tables(state, model.stage_specs, source, model.img_size, model.dynamic_img_pad)
    body = {k: v for k, v in state.items() if not k.startswith("head.") and k not in adapted}
    check_fits(body, model, path, may_miss=("head.", *adapted))
    check_shared(body, model, path)
    return state


def option_name(key):
    """The MsViT argument a :data:`MODEL_DEFINING_KEYS` key sets (as :data:`vil.config.MODEL_ARGUMENT_KEYS` says)."""
    return next(name for name, argument_key in MODEL_ARGUMENT_KEYS.items() if argument_key == key)


def trained_with(checkpoint, path, values):
    """``{key: (the checkpoint's value, the one in values)}`` for each of :data:`MODEL_DEFINING_KEYS` in ``values``
    (key: value) that computes otherwise than the value of the config the checkpoint holds (this project's; the
    original release's and bare state dicts hold none)."""
    saved = stored_config(checkpoint, path)
    if saved is None:
        return {}
    differences = {}
    for key, value in values.items():
        then = config_value(saved, key)
        if MODEL_DEFINING_KEYS[key](then) != MODEL_DEFINING_KEYS[key](value):
            differences[key] = (then, value)
    return differences


def check_trained_options(checkpoint, options, source):
    """Refuse, in one sentence naming them, a checkpoint of this project trained with other
    :data:`MODEL_DEFINING_KEYS` values than the model's arguments ``options`` (by MsViT argument name)."""
    values = {key: options[option_name(key)] for key in MODEL_DEFINING_KEYS if option_name(key) in options}
    differ = [
        f"{option_name(key)}={then!r} ({key}), not {now!r}"
        for key, (then, now) in trained_with(checkpoint, source, values).items()
    ]
    if differ:
        raise ValueError(
            f"{source} was trained with {', '.join(differ)}; give those arguments to build the model it holds."
        )


def checkpoint_filter_fn(state_dict, model, source="the pretrained checkpoint", options=None):
    """timm's checkpoint filter: the original release's checkpoints and this project's (the ``"net"`` entry,
    wrapper prefixes and derived buffers removed), fitted to the model by :func:`fit_to_model` (timm replaces
    a classifier of another class count, and adapts the first convolution to ``in_chans`` other than 3 after
    this filter); ``source`` names the checkpoint in a refusal. With the model's arguments ``options``, a checkpoint
    trained with other model options is refused (:func:`check_trained_options`)."""
    if options is not None:
        check_trained_options(state_dict, options, source)
    state = model_state(state_dict, source)
    first = model.pretrained_cfg["first_conv"] + ".weight"
    adapted = (first,) if first in state and state[first].shape[1] != model.in_chans else ()
    return fit_to_model(state, model, source, adapted)


def convert_classification_state(
    state, arch, image_size, *, full_attention_to_local=False, num_global=None, global_init="copy", pad=True
):
    """A classification model's state (arch string ``arch``, its position tables made for ``image_size``) as a
    backbone's: no classifier or final norm; optionally full-attention stages as longformer ones (on the maps of
    patch embeddings that ``pad``, as the detection backbone's do by default) and another number of global tokens.
    It keeps the tables' size: :func:`vil.detection.classification_backbone_state` remakes them for another image
    size before calling it. Returns ``(state, arch specs, image size)``."""
    specs = parse_arch(arch)
    state = drop_classifier(model_state(state))
    if full_attention_to_local:
        state, specs = full_to_local(state, specs, image_size, pad)
    if num_global is not None:
        state, specs = set_num_global(state, specs, num_global, global_init)
    return state, specs, tuple(image_size)
