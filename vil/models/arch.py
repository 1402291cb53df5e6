"""The architecture string of ``MODEL.VIT.MSVIT.ARCH`` and the named presets."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import LARGEST_SIZE, did_you_mean

GRAMMAR = (
    'stages separated by "_", each a comma-separated list of <letter><integer> fields: l (stage index, '
    "1-based), h (heads), d (hidden size), n (layers), s (1 local / 0 full attention), g (global tokens), "
    "p (patch size), f (window), a (1 absolute position embedding / 0 relative bias); "
    'e.g. "l1,h3,d96,n1,s1,g1,p4,f7,a1_l2,h3,d192,n2,s1,g1,p2,f7,a1_l3,h6,d384,n8,s0,g1,p2,f7,a1"'
)
_FIELDS = {
    "l": "index",
    "h": "heads",
    "d": "dim",
    "n": "depth",
    "s": "local",
    "g": "num_global",
    "p": "patch",
    "f": "window",
    "a": "ape",
}
_DEFAULTS = {"l": 1, "h": 3, "d": 192, "n": 1, "s": 1, "g": 1, "p": 2, "f": 7, "a": 1}
_MINIMUM = {"l": 1, "h": 1, "d": 1, "n": 1, "s": 0, "g": 0, "p": 1, "f": 1, "a": 0}
_MAXIMUM = {"s": 1, "a": 1}  # the other fields are sizes, at most LARGEST_SIZE


@dataclass(frozen=True)
class StageSpec:
    index: int
    heads: int
    dim: int
    depth: int
    local: bool  # False: full attention whatever ATTN_TYPE says
    num_global: int
    patch: int
    window: int
    ape: bool  # absolute position embedding; False: relative position bias


def parse_arch(arch: str) -> list[StageSpec]:
    """``"l1,h3,d96,..._l2,..."`` -> a list of 3 or 4 :class:`StageSpec`; malformed strings raise ``ValueError``."""
    if not isinstance(arch, str):
        raise ValueError(f"An arch string is a str ({GRAMMAR}), got {type(arch).__name__} {arch!r}.")
    if arch in PRESETS:
        raise ValueError(
            f"{arch!r} is the name of a preset, not an arch string; give its arch string, vil.models.PRESETS[{arch!r}]"
            ", or build it by name (timm.create_model, vil.detection.build_fpn_backbone)."
        )
    if not any(ch.isdigit() for ch in arch):  # every arch string has numbers: a name, likely a preset's misspelt
        raise ValueError(
            f"{arch!r} is neither a preset's name{did_you_mean(arch, PRESETS)} ({', '.join(PRESETS)}) nor an arch "
            f"string ({GRAMMAR})."
        )
    stages = arch.split("_")
    if len(stages) not in (3, 4):
        counted = "1 stage" if len(stages) == 1 else f"{len(stages)} stages"
        raise ValueError(f"Arch string {arch!r} has {counted}; it needs 3 or 4: {GRAMMAR}.")
    specs = []
    for position, stage in enumerate(stages, start=1):
        values = dict(_DEFAULTS)
        seen = set()
        for field in stage.split(","):
            letter, number = field[:1], field[1:]
            where = f"Arch string stage {position} ({stage!r}), field {field!r}"
            if letter not in _FIELDS:
                raise ValueError(f"{where}: unknown letter {letter!r}; {GRAMMAR}.")
            if letter in seen:
                raise ValueError(f"{where}: {letter!r} is given twice; {GRAMMAR}.")
            if not (number.isascii() and number.isdigit()):  # str.isdigit takes superscripts, which int() refuses
                raise ValueError(f"{where}: {letter!r} must be followed by a non-negative integer; {GRAMMAR}.")
            value = int(number)
            low, high = _MINIMUM[letter], _MAXIMUM.get(letter, LARGEST_SIZE)
            if not low <= value <= high:
                allowed = f"{low} or {high}" if high == 1 else f"at least {low} and at most {high}"
                raise ValueError(f"{where}: {letter} ({_FIELDS[letter]}) must be {allowed}; {GRAMMAR}.")
            seen.add(letter)
            values[letter] = value
        if values["l"] != position:
            raise ValueError(
                f"Arch string stage {position} ({stage!r}) says l{values['l']}: "
                f"stage indices must be 1, 2, 3(, 4) in order; {GRAMMAR}."
            )
        if values["d"] % values["h"]:
            raise ValueError(
                f"Arch string stage {position} ({stage!r}): "
                f"hidden size d{values['d']} is not divisible by heads h{values['h']}."
            )
        if values["a"] and values["d"] % 2:
            raise ValueError(
                f"Arch string stage {position} ({stage!r}): absolute position embedding (a1) splits d between rows "
                f"and columns, so d{values['d']} must be even."
            )
        specs.append(StageSpec(**{_FIELDS[k]: (bool(v) if k in "sa" else v) for k, v in values.items()}))
    return specs


def arch_string(specs: Iterable[StageSpec]) -> str:
    """The arch string of a list of :class:`StageSpec` (the inverse of :func:`parse_arch`)."""
    return "_".join(
        f"l{s.index},h{s.heads},d{s.dim},n{s.depth},s{int(s.local)},g{s.num_global},p{s.patch},f{s.window},a{int(s.ape)}"
        for s in specs
    )


def stage_map_sizes(
    specs: Iterable[StageSpec], image_size: tuple[int, int], pad: bool = False
) -> list[tuple[int, int]]:
    """The (rows, columns) of every stage's feature map for an image of ``image_size`` (H, W): each patch
    embedding drops the rows and columns that do not fill a patch (as the original release's convolution
    does), or, with ``pad``, pads its input at the bottom and right to a multiple of its patch size."""
    rows, cols = image_size
    sizes = []
    for spec in specs:
        if pad:
            rows, cols = -(-rows // spec.patch), -(-cols // spec.patch)
        else:
            rows, cols = rows // spec.patch, cols // spec.patch
        sizes.append((rows, cols))
    return sizes


def _arch(stages, windows=(7, 7, 7, 7), ape=True, local_stages=2, num_global=(1, 1, 1, 0)):
    """Arch string of a preset: ``stages`` as (layers, patch, heads, dim); stages 1..local_stages local (s1), the
    others full attention."""
    return arch_string(
        StageSpec(index=i, heads=h, dim=d, depth=n, local=i <= local_stages, num_global=g, patch=p, window=f, ape=ape)
        for i, ((n, p, h, d), f, g) in enumerate(zip(stages, windows, num_global), start=1)
    )


_PRESET_STAGES = {
    "vil_tiny": (((1, 4, 1, 48), (1, 2, 3, 96), (9, 2, 3, 192), (1, 2, 6, 384)), (7, 7, 7, 7)),
    "vil_small": (((1, 4, 3, 96), (2, 2, 3, 192), (8, 2, 6, 384), (1, 2, 12, 768)), (7, 7, 7, 7)),
    "vil_medium_deep": (((1, 4, 3, 96), (4, 2, 3, 192), (16, 2, 6, 384), (1, 2, 12, 768)), (7, 7, 7, 7)),
    "vil_medium_wide": (((1, 4, 3, 192), (2, 2, 6, 384), (8, 2, 8, 512), (1, 2, 12, 768)), (7, 7, 7, 7)),
    "vil_base_deep": (((1, 4, 3, 96), (8, 2, 3, 192), (24, 2, 6, 384), (1, 2, 12, 768)), (6, 8, 7, 7)),
    "vil_base_wide": (((1, 4, 3, 192), (2, 2, 6, 384), (8, 2, 12, 768), (1, 2, 16, 1024)), (8, 8, 7, 7)),
}
# Preset name -> arch string (absolute position embedding, as in the paper's parameter counts).
PRESETS: dict[str, str] = {name: _arch(stages, windows) for name, (stages, windows) in _PRESET_STAGES.items()}
# The relative-position-bias variants.
PRESETS.update({f"{name}_rpb": _arch(stages, windows, ape=False) for name, (stages, windows) in _PRESET_STAGES.items()})


def small_arch(
    local_stages: int = 2, windows: Sequence[int] = (7, 7, 7, 7), num_global: Sequence[int] = (1, 1, 1, 0)
) -> str:
    """A ViL-Small-sized arch string: ViL-Small's stages, the first ``local_stages`` of them s1 (the others full
    attention), with these f fields and global-token counts."""
    return _arch(_PRESET_STAGES["vil_small"][0], windows, local_stages=local_stages, num_global=num_global)


# The ViL-Small-sized models of the original release's attention comparison: name -> (arch string, the MsViT
# arguments of its attention). "partial": the mechanism in stages 1-2 only, full attention after. f is linformer's
# projected token count, srformer's reduction ratio (per stage, as the published models' parameter counts say) and
# performer's number of random features; "global" is longformer attention with ONLY_GLOBAL (local queries attend to
# the global tokens only), 64 global tokens in each of its stages.
COMPARISONS: dict[str, tuple[str, dict[str, Any]]] = {
    "vil_small_full": (PRESETS["vil_small"], dict(attention="full")),
    "vil_small_linformer": (small_arch(4, (256,) * 4), dict(attention="linformer", share_kv=True)),
    "vil_small_linformer_partial": (small_arch(2, (256, 256, 7, 7)), dict(attention="linformer", share_kv=True)),
    "vil_small_srformer64": (small_arch(4, (16, 8, 4, 2)), dict(attention="srformer")),
    "vil_small_srformer32": (small_arch(3, (8, 4, 2, 7)), dict(attention="srformer")),
    "vil_small_srformer32_partial": (small_arch(2, (8, 4, 7, 7)), dict(attention="srformer")),
    "vil_small_performer": (small_arch(4, (256,) * 4), dict(attention="performer")),
    "vil_small_performer_partial": (small_arch(2, (256, 256, 7, 7)), dict(attention="performer")),
    "vil_small_global": (small_arch(4, num_global=(64,) * 4), dict(attention="longformer", only_global=True)),
    "vil_small_global_partial": (
        small_arch(2, num_global=(64, 64, 1, 0)),
        dict(attention="longformer", only_global=True),
    ),
}
