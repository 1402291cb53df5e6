"""Data: ImageNet-style folders with unreadable files, the digits split, transforms, Mixup and the loss."""

import logging
import os
import random
import re
import shutil
import warnings
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from tool_runner import run_tool
from torch.utils.data import DataLoader
from torchvision.transforms import RandomVerticalFlip

from vil.config import load_cfg
from vil.data import DigitsDataset, build_dataset, build_mixup, build_transform, collate_skipping
from vil.images import read_image
from vil.loss import build_loss


def make_folder(root, classes=("cat", "dog"), per_class=3, size=40, corrupt=True):
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (size + i, size), (40 * c, 10 * i, 100)).save(folder / f"{i}.JPEG")
    if corrupt:
        (root / "train" / classes[0] / "broken.JPEG").write_bytes(b"not a jpeg")
    return root


def cfg_for(root, *overrides):
    return load_cfg(overrides=["DATA.PATH", str(root), "DATA.NUM_CLASSES", "2", "INPUT.IMAGE_SIZE", "32", *overrides])


def test_unreadable_images_are_skipped_named_and_counted(tmp_path):
    cfg = cfg_for(make_folder(tmp_path))
    dataset = build_dataset(cfg, train=True)
    assert len(dataset) == 7
    batches = list(DataLoader(dataset, batch_size=4, collate_fn=collate_skipping))
    names = [name for _, _, unreadable in batches for name in unreadable]
    assert len(names) == 1 and re.fullmatch(r".*broken\.JPEG \(cannot identify image file .*\)", names[0])
    assert sum(len(images) for images, _, _ in batches) == 6  # evaluation drops it
    images, targets, _ = batches[0]
    assert images.shape[1:] == (3, 32, 32) and targets.dtype == torch.long
    refilled = list(DataLoader(dataset, batch_size=4, collate_fn=partial(collate_skipping, refill=True)))
    assert [len(images) for images, _, _ in refilled] == [4, 3]  # training keeps every batch full


def test_an_unreadable_sample_is_named_with_the_first_line_of_its_error_or_the_errors_kind():
    from vil.unreadable import skipped, warn_unreadable

    named = [
        skipped("a.jpg", OSError("image file is truncated\n(5 bytes not processed)")),
        skipped("b.jpg", OSError()),  # PIL raises some errors without a message
        skipped("shard-000001.tar", ValueError("not a tar file"), images=40),  # the rest of a damaged shard
    ]
    assert named == ["a.jpg (image file is truncated)", "b.jpg (OSError)", "shard-000001.tar (not a tar file)"]
    assert warn_unreadable(named, held=[]) == 1 + 1 + 40


def test_decompression_bombs_and_damaged_images_are_skipped_also_in_worker_processes(tmp_path):
    root = make_folder(tmp_path, corrupt=False)
    folder = root / "train" / "cat"
    # 28 KB on disk, 15000 x 15000 pixels once decoded: PIL refuses it as a decompression bomb.
    Image.new("1", (15000, 15000)).save(folder / "bomb.png")
    good = (folder / "0.JPEG").read_bytes()
    (folder / "cut.JPEG").write_bytes(good[: len(good) // 3])  # truncated in its image data
    flipped = bytearray(good)
    flipped[2:40] = bytes(38)  # the JPEG header's segments zeroed
    (folder / "flipped.JPEG").write_bytes(bytes(flipped))
    dataset = build_dataset(cfg_for(root), train=True)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=partial(collate_skipping, refill=True))
    names = sorted(name for _, _, unreadable in loader for name in unreadable)
    assert [os.path.basename(name.split(" (")[0]) for name in names] == ["bomb.png", "cut.JPEG", "flipped.JPEG"]
    assert "decompression bomb" in names[0] and all("Traceback" not in name for name in names)


def deep_and_turned_images(folder):
    """Two images a plain RGB conversion gets wrong, saved in ``folder``: 16-bit grey levels (8-bit level k is
    16-bit level 257 k) and a photo whose EXIF orientation turns it on its side. Returns their paths."""
    levels = np.arange(0, 65536, 257, dtype=np.uint16).reshape(16, 16)
    Image.fromarray(levels).save(folder / "deep.png")
    assert Image.open(folder / "deep.png").mode.startswith("I")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: turn 90 degrees clockwise to view
    Image.new("RGB", (80, 40), (200, 10, 10)).save(folder / "phone.jpg", exif=exif)
    return folder / "deep.png", folder / "phone.jpg"


def test_images_are_read_as_a_viewer_shows_them(tmp_path):
    """16-bit grey levels scaled to 8 bits (a plain conversion made 99% of a photo's pixels white), the EXIF
    orientation applied (phone photos were classified on their side), floating-point pixels refused."""
    deep, phone = deep_and_turned_images(tmp_path)
    grey = np.asarray(read_image(deep))
    assert grey.shape == (16, 16, 3) and np.array_equal(grey[..., 0], np.arange(256).reshape(16, 16))
    assert read_image(phone).size == (40, 80)
    Image.fromarray(np.ones((4, 4), dtype=np.float32)).save(tmp_path / "float.tif")
    with pytest.raises(ValueError, match="floating-point pixels"):
        read_image(tmp_path / "float.tif")
    # 32-bit integers: 16-bit levels (as older Pillow opens 16-bit PNGs) are scaled, wider ones refused.
    levels = np.arange(0, 65536, 257, dtype=np.int32).reshape(16, 16)
    Image.fromarray(levels, "I").save(tmp_path / "wide.tif")
    assert np.array_equal(np.asarray(read_image(tmp_path / "wide.tif"))[..., 0], np.arange(256).reshape(16, 16))
    Image.fromarray(np.array([[51529, 65535]], np.int32), "I").save(tmp_path / "between.tif")  # x 255 / 65535
    assert np.asarray(read_image(tmp_path / "between.tif"))[..., 0].tolist() == [[201, 255]]  # 200.502 rounds up
    Image.fromarray(np.full((4, 4), 65536, np.int32), "I").save(tmp_path / "wider.tif")
    with pytest.raises(ValueError, match=r"32-bit integer pixels \(mode I\) outside 16-bit levels \(up to 65536\)"):
        read_image(tmp_path / "wider.tif")
    # Between Pillow's limit and twice it, Pillow only warns, in words that name no file: refused as a possible bomb,
    # whatever the caller's warning filters (here: every warning recorded, none raised).
    Image.new("1", (9500, 9500)).save(tmp_path / "large.png")
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"more than Pillow's 89478485 pixels.*decompression bomb.*MAX_IMAGE_PIX"):
            read_image(tmp_path / "large.png")
        # A palette with transparency in bytes: the RGB of the palette's colours, without Pillow's warning.
        palette = Image.new("P", (2, 1))
        palette.putpalette([10, 20, 30, 200, 100, 50])
        palette.putdata([0, 1])
        palette.save(tmp_path / "palette.png", transparency=bytes([0, 255]))
        assert np.asarray(read_image(tmp_path / "palette.png")).tolist() == [[[10, 20, 30], [200, 100, 50]]]
    assert not escaped  # no warning of Pillow's escapes


def test_image_folders_shards_and_predict_see_the_same_pixels(tmp_path):
    """Training and evaluation read a folder's 16-bit and EXIF-turned images as predict does (torchvision's loader
    turned the grey levels above 255 white and left the photo on its side), from shards too."""
    import webdataset

    from vil.data import SkippingImageFolder
    from vil.predict import ImageFiles
    from vil.shards import ShardDataset, write_index

    (tmp_path / "images" / "cat").mkdir(parents=True)
    paths = sorted(deep_and_turned_images(tmp_path / "images" / "cat"))
    viewed = [np.asarray(read_image(path)) for path in paths]
    folder = SkippingImageFolder(tmp_path / "images")
    shards = tmp_path / "shards"
    shards.mkdir()
    write_index(shards, ["cat"], {"shard-000000.tar": len(paths)})
    with webdataset.TarWriter(str(shards / "shard-000000.tar")) as tar:
        for i, path in enumerate(paths):
            tar.write({"__key__": str(i), path.suffix[1:]: path.read_bytes(), "cls": b"0"})
    from_shards = [image for image, _ in ShardDataset(shards).evaluation_batches(0, 1, 1, 0, lambda batch: batch[0])]
    for seen in ([image for image, _ in folder], [image for image, _ in ImageFiles(paths, None)], from_shards):
        assert len(seen) == len(viewed) and all(np.array_equal(np.asarray(a), b) for a, b in zip(seen, viewed))
    assert viewed[0].max() == 255 and len(np.unique(viewed[0])) == 256 and viewed[1].shape == (80, 40, 3)


def test_eval_transform_resizes_and_center_crops(tmp_path):
    # A 192 x 128 image (width x height) of 2 x 2 blocks, block (column c, row r) colored (2c, 3r, 77). The shorter
    # side is resized to int(32 / 0.5) = 64: a nearest-neighbour halving that keeps one pixel of each block, pixel
    # (j, i) of the 96 x 64 result colored (2j, 3i, 77). The center crop of 32 x 32 starts at column (96 - 32) / 2
    # = 32 and row (64 - 32) / 2 = 16.
    blocks = np.stack([*np.meshgrid(2 * np.arange(96), 3 * np.arange(64)), np.full((64, 96), 77)], axis=-1)
    pixels = blocks.repeat(2, axis=0).repeat(2, axis=1).astype(np.uint8)
    for name in ("a", "b"):
        (tmp_path / "val" / name).mkdir(parents=True)
        Image.fromarray(pixels).save(tmp_path / "val" / name / "0.png")  # lossless: the values stay exact
    cfg = cfg_for(
        tmp_path,
        *("INPUT.CROP_PCT", "0.5", "INPUT.INTERPOLATION", "0"),
        *("INPUT.MEAN", "[0.0, 0.0, 0.0]", "INPUT.STD", "[1.0, 1.0, 1.0]"),
    )
    image, _ = build_dataset(cfg, train=False)[0]
    rows, cols = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    expected = torch.stack([2 * (cols + 32), 3 * (rows + 16), torch.full((32, 32), 77)]) / 255
    torch.testing.assert_close(image, expected.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["missing", "empty"])
def test_missing_or_empty_data_folder_is_one_sentence(tmp_path, layout):
    if layout == "empty":
        (tmp_path / "train" / "cat").mkdir(parents=True)
    with pytest.raises(ValueError) as err:
        build_dataset(cfg_for(tmp_path), train=True)
    message = str(err.value)
    assert str(tmp_path / "train") in message and message.count("\n") == 0
    assert "DATA.PATH/train/<class>/<image>" in message and "DATA.PATH/val/<class>/<image>" in message


def test_a_data_path_that_does_not_exist_is_named_so(tmp_path):
    with pytest.raises(ValueError) as err:
        build_dataset(cfg_for(tmp_path / "nowhere"), train=False)
    message = str(err.value)
    assert f"DATA.PATH {tmp_path / 'nowhere'} does not exist" in message and message.count("\n") == 0
    assert "DATA.PATH/train/<class>/<image>" in message
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"DATA.PATH \S+a_file is a file, not a folder"):
        build_dataset(cfg_for(tmp_path / "a_file"), train=False)


def test_a_class_folder_without_images_and_images_without_class_folders_are_one_sentence(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "train" / "dog").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "dog" / "0.png")
    with pytest.raises(ValueError) as err:
        build_dataset(cfg_for(tmp_path), train=True)
    message = str(err.value)
    assert f"{tmp_path / 'train' / 'cat'} holds no images" in message and ".png" in message and "\n" not in message
    (tmp_path / "val").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "val" / "0.png")  # images, but no class folders
    with pytest.raises(ValueError) as err:
        build_dataset(cfg_for(tmp_path), train=False)
    message = str(err.value)
    assert f"{tmp_path / 'val'} has no class folders" in message and "<class>" in message and "\n" not in message


def test_class_folders_that_are_links_are_read(tmp_path):
    """DATA.PATH/train/<class> as symbolic links to folders elsewhere (a common way to lay out ImageNet), read as
    torchvision's ImageFolder reads them."""
    make_folder(tmp_path / "store", corrupt=False)
    for split in ("train", "val"):
        (tmp_path / "data" / split).mkdir(parents=True)
        for name in ("cat", "dog"):
            (tmp_path / "data" / split / name).symlink_to(tmp_path / "store" / split / name)
    dataset = build_dataset(cfg_for(tmp_path / "data"), train=True)
    assert len(dataset) == 6 and dataset.classes == ["cat", "dog"]


def test_evaluation_folders_lacking_some_of_the_models_classes_are_labelled_as_the_model(tmp_path, caplog):
    """A val/ without one of the classes: labelled by the model's classes (the training data's, a checkpoint's, or
    DATA.CLASSES), the missing one named once; without them, the refusal says how to give them."""
    root = make_folder(tmp_path, classes=("ant", "bee", "cat"), per_class=2, corrupt=False)
    shutil.rmtree(root / "val" / "bee")
    cfg = cfg_for(root, "DATA.NUM_CLASSES", "3")
    with caplog.at_level(logging.WARNING, logger="vil"):
        dataset = build_dataset(cfg, train=False, model_classes=["ant", "bee", "cat"])
    assert dataset.classes == ["ant", "bee", "cat"]
    assert (
        sorted((path.split("/")[-2], label) for path, label in dataset.samples) == [("ant", 0)] * 2 + [("cat", 2)] * 2
    )
    assert "no images of 1 of the 3 classes, ['bee']" in caplog.text
    (root / "val" / "bee").mkdir()  # an empty folder lacks the class's images as well
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vil"):
        with_empty = build_dataset(cfg, train=False, model_classes=["ant", "bee", "cat"])
    assert with_empty.classes == ["ant", "bee", "cat"] and with_empty.samples == dataset.samples
    assert "no images of 1 of the 3 classes, ['bee']" in caplog.text
    (root / "val" / "bee").rmdir()
    with pytest.raises(ValueError, match=r"has 2 classes but DATA.NUM_CLASSES is 3;.*DATA.CLASSES to all 3 in label"):
        build_dataset(cfg, train=False)
    by_name = build_dataset(
        cfg_for(root, "DATA.NUM_CLASSES", "3", "DATA.CLASSES", "['cat', 'bee', 'ant']"), train=False
    )
    assert (
        sorted((path.split("/")[-2], label) for path, label in by_name.samples) == [("ant", 2)] * 2 + [("cat", 0)] * 2
    )
    shutil.rmtree(root / "train" / "bee")
    with pytest.raises(ValueError, match=r"DATA.CLASSES names \['bee'\], which are not classes of"):  # training: all
        build_dataset(cfg_for(root, "DATA.NUM_CLASSES", "3", "DATA.CLASSES", "['cat', 'bee', 'ant']"), train=True)
    (root / "val" / "cat").rename(root / "val" / "cow")  # not the model's: its classes are not taken
    with pytest.raises(ValueError, match=r"has 2 classes but DATA.NUM_CLASSES is 3"):
        build_dataset(cfg, train=False, model_classes=["ant", "bee", "cat"])


def test_class_names_alike_but_for_their_unicode_form_are_said_so(tmp_path):
    from unicodedata import normalize

    from vil.data import check_same_classes

    for name, other in (("caf\u00e9", "bee"), ("\u00e9t\u00e9", "f")):  # the second sorts apart in its two forms
        composed, decomposed = normalize("NFC", name), normalize("NFD", name)
        train_set, test_set = (
            type("Split", (), {"classes": sorted([other, written])}) for written in (composed, decomposed)
        )
        with pytest.raises(ValueError, match=r"same letters written as other Unicode characters"):
            check_same_classes(train_set, test_set)


def test_class_count_must_match(tmp_path):
    with pytest.raises(ValueError, match=r"2 classes.*DATA.NUM_CLASSES is 5.*NUM_CLASSES 2\.$"):
        build_dataset(cfg_for(make_folder(tmp_path), "DATA.NUM_CLASSES", "5"), train=True)
    # More classes than the count: a subset of them (a checkpoint trained on some) is the other way.
    folder = make_folder(tmp_path / "three", classes=("cat", "dog", "fox"))
    with pytest.raises(ValueError, match=r"3 classes.*is 2; set DATA.NUM_CLASSES 3, or DATA.CLASSES to the 2 of them"):
        build_dataset(cfg_for(folder), train=True)


def test_digits_split_is_disjoint_stratified_and_fixed():
    train, held_out = DigitsDataset(train=True), DigitsDataset(train=False)
    assert len(train) + len(held_out) == 1797 and len(held_out) == 359
    assert not set(train.indices) & set(held_out.indices)
    assert sorted(set(held_out.targets)) == list(range(10))
    assert DigitsDataset(train=False).indices == held_out.indices
    assert train.images[0].size == (8, 8) and train.images[0].mode == "RGB"


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["DATA.FORMAT", "shards"], ["DATA.FORMAT"]),
        (["DATA.PATH", "mine", "DATA.FORMAT", "shards"], ["DATA.FORMAT", "DATA.PATH"]),
    ],
)
def test_digits_with_a_data_path_or_format_is_refused(overrides, named):
    # The digits would be read instead of the shards or folders named, silently.
    cfg = load_cfg("configs/vil_digits.yaml", overrides)
    with pytest.raises(ValueError) as refusal:
        build_dataset(cfg, train=False)
    message = str(refusal.value)
    assert message.startswith("DATA.TEST ('digits',)")
    assert re.search(r"do not read ([^;]*);", message).group(1).split(" or ") == named
    assert len(DigitsDataset(train=False)) == len(build_dataset(load_cfg("configs/vil_digits.yaml"), train=False))


def test_digits_without_scikit_learn_is_one_line_from_the_tools(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "sklearn.datasets", None)  # as if it were not installed
    status, _, stderr = run_tool("train", "--config-file", "vil_digits", "OUTPUT_DIR", tmp_path)
    assert status == 1 and stderr.startswith("error: The digits data set comes with scikit-learn")
    assert "pip install 'vil[digits]'" in stderr and "Traceback" not in stderr


BOXES_AND_SWITCH = ("AUG.MIXCUT_MINMAX", "[0.2, 0.6]", "AUG.MIXUP_SWITCH_PROB", "0.9")


def test_mixup_and_loss_follow_the_config(tmp_path):
    cfg = cfg_for(
        tmp_path, "AUG.MIXUP_PROB", "1.0", "AUG.MIXUP", "0.8", "AUG.MIXCUT", "1.0", "LOSS.LABEL_SMOOTHING", "0.1"
    )
    mixup = build_mixup(cfg)
    images, targets = mixup(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 1, 0]))
    assert targets.shape == (4, 2) and torch.allclose(targets.sum(1), torch.ones(4))
    assert targets.min() >= 0.05 - 1e-6  # smoothing 0.1 over 2 classes
    assert isinstance(build_loss(cfg, mixup), SoftTargetCrossEntropy)
    assert (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.mode) == (0.8, 1.0, "batch")
    boxes = build_mixup(cfg_for(tmp_path, "AUG.MIXUP_PROB", "1.0", "AUG.MIXUP", "0.8", *BOXES_AND_SWITCH))
    assert (boxes.cutmix_minmax, boxes.switch_prob) == ((0.2, 0.6), 0.9)
    assert (
        build_mixup(cfg_for(tmp_path, "AUG.MIXUP_PROB", "1.0", "AUG.MIXUP", "0.8", "AUG.MIXUP_MODE", "elem")).mode
        == "elem"
    )
    plain = cfg_for(tmp_path, "LOSS.LABEL_SMOOTHING", "0.3")
    loss = build_loss(plain, None)
    assert build_mixup(plain) is None and isinstance(loss, LabelSmoothingCrossEntropy)
    logits, labels = torch.randn(4, 2), torch.tensor([0, 1, 1, 0])
    smoothed = 0.7 * F.cross_entropy(logits, labels) - 0.3 * F.log_softmax(logits, -1).mean()  # by hand
    torch.testing.assert_close(loss(logits, labels), smoothed)
    assert isinstance(build_loss(cfg_for(tmp_path), None), torch.nn.CrossEntropyLoss)


def test_mixing_alphas_without_a_probability_say_that_nothing_is_mixed(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="vil"):
        assert build_mixup(cfg_for(tmp_path, "AUG.MIXUP", "0.8")) is None  # AUG.MIXUP_PROB stays 0
    assert "AUG.MIXUP_PROB is 0" in caplog.text and "1.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vil"):
        assert build_mixup(cfg_for(tmp_path)) is None
    assert "AUG.MIXUP_PROB" not in caplog.text


def test_a_subset_of_classes_is_labelled_in_the_order_given(tmp_path):
    root = make_folder(tmp_path, classes=("ant", "bee", "cat"), corrupt=False)
    cfg = cfg_for(root, "DATA.CLASSES", "['cat', 'ant']")
    dataset = build_dataset(cfg, train=True)
    assert dataset.classes == ["cat", "ant"]
    assert (
        sorted((path.split("/")[-2], label) for path, label in dataset.samples) == [("ant", 1)] * 3 + [("cat", 0)] * 3
    )
    with pytest.raises(
        ValueError,
        match=r"DATA.CLASSES.*'cow'.*\['ant', 'bee', 'cat'\]",
    ):
        build_dataset(cfg_for(root, "DATA.CLASSES", "['cow', 'ant']"), train=True)
    digits = DigitsDataset(train=False, classes=["3", "0"])
    everything = DigitsDataset(train=False)
    kept = [i for i, t in zip(everything.indices, everything.targets) if t in (0, 3)]
    assert digits.indices == kept  # the same held-out images as in the ten-class split
    assert [{3: 0, 0: 1}[t] for i, t in zip(everything.indices, everything.targets) if t in (0, 3)] == digits.targets


def test_timms_training_transform_takes_the_flip_and_erasing_keys(tmp_path):
    from timm.data.random_erasing import RandomErasing

    keys = ("AUG.TIMM_AUG.USE_TRANSFORM", "True", "AUG.TIMM_AUG.VFLIP", "0.4", "AUG.TIMM_AUG.RE_PROB", "0.5")
    keys += ("AUG.TIMM_AUG.RE_COUNT", "3", "AUG.TIMM_AUG.RE_MODE", "rand")
    transform = build_transform(cfg_for(tmp_path, *keys), train=True)
    (vflip,) = [t for t in transform.transforms if isinstance(t, RandomVerticalFlip)]
    (erasing,) = [t for t in transform.transforms if isinstance(t, RandomErasing)]
    assert vflip.p == 0.4
    assert (erasing.probability, erasing.max_count, erasing.rand_color, erasing.per_pixel) == (0.5, 3, True, False)


def test_training_transforms_follow_the_original_choices(tmp_path):
    root = make_folder(tmp_path, corrupt=False)
    finetune = build_transform(cfg_for(root, "FINETUNE.FINETUNE", "True", "INPUT.CROP_PCT", "0.8"), train=True)
    names = [type(t).__name__ for t in finetune.transforms]
    assert names == ["Resize", "RandomCrop", "RandomHorizontalFlip", "ToTensor", "Normalize"]
    assert finetune.transforms[0].size == 40 and finetune.transforms[1].size == (32, 32)  # 32 / 0.8
    image = Image.new("RGB", (50, 40))
    assert finetune(image).shape == (3, 32, 32)
    halves = Image.new("RGB", (32, 32))
    halves.paste((255, 255, 255), (0, 0, 16, 32))  # the left half white: a flip shows
    for hflip, flipped in (("0.0", False), ("1.0", True)):  # AUG.TIMM_AUG.HFLIP, also when fine-tuning
        keys = ("FINETUNE.FINETUNE", "True", "INPUT.CROP_PCT", "1.0", "AUG.TIMM_AUG.HFLIP", hflip)
        for out in map(build_transform(cfg_for(root, *keys), train=True), [halves] * 8):
            assert (out[..., 0].mean() < out[..., -1].mean()) == flipped
    with_train_aug = build_transform(
        cfg_for(root, "FINETUNE.FINETUNE", "True", "FINETUNE.USE_TRAIN_AUG", "True"), train=True
    )
    assert type(with_train_aug.transforms[0]).__name__ == "RandomResizedCropAndInterpolation"
    plain = build_transform(
        cfg_for(
            root, "AUG.COLOR_JITTER", "[0.4, 0.4, 0.4, 0.1, 0.8]", "AUG.GRAY_SCALE", "0.2", "AUG.GAUSSIAN_BLUR", "0.1"
        ),
        train=True,
    )
    text = repr(plain)
    assert "ColorJitter" in text and "p=0.8" in text and "RandomGrayscale(p=0.2)" in text and "GaussianBlur" in text
    assert "ColorJitter" not in repr(build_transform(cfg_for(root), train=True))  # the default probability is 0
    for size, refused in ((12, False), (11, True)):  # timm's 23-pixel blur pads by 11 pixels, inside the image
        blurring = cfg_for(root, "AUG.GAUSSIAN_BLUR", "1.0", "INPUT.IMAGE_SIZE", str(size))
        if refused:
            with pytest.raises(ValueError, match=r"23-pixel kernel.*at least 12 pixels.*INPUT.IMAGE_SIZE is 11"):
                build_transform(blurring, train=True)
        else:
            assert build_transform(blurring, train=True)(image).shape == (3, 12, 12)


def test_augmentation_keys_the_chosen_transform_does_not_read_are_named_once(caplog):
    def warnings(*overrides):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vil"):
            build_transform(load_cfg(None, ["INPUT.IMAGE_SIZE", "32", *overrides]), train=True)
        return [r.getMessage() for r in caplog.records]

    (line,) = warnings("AUG.TIMM_AUG.AUTO_AUGMENT", "rand-m9-mstd0.5", "AUG.TIMM_AUG.RE_PROB", "0.25")
    assert re.search(r"AUG.TIMM_AUG.AUTO_AUGMENT, AUG.TIMM_AUG.RE_PROB are set.*USE_TRANSFORM True", line)
    (line,) = warnings("AUG.TIMM_AUG.USE_TRANSFORM", "True", "AUG.GRAY_SCALE", "0.2")
    assert "AUG.GRAY_SCALE is set" in line and "USE_TRANSFORM True) does not read it" in line
    (line,) = warnings("FINETUNE.FINETUNE", "True", "AUG.SCALE", "[0.5, 1.0]", "AUG.TIMM_AUG.HFLIP", "0.0")
    assert "AUG.SCALE is set" in line and "FINETUNE.USE_TRAIN_AUG True" in line and "HFLIP" not in line
    # timm's transform comes before fine-tuning's; its color jitter is left out beside a policy.
    timm_aug = ("AUG.TIMM_AUG.USE_TRANSFORM", "True", "AUG.TIMM_AUG.AUTO_AUGMENT", "rand-m9-mstd0.5")
    first, second = warnings(*timm_aug, "FINETUNE.FINETUNE", "True", "AUG.TIMM_AUG.COLOR_JITTER", "0.8")
    assert "FINETUNE.FINETUNE is set" in first and "set AUG.TIMM_AUG.USE_TRANSFORM False" in first
    assert "AUG.TIMM_AUG.COLOR_JITTER is set" in second and "AUTO_AUGMENT" in second
    assert not warnings(*timm_aug, "FINETUNE.FINETUNE", "True", "FINETUNE.USE_TRAIN_AUG", "True")
    assert not warnings(  # timm keeps color jitter beside the 3a policies
        "AUG.TIMM_AUG.USE_TRANSFORM", "True", "AUG.TIMM_AUG.AUTO_AUGMENT", "3a", "AUG.TIMM_AUG.COLOR_JITTER", "0.3"
    )
    for name in ("vil_small", "vil_digits", "vil_digits_finetune"):  # the presets set only what they use
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vil"):
            build_transform(load_cfg(name), train=True)
        assert not caplog.records, name


def test_posterize_to_zero_bits_gives_a_black_image_and_keeps_timms_other_levels():
    from PIL import ImageOps

    from vil.data import posterize

    image = Image.new("RGB", (8, 6), (200, 100, 37))
    assert posterize(image, 0).getextrema() == ((0, 0), (0, 0), (0, 0))
    assert list(posterize(image, 3).getdata()) == list(ImageOps.posterize(image, 3).getdata())
    assert posterize(image, 8) is image


def test_increasing_randaugment_policy_transforms_thousands_of_images(tmp_path):
    """``rand-m9-mstd0.5-inc1`` (the ImageNet presets'): magnitudes drawn around 9 reach 10, where posterize keeps
    0 bits, which Pillow 13 refuses; every image must come through."""
    cfg = cfg_for(tmp_path, "AUG.TIMM_AUG.USE_TRANSFORM", "True", "AUG.TIMM_AUG.AUTO_AUGMENT", "rand-m9-mstd0.5-inc1")
    transform = build_transform(cfg, train=True)
    rand_augment = next(t for t in transform.transforms if type(t).__name__ == "RandAugment")
    posterize_op = next(op for op in rand_augment.ops if op.name == "PosterizeIncreasing")
    posterize_op.magnitude, posterize_op.magnitude_std, posterize_op.prob = 10, 0, 1.0  # 0 bits
    assert posterize_op(Image.new("RGB", (8, 8), (90, 90, 90))).getextrema() == ((0, 0),) * 3
    posterize_op.magnitude, posterize_op.magnitude_std, posterize_op.prob = 9, 0.5, 0.5
    random.seed(0)  # timm draws the ops with numpy and the magnitudes with random
    np.random.seed(0)
    colours = np.random.randint(0, 256, (3000, 3)).tolist()
    for i, colour in enumerate(colours):
        assert transform(Image.new("RGB", (24 + i % 17, 24), tuple(colour))).shape == (3, 32, 32)


def test_loader_benchmark_prints_a_row_per_worker_count():
    """``tools/benchmark_loader.py``: each epoch's images/s, the mean after the first, and that mean per worker."""
    status, out, err = run_tool(
        "benchmark_loader", "--images", "8", "--batch", "4", "--workers", "0", "1", "--epochs", "2"
    )
    assert status == 0, err
    assert out.startswith("CPU: ")  # the machine measured
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ") and "workers" not in line]
    assert [row[0].strip() for row in rows] == ["0", "1"]
    for workers, per_epoch, steady, per_worker in ([cell.strip() for cell in row] for row in rows):
        rates = [float(rate) for rate in per_epoch.split(" / ")]
        assert len(rates) == 2 and all(rate > 0 for rate in rates)
        assert float(steady) == pytest.approx(rates[1], abs=0.05)
        assert per_worker == ("-" if workers == "0" else steady)
