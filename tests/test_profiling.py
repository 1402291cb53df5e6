"""PeakMemory on the CPU counts the allocator's tensors, allocation by allocation."""

import os
import subprocess
import sys

import torch

from vil.profiling import PeakMemory

MIB = 2**20


def test_cpu_peak_is_the_most_held_at_once():
    kept = torch.empty(3 * MIB, dtype=torch.uint8)  # held before the block: not counted
    with PeakMemory("cpu") as peak:
        first = torch.empty(10 * MIB, dtype=torch.uint8)
        del first
        second = torch.empty(6 * MIB, dtype=torch.uint8)
        third = torch.empty(5 * MIB, dtype=torch.uint8)
    assert peak.mib == 11.0  # second and third together; first alone was 10
    with PeakMemory("cpu") as peak:
        del second, third
    assert peak.mib == 0.0
    assert kept.numel() == 3 * MIB


def test_a_cpu_profile_on_a_machine_without_a_gpu_logs_no_gpu_error():
    """A CUDA build of torch, profiling the CPU where there is no GPU, logs "gpuGetDeviceCount failed", and torch
    2.14 logs "profiler_start" and "profiler_stop" for every profile, unless told not to (a fresh process: the
    profiler says the first once)."""
    code = "from vil.profiling import PeakMemory\nwith PeakMemory('cpu'):\n    pass\nprint('profiled')"
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "profiled", done.stderr
    if not torch.cuda.is_available():
        for line in ("gpuGetDeviceCount", "profiler_start", "profiler_stop"):
            assert line not in done.stderr, done.stderr


# A three-stage ViL small enough for a test, at 32x32 with 3 classes.
TINY_MODEL = [
    "INPUT.IMAGE_SIZE",
    "32",
    "MODEL.VIT.MSVIT.ARCH",
    "l1,h1,d16,n1,s1,g1,p4,f2,a0_l2,h1,d16,n1,s0,g1,p2,f2,a0_l3,h1,d16,n1,s0,g1,p2,f2,a0",
    "DATA.NUM_CLASSES",
    "3",
]


def test_benchmark_model_compares_with_a_timm_model_and_profiles_both():
    from tool_runner import ROOT, run_tool

    options = ["--batch", "2", "--steps", "1", "--rounds", "1", "--timm", "resnet10t", "--profile"]
    status, out, err = run_tool(
        "benchmark_model", "--config-file", ROOT / "configs/vil_tiny.yaml", *options, *TINY_MODEL
    )
    assert status == 0, err
    assert "| eager |" in out and "| timm resnet10t |" in out
    assert "| float32 |" in out  # the preset's AMP.ENABLED is its GPU recipe's: without AMP.ON_CPU, float32
    # One profile per contender, each listing the operators that took the time: the products among them.
    assert out.count("two training steps:") == 2
    eager_profile, timm_profile = out.split("two training steps:")[1:]
    assert "aten::mm" in eager_profile or "aten::addmm" in eager_profile
    assert "convolution" in timm_profile


def test_benchmark_model_steps_run_under_the_configs_autocast(monkeypatch):
    from tool_runner import ROOT, run_tool

    logits = []
    cross_entropy = torch.nn.functional.cross_entropy
    monkeypatch.setattr(
        torch.nn.functional, "cross_entropy", lambda x, y: logits.append(x.dtype) or cross_entropy(x.float(), y)
    )
    amp = ["AMP.ENABLED", "True", "AMP.ON_CPU", "True"]
    config = ["--config-file", ROOT / "configs/vil_tiny.yaml", "--batch", "2", "--steps", "1"]
    status, out, err = run_tool("benchmark_model", *config, *TINY_MODEL, *amp)
    assert status == 0, err
    assert "| autocast bfloat16 |" in out
    # The machine, and the backend the op layer picks for the model's bfloat16 local attention.
    from vil.ops import default_backend

    said = f"local attention backend (backend=None): {default_backend('cpu', torch.bfloat16)}"
    assert out.startswith("Machine: ") and out.splitlines()[0].endswith(said), out
    assert logits and set(logits) == {torch.bfloat16}  # the model's logits, computed under autocast


def test_cpu_sdpa_is_counted_by_this_projects_counter_only():
    """torch's own FLOP counter has no formula for its CPU SDPA kernel, and importing vil leaves it so; the
    project's counter counts it as the two products of attention, 2 * L * S * D multiply-adds each (per batch entry
    and head), and its backward too."""
    from torch.utils.flop_counter import FlopCounterMode

    import vil  # noqa: F401
    from vil.profiling import flop_counter

    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    with FlopCounterMode(display=False) as torch_counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch_counter.get_total_flops() == 0
    assert counter.get_total_flops() == 2 * (2 * 2 * 5 * 7 * 8)
    # Its backward as five such products: the scores again, then the gradients of v, the probabilities, q and k.
    for t in (q, k, v):
        t.requires_grad_()
    with flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    assert counter.get_total_flops() == (2 + 5) * (2 * 2 * 5 * 7 * 8)


def test_benchmark_model_counts_multiply_adds_and_images_over_the_clocks_seconds(monkeypatch, capsys):
    """GMACs are multiply-adds, the paper's convention (ViL-Tiny at 224: 1.43G published, 1.39G counted here, where
    border chunks skip the keys outside the map); images/s are the timed steps' images over the clock's seconds:
    2 steps of 2 training images in 14 - 10 s and 2 of 2 inference images in 21 - 20 s."""
    from types import SimpleNamespace

    from tool_runner import ROOT, load_tool

    tool = load_tool("benchmark_model")
    readings = iter([10.0, 14.0, 20.0, 21.0])
    monkeypatch.setattr(tool, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    config = ["--config-file", str(ROOT / "configs/vil_tiny.yaml"), "--batch", "2", "--steps", "2"]
    monkeypatch.setattr(sys, "argv", ["benchmark_model.py", *config])
    tool.main()
    row = capsys.readouterr().out.splitlines()[-1].strip("| ").split(" | ")
    gmacs, train, infer = float(row[6]), row[7], row[8]
    assert 1.35 < gmacs < 1.43 and (train, infer) == ("1.0", "4.0")


def test_benchmark_model_compares_each_contenders_best_round_with_the_eager_models():
    """The side-by-side table: each contender's fastest of its rounds, in images/s, over the eager model's."""
    import contextlib
    import io
    from types import SimpleNamespace

    from tool_runner import load_tool

    tool = load_tool("benchmark_model")
    speeds = {  # per (net, step): images/s in rounds 1 and 2
        ("vil", "train"): [8.0, 10.0],
        ("vil", "infer"): [30.0, 25.0],
        ("swin", "train"): [12.5, 11.0],
        ("swin", "infer"): [20.0, 24.0],
    }
    rounds = {key: iter(values) for key, values in speeds.items()}
    args = SimpleNamespace(compile=False, timm="swin", rounds=2, batch=4, profile=False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tool.compare(
            args, "vil", "swin", lambda net: ((net, "train"), (net, "infer")), lambda s: next(rounds[s]), "cpu"
        )
    rows = {line.split(" | ")[0]: line for line in printed.getvalue().splitlines() if line.startswith("| ")}
    assert rows["| eager"] == "| eager | 10.0 | 30.0 | 1.00x | 1.00x |"
    assert rows["| timm swin"] == "| timm swin | 12.5 | 24.0 | 1.25x | 0.80x |"
