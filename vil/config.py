"""The yacs configuration: every key of the original ViL release (so its YAML files and command-line
overrides work unchanged), with the defaults of the original release, plus a few keys of our own.

Every key is read by the code, except those in :data:`COMPATIBILITY_KEYS`, which exist only so that the
original's YAML files load; setting one of those to another value than its default logs one warning line. (The
augmentation keys are read by one of the training transforms each: one set for another logs a warning too.)
"""

import difflib
import logging
import math
import os
import re
from collections.abc import Hashable
from pathlib import Path

import yaml
from yacs.config import CfgNode as CN

_C = CN()

_C.INPUT = CN()
_C.INPUT.MEAN = [0.485, 0.456, 0.406]
_C.INPUT.STD = [0.229, 0.224, 0.225]
_C.INPUT.IMAGE_SIZE = 224
_C.INPUT.CROP_PCT = 0.875
_C.INPUT.INTERPOLATION = 2  # PIL codes: 2 bilinear, 3 bicubic

_C.AMP = CN()
_C.AMP.ENABLED = False  # on CUDA; on the CPU too with AMP.ON_CPU
_C.AMP.ON_CPU = False  # autocast on the CPU as well (pays where it has bfloat16 matrix instructions: AVX512-BF16, AMX)
_C.AMP.MEMORY_FORMAT = "nchw"  # or "nhwc": the model and its inputs in channels-last layout
_C.AMP.DTYPE = "bfloat16"  # or float16, with a gradient scaler

_C.AUG = CN()
_C.AUG.SCALE = (0.08, 1.0)
_C.AUG.RATIO = (3.0 / 4.0, 4.0 / 3.0)
# The plain training transform's (neither AUG.TIMM_AUG.USE_TRANSFORM nor fine-tuning's): brightness, contrast,
# saturation, hue, and the probability to apply them.
_C.AUG.COLOR_JITTER = [0.4, 0.4, 0.4, 0.1, 0.0]
_C.AUG.GRAY_SCALE = 0.0
_C.AUG.GAUSSIAN_BLUR = 0.0
_C.AUG.DROPBLOCK_LAYERS = [3, 4]
_C.AUG.DROPBLOCK_KEEP_PROB = 1.0
_C.AUG.DROPBLOCK_BLOCK_SIZE = 7
_C.AUG.MIXUP_PROB = 0.0
_C.AUG.MIXUP = 0.0
_C.AUG.MIXCUT = 0.0  # CutMix's Beta alpha; 0: no CutMix, unless AUG.MIXCUT_MINMAX is set
_C.AUG.MIXCUT_MINMAX = []  # [low, high]: CutMix boxes of these fractions of the image side, whatever AUG.MIXCUT is
_C.AUG.MIXUP_SWITCH_PROB = 0.5
_C.AUG.MIXUP_MODE = "batch"
_C.AUG.MIXCUT_AND_MIXUP = False
_C.AUG.REPEATED_AUG = False  # distributed training: timm's repeated-augmentation sampler (3 repeats)
# timm's training transform (timm.data.create_transform) and its options, with timm's defaults.
_C.AUG.TIMM_AUG = CN()
_C.AUG.TIMM_AUG.USE_TRANSFORM = False
_C.AUG.TIMM_AUG.HFLIP = 0.5  # also the horizontal flip of the other training transforms
_C.AUG.TIMM_AUG.VFLIP = 0.0
_C.AUG.TIMM_AUG.COLOR_JITTER = 0.4
_C.AUG.TIMM_AUG.AUTO_AUGMENT = ""  # a timm policy string, e.g. rand-m9-mstd0.5-inc1; "": none
_C.AUG.TIMM_AUG.RE_PROB = 0.0  # random erasing
_C.AUG.TIMM_AUG.RE_MODE = "pixel"
_C.AUG.TIMM_AUG.RE_COUNT = 1
_C.AUG.TIMM_AUG.RE_SPLIT = False

_C.DATA = CN()
_C.DATA.TRAIN = ("imagenet",)
_C.DATA.TEST = ("imagenet",)
_C.DATA.NUM_CLASSES = 1000
_C.DATA.TARGETMAP = ""
_C.DATA.PATH = "./datasets"
_C.DATA.DATA_DIR = "./data"  # MODEL.MODEL_PATH is looked up here when it is not a file by itself
_C.DATA.FORMAT = (
    "folder"  # "folder": DATA.PATH/{train,val}/<class>/<image>; "shards": tar shards (tools/make_shards.py)
)
_C.DATA.CLASSES = []  # a subset of the classes (folder names; "0".."9" for digits), labelled in this order

_C.LOSS = CN()
_C.LOSS.LABEL_SMOOTHING = 0.0
_C.LOSS.LOSS = "xentropy"
_C.LOSS.FOCAL = CN()
_C.LOSS.FOCAL.NORMALIZE = True
_C.LOSS.FOCAL.ALPHA = 1.0
_C.LOSS.FOCAL.GAMMA = 0.5

_C.DATALOADER = CN()
_C.DATALOADER.BSZ = 128
_C.DATALOADER.RE = "no"
_C.DATALOADER.WORKERS = 0

_C.OPTIM = CN()
_C.OPTIM.OPT = "adamw"  # adamw, sgd, qhm, adam, lamb
_C.OPTIM.LR = 1.0
_C.OPTIM.MOM = 0.9
_C.OPTIM.NU = 1.0  # qhm's nu
_C.OPTIM.WD = 5e-4
_C.OPTIM.WD0 = 0.0  # the weight decay of the parameters model.no_weight_decay() names
_C.OPTIM.EPOCHS = 150
_C.OPTIM.WARMUP = 0
_C.OPTIM.DROP_FREQ = 50
_C.OPTIM.DROP_FACTOR = 10.0
_C.OPTIM.VAL = 0  # sgd/qhm: divide the learning rate by DROP_FACTOR after an epoch without a new best top-1
_C.OPTIM.TEST_FREQ = 1000
_C.OPTIM.ADAM = CN()
_C.OPTIM.ADAM.BETA1 = 0.9
_C.OPTIM.ADAM.BETA2 = 0.999
_C.OPTIM.ADAM.EPS = 1e-8
_C.OPTIM.CLIP_GRAD = 0.0  # max gradient norm; 0: no clipping
_C.OPTIM.ACCUM_STEPS = 1  # batches per optimizer step
_C.OPTIM.LAYER_DECAY = 0.0  # layer-wise learning-rate decay (e.g. 0.75): block k of n gets LR * decay^(n - k); 0: off

_C.SOLVER = CN()
_C.SOLVER.LR_POLICY = ""
_C.SOLVER.WARMUP_FACTOR = 1.0 / 3.0
_C.SOLVER.WARMUP_EPOCHS = 5.0
_C.SOLVER.WARMUP_METHOD = "linear"
_C.SOLVER.MIN_LR = 0.0
_C.SOLVER.DETECT_ANOMALY = False
_C.SOLVER.EPOCH_BASED_SCHEDULE = False
_C.SOLVER.USE_LARC = False

_C.MODEL = CN()
_C.MODEL.ARCH = "msvit"
_C.MODEL.NONLINEARITY = "celu"
_C.MODEL.MODEL_PATH = (
    ""  # training: the weights to start from (fine-tuning); EVALUATE and tools/eval.py: the checkpoint
)
_C.MODEL.LOAD_EMA = False  # take MODEL.MODEL_PATH's EMA weights instead of its model weights
_C.MODEL.PRETRAINED = False
_C.MODEL.FREEZE_CONV_BODY_AT = -1
_C.MODEL.EMA = False  # keep an exponential moving average of the weights
_C.MODEL.EMA_DECAY = 0.9998
_C.MODEL.GRAD_CHECKPOINT = False  # recompute each block's activations in backward
_C.MODEL.COMPILE = False  # train with torch.compile(model) (Inductor): minutes of compiling first; see README

_C.MODEL.VIT = CN()
_C.MODEL.VIT.DROP = 0.0
_C.MODEL.VIT.DROP_PATH = 0.1
_C.MODEL.VIT.NORM_EMBED = True
_C.MODEL.VIT.AVG_POOL = False
# Patch embeddings pad images to a multiple of the patch size; False (the original release's) drops the remainder.
_C.MODEL.VIT.DYNAMIC_IMG_PAD = False

_C.MODEL.VIT.MSVIT = CN()
# Stages separated by "_", fields "<letter><int>" separated by ","; see vil/models/arch.py. Default: ViL-Small.
_C.MODEL.VIT.MSVIT.ARCH = (
    "l1,h3,d96,n1,s1,g1,p4,f7,a1_l2,h3,d192,n2,s1,g1,p2,f7,a1_l3,h6,d384,n8,s0,g1,p2,f7,a1_"
    "l4,h12,d768,n1,s0,g0,p2,f7,a1"
)
_C.MODEL.VIT.MSVIT.SHARE_W = True
_C.MODEL.VIT.MSVIT.ATTN_TYPE = "longformerhand"
_C.MODEL.VIT.MSVIT.SHARE_KV = True  # ATTN_TYPE linformer: one projection for keys and values
_C.MODEL.VIT.MSVIT.ONLY_GLOBAL = False
_C.MODEL.VIT.MSVIT.SW_EXACT = 0
_C.MODEL.VIT.MSVIT.LN_EPS = 1e-6
_C.MODEL.VIT.MSVIT.MODE = 0
_C.MODEL.VIT.MSVIT.VIL_MODE_SWITCH = 0.75

_C.FINETUNE = CN()
_C.FINETUNE.FINETUNE = False
_C.FINETUNE.USE_TRAIN_AUG = False  # with FINETUNE: False trains on resize, random crop and flip only

_C.OUTPUT_DIR = "./output"
_C.BACKUP_LOG_DIR = ""
_C.LOG_FREQ = 10  # a line in log.txt and TensorBoard points every LOG_FREQ optimizer steps
_C.EVALUATE = False  # tools/train.py evaluates MODEL.MODEL_PATH and exits
_C.OUTPUT_PERCLASS_ACC = False  # tools/eval.py and EVALUATE also write every class's top-1 and top-5 to eval.json
_C.ONLY_SAVE_LAST = 0  # no checkpoint_epoch<N>.pth files, only checkpoint_last.pth and model_best.pth
_C.DISTRIBUTED_BACKEND = "nccl"  # torch.distributed backend on CUDA; CPU processes use gloo
_C.GATHER_ON_CPU = False
_C.SEED = 0
_C.CHECKPOINT = CN()
_C.CHECKPOINT.EVERY_STEPS = 0  # also write checkpoint_last.pth every N optimizer steps; 0: once per epoch
_C.CHECKPOINT.KEEP = 3  # epoch checkpoints kept besides checkpoint_last.pth and model_best.pth


# Keys that exist only so that the original release's YAML files load: what each did there.
COMPATIBILITY_KEYS = {
    "AUG.DROPBLOCK_LAYERS": "DropBlock in the original's ResNets",
    "AUG.DROPBLOCK_KEEP_PROB": "DropBlock in the original's ResNets",
    "AUG.DROPBLOCK_BLOCK_SIZE": "DropBlock in the original's ResNets",
    "AUG.MIXCUT_AND_MIXUP": "unused by the original's training",
    "AUG.TIMM_AUG.RE_SPLIT": "random erasing per augmentation split, which neither the original nor this training "
    "makes",
    "DATA.TARGETMAP": "a label map for the original's TSV datasets",
    "DATALOADER.RE": "unused by the original's training",
    "LOSS.FOCAL.NORMALIZE": "a focal loss the original's training refused",
    "LOSS.FOCAL.ALPHA": "a focal loss the original's training refused",
    "LOSS.FOCAL.GAMMA": "a focal loss the original's training refused",
    "OPTIM.WARMUP": "unused by the original's schedules (SOLVER.WARMUP_EPOCHS sets the warmup)",
    "OPTIM.TEST_FREQ": "unused by the original's training",
    "SOLVER.USE_LARC": "the LARC wrapper of the original's ResNet experiments",
    "MODEL.NONLINEARITY": "the original's ResNets",
    "MODEL.PRETRAINED": "torchvision's ResNet weights (ViL weights come from MODEL.MODEL_PATH)",
    "MODEL.FREEZE_CONV_BODY_AT": "the original's ResNets",
    "BACKUP_LOG_DIR": "a copy of the logs on the original's cluster",
    "GATHER_ON_CPU": "where the original gathered per-image results",
}


def compatibility_warnings(cfg):
    """One sentence for every compatibility-only key that ``cfg`` sets to another value than its default."""
    return [
        f"{key} {config_value(cfg, key)!r} is ignored: this key only lets the original release's YAML files load "
        f"(there: {COMPATIBILITY_KEYS[key]})."
        for key in keys_set(cfg, COMPATIBILITY_KEYS)
    ]


def warn_compatibility_keys(cfg, log=None):
    """Log :func:`compatibility_warnings` (to the ``vil`` logger unless ``log`` is given)."""
    log = log or logging.getLogger("vil")
    for sentence in compatibility_warnings(cfg):
        log.warning(sentence)


def config_items(node, prefix=""):
    """``(dotted key, value)`` for every key of a config (or of one of its sections), in order."""
    for name, value in node.items():
        if isinstance(value, CN):
            yield from config_items(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def config_value(cfg, key):
    """The value of a dotted key (``"OPTIM.LR"``)."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def keys_set(cfg, keys):
    """Those of the dotted ``keys`` that ``cfg`` sets to other values than their defaults, in their order."""
    defaults = get_cfg()
    return [key for key in keys if config_value(cfg, key) != config_value(defaults, key)]


# The keys that hold paths.
PATH_KEYS = ("DATA.PATH", "DATA.DATA_DIR", "MODEL.MODEL_PATH", "OUTPUT_DIR")

# The MsViT arguments that a config key sets as it is (vil.model_config.model_kwargs), by argument; ATTN_TYPE sets
# two, the attention and its backend.
MODEL_ARGUMENT_KEYS = {
    "arch": "MODEL.VIT.MSVIT.ARCH",
    "img_size": "INPUT.IMAGE_SIZE",
    "num_classes": "DATA.NUM_CLASSES",
    "drop_rate": "MODEL.VIT.DROP",
    "drop_path_rate": "MODEL.VIT.DROP_PATH",
    "norm_embed": "MODEL.VIT.NORM_EMBED",
    "avg_pool": "MODEL.VIT.AVG_POOL",
    "share_w": "MODEL.VIT.MSVIT.SHARE_W",
    "share_kv": "MODEL.VIT.MSVIT.SHARE_KV",
    "only_global": "MODEL.VIT.MSVIT.ONLY_GLOBAL",
    "sw_exact": "MODEL.VIT.MSVIT.SW_EXACT",
    "mode": "MODEL.VIT.MSVIT.MODE",
    "ln_eps": "MODEL.VIT.MSVIT.LN_EPS",
    "dynamic_img_pad": "MODEL.VIT.DYNAMIC_IMG_PAD",
}


def get_cfg():
    """A fresh copy of all defaults."""
    return _C.clone()


def warn_unread_keys(cfg, unread):
    """Say once, for each ``(keys, why)`` of ``unread``, which of ``keys`` are set to other values than their defaults
    although what the config chose does not read them: "KEY is set, but " and ``why``, whose ``{}`` becomes "it" or
    "them"."""
    for keys, why in unread:
        changed = keys_set(cfg, keys)
        if changed:
            one = len(changed) == 1
            logging.getLogger("vil").warning(
                f"{', '.join(changed)} {'is' if one else 'are'} set, but {why.format('it' if one else 'them')}."
            )


def load_cfg(config_file=None, overrides=()):
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``["KEY", "VALUE", ...]``); checked and frozen.

    Anything wrong (a file that is not YAML or not a mapping of keys, an unknown key, a value of the wrong type
    or out of range) raises ``ValueError`` with one sentence naming it.
    """
    cfg = get_cfg()
    if config_file is not None and not str(config_file):  # an unset variable ($CFG): not the defaults
        raise ValueError(f"{EMPTY_CONFIG_FILE}.")
    if config_file:
        config_file = _config_path(config_file)
        try:
            with open(config_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            stem = os.path.splitext(os.path.basename(str(config_file)))[0]
            preset = f"; the preset {stem} is given by its name alone" if stem in preset_config_files() else ""
            raise ValueError(
                f"Cannot read the config file {config_file} ({e.strerror or type(e).__name__}){preset}."
            ) from None
        except UnicodeDecodeError as e:
            raise ValueError(
                f"The config file {config_file} is not UTF-8 text (byte {e.start}); save it as UTF-8 YAML."
            ) from None
        merge_yaml(cfg, text, str(config_file))
    if overrides:
        if len(overrides) % 2:
            raise ValueError(
                f"Config overrides come in KEY VALUE pairs, but an odd number of items was given ({len(overrides)}, "
                f"the last {overrides[-1]!r}); give each key its value."
            )
        for key, value in zip(overrides[0::2], overrides[1::2]):
            _set(cfg, str(key), value, "the overrides")
    for key in PATH_KEYS:  # a leading ~ is the home folder, as a shell expands it on a command line
        _set(cfg, key, os.path.expanduser(config_value(cfg, key)), "the paths")
    check_values(cfg)
    cfg.freeze()
    return cfg


def preset_config_files():
    """The preset YAML files by name (``vil_small`` -> its path): ``vil/configs`` in an installed wheel, the
    ``configs/`` folder of a source checkout."""
    package = Path(__file__).resolve().parent
    for folder in (package / "configs", package.parent / "configs"):
        if folder.is_dir():
            return {path.stem: path for path in sorted(folder.glob("*.yaml"))}
    return {}


def _config_path(config_file):
    """A YAML file's path as given, or the preset file a bare name (no folder, no suffix) names."""
    name = str(config_file)
    # A folder named like a preset (an OUTPUT_DIR, say) is not a config file: the preset is meant.
    if os.path.isfile(name) or os.sep in name or name.endswith((".yaml", ".yml")):
        return config_file
    presets = preset_config_files()
    if name not in presets:
        raise ValueError(
            f"{name} is neither a config file nor a preset; give a YAML file or one of {', '.join(presets)}."
        )
    return presets[name]


def config_from_text(text, source):
    """The config stored as YAML text in ``source`` (a checkpoint): the defaults with the text merged in,
    checked as :func:`load_cfg` checks files."""
    if not isinstance(text, str):
        raise ValueError(f"Expected YAML text in {source}, not a {type(text).__name__}.")
    cfg = get_cfg()
    merge_yaml(cfg, text, source)
    check_values(cfg, source)
    cfg.freeze()
    return cfg


def config_from_model_arguments(arguments, source):
    """The config of a model built from ``arguments``, the MsViT arguments a Hub folder's ``config.json`` records
    (``model_args``): the defaults with the keys of :data:`MODEL_ARGUMENT_KEYS` set, and ATTN_TYPE where the
    attention is not ViL's; arguments that no key sets (timm's ``in_chans``) are left out. Checked as
    :func:`load_cfg` checks files."""
    if not isinstance(arguments, dict):
        raise ValueError(f"Expected the model's arguments as a mapping in {source}, not a {type(arguments).__name__}.")
    cfg = get_cfg()
    for name, value in arguments.items():
        if name == "img_size" and isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            value = value[0]  # timm records the side as (H, W)
        if name in MODEL_ARGUMENT_KEYS:
            _set(cfg, MODEL_ARGUMENT_KEYS[name], value, source)
        elif name == "attention" and value != "longformer":
            _set(cfg, "MODEL.VIT.MSVIT.ATTN_TYPE", value, source)
    check_values(cfg, source)
    cfg.freeze()
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: the plain loader keeps the
    last and drops the first without a word (a whole section, where a section name is repeated)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": the merged keys, which the mapping's own override
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key is a {type(key).__name__}, not a name", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def merge_yaml(cfg, text, source):
    """Merge the YAML ``text`` (from ``source``) into ``cfg``, key by key."""
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ValueError(
            f"Not valid YAML in {source}{line} ({getattr(e, 'problem', None) or type(e).__name__})."
        ) from None
    if tree is None:
        return
    if not isinstance(tree, dict):
        raise ValueError(
            f"Expected a mapping of config keys (like 'MODEL: ...') in {source}, not a {type(tree).__name__}."
        )
    for key, value in _flatten(tree, cfg, source):
        _set(cfg, key, value, source)


def _flatten(tree, node, source, prefix=""):
    """(dotted key, value) for every leaf of a YAML mapping, checked against the sections of ``node``."""
    for name, value in tree.items():
        key = f"{prefix}{name}"
        default = node.get(name) if isinstance(name, str) else None
        if isinstance(default, CN):
            if not isinstance(value, dict):
                raise ValueError(
                    f"In {source}, {key} is {_shown(value)}, but it is a section of keys "
                    f"(like '{key}: {{{next(iter(default), 'KEY')}: ...}}')."
                )
            yield from _flatten(value, default, source, prefix=f"{key}.")
        else:
            yield key, value


def did_you_mean(name: str, known) -> str:
    """`` (did you mean X?)`` for the one of ``known`` closest to a misspelt ``name`` (letter case aside), or ""
    where none is close."""
    by_case = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(by_case), n=1, cutoff=0.75)
    return f" (did you mean {by_case[close[0]]}?)" if close else ""


def _dotted_keys(node, prefix=""):
    for name, value in node.items():
        yield from _dotted_keys(value, f"{prefix}{name}.") if isinstance(value, CN) else (f"{prefix}{name}",)


def _set(cfg, key, value, source):
    """Set the dotted ``key`` to ``value`` (as given: text is read as a Python literal, as yacs reads it) when the
    key exists and the value has its default's type. Text for a key of text that reads as another type (an
    ``OUTPUT_DIR`` of ``2024``) stays text."""
    *sections, name = key.split(".")
    node = cfg
    for part in sections:
        node = node.get(part) if isinstance(node, CN) else None
    if not isinstance(node, CN) or name not in node:
        raise ValueError(
            f"Unknown config key {key}{did_you_mean(key, _dotted_keys(cfg))}: it is not one of the keys defined in "
            f"vil/config.py (in {source})."
        )
    default = node[name]
    if isinstance(default, CN):
        raise ValueError(
            f"In {source}, {key} is {_shown(value)}, but it is a section of keys; set its keys ({key}.KEY) instead."
        )
    decoded = CN._decode_cfg_value(value)
    if isinstance(default, str) and isinstance(value, str) and not isinstance(decoded, str):
        decoded = value
    node[name] = _coerced(decoded, default, key, source)


def _coerced(value, default, key, source):
    if isinstance(default, bool) or isinstance(value, bool):
        if type(value) is type(default):
            return value
    elif isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        if not any(isinstance(item, bool) for item in value):  # no list key holds True or False
            return type(default)(value)
        raise ValueError(
            f"In {source}, {key} is {_shown(value)}, but its items must be numbers or quoted text, not True or False "
            "(unquoted, YAML reads yes, no, on, off, true and false as those)."
        )
    elif isinstance(default, float) and isinstance(value, (int, float)):
        return float(value)
    elif type(value) is type(default):
        return value
    kind = {
        bool: "True or False",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        tuple: "a list",
    }.get(type(default), type(default).__name__)
    raise ValueError(f"In {source}, {key} is {_shown(value)}, but it must be {kind} (until then it was {default!r}).")


def _shown(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_PROBABILITY = (lambda v: 0 <= v <= 1, "a probability in [0, 1]")
# The largest size (an image side, an arch field): PIL's and torch's C functions take sizes as int.
LARGEST_SIZE = 2**31 - 1

# Keys whose values have a range: (test, what the value must be).
_RULES = {
    "INPUT.IMAGE_SIZE": (lambda v: 1 <= v <= LARGEST_SIZE, f"a positive number of pixels, at most {LARGEST_SIZE}"),
    "INPUT.CROP_PCT": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    # ToTensor's pixels are in [0, 1]: a mean of 123.675 (of 0-255 pixels) would put every image near -2
    "INPUT.MEAN": (
        lambda v: len(v) == 3 and all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in v),
        "three numbers in [0, 1], one per channel (of pixels in [0, 1], not 0-255)",
    ),
    "INPUT.STD": (
        lambda v: len(v) == 3 and all(isinstance(x, (int, float)) and 0 < x <= 1 for x in v),
        "three numbers in (0, 1], one per channel (of pixels in [0, 1], not 0-255)",
    ),
    "AMP.DTYPE": (lambda v: v in ("bfloat16", "float16"), "'bfloat16' or 'float16'"),
    "AMP.MEMORY_FORMAT": (lambda v: v in ("nchw", "nhwc"), "'nchw' or 'nhwc'"),
    "OUTPUT_DIR": (lambda v: v.strip() != "", "a folder to write the run into (./output by default)"),
    "DATA.NUM_CLASSES": (lambda v: v >= 1, "a positive number of classes"),
    "DATA.FORMAT": (lambda v: v in ("folder", "shards"), "'folder' (image folders) or 'shards' (tar shards)"),
    "DATALOADER.BSZ": (lambda v: v >= 1, "a positive batch size (the images of all processes together)"),
    "DATALOADER.WORKERS": (lambda v: v >= 0, "0 (load in the training process) or a positive number of workers"),
    "OPTIM.LR": (lambda v: math.isfinite(v) and v >= 0, "a finite learning rate >= 0"),
    "OPTIM.EPOCHS": (lambda v: v >= 1, "a positive number of epochs"),
    "OPTIM.ACCUM_STEPS": (lambda v: v >= 1, "a positive number of batches per optimizer step"),
    "OPTIM.MOM": (lambda v: 0 <= v < 1, "a momentum in [0, 1) (from 1 on, the steps grow without bound)"),
    "OPTIM.NU": (lambda v: 0 <= v <= 1, "a fraction in [0, 1] (qhm's nu)"),
    "OPTIM.WD": (lambda v: math.isfinite(v) and v >= 0, "a finite weight decay >= 0"),
    "OPTIM.WD0": (lambda v: math.isfinite(v) and v >= 0, "a finite weight decay >= 0"),
    "OPTIM.ADAM.BETA1": (lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
    "OPTIM.ADAM.BETA2": (lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
    "OPTIM.ADAM.EPS": (lambda v: math.isfinite(v) and v > 0, "a small positive number"),
    "SEED": (lambda v: 0 <= v < 2**31, "an integer in [0, 2**31) (each process seeds with SEED + its rank)"),
    "OPTIM.CLIP_GRAD": (lambda v: math.isfinite(v) and v >= 0, "a finite gradient norm >= 0 (0: no clipping)"),
    "OPTIM.DROP_FACTOR": (lambda v: math.isfinite(v) and v > 0, "a positive factor"),
    "OPTIM.DROP_FREQ": (lambda v: v >= 1, "a positive number of epochs"),
    "SOLVER.WARMUP_EPOCHS": (lambda v: math.isfinite(v) and v >= 0, "a finite number of epochs >= 0"),
    "SOLVER.WARMUP_FACTOR": (lambda v: math.isfinite(v) and v >= 0, "a finite factor >= 0"),
    "SOLVER.MIN_LR": (lambda v: math.isfinite(v) and v >= 0, "a finite learning rate >= 0"),
    "LOSS.LABEL_SMOOTHING": (lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
    "MODEL.EMA_DECAY": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "MODEL.VIT.DROP": (lambda v: 0 <= v < 1, "a probability in [0, 1)"),
    "MODEL.VIT.DROP_PATH": (lambda v: 0 <= v < 1, "a probability in [0, 1)"),
    "MODEL.VIT.MSVIT.LN_EPS": (lambda v: v > 0, "a positive epsilon"),
    "MODEL.VIT.MSVIT.VIL_MODE_SWITCH": (lambda v: 0 <= v <= 1, "a fraction of the epochs in [0, 1]"),
    "LOG_FREQ": (lambda v: v >= 0, "a number of optimizer steps >= 0 (0: no step lines)"),
    "CHECKPOINT.EVERY_STEPS": (lambda v: v >= 0, "a number of optimizer steps >= 0 (0: once an epoch)"),
    "CHECKPOINT.KEEP": (lambda v: v >= 1, "a positive number of epoch checkpoints"),
    "AUG.MIXUP_PROB": _PROBABILITY,
    "AUG.MIXUP_SWITCH_PROB": _PROBABILITY,
    "AUG.COLOR_JITTER": (
        lambda v: len(v) == 5 and all(math.isfinite(x) and x >= 0 for x in v) and v[3] <= 0.5 and v[4] <= 1,
        "five numbers: brightness, contrast and saturation strengths >= 0, a hue strength in [0, 0.5] and a "
        "probability in [0, 1]",
    ),
    "AUG.TIMM_AUG.COLOR_JITTER": (lambda v: math.isfinite(v) and v >= 0, "a finite strength >= 0 (0: no jitter)"),
    "DATA.CLASSES": (
        lambda v: all(isinstance(x, str) for x in v),
        "folder names as quoted strings, like ['0', '1'] (a YAML number loses leading zeros)",
    ),
    "AUG.GRAY_SCALE": _PROBABILITY,
    "AUG.GAUSSIAN_BLUR": _PROBABILITY,
    "AUG.TIMM_AUG.HFLIP": _PROBABILITY,
    "AUG.TIMM_AUG.VFLIP": _PROBABILITY,
    "AUG.TIMM_AUG.RE_PROB": _PROBABILITY,
    "AUG.SCALE": (lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1, "two fractions, low <= high, in (0, 1]"),
    "AUG.RATIO": (
        lambda v: len(v) == 2 and 0 < v[0] <= v[1] and math.isfinite(v[1]),
        "two positive finite aspect ratios, low <= high",
    ),
    "DATA.TRAIN": (lambda v: len(v) == 1 and isinstance(v[0], str), "one dataset name, like ('imagenet',)"),
    "DATA.TEST": (lambda v: len(v) == 1 and isinstance(v[0], str), "one dataset name, like ('imagenet',)"),
    # timm's Mixup takes these three modes; its "half" is FastCollateMixup's alone, which Mixup would run as "batch".
    "AUG.MIXUP_MODE": (lambda v: v in ("batch", "pair", "elem"), "'batch', 'pair' or 'elem' (timm's Mixup modes)"),
    "AUG.MIXUP": (lambda v: math.isfinite(v) and v >= 0, "a finite Beta alpha >= 0 (0: no mixup)"),
    "AUG.MIXCUT": (
        lambda v: math.isfinite(v) and v >= 0,
        "a finite Beta alpha >= 0 (0: no CutMix, unless AUG.MIXCUT_MINMAX sizes its boxes)",
    ),
    "AUG.MIXCUT_MINMAX": (
        lambda v: not v or (len(v) == 2 and 0 < v[0] <= v[1] <= 1),
        "[] (CutMix boxes from AUG.MIXCUT) or two fractions of the image side, low <= high, in (0, 1]",
    ),
    "AUG.TIMM_AUG.RE_COUNT": (lambda v: v >= 1, "a positive number of erased boxes"),
    "AUG.TIMM_AUG.RE_MODE": (lambda v: v in ("const", "rand", "pixel"), "'const', 'rand' or 'pixel' (timm's)"),
    "AUG.TIMM_AUG.AUTO_AUGMENT": (
        lambda v: not v or _is_timm_policy(v),
        "'' (none) or a policy timm builds: a name, then sections of a key and a number, at least one operation "
        "(n, w >= 1), such as rand-m9-mstd0.5-inc1, augmix-m5, original or v0",
    ),
}


def _is_timm_policy(text):
    """Whether timm's transform factory builds the augmentation policy ``text`` (as it picks the builder), reading
    all of it: timm's builders skip a section without a number (``incl`` for ``inc1``, ``mX``) without a word, and
    take any other RandAugment set than ``tweights``, ``t3a`` and ``t3aw`` as the default one, and build RandAugment of
    ``n0`` or AugMix of ``w0`` operations, which augment nothing."""
    from timm.data import auto_augment

    name, *sections = text.split("-")
    for section in sections:
        if name == "rand" and section in ("tweights", "t3a", "t3aw"):  # RandAugment's named sets of operations
            continue
        parsed = re.fullmatch(r"([a-z]+)(\d+(?:\.\d+)?)", section)
        if not parsed or (parsed[1] in ("n", "w") and float(parsed[2]) == 0):
            return False

    if text.startswith("rand"):
        build = auto_augment.rand_augment_transform
    elif text.startswith("augmix"):
        build = auto_augment.augment_and_mix_transform
    else:
        build = auto_augment.auto_augment_transform
    try:
        build(text, {})
    except (AssertionError, ValueError, KeyError, IndexError):
        return False
    return True


def check_values(cfg, source=None):
    """Raise one ``ValueError`` for the first value outside its key's range (naming ``source`` if given)."""
    for key, (test, expected) in _RULES.items():
        value = config_value(cfg, key)
        try:
            fine = bool(test(value))
        except (TypeError, ValueError):
            fine = False
        if not fine:
            raise ValueError(
                f"{'In ' + source + ', ' if source else ''}{key} is {_shown(value)}, but it must be {expected}."
            )
    where = f"In {source}, " if source else ""
    if cfg.SOLVER.LR_POLICY in ("cosine", "linear") and cfg.SOLVER.MIN_LR > cfg.OPTIM.LR:  # they decay to MIN_LR
        raise ValueError(
            f"{where}SOLVER.MIN_LR {cfg.SOLVER.MIN_LR:g} is above OPTIM.LR {cfg.OPTIM.LR:g}, so the schedule would "
            "rise to it; give a SOLVER.MIN_LR of at most OPTIM.LR."
        )
    if cfg.INPUT.IMAGE_SIZE / cfg.INPUT.CROP_PCT > LARGEST_SIZE:  # the side evaluation resizes images to
        raise ValueError(
            f"{where}INPUT.IMAGE_SIZE {cfg.INPUT.IMAGE_SIZE} / INPUT.CROP_PCT {cfg.INPUT.CROP_PCT:g}, the side the "
            f"evaluation resizes images to, is above {LARGEST_SIZE} pixels; give a larger INPUT.CROP_PCT."
        )


# An empty --config-file (an unset variable, $CFG) is refused, not read as the defaults.
EMPTY_CONFIG_FILE = "--config-file is empty; give a YAML file or a preset's name (vil_tiny, vil_small, ...)"


def config_from_command_line(description, argv=None):
    """The tools' command line, ``--config-file F [KEY VALUE ...]``, as a config from :func:`load_cfg`."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--config-file", required=True, help="a YAML file, or a preset's name (vil_tiny, vil_small, ...)"
    )
    parser.add_argument("opts", nargs="*", metavar="KEY VALUE", help="config overrides")
    args = parser.parse_intermixed_args(argv)  # --config-file after the overrides too
    if not args.config_file:
        parser.error(EMPTY_CONFIG_FILE)
    return load_cfg(args.config_file, args.opts)
