"""The backbone through the compiler stack: torch.compile (fullgraph), torch.export with dynamic sizes, fake tensors.

Compiled results are held against eager ones; eager ones are held against the naive reference elsewhere."""

import re

import onnxruntime
import pytest
import torch
from tool_runner import ROOT, run_tool
from torch._subclasses.fake_tensor import FakeTensorMode

from vil.export import export_program, onnx_outputs
from vil.models import MsViT
from vil.ops import available_backends, local_attention_1d, local_attention_2d
from vil.ops.registry import BACKENDS

# Local stages with relative bias and with absolute position embeddings, both with global tokens, then a
# full-attention stage with relative bias: every attention path.
ARCH = "l1,h2,d32,n1,s1,g1,p4,f2,a0_l2,h2,d32,n1,s1,g1,p2,f2,a1_l3,h2,d32,n1,s0,g0,p2,f2,a0"
# One local layer and one full-attention layer with relative bias, for the slow ONNX export of dynamic sizes.
ONNX_ARCH = "l1,h2,d32,n1,s1,g1,p4,f2,a0_l2,h2,d32,n1,s0,g0,p2,f2,a0_l3,h2,d32,n1,s0,g0,p2,f2,a1"
# The whole model compiled with the CPU's default backend; every backend's operator is compiled on its own below.
COMPILED_BACKENDS = ["fused_cpu"]


def small_model(backend, seed=0):
    torch.manual_seed(seed)
    return MsViT(ARCH, img_size=32, num_classes=5, attn_backend=backend, drop_path_rate=0.0)


def loss_and_grads(model, forward, x):
    """The loss of ``forward`` (the model, or a compiled one) and the gradients it leaves in ``model``."""
    model.zero_grad()
    loss = forward(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_fullgraph_compile_trains_like_eager_and_switches_without_recompiling(backend):
    """aot_eager runs the graphs that Dynamo and AOTAutograd capture (Inductor's code generation is timed by
    tools/benchmark_model.py --compile); fullgraph=True fails on any graph break."""
    torch._dynamo.reset()
    model = small_model(backend)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    x = torch.randn(2, 3, 32, 32)
    torch._dynamo.mark_dynamic(x, 0)
    want_loss, want = loss_and_grads(model, model, x)
    got_loss, got = loss_and_grads(model, compiled, x)
    torch.testing.assert_close(got_loss, want_loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    # Both modes compiled: switching back and forth, and other batch sizes, compile nothing new.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch, training in ((3, True), (5, False), (2, True)):
            model.train(training)
            y = torch.randn(batch, 3, 32, 32)
            torch._dynamo.mark_dynamic(y, 0)
            with torch.set_grad_enabled(training):
                torch.testing.assert_close(compiled(y), model(y))


def test_random_neighbour_training_draws_in_the_compiled_graph():
    """MODE > 0: every training forward draws a neighbour chunk per layer; compiled, the draw stays in the graph
    (aot_eager takes it from the same generator as eager, so the same seed gives the same result)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MsViT(
        "l1,h2,d32,n2,s1,g1,p4,f2,a0_l2,h2,d32,n1,s0,g0,p2,f2,a0_l3,h2,d32,n1,s0,g0,p2,f2,a0",
        img_size=32,
        num_classes=5,
        attn_backend="fused_cpu",
        drop_path_rate=0.0,
        mode=2,
    )
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    x = torch.randn(2, 3, 32, 32)
    results = []
    for seed in range(3):
        torch.manual_seed(seed)
        want_loss, want = loss_and_grads(model, model, x)
        torch.manual_seed(seed)
        got_loss, got = loss_and_grads(model, compiled, x)
        torch.testing.assert_close(got_loss, want_loss)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)
        results.append(got_loss)
    assert len({float(loss) for loss in results}) > 1  # the neighbours differ from call to call


def test_a_drawn_neighbour_is_refused_by_the_onnx_exporter(monkeypatch):
    from vil.ops import Neighborhood2d, local_attention
    from vil.ops.base import Extras

    monkeypatch.setattr(local_attention, "exporting_to_onnx", lambda: True)
    q = torch.randn(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"MODE > 0 in training.*model.eval\(\)"):
        local_attention._run(BACKENDS["unfold"], q, q, q, Neighborhood2d(2), Extras(1.0), torch.tensor(3))


@pytest.mark.parametrize("backend", ["fused_cpu", "unfold"])  # an operator of its own, the generic one
def test_export_with_dynamic_batch_and_size_runs_at_other_sizes(backend):
    model = small_model(backend).eval()
    exported = export_program(model, 32, 64)
    for shape in ((1, 3, 64, 64), (3, 3, 96, 32)):
        y = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(y), model(y))


def _runs_on_the_cpu(backend):
    devices = BACKENDS[backend].devices
    return devices is None or "cpu" in devices


# The 2D backends the model test above does not compile, and every 1D backend, on the CPU (the Triton kernels under
# their interpreter).
OTHER_2D = [b for b in available_backends(2) if b not in COMPILED_BACKENDS and _runs_on_the_cpu(b)]
ALL_1D = [b for b in available_backends(1) if _runs_on_the_cpu(b)]


@pytest.mark.parametrize("backend", available_backends(2))
def test_fake_tensor_forward_2d(backend):
    """Every backend runs on fake tensors (no data), as torch.export and torch.compile trace them; the Triton
    one refuses CPU tensors as it does eagerly."""
    with FakeTensorMode():
        q, k, v = (torch.randn(2, 2, 5, 7, 16) for _ in range(3))
        gk, gv = (torch.randn(2, 2, 1, 16) for _ in range(2))

        def run():
            return local_attention_2d(
                q,
                k,
                v,
                2,
                global_k=gk,
                global_v=gv,
                rel_bias=torch.randn(2, 49),
                global_bias=torch.randn(2, 1),
                backend=backend,
            )

        if not _runs_on_the_cpu(backend):
            with pytest.raises(ValueError, match=f"{backend}.*cuda.*cpu"):
                run()
            return
        out = run()
    assert out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.parametrize("backend", available_backends(1))
def test_fake_tensor_forward_1d(backend):
    with FakeTensorMode():
        q, k, v = (torch.randn(2, 2, 11, 16) for _ in range(3))
        mask = torch.zeros(2, 11, dtype=torch.bool)
        out = local_attention_1d(
            q,
            k,
            v,
            2,
            dilation=2 if BACKENDS[backend].dilation(1) else 1,
            key_padding_mask=mask,
            rel_bias=torch.randn(2, 5),
            backend=backend,
        )
    assert out.shape == q.shape


def _leaves(*shapes):
    return [torch.randn(shape, requires_grad=True) for shape in shapes]


def _compiled_matches_eager(function, leaves, backend):
    """``function(*leaves)`` and its gradients (where the backend trains on the CPU), compiled with
    fullgraph=True, against eager."""
    compiled = torch.compile(function, fullgraph=True, backend="aot_eager", dynamic=False)
    trains = BACKENDS[backend].trains_on is None or "cpu" in BACKENDS[backend].trains_on
    upstream = None
    results = []
    for run in (function, compiled):
        with torch.set_grad_enabled(trains):
            out = run(*leaves)
        upstream = torch.randn_like(out) if upstream is None else upstream
        results.append((out, torch.autograd.grad(out, leaves, upstream) if trains else ()))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", OTHER_2D)
def test_every_backend_compiles_with_fullgraph_2d(backend):
    """Backends not traced as they are run as one operator whose backward recomputes the forward; flex is
    traced as FlexAttention. Either way: fullgraph, results as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    _compiled_matches_eager(
        lambda q, k, v, gk, gv, bias: local_attention_2d(
            q, k, v, 2, global_k=gk, global_v=gv, rel_bias=bias, backend=backend
        ),
        _leaves((2, 2, 5, 7, 16), (2, 2, 5, 7, 16), (2, 2, 5, 7, 16), (2, 2, 1, 16), (2, 2, 1, 16), (2, 49)),
        backend,
    )


@pytest.mark.parametrize("backend", ALL_1D)
def test_every_backend_compiles_with_fullgraph_1d(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, -3:] = True
    dilation = [1, 2] if BACKENDS[backend].dilation(1) else 1
    _compiled_matches_eager(
        lambda q, k, v, bias: local_attention_1d(
            q, k, v, 2, dilation=dilation, key_padding_mask=mask, rel_bias=bias, backend=backend
        ),
        _leaves((2, 2, 11, 16), (2, 2, 11, 16), (2, 2, 11, 16), (2, 5)),
        backend,
    )  # head_dim 16: triton's least


def test_legacy_onnx_exporter_records_the_attention(tmp_path):
    """TorchScript's tracer (the legacy exporter) gets the decomposed attention, not a silently dropped one."""
    model = small_model("fused_cpu").eval()
    x = torch.randn(2, 3, 32, 32)
    torch.onnx.export(model, (x,), str(tmp_path / "legacy.onnx"), dynamo=False)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(onnx_outputs(tmp_path / "legacy.onnx", x), want, atol=1e-4, rtol=1e-4)
    # And the attention matters: without it the logits would be other ones.
    for block in model.modules():
        if hasattr(block, "only_global"):
            block.only_global = True
    with torch.no_grad():
        assert not torch.allclose(model(x), want, atol=1e-3)


class _DilatedWindows(torch.nn.Module):
    def forward(self, q, k, v):
        return local_attention_2d(q, k, v, 1, exact=1, dilation=2)


def test_onnx_records_dilated_windows(tmp_path):
    """The decomposition an ONNX file holds computes dilated windows too (per sub-lattice), as the reference does."""
    q, k, v = (torch.randn(1, 2, 7, 6, 8) for _ in range(3))
    torch.onnx.export(_DilatedWindows(), (q, k, v), str(tmp_path / "dilated.onnx"), dynamo=False)
    want = local_attention_2d(q, k, v, 1, exact=1, dilation=2, backend="reference")
    session = onnxruntime.InferenceSession(str(tmp_path / "dilated.onnx"), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), (q, k, v))}
    torch.testing.assert_close(torch.from_numpy(session.run(None, feeds)[0]), want, atol=1e-5, rtol=1e-5)


class _FixedSizeWindows(torch.nn.Module):
    def forward(self, q, sequence):
        return local_attention_2d(q, q, q, 3, exact=-1), local_attention_1d(sequence, sequence, sequence, 2)


def test_tables_built_while_an_export_traces_are_not_kept_for_later_calls():
    """The decomposition builds its window tables from the traced sizes, as fake tensors: kept, they would reach
    later eager calls of the same sizes (which returned fake tensors) and later exports."""
    from torch._subclasses.fake_tensor import is_fake

    from vil.ops.base import recording_for_onnx
    from vil.ops.geometry import unfolded_window_tables

    unfolded_window_tables.cache_clear()
    q, sequence = torch.randn(1, 2, 9, 9, 8), torch.randn(1, 2, 11, 8)
    for _ in range(2):  # a second export finds no fake tensor among its constants either
        with recording_for_onnx():
            torch.export.export(_FixedSizeWindows(), (q, sequence), strict=False)
    for backend in ("unfold", "reference"):
        out, out_1d = (
            local_attention_2d(q, q, q, 3, exact=-1, backend=backend),
            local_attention_1d(sequence, sequence, sequence, 2, backend="reference"),
        )
        assert not is_fake(out) and not is_fake(out_1d)
        torch.testing.assert_close(out, local_attention_2d(q, q, q, 3, exact=-1, backend="sliding_chunk"))
        torch.testing.assert_close(out_1d, local_attention_1d(sequence, sequence, sequence, 2, backend="loop"))


@pytest.mark.parametrize(
    "attention,second_size",
    [
        ((), "48x64"),
        (("MODEL.VIT.MSVIT.ATTN_TYPE", "triton"), "48x64"),
        (("MODEL.VIT.MSVIT.ATTN_TYPE", "linformer"), "32x32"),
    ],
    ids=["default", "triton", "linformer"],  # any backend (the file holds none); one input size
)
def test_export_onnx_tool_writes_and_checks_a_file(tmp_path, attention, second_size):
    common = ["MODEL.VIT.MSVIT.ARCH", ONNX_ARCH, "INPUT.IMAGE_SIZE", "32", *attention]
    config = ROOT / "configs" / "vil_digits.yaml"
    status, printed, error = run_tool("export_onnx", "--config-file", config, "--output", tmp_path / "m.onnx", *common)
    assert status == 0, error
    assert (tmp_path / "m.onnx").stat().st_size > 0
    assert re.findall(r"(\d+x\d+): largest difference", printed) == ["32x32", second_size]


def test_export_onnx_tool_says_what_the_model_refuses(tmp_path):
    common = ["MODEL.VIT.MSVIT.ARCH", ONNX_ARCH, "INPUT.IMAGE_SIZE", "32", "MODEL.VIT.MSVIT.SW_EXACT", "-1"]
    config = ROOT / "configs" / "vil_digits.yaml"
    status, _, error = run_tool("export_onnx", "--config-file", config, "--output", tmp_path / "m.onnx", *common)
    assert status == 1 and re.fullmatch(
        r"error: SW_EXACT -1 [^\n]*fixed map size[^\n]*--static[^\n]*\n", error[error.index("error:") :]
    )


def test_compile_key_compiles_the_training_step():
    from vil.config import load_cfg
    from vil.runtime import Runtime
    from vil.training.setup import _training_net

    model = small_model("fused_cpu")
    runtime = Runtime("")
    assert _training_net(model, load_cfg(None, []), runtime) is model
    net = _training_net(model, load_cfg(None, ["MODEL.COMPILE", "True"]), runtime)
    assert isinstance(net, torch._dynamo.eval_frame.OptimizedModule) and net._orig_mod is model


def test_a_dilation_tensor_is_refused_when_traced():
    from vil.ops import local_attention_1d

    class Dilated(torch.nn.Module):
        def forward(self, q, dilation):
            return local_attention_1d(q, q, q, 2, dilation=dilation)

    q, dilation = torch.randn(1, 2, 11, 8), torch.tensor([1, 2])
    torch.testing.assert_close(Dilated()(q, dilation), local_attention_1d(q, q, q, 2, dilation=(1, 2)))  # eagerly
    with pytest.raises(ValueError, match=r"dilation as Python ints"):
        torch.export.export(Dilated(), (q, dilation))
