"""Tests of the numpy-only chart renderer and PNG encoder (server_app.plotting)."""

from __future__ import annotations

import ast
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from server_app import plotting
from server_app.plotting import (
    GLYPHS,
    PALETTE,
    draw_line,
    draw_text,
    encode_png,
    format_tick,
    glyph,
    make_axis,
    new_canvas,
    plot_curves,
    render_curves,
    text_width,
)

ROUNDS = list(range(1, 21))
LOSS = [3.0 / r for r in ROUNDS]
ACC = [0.1 + 0.03 * r for r in ROUNDS]


def read_png(data: bytes) -> tuple[dict, np.ndarray]:
    """Minimal independent decoder for what encode_png writes; checks signature, CRCs and chunk order."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = [], 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, payload = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert crc == zlib.crc32(kind + payload), kind
        chunks.append((kind, payload))
        offset += 12 + length
    kinds = [kind for kind, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height, depth, color_type, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    header = {"width": width, "height": height, "depth": depth, "color_type": color_type,
              "compression": compression, "filter": filtering, "interlace": interlace}
    raw = zlib.decompress(b"".join(payload for kind, payload in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)  # one filter byte + RGB per pixel, per row
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert np.all(rows[:, 0] == 0)  # filter type "None" everywhere
    return header, rows[:, 1:].reshape(height, width, 3)


def _count_color(image: np.ndarray, color: tuple[int, int, int]) -> int:
    return int(np.all(image == np.array(color, dtype=np.uint8), axis=-1).sum())


# ----------------------------------------------------------------------------------------------------------
# PNG encoder
# ----------------------------------------------------------------------------------------------------------


def test_encode_png_header_bytes_and_pixels_of_a_tiny_image():
    image = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255]], [[1, 2, 3], [4, 5, 6], [7, 8, 9]]], dtype=np.uint8)
    data = encode_png(image)
    # IHDR: length 13, "IHDR", width 3, height 2, depth 8, colour type 2, compression/filter/interlace 0
    assert data[8:29] == bytes.fromhex("0000000d49484452") + bytes.fromhex("00000003000000020802000000")
    assert data[-12:] == bytes.fromhex("0000000049454e44ae426082")  # the constant IEND chunk
    header, pixels = read_png(data)
    assert header == {"width": 3, "height": 2, "depth": 8, "color_type": 2, "compression": 0, "filter": 0,
                      "interlace": 0}
    assert np.array_equal(pixels, image)


def test_encode_png_rejects_non_rgb_uint8():
    with pytest.raises(ValueError, match="image"):
        encode_png(np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="image"):
        encode_png(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="1x1"):
        encode_png(np.zeros((0, 4, 3), dtype=np.uint8))


def test_plot_curves_writes_a_valid_png_of_the_rendered_image(tmp_path):
    series = {"train_loss": (ROUNDS, LOSS), "knn_acc": (ROUNDS, ACC)}
    path = plot_curves(tmp_path / "sub" / "curves.png", series, title="run 1", xlabel="round")
    assert path == tmp_path / "sub" / "curves.png"
    header, pixels = read_png(path.read_bytes())
    expected = render_curves(series, title="run 1", xlabel="round")
    assert (header["height"], header["width"]) == expected.shape[:2]
    assert expected.shape[1] == 2 * 420  # two panels side by side at the default panel width
    assert np.array_equal(pixels, expected)


# ----------------------------------------------------------------------------------------------------------
# raster primitives and font
# ----------------------------------------------------------------------------------------------------------


def test_draw_line_sets_exactly_the_pixels_of_the_segment():
    canvas = new_canvas(10, 10)
    draw_line(canvas, 0, 0, 9, 9, (255, 0, 0))
    red = np.all(canvas == (255, 0, 0), axis=-1)
    assert np.array_equal(red, np.eye(10, dtype=bool))
    canvas = new_canvas(10, 10)
    draw_line(canvas, 2, 5, 7, 5, (0, 0, 255), thickness=2)
    blue = np.all(canvas == (0, 0, 255), axis=-1)
    expected = np.zeros((10, 10), dtype=bool)
    expected[4:6, 1:8] = True  # a 2x2 brush centred at offsets (-1, 0) on x = 2..7, y = 5
    assert np.array_equal(blue, expected)
    draw_line(canvas, -50, -50, 100, 100, (0, 255, 0))  # clipped, no IndexError


def test_every_glyph_is_5_wide_and_8_tall_and_text_renders_them():
    assert all(bitmap.shape == (8, 5) for bitmap in GLYPHS.values())
    needed = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-_%:/ ()=+e"
    assert set(needed) <= set(GLYPHS)
    canvas = new_canvas(20, 10)
    draw_text(canvas, 1, 1, "7a", (0, 0, 0))
    ink = np.all(canvas == 0, axis=-1)
    assert np.array_equal(ink[1:9, 1:6], glyph("7")) and np.array_equal(ink[1:9, 7:12], glyph("a"))
    assert not ink[:, 6].any()  # one blank column between characters
    assert np.array_equal(glyph("\u00e9"), glyph("?"))  # unknown characters fall back to '?'
    assert text_width("abc") == 17 and text_width("abc", scale=2) == 34 and text_width("") == 0


# ----------------------------------------------------------------------------------------------------------
# axes
# ----------------------------------------------------------------------------------------------------------


def test_axis_ticks_are_nice_numbers_enclosing_the_data():
    axis = make_axis(np.array([0.13, 0.71]), max_ticks=7)
    assert axis.labels == ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8")[: len(axis.labels)]
    assert axis.low == pytest.approx(0.1) and axis.high == pytest.approx(0.8)
    rounds = make_axis(np.array([1.0, 50.0]), max_ticks=6, integer=True)
    assert rounds.labels == ("0", "10", "20", "30", "40", "50")
    single = make_axis(np.array([3.0]), max_ticks=5, integer=True)  # one round: widened around it
    assert single.low < 3.0 < single.high and "3" in single.labels


def test_tick_formatting():
    assert format_tick(0.25, 0.25) == "0.25"
    assert format_tick(0.5, 0.25) == "0.50"
    assert format_tick(-1e-17, 0.1) == "0.0"  # floating-point noise does not print as -0.0
    assert format_tick(40.0, 10.0) == "40"
    assert format_tick(2e-5, 1e-5, scientific=True) == "2e-5"
    assert format_tick(1.5e10, 5e9, scientific=True) == "1.5e10"
    assert format_tick(5e9, 5e9, scientific=True) == "5e9"
    assert format_tick(-2.5e-7, 2.5e-7, scientific=True) == "-2.5e-7"
    assert format_tick(0.0, 1e-5, scientific=True) == "0"
    assert make_axis(np.array([1e-7, 2e-6]), max_ticks=5).labels == ("0", "5e-7", "1.0e-6", "1.5e-6", "2.0e-6")


# ----------------------------------------------------------------------------------------------------------
# charts
# ----------------------------------------------------------------------------------------------------------


def test_curve_pixels_appear_in_the_series_colour_and_follow_the_data():
    flat = render_curves({"loss": (ROUNDS, [1.0] * 20)})
    rising = render_curves({"loss": (ROUNDS, ACC)})
    assert _count_color(flat, PALETTE[0]) > 200
    assert not np.array_equal(flat, rising)
    # the rising curve's coloured pixels are higher (smaller row) on the right than on the left
    rows, cols = np.nonzero(np.all(rising == PALETTE[0], axis=-1))
    in_plot = rows > 60  # below the legend swatch
    left_rows = rows[in_plot][cols[in_plot] < np.median(cols[in_plot])]
    right_rows = rows[in_plot][cols[in_plot] >= np.median(cols[in_plot])]
    assert right_rows.mean() < left_rows.mean()


def test_overlaid_curves_get_distinct_colours():
    image = render_curves({"accuracy": {"knn_acc": (ROUNDS, ACC), "linear_probe_acc": (ROUNDS, LOSS)}})
    assert _count_color(image, PALETTE[0]) > 100 and _count_color(image, PALETTE[1]) > 100


def test_non_finite_points_are_skipped():
    nan, inf = float("nan"), float("inf")
    with_gaps = render_curves({"loss": ([1, 2, 3, 4, nan, 6], [4.0, nan, 2.0, inf, 1.0, 0.5])})
    without = render_curves({"loss": ([1, 3, 6], [4.0, 2.0, 0.5])})
    assert np.array_equal(with_gaps, without)


def test_points_are_drawn_in_x_order():
    shuffled = render_curves({"s": ([3, 1, 2], [1.0, 3.0, 2.0])})
    assert np.array_equal(shuffled, render_curves({"s": ([1, 2, 3], [3.0, 2.0, 1.0])}))


@pytest.mark.parametrize(
    "series",
    [
        {"empty": ([], [])},
        {"all_nan": ([1, 2], [float("nan"), float("nan")])},
        {"single": ([5], [0.42])},
        {"constant": (ROUNDS, [0.05] * 20)},
        {"zero": (ROUNDS, [0.0] * 20)},
        {"huge": (ROUNDS, [1e9 * r for r in ROUNDS])},
        {"tiny": (ROUNDS, [1e-7 * r for r in ROUNDS])},
        {"negative": (ROUNDS, [-r for r in ROUNDS])},
        {},
    ],
)
def test_degenerate_series_still_render(series):
    image = render_curves(series, title="edge cases")
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    header, pixels = read_png(encode_png(image))
    assert np.array_equal(pixels, image)
    name = next(iter(series), None)
    if name in ("single", "constant", "zero", "huge", "tiny", "negative"):
        assert _count_color(image, PALETTE[0]) > 20  # the data (marker or line) is visible
    if name in ("empty", "all_nan", None):
        assert _count_color(image, plotting.MUTED) > 0  # the "no data" note


def test_layout_grid_and_panel_size():
    six = {f"s{i}": (ROUNDS, LOSS) for i in range(6)}
    assert render_curves(six, panel_size=(300, 200)).shape == (2 * 200, 3 * 300, 3)  # 3 columns, 2 rows
    assert render_curves(six, columns=1, panel_size=(300, 200)).shape == (6 * 200, 300, 3)
    titled = render_curves({"a": (ROUNDS, LOSS)}, title="t")
    assert titled.shape[0] > render_curves({"a": (ROUNDS, LOSS)}).shape[0]


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="'loss'"):
        render_curves({"loss": ([1, 2, 3], [1.0, 2.0])})
    with pytest.raises(ValueError, match="series"):
        render_curves([("loss", ([1], [1.0]))])
    with pytest.raises(ValueError, match="panel_size"):
        render_curves({"loss": ([1], [1.0])}, panel_size=(50, 50))
    with pytest.raises(ValueError, match="columns"):
        render_curves({"loss": ([1], [1.0])}, columns=0)


def test_plotting_imports_neither_flwr_nor_plotting_libraries():
    tree = ast.parse(Path(plotting.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {name.split(".")[0] for name in imported} <= {"__future__", "math", "os", "struct", "zlib",
                                                         "collections", "dataclasses", "pathlib", "numpy"}
