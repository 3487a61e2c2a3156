"""Training-curve PNGs drawn with numpy only: no matplotlib, no Pillow.

The project's dependencies are flwr, torch, torchvision, ray, pyyaml and numpy, and a server run should still
leave a quick visual summary (loss and accuracy per round) next to its JSON logs. This module therefore
rasterises its own charts into an RGB ``uint8`` array, writes text with a built-in 5x7 bitmap font (plus one
descender row for g, j, p, q, y and the comma) and encodes the PNG itself (signature, IHDR, one IDAT compressed
with zlib, IEND; CRCs via ``zlib.crc32``).

Public entry points:

* :func:`plot_curves` -- one small panel per series (with axes, numeric ticks, a panel title and a legend),
  written to a PNG file;
* :func:`render_curves` -- the same image as an ``(H, W, 3)`` ``uint8`` array;
* :func:`encode_png` / :func:`write_png` -- the minimal PNG encoder.

Non-finite points (NaN, +-inf) are skipped, points are drawn in increasing x order, a series with no finite
point gets a "no data" panel, and constant or single-point series get a small symmetric range around the value.
This module does not import flwr.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Color = tuple[int, int, int]
Points = tuple[Sequence[float], Sequence[float]]
# A panel is either one (xs, ys) curve or several named curves sharing axes.
PanelData = Points | Mapping[str, Points]

WHITE: Color = (255, 255, 255)
TEXT: Color = (30, 30, 30)
AXIS: Color = (70, 70, 70)
GRID: Color = (228, 228, 228)
MUTED: Color = (140, 140, 140)
# Matplotlib's "tab10" colours: distinct and colour-blind friendly enough for a handful of curves.
PALETTE: tuple[Color, ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)

# --------------------------------------------------------------------------------------------------------------
# Bitmap font: 5 columns x 7 rows, plus an optional 8th (descender) row. '#' = ink.
# --------------------------------------------------------------------------------------------------------------

GLYPH_WIDTH = 5
GLYPH_HEIGHT = 8  # 7 rows above the baseline + 1 descender row
GLYPH_ADVANCE = GLYPH_WIDTH + 1  # one blank column between characters

_GLYPH_ROWS: dict[str, str] = {
    # digits
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    # upper case
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    # lower case (g, j, p, q, y use the descender row)
    "a": "..... ..... .###. ....# .#### #...# .####",
    "b": "#.... #.... #.##. ##..# #...# #...# ####.",
    "c": "..... ..... .###. #.... #.... #...# .###.",
    "d": "....# ....# .##.# #..## #...# #...# .####",
    "e": "..... ..... .###. #...# ##### #.... .###.",
    "f": "..##. .#..# .#... ###.. .#... .#... .#...",
    "g": "..... ..... .#### #...# #...# .#### ....# .###.",
    "h": "#.... #.... #.##. ##..# #...# #...# #...#",
    "i": "..#.. ..... .##.. ..#.. ..#.. ..#.. .###.",
    "j": "...#. ..... ..##. ...#. ...#. ...#. #..#. .##..",
    "k": "#.... #.... #..#. #.#.. ##... #.#.. #..#.",
    "l": ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "m": "..... ..... ##.#. #.#.# #.#.# #...# #...#",
    "n": "..... ..... #.##. ##..# #...# #...# #...#",
    "o": "..... ..... .###. #...# #...# #...# .###.",
    "p": "..... ..... ####. #...# #...# ####. #.... #....",
    "q": "..... ..... .#### #...# #...# .#### ....# ....#",
    "r": "..... ..... #.##. ##..# #.... #.... #....",
    "s": "..... ..... .###. #.... .###. ....# ####.",
    "t": ".#... .#... ###.. .#... .#... .#..# ..##.",
    "u": "..... ..... #...# #...# #...# #..## .##.#",
    "v": "..... ..... #...# #...# #...# .#.#. ..#..",
    "w": "..... ..... #...# #...# #.#.# #.#.# .#.#.",
    "x": "..... ..... #...# .#.#. ..#.. .#.#. #...#",
    "y": "..... ..... #...# #...# #...# .#### ....# .###.",
    "z": "..... ..... ##### ...#. ..#.. .#... #####",
    # punctuation
    " ": "..... ..... ..... ..... ..... ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... .#### ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "_": "..... ..... ..... ..... ..... ..... #####",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "[": ".###. .#... .#... .#... .#... .#... .###.",
    "]": ".###. ...#. ...#. ...#. ...#. ...#. .###.",
    "<": "...#. ..#.. .#... #.... .#... ..#.. ...#.",
    ">": ".#... ..#.. ...#. ....# ...#. ..#.. .#...",
    "*": "..... ..#.. #.#.# .###. #.#.# ..#.. .....",
    "'": ".##.. ..#.. .#... ..... ..... ..... .....",
    "!": "..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
    "|": "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "#": ".#.#. .#.#. ##### .#.#. ##### .#.#. .#.#.",
}
FALLBACK_CHAR = "?"


def _parse_glyph(char: str, rows: str) -> np.ndarray:
    lines = rows.split()
    if not 7 <= len(lines) <= GLYPH_HEIGHT or any(len(line) != GLYPH_WIDTH for line in lines):
        raise ValueError(f"glyph {char!r} must have 7 or 8 rows of {GLYPH_WIDTH} columns")
    lines += ["." * GLYPH_WIDTH] * (GLYPH_HEIGHT - len(lines))
    return np.array([[cell == "#" for cell in line] for line in lines], dtype=bool)


GLYPHS: dict[str, np.ndarray] = {char: _parse_glyph(char, rows) for char, rows in _GLYPH_ROWS.items()}


def glyph(char: str) -> np.ndarray:
    """The (8, 5) boolean bitmap of ``char``; unknown characters render as '?'."""
    return GLYPHS.get(char, GLYPHS[FALLBACK_CHAR])


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of ``text`` drawn at ``scale`` (no trailing gap)."""
    return max(0, len(text) * GLYPH_ADVANCE - 1) * scale


def text_height(scale: int = 1) -> int:
    return GLYPH_HEIGHT * scale


def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """Boolean ink mask ``(8*scale, text_width)`` of a single line of text."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    mask = np.zeros((GLYPH_HEIGHT, max(0, len(text) * GLYPH_ADVANCE - 1)), dtype=bool)
    for index, char in enumerate(text):
        left = index * GLYPH_ADVANCE
        mask[:, left : left + GLYPH_WIDTH] = glyph(char)
    return np.kron(mask, np.ones((scale, scale), dtype=bool)).astype(bool) if scale > 1 else mask


def fit_text(text: str, max_width: int, scale: int = 1) -> str:
    """``text`` shortened with '..' so that it fits into ``max_width`` pixels."""
    if text_width(text, scale) <= max_width:
        return text
    keep = max(0, max_width // (GLYPH_ADVANCE * scale) - 2)
    return text[:keep] + ".." if keep else ""


# --------------------------------------------------------------------------------------------------------------
# Raster primitives on an (H, W, 3) uint8 canvas; everything is clipped to the canvas.
# --------------------------------------------------------------------------------------------------------------


def new_canvas(width: int, height: int, color: Color = WHITE) -> np.ndarray:
    if width < 1 or height < 1:
        raise ValueError(f"canvas size must be positive, got width={width} height={height}")
    canvas = np.empty((height, width, 3), dtype=np.uint8)
    canvas[:] = color
    return canvas


def blit_mask(canvas: np.ndarray, mask: np.ndarray, left: int, top: int, color: Color) -> None:
    """Paint the True cells of ``mask`` with ``color``, its top-left corner at (left, top)."""
    height, width = canvas.shape[:2]
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + mask.shape[0], height), min(left + mask.shape[1], width)
    if y0 >= y1 or x0 >= x1:
        return
    region = mask[y0 - top : y1 - top, x0 - left : x1 - left]
    canvas[y0:y1, x0:x1][region] = color


def draw_text(canvas: np.ndarray, left: int, top: int, text: str, color: Color = TEXT, scale: int = 1) -> None:
    blit_mask(canvas, text_mask(text, scale), left, top, color)


def draw_text_vertical(canvas: np.ndarray, left: int, top: int, text: str, color: Color = TEXT, scale: int = 1) -> None:
    """Text rotated 90 degrees counter-clockwise (reads bottom to top), as y-axis labels usually are."""
    blit_mask(canvas, np.rot90(text_mask(text, scale)), left, top, color)


def fill_rect(canvas: np.ndarray, left: int, top: int, right: int, bottom: int, color: Color) -> None:
    """Fill the inclusive pixel rectangle [left, right] x [top, bottom]."""
    height, width = canvas.shape[:2]
    x0, x1 = max(left, 0), min(right, width - 1)
    y0, y1 = max(top, 0), min(bottom, height - 1)
    if x0 <= x1 and y0 <= y1:
        canvas[y0 : y1 + 1, x0 : x1 + 1] = color


def draw_line(
    canvas: np.ndarray, x0: float, y0: float, x1: float, y1: float, color: Color, thickness: int = 1
) -> None:
    """Straight segment sampled once per pixel step, stamped ``thickness`` x ``thickness`` pixels wide."""
    steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, steps + 1)).astype(np.int64)
    ys = np.rint(np.linspace(y0, y1, steps + 1)).astype(np.int64)
    height, width = canvas.shape[:2]
    start = -(thickness // 2)
    for dy in range(start, start + thickness):
        for dx in range(start, start + thickness):
            px, py = xs + dx, ys + dy
            inside = (px >= 0) & (px < width) & (py >= 0) & (py < height)
            canvas[py[inside], px[inside]] = color


def draw_marker(canvas: np.ndarray, x: float, y: float, color: Color, radius: int = 2) -> None:
    """A filled square marker centred on (x, y): makes single points and sparse rounds visible."""
    cx, cy = int(round(x)), int(round(y))
    fill_rect(canvas, cx - radius, cy - radius, cx + radius, cy + radius, color)


# --------------------------------------------------------------------------------------------------------------
# Axis scaling and tick labels
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Axis:
    """A numeric axis: displayed range [low, high] and tick positions/labels inside it."""

    low: float
    high: float
    ticks: tuple[float, ...]
    labels: tuple[str, ...]


def padded_range(values: np.ndarray) -> tuple[float, float]:
    """Data range, widened around a single value (constant series / single points) so it has extent."""
    low, high = float(values.min()), float(values.max())
    if high > low:
        return low, high
    pad = abs(low) * 0.1 if low != 0 else 1.0
    return low - pad, high + pad


def nice_step(span: float, max_ticks: int, integer: bool = False) -> float:
    """Smallest step of the form {1, 2, 2.5, 5} x 10^k that needs at most ``max_ticks`` ticks over ``span``."""
    raw = span / max(1, max_ticks - 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    multipliers = (1.0, 2.0, 5.0, 10.0) if integer else (1.0, 2.0, 2.5, 5.0, 10.0)
    step = next(m * magnitude for m in multipliers if m * magnitude >= raw * (1 - 1e-9))
    return max(1.0, float(round(step))) if integer else step


def _decimals_for(step: float) -> int:
    """Fewest decimals that write every multiple of ``step`` exactly (0.25 -> 2, 0.5 -> 1, 5 -> 0)."""
    return next(d for d in range(13) if d == 12 or math.isclose(step * 10**d, round(step * 10**d), rel_tol=1e-6))


def format_tick(value: float, step: float, scientific: bool = False) -> str:
    """Tick label with just the precision the step needs; ``scientific`` writes mantissa + "e" + exponent."""
    if abs(value) < step * 1e-6:
        value = 0.0  # floating-point noise must not print as "-0.0" or "1e-17"
    if not scientific:
        return f"{value:.{_decimals_for(step)}f}"
    if value == 0:
        return "0"
    exponent = math.floor(math.log10(abs(value)))
    mantissa = f"{value / 10**exponent:.{_decimals_for(step / 10**exponent)}f}"
    if mantissa.lstrip("-").startswith("10"):  # 9.99.. rounded up: renormalise
        exponent += 1
        mantissa = f"{value / 10**exponent:.{_decimals_for(step / 10**exponent)}f}"
    return f"{mantissa}e{exponent}"


def make_axis(values: np.ndarray, max_ticks: int, integer: bool = False) -> Axis:
    """Axis spanning ``values`` whose limits are extended outwards to the enclosing nice ticks.

    Labels switch to scientific notation when fixed-point ones would be long (|tick| >= 1e6 or step < 1e-4).
    """
    low, high = padded_range(values)
    step = nice_step(high - low, max_ticks, integer)
    first = math.floor(low / step + 1e-9)
    last = math.ceil(high / step - 1e-9)
    ticks = tuple(index * step for index in range(first, last + 1))
    scientific = max(abs(ticks[0]), abs(ticks[-1])) >= 1e6 or step < 1e-4
    return Axis(ticks[0], ticks[-1], ticks, tuple(format_tick(t, step, scientific) for t in ticks))


def fitted_axis(values: np.ndarray, length_px: int, label_extent: Callable[[str], int], integer: bool = False) -> Axis:
    """The densest nice axis (up to 8 ticks) whose labels, measured by ``label_extent``, do not collide."""
    axis = make_axis(values, 2, integer)
    for max_ticks in range(8, 1, -1):
        axis = make_axis(values, max_ticks, integer)
        spacing = length_px / max(1, len(axis.ticks) - 1)
        if all(label_extent(label) + 8 <= spacing for label in axis.labels):
            return axis
    return axis


# --------------------------------------------------------------------------------------------------------------
# Data preparation
# --------------------------------------------------------------------------------------------------------------


def finite_points(xs: Sequence[float], ys: Sequence[float], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Float arrays of the finite (x, y) pairs, sorted by x (stable); non-finite pairs are dropped."""
    x = np.asarray(list(xs), dtype=np.float64).reshape(-1)
    y = np.asarray(list(ys), dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"series {name!r}: xs has {x.size} values but ys has {y.size}")
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    order = np.argsort(x, kind="stable")
    return x[order], y[order]


def _panel_curves(name: str, data: PanelData) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Normalise one panel's data into {curve label: (x, y)}; a bare (xs, ys) curve is labelled ``name``."""
    if isinstance(data, Mapping):
        return {str(label): finite_points(*points, name=f"{name}/{label}") for label, points in data.items()}
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise ValueError(f"series {name!r} must be (xs, ys) or a mapping of curve name -> (xs, ys)")
    return {name: finite_points(data[0], data[1], name=name)}


# --------------------------------------------------------------------------------------------------------------
# Layout and rendering
# --------------------------------------------------------------------------------------------------------------

TITLE_SCALE = 2
LABEL_SCALE = 1
PAD = 8


def _legend_rows(labels: Sequence[str], max_width: int) -> list[list[tuple[str, int]]]:
    """Flow legend entries (swatch + label) into rows; returns rows of (label, x offset)."""
    rows: list[list[tuple[str, int]]] = [[]]
    cursor = 0
    for label in labels:
        label = fit_text(label, max_width - 18, LABEL_SCALE)
        entry_width = 18 + text_width(label, LABEL_SCALE)
        if rows[-1] and cursor + entry_width > max_width:
            rows.append([])
            cursor = 0
        rows[-1].append((label, cursor))
        cursor += entry_width + 14
    return rows


def _draw_frame(canvas: np.ndarray, left: int, top: int, right: int, bottom: int, color: Color) -> None:
    """One-pixel rectangle outline."""
    fill_rect(canvas, left, top, right, top, color)
    fill_rect(canvas, left, bottom, right, bottom, color)
    fill_rect(canvas, left, top, left, bottom, color)
    fill_rect(canvas, right, top, right, bottom, color)


def _draw_panel(
    canvas: np.ndarray,
    left: int,
    top: int,
    width: int,
    height: int,
    title: str,
    curves: dict[str, tuple[np.ndarray, np.ndarray]],
    colors: Sequence[Color],
    xlabel: str,
    ylabel: str,
) -> None:
    """Render one panel (title, legend, axes, grid, ticks, curves) into the given canvas rectangle."""
    title_text = fit_text(title, width - 2 * PAD, TITLE_SCALE)
    title_left = left + (width - text_width(title_text, TITLE_SCALE)) // 2
    draw_text(canvas, title_left, top + PAD, title_text, TEXT, TITLE_SCALE)
    cursor_y = top + PAD + text_height(TITLE_SCALE) + 4

    curve_colors = iter(colors)
    for row in _legend_rows(list(curves), width - 2 * PAD):
        row_width = (row[-1][1] + 18 + text_width(row[-1][0], LABEL_SCALE)) if row else 0
        row_left = left + (width - row_width) // 2
        for (label, offset), color in zip(row, curve_colors):
            swatch_y = cursor_y + 3
            fill_rect(canvas, row_left + offset, swatch_y, row_left + offset + 12, swatch_y + 1, color)
            draw_text(canvas, row_left + offset + 18, cursor_y, label, TEXT, LABEL_SCALE)
        cursor_y += text_height(LABEL_SCALE) + 4

    all_x = np.concatenate([x for x, _ in curves.values()]) if curves else np.zeros(0)
    all_y = np.concatenate([y for _, y in curves.values()]) if curves else np.zeros(0)
    ylabel_width = text_height(LABEL_SCALE) + 6 if ylabel else 0
    plot_top = cursor_y + 6
    plot_bottom = top + height - PAD - 2 * text_height(LABEL_SCALE) - 10
    if all_x.size == 0:
        _draw_frame(canvas, left + PAD, plot_top, left + width - PAD, plot_bottom, GRID)
        message = "no data"
        draw_text(canvas, left + (width - text_width(message)) // 2, (plot_top + plot_bottom) // 2, message, MUTED)
        return

    plot_height = plot_bottom - plot_top
    y_axis = fitted_axis(all_y, plot_height, lambda label: text_height(LABEL_SCALE))
    y_label_width = max(text_width(label, LABEL_SCALE) for label in y_axis.labels)
    plot_left = left + PAD + ylabel_width + y_label_width + 6
    plot_right = left + width - PAD - 6
    plot_width = plot_right - plot_left
    integer_x = bool(np.all(all_x == np.round(all_x)))
    x_axis = fitted_axis(all_x, plot_width, lambda label: text_width(label, LABEL_SCALE), integer=integer_x)

    def to_px(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        px = plot_left + (x - x_axis.low) / (x_axis.high - x_axis.low) * plot_width
        py = plot_bottom - (y - y_axis.low) / (y_axis.high - y_axis.low) * plot_height
        return px, py

    # grid, ticks and tick labels
    for tick, label in zip(y_axis.ticks, y_axis.labels):
        _, py = to_px(np.array([x_axis.low]), np.array([tick]))
        row = int(round(py[0]))
        fill_rect(canvas, plot_left, row, plot_right, row, GRID)
        fill_rect(canvas, plot_left - 4, row, plot_left - 1, row, AXIS)
        draw_text(canvas, plot_left - 6 - text_width(label), row - 3, label, TEXT)
    for tick, label in zip(x_axis.ticks, x_axis.labels):
        px, _ = to_px(np.array([tick]), np.array([y_axis.low]))
        column = int(round(px[0]))
        fill_rect(canvas, column, plot_top, column, plot_bottom, GRID)
        fill_rect(canvas, column, plot_bottom + 1, column, plot_bottom + 4, AXIS)
        draw_text(canvas, column - text_width(label) // 2, plot_bottom + 7, label, TEXT)

    _draw_frame(canvas, plot_left, plot_top, plot_right, plot_bottom, AXIS)  # on top of the grid

    # axis titles
    if xlabel:
        text = fit_text(xlabel, plot_width)
        text_top = plot_bottom + 7 + text_height() + 4  # below the tick labels
        draw_text(canvas, plot_left + (plot_width - text_width(text)) // 2, text_top, text, TEXT)
    if ylabel:
        text = fit_text(ylabel, plot_height)
        draw_text_vertical(canvas, left + PAD, plot_top + (plot_height - text_width(text)) // 2, text, TEXT)

    # curves: lines then markers (markers only while points are sparse enough to tell apart)
    for (x, y), color in zip(curves.values(), colors):
        if x.size == 0:
            continue
        px, py = to_px(x, y)
        for index in range(px.size - 1):
            draw_line(canvas, px[index], py[index], px[index + 1], py[index + 1], color, thickness=2)
        if px.size == 1 or plot_width / px.size >= 8:
            for cx, cy in zip(px, py):
                draw_marker(canvas, cx, cy, color, radius=2)


def _grid_shape(num_panels: int, columns: int | None) -> tuple[int, int]:
    if columns is None:
        columns = 1 if num_panels <= 1 else 2 if num_panels <= 4 else 3
    if columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}")
    columns = min(columns, max(1, num_panels))
    return columns, max(1, math.ceil(num_panels / columns))


def render_curves(
    series: Mapping[str, PanelData],
    title: str = "",
    xlabel: str = "round",
    ylabels: Mapping[str, str] | None = None,
    *,
    columns: int | None = None,
    panel_size: tuple[int, int] = (420, 280),
) -> np.ndarray:
    """Draw the chart described in :func:`plot_curves` and return it as an (H, W, 3) uint8 array."""
    if not isinstance(series, Mapping):
        raise ValueError(f"series must be a mapping of panel name -> (xs, ys), got {type(series).__name__}")
    panel_width, panel_height = panel_size
    if panel_width < 160 or panel_height < 120:
        raise ValueError(f"panel_size must be at least (160, 120) pixels, got {panel_size}")
    ylabels = dict(ylabels or {})
    panels = {name: _panel_curves(str(name), data) for name, data in series.items()}
    columns, rows = _grid_shape(len(panels), columns)
    title_height = text_height(TITLE_SCALE) + 2 * PAD if title else 0
    canvas = new_canvas(columns * panel_width, title_height + rows * panel_height)
    if title:
        text = fit_text(title, canvas.shape[1] - 2 * PAD, TITLE_SCALE)
        draw_text(canvas, (canvas.shape[1] - text_width(text, TITLE_SCALE)) // 2, PAD, text, TEXT, TITLE_SCALE)
    if not panels:
        message_left = (canvas.shape[1] - text_width("no data")) // 2
        draw_text(canvas, message_left, title_height + panel_height // 2, "no data", MUTED)
        return canvas
    color_index = 0
    for panel_index, (name, curves) in enumerate(panels.items()):
        row, column = divmod(panel_index, columns)
        colors = [PALETTE[(color_index + i) % len(PALETTE)] for i in range(len(curves))]
        color_index += len(curves)  # every curve of the figure gets its own colour
        _draw_panel(
            canvas, column * panel_width, title_height + row * panel_height, panel_width, panel_height,
            str(name), curves, colors, xlabel, ylabels.get(name, ""),
        )
    return canvas


def plot_curves(
    path: str | os.PathLike[str],
    series: Mapping[str, PanelData],
    title: str = "",
    xlabel: str = "round",
    ylabels: Mapping[str, str] | None = None,
    *,
    columns: int | None = None,
    panel_size: tuple[int, int] = (420, 280),
) -> Path:
    """Write a PNG with one line-chart panel per entry of ``series``; returns the written path.

    ``series`` maps a panel title to ``(xs, ys)`` (e.g. ``{"train_loss": (rounds, losses), "knn_acc":
    (rounds, accs)}``) or to a mapping ``{curve name: (xs, ys)}`` to overlay several curves in one panel.
    Each panel has a title, a legend (a colour swatch per curve), a framed plot area with a light grid and
    numeric tick labels, ``xlabel`` under the x axis and, if given, ``ylabels[panel title]`` along the y axis.
    Panels are laid out ``columns`` wide (default: 1, 2 or 3 depending on the count), each
    ``panel_size = (width, height)`` pixels; ``title`` goes above all panels. Non-finite points are skipped;
    parent directories are created.
    """
    return write_png(path, render_curves(series, title, xlabel, ylabels, columns=columns, panel_size=panel_size))


# --------------------------------------------------------------------------------------------------------------
# PNG encoding
# --------------------------------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    """length, type, data, CRC-32 over type + data (PNG spec section 5.3)."""
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)


def encode_png(image: np.ndarray, compression: int = 6) -> bytes:
    """Encode an (H, W, 3) uint8 RGB array as a PNG: 8-bit truecolour, no interlace, filter 0 on every row."""
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError("image must be a uint8 numpy array of shape (H, W, 3)")
    height, width = image.shape[:2]
    if height < 1 or width < 1:
        raise ValueError(f"image must be at least 1x1 pixels, got {width}x{height}")
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # depth 8, colour type 2 (RGB)
    # Each scanline is prefixed by its filter-type byte (0 = None).
    scanlines = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, width * 3)], axis=1)
    return b"".join(
        (
            PNG_SIGNATURE,
            _png_chunk(b"IHDR", header),
            _png_chunk(b"IDAT", zlib.compress(np.ascontiguousarray(scanlines).tobytes(), compression)),
            _png_chunk(b"IEND", b""),
        )
    )


def write_png(path: str | os.PathLike[str], image: np.ndarray) -> Path:
    """Encode ``image`` and write it to ``path`` (parent folders created); returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(encode_png(image))
    return target
