"""Pictures of the clipped relative position matrix (needs the ``plot`` extra: matplotlib).

The matrix drawn is ``clip(j - p_i, -K, K)`` for query ``i`` (rows, top to bottom) and key
``j`` (columns, left to right), the same numbers as
:func:`relpos.positions.relative_position_index` minus ``K``. Keys before the query give
negative offsets (blue, bottom-left), keys after it positive ones (red, top-right); the
saturated corners are the pairs farther than ``K`` apart, which share the row ``-K`` or
``+K`` of the embedding table.

Install with ``pip install 'relpos[plot]'``. Nothing here touches :mod:`matplotlib.pyplot`
or a display: figures are plain :class:`matplotlib.figure.Figure` objects drawn with Agg.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relpos._io import atomic_write
from relpos.positions import check_window, relative_position_index

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "ANNOTATE_MAX_LENGTH",
    "IMAGE_FORMATS",
    "MISSING_MATPLOTLIB",
    "clipped_offsets",
    "plot_relative_positions",
    "save_figure",
]

#: Cells are annotated with their offset only when the matrix has at most this many rows
#: and columns; beyond that the numbers are too small to read.
ANNOTATE_MAX_LENGTH = 32

#: Output formats understood by :func:`save_figure`, keyed by file suffix.
IMAGE_FORMATS: dict[str, str] = {".png": "png", ".svg": "svg", ".pdf": "pdf"}

#: The message of the :class:`ImportError` raised when matplotlib is not installed.
MISSING_MATPLOTLIB = "drawing needs matplotlib: pip install 'relpos[plot]'"

# Colour of the cells a causal mask hides (matplotlib's "lightgray").
_MASKED_COLOR = "#d3d3d3"


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(MISSING_MATPLOTLIB) from err


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def clipped_offsets(
    length: int,
    max_distance: int | tuple[int, int],
    *,
    queries: int | None = None,
    query_start: int | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The clipped offset matrix ``clip(j - p_i, -K, K)`` and its causal mask.

    Args:
        length: S, the number of keys (positions ``0..S-1``).
        max_distance: K, the clip distance (>= 0), or a window ``(left, right)``.
        queries: L, the number of queries; default ``S`` (self-attention).
        query_start: position of query 0; default ``S - L`` (queries aligned to the end of
            the keys, as everywhere in relpos).
        causal: also return ``True`` where key ``j`` is hidden from query ``i`` (``j > p_i``).

    Returns:
        ``(offsets, hidden, start)``: a ``torch.long`` tensor of shape ``(L, S)`` with
        values in ``[-K, K]``, a ``torch.bool`` tensor of shape ``(L, S)`` (all ``False``
        unless ``causal``) and the resolved position of query 0.

    Raises:
        ValueError: if a size is not a positive int or a query lies outside the keys.
        TypeError: if ``max_distance`` is not an int.

    Example:
        >>> offsets, hidden, start = clipped_offsets(3, 1)
        >>> offsets.tolist()
        [[0, 1, 1], [-1, 0, 1], [-1, -1, 0]]
    """
    key_len = _check_positive_int(length, "length")
    left, right = check_window(max_distance)
    query_len = key_len if queries is None else _check_positive_int(queries, "queries")
    if query_len > key_len:
        raise ValueError(
            f"queries must be at most length (each query is one of the key positions), "
            f"got queries={query_len}, length={key_len}"
        )
    index = relative_position_index(query_len, key_len, (left, right),
                                    query_start=query_start)  # (L, S)
    offsets = index - left  # (L, S)
    start = key_len - query_len if query_start is None else int(query_start)
    positions_q = torch.arange(start, start + query_len)  # (L,)
    positions_k = torch.arange(key_len)  # (S,)
    hidden = positions_k[None, :] > positions_q[:, None]  # (L, S)
    if not causal:
        hidden = torch.zeros_like(hidden)
    return offsets, hidden, start


def _format_offset(value: int) -> str:
    return "0" if value == 0 else f"{value:+d}"


def plot_relative_positions(
    length: int,
    max_distance: int | tuple[int, int],
    *,
    causal: bool = False,
    query_start: int | None = None,
    queries: int | None = None,
    annotate: bool | None = None,
    cmap: str = "RdBu_r",
    ax: Axes | None = None,
) -> Figure:
    """Draw the clipped relative position matrix as an annotated heatmap.

    Rows are queries (position ``p_i`` on the y axis, first query at the top), columns are
    keys ``j``; cell ``(i, j)`` shows ``clip(j - p_i, -K, K)``. The diverging colormap runs
    from darkest blue at ``-K`` ("far backward", bottom-left) through white at 0 to darkest
    red at ``+K`` ("far forward", top-right). In data coordinates the centre of cell
    ``(i, j)`` is ``(j, p_i)``.

    Args:
        length: S, the number of keys.
        max_distance: K, the clip distance (>= 0), or a window ``(left, right)``.
        causal: blank out (light gray, no number) the cells with ``j > p_i``.
        query_start: position of query 0; default ``S - L``.
        queries: L, the number of queries; default ``S``.
        annotate: write the offset in each cell; default: only when ``L`` and ``S`` are at
            most :data:`ANNOTATE_MAX_LENGTH`.
        cmap: name of a diverging matplotlib colormap.
        ax: axes to draw into; by default a new figure (not registered with pyplot) is made.

    Returns:
        The figure holding the heatmap (``ax.figure`` when ``ax`` is given). The axes is
        ``fig.axes[0]`` and its image ``fig.axes[0].images[0]``.

    Raises:
        ImportError: if matplotlib is not installed.
        ValueError: if a size is not a positive int or a query lies outside the keys.
        TypeError: if ``max_distance`` is not an int.

    Example:
        >>> fig = plot_relative_positions(10, 4)
        >>> fig.axes[0].images[0].get_array().shape
        (10, 10)
    """
    offsets_t, hidden_t, start = clipped_offsets(
        length, max_distance, queries=queries, query_start=query_start, causal=causal
    )
    left, right = check_window(max_distance)
    query_len, key_len = offsets_t.shape
    _require_matplotlib()
    import matplotlib as mpl
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if ax is None:
        # Cells of 0.55 in hold two digits; big matrices shrink to fit about 9.5 in.
        cell_in = min(0.55, 9.5 / max(query_len, key_len))
        width = max(key_len * cell_in + 2.2, 5.0)
        height = max(query_len * cell_in + 1.4, 3.0)
        fig = Figure(figsize=(width, height), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
    else:
        fig = ax.figure.figure  # the root Figure, also when ax lives in a SubFigure

    colormap = mpl.colormaps[cmap].with_extremes(bad=_MASKED_COLOR)
    # Offset 0 at the white centre of the map (a window may be lopsided, K = 0 a single value).
    reach = max(left, right, 1)
    norm = Normalize(vmin=-reach, vmax=reach)
    offsets = np.array(offsets_t.tolist(), dtype=np.int64).reshape(query_len, key_len)
    hidden = np.array(hidden_t.tolist(), dtype=bool).reshape(query_len, key_len)
    data = np.ma.masked_array(offsets, mask=hidden)  # (L, S)
    image = ax.imshow(
        data,
        cmap=colormap,
        norm=norm,
        interpolation="nearest",
        aspect="equal",
        # Cell (i, j) is centred on (j, p_i): axes read in positions, not indices.
        extent=(-0.5, key_len - 0.5, start + query_len - 0.5, start - 0.5),
    )

    if annotate is None:
        annotate = max(query_len, key_len) <= ANNOTATE_MAX_LENGTH
    if annotate:
        # Font size follows the cell size so two characters always fit.
        cell_pt = 72.0 * ax.get_window_extent().width / fig.dpi / key_len
        fontsize = float(np.clip(0.38 * cell_pt, 5.0, 12.0))
        rgba = image.to_rgba(data)  # (L, S, 4)
        for i in range(query_len):
            for j in range(key_len):
                if hidden[i, j]:
                    continue
                red, green, blue = rgba[i, j, :3]
                luminance = 0.2126 * red + 0.7152 * green + 0.0722 * blue
                ax.text(
                    j,
                    start + i,
                    _format_offset(int(offsets[i, j])),
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color="white" if luminance < 0.45 else "black",
                )

    if key_len <= ANNOTATE_MAX_LENGTH:
        ax.set_xticks(range(key_len))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if query_len <= ANNOTATE_MAX_LENGTH:
        ax.set_yticks(range(start, start + query_len))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("Key position j")
    ax.set_ylabel("Query position i")
    colorbar = ax.figure.colorbar(image, ax=ax, shrink=0.85)
    colorbar.set_label(f"clipped offset clip(j - i, {-left}, {right})")
    if left == right == 0:
        colorbar.set_ticks([0])
    else:
        colorbar.locator = MaxNLocator(integer=True, nbins=min(left + right + 1, 9))
        colorbar.update_ticks()

    bound = f"k = {left}" if left == right else f"window [-{left}, +{right}]"
    title = f"Clipped relative positions ({bound}, {key_len} keys"
    if query_len != key_len:
        title += f", queries at {start}..{start + query_len - 1}"
    title += ", causal)" if causal else ")"
    ax.set_title(title)
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: float = 150.0) -> Path:
    """Save ``fig`` atomically; the format follows the suffix (.png, .svg or .pdf).

    The image is written to a temporary file in the same directory, flushed to disk and
    then renamed over ``path``, so a reader never sees a half-written file.

    Args:
        fig: the figure to save.
        path: where to write it.
        dpi: resolution of raster output (and of raster parts of vector output).

    Returns:
        The path written.

    Raises:
        ValueError: if the suffix is not one of :data:`IMAGE_FORMATS` or ``dpi`` is not
            positive.
        FileNotFoundError: if the directory does not exist.
    """
    target = Path(path)
    fmt = IMAGE_FORMATS.get(target.suffix.lower())
    if fmt is None:
        allowed = ", ".join(IMAGE_FORMATS)
        raise ValueError(
            f"cannot tell the image format of {str(target)!r} from its suffix "
            f"{target.suffix!r}; allowed: {allowed}"
        )
    if not dpi > 0:
        raise ValueError(f"dpi must be > 0, got {dpi!r}")
    directory = target.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"output directory {str(directory)!r} does not exist")
    return atomic_write(
        target, lambda handle: fig.savefig(handle, format=fmt, dpi=dpi, metadata=_metadata(fmt))
    )


def _metadata(fmt: str) -> dict[str, Any]:
    # Without a fixed date, svg/pdf bytes change on every run.
    if fmt == "svg":
        return {"Date": None}
    if fmt == "pdf":
        return {"CreationDate": None}
    return {}
