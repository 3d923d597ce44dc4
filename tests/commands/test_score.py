"""`nmt score`: forced scores against float64 teacher forcing, the normalised score, the
per-piece columns, the three ways to give pairs, translate's scores reproduced, n-best
rescoring, ensembles, attention files, and one-line errors for bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import nmt, tiny_config, unchanged, write_config

from nmt.decoding.options import decoding_options
from nmt.decoding.scoring import score_ids
from nmt.decoding.translator import Translator
from nmt.vocab import BOS_ID, EOS_ID

# A pair with an empty target (EOS alone) and one with an empty source (empty fields).
SOURCES = ["sol luna", "mar rio casa", "agua", "perro gato libro fuego", "", "tierra"]
TARGETS = ["LUNA SOL", "CASA RIO MAR", "", "FUEGO LIBRO GATO PERRO", "X", "TIERRA AIRE"]
EMPTY_SOURCE = 4


def _lines(text: str) -> list[list[str]]:
    """Output text -> its lines' tab-separated fields."""
    assert text.endswith("\n") or not text
    return [line.split("\t") for line in text.split("\n")[:-1]]


def _lp(pieces: int, alpha: float) -> float:
    """GNMT length penalty over ``pieces`` target tokens (EOS included)."""
    return ((5.0 + pieces) / 6.0) ** alpha


@pytest.fixture(scope="module")
def files(corpus: Path) -> tuple[Path, Path, Path]:
    """SOURCES and TARGETS as -i/-t files and as one TSV file."""
    src, trg, tsv = corpus / "pairs.src", corpus / "pairs.trg", corpus / "pairs.tsv"
    src.write_text("".join(s + "\n" for s in SOURCES), encoding="utf-8")
    trg.write_text("".join(t + "\n" for t in TARGETS), encoding="utf-8")
    rows = zip(SOURCES, TARGETS, strict=True)
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in rows), encoding="utf-8")
    return src, trg, tsv


@pytest.fixture(scope="module")
def twin(corpus: Path, run: Path) -> Path:
    """A second tiny run with the same tokenizer: another seed and decoder style."""
    config = tiny_config(corpus)
    config["training"]["seed"] = 7
    config["model"]["decoder"]["style"] = "bahdanau"
    config["run"] = {"dir": str(corpus / "twin"), "device": "cpu", "tensorboard": False}
    result = nmt("train", str(write_config(corpus / "twin.yaml", config)), "--quiet")
    assert result.code == 0, result.err
    return corpus / "twin"


def _float64(path: Path) -> Translator:
    translator = Translator.from_checkpoint(path, "cpu")
    translator.model.double()
    return translator


@pytest.fixture(scope="module")
def reference(run: Path) -> Translator:
    """The run's model in float64, for the reference log-probabilities."""
    return _float64(run)


@torch.no_grad()
def _forced(translator: Translator, source: str, target: str) -> tuple[list[float], np.ndarray]:
    """Float64 teacher forcing of BOS y -> log p of each of y EOS, and the attention (n+1, S)."""
    model = translator.model
    (x,) = translator.tokenizer.encode_src([source])
    (y,) = translator.tokenizer.encode_trg([target])
    features, alphas = model(
        torch.tensor([x]), torch.tensor([len(x)]), torch.tensor([[BOS_ID, *y]])
    )
    log_probs = torch.log_softmax(model.generator(features).double(), dim=-1)[0]
    picked = log_probs.gather(1, torch.tensor([*y, EOS_ID]).unsqueeze(1)).squeeze(1)
    return picked.tolist(), alphas[0].double().numpy()


def _pieces(translator: Translator, target: str) -> list[str]:
    (y,) = translator.tokenizer.encode_trg([target])
    return [*translator.tokenizer.trg_pieces(y), "</s>"]


def _score(run: Path, *options: str, files: tuple[Path, Path, Path]) -> list[list[str]]:
    src, trg, _ = files
    result = nmt("score", "-m", str(run), "-i", str(src), "-t", str(trg), *options)
    assert result.code == 0, result.err
    rows = _lines(result.out)
    assert len(rows) == len(SOURCES)
    return rows


# ----------------------------------------------------------------------------- the numbers


def test_log_prob_is_the_float64_teacher_forced_sum(
    run: Path, files: tuple[Path, Path, Path], reference: Translator
) -> None:
    """Column 1 is sum log p(y EOS | BOS y, x) of the model in float64; empty source: empty."""
    rows = _score(run, files=files)
    for i, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
        if i == EMPTY_SOURCE:
            assert rows[i] == ["", ""]
            continue
        tokens, _ = _forced(reference, source, target)
        assert len(rows[i]) == 2
        assert float(rows[i][0]) == pytest.approx(math.fsum(tokens), abs=2e-4)
        if not target:
            assert len(tokens) == 1  # an empty target scores EOS alone


@pytest.mark.parametrize("alpha", [None, 0.0, 0.6, 2.0])
def test_score_column_is_log_prob_over_the_length_penalty(
    run: Path, files: tuple[Path, Path, Path], reference: Translator, alpha: float | None
) -> None:
    """Column 2 is log_prob / ((5 + n + 1) / 6) ** alpha (alpha: the run's 1.0 by default)."""
    options = [] if alpha is None else ["--length-penalty", str(alpha)]
    rows = _score(run, *options, files=files)
    used = 1.0 if alpha is None else alpha
    for i, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
        if i == EMPTY_SOURCE:
            continue
        tokens, _ = _forced(reference, source, target)
        expected = math.fsum(tokens) / _lp(len(tokens), used)
        assert float(rows[i][1]) == pytest.approx(expected, abs=2e-4)


def test_coverage_penalty_adds_beta_times_the_log_coverage(
    run: Path, files: tuple[Path, Path, Path], reference: Translator
) -> None:
    """--coverage-penalty b adds b * sum_j log min(1, sum_t alpha_tj) to the normalised score."""
    rows = _score(run, "--coverage-penalty", "0.4", "--length-penalty", "0.6", files=files)
    for i, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
        if i == EMPTY_SOURCE:
            continue
        tokens, alphas = _forced(reference, source, target)
        coverage = np.minimum(alphas.sum(axis=0), 1.0)
        expected = math.fsum(tokens) / _lp(len(tokens), 0.6) + 0.4 * float(np.log(coverage).sum())
        assert float(rows[i][0]) == pytest.approx(math.fsum(tokens), abs=2e-4)
        assert float(rows[i][1]) == pytest.approx(expected, abs=2e-4)


def test_tokens_columns_sum_to_the_log_prob_and_list_the_pieces(
    run: Path, files: tuple[Path, Path, Path], reference: Translator
) -> None:
    """--tokens: per-piece log-probs (float64's, summing to column 1) and the pieces, EOS last."""
    rows = _score(run, "--tokens", files=files)
    for i, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
        if i == EMPTY_SOURCE:
            assert rows[i] == ["", "", "", ""]
            continue
        assert len(rows[i]) == 4
        values = [float(v) for v in rows[i][2].split(" ")]
        pieces = rows[i][3].split(" ")
        tokens, _ = _forced(reference, source, target)
        assert pieces == _pieces(reference, target) and pieces[-1] == "</s>"
        assert len(values) == len(pieces) == len(tokens)
        assert values == pytest.approx(tokens, abs=2e-4)
        assert sum(values) == pytest.approx(float(rows[i][0]), abs=1e-4 + 5e-5 * len(values))
    assert rows[SOURCES.index("agua")][3] == "</s>"  # the empty target: EOS alone


def test_the_three_ways_to_give_pairs_agree(run: Path, files: tuple[Path, Path, Path]) -> None:
    """-i/-t, --tsv FILE, --tsv - and TSV on stdin (the default) give the same lines."""
    src, trg, tsv = files
    stdin = tsv.read_bytes()
    outputs = [
        nmt("score", "-m", str(run), "-i", str(src), "-t", str(trg)),
        nmt("score", "-m", str(run), "--tsv", str(tsv)),
        nmt("score", "-m", str(run), "--tsv", "-", stdin=stdin),
        nmt("score", "-m", str(run), stdin=stdin),
    ]
    assert all(r.code == 0 for r in outputs), [r.err for r in outputs]
    assert len(_lines(outputs[0].out)) == len(SOURCES)
    assert {r.out for r in outputs} == {outputs[0].out}


def test_output_file_holds_what_stdout_shows(
    run: Path, files: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """-o FILE writes the same lines as stdout, and nothing goes to stdout."""
    src, trg, _ = files
    out = tmp_path / "scores.tsv"
    written = nmt("score", "-m", str(run), "-i", str(src), "-t", str(trg), "-o", str(out))
    shown = nmt("score", "-m", str(run), "-i", str(src), "-t", str(trg))
    assert written.code == 0 and written.out == ""
    assert out.read_text(encoding="utf-8") == shown.out


def test_batch_size_does_not_change_the_numbers(run: Path, files: tuple[Path, Path, Path]) -> None:
    """--batch-size 1 (no padding) and the default batch give the same numbers."""
    batched = _score(run, "--tokens", files=files)
    alone = _score(run, "--tokens", "--batch-size", "1", files=files)
    for a, b in zip(batched, alone, strict=True):
        assert a[3] == b[3]
        numbers = [float(v) for v in [a[0], a[1], *a[2].split()] if v]
        again = [float(v) for v in [b[0], b[1], *b[2].split()] if v]
        assert again == pytest.approx(numbers, abs=1.5e-4)


@pytest.mark.parametrize(("alpha", "beta"), [(None, None), (0.6, 0.3)])
def test_scoring_a_translations_ids_reproduces_translate_scores(
    run: Path, corpus: Path, alpha: float | None, beta: float | None
) -> None:
    """Forced scoring of each best hypothesis' ids gives the score `nmt translate --scores`
    printed (ids, not text: the tiny model's outputs do not survive detokenise-retokenise),
    over the whole vocabulary: a shortlist's scores are normalised over its pieces alone."""
    options: list[str] = ["--shortlist", "off"]
    if alpha is not None:
        options += ["--length-penalty", str(alpha), "--coverage-penalty", str(beta)]
    result = nmt("translate", "-m", str(run), "-i", str(corpus / "test.src"), "--scores", *options)
    assert result.code == 0, result.err
    printed = _lines(result.out)
    translator = Translator.from_checkpoint(run, "cpu")
    decoding = decoding_options(
        translator.config.decoding,
        {"length_penalty": alpha, "coverage_penalty": beta, "shortlist": "off"},
    )
    sources = (corpus / "test.src").read_text(encoding="utf-8").splitlines()
    translations = translator.translate(sources, decoding)
    best = [t.hypotheses[0] for t in translations]
    assert [translator.detokenize(h) for h in best] == [text for _, text in printed]
    scored = score_ids(
        translator.ensemble(decoding),
        [t.src_ids for t in translations],
        [h.tokens for h in best],
        decoding,
        translator.device,
    )
    for (score, _), hyp, forced in zip(printed, best, scored, strict=True):
        assert forced.score == pytest.approx(float(score), abs=2e-4)
        assert forced.log_prob == pytest.approx(hyp.log_prob, abs=2e-4)


def test_n_best_rescoring_keeps_every_row_and_appends_one_column(
    run: Path, corpus: Path, tmp_path: Path
) -> None:
    """Each row of translate --n-best comes back as it was plus the score of its text, which
    is what scoring (source, text) as a TSV pair gives; an empty source gets an empty column."""
    src = tmp_path / "in.src"
    src.write_text("sol luna\n\nmar rio casa\nagua\n", encoding="utf-8")
    nbest = tmp_path / "nbest.tsv"
    made = nmt("translate", "-m", str(run), "-i", str(src), "--n-best", "3", "-o", str(nbest))
    assert made.code == 0, made.err
    rows = nbest.read_text(encoding="utf-8").splitlines()
    assert len(rows) == 10  # three per sentence, one for the empty line
    result = nmt("score", "-m", str(run), "-i", str(src), "--n-best", str(nbest))
    assert result.code == 0, result.err
    out = result.out.splitlines()
    assert len(out) == len(rows)
    sources = src.read_text(encoding="utf-8").splitlines()
    pairs = []
    for row, line in zip(rows, out, strict=True):
        assert line.startswith(row + "\t")
        assert line.count("\t") == row.count("\t") + 1 == 4
        index, _, _, text = row.split("\t")
        pairs.append(f"{sources[int(index)]}\t{text}\n")
    direct = nmt("score", "-m", str(run), stdin="".join(pairs).encode("utf-8"))
    assert direct.code == 0, direct.err
    expected = [fields[1] for fields in _lines(direct.out)]
    assert [line.split("\t")[4] for line in out] == expected
    assert out[3] == "1\t1\t0.0000\t\t"  # the empty source line's row


@pytest.mark.parametrize("average", ["linear", "log_linear"])
def test_ensemble_of_a_model_with_itself_scores_as_the_model(
    run: Path, files: tuple[Path, Path, Path], average: str
) -> None:
    """-m RUN -m RUN gives RUN's numbers, per piece too, with either average."""
    alone = _score(run, "--tokens", files=files)
    src, trg, _ = files
    both = nmt(
        "score", "-m", str(run), "-m", str(run), "-i", str(src), "-t", str(trg), "--tokens",
        "--ensemble-average", average,
    )  # fmt: skip
    assert both.code == 0, both.err
    rows = _lines(both.out)
    assert len(rows) == len(alone)
    for a, b in zip(alone, rows, strict=True):
        assert a[3] == b[3]  # the pieces
        numbers = [float(v) for v in [a[0], a[1], *a[2].split()] if v]
        again = [float(v) for v in [b[0], b[1], *b[2].split()] if v]
        assert again == pytest.approx(numbers, abs=1.5e-4)


@pytest.mark.parametrize("average", ["linear", "log_linear"])
def test_ensemble_of_two_models_scores_their_float64_mixture(
    run: Path, twin: Path, files: tuple[Path, Path, Path], reference: Translator, average: str
) -> None:
    """Two models: each piece's log-prob is the float64 mixture, log mean p (linear) or the
    renormalised mean log p (log_linear)."""
    other = _float64(twin)
    src, trg, _ = files
    result = nmt(
        "score", "-m", str(run), "-m", str(twin), "-i", str(src), "-t", str(trg), "--tokens",
        "--ensemble-average", average,
    )  # fmt: skip
    assert result.code == 0, result.err
    rows = _lines(result.out)
    for i, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
        if i == EMPTY_SOURCE:
            continue
        expected = _mixture([reference, other], source, target, average)
        values = [float(v) for v in rows[i][2].split(" ")]
        assert values == pytest.approx(expected, abs=2e-4)
        assert float(rows[i][0]) == pytest.approx(math.fsum(expected), abs=2e-4)


@torch.no_grad()
def _mixture(members: list[Translator], source: str, target: str, average: str) -> list[float]:
    (x,) = members[0].tokenizer.encode_src([source])
    (y,) = members[0].tokenizer.encode_trg([target])
    outs = []
    for member in members:
        model = member.model
        features, _ = model(torch.tensor([x]), torch.tensor([len(x)]), torch.tensor([[BOS_ID, *y]]))
        outs.append(torch.log_softmax(model.generator(features).double(), dim=-1)[0])
    stacked = torch.stack(outs)  # (M, T, V)
    if average == "linear":
        mixed = torch.logsumexp(stacked, dim=0) - math.log(len(members))
    else:
        mixed = torch.log_softmax(stacked.mean(dim=0), dim=-1)
    return mixed.gather(1, torch.tensor([*y, EOS_ID]).unsqueeze(1)).squeeze(1).tolist()


def test_attention_dir_gets_one_file_set_per_pair(
    run: Path, files: tuple[Path, Path, Path], reference: Translator, tmp_path: Path
) -> None:
    """--attention-dir: NNNNNN.png/.npy/.json per scored pair (none for the empty source), the
    matrix the float64 attention over the given target, (n+1) x |x| with rows summing to 1."""
    folder = tmp_path / "attention"
    _score(run, "--attention-dir", str(folder), files=files)
    expected = {
        f"{i:06d}{suffix}"
        for i in range(len(SOURCES))
        if i != EMPTY_SOURCE
        for suffix in (".png", ".npy", ".json")
    }
    assert {p.name for p in folder.iterdir()} == expected
    for i, (source, target) in enumerate(zip(SOURCES, TARGETS, strict=True)):
        if i == EMPTY_SOURCE:
            continue
        matrix = np.load(folder / f"{i:06d}.npy")
        _, alphas = _forced(reference, source, target)
        assert matrix.shape == alphas.shape
        assert np.allclose(matrix, alphas, atol=1e-4)
        assert np.allclose(matrix.sum(axis=1), 1.0, atol=1e-4)
        document = json.loads((folder / f"{i:06d}.json").read_text(encoding="utf-8"))
        assert document["target"] == _pieces(reference, target)
        assert len(document["source"]) == matrix.shape[1]


# ----------------------------------------------------------------------------- bad input


def _text(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_mismatched_source_and_target_counts(run: Path, tmp_path: Path, previous: Path) -> None:
    """-i with 3 lines and -t with 2: one line naming both files and counts."""
    src = _text(tmp_path / "a.src", ["sol", "mar", "rio"])
    trg = _text(tmp_path / "a.trg", ["SOL", "MAR"])
    result = nmt("score", "-m", str(run), "-i", str(src), "-t", str(trg), "-o", str(previous))
    assert str(src) in result.error and str(trg) in result.error
    assert "3 lines" in result.error and "2" in result.error
    assert unchanged(previous)


def test_a_tsv_line_without_a_tab(run: Path, tmp_path: Path, previous: Path) -> None:
    """--tsv FILE whose line 2 has no tab: the file and line 2 are named."""
    tsv = _text(tmp_path / "p.tsv", ["sol\tSOL", "mar MAR", "rio\tRIO"])
    result = nmt("score", "-m", str(run), "--tsv", str(tsv), "-o", str(previous))
    assert f"{tsv} line 2" in result.error and "source<TAB>target" in result.error
    assert unchanged(previous)


def test_a_tsv_line_with_two_tabs_on_stdin(run: Path, previous: Path) -> None:
    """TSV on stdin whose line 3 has three fields: stdin and line 3 are named."""
    stdin = b"sol\tSOL\nmar\tMAR\nrio\tRIO\textra\n"
    result = nmt("score", "-m", str(run), "-o", str(previous), stdin=stdin)
    assert "stdin line 3" in result.error and "3 tab-separated fields" in result.error
    assert unchanged(previous)


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ("7\t1\t-1.0000\tSOL", "source index 7"),  # past the 2 source lines
        ("x\t1\t-1.0000\tSOL", "index<TAB>rank<TAB>score<TAB>text"),
        ("-1\t1\t-1.0000\tSOL", "index<TAB>rank<TAB>score<TAB>text"),
        ("\u00b2\t1\t-1.0000\tSOL", "index<TAB>rank<TAB>score<TAB>text"),  # a digit for isdigit
        ("0\t1\tSOL", "index<TAB>rank<TAB>score<TAB>text"),
        ("0\t1\t-1.0000\tSOL\tMORE", "index<TAB>rank<TAB>score<TAB>text"),
    ],
)
def test_bad_n_best_rows(run: Path, tmp_path: Path, previous: Path, row: str, says: str) -> None:
    """An n-best row with a bad index or field count: the file and its line 2 are named."""
    src = _text(tmp_path / "in.src", ["sol", "mar"])
    nbest = _text(tmp_path / "nbest.tsv", ["0\t1\t-1.0000\tSOL", row, "1\t1\t-1.0000\tMAR"])
    result = nmt(
        "score", "-m", str(run), "-i", str(src), "--n-best", str(nbest), "-o", str(previous)
    )
    assert f"{nbest} line 2" in result.error and says in result.error
    if "source index" in says:
        assert str(src) in result.error
    assert unchanged(previous)


def test_tokens_with_n_best_is_refused(run: Path, tmp_path: Path, previous: Path) -> None:
    """--tokens does not go with --n-best: both options named."""
    src = _text(tmp_path / "in.src", ["sol"])
    nbest = _text(tmp_path / "nbest.tsv", ["0\t1\t-1.0000\tSOL"])
    result = nmt(
        "score", "-m", str(run), "-i", str(src), "--n-best", str(nbest), "--tokens",
        "-o", str(previous),
    )  # fmt: skip
    assert "--tokens" in result.error and "--n-best" in result.error
    assert unchanged(previous)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (["-i", "SRC"], "-t TRG is missing"),
        (["-t", "TRG"], "-i SRC is missing"),
        (["-i", "SRC", "-t", "TRG", "--tsv", "TSV"], "--tsv"),
        (["-t", "TRG", "--n-best", "TSV"], "--n-best"),
        (["--tsv", "TSV", "--n-best", "TSV"], "--n-best"),
    ],
)
def test_incomplete_or_conflicting_inputs(
    run: Path, tmp_path: Path, previous: Path, given: list[str], says: str
) -> None:
    """A missing -t or -i, or two ways of giving pairs at once: the option is named."""
    names = {
        "SRC": _text(tmp_path / "in.src", ["sol"]),
        "TRG": _text(tmp_path / "in.trg", ["SOL"]),
        "TSV": _text(tmp_path / "in.tsv", ["0\t1\t-1.0000\tSOL"]),
    }
    args = [str(names.get(a, a)) for a in given]
    result = nmt("score", "-m", str(run), *args, "-o", str(previous))
    assert says in result.error
    assert unchanged(previous)


def test_a_missing_input_file(run: Path, tmp_path: Path, previous: Path) -> None:
    """-t naming no file: the path is named."""
    src = _text(tmp_path / "in.src", ["sol"])
    missing = tmp_path / "nope.trg"
    result = nmt("score", "-m", str(run), "-i", str(src), "-t", str(missing), "-o", str(previous))
    assert f"{missing}: no such file" in result.error
    assert unchanged(previous)


@pytest.mark.parametrize("onto", ["-i", "-t", "--tsv", "--n-best"])
def test_output_onto_an_input_is_refused(run: Path, tmp_path: Path, onto: str) -> None:
    """-o naming the file an input option reads: refused, the option named, the file intact."""
    src = _text(tmp_path / "in.src", ["sol"])
    paths = {
        "-i": src,
        "-t": _text(tmp_path / "in.trg", ["SOL"]),
        "--tsv": _text(tmp_path / "in.tsv", ["sol\tSOL"]),
        "--n-best": _text(tmp_path / "nbest.tsv", ["0\t1\t-1.0000\tSOL"]),
    }
    given = {
        "-i": ["-i", str(src), "-t", str(paths["-t"])],
        "-t": ["-i", str(src), "-t", str(paths["-t"])],
        "--tsv": ["--tsv", str(paths["--tsv"])],
        "--n-best": ["-i", str(src), "--n-best", str(paths["--n-best"])],
    }[onto]
    target = paths[onto]
    before = target.read_bytes()
    result = nmt("score", "-m", str(run), *given, "-o", str(target))
    assert f"--output {target}" in result.error and f"the {onto} this command" in result.error
    assert target.read_bytes() == before


def test_output_onto_the_model_is_refused(run: Path, tmp_path: Path) -> None:
    """-o naming the run's best.pt: refused and the checkpoint intact."""
    tsv = _text(tmp_path / "in.tsv", ["sol\tSOL"])
    before = (run / "best.pt").read_bytes()
    result = nmt("score", "-m", str(run), "--tsv", str(tsv), "-o", str(run / "best.pt"))
    assert "--output" in result.error and "best.pt" in result.error
    assert (run / "best.pt").read_bytes() == before


def test_attention_dir_that_is_a_file(run: Path, tmp_path: Path, previous: Path) -> None:
    """--attention-dir naming a file: refused, the option named."""
    tsv = _text(tmp_path / "in.tsv", ["sol\tSOL"])
    result = nmt(
        "score", "-m", str(run), "--tsv", str(tsv), "--attention-dir", str(previous),
        "-o", str(tmp_path / "out.tsv"),
    )  # fmt: skip
    assert f"--attention-dir {previous}" in result.error
    assert unchanged(previous) and not (tmp_path / "out.tsv").exists()


def test_reference_links_are_outlined_on_the_heatmaps(
    run: Path, files: tuple[Path, Path, Path], reference: Translator, tmp_path: Path
) -> None:
    """--align-ref: each word link becomes the cells of its words' pieces (sure wins where
    links share a cell), listed in the JSON beside the matrix, drawn on the PNG."""
    from nmt.decoding.alignment import piece_words

    gold = tmp_path / "gold.align"
    lines = ["0-1 1?0", "0-2 2-0 1?1", "", "3-0", "", "0-0 0?1"]
    gold.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    plain, outlined = tmp_path / "plain", tmp_path / "outlined"
    _score(run, "--attention-dir", str(plain), files=files)
    _score(run, "--attention-dir", str(outlined), "--align-ref", str(gold), files=files)
    tokenizer = reference.tokenizer
    for i in (0, 1, 3, 5):
        src_words = piece_words(tokenizer.src, SOURCES[i])
        trg_words = piece_words(tokenizer.trg, TARGETS[i])
        expected: dict[tuple[int, int], bool] = {}
        for link in lines[i].split():
            mark = "?" if "?" in link else "-"
            word_src, word_trg = map(int, link.split(mark))
            for row, trg_word in enumerate(trg_words):
                for column, src_word in enumerate(src_words):
                    if (src_word, trg_word) == (word_src, word_trg):
                        cell = (row, column)
                        expected[cell] = expected.get(cell, False) or mark == "-"
        document = json.loads((outlined / f"{i:06d}.json").read_text(encoding="utf-8"))
        found = {(c["target"], c["source"]): c["sure"] for c in document["reference_links"]}
        assert found == expected and expected
        assert (outlined / f"{i:06d}.png").read_bytes() != (plain / f"{i:06d}.png").read_bytes()
    assert "reference_links" not in json.loads((outlined / "000002.json").read_text())


def test_bad_reference_links_stop_before_anything_is_written(
    run: Path, files: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    src, trg, _ = files
    gold, folder = tmp_path / "gold.align", tmp_path / "attention"
    base = ["score", "-m", str(run), "-i", str(src), "-t", str(trg)]
    gold.write_text("0-0\n" * len(SOURCES), encoding="utf-8")
    assert "give --attention-dir too" in nmt(*base, "--align-ref", str(gold)).error
    gold.write_text("0-0\n", encoding="utf-8")
    result = nmt(*base, "--attention-dir", str(folder), "--align-ref", str(gold))
    assert result.code == 2 and "has 1 lines but there are 6 pairs" in result.error
    gold.write_text("0-0\n0-7\n" + "\n" * (len(SOURCES) - 2), encoding="utf-8")
    result = nmt(*base, "--attention-dir", str(folder), "--align-ref", str(gold))
    assert f"--align-ref {gold} line 2: link 0-7 is outside" in result.error
    assert not folder.exists() and result.out == ""
