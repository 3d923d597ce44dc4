"""Attention heatmaps in the style of Bahdanau et al.'s alignment figures.

Figures are drawn with ``matplotlib.figure.Figure`` on an Agg canvas directly, so
nothing here touches pyplot or the global matplotlib backend.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from nmt.files import atomic_write_bytes

_CELL_INCHES = 0.28  # side of one attention cell when there is room for it
_MARGIN_INCHES = 1.6  # room for the tick labels
_MIN_INCHES, _MAX_INCHES = 3.0, 16.0
_MIN_FONT, _MAX_FONT = 4.0, 10.0
_DPI = 100


def _check_shape(src_tokens: Sequence[str], trg_tokens: Sequence[str], weights: np.ndarray) -> None:
    if weights.ndim != 2 or weights.shape != (len(trg_tokens), len(src_tokens)):
        raise ValueError(
            f"attention weights have shape {weights.shape}, expected "
            f"(len(trg_tokens), len(src_tokens)) = ({len(trg_tokens)}, {len(src_tokens)})"
        )
    if weights.size == 0:
        raise ValueError(f"attention weights of shape {weights.shape} are empty")


def _layout(n_src: int, n_trg: int) -> tuple[float, float, float]:
    """Figure width and height in inches and label font size for an (n_trg, n_src) matrix.

    Cells stay square and shrink only when the figure would outgrow 16 inches; the
    font fits one label per cell, between 4 and 10 points.
    """
    room = _MAX_INCHES - _MARGIN_INCHES
    cell = min(_CELL_INCHES, room / n_src, room / n_trg)
    width = max(_MIN_INCHES, _MARGIN_INCHES + cell * n_src)
    height = max(_MIN_INCHES, _MARGIN_INCHES + cell * n_trg)
    font = float(np.clip(cell * 72 * 0.6, _MIN_FONT, _MAX_FONT))
    return width, height, font


def _escape(token: str) -> str:
    """Keep ``$`` in a token from switching matplotlib into math mode."""
    return token.replace("$", r"\$")


# A reference link's cell: a red square for a sure link, a smaller orange one for a possible.
_STYLES = {True: ("#e8202a", 1.4, 0.92), False: ("#f59a23", 1.0, 0.6)}  # colour, line, size


def _overlay(ax: object, cells: Sequence[tuple[int, int, bool]]) -> None:
    """Outline the (row, column) cells of reference links on the heatmap."""
    from matplotlib.patches import Rectangle

    for row, column, sure in cells:
        colour, width, size = _STYLES[sure]
        corner = (column - size / 2, row - size / 2)
        patch = Rectangle(corner, size, size, fill=False, edgecolor=colour, linewidth=width)
        ax.add_patch(patch)  # type: ignore[attr-defined]


def attention_figure(
    src_tokens: Sequence[str],
    trg_tokens: Sequence[str],
    weights: np.ndarray,
    links: Sequence[tuple[int, int, bool]] = (),
) -> Figure:
    """Draw the heatmap: source on the x axis (top), target on the y axis, white = 1;
    ``links`` (row, column, sure) outline reference links: red sure, orange possible.

    Raises:
        ValueError: ``weights`` is not (len(trg_tokens), len(src_tokens)), or a link lies
            outside it.
    """
    weights = np.asarray(weights, dtype=np.float32)
    _check_shape(src_tokens, trg_tokens, weights)
    n_trg, n_src = weights.shape
    width, height, font = _layout(n_src, n_trg)
    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(weights, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="equal")
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xticks(range(n_src), [_escape(t) for t in src_tokens], rotation=90, fontsize=font)
    ax.set_yticks(range(n_trg), [_escape(t) for t in trg_tokens], fontsize=font)
    ax.tick_params(length=0)
    for row, column, _ in links:
        if not (0 <= row < n_trg and 0 <= column < n_src):
            raise ValueError(f"link cell ({row}, {column}) lies outside {weights.shape}")
    _overlay(ax, links)
    ax.set_xlabel("source", fontsize=font + 1)
    ax.set_ylabel("target", fontsize=font + 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        fig.tight_layout()
    return fig


def attention_figure_array(
    src_tokens: Sequence[str],
    trg_tokens: Sequence[str],
    weights: np.ndarray,
    links: Sequence[tuple[int, int, bool]] = (),
) -> np.ndarray:
    """Render the heatmap of ``save_attention`` (``links`` outlined) to an RGB array
    (H, W, 3) of uint8.

    Raises:
        ValueError: ``weights`` is not (len(trg_tokens), len(src_tokens)), or a link lies
            outside it.
    """
    fig = attention_figure(src_tokens, trg_tokens, weights, links)
    canvas = fig.canvas
    assert isinstance(canvas, FigureCanvasAgg)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    return np.ascontiguousarray(rgba[..., :3], dtype=np.uint8)


def save_attention(
    path_stem: Path,
    src_tokens: Sequence[str],
    trg_tokens: Sequence[str],
    weights: np.ndarray,
    links: Sequence[tuple[int, int, bool]] = (),
) -> list[Path]:
    """Save an attention matrix as a heatmap PNG, a float32 .npy and a JSON file.

    Args:
        path_stem: Output path without suffix; ``.png``, ``.npy`` and ``.json`` are
            appended to its name. Missing parent folders are created.
        src_tokens: Source pieces, one per column of ``weights``.
        trg_tokens: Target pieces, one per row of ``weights``.
        weights: Attention weights of shape (len(trg_tokens), len(src_tokens)).
        links: Reference links to outline, as (row, column, sure) cells; the JSON file
            lists them under ``reference_links``.

    Returns:
        The paths written: the PNG, the .npy and the JSON file.

    Raises:
        ValueError: ``weights`` is not (len(trg_tokens), len(src_tokens)).
    """
    path_stem = Path(path_stem)
    matrix = np.asarray(weights, dtype=np.float32)
    _check_shape(src_tokens, trg_tokens, matrix)
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    png, npy, js = (path_stem.with_name(path_stem.name + s) for s in (".png", ".npy", ".json"))

    fig = attention_figure(src_tokens, trg_tokens, matrix, links)

    def write_png(handle: IO[bytes]) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Glyph .* missing from")
            fig.savefig(handle, format="png", dpi=_DPI)

    document = {
        "source": list(src_tokens),
        "target": list(trg_tokens),
        "weights": np.round(matrix.astype(np.float64), 6).tolist(),
    }
    if links:
        document["reference_links"] = [
            {"target": row, "source": column, "sure": sure} for row, column, sure in links
        ]
    text = json.dumps(document, ensure_ascii=False).encode("utf-8")
    atomic_write_bytes(png, write_png)
    atomic_write_bytes(npy, lambda handle: np.save(handle, matrix))
    atomic_write_bytes(js, lambda handle: handle.write(text))
    return [png, npy, js]
