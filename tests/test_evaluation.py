"""evaluate(): top-1, top-5, the per-class figures and the count of non-finite outputs, against values counted by
hand from fixed logits."""

import contextlib
import logging
import math
import re
import sys

import pytest
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from vil.data import collate_skipping
from vil.progress import log_lines_above_bars
from vil.runtime import Runtime
from vil.training.evaluation import evaluate
from vil.unreadable import Unreadable

# One row per image, 7 classes; no ties within a row. Each comment: the target, then the classes in the order of
# their logits (highest first) and the target's rank in that order.
LOGITS = [
    [5.0, 1, 0, 2, 3, 4, -1],  # 0: 0 5 4 3 1 2 6, rank 1
    [0.0, 6, 1, 2, 5, 4, 3],  # 3: 1 4 5 6 3 2 0, rank 5
    [6.0, 5, 0, 4, 3, 2, 1],  # 2: 0 1 3 4 5 6 2, rank 7
    [1.0, 0, 2, 3, 4, 5, 9],  # 6: 6 5 4 3 2 0 1, rank 1
    [3.0, 2, 4, 5, 6, 1, 0],  # 1: 4 3 2 0 1 5 6, rank 5
    [1.0, 2, 3, 4, 5, 6, 7],  # 1: 6 5 4 3 2 1 0, rank 6 (in the top 6, not the top 5)
    [0.0, 1, 2, 3, 8, 5, -math.inf],  # 4: 4 5 3 2 1 0 6, rank 1, but not finite: no hit
    [4.0, 5, 3, 2, 1, 0, -2],  # 0: 1 0 2 3 4 5 6, rank 2
]
TARGETS = [0, 3, 2, 6, 1, 1, 4, 0]


class FixedLogits(torch.nn.Module):
    """Returns the row of LOGITS that each image's single pixel indexes; records whether it ran in evaluation mode
    and without gradients."""

    def __init__(self, rows):
        super().__init__()
        self.rows = torch.tensor(rows)
        self.calls = []

    def forward(self, images):
        self.calls.append((self.training, torch.is_grad_enabled(), len(images)))
        return self.rows.to(images.device)[images.flatten(1)[:, 0].long()]


def image(index):
    return torch.full((1, 1, 1), float(index))


def test_evaluate_counts_top1_top5_per_class_and_nonfinite_outputs_by_hand(caplog):
    broken = Unreadable("broken.JPEG (cannot identify image file)")
    samples = [(image(i), t) for i, t in enumerate(TARGETS)]
    # Batches of 3: [0 1 2] [3 broken 4] [5 6 7] [broken broken]; the last is empty once the unreadable are dropped.
    samples = samples[:4] + [broken] + samples[4:] + [broken, broken]
    loader = DataLoader(samples, batch_size=3, collate_fn=collate_skipping)
    model = FixedLogits(LOGITS).train()
    with caplog.at_level("WARNING", logger="vil"):
        result = evaluate(model, loader, Runtime(), contextlib.nullcontext, num_classes=7)
    assert model.calls == [(False, False, 3), (False, False, 2), (False, False, 3)]
    # Top-1 hits: images 0 and 3 of 8; top-5 hits: all but images 2 (rank 7), 5 (rank 6) and 6 (not finite).
    assert result["top1"] == pytest.approx(100 * 2 / 8)
    assert result["top5"] == pytest.approx(100 * 5 / 8)
    # Per class: images, top-1 hits, top-5 hits.
    per_class = [
        [2, 1, 2],  # class 0: images 0 (rank 1) and 7 (rank 2)
        [2, 0, 1],  # class 1: images 4 (rank 5) and 5 (rank 6)
        [1, 0, 0],  # class 2: image 2 (rank 7)
        [1, 0, 1],  # class 3: image 1 (rank 5)
        [1, 0, 0],  # class 4: image 6 (rank 1, not finite)
        [0, 0, 0],  # class 5: no image
        [1, 1, 1],  # class 6: image 3 (rank 1)
    ]
    assert result["per_class"].tolist() == per_class and result["per_class"].device.type == "cpu"
    assert result["nonfinite"] == 1  # image 6's -inf
    assert (result["images"], result["skipped"]) == (8, 3)  # eval.json's counts: images scored, and skipped
    # Each unreadable image named in a warning, and their number in one more.
    assert sum("broken.JPEG (cannot identify image file)" in m for m in caplog.messages) == 3, caplog.messages
    assert sum(bool(re.search(r"\bskipped 3 unreadable\b", m)) for m in caplog.messages) == 1, caplog.messages


def test_images_whose_outputs_are_not_finite_are_no_hits_whatever_topk_ranks():
    """topk ranks NaN as well as numbers: rows of NaN (the EMA weights' outputs, say, which evaluation scores rather
    than stops at) would otherwise count as hits at whatever ranks it gives them."""
    nan = math.nan
    rows = [[nan, nan, nan], [2.0, nan, 0], [2.0, 1, 0]]
    targets = [0, 0, 0]  # topk ranks class 0 first, second and first: three top-5 hits, but two are not finite
    loader = DataLoader([(image(i), t) for i, t in enumerate(targets)], batch_size=3, collate_fn=collate_skipping)
    result = evaluate(FixedLogits(rows), loader, Runtime(), contextlib.nullcontext, num_classes=3)
    assert result["top1"] == pytest.approx(100 / 3) and result["top5"] == pytest.approx(100 / 3)
    assert result["per_class"].tolist() == [[3, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert result["nonfinite"] == 2


def test_evaluation_of_which_no_image_can_be_read_is_refused_not_scored_zero():
    broken = Unreadable("broken.JPEG (cannot identify image file)")
    loader = DataLoader([broken, broken, broken], batch_size=2, collate_fn=collate_skipping)
    with pytest.raises(ValueError, match=r"No image of the evaluation data could be scored: all 3 were unreadable"):
        evaluate(FixedLogits(LOGITS), loader, Runtime(), contextlib.nullcontext, num_classes=7)


def test_evaluate_with_fewer_than_five_classes_counts_every_image_in_the_top_five():
    rows = [[2.0, 1, 0], [0.0, 2, 1], [1.0, 0, 2], [0.0, 1, 2]]
    targets = [0, 2, 1, 1]  # ranks 1, 2, 3 and 2
    loader = DataLoader([(image(i), t) for i, t in enumerate(targets)], batch_size=4, collate_fn=collate_skipping)
    result = evaluate(FixedLogits(rows), loader, Runtime(), contextlib.nullcontext, num_classes=3)
    assert result["top1"] == pytest.approx(25.0) and result["top5"] == pytest.approx(100.0)
    assert result["per_class"].tolist() == [[1, 1, 1], [2, 0, 2], [1, 0, 1]]
    assert result["nonfinite"] == 0


@pytest.mark.parametrize("stream", ["stderr", "stdout"])  # setup_logging's console, or basicConfig(stream=...)'s
@pytest.mark.parametrize("where", ["the vil logger's own handler", "the root logger's, propagated to"])
def test_log_lines_during_a_progress_bar_are_printed_above_it_once(capsys, where, stream):
    """What a terminal shows of each line (the text after its last carriage return): the logged lines whole, each
    once, not behind the bar's text (the bar and the log on the same stream, as on one terminal)."""
    vil_log, root = logging.getLogger("vil"), logging.getLogger()
    saved = vil_log.handlers, vil_log.propagate, root.handlers
    console = logging.StreamHandler(getattr(sys, stream))
    if where == "the vil logger's own handler":
        vil_log.handlers, vil_log.propagate = [console], False
    else:
        vil_log.handlers, vil_log.propagate, root.handlers = [], True, [console]
    try:
        with log_lines_above_bars():
            for i in tqdm(range(3), desc="bar", file=getattr(sys, stream)):
                vil_log.warning(f"line {i}")
    finally:
        vil_log.handlers, vil_log.propagate, root.handlers = saved
    shown = [line.split("\r")[-1] for line in getattr(capsys.readouterr(), stream[3:]).split("\n")]
    assert [line for line in shown if "line" in line] == ["line 0", "line 1", "line 2"]
