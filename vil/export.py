"""The classification model for deployment: ``torch.export`` with dynamic batch, height and width, and ONNX (with
dynamic height and width, or at one image size).

Local attention is one operator per call (``vil/ops/operators.py``); the exported program keeps it, so it runs
with the backend it was built with. ONNX has no such operator: during an ONNX export the op layer records its
decomposition into standard operators instead (the unfold_nnf computation of the same function).
"""

import torch

from .files import atomic_write
from .ops.base import recording_for_onnx


def _example_and_dims(model, height, width, batch=2, dynamic_size=True):
    """An input of ``batch x C x height x width`` and the dynamic shapes of any batch and any height and width
    that are multiples of the model's total stride from twice the stride (of any batch only, for a model of fixed
    input size or without ``dynamic_size``)."""
    example = torch.randn(batch, model.in_chans, height, width)
    any_batch = {0: torch.export.Dim("batch", min=1, max=1024)}
    if model.fixed_input_size and (height, width) != tuple(model.img_size):
        raise ValueError(
            f"This model takes only {model.img_size[0]}x{model.img_size[1]} images (linformer "
            f"attention is built for one token count); export it at that size, not {height}x{width}."
        )
    if model.fixed_input_size or not dynamic_size:
        return example, (any_batch,)
    stride = model.total_stride
    if height % stride or width % stride or min(height, width) < 2 * stride:
        raise ValueError(
            f"Export at an image size that is a multiple of the model's total stride {stride} and at least "
            f"{2 * stride} on each side, got {height}x{width}."
        )
    # At least two positions per side of the last map: torch specialises a size of 1 (broadcasting).
    rows, cols = (
        torch.export.Dim("rows", min=2, max=4096 // stride),
        torch.export.Dim("cols", min=2, max=4096 // stride),
    )
    return example, ({**any_batch, 2: stride * rows, 3: stride * cols},)


def export_program(model, height, width):
    """``torch.export`` of ``model`` in evaluation mode, traced at ``height x width``, for any batch and any
    height and width that are multiples of the model's total stride from twice the stride."""
    example, dims = _example_and_dims(model, height, width)
    with torch.no_grad():
        return torch.export.export(model.eval(), (example,), dynamic_shapes=dims)


def export_onnx(model, path, height, width, dynamic_size=True):
    """Write ``model`` as an ONNX file at ``path`` (atomically) that takes any batch and any image size that is a
    multiple of the total stride, or without ``dynamic_size`` only ``height x width`` images (what a model whose
    attention needs one map size, SW_EXACT -1, exports at); returns the path."""
    try:
        import onnx  # noqa: F401  (torch.onnx's exporter needs onnx and onnxscript)
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise ValueError(
            f"ONNX export needs the onnx and onnxscript packages ({error}); install them with pip install -e .[onnx]."
        ) from None
    example, dims = _example_and_dims(model, height, width, dynamic_size=dynamic_size)
    # Traced by torch.export (not strict: what the model refuses is raised as it is) with the op layer recording
    # standard operators, then translated.
    with torch.no_grad(), recording_for_onnx():
        program = torch.export.export(model.eval(), (example,), dynamic_shapes=dims, strict=False)
    onnx_program = torch.onnx.export(program, (example,), dynamo=True, input_names=["images"], output_names=["logits"])
    atomic_write(path, lambda f: f.write(onnx_program.model_proto.SerializeToString()))
    return path


def onnx_outputs(path, images):
    """The logits onnxruntime computes from the ONNX file at ``path`` for ``images``."""
    try:
        import onnxruntime
    except ImportError as error:
        raise ValueError(
            f"Running an ONNX file needs onnxruntime ({error}); install it with pip install -e .[onnx]."
        ) from None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: images.numpy()})[0])
