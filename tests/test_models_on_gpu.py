"""Whole models on a CUDA GPU, where ``backend=None`` takes the Triton kernels: transformers' Longformer accelerated
against the same model unaccelerated, and ViL-Tiny with the triton backend against sliding_chunk; the output and
every gradient, in float32 and under bfloat16 autocast. The kernel tests cover each window option one call at a
time; these cover the models' calls (views of the projections, global tokens, padding, autocast, several layers)."""

import copy
from pathlib import Path

import pytest
import torch

import vil
from vil.config import load_cfg
from vil.model_config import build_model

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels compiled for a GPU: needs CUDA"),
    pytest.mark.usefixtures("poisoned_triton_outputs"),
]

VIL_TINY = Path(__file__).parents[1] / "configs" / "vil_tiny.yaml"
# ViL-Tiny with the relative position bias (a0) instead of the absolute embedding
VIL_TINY_RELATIVE = (
    "l1,h1,d48,n1,s1,g1,p4,f7,a0_l2,h3,d96,n1,s1,g1,p2,f7,a0_l3,h3,d192,n9,s0,g1,p2,f7,a0_l4,h6,d384,n1,s0,g0,p2,f7,a0"
)
# (autocast, tolerance). float32: the kernels' products are three TF32 products each and cuDNN's convolutions TF32
# by default (ViL-Tiny's gradients differed by up to 1.6e-4 on an H200); bfloat16 rounds every product's inputs.
PRECISIONS = [pytest.param(False, 1e-3, id="float32"), pytest.param(True, 5e-2, id="bfloat16")]


def relative_errors(got, want):
    """Per tensor, max |got - want| over max |want|, the latter floored at a thousandth of the largest of ``want``:
    some gradients are zero but for rounding (a key projection's bias: a softmax does not see a shift shared by
    all of a query's scores)."""
    floor = 1e-3 * max(t.abs().max().item() for t in want.values())
    return {name: (got[name] - t).abs().max().item() / max(t.abs().max().item(), floor) for name, t in want.items()}


def assert_close(got, want, tol):
    errors = relative_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: {errors[worst]:.2e}"


def outputs_and_gradients(model, loss_of, autocast):
    """``{"output": ..., parameter name: gradient}`` of one training step, in float32."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout and drop-path draws for both models
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out, loss = loss_of(model)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None and p.grad.numel()}
    return {"output": out.detach().float(), **grads}


@pytest.mark.parametrize("autocast, tol", PRECISIONS)
def test_accelerated_longformer_matches_transformers_on_cuda(autocast, tol):
    """Longformer's settings at a smaller scale: head_dim 64, windows 32 and 64, 300 tokens (no multiple of either),
    three sequences with padding and a global token each; transformers' model in float32 is the reference."""
    transformers = pytest.importorskip("transformers", reason="the transformers extra: pip install 'vil[transformers]'")
    from test_transformers_longformer import PAD, longformer_config

    length = 300
    config = longformer_config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        attention_window=[32, 64],
        max_position_embeddings=length + 4,
    )
    torch.manual_seed(0)
    reference = transformers.LongformerModel(config).cuda()
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference))
    ids = torch.randint(2, 1000, (3, length), device="cuda")
    mask = torch.ones(3, length, dtype=torch.long, device="cuda")
    mask[1, length - 50 :], mask[2, length - 20 :] = 0, 0
    ids[mask == 0] = PAD
    global_mask = torch.zeros_like(mask)
    global_mask[0, 0] = global_mask[1, 5] = global_mask[2, 3] = 1
    probe = torch.randn(3, length, config.hidden_size, device="cuda")  # a loss whose gradients the layer norms keep

    def loss_of(model):
        out = model(ids, attention_mask=mask, global_attention_mask=global_mask).last_hidden_state.float()
        return out[mask.bool()], (out * mask[..., None] * probe).sum()

    want = outputs_and_gradients(reference, loss_of, autocast=False)
    assert_close(outputs_and_gradients(accelerated, loss_of, autocast), want, tol)


@pytest.mark.parametrize("autocast, tol", PRECISIONS)
def test_vil_with_the_triton_backend_matches_sliding_chunk_on_cuda(autocast, tol):
    """ViL-Tiny at 224 with the relative position bias (stage 1 at 56x56, one head of 48, and stage 2 at 28x28,
    three of 32, through the kernels, each with a global token), the same weights under both backends."""
    models = {}
    for backend in ("triton", "sliding_chunk"):
        torch.manual_seed(0)
        options = ["MODEL.VIT.MSVIT.ATTN_TYPE", backend, "MODEL.VIT.MSVIT.ARCH", VIL_TINY_RELATIVE]
        models[backend] = build_model(load_cfg(str(VIL_TINY), options)).cuda()
    models["triton"].load_state_dict(models["sliding_chunk"].state_dict())
    images = torch.randn(4, 3, 224, 224, device="cuda")
    probe = torch.linspace(-1, 1, 1000, device="cuda")

    def loss_of(model):
        logits = model(images).float()
        return logits, (logits * probe).sum()

    want = outputs_and_gradients(models["sliding_chunk"], loss_of, autocast)
    assert_close(outputs_and_gradients(models["triton"], loss_of, autocast), want, tol)
