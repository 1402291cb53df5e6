"""Position tables at another feature-map size.

The model calls these at forward time for inputs of a size other than the one it was built for, and the
checkpoint converters (:mod:`vil.models.convert`) call them on state dicts, so both give the same numbers.
"""

import torch
import torch.nn.functional as F


def _same(sizes, new_sizes):
    """Whether the new sizes are the old ones. Symbolic sizes (torch.export with dynamic shapes) count as
    different, so that the export does not specialise on them: interpolating to the same size returns the same
    values (linear and bicubic interpolation sample at the grid points themselves)."""
    return all(isinstance(n, int) for n in new_sizes) and tuple(sizes) == tuple(new_sizes)


def resize_position_embedding(table, length):
    """An absolute position embedding of one axis, ``(1, n, c)``, at ``length`` positions: linear
    interpolation (the table itself when ``length == n``)."""
    if _same((table.shape[1],), (length,)):
        return table
    return F.interpolate(table.transpose(1, 2), size=length, mode="linear", align_corners=False).transpose(1, 2)


def resize_full_bias_table(table, old_map, new_map):
    """A full-attention relative-bias table, ``((2nx-1)(2ny-1), heads)`` for an ``nx x ny`` map, for a map of
    ``new_map``: bicubic interpolation over the grid of (row offset, column offset), centre kept on centre."""
    (nx, ny), (mx, my) = old_map, new_map
    if _same(old_map, new_map):
        return table
    heads = table.shape[1]
    grid = table.t().reshape(1, heads, 2 * nx - 1, 2 * ny - 1)
    grid = F.interpolate(grid, size=(2 * mx - 1, 2 * my - 1), mode="bicubic", align_corners=False)
    return grid.reshape(heads, -1).t()


def full_bias_to_local(table, old_map, window):
    """A full-attention relative-bias table of an ``nx x ny`` map as a longformer table of window ``w``,
    ``((4w-1)^2, heads)``: the same offsets keep their bias; offsets the full table has no row for take the
    nearest one it has."""
    nx, ny = old_map
    heads = table.shape[1]
    grid = table.reshape(2 * nx - 1, 2 * ny - 1, heads)
    offsets = torch.arange(-(2 * window - 1), 2 * window, device=table.device)
    rows = offsets.clamp(-(nx - 1), nx - 1) + nx - 1
    cols = offsets.clamp(-(ny - 1), ny - 1) + ny - 1
    return grid[rows][:, cols].reshape(-1, heads)


def full_bias(table, nx, ny):
    """``(heads, nx*ny, nx*ny)``: the bias of local query (qi, qj) and local key (ki, kj) of an ``nx x ny`` map,
    row ``(qi-ki + nx-1) * (2ny-1) + (qj-kj + ny-1)`` of ``table`` (which must be that map's table). Indexed by
    token directly (no 5-dimensional view), which torch.export can trace for map sizes of any expression."""
    positions = torch.arange(nx * ny, device=table.device)
    rows = positions // ny
    cols = positions - rows * ny  # not %: ONNX's exporter takes no remainder by a size it does not know
    index = (rows[:, None] - rows[None, :] + nx - 1) * (2 * ny - 1) + (cols[:, None] - cols[None, :] + ny - 1)
    return table.t()[:, index]
