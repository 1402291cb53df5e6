"""DATA.FORMAT shards: tar shards written by tools/make_shards.py, read per process and per worker, every sample
once an epoch, damaged samples skipped and counted."""

import io
import pickle
import re
import sys
import tarfile

import pytest
from PIL import Image
from test_data import make_folder
from test_train import tiny_cfg
from tool_runner import run_tool
from torchvision.transforms import Compose, Resize, ToTensor

from vil.checkpoint import read_checkpoint
from vil.data import collate_skipping
from vil.shards import ShardDataset, write_index
from vil.training.loop import train
from vil.unreadable import warn_unreadable


def identity(image_and_target):
    """A sample's identity in make_folder's images: its class and its width (40 + its number)."""
    image, target = image_and_target
    return target, image.size[0]


@pytest.fixture
def shards(tmp_path):
    folder = make_folder(tmp_path / "folder", per_class=6, corrupt=False)  # 12 training and 12 evaluation images
    status, stdout, stderr = run_tool("make_shards", folder, tmp_path / "shards", "--per-shard", "3")
    assert status == 0, stderr
    assert "train: 12 images in 4 shards" in stdout and "val: 12 images in 4 shards" in stdout
    return tmp_path / "shards"


def test_each_process_reads_its_own_shards_and_every_sample_once_an_epoch(shards):
    train_set = ShardDataset(shards / "train")
    assert train_set.classes == ["cat", "dog"] and len(train_set) == 12
    everything = {(target, 40 + i) for target in (0, 1) for i in range(6)}
    for workers in (0, 2):
        assert train_set.steps_per_epoch(2, 2, 3, workers) == 2
        orders = []
        for epoch in (0, 1):
            seen = []
            for rank in (0, 1):
                batches = list(train_set.training_batches(epoch, rank, 2, 3, workers, collate_fn=list, stop=2))
                assert len(batches) == 2 and all(len(b) == 3 for b in batches)  # as many steps in every process
                seen.append([identity(sample) for batch in batches for sample in batch])
            assert not set(seen[0]) & set(seen[1]) and set(seen[0]) | set(seen[1]) == everything
            orders.append(seen)
        assert orders[0] != orders[1]  # a new order each epoch
    # Resuming at batch 1 gives the epoch's remaining batch.
    whole = list(train_set.training_batches(0, 1, 2, 3, 0, collate_fn=list))
    rest = list(train_set.training_batches(0, 1, 2, 3, 0, collate_fn=list, skip=1))
    assert [[identity(s) for s in b] for b in rest] == [[identity(s) for s in b] for b in whole[1:]]
    # Evaluation: every sample once over the processes, batches not filled up.
    val_set = ShardDataset(shards / "val")
    evaluated = [identity(s) for rank in (0, 1) for b in val_set.evaluation_batches(rank, 2, 5, 0, list) for s in b]
    assert sorted(evaluated) == sorted(everything)


def test_an_epoch_is_whole_steps_and_each_sample_augmented_by_its_own_seed(shards):
    """One process, 12 samples in batches of 2: 6 batches, 4 of them with 2 batches a step (the last 2 fill no step).
    The augmentation (here a random number a sample draws) depends on the seed, the epoch and the sample only."""
    import torch

    def draws(seed, epoch, workers, skip=0, accum=1):
        train_set = ShardDataset(shards / "train", transform=lambda image: (image.size[0], torch.rand(()).item()))
        train_set.seed = seed
        stop = train_set.steps_per_epoch(1, 1, 2, workers, accum) * accum
        batches = train_set.training_batches(epoch, 0, 1, 2, workers, list, skip=skip, stop=stop)
        return [(target, width, draw) for batch in batches for (width, draw), target in batch]

    torch.manual_seed(0)
    whole = draws(0, 0, 0)
    assert len(whole) == 12 and len(draws(0, 0, 0, accum=4)) == 8 and len(draws(0, 0, 0, accum=5)) == 10
    torch.manual_seed(1)  # the global random state plays no part
    assert draws(0, 0, 0, skip=2) == whole[4:]  # a resumed epoch: the same samples, the same draws
    assert sorted(draws(0, 0, 2)) == sorted(whole)  # workers: the same draws for each sample
    other_epoch, other_seed = ({(t, w): d for t, w, d in draws(*run, 0)} for run in ((0, 1), (1, 0)))
    assert all(other_epoch[t, w] != d and other_seed[t, w] != d for t, w, d in whole)
    # Nor do the batches draw from it: a mid-epoch checkpoint's saved state is the one a resumed run goes on with.
    before = torch.get_rng_state()
    draws(0, 0, 0, skip=2)
    draws(0, 0, 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_every_epoch_takes_the_steps_of_the_fewest_full_batches_and_the_schedule_counts_them(tmp_path):
    """Shards of 5, 5 and 2 samples, batches of 2, 2 workers each batching its own shards: an epoch whose order
    gives one worker both shards of 5 has 6 full batches, the others 5. Every epoch takes the fewest, counted from
    the loaders themselves, and the cosine schedule ends at its minimum."""
    folder = make_folder(tmp_path / "folder", per_class=6, corrupt=False)
    assert run_tool("make_shards", folder, tmp_path / "shards", "--per-shard", "5")[0] == 0
    train_set = ShardDataset(tmp_path / "shards" / "train", seed=4)
    assert sorted(train_set.counts.values()) == [2, 5, 5]
    assert [len(list(train_set.training_batches(epoch, 0, 1, 2, 2, list))) for epoch in (0, 1)] == [6, 5]
    assert train_set.steps_per_epoch(1, 1, 2, 2) == 6 and train_set.steps_per_epoch(2, 1, 2, 2) == 5
    assert train_set.steps_per_epoch(2, 1, 2, 2, accum=2) == 2
    out = tmp_path / "run"
    cfg = tiny_cfg(tmp_path / "shards", out, "DATA.FORMAT", "shards", "DATALOADER.BSZ", "2", "SEED", "4")
    cfg.merge_from_list(["DATALOADER.WORKERS", "2", "SOLVER.WARMUP_EPOCHS", "0.0"])
    train(cfg)
    checkpoint = read_checkpoint(str(out / "checkpoint_last.pth"))
    assert checkpoint["step"] == 2 * 5
    assert all(group["lr"] == 0.0 for group in checkpoint["optimizer"]["param_groups"])  # SOLVER.MIN_LR


def test_training_on_shards_skips_and_counts_a_damaged_sample(shards, tmp_path):
    import webdataset

    with webdataset.TarWriter(str(shards / "train" / "shard-000000.tar")) as tar:  # 3 samples, one damaged
        for key, payload, target in (("a", None, 0), ("b", b"not an image", 1), ("c", None, 1)):
            image = payload
            if image is None:
                from io import BytesIO

                from PIL import Image

                buffer = BytesIO()
                Image.new("RGB", (40, 40), (10, 20, 30)).save(buffer, format="PNG")
                image = buffer.getvalue()
            tar.write({"__key__": key, "png": image, "cls": str(target).encode()})
    out = tmp_path / "run"
    train(tiny_cfg(shards, out, "DATA.FORMAT", "shards", "OPTIM.EPOCHS", "1", "DATALOADER.WORKERS", "1"))
    log = (out / "log.txt").read_text()
    assert "12 training and 12 evaluation images" in log
    assert re.search(r"Skipped unreadable image \S*shard-000000\.tar:b \(cannot identify image file as any", log)
    assert "BytesIO" not in log  # Pillow's own words name the bytes' file object by its address
    assert "epoch 1/1:" in log and "skipped 1 unreadable images" in log
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["step"] == 3  # 12 images, 4 a batch


def test_an_epoch_that_ends_inside_an_optimizer_step_drops_its_gradients(shards, tmp_path, monkeypatch):
    """A damaged shard can end an epoch between the batches of one OPTIM.ACCUM_STEPS step: their gradients are
    dropped (said once), not added into the next epoch's first step."""
    import itertools

    import vil.training.loop

    real_batches, real_epoch = ShardDataset.training_batches, vil.training.loop.train_one_epoch
    monkeypatch.setattr(  # 3 batches of the 6 planned, as if the process's shards ended there
        ShardDataset, "training_batches", lambda *args, **kwargs: itertools.islice(real_batches(*args, **kwargs), 3)
    )
    held = []  # whether any parameter holds a gradient when an epoch starts and when it ends

    def recorded(run, epoch):
        held.append(any(p.grad is not None for p in run.model.parameters()))
        result = real_epoch(run, epoch)
        held.append(any(p.grad is not None for p in run.model.parameters()))
        return result

    monkeypatch.setattr(vil.training.loop, "train_one_epoch", recorded)
    out = tmp_path / "run"
    cfg = tiny_cfg(shards, out, "DATA.FORMAT", "shards", "OPTIM.EPOCHS", "2", "DATALOADER.BSZ", "2")
    cfg.merge_from_list(["OPTIM.ACCUM_STEPS", "2"])
    train(cfg)
    assert held == [False, False, False, False]
    log = (out / "log.txt").read_text()
    assert log.count("ends 3 of its batches early") == 2 and "last 1 batch(es) of epoch 2 make no step" in log
    assert read_checkpoint(str(out / "checkpoint_last.pth"))["step"] == 2  # one step of 2 batches an epoch


def test_a_run_on_shards_names_its_classes_as_the_folders_did(shards, tmp_path):
    from vil.hub import class_names

    folders = sorted(p.name for p in (tmp_path / "folder" / "train").iterdir())  # the split tools/make_shards.py read
    assert class_names(tiny_cfg(shards, tmp_path / "o", "DATA.FORMAT", "shards")) == folders != ["0", "1"]


def png_bytes(colour=(10, 20, 30)):
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def evaluated(folder):
    """Every sample of the split ``folder`` read for evaluation: (targets, names of the unreadable samples)."""
    transform = Compose([Resize((8, 8)), ToTensor()])
    batches = list(ShardDataset(folder, transform).evaluation_batches(0, 1, 2, 0, collate_skipping))
    return [int(t) for _, targets, _ in batches for t in targets], [n for _, _, names in batches for n in names]


def test_a_sample_is_its_image_and_class_whatever_else_it_holds(tmp_path):
    import webdataset

    write_index(tmp_path, ["cat", "dog"], {"shard-000000.tar": 4})
    with webdataset.TarWriter(str(tmp_path / "shard-000000.tar")) as tar:
        tar.write({"__key__": "a", "jpg": png_bytes(), "cls": b"1", "json": b"{}"})  # an extra member
        tar.write({"__key__": "b", "cls": b"0", "json": b"{}"})  # no image
        tar.write({"__key__": "c", "png": png_bytes(), "json": b"{}"})  # no class
        tar.write({"__key__": "d", "png": png_bytes(), "cls": b"2"})  # one past the last of the 2 classes
    targets, unreadable = evaluated(tmp_path)
    assert targets == [1] and len(unreadable) == 3
    assert re.search(r"shard-000000\.tar:b \(no image member \(members: cls, json\)", unreadable[0])
    assert re.search(r"shard-000000\.tar:c \(no cls member", unreadable[1])
    assert re.search(r"shard-000000\.tar:d \(class index 2 outside the 2 classes", unreadable[2])


def test_a_shard_cut_short_gives_its_samples_before_the_cut_and_names_itself(shards):
    first = shards / "val" / "shard-000000.tar"
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    targets, unreadable = evaluated(shards / "val")
    assert 9 <= len(targets) < 12  # the other three shards whole, the first one's samples before the cut
    (name,) = unreadable
    assert re.search(r"shard-000000\.tar:after \S+ \(the shard cannot be read past this point, .*make_shards", name)


def test_a_shard_ending_cleanly_before_its_index_count_names_itself_and_evaluation_counts_what_is_lost(tmp_path):
    """Cut at a member's boundary, a tar reads as a clean end: the index's count tells the samples are lost, and
    evaluation counts every image of the set as scored or skipped."""
    import contextlib

    import torch
    import webdataset

    from vil.runtime import Runtime
    from vil.training.evaluation import evaluate

    write_index(tmp_path, ["cat", "dog"], {"shard-000000.tar": 4})
    with webdataset.TarWriter(str(tmp_path / "shard-000000.tar")) as tar:
        for key in "ab":
            tar.write({"__key__": key, "png": png_bytes(), "cls": b"1"})
    targets, unreadable = evaluated(tmp_path)
    assert targets == [1, 1]
    (name,) = unreadable
    assert re.search(r"shard-000000\.tar:after b \(.*ends after 2 of the 4 samples its index\.json lists", name)
    assert "(2 of those its index.json lists)" in name
    # The marker stands for both lost samples, also as a worker process hands it over.
    assert warn_unreadable([pickle.loads(pickle.dumps(name))]) == 2
    dataset = ShardDataset(tmp_path, Compose([Resize((8, 8)), ToTensor()]))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
    loader = dataset.evaluation_batches(0, 1, 2, 0, collate_skipping)
    result = evaluate(model, loader, Runtime(), contextlib.nullcontext, 2, expected=len(dataset))
    assert (result["images"], result["skipped"]) == (2, 2)  # the two samples the marker stands for


def test_a_process_without_an_evaluation_shard_evaluates_nothing(shards):
    val_set = ShardDataset(shards / "val")
    assert list(val_set.evaluation_batches(5, 8, 2, 0, list)) == []  # 4 shards for 8 processes
    seen = [identity(s) for rank in range(8) for b in val_set.evaluation_batches(rank, 8, 2, 0, list) for s in b]
    assert len(seen) == len(set(seen)) == 12


def test_fewer_shards_than_processes_is_one_sentence(shards, tmp_path, monkeypatch):
    """Each process reads shards of its own: a process left with none would end training with advice (a smaller
    batch) that cannot help. (Only the set-up's wait for the main process runs before the check: the other processes
    need not exist.)"""
    from vil import runtime

    real_init = runtime.Runtime.__init__

    def eight_processes(self, backend="nccl"):
        real_init(self, backend)
        self.world = 8

    monkeypatch.setattr(runtime.Runtime, "__init__", eight_processes)
    monkeypatch.setattr(runtime.Runtime, "in_main", lambda self, action: action())  # the set-up's, as in process 0
    with pytest.raises(ValueError, match=r"4 shards for 8 processes.*at least one shard per process"):
        train(tiny_cfg(shards, tmp_path / "run", "DATA.FORMAT", "shards", "DATALOADER.BSZ", "8"))


def test_bad_shard_requests_are_one_sentence(shards, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"not a folder of shards.*make_shards.py",
    ):
        ShardDataset(tmp_path)
    with pytest.raises(ValueError, match=r"DATA.CLASSES picks classes of image folders"):
        train(tiny_cfg(shards, tmp_path / "o", "DATA.FORMAT", "shards", "DATA.CLASSES", "['cat', 'dog']"))
    with pytest.raises(ValueError, match=r"AUG.REPEATED_AUG.*image folders.*False"):
        train(tiny_cfg(shards, tmp_path / "o2", "DATA.FORMAT", "shards", "AUG.REPEATED_AUG", "True"))
    index = (shards / "val" / "index.json").read_text()
    (shards / "val" / "index.json").write_text(index.replace(": 3", ': "3"', 1))  # a count as text
    with pytest.raises(ValueError, match=r"not a folder of shards.*sample counts are not all whole numbers"):
        ShardDataset(shards / "val")
    (shards / "train" / "shard-000003.tar").unlink()
    with pytest.raises(ValueError, match=r"lists 1 shards.*shard-000003\.tar"):
        ShardDataset(shards / "train")
    status, _, stderr = run_tool("make_shards", tmp_path / "folder", shards)
    assert status == 1 and stderr.startswith(f"error: {shards / 'train'} exists; remove it or choose another")
    (tmp_path / "a_file").write_text("")
    status, _, stderr = run_tool("make_shards", tmp_path / "folder", tmp_path / "a_file" / "new")
    assert status == 1 and stderr.startswith(f"error: The output {tmp_path / 'a_file' / 'new'} cannot be written")
    status, _, stderr = run_tool("make_shards", tmp_path / "folder", tmp_path / "new", "--per-shard", "0")
    assert status == 1 and stderr.startswith("error: --per-shard must be a positive number of samples, got 0.")
    (tmp_path / "folder" / "val" / "empty").mkdir()  # a class of no images, found before anything is written
    status, _, stderr = run_tool("make_shards", tmp_path / "folder", tmp_path / "new")
    assert status == 1 and "empty" in stderr and not (tmp_path / "new" / "train").exists()
    (tmp_path / "folder" / "val" / "empty" / "0.JPEG").write_bytes(
        (tmp_path / "folder" / "val" / "cat" / "0.JPEG").read_bytes()
    )
    status, _, stderr = run_tool("make_shards", tmp_path / "folder", tmp_path / "new")
    assert status == 1 and "only the evaluation data has ['empty']" in stderr and not (tmp_path / "new").exists()
    status, _, stderr = run_tool("make_shards", shards / "train", tmp_path / "new")
    assert status == 1 and stderr.startswith(
        f"error: {shards / 'train'} has neither train/ nor val/; give the DATA.PATH"
    )
    (tmp_path / "a_file").write_text("")
    for source, output, fact in (
        (tmp_path / "nowhere", tmp_path / "new", f"{tmp_path / 'nowhere'} does not exist"),
        (tmp_path / "a_file", tmp_path / "new", f"{tmp_path / 'a_file'} is a file, not a folder"),
        (tmp_path / "folder", tmp_path / "a_file", f"The output {tmp_path / 'a_file'} is a file"),
    ):
        status, _, stderr = run_tool("make_shards", source, output)
        assert status == 1 and fact in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_a_split_of_no_samples_is_one_sentence(tmp_path):
    write_index(tmp_path, ["cat", "dog"], {})
    with pytest.raises(ValueError, match=r"index\.json lists no samples; write the split with tools/make_shards\.py"):
        ShardDataset(tmp_path)


def test_make_shards_names_a_file_it_cannot_read_and_leaves_it_out(tmp_path):
    folder = make_folder(tmp_path / "folder", per_class=2, corrupt=False)
    (folder / "train" / "dog" / "gone.JPEG").symlink_to(tmp_path / "nowhere.JPEG")  # a broken link
    status, stdout, stderr = run_tool("make_shards", folder, tmp_path / "shards", "--per-shard", "2")
    assert status == 0, stderr
    assert re.search(r"Skipped unreadable image \S*dog/gone\.JPEG \(No such file or directory\)", stderr)
    assert "train: 4 images in 3 shards" in stdout and "val: 4 images in 2 shards" in stdout
    train_set = ShardDataset(tmp_path / "shards" / "train")
    assert len(train_set) == 4
    targets, unreadable = evaluated(tmp_path / "shards" / "train")
    assert sorted(targets) == [0, 0, 1, 1] and unreadable == []


def test_make_shards_numbers_samples_across_shards_and_shuffles_only_the_training_images(tmp_path):
    folder = make_folder(tmp_path / "folder", per_class=4, corrupt=False)
    status, _, stderr = run_tool("make_shards", folder, tmp_path / "shards", "--per-shard", "3")
    assert status == 0, stderr

    def members(split):  # (key, class) of every sample, shard by shard
        found = []
        for shard in sorted((tmp_path / "shards" / split).glob("shard-*.tar")):
            with tarfile.open(shard) as tar:
                for member in tar.getmembers():
                    if member.name.endswith(".cls"):
                        found.append((member.name[: -len(".cls")], int(tar.extractfile(member).read())))
        return found

    for split in ("train", "val"):
        keys = [key for key, _ in members(split)]
        assert keys == [f"{n:09d}" for n in range(8)]  # one key per sample, none repeated in a later shard
    assert [target for _, target in members("val")] == [0, 0, 0, 0, 1, 1, 1, 1]  # as image folders list them
    training = [target for _, target in members("train")]
    assert sorted(training) == [0, 0, 0, 0, 1, 1, 1, 1] and training != sorted(training)  # seed 0's order


def test_make_shards_without_webdataset_says_so_before_making_anything(tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "folder", per_class=2, corrupt=False)
    monkeypatch.setitem(sys.modules, "webdataset", None)  # as if not installed: its import fails
    status, _, stderr = run_tool("make_shards", folder, tmp_path / "shards")
    assert status == 1 and re.fullmatch(
        r"error: make_shards\.py writes tar shards with webdataset .*pip install 'vil\[shards\]'\.", stderr.strip()
    )
    assert not (tmp_path / "shards").exists()
