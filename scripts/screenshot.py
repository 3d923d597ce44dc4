#!/usr/bin/env python3
"""A screenshot of the page of `nmt serve` (docs/serve.png): starts the server on the given
models, opens its page in headless Chromium, translates the given sentences with their
reference and saves the whole page as a PNG.

    .venv/bin/python scripts/screenshot.py --model runs/demo
    .venv/bin/python scripts/screenshot.py --model runs/demo --model runs/bahdanau --out shot.png
    .venv/bin/python scripts/screenshot.py --url http://127.0.0.1:8000   # a server already up

Needs selenium (the dev extra) and Debian's chromium and chromium-driver
(``apt-get install chromium chromium-driver``); Selenium Manager is never run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "En el principio creó Dios los cielos y la tierra."
REFERENCE = "In the beginning God created the heavens and the earth."
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, server: subprocess.Popen | None, timeout: float) -> list[str]:
    """The served models' names once GET /api/health answers (the models load first)."""
    deadline = time.monotonic() + timeout
    while True:
        if server is not None and server.poll() is not None:
            raise SystemExit(f"nmt serve exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/health", timeout=5) as response:
                return list(json.load(response)["models"])
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}: no answer from /api/health in {timeout:.0f} s") from None
            time.sleep(0.5)


@contextlib.contextmanager
def serving(models: list[str], device: str) -> Iterator[str]:
    """`nmt serve` on the models, on a free local port, for as long as the block runs."""
    port = free_port()
    command = [sys.executable, "-m", "nmt", "serve", "--port", str(port), "--device", device]
    for model in models:
        command += ["--model", model]
    server = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout=300)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def chromium(width: int, height: int) -> Iterator[webdriver.Chrome]:
    with tempfile.TemporaryDirectory(prefix="nmt-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def fill(driver: webdriver.Chrome, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    if text:
        field.send_keys(text)


def shoot(url: str, args: argparse.Namespace) -> None:
    with chromium(args.width, args.height) as driver:
        driver.get(f"{url}/")
        wait = WebDriverWait(driver, 120)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model-a option"))
        names = [
            o.get_attribute("value") for o in Select(driver.find_element(By.ID, "model-a")).options
        ]
        if len(names) > 1:
            Select(driver.find_element(By.ID, "model-b")).select_by_value(names[1])
        fill(driver, "sentences", "\n".join(args.sentence or [SENTENCE]))
        default = [] if args.sentence else [REFERENCE]  # the default sentence's reference
        fill(driver, "reference", "\n".join(args.reference or default))
        fill(driver, "beam", str(args.beam))
        fill(driver, "nbest", str(args.nbest))
        run = driver.find_element(By.ID, "results").get_attribute("data-run")
        driver.find_element(By.ID, "translate").click()
        wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-run") != run)
        error = driver.find_element(By.ID, "error")
        if error.is_displayed():
            raise SystemExit(f"the page shows an error: {error.text}")
        # the whole page in one image: the window as tall as the document
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(args.width, max(args.height, int(height) + 20))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", action="append", default=[], help="a run or checkpoint (twice: side by side)"
    )
    parser.add_argument("--url", help="the page of a server already running, instead of --model")
    parser.add_argument(
        "--sentence", action="append", help=f"a source sentence (default: {SENTENCE!r})"
    )
    parser.add_argument(
        "--reference",
        action="append",
        help=f"its reference (default: {REFERENCE!r} for the default sentence)",
    )
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--nbest", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="the server's --device")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "serve.png")
    args = parser.parse_args()
    if bool(args.url) == bool(args.model):
        parser.error("give --model (once or twice) or --url")
    if len(args.model) > 2:
        parser.error("at most two --model: the page shows two side by side")
    if args.url:
        wait_healthy(args.url.rstrip("/"), None, timeout=30)
        shoot(args.url.rstrip("/"), args)
        return
    with serving(args.model, args.device) as url:
        shoot(url, args)


if __name__ == "__main__":
    main()
