"""What a local attention call computes: the neighbourhood of every query, validated once where the public
function is called and handed to the backends as one frozen value.

A 2D neighbourhood is ViL's window on a map (:class:`Neighborhood2d`); a 1D neighbourhood is Longformer's band
over a sequence (:class:`Neighborhood1d`). Both say nothing about how a backend computes them.
"""

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, Union

import torch


def _is_int(value) -> bool:
    """An int, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_ints(hood) -> None:
    """Integers of other types (numpy's, say) in ``hood``'s fields, and in a tuple of dilations, made Python ints:
    the same values, so that they are taken, compared and hashed as ints are."""

    def plain(value):
        integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return int(value) if integral else value

    for field in fields(hood):
        value = getattr(hood, field.name)
        object.__setattr__(hood, field.name, tuple(map(plain, value)) if isinstance(value, tuple) else plain(value))


@dataclass(frozen=True)
class Neighborhood2d:
    """ViL's window on an ``X x Y`` map.

    ``window``: chunk size ``w`` (SW_EXACT 0 / -1) or radius (SW_EXACT 1). ``exact``: 0 = the 3x3 chunks around
    the query's chunk, zero padded; -1 = the same, wrapping around; 1 = the exact ``(2w+1)^2`` window.
    ``mode``: 0 all 9 chunks, -1 the own chunk, 1..8 the own chunk and one neighbour (chunked windows only).
    ``dilation``: exact window only, keys at ``(qi + d*a, qj + d*b)``.
    """

    window: int
    exact: int = 0
    mode: int = 0
    dilation: int = 1
    dims: ClassVar[int] = 2

    def __post_init__(self) -> None:
        _plain_ints(self)
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be a positive integer, got {self.window!r}.")
        if not _is_int(self.exact) or self.exact not in (1, 0, -1):
            raise ValueError(f"exact (SW_EXACT) must be 1, 0 or -1, got {self.exact!r}.")
        if not _is_int(self.mode) or not -1 <= self.mode <= 8:
            raise ValueError(f"mode (MODE) must be 0, -1 or one of 1..8, got {self.mode!r}.")
        if self.exact == 1 and self.mode != 0:
            raise ValueError(
                f"mode (MODE) {self.mode} needs chunked windows (SW_EXACT 0 or -1); the exact window "
                "(SW_EXACT 1) takes mode 0 only."
            )
        if not _is_int(self.dilation) or self.dilation < 1:
            raise ValueError(f"dilation must be a positive integer, got {self.dilation!r}.")
        if self.dilation > 1 and self.exact != 1:
            raise ValueError(
                f"dilation {self.dilation} needs the exact window (SW_EXACT 1); chunked windows take dilation 1."
            )

    @property
    def chunked(self) -> bool:
        """ViL's chunked windows (SW_EXACT 0 or -1), as opposed to the exact window."""
        return self.exact != 1

    @property
    def cyclic(self) -> bool:
        """Chunked windows that wrap around the map (SW_EXACT -1)."""
        return self.exact == -1

    @property
    def dilated(self) -> bool:
        return self.dilation > 1

    def with_dilation(self, dilation: int) -> "Neighborhood2d":
        return Neighborhood2d(self.window, self.exact, self.mode, dilation)

    def fitted(self, rows: int, cols: int) -> "Neighborhood2d":
        """The same neighbourhood on a ``rows x cols`` map with no larger window or dilation than the map can
        use: every query keeps exactly its keys, since a chunk as large as the map holds all of it and a larger
        radius or dilation only reaches outside the map. Each (query, key) pair also keeps its relative position
        (in one chunk, under wrap-around too, the offset is the positions' own), so a bias table follows by
        :meth:`bias_of_window`. An exact window is fitted to the map's side too (in steps of the dilation), not to
        the side less one that already reaches every key: the backends that lay a map out in chunks of the window
        then take one chunk, not four (sliding_chunk 10x faster on a 14 x 14 map)."""
        reach = max(rows, cols, 1)
        if self.chunked:
            return Neighborhood2d(min(self.window, reach), self.exact, self.mode)
        dilation = min(self.dilation, reach)
        return Neighborhood2d(min(self.window, -(-reach // dilation)), self.exact, self.mode, dilation)

    @property
    def bias_rows(self) -> int:
        """Rows of the relative position bias table: ``(4w-1)^2``."""
        return (4 * self.window - 1) ** 2

    def bias_of_window(self, table: torch.Tensor, window: int) -> torch.Tensor:
        """This window's ``(heads, (4w-1)^2)`` table cut to a smaller ``window``'s: the rows of its offsets, each
        axis's ``-(2window-1)..2window-1`` of ``-(2w-1)..2w-1``."""
        side, first = 4 * window - 1, 2 * (self.window - window)
        grid = table.unflatten(1, (4 * self.window - 1, 4 * self.window - 1))
        return grid[:, first : first + side, first : first + side].flatten(1)


@dataclass(frozen=True)
class Neighborhood1d:
    """Longformer's band over a sequence: query ``i`` sees keys ``i + d*a`` for ``-w <= a <= w`` (``a <= 0`` when
    ``causal``) that lie in the sequence. ``dilation`` is one int, or a tuple of one int per head."""

    window: int
    dilation: Union[int, tuple[int, ...]] = 1
    causal: bool = False
    dims: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _plain_ints(self)
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(
                f"window must be a positive integer (keys on each side of the query), got {self.window!r}."
            )
        values = self.dilation if isinstance(self.dilation, tuple) else (self.dilation,)
        if not values or any(not _is_int(d) or d < 1 for d in values):
            raise ValueError(
                f"dilation must be a positive integer or one positive integer per head, got {self.dilation!r}."
            )
        if isinstance(self.dilation, tuple) and len(set(self.dilation)) == 1:
            object.__setattr__(self, "dilation", self.dilation[0])  # one value for every head
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}.")

    @classmethod
    def of_heads(
        cls, window: int, dilation: Union[int, Sequence[int], torch.Tensor], causal: bool, heads: int
    ) -> "Neighborhood1d":
        """The band of ``heads`` heads whose ``dilation`` is one int or one per head, given as any sequence, numpy
        array or tensor of values."""
        if hasattr(dilation, "tolist"):  # a tensor, a numpy array or a numpy int, as Python values
            if len(dilation.shape) > 1:
                raise ValueError(
                    f"dilation must be one int or one int per head ({heads}), got an array of shape "
                    f"{tuple(dilation.shape)}; give it flat, of shape ({heads},)."
                )
            dilation = dilation.tolist()
        if isinstance(dilation, Sequence) and not isinstance(dilation, str):
            if len(dilation) != heads:
                raise ValueError(f"dilation must be one int or one int per head ({heads}), got {len(dilation)} values.")
            dilation = tuple(dilation)
        return cls(window, dilation, causal)

    @property
    def per_head(self) -> bool:
        """Whether the heads have different dilations."""
        return isinstance(self.dilation, tuple)

    @property
    def dilated(self) -> bool:
        return max(self.dilation if self.per_head else (self.dilation,)) > 1

    def dilations(self, heads: int) -> tuple[int, ...]:
        """One dilation per head."""
        return self.dilation if self.per_head else (self.dilation,) * heads

    def with_dilation(self, dilation: Union[int, tuple[int, ...]]) -> "Neighborhood1d":
        return Neighborhood1d(self.window, dilation, self.causal)

    def fitted(self, length: int) -> "Neighborhood1d":
        """The same band over ``length`` positions with no larger window than it can use, fitted to the length in
        steps of the smallest dilation (see :meth:`Neighborhood2d.fitted`); the dilations are kept, as they are per
        head."""
        smallest = min(self.dilation if self.per_head else (self.dilation,))
        return Neighborhood1d(min(self.window, -(-max(length, 1) // smallest)), self.dilation, self.causal)

    @property
    def offsets(self) -> range:
        """The window offsets ``a`` (in steps of the dilation) a query may see: ``-w..w``, or ``-w..0`` causal."""
        return range(-self.window, 1 if self.causal else self.window + 1)

    @property
    def bias_rows(self) -> int:
        """Rows of the relative position bias table: ``2w + 1``, row ``a + w`` for offset ``a``."""
        return 2 * self.window + 1

    def bias_of_window(self, table: torch.Tensor, window: int) -> torch.Tensor:
        """This window's ``(heads, 2w+1)`` table cut to a smaller ``window``'s: the rows of offsets
        ``-window..window``."""
        return table[:, self.window - window : self.window + window + 1]
