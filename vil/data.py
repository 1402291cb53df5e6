"""Datasets, transforms and batch mixing, built from the config.

``DATA.TRAIN`` / ``DATA.TEST`` name the data: ``('imagenet',)`` (or any other name) reads ImageNet-style
folders under ``DATA.PATH``; ``('digits',)`` is the 1,797 handwritten digits that scikit-learn ships.
``DATA.CLASSES`` keeps a subset of the classes, labelled in the order it lists them.
"""

import logging
import os
from unicodedata import normalize

import numpy as np
import torch
from PIL import Image
from timm.data import Mixup, auto_augment, create_transform
from torch.utils.data import Dataset, default_collate
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from .config import keys_set, warn_unread_keys
from .files import not_a_folder
from .images import read_image
from .shards import ShardDataset
from .unreadable import Unreadable, skipped

EXPECTED_LAYOUT = "DATA.PATH/train/<class>/<image> and DATA.PATH/val/<class>/<image>"
# The training transforms' own keys: each branch of build_transform leaves the others' unread.
_TIMM_KEYS = tuple(
    f"AUG.TIMM_AUG.{k}" for k in ("VFLIP", "COLOR_JITTER", "AUTO_AUGMENT", "RE_PROB", "RE_MODE", "RE_COUNT")
)
# The side of the Gaussian blur of timm's create_transform (gaussian_blur_prob), which pads by half of it.
TIMM_BLUR_KERNEL = 23
_PLAIN_KEYS = ("AUG.COLOR_JITTER", "AUG.GRAY_SCALE", "AUG.GAUSSIAN_BLUR")
_CROP_KEYS = ("AUG.SCALE", "AUG.RATIO")
# INPUT.INTERPOLATION holds PIL's codes, as in the original release.
INTERPOLATIONS = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # INPUT.INTERPOLATION (PIL codes) -> timm's names

log = logging.getLogger("vil")


class SkippingImageFolder(ImageFolder):
    """An ImageFolder whose images that cannot be decoded or transformed (corrupt, truncated, not images,
    decompression bombs, odd modes) come out as :class:`Unreadable`, which :func:`collate_skipping` drops,
    counts and names. ``classes``: the class folders to keep, labelled in that order (None: all, sorted).
    ``may_lack``: evaluation data, which may have no images of some of ``classes`` (said once in the log)."""

    def __init__(self, root, transform=None, classes=None, may_lack=False):
        self.chosen = list(classes) if classes else None
        self.may_lack = may_lack and self.chosen is not None
        try:
            super().__init__(root, transform, loader=read_image, allow_empty=self.may_lack)
        except FileNotFoundError:  # torchvision's words for a folder without class folders, or a class without images
            if not os.path.isdir(root):
                raise ValueError(f"{root} does not exist; give a folder of class folders, {EXPECTED_LAYOUT}.") from None
            folders = self.chosen or class_folders(root)
            raise ValueError(_without_images(root, folders)) from None
        if self.may_lack:
            lacking = sorted(set(self.classes) - {self.classes[target] for target in self.targets})
            if lacking:
                log.warning(
                    f"{root} has no images of {len(lacking)} of the {len(self.classes)} classes, {lacking}: the "
                    "evaluation scores the others, labelled as the model's classes."
                )

    def find_classes(self, directory):
        found, _ = super().find_classes(directory)
        if self.chosen is None:
            return found, {name: i for i, name in enumerate(found)}
        kept = _checked_subset(self.chosen, self.chosen if self.may_lack else found, directory)
        return kept, {name: i for i, name in enumerate(kept)}

    def __getitem__(self, index):
        path, target = self.samples[index]
        return loaded_or_skipped(path, target, self.transform)


def class_folders(root):
    """The class folders of ``root``, sorted (as ImageFolder finds them)."""
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir())


def holds_images(folder):
    """Whether ``folder``, or a folder in it, holds a file named as an image (``IMG_EXTENSIONS``)."""
    return any(f.lower().endswith(IMG_EXTENSIONS) for _, _, files in os.walk(folder, followlinks=True) for f in files)


def _lacks_some_of(root, classes):
    """Whether the class folders of ``root`` are some of ``classes`` and hold images of fewer than all of them (a
    class without a folder, or with an empty one)."""
    folders = class_folders(root)
    with_images = {name for name in folders if holds_images(os.path.join(root, name))}
    return set(folders) <= set(classes) and with_images < set(classes)


def _without_images(root, classes):
    """One sentence on what of ``root`` holds no images: its class folders (``classes``), or the first without."""
    if not classes:
        return f"{root} has no class folders; put each class's images in {root}/<class>/ ({EXPECTED_LAYOUT})."
    for name in classes:
        if not holds_images(os.path.join(root, name)):
            return f"{os.path.join(root, name)} holds no images ({', '.join(IMG_EXTENSIONS)}); add some or remove it."
    return f"{root} holds no images of its classes; the data must be ImageNet-style folders, {EXPECTED_LAYOUT}."


def loaded_or_skipped(path, target, transform):
    """``(transform(image), target)`` of the image file at ``path`` (:func:`vil.images.read_image`), or the
    :class:`Unreadable` that names it."""
    try:
        image = read_image(path)
        return (transform(image) if transform else image), target
    except Exception as e:  # a decoder can fail in many ways on crafted bytes; each is one skipped file
        return skipped(path, e)


class DigitsDataset(Dataset):
    """scikit-learn's 1,797 8x8 handwritten digits as RGB images, with a fixed stratified split: 20% of each
    class held out for evaluation (359 images), the rest for training (1,438). ``classes``: the digits to keep
    (names ``"0"`` to ``"9"``), labelled in that order (None: all ten)."""

    def __init__(self, train, transform=None, held_out=0.2, classes=None):
        try:
            from sklearn.datasets import load_digits
        except ImportError as error:  # a ValueError, as the other missing extras: the tools print it as one line
            raise ValueError(
                f"The digits data set comes with scikit-learn ({error}); install it with pip install 'vil[digits]'."
            ) from None

        names = [str(d) for d in range(10)]
        self.classes = list(classes) if classes else names
        label_of = {int(name): i for i, name in enumerate(_checked_subset(self.classes, names, "the digits"))}
        digits = load_digits()
        rng = np.random.default_rng(0)
        chosen = []
        for digit in range(10):  # the same split whichever classes are kept
            members = rng.permutation(np.flatnonzero(digits.target == digit))
            cut = int(round(len(members) * held_out))
            if digit in label_of:
                chosen.extend(members[cut:] if train else members[:cut])
        chosen = np.sort(np.array(chosen))
        self.indices = chosen.tolist()  # into scikit-learn's array
        pixels = (digits.images[chosen] * (255.0 / 16.0)).astype(np.uint8)
        self.images = [Image.fromarray(p).convert("RGB") for p in pixels]
        self.targets = [label_of[d] for d in digits.target[chosen].tolist()]
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        image = self.images[index]
        return (self.transform(image) if self.transform else image), self.targets[index]


def _checked_subset(chosen, found, where):
    """``chosen`` (DATA.CLASSES) when every name in it is one of ``found`` and none repeats; else one sentence."""
    unknown = [name for name in chosen if name not in found]
    if unknown:
        raise ValueError(
            f"DATA.CLASSES names {unknown}, which are not classes of {where}; its classes are {sorted(found)}."
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"DATA.CLASSES {list(chosen)} names a class twice; name each class once.")
    return chosen


def collate_skipping(batch, refill=False):
    """Collate the samples that loaded; returns ``(images, targets, unreadable)``, the last a list naming each
    sample that did not load and why.

    With ``refill``, unreadable samples are replaced by readable ones of the same batch, so that every
    batch keeps its size: in distributed training every process must take every step, and Mixup needs
    an even batch. Evaluation drops them instead, so that no sample counts twice. A batch of unreadable
    samples only comes out empty."""
    unreadable = [sample for sample in batch if isinstance(sample, Unreadable)]
    kept = [sample for sample in batch if not isinstance(sample, Unreadable)]
    if not kept:  # nothing to refill from: the training loop stops (a worker process must not raise)
        return torch.empty(0), torch.empty(0, dtype=torch.long), unreadable
    if refill:
        kept += [kept[i % len(kept)] for i in range(len(unreadable))]
    images, targets = default_collate(kept)
    return images, targets, unreadable


def build_transform(cfg, train):
    """The transform of the training or the evaluation images, as the original release chose it:

    - evaluation: resize to ``INPUT.IMAGE_SIZE / INPUT.CROP_PCT``, center crop;
    - training with ``AUG.TIMM_AUG.USE_TRANSFORM``: timm's (random resized crop, flips, the
      ``AUTO_AUGMENT`` policy where one is set (RandAugment, AutoAugment or AugMix), color jitter, random erasing;
      the crop's scale and ratio from ``AUG.SCALE`` and ``AUG.RATIO``, the rest from ``AUG.TIMM_AUG``);
    - fine-tuning (``FINETUNE.FINETUNE``) without ``FINETUNE.USE_TRAIN_AUG``: the evaluation resize, then a
      random crop and the horizontal flip;
    - otherwise: random resized crop (``AUG.SCALE``, ``AUG.RATIO``), horizontal flip, and with the
      probabilities ``AUG.COLOR_JITTER[4]``, ``AUG.GRAY_SCALE``, ``AUG.GAUSSIAN_BLUR`` color jitter
      (``AUG.COLOR_JITTER[:4]``), grayscale and Gaussian blur.

    The horizontal flip has probability ``AUG.TIMM_AUG.HFLIP``."""
    if cfg.INPUT.INTERPOLATION not in INTERPOLATIONS:
        raise ValueError(
            f"INPUT.INTERPOLATION {cfg.INPUT.INTERPOLATION} is not a PIL code this project knows; use 0, 2 or 3."
        )
    size, interpolation = cfg.INPUT.IMAGE_SIZE, INTERPOLATIONS[cfg.INPUT.INTERPOLATION]
    common = dict(input_size=size, interpolation=interpolation, mean=tuple(cfg.INPUT.MEAN), std=tuple(cfg.INPUT.STD))
    timm_aug, aug = cfg.AUG.TIMM_AUG, cfg.AUG
    hflip = timm_aug.HFLIP
    if not train:
        return create_transform(is_training=False, crop_pct=cfg.INPUT.CROP_PCT, **common)
    _warn_unread_keys(cfg)
    if timm_aug.USE_TRANSFORM:
        return _posterize_any_bits(
            create_transform(
                is_training=True,
                scale=tuple(aug.SCALE),
                ratio=tuple(aug.RATIO),
                hflip=hflip,
                vflip=timm_aug.VFLIP,
                color_jitter=cfg.AUG.TIMM_AUG.COLOR_JITTER,
                auto_augment=timm_aug.AUTO_AUGMENT or None,
                re_prob=timm_aug.RE_PROB,
                re_mode=timm_aug.RE_MODE,
                re_count=timm_aug.RE_COUNT,
                **common,
            )
        )
    if cfg.FINETUNE.FINETUNE and not cfg.FINETUNE.USE_TRAIN_AUG:
        return transforms.Compose(
            [
                transforms.Resize(
                    int(size / cfg.INPUT.CROP_PCT), interpolation=transforms.InterpolationMode(interpolation)
                ),
                transforms.RandomCrop(size),
                transforms.RandomHorizontalFlip(hflip),
                transforms.ToTensor(),
                transforms.Normalize(cfg.INPUT.MEAN, cfg.INPUT.STD),
            ]
        )
    if len(cfg.AUG.COLOR_JITTER) != 5:
        raise ValueError(
            f"AUG.COLOR_JITTER {list(cfg.AUG.COLOR_JITTER)} must hold 5 numbers: "
            "brightness, contrast, saturation, hue, probability."
        )
    jitter_prob = cfg.AUG.COLOR_JITTER[4]
    if aug.GAUSSIAN_BLUR and size <= TIMM_BLUR_KERNEL // 2:
        raise ValueError(
            f"AUG.GAUSSIAN_BLUR blurs with timm's {TIMM_BLUR_KERNEL}-pixel kernel, which needs images of at least "
            f"{TIMM_BLUR_KERNEL // 2 + 1} pixels, but INPUT.IMAGE_SIZE is {size}; set AUG.GAUSSIAN_BLUR 0 or a larger "
            "INPUT.IMAGE_SIZE."
        )
    return create_transform(
        is_training=True,
        scale=tuple(aug.SCALE),
        ratio=tuple(aug.RATIO),
        hflip=hflip,
        vflip=0.0,
        color_jitter=tuple(cfg.AUG.COLOR_JITTER[:4]) if jitter_prob > 0 else None,
        color_jitter_prob=jitter_prob,
        grayscale_prob=aug.GRAY_SCALE,
        gaussian_blur_prob=aug.GAUSSIAN_BLUR,
        **common,
    )


def _warn_unread_keys(cfg):
    """Say once which augmentation keys, set to other values than their defaults, the chosen training transform
    does not read, and what would make it read them (the original release ignored them without a word)."""
    timm_aug = cfg.AUG.TIMM_AUG
    if timm_aug.USE_TRANSFORM:
        unread = [(_PLAIN_KEYS, "timm's transform (AUG.TIMM_AUG.USE_TRANSFORM True) does not read {}")]
        if not cfg.FINETUNE.USE_TRAIN_AUG:
            unread.append(
                (
                    ("FINETUNE.FINETUNE",),
                    "timm's transform (AUG.TIMM_AUG.USE_TRANSFORM True) comes first, so fine-tuning's resize and "
                    "random crop are not taken; set AUG.TIMM_AUG.USE_TRANSFORM False for them",
                )
            )
        if timm_aug.AUTO_AUGMENT and "3a" not in timm_aug.AUTO_AUGMENT:  # timm keeps it beside 3a's policies
            unread.append(
                (
                    ("AUG.TIMM_AUG.COLOR_JITTER",),
                    "timm leaves color jitter out beside an AUG.TIMM_AUG.AUTO_AUGMENT policy; set AUTO_AUGMENT '' "
                    "for it",
                )
            )
    elif cfg.FINETUNE.FINETUNE and not cfg.FINETUNE.USE_TRAIN_AUG:
        why = "fine-tuning's transform (a resize, a random crop, the flip) does not read {}; set FINETUNE.USE_TRAIN_AUG"
        unread = [(_TIMM_KEYS + _PLAIN_KEYS + _CROP_KEYS, why + " True for the training transform")]
    else:
        unread = [(_TIMM_KEYS, "only timm's transform reads {}; set AUG.TIMM_AUG.USE_TRANSFORM True")]
    if timm_aug.USE_TRANSFORM and timm_aug.RE_PROB == 0:
        unread.append((("AUG.TIMM_AUG.RE_MODE", "AUG.TIMM_AUG.RE_COUNT"), "AUG.TIMM_AUG.RE_PROB 0 erases nothing"))
    if not timm_aug.USE_TRANSFORM and len(cfg.AUG.COLOR_JITTER) == 5 and cfg.AUG.COLOR_JITTER[4] == 0:
        unread.append((("AUG.COLOR_JITTER",), "its probability (the fifth number) is 0, so its strengths do nothing"))
    if not cfg.FINETUNE.FINETUNE:
        unread.append((("FINETUNE.USE_TRAIN_AUG",), "only FINETUNE.FINETUNE True reads {}"))
    warn_unread_keys(cfg, unread)


def posterize(img, bits_to_keep, **kwargs):
    """timm's posterize, also with 0 bits to keep: a black image, as Pillow gave before version 13, which refuses
    0 bits (timm's increasing RandAugment policies, ``inc1``, reach 0 at the top magnitudes)."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return auto_augment.posterize(img, bits_to_keep, **kwargs)


def _posterize_any_bits(transform):
    """``transform`` with :func:`posterize` in each of timm's augmentation ops (RandAugment, AutoAugment and
    AugMix hold them in ``ops`` or in the sub-policies of ``policy``)."""
    for step in getattr(transform, "transforms", ()):
        groups = [getattr(step, "ops", [])] + list(getattr(step, "policy", []))
        for op in (op for group in groups for op in group):
            if getattr(op, "aug_fn", None) is auto_augment.posterize:
                op.aug_fn = posterize
    return transform


def _refuse_data_keys_for_digits(cfg, train):
    """Raise where the config names scikit-learn's digits and also where to read images from: the digits would be
    read instead, without a word."""
    unread = keys_set(cfg, ("DATA.FORMAT", "DATA.PATH"))
    if unread:
        key = "DATA.TRAIN" if train else "DATA.TEST"
        raise ValueError(
            f"{key} ('digits',) is scikit-learn's digits, which do not read {' or '.join(unread)}; to read images "
            f"from DATA.PATH, name the data otherwise (DATA.TRAIN and DATA.TEST ('imagenet',)), or leave "
            f"{' and '.join(unread)} at the default."
        )


def build_dataset(cfg, train, model_classes=None):
    """The training (``DATA.TRAIN``) or evaluation (``DATA.TEST``) dataset with its transform. ``model_classes``:
    the classes the model labels, in label order (the training data's, or those a checkpoint records; taken where
    they are ``DATA.NUM_CLASSES``); evaluation folders of some of them only are labelled as the model's (as are
    folders lacking some of ``DATA.CLASSES``)."""
    name = (cfg.DATA.TRAIN if train else cfg.DATA.TEST)[0]
    transform = build_transform(cfg, train)
    chosen = list(cfg.DATA.CLASSES) or None
    if name == "digits":
        _refuse_data_keys_for_digits(cfg, train)
        dataset = DigitsDataset(train, transform, classes=chosen)
    elif cfg.DATA.FORMAT == "shards":
        if chosen:
            raise ValueError(
                "DATA.CLASSES picks classes of image folders; shards hold their classes' labels, so write "
                "shards of the classes wanted (tools/make_shards.py) and leave DATA.CLASSES empty."
            )
        dataset = ShardDataset(os.path.join(cfg.DATA.PATH, "train" if train else "val"), transform, cfg.SEED)
    else:
        root = os.path.join(cfg.DATA.PATH, "train" if train else "val")
        if what := not_a_folder(cfg.DATA.PATH):
            raise ValueError(
                f"DATA.PATH {cfg.DATA.PATH} {what}; give the folder that holds the data, {EXPECTED_LAYOUT}."
            )
        if not (os.path.isdir(root) and holds_images(root)):
            raise ValueError(f"No images found in {root}: the data must be ImageNet-style folders, {EXPECTED_LAYOUT}.")
        if (
            not train
            and not chosen
            and len(model_classes or ()) == cfg.DATA.NUM_CLASSES
            and _lacks_some_of(root, model_classes)
        ):
            chosen = list(model_classes)
        dataset = SkippingImageFolder(root, transform, classes=chosen, may_lack=not train)
    classes = len(dataset.classes)
    if classes != cfg.DATA.NUM_CLASSES:
        wanted = cfg.DATA.NUM_CLASSES
        if classes > wanted:
            subset = f", or DATA.CLASSES to the {wanted} of them to keep"
        elif not train and isinstance(dataset, SkippingImageFolder):
            subset = f", or where it lacks some of the model's classes, DATA.CLASSES to all {wanted} in label order"
        else:
            subset = ""
        raise ValueError(
            f"The {'training' if train else 'evaluation'} data has {classes} classes but DATA.NUM_CLASSES is "
            f"{wanted}; set DATA.NUM_CLASSES {classes}{subset}."
        )
    return dataset


def check_same_classes(train_set, test_set):
    """Refuse, in one sentence, training and evaluation data whose class names (in label order) differ: the same
    index would name another class in each."""
    if list(train_set.classes) == list(test_set.classes):
        return
    pairs = (("training", train_set.classes, test_set.classes), ("evaluation", test_set.classes, train_set.classes))
    only = [f"only the {split} data has {sorted(set(a) - set(b))}" for split, a, b in pairs if set(a) - set(b)]
    if {normalize("NFC", name) for name in train_set.classes} == {normalize("NFC", name) for name in test_set.classes}:
        raise ValueError(
            f"The training and evaluation data name their classes with the same letters written as other Unicode "
            f"characters ({'; '.join(only)}: composed and decomposed accents, as some file systems write names); "
            "rename the folders of one of them so that both write each name alike."
        )
    raise ValueError(
        f"The training and evaluation data label their classes differently ({'; '.join(only) or 'in another order'}); "
        "give both the same classes, so that each index names the same class."
    )


def build_mixup(cfg):
    """timm's Mixup/CutMix (with label smoothing in its soft targets) from ``AUG.*``, or None when off."""
    aug = cfg.AUG
    asked = aug.MIXUP > 0 or aug.MIXCUT > 0 or bool(aug.MIXCUT_MINMAX)
    if aug.MIXUP_PROB <= 0 and asked:
        log.warning(
            "AUG.MIXUP, AUG.MIXCUT or AUG.MIXCUT_MINMAX is set, but AUG.MIXUP_PROB is 0 (the original release's "
            "default), so no batch is mixed; set AUG.MIXUP_PROB (timm's default is 1.0) to mix them."
        )
    if aug.MIXUP_PROB <= 0 or not asked:
        return None
    return Mixup(
        mixup_alpha=aug.MIXUP,
        cutmix_alpha=aug.MIXCUT,
        cutmix_minmax=tuple(aug.MIXCUT_MINMAX) or None,
        prob=aug.MIXUP_PROB,
        switch_prob=aug.MIXUP_SWITCH_PROB,
        mode=aug.MIXUP_MODE,
        label_smoothing=cfg.LOSS.LABEL_SMOOTHING,
        num_classes=cfg.DATA.NUM_CLASSES,
    )
