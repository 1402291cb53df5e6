"""The yacs config: the original release's keys and files, and clear errors; every key is read."""

import ast
import re
from pathlib import Path

import pytest

from vil.config import (
    COMPATIBILITY_KEYS,
    MODEL_ARGUMENT_KEYS,
    compatibility_warnings,
    config_items,
    config_value,
    get_cfg,
    load_cfg,
)

ORIGINAL_STYLE_YAML = """
INPUT:
  INTERPOLATION: 3
AUG:
  MIXUP_PROB: 1.0
  TIMM_AUG:
    USE_TRANSFORM: True
    RE_PROB: 0.25
    AUTO_AUGMENT: rand-m9-mstd0.5-inc1
DATALOADER:
  BSZ: 256
  WORKERS: 6
OPTIM:
  LR: 5.0e-4
  WD: 0.05
SOLVER:
  LR_POLICY: cosine
  WARMUP_FACTOR: 0.002
MODEL:
  ARCH: msvit
  VIT:
    MSVIT:
      ARCH: 'l1,h1,d48,n1,s1,g1,p4,f7_l2,h3,d96,n1,s1,g1,p2,f7_l3,h3,d192,n9,s0,g1,p2,f7_l4,h6,d384,n1,s0,g0,p2,f7'
      ATTN_TYPE: longformerhand
      LN_EPS: 1.0e-06
      ONLY_GLOBAL: False
EVALUATE: True
"""


def test_defaults_are_the_original_releases():
    cfg = get_cfg()
    assert cfg.MODEL.VIT.MSVIT.ATTN_TYPE == "longformerhand"
    assert cfg.MODEL.VIT.MSVIT.SW_EXACT == 0 and cfg.MODEL.VIT.MSVIT.MODE == 0
    assert cfg.MODEL.VIT.MSVIT.VIL_MODE_SWITCH == 0.75 and cfg.MODEL.VIT.MSVIT.LN_EPS == 1e-6
    assert cfg.MODEL.VIT.DROP_PATH == 0.1 and cfg.MODEL.VIT.NORM_EMBED is True
    assert cfg.INPUT.CROP_PCT == 0.875
    get_cfg().INPUT.IMAGE_SIZE = 1  # a fresh copy each time
    assert get_cfg().INPUT.IMAGE_SIZE == 224


def test_original_style_yaml_and_overrides(tmp_path):
    path = tmp_path / "msvit.yaml"
    path.write_text(ORIGINAL_STYLE_YAML)
    cfg = load_cfg(path, ["MODEL.VIT.MSVIT.SW_EXACT", "-1", "OPTIM.EPOCHS", "10"])
    assert cfg.AUG.TIMM_AUG.RE_PROB == 0.25 and cfg.AUG.TIMM_AUG.AUTO_AUGMENT == "rand-m9-mstd0.5-inc1"
    assert cfg.MODEL.VIT.MSVIT.SW_EXACT == -1 and cfg.OPTIM.EPOCHS == 10 and cfg.EVALUATE is True
    assert cfg.is_frozen()


def test_unknown_keys_name_the_key(tmp_path):
    with pytest.raises(
        ValueError, match=r"Unknown config key MODEL.VIT.MSVIT.ATTNTYPE \(did you mean MODEL.VIT.MSVIT.ATTN_TYPE\?\)"
    ):
        load_cfg(overrides=["MODEL.VIT.MSVIT.ATTNTYPE", "full"])
    path = tmp_path / "typo.yaml"
    path.write_text("MODEL:\n  VIT:\n    DROPPATH: 0.2\n")
    with pytest.raises(
        ValueError, match=r"Unknown config key MODEL.VIT.DROPPATH \(did you mean MODEL.VIT.DROP_PATH\?\)"
    ):
        load_cfg(path)
    with pytest.raises(ValueError, match=r"Unknown config key optim.lr \(did you mean OPTIM.LR\?\)"):
        load_cfg(overrides=["optim.lr", "0.1"])
    with pytest.raises(ValueError, match=r"Unknown config key ZEBRA.STRIPES: "):  # nothing close: no guess
        load_cfg(overrides=["ZEBRA.STRIPES", "1"])
    with pytest.raises(ValueError, match=r"Unknown config key AUG.TIMM_AUG.RE_PROBABILITY"):
        load_cfg(overrides=["AUG.TIMM_AUG.RE_PROBABILITY", "0.25"])  # timm's options are keys like any other
    with pytest.raises(ValueError, match="KEY VALUE pairs"):
        load_cfg(overrides=["OPTIM.LR"])
    with pytest.raises(
        ValueError,
        match=r"INPUT.IMAGE_SIZE is 'big'.*integer.*224",
    ):
        load_cfg(overrides=["INPUT.IMAGE_SIZE", "big"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("MODEL:\n  ARCH: [msvit\n", r"YAML.*bad.yaml.*line 3"),
        (
            "- MODEL\n- OPTIM\n",
            r"mapping of config keys.*bad.yaml.*list",
        ),
        ("MODEL: 5\n", r"MODEL is 5.*section.*'MODEL: \{ARCH"),
        ("OPTIM:\n  LR: None\n", r"OPTIM.LR is None.*number.*1.0"),
        ("OPTIM:\n  LR: .inf\n", r"OPTIM.LR is inf.*finite"),
        ("DATALOADER:\n  BSZ: 0\n", r"DATALOADER.BSZ is 0.*positive"),
        ("DATALOADER:\n  BSZ: -8\n", r"DATALOADER.BSZ is -8.*positive"),
        ("AMP:\n  DTYPE: fp8\n", r"AMP.DTYPE is 'fp8'.*'bfloat16' or 'float16'"),
        ("INPUT:\n  CROP_PCT: 0.0\n", r"INPUT.CROP_PCT is 0.0.*\(0, 1\]"),
        ("SEED: -1\n", r"SEED is -1.*\[0, 2\*\*31\)"),
        ("OUTPUT_DIR: ''\n", r"OUTPUT_DIR is ''.*a folder to write the run into"),
        ("OPTIM:\n  WD: -0.1\n", r"OPTIM.WD is -0.1.*>= 0"),
        ("OPTIM:\n  MOM: -1.0\n", r"OPTIM.MOM is -1.0.*\[0, 1\)"),
        ("OPTIM:\n  MOM: 1.5\n", r"OPTIM.MOM is 1.5.*\[0, 1\)"),
        ("OPTIM:\n  ADAM:\n    BETA1: 1.5\n", r"OPTIM.ADAM.BETA1 is 1.5.*\[0, 1\)"),
        ("OPTIM:\n  LR: 0.001\nSOLVER:\n  LR_POLICY: cosine\n  MIN_LR: 1.0\n", r"MIN_LR 1 is above OPTIM.LR 0.001"),
        ("AUG:\n  MIXUP_MODE: half\n", r"AUG.MIXUP_MODE is 'half'.*'batch', 'pair' or 'elem'"),
        ("AUG:\n  MIXUP_PROB: 1.5\n", r"AUG.MIXUP_PROB is 1.5.*probability in \[0, 1\]"),
        ("AUG:\n  TIMM_AUG:\n    HFLIP: -0.5\n", r"AUG.TIMM_AUG.HFLIP is -0.5.*probability in \[0, 1\]"),
        ("AUG:\n  MIXCUT: -1.0\n", r"AUG.MIXCUT is -1.0.*alpha >= 0"),
        ("AUG:\n  MIXCUT_MINMAX: [0.2]\n", r"AUG.MIXCUT_MINMAX is \[0.2\].*two fractions.*\(0, 1\]"),
        ("AUG:\n  MIXCUT_MINMAX: [0.8, 0.2]\n", r"AUG.MIXCUT_MINMAX is \[0.8, 0.2\].*low <= high"),
        ("AUG:\n  TIMM_AUG:\n    RE_MODE: bogus\n", r"AUG.TIMM_AUG.RE_MODE is 'bogus'.*'const', 'rand' or 'pixel'"),
        ("AUG:\n  TIMM_AUG:\n    AUTO_AUGMENT: rand-x9\n", r"AUTO_AUGMENT is 'rand-x9'.*rand-m9-mstd0.5-inc1"),
        ("AUG:\n  TIMM_AUG:\n    AUTO_AUGMENT: rand-m9-incl\n", r"AUTO_AUGMENT is 'rand-m9-incl'.*key and a number"),
        ("AUG:\n  TIMM_AUG:\n    AUTO_AUGMENT: rand-mX-inc1\n", r"AUTO_AUGMENT is 'rand-mX-inc1'.*key and a number"),
        ("AUG:\n  TIMM_AUG:\n    AUTO_AUGMENT: rand-m9-n0\n", r"AUTO_AUGMENT is 'rand-m9-n0'.*n, w >= 1"),
        ("AUG:\n  TIMM_AUG:\n    AUTO_AUGMENT: augmix-m5-w0\n", r"AUTO_AUGMENT is 'augmix-m5-w0'.*n, w >= 1"),
        ("OPTIM:\n  LR: 0.1\nDATA:\n  PATH: x\nOPTIM:\n  EPOCHS: 3\n", r"line 5 \(key 'OPTIM' is given twice"),
        ("OPTIM:\n  LR: 0.1\n  LR: 0.2\n", r"line 3 \(key 'LR' is given twice"),
        ("INPUT:\n  MEAN: [123.675, 116.28, 103.53]\n", r"INPUT.MEAN is \[123.675.*\[0, 1\].*not 0-255"),
        ("INPUT:\n  STD: [58.395, 57.12, 57.375]\n", r"INPUT.STD is \[58.395.*\(0, 1\].*not 0-255"),
        ("AUG:\n  COLOR_JITTER: [0.4, 0.4, 0.4, 0.9, 0.8]\n", r"AUG.COLOR_JITTER is .*hue strength in \[0, 0.5\]"),
        ("AUG:\n  COLOR_JITTER: [0.4, 0.4, 0.4, 0.1, 1.5]\n", r"AUG.COLOR_JITTER is .*probability in \[0, 1\]"),
        ("AUG:\n  TIMM_AUG:\n    COLOR_JITTER: -0.4\n", r"AUG.TIMM_AUG.COLOR_JITTER is -0.4.*>= 0"),
        ("DATA:\n  CLASSES: [3, 5]\n", r"DATA.CLASSES is \[3, 5\].*quoted strings"),
        ("AUG:\n  RATIO: [1.0, .inf]\n", r"AUG.RATIO is \(1.0, inf\).*finite"),
        ("INPUT:\n  CROP_PCT: 1.0e-12\n", r"INPUT.IMAGE_SIZE 224 / INPUT.CROP_PCT 1e-12.*above 2147483647.*CROP_PCT"),
        ("INPUT:\n  IMAGE_SIZE: 99999999999999999999\n", r"IMAGE_SIZE is 99999999999999999999.*at most 2147483647"),
        ("? [a, b]\n: 1\n", r"Not valid YAML.* at line 1 \(a key is a list, not a name\)"),
        ("OPTIM:\n  {LR: 1}: 0.1\n", r"Not valid YAML.* at line 2 \(a key is a dict, not a name\)"),
        ("INPUT:\n  MEAN: [true, 0.5, 0.5]\n", r"INPUT.MEAN is \[True, 0.5, 0.5\].*items.*not True or False"),
        ("DATA:\n  CLASSES: [yes, no]\n", r"DATA.CLASSES is \[True, False\].*quoted text.*yes, no"),
        ("OPTIM: &o\n  LR: 0.2\nSOLVER:\n  <<: *o\n", r"Unknown config key SOLVER.LR"),  # YAML's merge keys are read
    ],
)
def test_malformed_config_files_are_one_sentence(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as caught:
        load_cfg(path)
    assert "\n" not in str(caught.value)


def test_integers_are_accepted_for_float_keys_and_lists_for_tuples():
    cfg = load_cfg(overrides=["OPTIM.LR", "1", "AUG.SCALE", "[0.5, 1.0]"])
    assert cfg.OPTIM.LR == 1.0 and isinstance(cfg.OPTIM.LR, float) and cfg.AUG.SCALE == (0.5, 1.0)


def test_text_that_reads_as_a_number_stays_text_for_keys_of_text(tmp_path):
    """A folder named 2024 on the command line, or quoted in YAML, is a path, not a number refused as one."""
    (tmp_path / "c.yaml").write_text('OUTPUT_DIR: "2024"\nDATA: {PATH: "1e3"}\n')
    cfg = load_cfg(tmp_path / "c.yaml", ["MODEL.MODEL_PATH", "7", "DATA.DATA_DIR", "'8'"])
    assert (cfg.OUTPUT_DIR, cfg.DATA.PATH, cfg.MODEL.MODEL_PATH, cfg.DATA.DATA_DIR) == ("2024", "1e3", "7", "8")


def test_a_leading_tilde_in_a_path_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("OUTPUT_DIR: ~/runs/a\nDATA:\n  PATH: ~/imagenet\n")
    cfg = load_cfg(tmp_path / "c.yaml", ["MODEL.MODEL_PATH", "~/best.pth"])
    assert cfg.OUTPUT_DIR == str(tmp_path / "runs" / "a") and cfg.DATA.PATH == str(tmp_path / "imagenet")
    assert cfg.MODEL.MODEL_PATH == str(tmp_path / "best.pth") and cfg.DATA.DATA_DIR == "./data"


def test_a_value_of_the_wrong_type_names_the_value_the_key_had():
    # under a preset, the preset's value, not vil/config.py's default (1.0)
    with pytest.raises(ValueError, match=r"OPTIM.LR is 'abc', but it must be a number \(until then it was 0.003\)"):
        load_cfg("vil_digits", ["OPTIM.LR", "abc"])


def test_compatibility_only_keys_warn_when_set():
    assert compatibility_warnings(get_cfg()) == []
    cfg = load_cfg(overrides=["MODEL.PRETRAINED", "True", "OPTIM.LR", "0.5"])
    assert compatibility_warnings(cfg) == [
        "MODEL.PRETRAINED True is ignored: this key only lets the original release's YAML files load "
        "(there: torchvision's ResNet weights (ViL weights come from MODEL.MODEL_PATH))."
    ]
    (warning,) = compatibility_warnings(load_cfg(overrides=["AUG.TIMM_AUG.RE_SPLIT", "True"]))
    assert warning.startswith("AUG.TIMM_AUG.RE_SPLIT True is ignored") and "augmentation split" in warning


def _read_names(paths):
    """What the code reads from a config: every chain of upper-case attributes (``cfg.OPTIM.ADAM.EPS`` gives
    ``OPTIM.ADAM.EPS``, ``adam.EPS`` gives ``EPS``) and every upper-case string given to ``.get``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.isupper():
                chain, inner = [node.attr], node.value
                while isinstance(inner, ast.Attribute) and inner.attr.isupper():
                    chain.insert(0, inner.attr)
                    inner = inner.value
                names.add(".".join(chain))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                names.update(a.value for a in node.args[:1] if isinstance(a, ast.Constant) and str(a.value).isupper())
    return names


def test_every_config_key_is_read_or_declared_for_compatibility():
    root = Path(__file__).resolve().parents[1]
    sources = [p for p in [*(root / "vil").rglob("*.py"), *(root / "tools").glob("*.py")] if p.name != "config.py"]
    # The model's arguments are read by name (vil.model_config.model_kwargs, through MODEL_ARGUMENT_KEYS).
    read = _read_names(sources) | set(MODEL_ARGUMENT_KEYS.values())
    keys = [key for key, _ in config_items(get_cfg())]

    def is_read(key):
        # A name read counts for the key it ends, when it ends no other key (a bare EPS must be unambiguous).
        return any(
            (key == name or key.endswith("." + name)) and sum(k == name or k.endswith("." + name) for k in keys) == 1
            for name in read
        )

    unread = [k for k in keys if not is_read(k) and k not in COMPATIBILITY_KEYS]
    assert unread == [], f"config keys nothing reads (use them, or declare them in COMPATIBILITY_KEYS): {unread}"
    read_anyway = [k for k in COMPATIBILITY_KEYS if is_read(k)]
    assert read_anyway == [], f"keys declared compatibility-only that the code reads: {read_anyway}"
    assert set(COMPATIBILITY_KEYS) <= set(keys)


def test_config_files_are_found_by_what_they_are(tmp_path, monkeypatch):
    (tmp_path / "latin.yaml").write_bytes(b"OPTIM:\n  LR: 0.1\n# caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin.yaml is not UTF-8 text \(byte 22\)"):
        load_cfg(tmp_path / "latin.yaml")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vil_digits").mkdir()  # an OUTPUT_DIR named as the preset: the preset is meant
    assert load_cfg("vil_digits").OPTIM.EPOCHS == 60
    with pytest.raises(ValueError, match=r"vil_tiny.yaml \(No such file.*the preset vil_tiny is given by its name"):
        load_cfg("vil_tiny.yaml")  # no such file here: the preset's name has no suffix


def test_an_empty_config_file_argument_is_refused(capsys):
    from vil.config import config_from_command_line

    with pytest.raises(SystemExit) as exit_info:  # as from an unset $CFG: not the defaults
        config_from_command_line("a tool", ["--config-file", ""])
    assert exit_info.value.code == 2 and "--config-file is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--config-file is empty; give a YAML file or a preset's name"):
        load_cfg("")  # the tools that read --config-file themselves


def test_the_config_file_may_follow_the_overrides_and_negative_values_stay_values():
    from vil.config import config_from_command_line

    argv = ["OPTIM.LR", "0.1", "--config-file", "vil_tiny", "MODEL.VIT.MSVIT.SW_EXACT", "-1"]
    cfg = config_from_command_line("a tool", argv)
    assert cfg.OPTIM.LR == 0.1 and cfg.MODEL.VIT.MSVIT.SW_EXACT == -1 and cfg.MODEL.VIT.MSVIT.ARCH


# Each range's bound: the first value is just outside it, the second just inside.
BOUNDS = [
    ("OPTIM.MOM", "1.0", "0.0"),
    ("OPTIM.NU", "1.01", "1.0"),
    ("OPTIM.ADAM.BETA1", "1.0", "0.0"),
    ("OPTIM.ADAM.BETA2", "1.0", "0.999"),
    ("OPTIM.ADAM.EPS", "0.0", "1e-12"),
    ("OPTIM.LR", "-1e-9", "0.0"),
    ("OPTIM.EPOCHS", "0", "1"),
    ("OPTIM.ACCUM_STEPS", "0", "1"),
    ("SEED", "2147483648", "2147483647"),
    ("LOSS.LABEL_SMOOTHING", "1.0", "0.0"),
    ("MODEL.EMA_DECAY", "1.01", "1.0"),
    ("MODEL.VIT.DROP", "1.0", "0.0"),
    ("MODEL.VIT.DROP_PATH", "1.0", "0.99"),
    ("MODEL.VIT.MSVIT.LN_EPS", "0.0", "1e-12"),
    ("MODEL.VIT.MSVIT.VIL_MODE_SWITCH", "1.01", "1.0"),
    ("CHECKPOINT.KEEP", "0", "1"),
    ("CHECKPOINT.EVERY_STEPS", "-1", "0"),
    ("LOG_FREQ", "-1", "0"),
    ("DATALOADER.WORKERS", "-1", "0"),
    ("AUG.MIXUP_PROB", "1.01", "1.0"),
    ("AUG.SCALE", "[0.9, 0.2]", "[0.2, 0.2]"),
    ("AUG.SCALE", "[0.0, 0.5]", "[0.5, 1.0]"),
]


@pytest.mark.parametrize("key,outside,inside", BOUNDS)
def test_each_range_refuses_the_value_beyond_its_bound_and_takes_the_bound(key, outside, inside):
    with pytest.raises(ValueError, match=rf"^{re.escape(key)} is .*, but it must be "):
        load_cfg(overrides=[key, outside])
    taken = config_value(load_cfg(overrides=[key, inside]), key)
    assert (list(taken) if isinstance(taken, tuple) else taken) == ast.literal_eval(inside)
