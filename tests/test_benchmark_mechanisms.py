"""The efficiency study of the attention mechanisms (tools/benchmark_mechanisms.py): a tiny run end to end, and
its skip and failure rules."""

import contextlib
import dataclasses
import io
import json
import math
import re
import subprocess

import pytest
import torch
from tool_runner import load_tool

from vil.models import MsViT, arch_string, parse_arch, stage_map_sizes
from vil.profiling import flop_counter

PNG = b"\x89PNG\r\n\x1a\n"
# What the original release reports (ImageNet top-1, %), as the table must say.
TOP1 = {
    "full/all": "81.9",
    "longformer/all": "",
    "longformer/partial": "82.0",
    "linformer/all": "81.0",
    "linformer/partial": "81.8",
    "srformer/all": "79.9",
    "srformer/partial": "81.6",
    "performer/all": "78.7",
    "performer/partial": "81.7",
    "global/all": "79.0",
    "global/partial": "81.4",
}


def narrow(arch):
    """The arch with a quarter of the width and one layer a stage: the same stages, patches, windows, global
    tokens and mechanisms, built and run in a fraction of the time."""
    return arch_string(dataclasses.replace(s, dim=s.dim // 4, depth=1) for s in parse_arch(arch))


@pytest.fixture
def tool(monkeypatch):
    """The tool with narrow models, its workers run in this process with one thread (the machine may be busy)."""
    tool = load_tool("benchmark_mechanisms")
    monkeypatch.setattr(tool, "MODELS", {name: (narrow(arch), kwargs) for name, (arch, kwargs) in tool.MODELS.items()})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tool
    torch.set_num_threads(threads)


def in_process_workers(tool, monkeypatch):
    workers, real_run = [], subprocess.run

    def run(argv, **kwargs):
        if "--worker" not in argv:  # platform's questions to the system
            return real_run(argv, **kwargs)
        workers.append(argv)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            tool.main(argv[2:])
        return subprocess.CompletedProcess(argv, 0, printed.getvalue(), "")

    monkeypatch.setattr(tool.subprocess, "run", run)
    return workers


def full_attention_gmacs(arch, size):
    """Forward GMACs of the full-attention model: the counter's count of everything but attention (torch's SDPA, or
    the batched products of the attention written out, vil.models.attention.softmax_attention), plus the attention
    by hand: q k^T and the product with v, each (tokens)^2 x width multiply-adds, per layer."""
    model = MsViT(arch, img_size=size, attention="full").eval()
    with torch.no_grad(), flop_counter() as counter:
        model(torch.randn(1, 3, size, size))
    counts = counter.get_flop_counts()["Global"].items()
    others = sum(flops for op, flops in counts if "attention" not in str(op) and "bmm" not in str(op))
    specs = parse_arch(arch)
    attention = sum(
        2 * (rows * cols + s.num_global) ** 2 * s.dim * s.depth
        for s, (rows, cols) in zip(specs, stage_map_sizes(specs, (size, size)))
    )
    return (others / 2 + attention) / 1e9


def test_study_end_to_end(tool, tmp_path, monkeypatch, capsys):
    workers = in_process_workers(tool, monkeypatch)
    prefix = tmp_path / "study"
    # No step skipped for its estimated time, however busy the machine (the skip has a test of its own).
    tool.main(
        ["--sizes", "128", "32", "--repeats", "1", "--max-step-seconds", "0"]
        + ["--markdown", str(tmp_path / "study.md"), "--plot", str(prefix)]
    )
    assert [w[w.index("--repeats") + 1] for w in workers] == ["1", "1"]  # one fresh worker per size
    assert [json.loads(w[3])[1] for w in workers] == [32, 128]

    text = (tmp_path / "study.md").read_text()
    printed = capsys.readouterr().out
    assert text.startswith("Machine: ") and all(line in printed for line in text.splitlines()[1:])
    cells = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith(("| 32x32 ", "| 128x128 "))
    ]
    names = list(TOP1)
    assert [(c[0], f"{c[2]}/{c[3]}") for c in cells] == [(f"{s}x{s}", n) for s in (32, 128) for n in names]
    assert all(c[1] == str((s // 4) ** 2) for c, s in zip(cells, [32] * 11 + [128] * 11))  # stage-1 tokens
    assert all(c[-1] == TOP1[f"{c[2]}/{c[3]}"] for c in cells)
    rows = {(c[0], f"{c[2]}/{c[3]}"): c for c in cells}
    for placement in ("all", "partial"):  # stage 1's 8x8 map reduced by 8 leaves one position
        refusal = rows["32x32", f"srformer/{placement}"][4]
        assert re.fullmatch(r"refused: [^\n]*stage 1[^\n]*8x8[^\n]* 8 [^\n]*1x1[^\n]* 2 positions", refusal), refusal
    measured = {key: [float(x) for x in c[4:9]] for key, c in rows.items() if not c[4].startswith("refused")}
    assert len(measured) == 20 and all(value > 0 for numbers in measured.values() for value in numbers)

    gmacs = {key: numbers[1] for key, numbers in measured.items()}
    assert gmacs["128x128", "full/all"] == pytest.approx(
        full_attention_gmacs(tool.MODELS["full/all"][0], 128), abs=6e-4
    )
    # Past 256 tokens linformer's 256 projected keys are fewer than full attention's, ViL's windows fewer still.
    assert gmacs["128x128", "longformer/all"] < gmacs["128x128", "linformer/all"] < gmacs["128x128", "full/all"]

    growth = {
        f"{c[0]}/{c[1]}": c[2:]
        for c in (
            [x.strip() for x in line.strip("|").split("|")]
            for line in text.split("Growth of each cost")[1].splitlines()
            if line.startswith("| ") and "mechanism" not in line
        )
    }
    assert list(growth) == names and all(growth[n][0] == TOP1[n] for n in names)
    for name in names:
        if name.startswith("srformer"):  # measured at one size only
            assert growth[name][1:] == ["", "", "", "", ""]
            continue
        assert growth[name][1] == "32 and 128"
        training, forward, memory, flops = (float(x) for x in growth[name][2:])
        assert memory > 0 and flops == pytest.approx(
            math.log(gmacs["128x128", name] / gmacs["32x32", name], 16), abs=0.01
        )
    # Full attention's work grows fastest, faster than the tokens; the other mechanisms' keys per query are bounded.
    flops = {name: float(growth[name][-1]) for name in names if not name.startswith("srformer")}
    assert max(flops, key=flops.get) == "full/all" and flops["full/all"] > 1.2, flops
    assert "srformer/64" in text

    for what in ("time", "memory", "flops"):
        assert (tmp_path / f"study_{what}.png").read_bytes()[:8] == PNG
    assert not list(tmp_path.glob(".tmp-*"))


def test_skips_and_failures(tool, monkeypatch):
    """No model is built here: the time guard and a dying worker answer in the table."""

    def point(step):  # forward s, training step s, MiB, GMACs, M parameters
        return 0.01, step, 10.0, 0.1, 1.0

    history = {
        224: {"full/all": point(1.0), "linformer/all": point(1.0)},
        448: {"full/all": point(8.0), "linformer/all": "failed"},
    }
    # full: 8x the time for 4x the tokens, exponent 1.5 -> 8 * 2.25^1.5 at 672; linformer, measured once: quadratic.
    assert tool.estimated_step(history, "full/all", 672) == pytest.approx(8 * 2.25**1.5)
    assert tool.estimated_step(history, "linformer/all", 672) == pytest.approx(1.0 * 9**2)
    assert tool.estimated_step(history, "performer/all", 672) is None

    calls = []

    def fake_run(argv, **kwargs):
        names = json.loads(argv[3])[0]
        calls.append(names)
        if len(names) > 1:  # the joint worker dies
            return subprocess.CompletedProcess(argv, -9, "", "")
        if names == ["performer/all"]:
            return subprocess.CompletedProcess(argv, 1, "", "Traceback ...\nRuntimeError: not enough memory\n")
        return subprocess.CompletedProcess(argv, 0, json.dumps({names[0]: list(point(2.0))}) + "\n", "")

    monkeypatch.setattr(tool.subprocess, "run", fake_run)
    args = tool.parse_args(["--max-step-seconds", "30"])
    results = tool.run_size(args, ["full/all", "linformer/all", "performer/all", "global/all"], 672, history)
    assert results["full/all"] == point(2.0)  # estimated at 27 s
    skipped = results["linformer/all"]
    assert skipped.startswith("skipped:") and "81 s" in skipped and "--max-step-seconds 30" in skipped
    assert results["performer/all"] == "failed: RuntimeError: not enough memory"
    assert results["global/all"] == point(2.0)
    assert calls[0] == ["full/all", "performer/all", "global/all"] and sorted(map(tuple, calls[1:])) == [
        ("full/all",),
        ("global/all",),
        ("performer/all",),
    ]

    monkeypatch.setattr(tool.subprocess, "run", lambda argv, **kwargs: subprocess.CompletedProcess(argv, -9, "", ""))
    killed = "failed: worker killed by signal SIGKILL (out of memory?)"
    assert tool.run_size(args, ["global/all"], 672, {}) == {"global/all": killed}


def test_no_plots_where_no_model_was_measured(tool, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        tool, "run_size", lambda args, names, size, study: {name: "refused: too small" for name in names}
    )
    tool.main(["--sizes", "8", "--repeats", "1", "--plot", str(tmp_path / "study")])
    assert (
        f"No model was measured at any size: no plots written to {tmp_path / 'study'}_*.png." in capsys.readouterr().out
    )
    assert not list(tmp_path.iterdir())
