"""vil.accelerate_longformer against transformers' own Longformer and LED classes: small random configs (nothing
downloaded), float64, the same outputs and gradients as the model before it was accelerated."""

import copy
import logging
import re

import hypothesis
import pytest
import torch
from hypothesis import strategies as st

import vil
import vil.models.longformer

transformers = pytest.importorskip("transformers", reason="the transformers extra (pip install 'vil[transformers]')")
import vil.transformers_longformer  # noqa: E402  (needs transformers)

VOCAB, PAD = 60, 1
# .ci/run runs this file with transformers 5 (requirements.txt) and again with transformers 4 (.ci/transformers4.txt).
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5
needs_l_by_l_mask = pytest.mark.skipif(
    not vil.transformers_longformer.REPLACES_MASK,
    reason="this transformers builds LongformerModel's mask as one row per sequence (transformers 4): none replaced",
)


def longformer_config(**changes):
    options = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        attention_window=[4, 8],  # a different window per layer
        max_position_embeddings=96,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        pad_token_id=PAD,
        num_labels=3,
    )
    return transformers.LongformerConfig(**dict(options, **changes))


def led_config(**changes):
    options = dict(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        attention_window=[4, 8],
        max_encoder_position_embeddings=96,
        max_decoder_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=PAD,
    )
    return transformers.LEDConfig(**dict(options, **changes))


def batch(length=29, seed=0, one_global_each=False):
    """Three sequences of ``length`` (not a multiple of either window): the second and third padded at the end,
    with 1, 3 and 0 global tokens, at different positions (``one_global_each``: 1, 1 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (3, length), generator=gen)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, 20:] = 0
    mask[2, 25:] = 0
    ids[mask == 0] = PAD
    global_mask = torch.zeros(3, length, dtype=torch.long)
    global_mask[0, 0] = 1
    global_mask[1, [5] if one_global_each else [0, 5, 7]] = 1
    global_mask[2, 3] = int(one_global_each)
    return ids, mask, global_mask


def pair(model_class, config):
    """(transformers' model, the same model accelerated), float64, equal weights."""
    torch.manual_seed(0)
    reference = model_class(config).double()
    return reference, vil.accelerate_longformer(copy.deepcopy(reference))


def assert_same(got, want, mask=None, tol=1e-7):
    """Within float32's rounding of the largest value: transformers' layers compute their softmax in float32 even in
    a float64 model (the accelerated ones in float64), so the two differ by up to about 1e-8 of an attention output
    (1e-9 relative after the layer norm, depending on the CPU's float32 kernels)."""
    if mask is not None:  # padded positions of a sequence output are not defined by either
        got, want = got[mask.bool()], want[mask.bool()]
    assert (got - want).abs().max() <= tol * max(1.0, want.abs().max())


def training_results(model, ids, mask, global_mask):
    """The sequence output, the pooled output and every parameter's gradient of one training step."""
    model.train()
    out = model(ids, attention_mask=mask, global_attention_mask=global_mask)
    (out.last_hidden_state * mask[..., None]).square().sum().backward()
    return out.last_hidden_state, out.pooler_output, {n: p.grad for n, p in model.named_parameters()}


def test_longformer_model_gives_the_same_outputs_and_gradients():
    """One global token per sequence: with other counts, or none, transformers' own gradients are NaN (its masked
    softmax rows), while the accelerated model's are finite; see the next test."""
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    assert isinstance(accelerated.encoder.layer[0].attention.self, vil.transformers_longformer._Accelerated)
    ids, mask, global_mask = batch(one_global_each=True)
    want, want_pooled, want_grads = training_results(reference, ids, mask, global_mask)
    got, got_pooled, got_grads = training_results(accelerated, ids, mask, global_mask)
    assert_same(got, want, mask)
    assert_same(got_pooled, want_pooled)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        if grad is not None:
            assert_same(got_grads[name], grad), name


@needs_l_by_l_mask
def test_the_accelerated_model_forms_no_mask_over_every_pair_of_tokens():
    """LongformerModel keeps one query row of its (batch, 1, L, L) mask: accelerated, the mask is that row's values
    broadcast, and every other mask of transformers' is still its own."""
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    embeds = torch.zeros(3, 29, 8, dtype=torch.float64)
    _, mask, _ = batch()
    masks = {
        "Longformer's": lambda c, m: create_bidirectional_mask(c, embeds, m, allow_is_bidirectional_skip=False),
        "skippable": lambda c, m: create_bidirectional_mask(c, embeds, m),
        # no cache, by position: the keyword is past_key_values in transformers 5.17, cache in 5.24
        "causal": lambda c, m: create_causal_mask(c, embeds, m, None, position_ids=None),
    }
    for name, make in masks.items():
        for attention_mask in (mask, torch.ones_like(mask)):
            want, got = make(reference.config, attention_mask), make(accelerated.config, attention_mask)
            assert (got is None and want is None) or torch.equal(got, want), name
            if name == "Longformer's":
                assert got.untyped_storage().nbytes() == 3 * 29 * 8  # one float64 per key of each sequence
    assert torch.finfo(torch.float64).min in masks["Longformer's"](accelerated.config, mask)


@needs_l_by_l_mask
def test_models_built_from_an_accelerated_config_pass_transformers_checks_and_give_the_same_outputs(tmp_path):
    """The mask implementation lives on the config: other models built from it, with or without acceleration, are
    still transformers' models with the same outputs; one that computes attention through it is told why not."""
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    accelerated.save_pretrained(tmp_path)
    ids, mask, global_mask = batch(seed=3)
    with torch.no_grad():
        want = reference.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)[0]
        for built in (
            transformers.AutoModel.from_config(accelerated.config),
            transformers.LongformerModel.from_pretrained(tmp_path, config=accelerated.config),
        ):
            built.load_state_dict(reference.state_dict())
            got = built.double().eval()(ids, attention_mask=mask, global_attention_mask=global_mask)[0]
            assert_same(got, want, mask)
    bert = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37
    )
    bert._attn_implementation = vil.transformers_longformer.MASK_IMPLEMENTATION
    with pytest.raises(ValueError, match=r"'vil_key_padding' only builds the attention mask of Longformer models"):
        transformers.BertModel(bert)(ids)


def test_activation_checkpointing_gives_the_same_outputs_and_gradients():
    """transformers' activation checkpointing recomputes each layer's forward, the op's included, in the backward."""
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    # activation_checkpointing_enable from transformers 5.2x; gradient_checkpointing_enable before (deprecated after)
    enable = getattr(accelerated, "activation_checkpointing_enable", None) or accelerated.gradient_checkpointing_enable
    enable()
    ids, mask, global_mask = batch(one_global_each=True)
    want, _, want_grads = training_results(reference, ids, mask, global_mask)
    layer = accelerated.encoder.layer[0].attention.self
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    got, _, got_grads = training_results(accelerated, ids, mask, global_mask)
    assert len(calls) == 2  # the forward, then its recomputation in the backward
    assert_same(got, want, mask)
    for name, grad in want_grads.items():
        if grad is not None:
            assert_same(got_grads[name], grad), name


def test_different_global_counts_give_the_same_outputs_and_finite_gradients():
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    ids, mask, global_mask = batch()  # 1, 3 and 0 global tokens
    want, want_pooled, want_grads = training_results(reference, ids, mask, global_mask)
    got, got_pooled, got_grads = training_results(accelerated, ids, mask, global_mask)
    assert_same(got, want, mask)
    assert_same(got_pooled, want_pooled)
    assert any(g.isnan().any() for g in want_grads.values() if g is not None)  # transformers' own
    assert all(g.isfinite().all() for g in got_grads.values() if g is not None)


def test_many_global_tokens_give_the_same_outputs_and_gradients():
    """12 global tokens per sequence, past the count (10 at 32 = 4 x 8) beyond which the global keys and values are
    projected for every token rather than folded into the global queries' products."""
    assert not vil.models.longformer.folding_pays(12, 4, 32)
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    ids, mask, _ = batch()
    global_mask = torch.zeros_like(mask)
    global_mask[:, [0, 1, 2, 3, 5, 7, 8, 11, 13, 16, 17, 19]] = 1
    want, want_pooled, want_grads = training_results(reference, ids, mask, global_mask)
    got, got_pooled, got_grads = training_results(accelerated, ids, mask, global_mask)
    assert_same(got, want, mask)
    assert_same(got_pooled, want_pooled)
    for name, grad in want_grads.items():
        if grad is not None:
            assert_same(got_grads[name], grad), name


# Random models and batches: transformers' model is the oracle. Windows are drawn from one family of multiples, so that
# transformers' padding to its largest window suits every layer (with windows 4 and 6 its own forward fails).
WINDOW_FAMILIES = ([4, 8, 16, 32], [6, 12, 24])


@st.composite
def random_requests(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    family = draw(st.sampled_from(WINDOW_FAMILIES))
    windows = draw(st.lists(st.sampled_from(family), min_size=1, max_size=3))
    B, L = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    rows = st.lists(st.lists(st.booleans(), min_size=L, max_size=L), min_size=B, max_size=B)
    mask = torch.tensor(draw(rows), dtype=torch.long)
    mask[:, 0] = 1  # every sequence has a token; the others are padding anywhere
    kind = draw(st.sampled_from(["the same count in each sequence", "at tokens", "anywhere"]))
    if kind == "the same count in each sequence":  # where transformers' own gradients are finite
        count = draw(st.integers(1, int(mask.sum(1).min())))
        global_mask = torch.zeros_like(mask)
        for row, tokens in enumerate(mask.bool()):
            global_mask[row, draw(st.permutations(tokens.nonzero().squeeze(1).tolist()))[:count]] = 1
    else:
        global_mask = torch.tensor(draw(rows), dtype=torch.long)
        if kind == "at tokens":
            global_mask *= mask  # else some global tokens are padding too
    return heads, windows, mask, global_mask, draw(st.integers(0, 99))


def assert_random_request_gives_the_same_results(reference, accelerated, ids, mask, global_mask):
    """Outputs at the tokens in eval mode; in training, every gradient of ours finite, and equal to transformers' where
    its own is (with different global counts per sequence its masked softmax rows make some of its own NaN)."""
    inputs = dict(attention_mask=mask, global_attention_mask=global_mask)
    with torch.no_grad():
        want, got = (model.eval()(ids, **inputs).last_hidden_state for model in (reference, accelerated))
    assert_same(got, want, mask)
    for model in (reference, accelerated):
        out = model.train()(ids, **inputs).last_hidden_state
        (out * mask[..., None]).square().sum().backward()
    for (name, want_grad), got_grad in zip(
        ((n, p.grad) for n, p in reference.named_parameters()), (p.grad for p in accelerated.parameters())
    ):
        assert (want_grad is None) == (got_grad is None), name
        if got_grad is not None:
            assert got_grad.isfinite().all(), name
            if want_grad.isfinite().all():
                assert_same(got_grad, want_grad), name


@hypothesis.seed(20261127)
@hypothesis.settings(max_examples=30, deadline=None, derandomize=True, database=None)
@hypothesis.given(request=random_requests())
def test_random_models_and_batches_give_transformers_results(request):
    heads, windows, mask, global_mask, seed = request
    changes = dict(hidden_size=8 * heads, num_attention_heads=heads, intermediate_size=13)
    config = longformer_config(**changes, num_hidden_layers=len(windows), attention_window=windows)
    reference, accelerated = pair(transformers.LongformerModel, config)
    ids = torch.randint(2, VOCAB, mask.shape, generator=torch.Generator().manual_seed(seed)).masked_fill(mask == 0, PAD)
    assert_random_request_gives_the_same_results(reference, accelerated, ids, mask, global_mask)


@hypothesis.seed(20261127)
@hypothesis.settings(max_examples=20, deadline=None, derandomize=True, database=None)
@hypothesis.given(request=random_requests())
def test_random_led_encoders_and_batches_give_transformers_results(request):
    heads, windows, mask, global_mask, seed = request
    config = led_config(
        d_model=8 * heads, encoder_attention_heads=heads, encoder_layers=len(windows), attention_window=windows
    )
    reference, accelerated = (model.get_encoder() for model in pair(transformers.LEDModel, config))
    ids = torch.randint(2, VOCAB, mask.shape, generator=torch.Generator().manual_seed(seed)).masked_fill(mask == 0, PAD)
    assert_random_request_gives_the_same_results(reference, accelerated, ids, mask, global_mask)


@pytest.mark.parametrize(
    "head",
    [
        "LongformerForMaskedLM",
        "LongformerForSequenceClassification",
        "LongformerForTokenClassification",
        "LongformerForQuestionAnswering",
    ],
)
def test_every_longformer_head(head):
    labels = 2 if head == "LongformerForQuestionAnswering" else 3  # start and end
    reference, accelerated = pair(getattr(transformers, head), longformer_config(num_labels=labels))
    ids, mask, global_mask = batch(length=21, seed=1)
    with torch.no_grad():
        want = reference.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)
        got = accelerated.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)
    for key in want.keys():
        per_token = want[key].dim() >= 2 and want[key].shape[1] == ids.shape[1]
        assert_same(got[key], want[key], mask if per_token else None)


def test_multiple_choice_head():
    reference, accelerated = pair(transformers.LongformerForMultipleChoice, longformer_config())
    ids, mask, global_mask = batch(length=17, seed=2)
    choices = dict(input_ids=ids[None], attention_mask=mask[None], global_attention_mask=global_mask[None])
    with torch.no_grad():
        assert_same(accelerated.eval()(**choices).logits, reference.eval()(**choices).logits)


@pytest.fixture
def float64_by_default():
    """transformers 4's LED decoder fills its causal mask with the model dtype's lowest value in the default dtype,
    which a float64 model's overflows in float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_led_encoder_is_accelerated_and_the_decoder_stays(float64_by_default):
    reference, accelerated = pair(transformers.LEDForConditionalGeneration, led_config())
    encoder_layer = accelerated.led.encoder.layers[0].self_attn.longformer_self_attn
    assert isinstance(encoder_layer, vil.transformers_longformer.AcceleratedLEDEncoderSelfAttention)
    assert type(accelerated.led.decoder.layers[0].self_attn) is type(reference.led.decoder.layers[0].self_attn)
    ids, mask, global_mask = batch(length=23, seed=3, one_global_each=True)
    decoder_ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    results = []
    for model in (reference, accelerated):
        model.train()
        out = model(ids, attention_mask=mask, global_attention_mask=global_mask, decoder_input_ids=decoder_ids)
        out.logits.square().mean().backward()
        results.append((out.logits, out.encoder_last_hidden_state, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_encoded, want_grads), (got, got_encoded, got_grads) = results
    assert_same(got, want)
    assert_same(got_encoded, want_encoded, mask)
    for name, grad in want_grads.items():
        if grad is not None:
            assert_same(got_grads[name], grad), name


def transformers_led_module():
    """A fresh copy of transformers' LED module, as transformers wrote it (the imported one's mask function is
    vil's)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers.models.led.modeling_led")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_led_encoder_forms_no_mask_over_every_pair_of_tokens(dtype):
    """Importing vil.transformers_longformer replaces the function of transformers' LED module that forms the
    encoder's mask: LED's 0 (padding), 1 (a token), 2 (a global token) become the dtype's lowest value, 0 and its
    highest, as transformers' function gives them, but as a view of one row per sequence."""
    replaced = transformers.models.led.modeling_led._prepare_4d_attention_mask_inverted
    assert replaced is vil.transformers_longformer.led_padding_mask
    original = transformers_led_module()._prepare_4d_attention_mask_inverted
    assert original is not replaced
    mask = torch.tensor([[2, 1, 1, 0, 0], [1, 2, 2, 1, 1]])
    lowest, highest = torch.finfo(dtype).min, torch.finfo(dtype).max
    row = torch.tensor([[highest, 0, 0, lowest, lowest], [0, highest, highest, 0, 0]], dtype=dtype)
    for given in (mask, mask.bool(), mask.double() * 0.75):  # transformers' function takes any mask
        for tgt_len, queries in ((None, 5), (3, 3)):
            got, want = (f(given, dtype, tgt_len) for f in (replaced, original))
            assert got.shape == want.shape == (2, 1, queries, 5) and got.dtype == want.dtype == dtype
            assert torch.equal(got, want)
            assert got.untyped_storage().nbytes() == 2 * 5 * row.element_size()
            if given is mask:
                assert torch.equal(want, row[:, None, None, :].expand(2, 1, queries, 5))


def test_compiled_model_gives_the_same_outputs_and_gradients_at_several_lengths():
    """torch.compile with dynamic shapes: the accelerated layers add no graph break (transformers' encoder has its
    own: a ``.item()`` and a log call), and outputs and gradients stay those of transformers' model."""
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    explanation = torch._dynamo.explain(accelerated.eval())(*batch())
    assert explanation.graph_break_count >= 1  # transformers' own, below
    for reason in explanation.break_reasons:
        assert all("/vil/" not in frame.filename for frame in reason.user_stack), reason
    torch._dynamo.reset()
    compiled = torch.compile(accelerated, backend="aot_eager", dynamic=True)
    for length in (29, 57):
        ids, mask, global_mask = batch(length=length, seed=length)
        want, _, want_grads = training_results(reference, ids, mask, global_mask)
        reference.zero_grad()
        accelerated.zero_grad()
        got = training_results(compiled, ids, mask, global_mask)[0]
        assert_same(got, want, mask)
        got_grads = {name: p.grad for name, p in accelerated.named_parameters()}
        for name, grad in want_grads.items():
            if grad is not None and grad.isfinite().all():  # NaN where transformers' own gradients are
                assert_same(got_grads[name], grad), name


def test_the_layer_compiles_as_one_graph():
    layer = vil.models.longformer.LongformerSelfAttention(32, 4, 3, dilation=[1, 2, 1, 2]).double()
    x = torch.randn(3, 20, 32, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(3, 20, dtype=torch.bool)
    padding[1, 15:] = True
    global_mask = torch.zeros_like(padding)
    global_mask[0, [0, 4]] = global_mask[1, 7] = True  # 2, 1 and 0 global tokens
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    # No global token anywhere: the global projections get zero gradients (the compiled backward once crashed).
    for marked in (global_mask, torch.zeros_like(padding)):
        results = []
        for run in (layer, compiled):
            out = run(x, padding, marked)
            leaves = [x, *layer.parameters()]
            results.append((out, *torch.autograd.grad(out.square().sum(), leaves, materialize_grads=True)))
        for got, want in zip(results[1], results[0]):
            assert_same(got, want)


EXPORT_LENGTH = 8 * torch.export.Dim("blocks", min=1, max=11)  # transformers pads to the largest window, 8


def export_inputs(length, seed=0):
    ids, mask, global_mask = batch(length=length, seed=seed)
    return dict(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask)


def test_exported_program_gives_the_same_outputs_at_other_lengths():
    torch.manual_seed(0)
    reference = transformers.LongformerModel(longformer_config(), add_pooling_layer=False).eval()
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference))
    shapes = {name: {1: EXPORT_LENGTH} for name in ("input_ids", "attention_mask", "global_attention_mask")}
    with torch.no_grad():
        program = torch.export.export(accelerated, (), export_inputs(32), dynamic_shapes=shapes)
        for length in (32, 48):
            inputs = export_inputs(length, seed=length)
            assert_same(program.module()(**inputs)[0], reference(**inputs)[0], inputs["attention_mask"], 1e-5)


def test_onnx_export_runs_in_onnxruntime_with_the_same_outputs(tmp_path):
    pytest.importorskip("onnxscript", reason="the onnx extra (pip install 'vil[onnx]')")
    onnxruntime = pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'vil[onnx]')")
    torch.manual_seed(0)
    reference = transformers.LongformerModel(longformer_config(), add_pooling_layer=False).eval()
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference))
    shapes = {name: {1: EXPORT_LENGTH} for name in ("input_ids", "attention_mask", "global_attention_mask")}
    with torch.no_grad():
        program = torch.onnx.export(accelerated, (), kwargs=export_inputs(32), dynamic_shapes=shapes, dynamo=True)
    program.save(tmp_path / "longformer.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "longformer.onnx"), providers=["CPUExecutionProvider"])
    for length in (32, 48):
        inputs = export_inputs(length, seed=length)
        got = session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})[0]
        with torch.no_grad():
            want = reference(**inputs)[0]
        assert_same(torch.from_numpy(got), want, inputs["attention_mask"], 1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-3), (torch.float16, 1e-4)])
def test_half_precision_autocast_stays_finite_and_close_to_float32(dtype, tol):
    """The layers compute in ``dtype`` (their outputs are), the op's scores and softmax in float32."""
    torch.manual_seed(0)
    reference = transformers.LongformerModel(longformer_config(), add_pooling_layer=False).eval()
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference))
    layer_dtypes = []
    layer = accelerated.encoder.layer[0].attention.self
    layer.register_forward_hook(lambda module, inputs, out: layer_dtypes.append(out[0].dtype))
    inputs = export_inputs(29)
    with torch.no_grad():
        want = reference(**inputs)[0]
        with torch.autocast("cpu", dtype=dtype):
            got = accelerated(**inputs)[0]
    assert layer_dtypes == [dtype] and got.isfinite().all()
    assert_same(got, want, inputs["attention_mask"], tol)


def test_parameters_and_checkpoints_are_unchanged(tmp_path):
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    want, got = reference.state_dict(), accelerated.state_dict()
    assert list(want) == list(got) and all(torch.equal(want[k], got[k]) for k in want)
    accelerated.save_pretrained(tmp_path)
    assert vil.transformers_longformer.MASK_IMPLEMENTATION not in (tmp_path / "config.json").read_text()
    reloaded = transformers.LongformerModel.from_pretrained(tmp_path).double().eval()
    assert (
        type(reloaded.encoder.layer[0].attention.self)
        is transformers.models.longformer.modeling_longformer.LongformerSelfAttention
    )
    ids, mask, global_mask = batch(seed=5)
    with torch.no_grad():
        assert_same(
            vil.accelerate_longformer(reloaded)(ids, attention_mask=mask, global_attention_mask=global_mask)[0],
            reference.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)[0],
            mask,
        )


class LowRankAdapted(torch.nn.Linear):
    """A linear layer plus a trained low-rank update, as adapter libraries write one: a subclass with a forward of
    its own, whose weight alone is not what it computes."""

    def __init__(self, base, rank=2):
        super().__init__(base.in_features, base.out_features, dtype=base.weight.dtype)
        self.load_state_dict(base.state_dict())
        self.down = torch.nn.Parameter(0.3 * torch.randn(rank, base.in_features, dtype=base.weight.dtype))
        self.up = torch.nn.Parameter(0.3 * torch.randn(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x):
        return super().forward(x) + x @ self.down.T @ self.up.T


def test_global_projections_that_are_not_plain_linear_layers_are_called_as_they_are(caplog):
    """Adapters and forward hooks on query_global, key_global and value_global change what they compute: the
    accelerated model calls them (said once) and gives transformers' outputs and gradients, the adapters' too,
    eagerly and compiled."""
    torch.manual_seed(0)
    reference = transformers.LongformerModel(longformer_config()).double()
    for layer in reference.encoder.layer:
        for name in ("query_global", "key_global", "value_global"):
            setattr(layer.attention.self, name, LowRankAdapted(getattr(layer.attention.self, name)))
    reference.encoder.layer[1].attention.self.value_global.register_forward_hook(lambda module, x, out: 0.5 * out)
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference))
    ids, mask, global_mask = batch(one_global_each=True)
    want, want_pooled, want_grads = training_results(reference, ids, mask, global_mask)
    vil.models.longformer._said_projected.clear()
    with caplog.at_level(logging.WARNING, logger="vil.models.longformer"):
        got, got_pooled, got_grads = training_results(accelerated, ids, mask, global_mask)
    assert caplog.text.count("calls them on every token") == 1
    assert f"({__name__}.LowRankAdapted, {__name__}.LowRankAdapted, {__name__}.LowRankAdapted)" in caplog.text
    assert_same(got, want, mask)
    assert_same(got_pooled, want_pooled)
    assert any(".up" in name for name in want_grads)
    for name, grad in want_grads.items():
        if grad is not None:
            assert_same(got_grads[name], grad), name
    accelerated.zero_grad()
    compiled = torch.compile(accelerated, backend="aot_eager", dynamic=True)
    got = training_results(compiled, ids, mask, global_mask)[0]
    assert_same(got, want, mask)
    got_grads = {name: p.grad for name, p in accelerated.named_parameters()}
    for name, grad in want_grads.items():
        if grad is not None:
            assert_same(got_grads[name], grad), name


def test_backward_hooks_and_forwards_set_on_global_projections_are_kept(caplog):
    """A backward hook that scales a gradient, and a forward set on the instance (as accelerate's hooks wrap one),
    change what plain nn.Linear global projections compute: the accelerated model calls them as transformers does
    (its gradients were 2x transformers' with the hook ignored)."""
    torch.manual_seed(0)
    reference = transformers.LongformerModel(longformer_config()).double()
    attention = reference.encoder.layer[0].attention.self
    attention.key_global.register_full_backward_pre_hook(lambda module, grad_out: (0.5 * grad_out[0],))
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference))
    ids, mask, global_mask = batch(one_global_each=True)
    want, _, want_grads = training_results(reference, ids, mask, global_mask)
    vil.models.longformer._said_projected.clear()
    with caplog.at_level(logging.WARNING, logger="vil.models.longformer"):
        got, _, got_grads = training_results(accelerated, ids, mask, global_mask)
    assert "(nn.Linear, nn.Linear with hooks, nn.Linear)" in caplog.text
    assert_same(got, want, mask)
    for name, grad in want_grads.items():
        if grad is not None:
            assert_same(got_grads[name], grad), name
    for model in (reference, accelerated):
        value_global = model.encoder.layer[1].attention.self.value_global
        value_global.forward = lambda x, linear=value_global: 0.5 * torch.nn.functional.linear(x, linear.weight)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="vil.models.longformer"):
        want = reference.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)[0]
        got = accelerated.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)[0]
    assert "(nn.Linear, nn.Linear, nn.Linear with a forward of its own)" in caplog.text
    assert_same(got, want, mask)


@pytest.mark.skipif(not TRANSFORMERS_4, reason="transformers 5's Longformer models take no head_mask")
def test_head_mask_gives_the_same_outputs_and_gradients(float64_by_default):
    """transformers 4 scales each head's attention probabilities by ``head_mask``, gradients to the mask included
    (head-importance scores are those gradients); the op's output is scaled per head instead. With attention dropout
    in training, transformers' own attention gets the mask. LED's encoder too; a mask in another dtype than the
    model's is cast, as transformers casts its product."""
    for dropout in (0.0, 0.3):
        reference, accelerated = pair(
            transformers.LongformerModel, longformer_config(attention_probs_dropout_prob=dropout)
        )
        ids, mask, global_mask = batch(one_global_each=True)
        results = []
        for model in (reference, accelerated):
            head_mask = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.25, 1.0, 1.0, 0.0]], dtype=torch.float64)
            head_mask.requires_grad_()
            torch.manual_seed(7)
            out = model.train()(ids, attention_mask=mask, global_attention_mask=global_mask, head_mask=head_mask)
            (out.last_hidden_state * mask[..., None]).square().sum().backward()
            results.append((out.last_hidden_state, head_mask.grad, {n: p.grad for n, p in model.named_parameters()}))
        (want, want_mask_grad, want_grads), (got, got_mask_grad, got_grads) = results
        assert_same(got, want, mask)
        assert_same(got_mask_grad, want_mask_grad)
        assert want_mask_grad.abs().min() > 0  # every head's output reaches the loss
        for name, grad in want_grads.items():
            if grad is not None:
                assert_same(got_grads[name], grad), name
    with pytest.raises(ValueError, match=r"shape \(3,\).*\(4,\).*\(layers, 4\)"):
        accelerated.eval()(ids, attention_mask=mask, global_attention_mask=global_mask, head_mask=torch.ones(2, 3))

    reference, accelerated = pair(transformers.LEDModel, led_config())
    decoder_ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    results = []
    for model in (reference, accelerated):
        head_mask = torch.tensor([[0.5, 1.0, 0.0, 1.0], [1.0, 0.75, 1.0, 1.0]], dtype=torch.float64)
        head_mask.requires_grad_()
        out = model.train()(
            ids, attention_mask=mask, global_attention_mask=global_mask, decoder_input_ids=decoder_ids,
            head_mask=head_mask,
        )  # fmt: skip
        out.last_hidden_state.square().mean().backward()
        results.append((out.encoder_last_hidden_state, head_mask.grad))
    (want, want_mask_grad), (got, got_mask_grad) = results
    assert_same(got, want, mask)
    assert_same(got_mask_grad, want_mask_grad)
    assert want_mask_grad.abs().min() > 0

    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    reference = transformers.LongformerModel(longformer_config()).eval()  # float32, with a float64 mask
    accelerated = vil.accelerate_longformer(copy.deepcopy(reference))
    head_mask = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.25, 1.0, 1.0, 0.0]], dtype=torch.float64)
    with torch.no_grad():
        want, got = (
            model(ids, attention_mask=mask, global_attention_mask=global_mask, head_mask=head_mask)[0]
            for model in (reference, accelerated)
        )
    assert got.dtype == torch.float32
    assert_same(got, want, mask, tol=1e-5)


def test_attention_dropout_in_training_runs_transformers_attention_and_says_so_once(caplog, monkeypatch):
    reference, accelerated = pair(transformers.LongformerModel, longformer_config(attention_probs_dropout_prob=0.3))
    ids, mask, global_mask = batch(seed=6)
    outputs = []
    with caplog.at_level(logging.WARNING, logger="vil.transformers_longformer"):
        vil.transformers_longformer._Accelerated._said.clear()
        # Compiled too: that attention runs eagerly there (dynamo fails on transformers' global attention).
        compiled = torch.compile(accelerated, backend="aot_eager")
        for model in (reference, accelerated, accelerated, compiled):
            torch.manual_seed(7)
            outputs.append(model.train()(ids, attention_mask=mask, global_attention_mask=global_mask)[0])
    assert_same(outputs[1], outputs[0], mask)  # the same dropout draws: transformers' own attention
    assert_same(outputs[3], outputs[0], mask)
    assert caplog.text.count("The attention dropout is above 0") == 1 and "layer.dropout = 0.0" in caplog.text
    attend, calls = vil.models.longformer.SlidingWindowSelfAttention.attend, []
    monkeypatch.setattr(
        vil.models.longformer.SlidingWindowSelfAttention, "attend", lambda *a: calls.append(1) or attend(*a)
    )
    caplog.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="vil.transformers_longformer"):
        vil.transformers_longformer._Accelerated._said.clear()
        assert_same(  # in evaluation dropout is off: the op, on every layer, and nothing said
            accelerated.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)[0],
            reference.eval()(ids, attention_mask=mask, global_attention_mask=global_mask)[0],
            mask,
        )
    assert len(calls) == 2 and caplog.text == ""


def test_output_attentions_gives_transformers_tensors_and_says_so_once(caplog):
    """The op never forms the probabilities: a call that asks for them runs transformers' own attention."""
    reference, accelerated = pair(transformers.LongformerModel, longformer_config())
    ids, mask, global_mask = batch(one_global_each=True)
    vil.transformers_longformer._Accelerated._said.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="vil.transformers_longformer"):
        want, got, _, compiled = (
            model.eval()(ids, attention_mask=mask, global_attention_mask=global_mask, output_attentions=True)
            for model in (reference, accelerated, accelerated, torch.compile(accelerated, backend="aot_eager"))
        )
    assert caplog.text.count("output_attentions=True asks for the attention probabilities") == 1
    for result in (got, compiled):  # compiled, transformers' attention runs eagerly
        assert_same(result.last_hidden_state, want.last_hidden_state, mask)
        assert len(result.attentions) == len(result.global_attentions) == 2
        pairs = zip(result.attentions + result.global_attentions, want.attentions + want.global_attentions)
        for got_probs, want_probs in pairs:
            assert torch.equal(got_probs, want_probs)


def test_what_is_refused():
    _, accelerated = pair(transformers.LongformerModel, longformer_config())
    ids, mask, global_mask = batch()
    with pytest.raises(ValueError, match="Linear has no Longformer self-attention"):
        vil.accelerate_longformer(torch.nn.Linear(2, 2))
    for not_a_model, named in (
        ("allenai/longformer-base-4096", "a str"),
        (transformers.LongformerModel, "the class LongformerModel"),
    ):
        with pytest.raises(ValueError, match=f"model instance .*got {named}"):
            vil.accelerate_longformer(not_a_model)
    subclassed = transformers.LongformerModel(longformer_config())
    for layer in subclassed.encoder.layer:
        layer.attention.self.__class__ = type(
            "OwnAttention", (transformers.models.longformer.modeling_longformer.LongformerSelfAttention,), {}
        )
    with pytest.raises(ValueError, match="OwnAttention subclasses transformers' LongformerSelfAttention"):
        vil.accelerate_longformer(subclassed)
    assert subclassed.config._attn_implementation == "eager"  # a refused call leaves the model as it was
    assert vil.accelerate_longformer(accelerated) is accelerated  # a second call changes nothing
    for name, what in (("'nonsense'", "Unknown"), ("unfold", "does not compute 1D")):  # unfold: 2D only
        with pytest.raises(ValueError, match=rf"{name}.*; (available|1D backends): sliding_chunk, .*reference") as e:
            vil.accelerate_longformer(accelerated, backend=name)
        assert what in str(e.value)


def test_layers_left_computing_transformers_attention_are_said(caplog):
    """Beside converted layers, a subclass of transformers' layer stays as it is, and a converted layer whose forward
    is set on the instance (a wrapper that calls the forward it found, as accelerate's hooks do) keeps calling
    transformers' attention: each is said in one warning, which counts them."""
    model = transformers.LongformerModel(longformer_config(num_hidden_layers=3, attention_window=[4, 8, 4]))
    layers = [layer.attention.self for layer in model.encoder.layer]
    layers[0].__class__ = type(
        "OwnAttention", (transformers.models.longformer.modeling_longformer.LongformerSelfAttention,), {}
    )
    found = layers[1].forward  # bound to transformers' forward when the wrapper is made
    layers[1].forward = lambda *args, **kwargs: found(*args, **kwargs)
    with caplog.at_level(logging.WARNING, logger="vil.transformers_longformer"):
        vil.accelerate_longformer(model)
    assert [type(layer).__name__ for layer in layers] == ["OwnAttention"] + ["AcceleratedLongformerSelfAttention"] * 2
    assert "1 of the model's 3 Longformer self-attention layers (OwnAttention) subclass" in caplog.text
    assert "1 of the 2 accelerated self-attention layers have a forward set on the instance" in caplog.text


def test_without_transformers_the_call_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "vil.transformers_longformer", raising=False)
    for name in [name for name in sys.modules if name.split(".")[0] == "transformers"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"transformers 4\.57 or later.*vil\[transformers\]"):
        vil.accelerate_longformer(torch.nn.Linear(2, 2))


def test_benchmark_tool_figures_are_those_of_the_times_and_peaks_measured():
    """From given medians (s) and peaks (MiB), hand-computed: each speed-up is transformers' time over the
    accelerated one's, the peak ratio the accelerated peak over transformers', and the bound transformers' time over
    the shared parts' (the model without attention)."""
    from tool_runner import load_tool

    tool = load_tool("benchmark_longformer")
    results = {
        ("model", 4096, "transformers"): (0.300, 0.120, 800.0),
        ("model", 4096, "accelerated"): (0.100, 0.040, 200.0),
        ("model", 4096, tool.SHARED): (0.060, 0.030, None),
    }
    (row,) = tool.table(results).splitlines()[2:]
    assert row == (
        "| model | 4096 | 300 / 120 | 100 / 40 | 3.00x / 3.00x | 800 -> 200 (0.25x) | 60 / 30: 5.00x / 4.00x |"
    )


def test_benchmark_tool_prints_the_table_and_draws_the_plots(tmp_path):
    from tool_runner import run_tool

    options = ["--lengths", "16", "32", "--hidden", "24", "--window", "4", "--layers", "1", "--rounds", "1"]
    what = ["--what", "layer", "model", "autocast"]
    markdown = ["--markdown", tmp_path / "lf.md"]
    status, out, err = run_tool("benchmark_longformer", *options, *what, "--plot", tmp_path / "lf", *markdown)
    assert status == 0, err
    machine, tables = (tmp_path / "lf.md").read_text().strip().split("\n\n", 1)
    assert machine == out.splitlines()[0] and machine.startswith("CPU: ") and tables in out
    rows = [line for line in out.splitlines() if line.startswith(("| layer |", "| model |"))]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| layer", "16"],
        ["| layer", "32"],
        ["| model", "16"],
        ["| model", "32"],
    ]
    bounds = [row.split(" | ")[-1].rstrip(" |") for row in rows]  # shared parts train / infer: two ratios, model only
    assert bounds[:2] == ["-", "-"]
    assert all(re.fullmatch(r"\d+ / \d+: [\d.]+x / [\d.]+x", bound) for bound in bounds[2:]), bounds
    autocast = [line.split(" | ")[:2] for line in out.splitlines() if "float16 |" in line]
    assert autocast == [["| 16", dtype] for dtype in ("bfloat16", "float16")] + [
        ["| 32", dtype] for dtype in ("bfloat16", "float16")
    ]
    for quantity in ("time", "memory"):
        assert (tmp_path / f"lf_{quantity}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
