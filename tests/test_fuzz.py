"""Fuzz tests (hypothesis, a fixed seed and a bounded number of examples, about a minute together): damaged
image files and random config overrides end in a result or in one sentence, never in a traceback; random valid
2D and 1D local-attention requests give every CPU backend the reference's result (1D: every gradient too),
random models the reference backend's logits and gradients, and checkpoints altered in their structure load their
own values or stop in one sentence.

A longer profile, by hand: ``VIL_FUZZ_EXAMPLES=500 python -m pytest tests/test_fuzz.py``.
"""

import io
import itertools
import math
import os

import torch
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from PIL import Image
from test_train import tiny_cfg

import vil.training.epoch as training_epoch
from vil.config import config_items, get_cfg
from vil.models.msvit import MsViT
from vil.ops import available_backends, local_attention_1d, local_attention_2d
from vil.ops.registry import BACKENDS
from vil.training.loop import train

EXAMPLES = int(os.environ.get("VIL_FUZZ_EXAMPLES", 0))


def fuzz_settings(examples):
    return settings(
        max_examples=EXAMPLES or examples,
        deadline=None,
        derandomize=not EXAMPLES,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def assert_one_sentence(error):
    assert isinstance(error, (ValueError, OSError, FloatingPointError)), f"{type(error).__name__}: {error}"
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, text


# Damaged images.

FORMATS = ("JPEG", "PNG", "BMP")
FILES = 8  # training images: two batches of 4, so every file is loaded once an epoch


def image_bytes(index):
    image = Image.new("RGB", (20 + index, 18), (30 * index % 255, 90, 200 - 20 * index))
    buffer = io.BytesIO()
    image.save(buffer, format=FORMATS[index % len(FORMATS)])
    return buffer.getvalue()


damage = st.one_of(
    st.none(),
    st.tuples(st.just("truncate"), st.floats(0.0, 0.95)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(1, 255)), min_size=1, max_size=6)),
)


def damaged(data, how):
    if how is None:
        return data
    if how[0] == "truncate":
        return data[: int(len(data) * how[1])]
    data = bytearray(data)
    for where, mask in how[1]:
        data[int(where * len(data))] ^= mask
    return bytes(data)


def decodes(path):
    """The oracle: PIL opens and fully decodes the file (no project code involved)."""
    try:
        with Image.open(path) as image:
            image.convert("RGB").load()
        return True
    except Exception:
        return False


@seed(20261123)
@fuzz_settings(20)
@given(damages=st.lists(damage, min_size=FILES, max_size=FILES))
def test_damaged_images_train_an_epoch_and_every_skip_is_counted(tmp_path_factory, damages):
    root = tmp_path_factory.mktemp("images")
    bad = 0
    for split in ("train", "val"):
        for i in range(FILES):
            folder = root / split / ("a" if i % 2 else "b")
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{i}.{FORMATS[i % len(FORMATS)].lower()}"
            path.write_bytes(damaged(image_bytes(i), damages[i]) if split == "train" else image_bytes(i))
            bad += split == "train" and not decodes(path)
    out = root / "out"
    cfg = tiny_cfg(root, out, "OPTIM.EPOCHS", "1", "MODEL.VIT.DROP_PATH", "0.0")
    try:
        train(cfg)
    except ValueError as error:  # only when a whole batch was unreadable
        assert_one_sentence(error)
        assert bad >= 4 and "are unreadable" in str(error)
        return
    text = (out / "log.txt").read_text()
    assert (f"skipped {bad} unreadable images" in text) if bad else ("unreadable" not in text)
    assert text.count("Skipped unreadable image") == bad


# Random config overrides.

EXCLUDED = {"OUTPUT_DIR", "DATA.PATH", "MODEL.MODEL_PATH", "EVALUATE"}  # where the run writes, reads, or what it does


KEYS = {key: value for key, value in config_items(get_cfg()) if key not in EXCLUDED}


def values_like(default):
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.sampled_from(sorted({-1, 0, 1, 2, 3, default, 2 * default}))
    if isinstance(default, float):
        return st.sampled_from([-1.0, 0.0, 0.5, 1.0, 1e10, math.nan, math.inf, default])
    if isinstance(default, str):
        return st.sampled_from(["", "abc", "1", default])
    return st.sampled_from([[], list(default), [0.5], ["x"], [0.5, 1.0], [1, 2, 3, 4, 5]])


overrides = st.lists(st.sampled_from(sorted(KEYS)), min_size=1, max_size=3, unique=True).flatmap(
    lambda keys: st.tuples(*[st.tuples(st.just(k), values_like(KEYS[k])) for k in keys])
)


class OneStepDone(Exception):
    pass


@seed(20261123)
@fuzz_settings(50)
@given(pairs=overrides)
def test_random_config_overrides_train_a_step_or_stop_with_one_sentence(tmp_path_factory, monkeypatch, pairs):
    root = tmp_path_factory.mktemp("config")
    from test_data import make_folder

    data = make_folder(root / "data", per_class=4, corrupt=False)
    real_step = training_epoch.optimizer_step

    def one_step(run, where):
        real_step(run, where)
        raise OneStepDone

    monkeypatch.setattr(training_epoch, "optimizer_step", one_step)
    flat = [x for pair in pairs for x in pair]
    try:
        cfg = tiny_cfg(data, root / "out", "OPTIM.EPOCHS", "1", *flat)
        train(cfg)
    except OneStepDone:
        return
    except Exception as error:
        assert_one_sentence(error)


# Random local-attention requests.

# The 2D backends that run on the CPU, each compared with the reference. Not triton: on the CPU it runs only under
# Triton's interpreter and takes head_dim 16 and more (tests/test_triton_kernels.py compares it with the reference).
CPU_BACKENDS = ("sliding_chunk", "sliding_chunk_autograd", "fused_cpu", "unfold", "unfold_nnf", "chunk_rows", "flex")


def test_every_cpu_backend_is_fuzzed():
    on_cpu = {n for n in available_backends(2) if BACKENDS[n].runs_on("cpu")}
    assert set(CPU_BACKENDS) == on_cpu - {"reference", "triton"}


def declared_to_take(name, dilation):
    """Whether a backend's declaration takes a float32 CPU forward request: it computes 2D windows, runs on the
    CPU, takes float32, dilated windows where the request is dilated, and has no check of its own that may refuse
    options."""
    b = BACKENDS[name]
    return (
        b.computes(2)
        and b.runs_on("cpu")
        and torch.float32 in b.dtypes
        and (dilation == 1 or b.dilation(2) is not None)
        and b.check is None
    )


# Valid window options only: chunked windows (exact 0 or -1) with any mode and dilation 1, or the exact window
# (exact 1) with mode 0 and any dilation.
window_options = st.sampled_from([-1, 0, 1]).flatmap(
    lambda exact: (
        st.tuples(st.just(exact), st.just(0), st.integers(1, 9))
        if exact == 1
        else st.tuples(st.just(exact), st.integers(-1, 8), st.just(1))
    )
)


def request_2d(side, head_dim, window):
    """The strategies of a random valid 2D request, by argument name: (B, H, X, Y, D) with sides up to ``side`` and
    head sizes up to ``head_dim``, a window up to ``window`` and its options, 0 to 2 global keys, bias tables or not."""
    sizes = (st.integers(1, 2), st.integers(1, 2), st.integers(1, side), st.integers(1, side), st.integers(1, head_dim))
    return dict(
        shape=st.tuples(*sizes),
        window=st.integers(1, window),
        options=window_options,
        num_global=st.integers(0, 2),
        with_bias=st.booleans(),
    )


def each_backend_on_three_kinds_of_window(test):
    """Besides the drawn requests, each backend on a cyclic chunked window with one neighbour, a zero-padded one
    with all nine chunks and a dilated exact window, with global keys and both bias tables: the draws alone leave
    some of these pairs out."""
    for backend, options in itertools.product(CPU_BACKENDS, [(-1, 5, 1), (0, 0, 1), (1, 0, 2)]):
        request = dict(shape=(2, 2, 7, 5, 3), window=2, options=options, num_global=1, with_bias=True)
        test = example(**request, backend=backend)(test)
    return test


@seed(20261123)
@fuzz_settings(150)
@each_backend_on_three_kinds_of_window
@given(**request_2d(side=7, head_dim=6, window=9), backend=st.sampled_from(CPU_BACKENDS))
def test_random_local_attention_requests_match_the_reference(shape, window, options, num_global, with_bias, backend):
    B, H, X, Y, D = shape
    exact, mode, dilation = options
    generator = torch.Generator().manual_seed(X * 100 + Y * 10 + D)
    q, k, v = (torch.randn(B, H, X, Y, D, generator=generator) for _ in range(3))
    extra = {}
    if num_global:
        extra.update(
            global_k=torch.randn(B, H, num_global, D, generator=generator),
            global_v=torch.randn(B, H, num_global, D, generator=generator),
        )
    if with_bias:
        extra["rel_bias"] = torch.randn(H, (4 * window - 1) ** 2, generator=generator)
        if num_global:
            extra["global_bias"] = torch.randn(H, num_global, generator=generator)
    request = dict(exact=exact, mode=mode, dilation=dilation, **extra)
    expected = local_attention_2d(q, k, v, window, backend="reference", **request)
    try:
        got = local_attention_2d(q, k, v, window, backend=backend, **request)
    except ValueError as error:
        assert_one_sentence(error)
        assert not declared_to_take(backend, dilation), f"{backend} refused a request it declares: {error}"
        return
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# Random 1D requests: every CPU backend of local_attention_1d against the reference in float64, forward and every
# gradient (flex: forward only, it has no CPU backward), q, k, v contiguous or views of one projection.

CPU_BACKENDS_1D = ("sliding_chunk", "fused_cpu", "flex", "loop", "chunks")


def test_every_cpu_backend_is_fuzzed_in_1d():
    on_cpu = {n for n in available_backends(1) if BACKENDS[n].runs_on("cpu")}
    assert set(CPU_BACKENDS_1D) == on_cpu - {"reference", "triton"}


@st.composite
def requests_1d(draw, length=40, head_dim=9, window=12):
    """A random valid 1D request: up to ``length`` tokens, heads up to ``head_dim`` wide, a window up to ``window``."""
    heads = draw(st.integers(1, 3))
    return dict(
        shape=(draw(st.integers(1, 2)), heads, draw(st.integers(1, length)), draw(st.integers(1, head_dim))),
        window=draw(st.integers(1, window)),
        dilation=draw(st.one_of(st.integers(1, 5), st.lists(st.integers(1, 6), min_size=heads, max_size=heads))),
        causal=draw(st.booleans()),
        num_global=draw(st.integers(0, 3)),
        with_bias=draw(st.booleans()),
        padding=draw(st.sampled_from([None, "scattered", "at the end"])),
        one_projection=draw(st.booleans()),
    )


def padding_mask(kind, B, L, generator):
    """A drawn request's key padding mask (B, L): None, scattered keys (30%) or the last third of the keys."""
    if kind == "scattered":
        return torch.rand(B, L, generator=generator) < 0.3
    if kind == "at the end":
        return torch.arange(L).expand(B, L) >= L - L // 3
    return None


def inputs_1d(request, generator):
    """The leaves (float64) and a function of them giving local_attention_1d's arguments."""
    B, H, L, D = request["shape"]
    G, window = request["num_global"], request["window"]
    if request["one_projection"]:
        leaves = [torch.randn(B, L, 3, H, D, generator=generator, dtype=torch.float64)]
    else:
        leaves = [torch.randn(B, H, L, D, generator=generator, dtype=torch.float64) for _ in range(3)]
    names = []
    if G:
        names += ["global_k", "global_v"]
        leaves += [torch.randn(B, H, G, D, generator=generator, dtype=torch.float64) for _ in range(2)]
    if request["with_bias"]:
        names += ["rel_bias", *(["global_bias"] if G else [])]
        leaves += [torch.randn(H, 2 * window + 1, generator=generator, dtype=torch.float64)]
        leaves += [torch.randn(H, G, generator=generator, dtype=torch.float64)] if G else []
    padding = padding_mask(request["padding"], B, L, generator)

    def arguments(tensors):
        if request["one_projection"]:
            qkv = tensors[0].permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) views, as a model's projection gives
            tensors = [*qkv, *tensors[1:]]
        optional = dict(zip(names, tensors[3:]))
        return tensors[:3], dict(optional, key_padding_mask=padding)

    return leaves, arguments


@seed(20261127)
@fuzz_settings(120)
@given(request=requests_1d(), backend=st.sampled_from(CPU_BACKENDS_1D))
def test_random_1d_requests_match_the_reference_with_every_gradient(request, backend):
    leaves, arguments = inputs_1d(request, torch.Generator().manual_seed(sum(request["shape"])))
    options = dict(window=request["window"], dilation=request["dilation"], causal=request["causal"])
    grad_out = torch.randn(request["shape"], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    train = backend != "flex"

    def results(name):
        tensors = [t.detach().requires_grad_(train) for t in leaves]
        (q, k, v), optional = arguments(tensors)
        out = local_attention_1d(q, k, v, **options, **optional, backend=name)
        if not train:
            return [out]
        (out * grad_out).sum().backward()
        return [out, *(t.grad for t in tensors)]

    for got, want in zip(results(backend), results("reference"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


# Random models: arch strings of 3 or 4 stages (local or full attention, 0 to 2 global tokens, windows 1 to 5, either
# position embedding), image sizes, SW_EXACT, SHARE_W and padding; each 2D CPU backend (flex: no CPU backward) gives
# the logits and every gradient of the same weights with the reference backend, in float64. (ONLY_GLOBAL computes no
# window, and takes no backend.)

TRAINING_BACKENDS_2D = tuple(name for name in CPU_BACKENDS if name != "flex")


@st.composite
def arch_strings(draw):
    stages = []
    for index in range(1, draw(st.integers(3, 4)) + 1):
        heads = draw(st.integers(1, 3))
        fields = dict(
            l=index,
            h=heads,
            d=2 * heads * draw(st.integers(1, 3)),  # even: the absolute embedding splits it between rows and columns
            n=draw(st.integers(1, 2)),
            s=draw(st.integers(0, 1)),
            g=draw(st.integers(0, 2)),
            p=draw(st.integers(1, 2)),
            f=draw(st.integers(1, 5)),
            a=draw(st.integers(0, 1)),
        )
        stages.append(",".join(f"{letter}{value}" for letter, value in fields.items()))
    return "_".join(stages)


@seed(20261127)
@fuzz_settings(25)
@given(
    arch=arch_strings(),
    size=st.tuples(st.integers(8, 40), st.integers(8, 40)),
    backend=st.sampled_from(TRAINING_BACKENDS_2D),
    exact=st.sampled_from([-1, 0, 1]),
    share_w=st.booleans(),
    padding=st.booleans(),
)
def test_random_models_give_the_reference_backends_logits_and_gradients(arch, size, backend, exact, share_w, padding):
    options = dict(arch=arch, img_size=size, num_classes=3, drop_path_rate=0.0, sw_exact=exact, share_w=share_w)
    options.update(dynamic_img_pad=padding)
    try:
        reference = MsViT(**options, attn_backend="reference").double()
    except ValueError as error:  # e.g. an image smaller than the strides
        assert_one_sentence(error)
        return
    model = MsViT(**options, attn_backend=backend).double()
    model.load_state_dict(reference.state_dict())
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(sum(size)), dtype=torch.float64)
    for m in (reference, model):
        m(images).square().sum().backward()
    torch.testing.assert_close(model(images), reference(images), rtol=1e-9, atol=1e-10)
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert (want.grad is None) == (got.grad is None), name
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10, msg=name)


# Checkpoints altered in their structure: a key dropped, added or renamed, a tensor reshaped, made a scalar, cast to
# another dtype or replaced by a number, the state put under another key. Loading gives the file's own values (cast
# to the model's precision), or stops in one sentence; never other values, never a traceback.

ALTERATIONS = ("drop", "add", "rename", "reshape", "scalar", "dtype", "number", "rehome")
DTYPES = (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool, torch.complex64)


def altered(net, how, index, dtype):
    """``net`` (a state dict with original-release names) with one alteration at its ``index``-th key."""
    key = sorted(net)[index % len(net)]
    value = net[key]
    if how == "drop":
        del net[key]
    elif how == "add":
        net[key + "_extra"] = torch.zeros(3)
    elif how == "rename":
        net[key.replace(".", "_", 1)] = net.pop(key)
    elif how == "reshape":
        net[key] = value.reshape(-1)[:-1].clone() if value.numel() > 1 else value.reshape(1, 1)
    elif how == "scalar":
        net[key] = torch.tensor(1.0)
    elif how == "dtype":
        net[key] = value.to(dtype)
    elif how == "number":
        net[key] = 3
    else:  # the whole state under a key of its own, as no writer puts it
        return {"weights": dict(net)}
    return net


@seed(20261128)
@fuzz_settings(60)
@example(alterations=[("dtype", 0, torch.int32)], new_classifier=False)  # head.bias: cast and loaded, once
@example(alterations=[("scalar", 0, torch.float32)], new_classifier=True)  # an IndexError, once
@given(
    alterations=st.lists(
        st.tuples(st.sampled_from(ALTERATIONS), st.integers(0, 500), st.sampled_from(DTYPES)), min_size=1, max_size=2
    ),
    new_classifier=st.booleans(),
)
def test_altered_checkpoints_load_their_own_values_or_stop_in_one_sentence(
    tmp_path_factory, alterations, new_classifier
):
    from vil.config import load_cfg
    from vil.weights import load_weights

    arch = "l1,h1,d16,p4,f2,g1_l2,h1,d32,f2,a0_l3,h2,d32,s0"
    root = tmp_path_factory.mktemp("altered")
    torch.manual_seed(0)
    net = {f"module.{k}": v for k, v in MsViT(arch, img_size=32, num_classes=5, share_w=False).state_dict().items()}
    for how, index, dtype in alterations:
        net = altered(net, how, index, dtype) if "weights" not in net else net
    torch.save({"net": net, "arch": "msvit", "epoch": 300}, root / "altered.pth")
    overrides = ["MODEL.VIT.MSVIT.ARCH", arch, "MODEL.VIT.MSVIT.SHARE_W", "False", "INPUT.IMAGE_SIZE", "32"]
    overrides += ["DATA.NUM_CLASSES", "5", "MODEL.MODEL_PATH", str(root / "altered.pth")]
    torch.manual_seed(1)
    model = MsViT(arch, img_size=32, num_classes=5, share_w=False)
    try:
        load_weights(model, load_cfg(overrides=overrides), new_classifier=new_classifier)
    except ValueError as error:
        assert_one_sentence(error)
        return
    for key, value in model.state_dict().items():
        stored = net[f"module.{key}"]
        assert value.dtype == torch.float32 and torch.equal(value, stored.to(torch.float32)), key
