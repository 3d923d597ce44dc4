"""The Python API (nmt.load -> translate, score): the CLI's outputs and numbers, n-best
candidates, ensembles, prefixes and constraints, the CLI's errors as nmt.errors exceptions,
and an `import nmt` that does not load torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from clirun import nmt

import nmt as nmt_api
from nmt.api import Model, Score, ScoredTranslation
from nmt.errors import CheckpointError, ConfigError, DataError, NMTError

SOURCES = ["sol luna", "", "mar rio casa", "agua fuego"]
TARGETS = ["LUNA SOL", "X", "CASA RIO MAR", ""]


@pytest.fixture(scope="module")
def model(run: Path) -> Model:
    return nmt_api.load(run)


@pytest.fixture(scope="module")
def cli_lines(run: Path) -> list[str]:
    """The CLI's translations of SOURCES."""
    result = nmt("translate", "-m", str(run), stdin="".join(s + "\n" for s in SOURCES).encode())
    assert result.code == 0, result.err
    return result.out.split("\n")[:-1]


def test_a_string_gives_the_cli_output_as_a_str(model: Model, run: Path) -> None:
    """translate("sol luna") is a str, the line `nmt translate` writes for it."""
    result = nmt("translate", "-m", str(run), stdin=b"sol luna\n")
    assert result.code == 0, result.err
    text = model.translate("sol luna")
    assert isinstance(text, str)
    assert text == result.out.removesuffix("\n")


def test_a_list_gives_a_list_of_the_cli_lines(model: Model, cli_lines: list[str]) -> None:
    """A list in, a list of str out, line for line the CLI's (an empty line: "")."""
    texts = model.translate(SOURCES)
    assert isinstance(texts, list) and all(isinstance(t, str) for t in texts)
    assert texts == cli_lines and texts[1] == ""


def test_beam_size_option_is_the_cli_beam(model: Model, run: Path) -> None:
    """translate(..., beam_size=1) is `nmt translate --beam 1`."""
    stdin = "".join(s + "\n" for s in SOURCES).encode()
    result = nmt("translate", "-m", str(run), "--beam", "1", stdin=stdin)
    assert model.translate(SOURCES, beam_size=1) == result.out.split("\n")[:-1]


def test_n_best_gives_candidates_sorted_by_score(model: Model, cli_lines: list[str]) -> None:
    """n_best=2: per sentence two ScoredTranslations, best first, with float scores and log-probs;
    the first is the 1-best translation; an empty line has none."""
    lists = model.translate(SOURCES, n_best=2)
    assert isinstance(lists, list) and len(lists) == len(SOURCES)
    assert lists[1] == []
    for i, candidates in enumerate(lists):
        if not SOURCES[i]:
            continue
        assert len(candidates) == 2
        assert all(isinstance(c, ScoredTranslation) for c in candidates)
        assert candidates[0].score >= candidates[1].score
        for c in candidates:
            assert isinstance(c.log_prob, float) and isinstance(c.score, float)
            assert c.log_prob <= 0.0
        assert candidates[0].text == cli_lines[i]
    single = model.translate("sol luna", n_best=2)
    assert [c.text for c in single] == [c.text for c in lists[0]]


def test_n_best_candidates_score_as_the_cli_n_best(model: Model, run: Path) -> None:
    """The candidates' texts and scores are the rows of `nmt translate --n-best 3 --beam 3`."""
    stdin = "".join(s + "\n" for s in SOURCES).encode()
    result = nmt("translate", "-m", str(run), "--n-best", "3", "--beam", "3", stdin=stdin)
    assert result.code == 0, result.err
    lists = model.translate(SOURCES, n_best=3, beam_size=3)
    rows = [
        f"{i}\t{rank}\t{c.score:.4f}\t{c.text}"
        for i, candidates in enumerate(lists)
        for rank, c in enumerate(candidates, start=1)
    ]
    expected = [r for r in result.out.splitlines() if not r.startswith("1\t")]
    assert rows == expected


def test_score_equals_the_cli_numbers(model: Model, run: Path, tmp_path: Path) -> None:
    """score(sources, targets) gives `nmt score --tokens`'s log_prob, score and pieces to 4
    decimals; an empty source gives None fields."""
    tsv = "".join(f"{s}\t{t}\n" for s, t in zip(SOURCES, TARGETS, strict=True)).encode()
    result = nmt("score", "-m", str(run), "--tokens", stdin=tsv)
    assert result.code == 0, result.err
    rows = [line.split("\t") for line in result.out.split("\n")[:-1]]
    scores = model.score(SOURCES, TARGETS)
    assert isinstance(scores, list) and len(scores) == len(rows)
    for row, s in zip(rows, scores, strict=True):
        assert isinstance(s, Score)
        if s.log_prob is None:
            assert row == ["", "", "", ""] and s.score is None and s.tokens == []
            continue
        assert f"{s.log_prob:.4f}" == row[0] and f"{s.score:.4f}" == row[1]
        assert " ".join(f"{v:.4f}" for _, v in s.tokens) == row[2]
        assert " ".join(p for p, _ in s.tokens) == row[3]
    assert scores[1].log_prob is None  # the empty source
    assert [p for p, _ in scores[3].tokens] == ["</s>"]  # the empty target
    one = model.score("sol luna", "LUNA SOL")
    assert isinstance(one, Score) and one.log_prob == pytest.approx(scores[0].log_prob, abs=1e-4)


def test_score_options_are_the_cli_options(model: Model, run: Path) -> None:
    """length_penalty and coverage_penalty change the score as --length-penalty and
    --coverage-penalty do; the log-prob stays."""
    tsv = "".join(f"{s}\t{t}\n" for s, t in zip(SOURCES, TARGETS, strict=True)).encode()
    options = ["--length-penalty", "0.6", "--coverage-penalty", "0.3"]
    result = nmt("score", "-m", str(run), *options, stdin=tsv)
    assert result.code == 0, result.err
    rows = [line.split("\t") for line in result.out.split("\n")[:-1]]
    scores = model.score(SOURCES, TARGETS, length_penalty=0.6, coverage_penalty=0.3)
    for row, s in zip(rows, scores, strict=True):
        if s.log_prob is not None:
            assert [f"{s.log_prob:.4f}", f"{s.score:.4f}"] == row


def test_an_ensemble_of_a_run_with_itself(model: Model, run: Path, cli_lines: list[str]) -> None:
    """nmt.load([run, run]) translates as the run and scores as it."""
    both = nmt_api.load([run, str(run)])
    assert len(both.translator.models) == 2
    assert both.translate(SOURCES) == cli_lines
    for a, b in zip(both.score(SOURCES, TARGETS), model.score(SOURCES, TARGETS), strict=True):
        if a.log_prob is None:
            assert b.log_prob is None
            continue
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
        assert a.score == pytest.approx(b.score, abs=1e-4)


def test_prefixes_are_honoured(model: Model, cli_lines: list[str]) -> None:
    """prefixes: each output starts with its prefix; "" leaves the plain output; a single
    sentence takes a single prefix string."""
    prefixes = ["LUNA", "", "CASA RIO", ""]
    texts = model.translate(SOURCES, prefixes=prefixes)
    assert texts[0].startswith("LUNA") and texts[2].startswith("CASA RIO")
    assert texts[1] == "" and texts[3] == cli_lines[3]
    assert model.translate("sol luna", prefixes="LUNA") == texts[0]


def test_constraints_are_honoured(model: Model, cli_lines: list[str]) -> None:
    """constraints: each output contains each phrase; [] leaves the plain output; a single
    sentence takes one list of phrases."""
    constraints = [["SOL"], [], ["MAR", "CASA"], []]
    texts = model.translate(SOURCES, constraints=constraints)
    assert "SOL" in texts[0] and "MAR" in texts[2] and "CASA" in texts[2]
    assert texts[3] == cli_lines[3]
    assert model.translate("sol luna", constraints=["SOL"]) == texts[0]


# ----------------------------------------------------------------------------- errors


def test_beam_size_zero_names_the_key(model: Model) -> None:
    """beam_size=0: ConfigError naming the keyword beam_size."""
    with pytest.raises(ConfigError, match=r"^beam_size: got 0; input should be greater"):
        model.translate("sol luna", beam_size=0)


def test_an_unknown_option_names_it(model: Model) -> None:
    """A misspelt option (beam=5) is a ConfigError naming it, not silently ignored."""
    with pytest.raises(
        ConfigError, match=r"^beam: not a decoding option; did you mean beam_size\?"
    ):
        model.translate("sol luna", beam=5)


def test_constraints_with_greedy_search(model: Model) -> None:
    """constraints with beam_size=1: ConfigError, as --constraints with --beam 1, naming
    the keywords."""
    with pytest.raises(
        ConfigError, match="^constraints needs a beam of 2 or more, got beam_size 1"
    ):
        model.translate("sol luna", constraints=["SOL"], beam_size=1)


def test_more_n_best_than_beam(model: Model) -> None:
    """n_best larger than beam_size: ConfigError, naming the keywords."""
    with pytest.raises(ConfigError, match="^n_best 4 is larger than beam_size 3"):
        model.translate("sol luna", n_best=4, beam_size=3)


def test_a_prefix_that_no_repeat_ngram_forbids(model: Model) -> None:
    """ConfigError naming the entry and the keyword, not an empty translation."""
    with pytest.raises(ConfigError, match="prefixes line 2: 'LUNA LUNA' repeats a piece, "):
        model.translate(["sol", "mar"], prefixes=["", "LUNA LUNA"], no_repeat_ngram=1)
    with pytest.raises(ConfigError, match="which no_repeat_ngram 1 forbids"):
        model.translate("sol", constraints=["SOL SOL"], no_repeat_ngram=1, beam_size=3)


def test_mismatched_sources_and_targets(model: Model) -> None:
    """score with 2 sources and 1 target: DataError naming the counts."""
    with pytest.raises(DataError, match="2 sources but 1 targets"):
        model.score(["sol", "mar"], ["SOL"])


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"prefixes": ["LUNA"]}, "1 prefixes for 2 sentences"),
        ({"constraints": [["SOL"]]}, "1 constraints for 2 sentences"),
        ({"constraints": [["SOL"], [""]]}, "constraints line 2: an empty constraint phrase"),
        ({"prefixes": ["LUNA", "\u4e2d\u6587"]}, "prefixes line 2"),
    ],
)
def test_bad_prefixes_and_constraints(model: Model, options: dict, error: str) -> None:
    """Prefixes or constraints not one per sentence, or not spellable: DataError."""
    with pytest.raises(DataError, match=error):
        model.translate(["sol", "mar"], **options)


def test_loading_a_missing_path(tmp_path: Path) -> None:
    """nmt.load of a path that does not exist: an NMTError (CheckpointError) naming it."""
    missing = tmp_path / "no-such-run"
    with pytest.raises(NMTError, match="no-such-run") as caught:
        nmt_api.load(missing)
    assert isinstance(caught.value, CheckpointError)
    with pytest.raises(DataError):
        nmt_api.load([])


def test_import_nmt_does_not_import_torch() -> None:
    """`import nmt` stays light: torch is loaded only on nmt.load."""
    result = subprocess.run(
        [sys.executable, "-c", "import nmt, sys; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_align_gives_the_cli_links(run: Path, tmp_path: Path) -> None:
    """model.align equals `nmt align` line for line; two strings give one list."""
    model = nmt_api.load(run, device="cpu")
    sources, targets = ["sol luna agua", "fuego", ""], ["AGUA LUNA SOL", "FUEGO", "SOL"]
    tsv = "".join(f"{s}\t{t}\n" for s, t in zip(sources, targets, strict=True)).encode()
    lines = nmt("align", "-m", str(run), "--device", "cpu", stdin=tsv).out.split("\n")[:-1]
    links = model.align(sources, targets)
    assert [" ".join(f"{i}-{j}" for i, j in row) for row in links] == lines
    assert model.align("fuego", "FUEGO") == links[1] and links[2] == []
    with pytest.raises(ConfigError, match="^extract 'max': expected one of"):
        model.align("fuego", "FUEGO", extract="max")


def test_the_model_says_what_precision_it_decodes_in(model: Model, run: Path) -> None:
    assert model.precision.startswith("fp32 (auto: ")  # a model this small: fp32 on any CPU
    assert nmt_api.load(run, precision="fp32").precision == "fp32 (--precision: fp32)"


def test_the_model_says_its_decoding_plan(run: Path) -> None:
    """Before any call, the plan of full batches under the run's decoding section; after
    one, what that call ran: a search's workers and shortlist, scoring's forced pass."""
    model = nmt_api.load(run, device="cpu", precision="fp32")
    assert model.plan.precision == "fp32" and model.plan.reason == "--precision: fp32"
    model.translate(["sol luna", "agua"], shortlist="off", workers=1)
    ran = model.plan
    assert (ran.loop, ran.workers, ran.shortlist, ran.backend) == ("host", 1, False, "torch")
    assert ran.line().startswith("Decoding plan: fp32 (--precision: fp32), ")
    model.translate(["sol luna", "agua"], shortlist="on")
    assert model.plan.shortlist
    model.score(["sol luna"], ["SOL"])
    assert (model.plan.loop, model.plan.workers, model.plan.shortlist) == ("forced", 1, False)
