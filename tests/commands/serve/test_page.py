"""The page of `nmt serve` in a real browser (headless Chromium through Selenium), against the
real app serving a tiny trained run: the translation is `nmt translate`'s, the heatmap holds
the API's attention, hovering highlights the strongest pieces, a reference's alignment links
outline their cells, two models stand side by side, an API error is shown, and
scripts/screenshot.py saves the page.

Skipped where selenium or Debian's chromium and chromium-driver are missing."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import uvicorn_thread

import nmt

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

try:  # the browser as scripts/screenshot.py starts it, and selenium's parts
    import screenshot
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webelement import WebElement
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the module is skipped below
    screenshot = None

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.skipif(screenshot is None, reason="selenium is not installed (the dev extra)"),
    pytest.mark.skipif(
        not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)),
        reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)",
    ),
]

SERVE_MISSING = "nmt serve needs its extra, serve (fastapi and uvicorn): pip install -e '.[serve]'"
uvicorn = pytest.importorskip("uvicorn", reason=SERVE_MISSING)
serve_app = pytest.importorskip("nmt.commands.serve.app", reason=SERVE_MISSING)

SENTENCE = "sol luna mar"
REFERENCE = "MAR LUNA SOL"
NAMES = ("tiny", "tiny-2")  # the tiny run served twice, to stand side by side
# page.js's HIGHLIGHT_MASS: hovering a piece highlights the fewest pieces, strongest first, that
# carry this share of its attention
MASS = 0.5
WAIT_S = 60


# --- the server and the browser ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(run: Path) -> Iterator[str]:
    """The real app on the tiny run (twice, under two names), in uvicorn on a free local port:
    its base URL."""
    served = [serve_app.ServedModel.load(run, name=name, device="cpu") for name in NAMES]
    with uvicorn_thread(serve_app.create_app(served), WAIT_S) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium as scripts/screenshot.py starts it."""
    with screenshot.chromium(1400, 1000) as driver:
        yield driver


@pytest.fixture()
def page(browser: Any, server: str) -> Any:
    """The page, freshly loaded, with its model list filled from GET /api/models."""
    browser.get(f"{server}/")
    WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#model-a option")
    )
    return browser


def post(server: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{server}{path}",
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def api(server: str, path: str, body: dict) -> dict:
    status, answer = post(server, path, body)
    assert status == 200, answer
    return answer


def translate_request(beam: int, n_best: int, model: str = NAMES[0]) -> dict:
    """The request the page sends for SENTENCE."""
    return {
        "model": model,
        "sentences": [SENTENCE],
        "beam_size": beam,
        "n_best": n_best,
        "length_penalty": None,
        "coverage_penalty": None,
        "max_len_ratio": None,
        "no_repeat_ngram": None,
        "prefixes": None,
        "constraints": None,
        "attention": True,
        "alignments": False,
    }


# --- driving the page ------------------------------------------------------------------------


def fill(driver: Any, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def submit(driver: Any) -> None:
    """Click Translate and wait until the page has rendered the answers (or an error)."""
    results = driver.find_element(By.ID, "results")
    before = results.get_attribute("data-run")
    driver.find_element(By.ID, "translate").click()
    WebDriverWait(driver, WAIT_S).until(lambda d: results.get_attribute("data-run") != before)


def translate(driver: Any, beam: int, n_best: int, reference: str = "") -> None:
    fill(driver, "sentences", SENTENCE)
    if reference:
        fill(driver, "reference", reference)
    fill(driver, "beam", str(beam))
    fill(driver, "nbest", str(n_best))
    submit(driver)
    error = driver.find_element(By.ID, "error")
    assert not error.is_displayed(), error.text


def text(element: WebElement) -> str:
    """The element's text as the page set it (not as rendered, which folds whitespace)."""
    return str(element.get_attribute("textContent"))


def heatmap(driver: Any, kind: str) -> WebElement:
    (table,) = driver.find_elements(By.CSS_SELECTOR, f'table.heatmap[data-kind="{kind}"]')
    return table


def cells(driver: Any, table: WebElement) -> list[tuple[int, int, float, str]]:
    """Every td.cell as (row, column, weight, classes), read in one call."""
    rows = driver.execute_script(
        "return Array.from(arguments[0].querySelectorAll('td.cell'), td => "
        "[Number(td.dataset.row), Number(td.dataset.col), td.dataset.weight, td.className])",
        table,
    )
    return [(int(r), int(c), float(w), str(k)) for r, c, w, k in rows]


def labels(driver: Any, table: WebElement, kind: str) -> list[tuple[int, str, bool]]:
    """th.src (kind "src") or th.trg ("trg") labels as (index, text, highlighted)."""
    key = "col" if kind == "src" else "row"
    rows = driver.execute_script(
        f"return Array.from(arguments[0].querySelectorAll('th.{kind}'), th => "
        f"[Number(th.dataset.{key}), th.textContent, th.classList.contains('hl')])",
        table,
    )
    return [(int(i), str(t), bool(h)) for i, t, h in rows]


def strongest(values: list[float]) -> set[int]:
    """As page.js: the fewest indices, largest values first (ties: the first), whose values sum
    to MASS of all, summed one by one in that order as JavaScript does."""
    total = 0.0
    for value in values:
        total += value
    out: set[int] = set()
    mass = 0.0
    for k in sorted(range(len(values)), key=lambda k: (-values[k], k)):
        out.add(k)
        mass += values[k]
        if mass >= MASS * total:
            break
    return out


def highlighted(driver: Any, table: WebElement) -> tuple[set[int], set[int], set[tuple[int, int]]]:
    """(highlighted target rows, source columns, cells)."""
    rows = {i for i, _, on in labels(driver, table, "trg") if on}
    cols = {j for j, _, on in labels(driver, table, "src") if on}
    lit = {(i, j) for i, j, _, classes in cells(driver, table) if "hl" in classes.split()}
    return rows, cols, lit


def hover(driver: Any, element: WebElement) -> None:
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    ActionChains(driver).move_to_element(element).perform()


def check_weights(driver: Any, table: WebElement, attention: dict) -> None:
    """The table holds the attention: its pieces as labels, a cell per weight."""
    source, target, weights = attention["source"], attention["target"], attention["weights"]
    assert [t for _, t, _ in labels(driver, table, "src")] == source
    assert [t for _, t, _ in labels(driver, table, "trg")] == target
    shown = cells(driver, table)
    assert len(shown) == len(target) * len(source)
    assert {(i, j) for i, j, _, _ in shown} == {
        (i, j) for i in range(len(target)) for j in range(len(source))
    }
    for i, j, weight, _ in shown:
        assert weight == pytest.approx(weights[i][j], abs=1e-4), (i, j)
    for i in range(len(target)):
        assert sum(w for r, _, w, _ in shown if r == i) == pytest.approx(1.0, abs=1e-3)


# --- the tests -------------------------------------------------------------------------------


def test_translation_nbest_and_heatmap(page: Any, server: str, run: Path) -> None:
    models = json.load(urllib.request.urlopen(f"{server}/api/models", timeout=WAIT_S))["models"]
    assert models[0]["summary"] in text(page.find_element(By.ID, "model-info"))

    translate(page, beam=3, n_best=2)
    (result,) = page.find_elements(By.CSS_SELECTOR, "#results .result")
    assert result.get_attribute("data-model") == NAMES[0]
    (answer,) = api(server, "/api/translate", translate_request(3, 2))["translations"]
    best = text(result.find_element(By.CSS_SELECTOR, ".translation"))
    assert best == answer["text"] == nmt.load(run, device="cpu").translate(SENTENCE, beam_size=3)
    items = result.find_elements(By.CSS_SELECTOR, ".nbest li")
    hypotheses = answer["hypotheses"]
    assert len(hypotheses) == 2
    assert [text(i.find_element(By.CSS_SELECTOR, ".text")) for i in items] == [
        h["text"] for h in hypotheses
    ]
    check_weights(page, heatmap(page, "translation"), answer["attention"])


def test_hover_highlights_the_strongest_pieces(page: Any, server: str) -> None:
    translate(page, beam=3, n_best=1)
    table = heatmap(page, "translation")
    (answer,) = api(server, "/api/translate", translate_request(3, 1))["translations"]
    weights = answer["attention"]["weights"]
    assert highlighted(page, table) == (set(), set(), set())

    row = len(weights) // 2
    cols = strongest(weights[row])
    assert 0 < len(cols) < len(weights[row])  # a check that tells the strongest from the rest
    for target in (
        table.find_element(By.CSS_SELECTOR, f'th.trg[data-row="{row}"]'),
        table.find_element(By.CSS_SELECTOR, f'td.cell[data-row="{row}"][data-col="0"]'),
    ):
        hover(page, target)
        assert highlighted(page, table) == ({row}, cols, {(row, j) for j in cols})

    col = 0
    rows = strongest([weights[i][col] for i in range(len(weights))])
    assert 0 < len(rows) < len(weights)
    hover(page, table.find_element(By.CSS_SELECTOR, f'th.src[data-col="{col}"]'))
    assert highlighted(page, table) == (rows, {col}, {(i, col) for i in rows})

    hover(page, page.find_element(By.ID, "form"))
    assert highlighted(page, table) == (set(), set(), set())


def test_reference_attention_and_alignment_links(page: Any, server: str) -> None:
    translate(page, beam=2, n_best=1, reference=REFERENCE)
    table = heatmap(page, "reference")
    pair = {"model": NAMES[0], "sources": [SENTENCE], "targets": [REFERENCE]}
    (scored,) = api(server, "/api/score", {**pair, "attention": True})["scores"]
    (aligned,) = api(server, "/api/align", pair)["alignments"]
    attention = scored["attention"]
    check_weights(page, table, attention)

    links = {tuple(link) for link in aligned["links"]}
    expected = {
        (i, j)
        for i, t in enumerate(attention["target_piece_word"])
        for j, s in enumerate(attention["source_piece_word"])
        if t is not None and (s, t) in links
    }
    assert expected  # argmax links every target word
    outlined = {(i, j) for i, j, _, classes in cells(page, table) if "link" in classes.split()}
    assert outlined == expected
    translation = heatmap(page, "translation")
    assert not [c for c in cells(page, translation) if "link" in c[3].split()]


def test_two_models_side_by_side(page: Any) -> None:
    Select(page.find_element(By.ID, "model-b")).select_by_value(NAMES[1])
    translate(page, beam=2, n_best=1)
    results = page.find_elements(By.CSS_SELECTOR, "#results .columns.two > .result")
    assert [r.get_attribute("data-model") for r in results] == list(NAMES)
    first, second = (text(r.find_element(By.CSS_SELECTOR, ".translation")) for r in results)
    assert first == second  # one run, served twice
    assert len(page.find_elements(By.CSS_SELECTOR, "table.heatmap")) == 2


def test_an_api_error_is_shown(page: Any, server: str) -> None:
    status, answer = post(server, "/api/translate", translate_request(2, 3))
    assert status == 400, answer
    assert answer["error"].startswith("n_best 3 is larger than beam_size 2;")
    fill(page, "sentences", SENTENCE)
    fill(page, "beam", "2")
    fill(page, "nbest", "3")
    submit(page)
    error = page.find_element(By.ID, "error")
    assert error.is_displayed()
    assert error.text == answer["error"]
    assert not page.find_elements(By.CSS_SELECTOR, "#results .result")


def test_screenshot_script(server: str, tmp_path: Path) -> None:
    """scripts/screenshot.py on a server already up (--url): a PNG of the whole page."""
    out = tmp_path / "serve.png"
    script = ROOT / "scripts" / "screenshot.py"
    args = ["--url", server, "--sentence", SENTENCE, "--reference", REFERENCE, "--out", str(out)]
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    width, height = struct.unpack(">II", out.read_bytes()[16:24])  # the PNG's IHDR
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert width == 1400 and height >= 900
