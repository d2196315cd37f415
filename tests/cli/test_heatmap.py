"""``relpos heatmap`` and :func:`relpos.training.plotting.plot_relative_positions`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import matplotlib as mpl
import matplotlib.image
import numpy as np
import pytest
from matplotlib.figure import Figure

from relpos import clip_relative_position, relative_position_index
from relpos.cli import main
from relpos.training.plotting import plot_relative_positions, save_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DPI = 100.0
LIGHTGRAY = np.array([211, 211, 211]) / 255.0


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["heatmap", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def expected_rgb(offset: int, k: int) -> np.ndarray:
    """Colour of a cell, straight from the colormap: -K darkest blue, +K darkest red."""
    return np.asarray(mpl.colormaps["RdBu_r"]((offset + k) / (2 * k))[:3])


def luminance(rgb: np.ndarray) -> float:
    return float(0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2])


def cell_pixels(fig: Figure, queries: range, keys: range, shift: float) -> dict:
    """Pixel (row, col) in the saved image of every cell (p, j), moved by ``shift`` cells
    to the right and up from the centre (to sample beside the number written there)."""
    fig.set_dpi(DPI)
    fig.canvas.draw()
    ax = fig.axes[0]
    height = fig.get_size_inches()[1] * DPI
    out = {}
    for p in queries:
        for j in keys:
            # Data coordinates of a cell centre are (j, p); y grows downwards (p increases).
            x, y = ax.transData.transform((j + shift, p - shift))
            out[p, j] = (round(height - y), round(x))
    return out


def axes_corners(fig: Figure, image: np.ndarray, inset: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Colours just inside the bottom-left and top-right corners of the heatmap's axes,
    found from the axes box alone (not from the data coordinates)."""
    fig.set_dpi(DPI)
    fig.canvas.draw()
    box = fig.axes[0].get_window_extent()
    height = image.shape[0]
    bottom_left = (round(height - box.y0) - inset, round(box.x0) + inset)
    top_right = (round(height - box.y1) + inset, round(box.x1) - inset)
    return sample(image, *bottom_left), sample(image, *top_right)


def sample(image: np.ndarray, row: int, col: int) -> np.ndarray:
    patch = image[row - 1 : row + 2, col - 1 : col + 2, :3]  # 3x3 pixels
    return patch.reshape(-1, 3).mean(axis=0)


def check_corner_colours(colours: dict, offsets: dict, k: int, bottom_left, top_right) -> None:
    blue = {c: rgb for c, rgb in colours.items() if rgb[2] > rgb[0] + 0.05}
    red = {c: rgb for c, rgb in colours.items() if rgb[0] > rgb[2] + 0.05}
    # The corners are the saturated ends of the map ...
    np.testing.assert_allclose(colours[bottom_left], expected_rgb(-k, k), atol=0.02)
    np.testing.assert_allclose(colours[top_right], expected_rgb(k, k), atol=0.02)
    assert colours[bottom_left][2] > colours[bottom_left][0] + 0.25  # clearly blue
    assert colours[top_right][0] > colours[top_right][2] + 0.25  # clearly red
    # ... the darkest blue and the darkest red of the picture ...
    assert luminance(colours[bottom_left]) <= min(map(luminance, blue.values())) + 1e-3
    assert luminance(colours[top_right]) <= min(map(luminance, red.values())) + 1e-3
    # ... and only cells clipped to -K / +K are that dark.
    for cell, rgb in blue.items():
        if offsets[cell] != -k:
            assert luminance(rgb) > luminance(colours[bottom_left]) + 0.02, cell
    for cell, rgb in red.items():
        if offsets[cell] != k:
            assert luminance(rgb) > luminance(colours[top_right]) + 0.02, cell


def test_png_from_cli_has_darkest_corners(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n, k = 10, 4
    target = tmp_path / "clipped.png"
    code, out, err = run_cli(
        capsys, "--length", str(n), "--max-distance", str(k), "--dpi", str(DPI), "-o", str(target)
    )
    assert (code, err) == (0, "")
    assert str(target) in out
    assert target.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(target)  # (height, width, 4) floats in [0, 1]

    # The same figure, drawn again, tells where each cell landed in the file.
    fig = plot_relative_positions(n, k)
    width_in, height_in = fig.get_size_inches()
    assert image.shape[:2] == (round(height_in * DPI), round(width_in * DPI))
    offsets = {(i, j): clip_relative_position(j, i, k) for i in range(n) for j in range(n)}
    # Beside the number written in each cell, the pixels are the cell colour.
    where = cell_pixels(fig, range(n), range(n), shift=0.36)
    colours = {cell: sample(image, *rc) for cell, rc in where.items()}
    for cell, rgb in colours.items():
        np.testing.assert_allclose(rgb, expected_rgb(offsets[cell], k), atol=0.02, err_msg=cell)
    check_corner_colours(colours, offsets, k, bottom_left=(n - 1, 0), top_right=(0, n - 1))
    # The picture's own corners: darkest blue at the bottom left, darkest red at the top right.
    corner_bl, corner_tr = axes_corners(fig, image)
    np.testing.assert_allclose(corner_bl, expected_rgb(-k, k), atol=0.02)
    np.testing.assert_allclose(corner_tr, expected_rgb(k, k), atol=0.02)

    # The image data agrees: corners map to the two ends of the colormap.
    im = fig.axes[0].images[0]
    rgba = im.to_rgba(im.get_array())
    np.testing.assert_allclose(rgba[n - 1, 0, :3], expected_rgb(-k, k), atol=1e-6)
    np.testing.assert_allclose(rgba[0, n - 1, :3], expected_rgb(k, k), atol=1e-6)
    # Each cell carries its offset as text: "+4", "0", "-4".
    texts = {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
        for t in fig.axes[0].texts
    }
    assert texts[(n - 1, 0)] == f"-{k}"
    assert texts[(0, n - 1)] == f"+{k}"
    assert texts[(3, 3)] == "0"
    assert len(texts) == n * n


def test_unannotated_cell_centres_and_labels(tmp_path: Path) -> None:
    n, k = 7, 2
    fig = plot_relative_positions(n, k, annotate=False)
    ax = fig.axes[0]
    assert len(ax.texts) == 0
    assert "query" in ax.get_ylabel().lower()
    assert "key" in ax.get_xlabel().lower()
    assert ax.get_title()
    assert len(fig.axes) == 2  # the heatmap and its colorbar
    target = save_figure(fig, tmp_path / "plain.png", dpi=DPI)
    image = matplotlib.image.imread(target)
    offsets = {(i, j): clip_relative_position(j, i, k) for i in range(n) for j in range(n)}
    where = cell_pixels(fig, range(n), range(n), shift=0.0)
    colours = {cell: sample(image, *rc) for cell, rc in where.items()}
    for cell, rgb in colours.items():
        np.testing.assert_allclose(rgb, expected_rgb(offsets[cell], k), atol=0.02, err_msg=cell)
    check_corner_colours(colours, offsets, k, bottom_left=(n - 1, 0), top_right=(0, n - 1))
    # The picture's own corners: darkest blue at the bottom left, darkest red at the top right.
    corner_bl, corner_tr = axes_corners(fig, image)
    np.testing.assert_allclose(corner_bl, expected_rgb(-k, k), atol=0.02)
    np.testing.assert_allclose(corner_tr, expected_rgb(k, k), atol=0.02)


def test_causal_masks_upper_triangle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n, k = 10, 4
    fig = plot_relative_positions(n, k, causal=True)
    im = fig.axes[0].images[0]
    data = im.get_array()
    upper = np.triu(np.ones((n, n), dtype=bool), 1)
    np.testing.assert_array_equal(np.ma.getmaskarray(data), upper)
    np.testing.assert_array_equal(
        data.filled(99), np.where(upper, 99, relative_position_index(n, n, k).numpy() - k)
    )
    # Only visible cells are numbered.
    assert len(fig.axes[0].texts) == n * (n + 1) // 2
    assert "causal" in fig.axes[0].get_title()

    target = tmp_path / "causal.png"
    code, _, err = run_cli(
        capsys, "--length", str(n), "-k", str(k), "--causal", "--dpi", str(DPI), "-o", str(target)
    )
    assert (code, err) == (0, "")
    image = matplotlib.image.imread(target)
    where = cell_pixels(fig, range(n), range(n), shift=0.36)
    for (i, j), rc in where.items():
        rgb = sample(image, *rc)
        want = LIGHTGRAY if j > i else expected_rgb(clip_relative_position(j, i, k), k)
        np.testing.assert_allclose(rgb, want, atol=0.02, err_msg=str((i, j)))


def test_queries_and_query_start() -> None:
    # Three queries aligned to the end of ten keys (positions 7, 8, 9) ...
    fig = plot_relative_positions(10, 3, queries=3)
    ax = fig.axes[0]
    data = ax.images[0].get_array()
    np.testing.assert_array_equal(data, relative_position_index(3, 10, 3).numpy() - 3)
    assert ax.get_ylim() == (9.5, 6.5)
    assert [int(t) for t in ax.get_yticks()] == [7, 8, 9]
    # ... or placed explicitly.
    fig = plot_relative_positions(10, 3, queries=3, query_start=2, causal=True)
    data = fig.axes[0].images[0].get_array()
    expected = relative_position_index(3, 10, 3, query_start=2).numpy() - 3
    np.testing.assert_array_equal(data.filled(99), np.where(np.ma.getmaskarray(data), 99, expected))
    hidden = np.arange(10)[None, :] > np.arange(2, 5)[:, None]
    np.testing.assert_array_equal(np.ma.getmaskarray(data), hidden)


def test_annotations_skipped_for_large_lengths() -> None:
    assert len(plot_relative_positions(40, 4).axes[0].texts) == 0
    assert len(plot_relative_positions(40, 4, queries=2, annotate=True).axes[0].texts) == 80


def test_draws_into_given_axes() -> None:
    outer = Figure()
    ax = outer.add_subplot()
    assert plot_relative_positions(4, 1, ax=ax) is outer
    assert ax.images[0].get_array().shape == (4, 4)


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF-"), (".PNG", PNG_MAGIC)]
)
def test_svg_pdf_png_by_suffix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str, magic: bytes
) -> None:
    target = tmp_path / f"matrix{suffix}"
    code, _, err = run_cli(capsys, "--length", "6", "-k", "2", "-o", str(target))
    assert (code, err) == (0, "")
    data = target.read_bytes()
    assert data.startswith(magic)
    if suffix == ".svg":
        assert b"<svg" in data
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no temp file left
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as if written with open()


def test_existing_file_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "m.png"
    target.write_bytes(b"old")
    fig = plot_relative_positions(3, 1, annotate=False)

    def broken_savefig(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(fig, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        save_figure(fig, target)
    assert target.read_bytes() == b"old"  # untouched when writing fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png"]
    monkeypatch.undo()
    save_figure(fig, target, dpi=50)
    assert target.read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png"]


def parse_matrix(text: str) -> tuple[list[int], dict[tuple[int, int], str]]:
    lines = text.splitlines()
    header = lines[0].split()
    assert header[0] == "i\\j"
    keys = [int(x) for x in header[1:]]
    cells = {}
    for line in lines[1:]:
        p, *values = line.split()
        assert len(values) == len(keys)
        for j, v in zip(keys, values, strict=True):
            cells[int(p), j] = v
    return keys, cells


def test_text_matrix_without_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert (code, err) == (0, "")
    code, explicit, _ = run_cli(capsys, "--length", "10", "--max-distance", "4")
    assert explicit == out
    keys, cells = parse_matrix(out)
    assert keys == list(range(10))
    assert {p for p, _ in cells} == set(range(10))
    for (i, j), v in cells.items():
        assert int(v) == clip_relative_position(j, i, 4)
        assert v == "0" or v[0] in "+-"
    # Columns are right-aligned: every line has the same length.
    assert len({len(line) for line in out.splitlines()}) == 1


def test_text_matrix_causal_with_query_start(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "--length", "12", "-k", "2", "--queries", "3", "--query-start", "4", "--causal"
    )
    assert code == 0
    keys, cells = parse_matrix(out)
    assert keys == list(range(12))
    assert {p for p, _ in cells} == {4, 5, 6}
    for (p, j), v in cells.items():
        if j > p:
            assert v == "."
        else:
            assert int(v) == clip_relative_position(j, p, 2)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-distance", "-1"], "--max-distance"),
        (["--length", "0"], "--length"),
        (["--length", "5", "--queries", "6"], "--queries"),
        (["--length", "5", "--queries", "2", "--query-start", "4"], "0..3"),
        (["--dpi", "0", "-o", "x.png"], "--dpi"),
        (["-o", "matrix.jpg"], ".png, .svg, .pdf"),
        (["-o", "matrix"], ".png, .svg, .pdf"),
        (["-o", "no/such/dir/m.png"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    needle: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("relpos: error: ")
    assert needle in err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []  # nothing written


def test_missing_matplotlib_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" now fails
    code, out, err = run_cli(capsys, "-o", str(tmp_path / "m.png"))
    assert code == 2
    assert out == ""
    assert err.splitlines() == [
        "relpos: error: drawing needs matplotlib: pip install 'relpos[plot]'"
    ]
    # The text form needs no matplotlib.
    code, out, _ = run_cli(capsys, "--length", "3", "-k", "1")
    assert code == 0
    assert out.splitlines()[1].split() == ["0", "0", "+1", "+1"]


@pytest.mark.parametrize(("left", "right"), [(2, 1), (0, 3), (5, 0)])
def test_window_matrix_and_figure(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  left: int, right: int) -> None:
    code, out, err = run_cli(capsys, "--length", "7", "--left", str(left), "--right", str(right))
    assert (code, err) == (0, "")
    _, cells = parse_matrix(out)
    assert len(cells) == 49
    for (i, j), v in cells.items():
        assert int(v) == clip_relative_position(j, i, (left, right))
    path = tmp_path / "window.png"
    code, _, err = run_cli(capsys, "--length", "7", "--left", str(left), "--right", str(right),
                           "-o", str(path))
    assert (code, err) == (0, "") and path.stat().st_size > 0
    fig = plot_relative_positions(7, (left, right))
    data = fig.axes[0].images[0].get_array()
    want = relative_position_index(7, 7, (left, right)) - left
    assert data.tolist() == want.tolist()
