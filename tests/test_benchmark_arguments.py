"""The measuring tools refuse bad arguments in one sentence before measuring anything, and a failed step of the
digits check says why."""

import math
import re
import sys

import pytest
from tool_runner import load_tool, run_tool


@pytest.fixture
def not_a_folder(tmp_path):
    """A path whose folder is a file: nothing can be written there."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "out"


@pytest.mark.parametrize(
    "tool,args,facts",
    [
        ("benchmark_attention", ["--sizes", "-4"], r"--sizes: must be a positive integer, got -4"),
        ("benchmark_attention", ["--sizes", "8", "--repeats", "0"], r"--repeats: must be a positive integer, got 0"),
        ("benchmark_attention", ["--sizes", "8", "--batch", "x"], r"--batch: must be a positive integer, got 'x'"),
        ("benchmark_attention", ["--num-global", "-1"], r"--num-global: must be an integer of at least 0, got -1"),
        ("benchmark_attention", ["--markdown", "{bad}.md"], r"{bad}.md cannot be written \(it is a file"),
        ("benchmark_attention", ["--plot", "{bad}"], r"{bad}_time.png cannot be written"),
        ("benchmark_precision", ["--rounds", "0"], r"--rounds: must be a positive integer, got 0"),
        ("benchmark_precision", ["--matmul", "0"], r"--matmul: must be a positive integer, got 0"),
        ("benchmark_precision", ["--markdown", "{bad}.md"], r"{bad}.md cannot be written"),
        ("benchmark_model", ["--config-file", "vil_tiny", "--rounds", "0"], r"--rounds: .* got 0"),
        ("benchmark_model", ["--config-file", "vil_tiny", "--steps", "0"], r"--steps: .* got 0"),
        (
            "benchmark_model",
            ["--config-file", "vil_tiny", "MODEL.COMPILE", "True"],
            r"MODEL.COMPILE is not read .*--compile",
        ),
        ("benchmark_longformer", ["--window", "7"], r"--window must be even .* got 7"),
        ("benchmark_longformer", ["--hidden", "50"], r"--hidden must be a multiple of the 12 heads, got 50"),
        ("benchmark_longformer", ["--lengths", "0"], r"--lengths: must be a positive integer, got 0"),
        ("benchmark_longformer", ["--what", "autocast", "--plot", "x"], r"--what autocast alone"),
        ("benchmark_mechanisms", ["--max-step-seconds", "-1"], r"--max-step-seconds must be 0 .* got -1"),
        ("benchmark_mechanisms", ["--plot", "{bad}"], r"{bad}_time.png cannot be written"),
        ("benchmark_loader", ["--images", "4", "--batch", "8"], r"--images must be at least 2 .* --batch 8 .* got 4"),
        ("benchmark_loader", ["--workers", "-1"], r"--workers: must be an integer of at least 0, got -1"),
        ("benchmark_loader", ["--config-file", "vil_smal"], r"vil_smal"),
        ("benchmark_model", ["--config-file", "vil_tiny", "--timm", "no_such_net"], r"--timm no_such_net"),
        ("benchmark_model", ["--config-file", "vil_tiny", "--profile"], r"give --compile or --timm with it"),
        ("benchmark_attention", ["--host-time"], r"--host-time .* give --device cuda with it"),
        ("benchmark_mechanisms", ["--max-step-seconds", "nan"], r"--max-step-seconds must be 0 .* got nan"),
        ("benchmark_longformer", ["--lengths", "100", "--window", "16"], r"multiples of --window 16 .* got 100"),
    ],
)
def test_bad_arguments_are_one_sentence(tool, args, facts, not_a_folder):
    status, out, err = run_tool(tool, *(a.replace("{bad}", str(not_a_folder)) for a in args))
    assert status == 2 and not out
    assert re.search(facts.replace("{bad}", re.escape(str(not_a_folder))), err.strip().splitlines()[-1]), err


def test_the_precision_study_checks_the_products_variable_before_measuring(monkeypatch):
    """VIL_FUSED_CPU_PRODUCTS, which the fused kernels read: a bad value is their sentence, with nothing measured."""
    monkeypatch.setenv("VIL_FUSED_CPU_PRODUCTS", "bogus")
    status, out, err = run_tool("benchmark_precision", "--sizes", "6", "--rounds", "1")
    assert status == 1 and "|" not in out
    assert re.search(r"VIL_FUSED_CPU_PRODUCTS must be one of auto, half, float32, got 'bogus'", err.splitlines()[-1])


@pytest.mark.parametrize("tool", ["benchmark_attention", "benchmark_mechanisms", "benchmark_longformer"])
def test_plots_without_matplotlib_are_refused_before_measuring(tool, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import fails
    status, out, err = run_tool(tool, "--plot", tmp_path / "study")
    assert status == 2 and not out
    assert re.search(r"Plots need matplotlib .*pip install 'vil\[plots\]'", err.strip().splitlines()[-1]), err


def test_growth_between_sizes_of_one_token_count_is_left_blank():
    tool = load_tool("benchmark_mechanisms")
    name = next(iter(tool.MODELS))
    assert tool.stage1_tokens(name, 32) == tool.stage1_tokens(name, 33)
    assert math.isnan(tool.growth(name, (32, 1.0), (33, 2.0)))
    assert tool.growth(name, (32, 1.0), (64, 4.0)) == pytest.approx(1.0)  # 4x the tokens, 4x the cost
    assert tool.estimated_step({32: {name: (0.5,) * 8}, 33: {name: (0.7,) * 8}}, name, 64) > 0


def test_a_failed_step_of_the_digits_check_says_why():
    tool = load_tool("check_digits_demo")
    with pytest.raises(SystemExit, match=r"python -m vil train failed \(exit status \d\): .*SEED is 'x'.*integer"):
        tool.run_step("vil_digits", "/nonexistent/out", ["SEED", "x"])


def test_the_timm_contender_is_built_for_the_models_images_or_refused_in_one_sentence():
    """A timm model of one input size (a ViT) is built for INPUT.IMAGE_SIZE; one that cannot take that size says so,
    where the comparison failed with the timm model's own assertion."""
    import torch

    from vil.models import MsViT

    tool = load_tool("benchmark_model")
    model = MsViT("l1,h1,d16,p2,s0_l2,h1,d32,p1,s0_l3,h1,d32,p1,s0", img_size=32, num_classes=3)
    vit = tool._timm_model("vit_tiny_patch16_224", model, torch.device("cpu"))
    assert vit(torch.randn(1, 3, 32, 32)).shape == (1, 3) and vit.training
    model.img_size = (8, 8)
    with pytest.raises(SystemExit, match=r"--timm vit_tiny_patch16_224 does not take 8x8 images \(INPUT.IMAGE_SIZE\)"):
        tool._timm_model("vit_tiny_patch16_224", model, torch.device("cpu"))


def test_a_timm_contender_that_cannot_be_built_is_one_sentence_before_measuring(monkeypatch):
    """A Hub model that is neither reachable nor cached here (timm takes any hf-hub: name up front). Offline, so
    that no network's timeouts are waited for: huggingface_hub reads HF_HUB_OFFLINE once, when it is imported."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    name = "hf-hub:no-such-owner/no-such-model"
    status, out, err = run_tool("benchmark_model", "--config-file", "vil_tiny", "--timm", name, "--batch", "1")
    assert status == 1 and not out  # no table measured before it
    built = rf"error: --timm {re.escape(name)} could not be built \(\w+: .*\); give a model timm can create here\."
    assert re.fullmatch(built, err.strip()), err


def test_a_backend_that_does_not_train_on_the_device_is_refused_before_measuring():
    status, out, err = run_tool("benchmark_attention", "--sizes", "8", "--backends", "sliding_chunk", "flex")
    assert status == 1 and not out
    assert re.fullmatch(r"The flex backend does not train on cpu, .*: .*sliding_chunk.*\.", err.strip()), err
