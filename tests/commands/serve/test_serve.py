"""`nmt serve`'s API on a tiny trained run: each endpoint gives what the CLI gives for the same
options (`nmt translate`, `nmt score`, `nmt align`), the attention is the search's own, every
limit and malformed request gets its 4xx and one error line (and the server answers the next
request), an exception while decoding is a 500 that leaves the server serving, and requests
that arrive together are decoded together, each getting what it gets alone."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from clirun import nmt
from serving import uvicorn_thread

pytest.importorskip("fastapi", reason="nmt serve's extra is not installed")
pytest.importorskip("uvicorn", reason="nmt serve's extra is not installed")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from nmt.commands.serve import app as serve_app  # noqa: E402
from nmt.commands.serve.app import ServedModel, create_app  # noqa: E402
from nmt.commands.serve.batching import Batching  # noqa: E402
from nmt.commands.serve.limits import Limits  # noqa: E402
from nmt.decoding.options import SearchOptions  # noqa: E402
from nmt.decoding.workers import worker_count  # noqa: E402

SOURCES = ["sol luna", "", "mar rio casa", "agua fuego"]
TARGETS = ["LUNA SOL", "X", "CASA RIO MAR", ""]
LIMITS = Limits(max_sentences=4, max_chars=200, max_body=2000, max_beam=5)  # the run's beam: 5


@pytest.fixture(scope="module")
def served(run: Path) -> list[ServedModel]:
    """The tiny run, served twice: as ``run`` and as ``run-2``."""
    return [ServedModel.load(run, device="cpu"), ServedModel.load(run, "run-2", device="cpu")]


@pytest.fixture(scope="module")
def client(served: list[ServedModel]) -> Iterator[TestClient]:
    app = create_app(served, LIMITS)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def cli_lines(run: Path, *options: str, stdin: list[str] = SOURCES) -> list[str]:
    """What `nmt translate` (or another command, first in ``options``) writes, line by line."""
    text = "".join(line + "\n" for line in stdin).encode()
    result = nmt(*options[:1], "-m", str(run), "--device", "cpu", *options[1:], stdin=text)
    assert result.code == 0, result.err
    return result.out.split("\n")[:-1]


def translate(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/api/translate", json={"sentences": SOURCES, **body})
    assert response.status_code == 200, response.text
    return response.json()


# --- the same outputs as the CLI --------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "body"),
    [([], {}), (["--beam", "1"], {"beam_size": 1}), (["--beam", "3"], {"beam_size": 3})],
)
def test_translate_gives_the_lines_of_nmt_translate(
    client: TestClient, run: Path, options: list[str], body: dict[str, Any]
) -> None:
    """Each text is the line `nmt translate` writes (an empty sentence: "", score null)."""
    reply = translate(client, **body)
    assert [t["text"] for t in reply["translations"]] == cli_lines(run, "translate", *options)
    assert reply["model"] == "run" and reply["translations"][1]["score"] is None
    assert reply["translations"][1]["hypotheses"] == []


def test_scores_are_those_of_translate_scores(client: TestClient, run: Path) -> None:
    """score: the number `nmt translate --scores` prints before the text (4 decimals)."""
    reply = translate(client, beam_size=3)
    lines = cli_lines(run, "translate", "--scores", "--beam", "3")
    for line, translation in zip(lines, reply["translations"], strict=True):
        score, text = line.split("\t")
        assert text == translation["text"]
        if translation["score"] is not None:
            assert f"{translation['score']:.4f}" == score
            assert translation["log_prob"] <= 0.0


def test_n_best_lists_are_those_of_translate_n_best(client: TestClient, run: Path) -> None:
    """hypotheses: the rows of `nmt translate --n-best 3 --beam 3`, best first; the best is
    the text."""
    reply = translate(client, beam_size=3, n_best=3)
    rows = [
        f"{i}\t{rank}\t{h['score']:.4f}\t{h['text']}"
        for i, t in enumerate(reply["translations"])
        for rank, h in enumerate(t["hypotheses"], start=1)
    ]
    expected = cli_lines(run, "translate", "--n-best", "3", "--beam", "3")
    assert rows == [row for row in expected if not row.startswith("1\t")]  # "" has none
    for t in reply["translations"]:
        assert len(t["hypotheses"]) in (0, 3)
        assert not t["hypotheses"] or t["hypotheses"][0]["text"] == t["text"]


def test_prefixes_and_constraints_are_those_of_translate(
    client: TestClient, run: Path, tmp_path: Path
) -> None:
    """prefixes and constraints, one per sentence: the outputs of --prefix and
    --constraints files."""
    prefixes, constraints = ["LUNA", "", "CASA RIO", ""], [["SOL"], [], ["MAR", "CASA"], []]
    (tmp_path / "prefix").write_text("".join(p + "\n" for p in prefixes), encoding="utf-8")
    rows = "".join(json.dumps(c) + "\n" for c in constraints)
    (tmp_path / "constraints.jsonl").write_text(rows, encoding="utf-8")
    reply = translate(client, prefixes=prefixes)
    expected = cli_lines(run, "translate", "--prefix", str(tmp_path / "prefix"))
    assert [t["text"] for t in reply["translations"]] == expected
    assert expected[0].startswith("LUNA")
    reply = translate(client, constraints=constraints, beam_size=4)
    jsonl = str(tmp_path / "constraints.jsonl")
    expected = cli_lines(run, "translate", "--constraints", jsonl, "--beam", "4")
    assert [t["text"] for t in reply["translations"]] == expected
    assert "SOL" in expected[0]


def test_alignments_are_those_of_translate(client: TestClient, run: Path, tmp_path: Path) -> None:
    """alignment: the links of `nmt translate --alignments` (none for an empty line)."""
    reply = translate(client, alignments=True)
    links = tmp_path / "links.txt"
    cli_lines(run, "translate", "--alignments", str(links))
    pharaoh = [" ".join(f"{i}-{j}" for i, j in t["alignment"]) for t in reply["translations"]]
    assert pharaoh == links.read_text(encoding="utf-8").splitlines()
    assert reply["translations"][1]["alignment"] == []
    assert reply["translations"][0]["attention"] is None  # not asked for


def test_score_gives_the_numbers_of_nmt_score(client: TestClient, run: Path) -> None:
    """log_prob, score and tokens: `nmt score --tokens` to 4 decimals; an empty source: nulls."""
    response = client.post(
        "/api/score", json={"sources": SOURCES, "targets": TARGETS, "tokens": True}
    )
    assert response.status_code == 200, response.text
    tsv = [f"{s}\t{t}" for s, t in zip(SOURCES, TARGETS, strict=True)]
    rows = [line.split("\t") for line in cli_lines(run, "score", "--tokens", stdin=tsv)]
    for row, scored in zip(rows, response.json()["scores"], strict=True):
        if scored["log_prob"] is None:
            assert row == ["", "", "", ""] and scored["tokens"] is None
            continue
        assert [f"{scored['log_prob']:.4f}", f"{scored['score']:.4f}"] == row[:2]
        assert " ".join(f"{v:.4f}" for _, v in scored["tokens"]) == row[2]
        assert " ".join(p for p, _ in scored["tokens"]) == row[3]
    options = {"length_penalty": 0.6, "coverage_penalty": 0.3}
    response = client.post("/api/score", json={"sources": SOURCES, "targets": TARGETS, **options})
    flags = ["--length-penalty", "0.6", "--coverage-penalty", "0.3"]
    lines = cli_lines(run, "score", *flags, stdin=tsv)
    for line, scored in zip(lines, response.json()["scores"], strict=True):
        if scored["score"] is not None:
            assert f"{scored['log_prob']:.4f}\t{scored['score']:.4f}" == line


@pytest.mark.parametrize("extract", ["argmax", "gdfa"])
def test_align_gives_the_links_of_nmt_align(client: TestClient, run: Path, extract: str) -> None:
    sources, targets = ["sol luna agua", "fuego", ""], ["AGUA LUNA SOL", "FUEGO", "SOL"]
    body = {"sources": sources, "targets": targets, "extract": extract}
    response = client.post("/api/align", json=body)
    assert response.status_code == 200, response.text
    tsv = [f"{s}\t{t}" for s, t in zip(sources, targets, strict=True)]
    expected = cli_lines(run, "align", "--extract", extract, stdin=tsv)
    alignments = response.json()["alignments"]
    assert [a["pharaoh"] for a in alignments] == expected
    assert [" ".join(f"{i}-{j}" for i, j in a["links"]) for a in alignments] == expected
    assert alignments[0]["source_words"] == ["sol", "luna", "agua"] and alignments[2]["links"] == []


# --- attention ---------------------------------------------------------------------------------


def _check_attention(attention: dict[str, Any]) -> None:
    """(target pieces, </s>) x (source pieces, </s>), rows summing to 1, each piece's word."""
    weights = attention["weights"]
    assert len(weights) == len(attention["target"]) and attention["target"][-1] == "</s>"
    assert all(len(row) == len(attention["source"]) for row in weights)
    assert all(sum(row) == pytest.approx(1.0, abs=1e-5) for row in weights)
    assert all(w >= 0.0 for row in weights for w in row)
    for side in ("source", "target"):
        words = attention[f"{side}_piece_word"]
        assert len(words) == len(attention[side]) and words[-1] is None
        assert sorted(set(words[:-1])) == list(range(len(attention[f"{side}_words"])))


def test_attention_is_the_search_s_own(client: TestClient, served: list[ServedModel]) -> None:
    """attention: the best hypothesis's matrix as Translator.translate gives it with
    SearchOptions(attention=True), with its pieces; none for an empty sentence."""
    reply = translate(client, beam_size=3, attention=True)
    translator = served[0].translator
    decoding = translator.config.decoding.model_copy(update={"beam_size": 3})
    items = translator.translate(SOURCES, decoding, SearchOptions(attention=True))
    for source, item, t in zip(SOURCES, items, reply["translations"], strict=True):
        if not source:
            assert t["attention"] is None
            continue
        attention = t["attention"]
        _check_attention(attention)
        assert item.best is not None and item.best.alphas is not None
        assert torch.tensor(attention["weights"]).equal(item.best.alphas.float())
        tokenizer = translator.tokenizer
        assert attention["source"] == tokenizer.src_pieces(item.src_ids)
        assert attention["target"] == tokenizer.trg_pieces_and_eos(item.best.tokens)
        assert attention["source_words"] == source.split()
        assert attention["target_words"] == t["text"].split()


def test_score_attention_is_over_the_given_target(client: TestClient) -> None:
    body = {"sources": SOURCES, "targets": TARGETS, "attention": True}
    scores = client.post("/api/score", json=body).json()["scores"]
    assert scores[1]["attention"] is None  # an empty source
    for target, scored in zip(TARGETS, scores, strict=True):
        if scored["attention"] is not None:
            _check_attention(scored["attention"])
            assert scored["attention"]["target_words"] == target.split()
    assert scores[3]["attention"]["target"] == ["</s>"]  # an empty target: EOS alone


# --- what the server says of itself ------------------------------------------------------------


def test_health_models_vocabulary_and_docs(client: TestClient, run: Path) -> None:
    assert client.get("/api/health").json() == {"status": "ok", "models": ["run", "run-2"]}
    models = client.get("/api/models").json()["models"]
    assert [m["name"] for m in models] == ["run", "run-2"]
    info = models[0]
    assert info["path"] == str(run) and info["device"] == "cpu" and info["precision"] == "fp32"
    plan = info["decoding_plan"]  # of full batches under the run's decoding section
    assert plan["precision"] == "fp32" and plan["reason"].startswith("auto: ")
    assert plan["loop"] == "host" and plan["backend"] == "torch" and plan["shortlist"] is True
    decoding = info["config"]["decoding"]  # two full batches: auto's rule on this CPU
    full = [decoding["batch_size"]] * 2
    assert plan["workers"] == worker_count(decoding["workers"], torch.device("cpu"), full)
    assert plan["line"].startswith("Decoding plan: fp32 (auto: ")  # as nmt eval prints it
    assert info["alignment_head"] is False
    assert info["summary"] == "Luong general attention, input feeding; bi-GRU 8, GRU 8; 40 pieces"
    assert info["config"]["model"]["attention"]["score"] == "general"
    assert info["vocabulary"] == {"source": 40, "target": 40, "joint": True}
    training = info["training"]
    assert training["step"] == 3 and training["best_metric"] == "bleu"
    assert isinstance(training["dev_loss"], float) and isinstance(training["dev_bleu"], float)
    vocabulary = client.get("/api/models/run-2/vocabulary?side=source&offset=2&limit=3").json()
    assert {key: vocabulary[key] for key in ("side", "size", "offset")} == {
        "side": "source",
        "size": 40,
        "offset": 2,
    }
    assert vocabulary["pieces"][:2] == ["<s>", "</s>"] and len(vocabulary["pieces"]) == 3
    assert len(client.get("/api/models/run/vocabulary").json()["pieces"]) == 40
    assert client.get("/docs").status_code == 200
    paths = set(client.get("/openapi.json").json()["paths"])
    assert {"/api/translate", "/api/score", "/api/align", "/api/models", "/api/health"} <= paths


def test_a_named_model_is_used(client: TestClient) -> None:
    plain = translate(client)
    named = translate(client, model="run-2")
    assert named["model"] == "run-2" and named["translations"] == plain["translations"]


def test_the_page_and_its_files(
    served: list[ServedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/ is the page's index.html, /page/NAME its other files; nothing outside the folder."""
    (tmp_path / "index.html").write_text("<title>nmt</title>", encoding="utf-8")
    (tmp_path / "page.js").write_text("let x = 1;", encoding="utf-8")
    monkeypatch.setattr(serve_app, "PAGE", tmp_path)
    with TestClient(create_app(served)) as page_client:
        index = page_client.get("/")
        assert index.status_code == 200 and index.text == "<title>nmt</title>"
        assert index.headers["content-type"].startswith("text/html")
        script = page_client.get("/page/page.js")
        assert script.text == "let x = 1;" and "javascript" in script.headers["content-type"]
        for path in ("/page/missing.css", "/page/.hidden", "/page/..%2Fapp.py"):
            missing = page_client.get(path)
            assert missing.status_code == 404 and "error" in missing.json(), path


def test_the_favicon(client: TestClient) -> None:
    """/favicon.ico and the page's icon link are the page's SVG icon: no 404 in the browser."""
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.text.lstrip().startswith("<svg")
    link = re.search(r'<link rel="icon"[^>]* href="([^"]+)"', client.get("/").text)
    assert link is not None and client.get(f"/{link[1]}").content == icon.content


HEADS = [
    "/",
    "/page/page.js",
    "/favicon.ico",
    "/api/health",
    "/api/models",
    "/api/models/run/vocabulary",
    "/docs",
    "/openapi.json",
]


@pytest.mark.parametrize("path", HEADS)
def test_head_is_answered_wherever_get_is(client: TestClient, path: str) -> None:
    """HEAD gets GET's status and headers, without the body."""
    get, head = client.get(path), client.head(path)
    assert get.status_code == head.status_code == 200, head.text
    assert head.content == b"" and get.content
    for header in ("content-type", "content-length"):
        assert head.headers[header] == get.headers[header], header


def test_head_elsewhere_and_under_uvicorn(server: str) -> None:
    """Under uvicorn too; a path without GET: its 404 or 405, without the body."""
    with httpx.Client(base_url=server, timeout=30) as http:
        health = http.head("/api/health")
        assert health.status_code == 200 and health.content == b""
        assert int(health.headers["content-length"]) == len(http.get("/api/health").content)
        missing, post_only = http.head("/api/nowhere"), http.head("/api/translate")
        assert missing.status_code == 404 and missing.content == b""
        assert post_only.status_code == 405 and post_only.content == b""


# --- errors -------------------------------------------------------------------------------------


def test_a_method_not_allowed_is_a_405_naming_the_allowed_ones_in_its_allow_header(
    client: TestClient,
) -> None:
    """HTTP requires a 405's Allow header (RFC 9110, 15.5.6)."""
    response = client.get("/api/translate")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json() == {"error": "GET /api/translate: not allowed; this endpoint takes POST"}


TOO_LONG = "sol " * 60  # 240 characters: past LIMITS.max_chars
LONE = "\ud800"  # a lone surrogate: valid in JSON text (sent escaped), no Unicode character
NOT_UNICODE = "not valid Unicode (a lone surrogate)"


def escaped(body: dict[str, Any]) -> bytes:
    """``body`` as JSON with every character past ASCII escaped (a lone surrogate too)."""
    return json.dumps(body).encode()


BAD_REQUESTS = [
    # (endpoint, JSON body or raw bytes, status, what the error line says)
    ("translate", b"{not json", 422, "request body: not valid JSON"),
    ("translate", b"", 422, "request body: missing"),
    ("translate", b"[1, 2]", 422, "request body"),
    ("translate", {}, 422, "sentences: Field required"),
    ("translate", {"sentences": "sol luna"}, 422, "sentences: Input should be a valid list"),
    ("translate", {"sentences": [1]}, 422, "sentences.0: Input should be a valid string"),
    ("translate", {"sentences": ["sol"], "beam_size": "3"}, 422, "beam_size: Input should be"),
    ("translate", {"sentences": ["sol"], "beam_size": True}, 422, "beam_size: Input should be"),
    ("translate", {"sentences": ["sol"], "n_best": 0}, 422, "n_best: Input should be greater"),
    ("translate", {"sentences": ["sol"], "beam": 3}, 422, "beam: not a field of this request"),
    ("translate", {"sentences": ["sol"], "model": "nope"}, 404, "model: 'nope' is not served"),
    ("translate", {"sentences": ["sol"] * 5}, 413, "sentences: 5 given, more than this server's limit of 4"),
    ("translate", {"sentences": [TOO_LONG]}, 413, "text: 240 characters, more than this server's limit of 200"),
    ("translate", {"sentences": ["sol"], "prefixes": [TOO_LONG]}, 413, "text: 243 characters"),
    ("translate", {"sentences": ["sol"], "beam_size": 6}, 413, "beam_size: 6, more than this server's limit of 5"),
    ("translate", {"sentences": ["sol"], "beam_size": 1001}, 413, "beam_size: 1001, more than this server's limit of 5 (nmt serve --max-beam)"),
    ("translate", {"sentences": ["sol"], "beam_size": 10**30}, 413, f"beam_size: {10**30}, more than this server's limit of 5 (nmt serve --max-beam)"),
    ("translate", {"sentences": ["sol"], "beam_size": 0}, 400, "beam_size: got 0; input should be greater than or equal to 1"),
    ("translate", {"sentences": ["sol"], "beam_size": 2, "n_best": 3}, 400, "n_best 3 is larger than beam_size 2; a beam keeps at most that many hypotheses: raise beam_size or lower n_best"),
    ("translate", {"sentences": ["sol"], "beam_size": 1, "constraints": [["SOL"]]}, 400, "constraints needs a beam of 2 or more, got beam_size 1"),
    ("translate", {"sentences": ["sol"], "beam_size": 3, "constraints": [["\u4e2d"]]}, 400, "constraints.0: '\u4e2d' has pieces the model's target vocabulary lacks"),
    ("translate", {"sentences": ["sol", "mar"], "beam_size": 3, "constraints": [[], ["MAR", "\U0001f600"]]}, 400, "constraints.1: '\U0001f600' has pieces"),
    ("translate", {"sentences": ["sol"], "beam_size": 3, "constraints": [[""]]}, 400, "constraints.0: an empty constraint phrase"),
    ("translate", {"sentences": ["sol", "mar"], "beam_size": 3, "constraints": [["SOL"], ["   "]]}, 400, "constraints.1: an empty constraint phrase"),
    ("translate", {"sentences": ["sol", "mar"], "prefixes": ["", "LUNA \u4e2d"]}, 400, "prefixes.1: 'LUNA \u4e2d' has pieces"),
    ("translate", {"sentences": ["sol", "mar"], "prefixes": ["LUNA"]}, 400, "1 prefixes for 2 sentences"),
    ("translate", {"sentences": ["sol", "mar"], "prefixes": ["", "LUNA LUNA"], "no_repeat_ngram": 1}, 400, "prefixes.1: 'LUNA LUNA' repeats a piece, which no_repeat_ngram 1 forbids in every output"),
    ("translate", {"sentences": ["sol"], "beam_size": 3, "constraints": [["SOL SOL"]], "no_repeat_ngram": 1}, 400, "constraints.0: 'SOL SOL' repeats a piece"),
    ("translate", escaped({"sentences": ["sol", f"{LONE} mar"]}), 422, f"sentences.1: {NOT_UNICODE}"),
    ("translate", escaped({"sentences": ["sol"], "prefixes": [LONE]}), 422, f"prefixes.0: {NOT_UNICODE}"),
    ("translate", escaped({"sentences": ["sol"], "constraints": [["SOL", LONE]]}), 422, f"constraints.0.1: {NOT_UNICODE}"),
    ("translate", escaped({"sentences": ["sol"], "model": LONE}), 422, f"model: {NOT_UNICODE}"),
    ("score", escaped({"sources": [LONE], "targets": ["SOL"]}), 422, f"sources.0: {NOT_UNICODE}"),
    ("score", escaped({"sources": ["sol"], "targets": [f"SOL{LONE}"]}), 422, f"targets.0: {NOT_UNICODE}"),
    ("align", escaped({"sources": [LONE], "targets": ["SOL"]}), 422, f"sources.0: {NOT_UNICODE}"),
    ("align", escaped({"sources": ["sol"], "targets": ["SOL"], "extract": LONE}), 422, f"extract: {NOT_UNICODE}"),
    ("score", {"sources": ["sol", "mar"], "targets": ["SOL"]}, 400, "targets: 1 for 2 sources"),
    ("score", {"sources": ["sol"]}, 422, "targets: Field required"),
    ("score", {"sources": ["sol"] * 5, "targets": ["SOL"] * 5}, 413, "sources: 5 given"),
    ("align", {"sources": ["sol"], "targets": ["SOL", "MAR"]}, 400, "targets: 2 for 1 sources"),
    ("align", {"sources": ["sol"], "targets": ["SOL"], "extract": "max"}, 400, "extract 'max': expected one of"),
    ("align", {"sources": ["sol"], "targets": ["SOL"], "extract": "threshold", "threshold": 2.0}, 400, "threshold 2.0: expected a value in (0, 1]"),
    ("align", {"sources": ["sol"], "targets": ["SOL"], "threshold": 0.3}, 400, "threshold 0.3: only extract threshold reads it (not argmax); give both, or neither"),
    ("models/nope/vocabulary", None, 404, "model: 'nope' is not served"),
    ("models/run/vocabulary?side=middle", None, 422, "side: Input should be 'source' or 'target'"),
    ("nowhere", None, 404, "GET /api/nowhere: no such endpoint"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body", "status", "message"), BAD_REQUESTS)
def test_a_bad_request_gets_its_status_and_one_error_line(
    client: TestClient, endpoint: str, body: Any, status: int, message: str
) -> None:
    """Each malformed request or passed limit: its 4xx, {"error": one line naming the field
    or limit}; the next request is answered as ever."""
    url = f"/api/{endpoint}"
    if body is None:
        response = client.get(url)
    elif isinstance(body, bytes):
        response = client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(url, json=body)
    assert response.status_code == status, response.text
    assert list(response.json()) == ["error"]
    error = response.json()["error"]
    assert message in error and "\n" not in error, error
    again = client.post("/api/translate", json={"sentences": ["sol luna"]})
    assert again.status_code == 200 and again.json()["translations"][0]["text"]


UNREADABLE = [
    # (a body Python's json gives up on though it is no malformed JSON, what the error says)
    (b'{"sentences": ["\xff"]}', "not valid UTF-8 (byte 0xff at offset 16: invalid start byte)"),
    ('{"sentences": ["el sol está"]}'.encode("latin-1"), "not valid UTF-8 (byte 0xe1 at offset 26"),
    (b'{"sentences": ["sol"], "n_best": 1' + b"0" * 5000 + b"}", "not valid JSON (an integer too long"),
    (b"[" * 100_000, "not valid JSON (nested too deep)"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message"), UNREADABLE)
def test_a_body_json_cannot_read_is_a_422_like_malformed_json(
    served: list[ServedModel], body: bytes, message: str
) -> None:
    """Not UTF-8, an integer past Python's digit limit, lists nested past its recursion
    limit: the 422 of malformed JSON and one line; nothing raised in the app (no traceback
    in the log)."""
    with TestClient(create_app(served)) as strict:  # the default limits: 1,000,000 bytes
        response = strict.post(
            "/api/translate", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 422, response.text
    assert list(response.json()) == ["error"]
    assert response.json()["error"].startswith(f"request body: {message}")


def test_the_body_limit_by_content_length(client: TestClient) -> None:
    big = json.dumps({"sentences": ["sol " * 600]}).encode()
    response = client.post(
        "/api/translate", content=big, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"].startswith(
        f"request body: {len(big)} bytes, more than this server's limit of 2000 bytes"
    )


def _chunks(count: int) -> Iterator[bytes]:
    yield b'{"sentences": ["'
    for _ in range(count):
        yield b"sol luna " * 10
    yield b'"]}'


@pytest.fixture(scope="module")
def server(served: list[ServedModel]) -> Iterator[str]:
    """The app (LIMITS) in uvicorn on a free local port: its base URL."""
    with uvicorn_thread(create_app(served, LIMITS)) as url:
        yield url


def test_the_body_limit_of_a_chunked_body(server: str) -> None:
    """A body without Content-Length (chunked) is cut off once past the limit: 413."""
    with httpx.Client(base_url=server, timeout=30) as http:
        small = http.post(
            "/api/translate", content=_chunks(2), headers={"content-type": "application/json"}
        )
        assert small.status_code == 200, small.text
        assert small.request.headers["transfer-encoding"] == "chunked"
        big = http.post(
            "/api/translate", content=_chunks(100), headers={"content-type": "application/json"}
        )
        assert big.status_code == 413
        assert big.json()["error"].startswith(
            "request body: more than this server's limit of 2000 bytes"
        )
    with httpx.Client(base_url=server, timeout=30) as http:
        again = http.post("/api/translate", json={"sentences": ["sol luna"]})
        assert again.status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_a_client_that_sends_the_whole_body_first_gets_the_413(server: str, chunked: bool) -> None:
    """urllib writes the whole body before it reads the reply: a body past the limit, larger
    than the sockets' buffers (5 MB), gets the 413 and its message, not a reset connection."""
    big = json.dumps({"sentences": ["sol luna " * 555_000]}).encode()
    pieces = (big[start : start + 65_536] for start in range(0, len(big), 65_536))
    request = urllib.request.Request(
        f"{server}/api/translate",
        data=pieces if chunked else big,  # an iterator without Content-Length: chunked
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413
    amount = "more than" if chunked else f"{len(big)} bytes, more than"
    assert json.load(refused.value)["error"].startswith(
        f"request body: {amount} this server's limit of 2000 bytes"
    )


def _raw_post(server: str, head: str, body: bytes) -> bytes:
    """The reply's first bytes to a POST of ``head`` and ``body``, the client then silent."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /api/translate HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
        sock.sendall(body)
        return sock.recv(100)


def test_the_discarding_of_a_body_past_the_limit_is_bounded(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that stalls gets its 413 after DISCARD_SECONDS; one declared past DISCARD_BYTES
    more than the limit, at once, none of it read."""
    monkeypatch.setattr(serve_app, "DISCARD_SECONDS", 0.5)
    started = time.monotonic()
    stalled = _raw_post(server, "Content-Length: 100000\r\n", b"x" * 3000)
    assert stalled.startswith(b"HTTP/1.1 413") and time.monotonic() - started < 20
    declared = 2000 + serve_app.DISCARD_BYTES + 1
    unread = _raw_post(server, f"Content-Length: {declared}\r\n", b"")
    assert unread.startswith(b"HTTP/1.1 413")


def _fail_on_boom(translator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The translator raises a RuntimeError for any batch of lines with "boom" among them."""
    original = translator.translate

    def failing(lines: list[str], *args: Any, **kwargs: Any) -> Any:
        if "boom" in lines:
            raise RuntimeError("a decoding failure")
        return original(lines, *args, **kwargs)

    monkeypatch.setattr(translator, "translate", failing)


def test_an_exception_while_decoding_is_a_500_and_the_server_goes_on(
    client: TestClient, served: list[ServedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = translate(client)
    _fail_on_boom(served[0].translator, monkeypatch)
    response = client.post("/api/translate", json={"sentences": ["sol", "boom"]})
    assert response.status_code == 500
    assert response.json() == {
        "error": "internal error: RuntimeError: a decoding failure; the server goes on (its "
        "log has the traceback)"
    }
    assert translate(client)["translations"] == before["translations"]


# --- dynamic batching ---------------------------------------------------------------------------


async def _concurrently(app: FastAPI, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The replies to ``bodies``, all sent at once."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://serve") as http:
        responses = await asyncio.gather(
            *(http.post("/api/translate", json=body) for body in bodies)
        )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def _outputs(reply: dict[str, Any]) -> list[tuple[str, str | None, list[str]]]:
    """Each translation's text, score to 4 decimals and n-best texts."""
    return [
        (
            t["text"],
            None if t["score"] is None else f"{t['score']:.4f}",
            [f"{h['score']:.4f} {h['text']}" for h in t["hypotheses"]],
        )
        for t in reply["translations"]
    ]


BODIES = [
    {"sentences": ["sol luna"], "beam_size": 2},
    {"sentences": ["mar rio casa", ""], "beam_size": 2},
    {"sentences": ["agua"], "beam_size": 2, "prefixes": ["AGUA"]},
    {"sentences": ["fuego tierra aire"], "beam_size": 2, "n_best": 2},
    {"sentences": ["gato perro"], "beam_size": 2, "constraints": [["GATO"]]},
    {"sentences": ["libro"], "beam_size": 3},
    {"sentences": ["casa sol", "luna"], "beam_size": 3},
    {"sentences": ["rio mar"], "beam_size": 2},
]


def test_requests_that_arrive_together_are_decoded_together(
    client: TestClient, served: list[ServedModel]
) -> None:
    """Concurrent requests with the same options share a decoding (batched_with: the
    sentences of the group, theirs included), others are decoded apart; each gets exactly
    what it gets alone."""
    alone = [client.post("/api/translate", json=body).json() for body in BODIES]
    app = create_app(served, batching=Batching(batch_window_ms=1000, max_batch=64))
    replies = asyncio.run(_concurrently(app, BODIES))
    for body, reply, single in zip(BODIES, replies, alone, strict=True):
        assert _outputs(reply) == _outputs(single), body
        assert single["batched_with"] == len(body["sentences"])
    together = [reply["batched_with"] for reply in replies]
    # beam 2 with one sentence a hypothesis: 5 requests (6 sentences) alike; n_best 2 apart;
    # beam 3: 2 requests (3 sentences)
    assert together == [6, 6, 6, 1, 6, 3, 3, 6]


def test_max_batch_caps_a_group(served: list[ServedModel]) -> None:
    """Four requests of a sentence each, at most two sentences a group: two groups of two
    (each decoded as soon as it is full)."""
    bodies = [{"sentences": [s]} for s in ("sol", "luna", "mar", "rio")]
    app = create_app(served, batching=Batching(batch_window_ms=5000, max_batch=2))
    started = time.perf_counter()
    together = [reply["batched_with"] for reply in asyncio.run(_concurrently(app, bodies))]
    assert together == [2, 2, 2, 2]
    assert time.perf_counter() - started < 4.0  # full groups did not wait out the window


def test_no_batching_decodes_each_request_alone(served: list[ServedModel]) -> None:
    app = create_app(served, batching=Batching(no_batching=True))
    replies = asyncio.run(_concurrently(app, BODIES))
    assert [r["batched_with"] for r in replies] == [len(b["sentences"]) for b in BODIES]


def test_a_failing_request_does_not_fail_those_decoded_with_it(
    served: list[ServedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose decoding fails is decoded again request by request: only the request
    that fails gets the 500."""
    _fail_on_boom(served[0].translator, monkeypatch)
    app = create_app(served, batching=Batching(batch_window_ms=5000, max_batch=3))

    async def send() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as http:
            bodies = [{"sentences": [s]} for s in ("sol", "boom", "mar")]
            return await asyncio.gather(*(http.post("/api/translate", json=b) for b in bodies))

    good, bad, other = asyncio.run(send())
    assert bad.status_code == 500 and "a decoding failure" in bad.json()["error"]
    assert good.status_code == other.status_code == 200
    assert good.json()["batched_with"] == other.json()["batched_with"] == 1  # retried alone
