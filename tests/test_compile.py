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


def test_a_drawn_neighbour_is_refused_by_the_onnx_exporter(tmp_path):
    """TorchScript's tracer runs the op on real tensors: the neighbour drawn then would stay in the file for good."""
    model = MsViT(ARCH, img_size=32, num_classes=5, mode=3).train()
    with pytest.raises(ValueError, match=r"MODE > 0 in training.*model.eval\(\)"):
        torch.onnx.export(
            model,
            (torch.randn(1, 3, 32, 32),),
            tmp_path / "m.onnx",
            dynamo=False,
            training=torch.onnx.TrainingMode.PRESERVE,
        )


def test_a_drawn_neighbour_needs_chunked_windows_compiled_or_not():
    q = torch.randn(1, 1, 4, 6, 8)
    attend = lambda q, mode: local_attention_2d(q, q, q, 2, exact=1, mode=mode)  # noqa: E731
    for run in (attend, torch.compile(attend, backend="aot_eager")):
        with pytest.raises(ValueError, match=r"mode as a tensor.*exact 0 or -1"):
            run(q, torch.tensor(0))


def test_dynamic_compile_takes_the_window_numbers_as_arguments():
    q = torch.randn(1, 2, 8, 7, 8, dtype=torch.float64)

    def attend(q, window, exact, mode, dilation):
        return local_attention_2d(q, q, q, window, exact=exact, mode=mode, dilation=dilation)

    compiled = torch.compile(attend, backend="aot_eager", dynamic=True)
    for numbers in ((2, 0, 0, 1), (3, 0, 5, 1), (1, 1, 0, 2), (2, -1, -1, 1)):
        torch.testing.assert_close(compiled(q, *numbers), attend(q, *numbers), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dims", [1, 2])
def test_autocast_leaves_every_backend_in_the_inputs_dtype_compiled_or_not(dims):
    """The operators torch.compile records run below autocast, so eagerly too every backend computes in q's dtype:
    float32 inputs under bfloat16 autocast give float32 results, the same compiled or not."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, 16) for _ in range(3))
    if dims == 1:
        q, k, v = (t.flatten(2, 3) for t in (q, k, v))
    op = local_attention_1d if dims == 1 else local_attention_2d
    for backend in OTHER_2D + COMPILED_BACKENDS if dims == 2 else ALL_1D:
        if backend == "triton":
            continue  # CUDA tensors only, outside its interpreter
        attend = lambda q, k, v: op(q, k, v, 2, backend=backend)  # noqa: E731,B023
        torch._dynamo.reset()  # one code object for every backend
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = attend(q, k, v)
            compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
        assert eager.dtype == compiled.dtype == torch.float32, backend
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0, msg=backend)
        torch.testing.assert_close(eager, attend(q, k, v), rtol=0, atol=0, msg=backend)


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
        _leaves((1, 2, 5, 7, 16), (1, 2, 5, 7, 16), (1, 2, 5, 7, 16), (1, 2, 1, 16), (1, 2, 1, 16), (2, 49)),
        backend,
    )


@pytest.mark.parametrize("backend", [b for b in available_backends(2) if BACKENDS[b].passes_2d and _runs_on_the_cpu(b)])
@pytest.mark.parametrize("exact,mode", [(0, 3), (-1, -1)])
def test_operators_of_fused_passes_compile_with_the_neighbour_mode_given(backend, exact, mode):
    """A fixed neighbour chunk (or the own chunk only) reaches the operators' backward too: its gradients as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    _compiled_matches_eager(
        lambda q, k, v, bias: local_attention_2d(q, k, v, 2, exact=exact, mode=mode, rel_bias=bias, backend=backend),
        _leaves((1, 2, 6, 6, 16), (1, 2, 6, 6, 16), (1, 2, 6, 6, 16), (2, 49)),
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


def test_tracing_cyclic_windows_with_torchscript_names_the_exports_that_take_one_size():
    """TorchScript's tracer records the map size as a variable, which cyclic windows (SW_EXACT -1) cannot take: the
    refusal says so and names the one-size exports, where a plain export's refusal names SW_EXACT 0 or 1."""
    q = torch.randn(1, 2, 14, 14, 8)
    with pytest.raises(ValueError, match=r"SW_EXACT -1 .*torch\.jit\.trace.*dynamic_size=False") as refused:
        torch.jit.trace(lambda q: local_attention_2d(q, q, q, 7, exact=-1), (q,))
    assert "SW_EXACT 0 or 1" not in str(refused.value)


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
        (("MODEL.VIT.MSVIT.ATTN_TYPE", "triton"), "48x64"),
        (("MODEL.VIT.MSVIT.ATTN_TYPE", "linformer"), "32x32"),
    ],
    # Any backend, even one that cannot run on this machine (the file holds none); one input size.
    ids=["triton", "linformer"],
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


def test_compile_key_compiles_the_training_step_and_says_so(caplog):
    from vil.config import load_cfg
    from vil.runtime import Runtime
    from vil.training.setup import _training_net

    model = small_model("fused_cpu")
    runtime = Runtime()
    with caplog.at_level("INFO", logger="vil"):
        assert _training_net(model, load_cfg(None, []), runtime) is model
        assert "torch.compile" not in caplog.text
        net = _training_net(model, load_cfg(None, ["MODEL.COMPILE", "True"]), runtime)
    assert isinstance(net, torch._dynamo.eval_frame.OptimizedModule) and net._orig_mod is model
    assert caplog.text.count("MODEL.COMPILE: the training steps run the model through torch.compile") == 1


def test_a_dilation_tensor_is_refused_when_traced():
    from vil.ops import local_attention_1d

    class Dilated(torch.nn.Module):
        def forward(self, q, dilation):
            return local_attention_1d(q, q, q, 2, dilation=dilation)

    q, dilation = torch.randn(1, 2, 11, 8), torch.tensor([1, 2])
    torch.testing.assert_close(Dilated()(q, dilation), local_attention_1d(q, q, q, 2, dilation=(1, 2)))  # eagerly
    with pytest.raises(ValueError, match=r"dilation as Python ints"):
        torch.export.export(Dilated(), (q, dilation))


@pytest.mark.parametrize("backend", ["fused_cpu", "sliding_chunk"])
def test_dilated_windows_export_with_dynamic_sizes_and_run_at_others(backend):
    """Split per sub-lattice (2D) or residue class (``sliding_chunk`` 1D), whose number depends on the size: with
    symbolic sizes the request runs as the generic operator, on the real tensors."""
    from torch.export import Dim

    class Dilated2d(torch.nn.Module):
        def forward(self, q, k, v):
            return local_attention_2d(q, k, v, 1, exact=1, dilation=2, backend=backend)

    class Dilated1d(torch.nn.Module):
        def forward(self, q, k, v):
            return local_attention_1d(q, k, v, 2, dilation=[1, 3], backend=backend)

    sides = {0: Dim("batch", min=1, max=8), 2: Dim("rows", min=2, max=64), 3: Dim("cols", min=2, max=64)}
    for module, traced, others, dims in (
        (Dilated2d(), (2, 2, 6, 5, 8), ((1, 2, 9, 7, 8), (2, 2, 3, 2, 8)), sides),
        (Dilated1d(), (1, 2, 20, 8), ((1, 2, 3, 8), (1, 2, 37, 8)), {2: Dim("length", min=2, max=200)}),
    ):
        program = torch.export.export(module, tuple(torch.randn(traced) for _ in range(3)), dynamic_shapes=(dims,) * 3)
        for shape in others:
            inputs = [torch.randn(shape) for _ in range(3)]
            torch.testing.assert_close(program.module()(*inputs), module(*inputs), msg=f"{backend} {shape}")


def test_dilated_windows_train_compiled_with_dynamic_sizes():
    attend = lambda q, k, v: local_attention_2d(q, k, v, 1, exact=1, dilation=2)  # noqa: E731
    compiled = torch.compile(attend, backend="aot_eager", dynamic=True)
    for shape in ((1, 2, 6, 5, 8), (2, 2, 9, 7, 8)):  # the second compiles with symbolic sizes
        inputs = [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        grad_out = torch.randn(shape, dtype=torch.float64)
        want = torch.autograd.grad(attend(*inputs), inputs, grad_out)
        got = torch.autograd.grad(compiled(*inputs), inputs, grad_out)
        for name, a, b in zip("qkv", got, want):
            torch.testing.assert_close(a, b, msg=f"{shape} {name}")


def test_flex_refuses_dynamic_sizes_in_an_export():
    from torch.export import Dim

    class Flex(torch.nn.Module):
        def forward(self, q):
            return local_attention_1d(q, q, q, 3, backend="flex")

    with pytest.raises(ValueError, match="flex .*dynamic sizes.*fused_cpu"):
        torch.export.export(
            Flex(), (torch.randn(1, 2, 40, 8),), dynamic_shapes=({2: Dim("length", min=2, max=200)},), strict=False
        )
    program = torch.export.export(Flex(), (torch.randn(1, 2, 40, 8),))  # static sizes export
    q = torch.randn(1, 2, 40, 8)
    torch.testing.assert_close(program.module()(q), Flex()(q))
