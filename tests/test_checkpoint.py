"""Checkpoints: the original release's format loads and reproduces outputs; wrong ones are refused clearly."""

import logging
import os
import pickle
import re
import struct
import warnings
import zipfile

import pytest
import torch

from vil.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from vil.models import PRESETS, MsViT
from vil.training_state import read_resume_point

ARCH = PRESETS["vil_tiny_rpb"]  # relative bias: also exercises the original's derived index buffers


def model(seed, arch=ARCH):
    torch.manual_seed(seed)
    return MsViT(arch, img_size=64, num_classes=7).eval()


def original_release_checkpoint(state):
    """A state dict saved the way the original release did: under "net", from a DDP wrapper (``module.``),
    with its ``relative_position_index`` buffers, plus its other entries."""
    net = {f"module.{k}": v for k, v in state.items()}
    for key in state:  # beside each relative bias table (of models that have them)
        if key.endswith(".local_relative_position_bias_table"):
            net[f"module.{key.rpartition('.')[0]}.relative_position_index"] = torch.zeros(4, 4, dtype=torch.int64)
    return {"net": net, "arch": "msvit", "epoch": 300, "best_acc": 76.6}


def test_original_release_checkpoint_loads_and_gives_the_same_outputs(tmp_path):
    source, target = model(0), model(1)
    x = torch.randn(2, 3, 64, 64)
    assert not torch.allclose(source(x), target(x))
    path = tmp_path / "vil_tiny_original.pth"
    torch.save(original_release_checkpoint(source.state_dict()), path)
    checkpoint = load_checkpoint(target, path)
    assert checkpoint["epoch"] == 300
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


def test_an_index_buffer_beside_no_bias_table_is_an_unexpected_key(tmp_path):
    """The original release saved relative_position_index beside each relative bias table; one elsewhere (an
    absolute-position model has none) is a key the model does not have, named as such."""
    absolute = MsViT(PRESETS["vil_tiny"], img_size=64, num_classes=7)
    checkpoint = original_release_checkpoint(absolute.state_dict())
    for layer in ("layer1.1", "layer3.1"):
        checkpoint["net"][f"module.{layer}.attn.relative_position_index"] = torch.zeros(4, 4, dtype=torch.int64)
    torch.save(checkpoint, tmp_path / "absolute.pth")
    with pytest.raises(ValueError, match=r"2 unexpected: layer1.1.attn.relative_position_index, layer3.1"):
        load_checkpoint(absolute, tmp_path / "absolute.pth")


def test_own_checkpoint_round_trip_and_bare_state_dict(tmp_path):
    source, target = model(0), model(1)
    save_checkpoint(tmp_path / "ckpt.pth", source, epoch=3)
    assert load_checkpoint(target, tmp_path / "ckpt.pth")["epoch"] == 3
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    torch.save(source.state_dict(), tmp_path / "bare.pth")
    load_checkpoint(model(2), tmp_path / "bare.pth")


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pth"
    save_checkpoint(path, model(0), epoch=1)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(path, model(1), epoch=2)
    assert path.read_bytes() == before  # the old checkpoint is intact
    assert os.listdir(tmp_path) == ["ckpt.pth"]  # and no temporary file is left behind


def test_saved_files_get_the_mode_a_plain_open_gives(tmp_path):
    save_checkpoint(tmp_path / "ckpt.pth", model(0))
    (tmp_path / "plain").write_bytes(b"")
    assert os.stat(tmp_path / "ckpt.pth").st_mode == os.stat(tmp_path / "plain").st_mode


def test_checkpoint_of_another_architecture_is_one_sentence(tmp_path):
    save_checkpoint(tmp_path / "small.pth", MsViT(PRESETS["vil_small"], img_size=64, num_classes=7))
    with pytest.raises(ValueError) as err:
        load_checkpoint(model(0), tmp_path / "small.pth")
    message = str(err.value)
    assert str(tmp_path / "small.pth") in message
    assert re.search(r"mis-shaped.*layer1\.0\.cls_token \(1, 1, 96\) vs \(1, 1, 48\)", message)
    assert re.search(r"missing: [^;]*layer1\.1\.attn\.local_relative_position_bias_table", message)
    assert re.search(r"unexpected: [^;]*layer1\.0\.cls_pos_embed", message)
    assert "\n" not in message


@pytest.mark.parametrize("layers,rest", [(3, ""), (4, ", ... (2 more)")])
def test_a_refusal_names_six_missing_keys_then_counts_the_rest(layers, rest):
    """A model of 6 keys: the sentence names all six; of 8: the first six, then how many more."""
    from vil.checkpoint import check_fits

    six = "0.weight, 0.bias, 1.weight, 1.bias, 2.weight, 2.bias"
    with pytest.raises(ValueError, match=re.escape(f"({2 * layers} missing: {six}{rest});")):
        check_fits({}, torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(layers)]), "empty.pth")


def test_tensors_of_another_kind_of_number_are_named(tmp_path):
    """Loading casts floating-point tensors to the model's precision; whole, boolean or complex numbers where the
    model has real ones are named with both dtypes (they were cast and loaded)."""
    state = model(0).state_dict()
    state["layer1.0.proj.weight"] = state["layer1.0.proj.weight"].to(torch.int64)
    state["norm.bias"] = state["norm.bias"] > 0
    state["head.bias"] = state["head.bias"].half()  # loads, cast
    torch.save(state, tmp_path / "mixed.pth")
    with pytest.raises(ValueError, match=r"2 of another kind of number \(checkpoint vs model\): ") as refusal:
        load_checkpoint(model(1), tmp_path / "mixed.pth")
    assert {"layer1.0.proj.weight torch.int64 vs torch.float32", "norm.bias torch.bool vs torch.float32"} <= set(
        re.split(r": |, |\)", str(refusal.value))
    )


def test_missing_and_unreadable_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(model(0), tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_text("MODEL:\n  ARCH: msvit\n")  # a config given for the checkpoint
    with pytest.raises(ValueError, match=r"junk\.pth is not a PyTorch checkpoint \(.*zip archive or a pickle"):
        load_checkpoint(model(0), tmp_path / "junk.pth")
    for protocol in (0, 1, 2):  # older files torch.save wrote as pickles: taken as such, whatever their protocol
        legacy = tmp_path / f"legacy{protocol}.pth"
        state = {"net": model(0).state_dict()}
        torch.save(state, legacy, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
        try:
            load_checkpoint(model(0), legacy)
        except ValueError as refusal:
            assert "is not a PyTorch checkpoint" not in str(refusal)
    torch.save({"net": model(0).state_dict()}, tmp_path / "cut.pth")
    (tmp_path / "cut.pth").write_bytes((tmp_path / "cut.pth").read_bytes()[:1000])  # a copy cut short
    with pytest.raises(ValueError) as refusal:
        load_checkpoint(model(0), tmp_path / "cut.pth")
    # One sentence: the reader's first, without its advice about its own internals.
    assert re.fullmatch(r"\S+cut\.pth is not a readable PyTorch checkpoint of tensors \([^.]*\)\.", str(refusal.value))
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:  # a zip archive of something else
        archive.writestr("notes.txt", "not weights")
    with pytest.raises(ValueError, match=r"other\.zip is a zip archive, but not one torch.save wrote \(it holds no"):
        load_checkpoint(model(0), tmp_path / "other.zip")
    with open(tmp_path / "plain.pkl", "wb") as f:  # pickle.dump's own file, protocol 4: its framing and no magic
        pickle.dump({"a": 1}, f, protocol=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor torch's warning about the protocol
        with pytest.raises(ValueError, match=r"Unsupported operand \d+: a pickle that torch.save did not write"):
            load_checkpoint(model(0), tmp_path / "plain.pkl")
    torch.save({"net": {"a": 1}}, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match="has no model state dict"):
        load_checkpoint(model(0), tmp_path / "odd.pth")


def flip_a_byte_of_the_largest_tensor(path):
    """Alters one byte in the middle of the largest record of the zip archive torch.save wrote: a tensor's data, which
    torch.load reads without checking its CRC-32. Returns the record's name."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda r: r.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26 : record.header_offset + 30])
    start = record.header_offset + 30 + name_length + extra_length  # after the record's local header
    data[start + record.file_size // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return record.filename


def test_a_checkpoint_altered_after_it_was_written_is_refused_naming_its_record(tmp_path):
    path = tmp_path / "altered.pth"
    torch.save({"net": model(0).state_dict()}, path)
    record = flip_a_byte_of_the_largest_tensor(path)
    altered = torch.load(path, weights_only=True)["net"]  # torch.load itself takes it, with other weights
    assert any(not torch.equal(altered[k], v) for k, v in model(0).state_dict().items())
    with pytest.raises(ValueError) as refusal:
        load_checkpoint(model(0), path)
    assert "damaged" in str(refusal.value) and record in str(refusal.value) and "\n" not in str(refusal.value)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # what torch says of an altered data.pkl
def test_each_byte_of_a_checkpoint_altered_gives_the_saved_weights_or_one_sentence(tmp_path):
    """A small checkpoint altered a byte at a time, every byte: its pickle, its tensors' data, the records' headers and
    their directory (offsets, sizes, checksums, compression methods, flags, names, attributes). Each file loads with
    the weights saved or is refused in one sentence; never other weights, never another exception. (torch.load alone
    takes a flipped byte of a tensor as other weights, and a record marked as a folder as uninitialised memory.)"""
    saved = {"net": {"weight": torch.arange(6.0).view(2, 3), "index": torch.tensor([4, 5])}, "epoch": 2}
    path = tmp_path / "small.pth"
    torch.save(saved, path)
    data = path.read_bytes()
    refused = 0
    for at in range(len(data)):
        path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
        try:
            loaded = read_checkpoint(path)
        except ValueError as refusal:
            assert "\n" not in str(refusal)
            refused += 1
            continue
        assert loaded["epoch"] == 2 and loaded["net"].keys() == saved["net"].keys(), at
        assert all(torch.equal(loaded["net"][k], v) for k, v in saved["net"].items()), at
    assert 0 < refused < len(data)


def test_a_resumed_run_passes_over_an_altered_last_checkpoint(tmp_path, caplog):
    for name in ("checkpoint_epoch1.pth", "checkpoint_last.pth"):
        torch.save({"net": model(0).state_dict(), "epoch": 1}, tmp_path / name)
    flip_a_byte_of_the_largest_tensor(tmp_path / "checkpoint_last.pth")
    with caplog.at_level(logging.WARNING):
        path, checkpoint = read_resume_point(str(tmp_path))
    assert path.endswith("checkpoint_epoch1.pth") and checkpoint["epoch"] == 1
    assert re.search(r"Resuming from \S+checkpoint_epoch1\.pth.*checkpoint_last\.pth is damaged", caplog.text)


def test_a_checkpoint_written_without_checksums_loads(tmp_path):
    path = tmp_path / "unchecked.pth"
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"net": model(0).state_dict()}, path)
    finally:
        torch.serialization.set_crc32_options(previous)
    with zipfile.ZipFile(path) as archive:
        assert all(record.CRC == 0 for record in archive.infolist())
    loaded = model(1)
    load_checkpoint(loaded, path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model(0).state_dict().items())


def test_untrusted_pickles_are_not_executed(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"net": {}, "payload": Evil()}, tmp_path / "evil.pth")
    refusal = r"is not a readable PyTorch checkpoint.*posix.system.*weights_only=True"
    with pytest.raises(ValueError, match=refusal) as err:
        load_checkpoint(model(0), tmp_path / "evil.pth")
    assert not (tmp_path / "pwned").exists()
    assert "weights_only` set to `False`" not in str(err.value)  # torch's advice to run the file's code is left out


def test_share_w_false_checkpoint_is_refused_by_a_share_w_true_model(tmp_path):
    torch.manual_seed(0)
    separate = MsViT(ARCH, img_size=64, num_classes=7, share_w=False)
    save_checkpoint(tmp_path / "separate.pth", separate)
    with pytest.raises(
        ValueError,
        match=r"query.weight.*query_global.weight.*SHARE_W",
    ):
        load_checkpoint(model(0), tmp_path / "separate.pth")
    load_checkpoint(MsViT(ARCH, img_size=64, num_classes=7, share_w=False), tmp_path / "separate.pth")


def test_compiled_model_prefix_is_stripped(tmp_path):
    source = model(0)
    torch.save({"net": {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "compiled.pth")
    target = model(1)
    load_checkpoint(target, tmp_path / "compiled.pth")
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


def test_data_sharing_a_class_with_the_checkpoint_under_another_label_is_refused(caplog):
    """A checkpoint trained on digits 0 and 1, evaluated on 1 and 2: its class '1' (output 1) would be scored as the
    data's label 0. Refused naming the class and both labels; classes that share no name are scored label by label,
    said once."""
    from vil.weights import check_trained_classes

    checkpoint = {"classes": ["0", "1"]}
    with pytest.raises(ValueError, match=r"class '1' as its label 1, but the data labels it 0.*DATA.CLASSES"):
        check_trained_classes(checkpoint, "digits.pth", ["1", "2"])
    with pytest.raises(ValueError, match=r"same classes in another order: its label 0 is '0', the data's '1'"):
        check_trained_classes(checkpoint, "digits.pth", ["1", "0"])
    check_trained_classes(checkpoint, "digits.pth", ["0", "2"])  # '0' keeps its label
    with caplog.at_level(logging.WARNING, logger="vil"):
        check_trained_classes(checkpoint, "digits.pth", ["cat", "dog"])
    assert "its label 0 is '0', the data's 'cat'" in caplog.text
    # A "classes" entry that is not a list of names records none: nothing to compare, nothing refused.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vil"):
        check_trained_classes({"classes": [0, "dog"]}, "odd.pth", ["cat", "dog"])
    assert not caplog.text


@pytest.mark.parametrize("key", ["ema", "state_dict_ema", "model_ema"])  # this project's, timm's, DeiT's and Swin's
def test_the_ema_weights_are_found_under_each_trainers_key(key):
    from vil.checkpoint import ema_state, model_state

    ema, model = {"head.weight": torch.ones(2, 2)}, {"head.weight": torch.zeros(2, 2)}
    checkpoint = {"model": model, key: ema}
    assert torch.equal(ema_state(checkpoint, "deit.pth")["head.weight"], ema["head.weight"])
    assert torch.equal(model_state(checkpoint, "deit.pth")["head.weight"], model["head.weight"])
    # The EMA weights are read as the model's are: DistributedDataParallel's prefix dropped, NaN refused.
    assert list(ema_state({"model": model, key: {"module.head.weight": torch.ones(2, 2)}}, "ddp.pth")) == [
        "head.weight"
    ]
    with pytest.raises(ValueError, match=r"nan\.pth holds values that are not finite .* in 1 tensors, e\.g\. head\.w"):
        ema_state({"model": model, key: {"head.weight": torch.full((2, 2), float("nan"))}}, "nan.pth")
