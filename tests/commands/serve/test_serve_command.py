"""`nmt serve` as a user types it, before it listens: a bad --model path, the extra not
installed, an address in use, each one line and exit status 2; and the names models are
served under."""

from __future__ import annotations

import inspect
import socket
import sys
from pathlib import Path

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
