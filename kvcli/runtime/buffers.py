"""Layer buffers with room: which views a kernel may widen past their last row.

A cache layout appends to a layer in place (:func:`kvcli.caches.base.append_rows`): the layer is a
view of the first rows of a (1, heads, cap, d) buffer. A buffer made with :func:`made_finite` has
its room zeroed and is only ever written with entries, so a kernel may read rows past the view and
weigh them by exactly zero (:func:`kvcli.runtime.kernels.grouped` keeps its shapes that way). The
registry is here, below the caches that fill it and the kernels that read it.
"""

from __future__ import annotations

import weakref

import torch

# the storages of the buffers made by :func:`made_finite`: their room holds finite entries only
_FINITE: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()


def has_room(t: torch.Tensor, rows: int) -> bool:
    """Whether ``t`` (1, heads, m, d), a view of the first m rows of a (1, heads, cap, d) buffer,
    can be widened to ``rows`` rows inside its storage."""
    d = t.shape[-1]
    stride = t.stride()
    if t.dim() != 4 or stride[-1] != 1 or stride[-2] != d or stride[-3] < rows * d or t.storage_offset() != 0:
        return False
    needed = ((t.shape[0] - 1) * stride[0] + (t.shape[1] - 1) * stride[1] + rows * d) * t.element_size()
    return t.untyped_storage().nbytes() >= needed


def widened(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` (…, m, d), a view of the first m rows of a buffer, as the view of its first ``rows``
    rows (where :func:`has_room` says the buffer holds them)."""
    return t.as_strided((*t.shape[:-2], rows, t.shape[-1]), t.stride())


def finite_room(t: torch.Tensor, rows: int) -> bool:
    """Whether ``t`` can be widened to ``rows`` rows (:func:`has_room`) over entries that are all
    finite: ``t`` is a view of a buffer made by :func:`made_finite`, whose room was zero when made
    and is only ever written with entries."""
    return t.untyped_storage() in _FINITE and has_room(t, rows)


def made_finite(buf: torch.Tensor, filled: int) -> torch.Tensor:
    """A new layer buffer (…, cap, d) whose first ``filled`` rows are written: its room zeroed and
    its storage marked for :func:`finite_room`."""
    buf[..., filled:, :].zero_()
    _FINITE.add(buf.untyped_storage())
    return buf
