"""The classification model for deployment: ``torch.export`` with dynamic batch, height and width, and ONNX (with
dynamic height and width, or at one image size).

Local attention is one operator per call (``vil/ops/operators.py``); the exported program keeps it, so it runs
with the backend it was built with. ONNX has no such operator: during an ONNX export the op layer records its
decomposition into standard operators instead (the unfold_nnf computation of the same function), as it does for a
program of standard operators (``export_program(..., standard_operators=True)``).
"""

import contextlib

import torch

from .files import atomic_write
from .models.attention import LongformerAttention
from .ops.base import ONE_SIZE_EXPORT, exporting_to_onnx, recording_for_onnx

LARGEST_SIDE = 4096  # the largest image side the exports declare


def _size_step(model):
    """The image sides an export takes are the multiples of this: the model's total stride, or 1 for a model whose
    patch embeddings pad images to a multiple of their patch size (``dynamic_img_pad``), except in an ONNX export,
    where local attention's decomposition would need torch to prove guards it cannot for any size."""
    return 1 if getattr(model, "dynamic_img_pad", False) and not exporting_to_onnx() else model.total_stride


def _least_side(model):
    """The least image side an export declares: twice the total stride (torch specialises a last map of one position
    per side, broadcasting it), or the least the model takes where that is more (spatial-reduction stages)."""
    return max(2 * model.total_stride, model.least_image_side)


def _example_and_dims(model, height, width, dynamic_size=True):
    """An input of ``2 x C x height x width`` and the dynamic shapes of any batch and any height and width
    from :func:`_least_side` that are multiples of :func:`_size_step` (of any batch only, for a model of fixed input
    size or without ``dynamic_size``)."""
    example = torch.randn(2, model.in_chans, height, width)
    any_batch = {0: torch.export.Dim("batch", min=1, max=1024)}
    if model.fixed_input_size and (height, width) != tuple(model.img_size):
        raise ValueError(
            f"This model takes only {model.img_size[0]}x{model.img_size[1]} images (linformer "
            f"attention is built for one token count); export it at that size, not {height}x{width}."
        )
    if model.fixed_input_size or not dynamic_size:
        return example, (any_batch,)
    stride, step, least = model.total_stride, _size_step(model), _least_side(model)
    if height % step or width % step or min(height, width) < least:
        multiple = f"a multiple of the model's total stride {stride} and " if step > 1 else ""
        raise ValueError(
            f"Export at an image size that is {multiple}at least {least} on each side, got {height}x{width}."
        )
    rows, cols = (torch.export.Dim(name, min=-(-least // step), max=LARGEST_SIDE // step) for name in ("rows", "cols"))
    if step == 1:
        return example, ({**any_batch, 2: rows, 3: cols},)
    return example, ({**any_batch, 2: step * rows, 3: step * cols},)


def _two_chunks_size(model):
    """The smallest image side, a multiple of the total stride from twice it, at which every chunked local stage
    (SW_EXACT 0 or -1, not ONLY_GLOBAL) has at least two chunks per side of its map."""
    side, stride = 2 * model.total_stride, 1
    for spec in model.stage_specs:
        stride *= spec.patch
        if any(
            isinstance(m, LongformerAttention) and m.exact != 1 and not m.only_global
            for m in getattr(model, f"layer{spec.index}").modules()
        ):
            side = max(side, (spec.window + 1) * stride)
    return -(-side // model.total_stride) * model.total_stride


def _check_any_size(model, program, height, width):
    """Refuse a program whose height or width torch narrowed below the declared largest while tracing: where a
    chunked local stage has one chunk per side, the unfold computation broadcasts it and torch specialises that
    (the program would refuse larger images; an ONNX file, which keeps no guards, would fail on them)."""
    (name,) = program.graph_signature.user_inputs
    shape = next(node for node in program.graph.nodes if node.name == name).meta["val"].shape
    largest, declared = [], []
    for side in shape[2:]:
        expr = side.node.expr  # step * rows
        (root,) = expr.free_symbols
        largest.append(int(expr.subs(root, program.range_constraints[root].upper)))
        declared.append(int(expr.subs(root, LARGEST_SIDE // _size_step(model))))
    if largest != declared:
        # The first size torch did not narrow away, and the size at which no chunked stage has one chunk.
        wanted = max(_two_chunks_size(model), *(a + model.total_stride for a, b in zip(largest, declared) if a < b))
        raise ValueError(
            f"Traced at {height}x{width}, where a chunked local stage has one chunk per side, the program takes images "
            f"of at most {largest[0]}x{largest[1]} only, not every {_sides_taken(model)} up to "
            f"{declared[0]}x{declared[1]}; export at {max(height, wanted)}x{max(width, wanted)} or larger (every "
            f"chunked local stage then has at least two chunks per side) for a program that takes any size."
        )


def _traced(model, height, width, dynamic_size=True):
    """The example input and the ``torch.export`` program of ``model`` in evaluation mode traced at ``height x
    width`` (not strict: what the model refuses is raised as it is), for the sizes of :func:`_example_and_dims`.
    The model is left in the mode it was in."""
    described = _vil_of(model)
    example, dims = _example_and_dims(described, height, width, dynamic_size=dynamic_size)
    training = model.training
    try:
        with torch.no_grad():
            program = torch.export.export(model.eval(), (example,), dynamic_shapes=dims, strict=False)
    except torch._dynamo.exc.UserError as error:
        if error.error_type != torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
            raise
        raise ValueError(_unprovable(described, error, height, width)) from None
    finally:
        model.train(training)
    if 2 in dims[0]:
        _check_any_size(described, program, height, width)
    return example, program


def _unprovable(model, error, height, width):
    """One sentence for a trace whose guards on the image size torch cannot prove for every size declared (e.g. a
    model of total stride 1, whose sides torch takes as they are rather than narrowing them)."""
    reason = str(error).splitlines()[0].split(" For more information")[0].strip()
    keep_operators = ", or keep the op's operators (vil.export.export_program without standard_operators)"
    return (
        f"torch.export cannot prove that the program traced at {height}x{width} takes every {_sides_taken(model)} "
        f"it declares ({reason}); {ONE_SIZE_EXPORT}{keep_operators if exporting_to_onnx() else ''}."
    )


def _vil_of(model):
    """The ViL model whose sizes ``model`` takes: itself (a classification model, a detection backbone), or the one
    that timm's ``features_only`` wrapper holds; anything else is refused in one sentence."""
    for candidate in (model, getattr(model, "model", None)):
        if all(hasattr(candidate, name) for name in ("total_stride", "fixed_input_size", "img_size", "in_chans")):
            return candidate
    raise ValueError(
        f"vil.export takes a ViL model (MsViT, a vil.detection backbone, or timm's features_only model of one with "
        f"feature_cls 'getter', the default, which keeps the model), got {type(model).__name__}."
    )


def _sides_taken(model):
    step = _size_step(model)
    return "size" if step == 1 else f"multiple of {step}"


def export_program(model, height, width, standard_operators=False, dynamic_size=True):
    """``torch.export`` of ``model`` in evaluation mode, traced at ``height x width``, for any batch and any
    height and width from twice the model's total stride that are multiples of it, or of any size for a model that
    pads its input (``dynamic_img_pad``); a trace size at which torch would narrow that is refused
    (:func:`_check_any_size`). Without ``dynamic_size``, for ``height x width`` images only (what a model whose
    attention needs one map size, SW_EXACT -1, exports at with ``standard_operators``).

    The program keeps the op layer's operators, which are Python custom operators: it runs, and so does an
    AOTInductor package of it, in a process that has imported ``vil``. With ``standard_operators`` it records their
    decomposition into standard operators instead, as an ONNX file does (and takes the sizes an ONNX file takes),
    so that it runs without ``vil``, e.g. as an AOTInductor package loaded from C++."""
    with recording_for_onnx() if standard_operators else contextlib.nullcontext():
        return _traced(model, height, width, dynamic_size)[1]


def onnx_model(model, height, width, dynamic_size=True) -> bytes:
    """``model`` as the bytes of an ONNX file that takes any batch and any height and width from twice the total
    stride that are multiples of it (a padding model's too), or without ``dynamic_size`` only ``height x width``
    images (what a model whose attention needs one map size, SW_EXACT -1, exports at). A trace size at which torch
    would narrow the sizes the file takes is refused (:func:`_check_any_size`)."""
    try:
        import onnx  # noqa: F401  (torch.onnx's exporter needs onnx and onnxscript)
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise ValueError(
            f"ONNX export needs the onnx and onnxscript packages ({error}); install them with pip install 'vil[onnx]'."
        ) from None
    # Traced by torch.export with the op layer recording standard operators, then translated.
    with recording_for_onnx():
        example, program = _traced(model, height, width, dynamic_size)
    onnx_program = torch.onnx.export(
        program, (example,), dynamo=True, input_names=["images"], output_names=_output_names(program)
    )
    proto = onnx_program.model_proto
    described = _vil_of(model)
    if described.fixed_input_size or not dynamic_size:
        taken = {SIZES_TAKEN["fixed"]: f"{height}x{width}"}
    else:
        taken = {
            SIZES_TAKEN["step"]: str(described.total_stride),
            SIZES_TAKEN["least"]: str(_least_side(described)),
        }
    for key, value in taken.items():
        proto.metadata_props.add(key=key, value=value)
    return proto.SerializeToString()


# The image sizes an ONNX file of this project takes, as it records them (metadata_props): one size, or the
# multiples of a step from a least side up.
SIZES_TAKEN = {"fixed": "vil.image_size", "step": "vil.image_side_step", "least": "vil.image_side_least"}


def _output_names(program):
    """The names of the file's outputs: ``logits`` for a classifier's one tensor, a backbone's map names (its
    dict's keys, prefixed ``map``), ``map0``, ``map1``, ... for a list of maps (timm's ``features_only``)."""
    spec = program.call_spec.out_spec
    if spec.num_children == 0:  # the one tensor itself
        return ["logits"]
    if isinstance(spec.context, list) and all(isinstance(key, str) for key in spec.context):
        return [f"map{key}" for key in spec.context]
    return [f"map{i}" for i in range(spec.num_leaves)]


def export_onnx(model, path, height, width, dynamic_size=True):
    """Write :func:`onnx_model` to ``path`` (atomically); returns the path."""
    data = onnx_model(model, height, width, dynamic_size)
    atomic_write(path, lambda f: f.write(data))
    return path


def onnx_outputs(onnx_file, images):
    """What onnxruntime computes for ``images`` (N, C, H, W) from an ONNX file (its path, or its bytes): a
    classifier's logits, or a backbone's maps as a list in the file's order (``map0``, ``map1``, ...). Images of
    another floating dtype are computed in float32, the file's; an empty batch gives empty outputs."""
    try:
        import onnxruntime
    except ImportError as error:
        raise ValueError(
            f"Running an ONNX file needs onnxruntime ({error}); install it with pip install 'vil[onnx]'."
        ) from None
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # a failure is raised with its message; not logged to stderr besides
    source = onnx_file if isinstance(onnx_file, bytes) else str(onnx_file)
    session = onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    (taken,) = session.get_inputs()
    channels = taken.shape[1]
    if images.dim() != 4 or (isinstance(channels, int) and images.shape[1] != channels):
        raise ValueError(f"This ONNX file takes images of shape (N, {channels}, H, W), got {tuple(images.shape)}.")
    if not images.is_floating_point():
        raise ValueError(f"This ONNX file takes floating-point images (float32), got {images.dtype}.")
    _check_sizes_taken(session.get_modelmeta().custom_metadata_map, tuple(images.shape[-2:]))
    batch = images.detach().float().cpu()
    run = batch if len(batch) else torch.zeros(1, *batch.shape[1:])  # onnxruntime's reshapes refuse a batch of 0
    outputs = [torch.from_numpy(out)[: len(batch)] for out in session.run(None, {taken.name: run.numpy()})]
    return outputs[0] if len(outputs) == 1 else outputs


def _check_sizes_taken(recorded, size):
    """Refuse, in one sentence, images of a ``size`` (H, W) that the file's recorded sizes (:data:`SIZES_TAKEN`) do not
    include; a file without the record is run as it is."""
    height, width = size
    if SIZES_TAKEN["fixed"] in recorded and recorded[SIZES_TAKEN["fixed"]] != f"{height}x{width}":
        raise ValueError(f"This ONNX file takes {recorded[SIZES_TAKEN['fixed']]} images only, not {height}x{width}.")
    if SIZES_TAKEN["step"] in recorded:
        step, least = int(recorded[SIZES_TAKEN["step"]]), int(recorded[SIZES_TAKEN["least"]])
        if height % step or width % step or min(height, width) < least:
            raise ValueError(
                f"This ONNX file takes images whose sides are multiples of {step} from {least} up, not "
                f"{height}x{width}; resize or pad them to such a size."
            )
