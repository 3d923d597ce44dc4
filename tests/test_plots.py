"""nmt.plots: attention heatmaps and their side files."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from nmt.plots import attention_figure_array, save_attention

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _weights(n_trg: int, n_src: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(n_src, 0.3), size=n_trg)


def _tokens(prefix: str, n: int) -> list[str]:
    return [f"▁{prefix}{i}" for i in range(n)]


def test_save_attention_writes_png_npy_json(tmp_path: Path) -> None:
    src = ["▁The", "▁cost", "▁is", "▁$5", "."]
    trg = ["▁Le", "▁coût", "▁est", "▁de", "▁5", "▁$", "."]
    weights = _weights(len(trg), len(src))
    paths = save_attention(tmp_path / "out" / "sample.0", src, trg, weights)

    png, npy, js = paths
    assert [p.name for p in paths] == ["sample.0.png", "sample.0.npy", "sample.0.json"]
    assert png.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    loaded = np.load(npy)
    assert loaded.dtype == np.float32
    np.testing.assert_allclose(loaded, weights.astype(np.float32))

    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["source"] == src and data["target"] == trg
    np.testing.assert_allclose(np.array(data["weights"]), weights, atol=1e-5)
    assert not [p for p in png.parent.iterdir() if p.name.endswith(".tmp")]


def test_figure_aspect_follows_the_matrix(tmp_path: Path) -> None:
    wide = save_attention(tmp_path / "wide", _tokens("s", 40), _tokens("t", 4), _weights(4, 40))
    tall = save_attention(tmp_path / "tall", _tokens("s", 4), _tokens("t", 40), _weights(40, 4))
    wide_h, wide_w = matplotlib.image.imread(wide[0]).shape[:2]
    tall_h, tall_w = matplotlib.image.imread(tall[0]).shape[:2]
    assert wide_w > 2 * wide_h
    assert tall_h > 2 * tall_w


def test_figure_size_is_bounded(tmp_path: Path) -> None:
    paths = save_attention(tmp_path / "big", _tokens("s", 300), _tokens("t", 2), _weights(2, 300))
    height, width = matplotlib.image.imread(paths[0]).shape[:2]
    assert width <= 1700 and height <= 1700


def test_overwrites_existing_files(tmp_path: Path) -> None:
    first = save_attention(tmp_path / "a", ["x"], ["y"], np.ones((1, 1)))
    second = save_attention(tmp_path / "a", ["x", "z"], ["y"], np.array([[0.25, 0.75]]))
    assert first == second
    np.testing.assert_allclose(np.load(second[1]), [[0.25, 0.75]])


@pytest.mark.parametrize(
    "shape",
    [(3, 4), (4, 3), (12,), (3, 4, 1), (0, 0)],
    ids=["swapped", "too-few-columns", "1d", "3d", "empty"],
)
def test_shape_mismatch_raises_value_error(tmp_path: Path, shape: tuple[int, ...]) -> None:
    src, trg = ["a", "b", "c"], ["x", "y", "z", "w"]
    if shape == (0, 0):
        src, trg = [], []
    if shape == (4, 3):
        src = src + ["d"]
    with pytest.raises(ValueError, match="shape"):
        save_attention(tmp_path / "bad", src, trg, np.zeros(shape))
    with pytest.raises(ValueError):
        attention_figure_array(src, trg, np.zeros(shape))
    assert not list(tmp_path.glob("bad*"))


def test_attention_figure_array_is_rgb_uint8() -> None:
    image = attention_figure_array(["▁a", "▁b", "c"], ["▁x", "y"], _weights(2, 3))
    assert image.dtype == np.uint8
    assert image.ndim == 3 and image.shape[2] == 3
    assert image.shape[0] > 50 and image.shape[1] > 50
    assert image.min() < 50 and image.max() > 200


def test_reference_links_are_outlined_and_listed(tmp_path: Path) -> None:
    weights = np.full((3, 4), 0.25, dtype=np.float32)
    links = [(0, 1, True), (2, 3, False)]
    plain = save_attention(tmp_path / "plain", list("abcd"), list("xyz"), weights)
    drawn = save_attention(tmp_path / "drawn", list("abcd"), list("xyz"), weights, links)
    assert plain[0].read_bytes() != drawn[0].read_bytes(), "the outlines change the picture"
    document = json.loads(drawn[2].read_text(encoding="utf-8"))
    assert document["reference_links"] == [
        {"target": 0, "source": 1, "sure": True},
        {"target": 2, "source": 3, "sure": False},
    ]
    with pytest.raises(ValueError, match=r"link cell \(3, 0\) lies outside \(3, 4\)"):
        save_attention(tmp_path / "bad", list("abcd"), list("xyz"), weights, [(3, 0, True)])


def test_the_tensorboard_image_outlines_reference_links() -> None:
    """attention_figure_array draws the links in red (sure) and orange (possible), on a grey
    matrix that has neither colour."""
    weights = np.full((3, 4), 0.25, dtype=np.float32)

    def coloured(image: np.ndarray, rgb: tuple[int, int, int]) -> int:
        return int((np.abs(image.astype(int) - rgb).sum(axis=2) < 60).sum())

    plain = attention_figure_array(list("abcd"), list("xyz"), weights)
    sure = attention_figure_array(list("abcd"), list("xyz"), weights, [(0, 1, True)])
    possible = attention_figure_array(list("abcd"), list("xyz"), weights, [(2, 3, False)])
    red, orange = (0xE8, 0x20, 0x2A), (0xF5, 0x9A, 0x23)
    assert coloured(plain, red) == coloured(plain, orange) == 0
    assert coloured(sure, red) > 20 and coloured(sure, orange) == 0
    assert coloured(possible, orange) > 20 and coloured(possible, red) == 0
