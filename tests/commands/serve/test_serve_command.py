"""`nmt serve` as a user types it, before it listens: a bad --model path, the extra not
installed, an address in use, each one line and exit status 2; the names models are served
under; and Ctrl-C while a long sentence decodes, which stops the server at once."""

from __future__ import annotations

import inspect
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from clirun import nmt

from nmt import cli
from nmt.commands.serve.command import ServeRequest, listen
from nmt.commands.serve.models import run_name, unique_names
from nmt.errors import DataError


def test_a_bad_model_path_is_one_line_before_listening(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    result = nmt("serve", "--model", str(missing), "--port", "0")
    assert result.error == (
        f"error: {missing}: no such checkpoint file or run directory; check the path given to --model"
    )


def test_a_later_bad_model_path_is_found_before_any_model_loads(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = nmt("serve", "-m", str(tmp_path / "empty"), "-m", str(tmp_path / "x"))
    assert "no best.pt or last.pt in this run directory" in result.error


def test_without_the_extra_it_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    result = nmt("serve", "--model", str(tmp_path))
    assert result.error == (
        "error: nmt serve needs FastAPI and uvicorn (uvicorn is not installed): "
        "pip install -e '.[serve]'"
    )


def test_an_address_in_use_is_an_error_naming_it() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(DataError, match=f"--host 127.0.0.1 --port {port}: cannot listen"):
            listen("127.0.0.1", port)
    finally:
        taken.close()
    free = listen("127.0.0.1", 0)
    assert free.getsockname()[1] > 0
    free.close()


def test_models_are_named_by_their_run_directories(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    run.mkdir()
    (run / "step-10.pt").write_bytes(b"")
    assert run_name(run) == run_name(run / "step-10.pt") == "demo"
    assert unique_names(["demo", "demo", "other", "demo"]) == ["demo", "demo-2", "other", "demo-3"]


def test_it_listens_on_this_machine_only_unless_told() -> None:
    assert inspect.signature(cli.serve).parameters["host"].default == "127.0.0.1"
    assert ServeRequest(models=[]).host == "127.0.0.1"


def _post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST ``body`` as JSON: the reply's status and text (an error's too)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_ctrl_c_while_a_long_sentence_decodes_stops_it_at_once_with_a_503(run: Path) -> None:
    """The search stops at its next step: the server exits within seconds rather than after
    the decoding, with no traceback, and the request still decoding gets a one-line 503."""
    server = subprocess.Popen(
        [sys.executable, "-m", "nmt", "serve", "--model", str(run), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stderr is not None
    try:
        first = server.stderr.readline()
        found = re.search(r"http://[^/]+/", first)
        assert found, first
        base = found.group(0)
        lines = [first]
        reader = threading.Thread(target=lambda: lines.extend(server.stderr or []), daemon=True)
        reader.start()
        # the printed address takes connections at once (it listens before uvicorn starts)
        urllib.request.urlopen(base + "api/health", timeout=30).close()
        replies: list[tuple[int, str]] = []
        # a long forced prefix: tens of seconds of decoding, step by step
        body = {"sentences": ["sol luna " * 100], "prefixes": ["SOL LUNA " * 400]}
        client = threading.Thread(
            target=lambda: replies.append(_post(base + "api/translate", body))
        )
        client.start()
        time.sleep(1.0)  # decoding by now
        interrupted = time.monotonic()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("the server still runs 15 s after Ctrl-C")
        took = time.monotonic() - interrupted
        client.join(timeout=10)
        reader.join(timeout=10)
    finally:
        server.kill()
        server.wait()
    stderr = "".join(lines)
    assert took < 10, f"exited {took:.1f} s after Ctrl-C"
    assert "Traceback" not in stderr, stderr
    assert replies == [(503, '{"error":"the server is shutting down; send the request again"}')]
