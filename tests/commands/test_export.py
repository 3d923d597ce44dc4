"""`nmt export --format onnx` and `nmt translate --backend onnxruntime`: the exported encoder
and decoder step equal the model's for every decoder, cell and score function (random
weights, padded sources of another size than the traced one); search over the graphs finds
the model's outputs; the exported directory translates the tiny run's lines without its
checkpoint; and one-line errors for what cannot be exported or read."""

from __future__ import annotations

import json
import random
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from clirun import WORDS, nmt, reversal, unchanged

from nmt import checkpoint, load
from nmt.config import Config, DecodingConfig, from_dict
from nmt.data.batching import pad
from nmt.data.tokenizer import Tokenizer, train_sentencepiece
from nmt.decoding import search
from nmt.decoding.exported import ENCODER, STEP, ExportedModel, load_exported
from nmt.decoding.onnx import check_recurrences, export_onnx
from nmt.decoding.options import SearchOptions
from nmt.decoding.search import Hypothesis, beam_search, greedy_search
from nmt.errors import CheckpointError, ConfigError
from nmt.model import Seq2Seq, build_model
from nmt.model.attention import masked_softmax
from nmt.model.positional import LocationAttention
from nmt.vocab import BOS_ID


def _model(
    style: str,
    rnn: str,
    score: str,
    feeding: bool = True,
    layers: int = 1,
    **attention: object,
) -> dict:
    """A model section with sizes 4-8: the encoder's 2 x 4 units equal the decoder's 8, as
    dot, scaled_dot and cosine need."""
    return {
        "embedding_size": 6,
        "embedding_dropout": 0.3,  # eval mode: the graphs must not drop
        "tie_embeddings": style == "bahdanau",
        "encoder": {"rnn": rnn, "hidden_size": 4, "layers": layers},
        "decoder": {
            "style": style,
            "rnn": rnn,
            "hidden_size": 8,
            "layers": layers,
            "input_feeding": feeding,
            "init": "final" if layers > 1 else "bridge",
            "maxout": rnn == "lstm",
        },
        "attention": {"score": score, **attention},
    }


# Every decoder, both cells, every score function and coverage kind at least once.
VARIANTS = {
    "bahdanau-gru-additive": _model("bahdanau", "gru", "additive"),
    "bahdanau-lstm-general": _model("bahdanau", "lstm", "general", layers=2),
    "luong-gru-dot": _model("luong", "gru", "dot", scale="learned"),
    "luong-nofeed-lstm-scaled_dot": _model("luong", "lstm", "scaled_dot", feeding=False),
    "luong-nofeed-gru-cosine": _model("luong", "gru", "cosine", False, learn_beta=True),
    "bahdanau-gru-location": _model("bahdanau", "gru", "location", max_source_length=5),
    "luong-lstm-multihead": _model("luong", "lstm", "multihead", heads=2),
    "luong-gru-local-m": _model("luong", "gru", "local-m", window=1, local_score="dot"),
    "bahdanau-lstm-local-p": _model("bahdanau", "lstm", "local-p", window=2),
    "bahdanau-gru-coverage-sum": _model("bahdanau", "gru", "additive", coverage="sum"),
    "luong-gru-coverage-linguistic": _model("luong", "gru", "additive", coverage="linguistic"),
    "bahdanau-lstm-coverage-neural": _model("bahdanau", "lstm", "additive", coverage="neural"),
}
SCORES = [
    "additive", "dot", "general", "scaled_dot", "cosine", "location", "multihead", "local-m",
    "local-p",
]  # fmt: skip
DECODERS = [("bahdanau", True), ("luong", True), ("luong", False)]
EVERY = {  # the slow tier: every decoder x cell x score
    f"{style}{'' if feeding else '-nofeed'}-{rnn}-{score}-all": _model(
        style, rnn, score, feeding, heads=2, max_source_length=5, window=2
    )
    for style, feeding in DECODERS
    for rnn in ("gru", "lstm")
    for score in SCORES
}
VARIANTS.update(EVERY)
FAST = [name for name in VARIANTS if not name.endswith("-all")]
ALL = FAST + [pytest.param(name, marks=pytest.mark.slow) for name in EVERY]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    src, trg = reversal(200, seed=5)
    proto = train_sentencepiece(src + trg + WORDS, 40, "bpe", 1.0, 1000, seed=1)
    return Tokenizer(proto, proto)


def _random_model(section: dict, vocab: int, seed: int = 0) -> tuple[Seq2Seq, Config]:
    config = from_dict({"model": section})
    torch.manual_seed(seed)
    model = build_model(config.model, vocab, vocab).eval()
    with torch.no_grad():
        model.generator.weight.mul_(4.0)  # peakier distributions: fewer near-ties
    return model, config


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer):
    """name -> the random model of VARIANTS[name] and its export under onnxruntime."""
    cache: dict[str, tuple[Seq2Seq, ExportedModel]] = {}

    def get(name: str) -> tuple[Seq2Seq, ExportedModel]:
        if name not in cache:
            model, config = _random_model(VARIANTS[name], tokenizer.src_vocab_size, len(cache))
            directory = tmp_path_factory.mktemp(name)
            export_onnx(model, tokenizer, config, directory, "random weights")
            cache[name] = model, load_exported(directory).model
        return cache[name]

    return get


def _source(lengths: list[int], seed: int, vocab: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]
    return pad(ids), torch.tensor(lengths)


def _close(found: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(found, expected.to(found.dtype), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ALL)
def test_the_exported_step_is_the_models_step(name: str, exported) -> None:
    """Four steps from random previous tokens, each side fed its own state, on a padded
    batch of another size and source width (longer than location's 5) than the traced one:
    the log-probabilities, the attention (zero at padding) and every state tensor."""
    model, graphs = exported(name)
    src, lengths = _source([7, 3, 5, 1, 4], seed=2)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        memory, state = model.encode(src, lengths)
        rows = graphs.encode(src, lengths)
        _close(rows.memory["values"], memory.values)
        for _ in range(4):
            prev = torch.randint(4, 40, (5,), generator=generator)
            features, alphas, state = model.decoder.step(prev, memory, state)
            log_probs, graph_alphas, rows = graphs.step(prev, rows)
            _close(log_probs, model.log_probs(features))
            _close(graph_alphas, alphas)
            assert bool((graph_alphas[~memory.mask] == 0).all())
            fields = ("hidden", "cell", "feed", "coverage")
            assert set(rows.decoder) == {f for f in fields if getattr(state, f, None) is not None}
            for field, tensor in rows.decoder.items():
                _close(tensor, getattr(state, field))


def _same_up_to_ties(expected: list[Hypothesis], found: list[Hypothesis]) -> None:
    """The same scores rank by rank, and the same outputs where a score is not tied."""
    assert [h.score for h in found] == pytest.approx([h.score for h in expected], abs=1e-4)
    for rank, hyp in enumerate(expected):
        tied = [h for h in expected if abs(h.score - hyp.score) < 1e-4]
        if len(tied) == 1:
            assert found[rank].tokens == hyp.tokens


@pytest.mark.parametrize("floor", [None, 1], ids=["default", "dropping"])
@pytest.mark.parametrize("name", ALL)
def test_search_over_the_graphs_finds_the_models_outputs(
    name: str, floor: int | None, exported, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nmt's own greedy and beam search stepping the graphs: the model's greedy ids, and its
    n-best lists up to score ties; also when the batch drops its ended sentences' rows (a
    floor of 1 row: the graphs' memory is selected too)."""
    if floor is not None:
        monkeypatch.setattr(search, "MIN_ROWS", floor)
    model, graphs = exported(name)
    src, lengths = _source([6, 2, 5, 4], seed=4)
    limits = {"max_len_ratio": 1.5, "max_len_offset": 3}
    greedy = DecodingConfig(beam_size=1, **limits)
    expected = greedy_search(model, src, lengths, greedy)
    assert [h.tokens for h in greedy_search(graphs, src, lengths, greedy)] == [
        h.tokens for h in expected
    ]
    beam = DecodingConfig(beam_size=3, length_penalty=1.0, coverage_penalty=0.2, **limits)
    for want, got in zip(
        beam_search(model, src, lengths, beam, n_best=3),
        beam_search(graphs, src, lengths, beam, n_best=3),
        strict=True,
    ):
        _same_up_to_ties(want, got)


# ----------------------------------------------------------------- the exported tiny run

SOURCES = ["sol luna", "mar rio casa", "", "agua fuego", "perro gato"]
PREFIXES = ["LUNA", "CASA RIO", "", "", "GATO"]
CONSTRAINTS = [["SOL"], ["MAR", "CASA"], [], [], ["PERRO GATO"]]
OPTIONS = [  # translate's options, each run with both backends
    [],
    ["-b", "3", "--n-best", "2"],
    ["-b", "1", "--scores"],
    ["--prefix", "prefix", "-b", "3"],
    ["--constraints", "constraints", "-b", "4"],
]


def _steering(folder: Path) -> dict[str, Path]:
    """SOURCES, PREFIXES and CONSTRAINTS as the files translate reads."""
    files = {"source": SOURCES, "prefix": PREFIXES}
    paths = {name: folder / f"export.{name}" for name in (*files, "constraints")}
    for name, lines in files.items():
        paths[name].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    rows = "".join(json.dumps(row) + "\n" for row in CONSTRAINTS)
    paths["constraints"].write_text(rows, encoding="utf-8")
    return paths


def test_the_exported_run_translates_as_the_run_without_its_checkpoint(
    run: Path, tmp_path: Path
) -> None:
    """The tiny run exported from a copy of it, which is deleted: the exported directory
    describes itself, and `translate --backend onnxruntime` on it writes the run's lines
    (plain, n-best, greedy with scores, prefixes, constraints). The only test of this file
    that trains (clirun's run)."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    out = tmp_path / "onnx"
    result = nmt("export", str(copy), "--format", "onnx", "-o", str(out))
    assert result.code == 0, result.err
    assert result.err.splitlines() == [
        f"{out}: encoder and decoder step as ONNX graphs (opset 17), with the tokenizer and config"
    ]
    shutil.rmtree(copy)
    names = sorted(path.name for path in out.iterdir())
    assert names == ["config.yaml", "decoder_step.onnx", "encoder.onnx", "export.json", "spm.model"]
    metadata = json.loads((out / "export.json").read_text())
    assert metadata["opset"] == 17 and "dynamo=False" in metadata["exporter"]
    batch_source = {"0": "batch", "1": "source"}
    assert metadata["encoder"]["inputs"] == {"src": batch_source, "src_lengths": {"0": "batch"}}
    step = metadata["step"]
    assert list(step["inputs"]) == ["prev", "step", "hidden", "feed", "values", "keys", "mask"]
    assert step["outputs"]["alphas"] == batch_source
    assert step["outputs"]["next_hidden"] == {"1": "batch"}  # (layers, batch, hidden)
    files = _steering(tmp_path)
    for options in OPTIONS:
        given = [str(files.get(option, option)) for option in options]
        whole = ("--shortlist", "off")  # the exported step's output layer is the whole one
        expected = nmt("translate", "-m", str(run), "-i", str(files["source"]), *whole, *given)
        assert expected.code == 0, expected.err
        found = nmt(
            "translate", "-m", str(out), "--backend", "onnxruntime", "-i", str(files["source"]),
            *given,
        )  # fmt: skip
        assert found.code == 0, found.err
        assert found.out == expected.out, options
        assert len(found.out.splitlines()) >= len(SOURCES)
    exported = load(out, backend="onnxruntime")  # the Python API, the same search
    want = load(run).translate(SOURCES, beam_size=3, n_best=2, shortlist="off")
    got = exported.translate(SOURCES, beam_size=3, n_best=2)
    assert [[h.text for h in row] for row in got] == [[h.text for h in row] for row in want]
    scores = [x for row in got for h in row for x in (h.score, h.log_prob)]
    assert scores == pytest.approx([x for row in want for h in row for x in (h.score, h.log_prob)])
    with pytest.raises(ConfigError, match="need the model's checkpoint"):
        exported.score(SOURCES[:1], ["SOL"])


# ------------------------------------------------------------------------ what is refused


@pytest.fixture(scope="module")
def random_run(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """A run directory with a best.pt of random weights: what export reads, untrained."""
    model, config = _random_model(VARIANTS["luong-gru-dot"], tokenizer.src_vocab_size)
    folder = tmp_path_factory.mktemp("random") / "run"
    state = {"model": model.state_dict(), "config": config.model_dump(mode="json")}
    checkpoint.save(folder / "best.pt", {**state, "tokenizer": tokenizer.state_dict()})
    return folder


def test_translate_with_onnxruntime_refuses_a_run_directory(random_run: Path) -> None:
    result = nmt("translate", "-m", str(random_run), "--backend", "onnxruntime", stdin=b"a\n")
    assert "not an exported model (no export.json); it is a run directory" in result.error


def test_without_the_onnx_extra_both_commands_say_what_to_install(
    random_run: Path, exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, graphs = exported("luong-gru-dot")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime fails
    result = nmt("export", str(random_run), "-o", str(tmp_path / "out"))
    assert result.error == (
        "error: nmt export --format onnx needs the onnxruntime package, which is not "
        "installed: pip install -e '.[onnx]'"
    )
    assert not (tmp_path / "out").exists()
    model = str(graphs.directory)
    translated = nmt("translate", "-m", model, "--backend", "onnxruntime", stdin=b"a\n")
    assert translated.error.startswith("error: --backend onnxruntime needs the onnxruntime")


def test_export_refuses_a_file_as_output(random_run: Path, previous: Path) -> None:
    result = nmt("export", str(random_run), "--format", "onnx", "-o", str(previous))
    assert result.error == (
        f"error: --output {previous}: is a file; give a directory for the exported model"
    )
    assert unchanged(previous)


def test_export_refuses_a_folder_of_other_files_and_a_missing_run(
    random_run: Path, previous: Path, tmp_path: Path
) -> None:
    result = nmt("export", str(random_run), "-o", str(tmp_path))
    assert "a folder with other files in it" in result.error
    assert unchanged(previous)
    missing = nmt("export", str(tmp_path / "no-run"), "-o", str(tmp_path / "out"))
    assert "no-run: no such checkpoint file or run directory" in missing.error
    assert not (tmp_path / "out").exists()


def test_an_earlier_export_with_other_files_is_refused_and_kept(
    random_run: Path, tmp_path: Path
) -> None:
    """Replacing an earlier export deletes what it holds: with a file or folder of the
    user's in it, the export is refused, naming them; without, it is replaced."""
    out = tmp_path / "onnx"
    assert nmt("export", str(random_run), "-o", str(out)).code == 0
    exported = sorted(p.name for p in out.iterdir())
    (out / "NOTES.txt").write_text("mine\n", encoding="utf-8")
    (out / "runs").mkdir()
    result = nmt("export", str(random_run), "-o", str(out))
    assert result.error == (
        f"error: --output {out}: an earlier export with other files in it (NOTES.txt, runs), "
        f"which replacing it would delete; move them out or give another directory"
    )
    assert sorted(p.name for p in out.iterdir()) == sorted([*exported, "NOTES.txt", "runs"])
    (out / "NOTES.txt").unlink()
    (out / "runs").rmdir()
    assert nmt("export", str(random_run), "-o", str(out)).code == 0
    assert sorted(p.name for p in out.iterdir()) == exported


def test_a_models_alignment_head_is_not_exported_and_its_alignments_are_refused(
    tokenizer: Tokenizer, tmp_path: Path, previous: Path
) -> None:
    """The alignment head never changes a translation: the export translates as the model,
    and --alignments, which would read the head, is refused instead of read from the
    attention."""
    section = {**VARIANTS["bahdanau-gru-additive"], "alignment_head": True}
    config = from_dict({"model": section, "training": {"guided_alignment": "train.align"}})
    torch.manual_seed(0)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    state = {"model": model.state_dict(), "config": config.model_dump(mode="json")}
    checkpoint.save(tmp_path / "head.pt", {**state, "tokenizer": tokenizer.state_dict()})
    out = tmp_path / "onnx"
    assert nmt("export", str(tmp_path / "head.pt"), "-o", str(out)).code == 0
    text = b"sol luna\nmar rio casa\n"
    expected = nmt("translate", "-m", str(tmp_path / "head.pt"), "-b", "3", stdin=text)
    found = nmt("translate", "-m", str(out), "--backend", "onnxruntime", "-b", "3", stdin=text)
    assert found.code == 0 and found.out == expected.out
    refused = nmt(
        "translate", "-m", str(out), "--backend", "onnxruntime", "--alignments", str(previous),
        stdin=text,
    )  # fmt: skip
    assert refused.error.startswith(
        "error: --alignments: this model aligns with its alignment head"
    )
    assert unchanged(previous)


def _branching_location(self, query, memory, positions):  # type: ignore[no-untyped-def]
    """Location's weights with a Python branch on the source width, as a tracer freezes it:
    a score that cannot be exported as written."""
    width = memory.mask.size(1)
    energies = self.location_proj(query)
    if width <= self.max_source_length:
        return masked_softmax(energies[..., :width], memory.mask)
    energies = torch.nn.functional.pad(energies, (0, width - self.max_source_length))
    reachable = torch.arange(width) < self.max_source_length
    return masked_softmax(energies, memory.mask & reachable)


def test_a_score_that_does_not_export_is_refused_naming_its_key(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export runs its graphs on other sizes than traced (source widths 6, then 9): a
    graph that fails there, or differs from the model, is a one-line error naming the config
    key, and an earlier export in the output directory stays as it was."""
    section = _model("bahdanau", "gru", "location", max_source_length=7)
    model, config = _random_model(section, tokenizer.src_vocab_size)
    path = tmp_path / "location.pt"
    state = {"model": model.state_dict(), "config": config.model_dump(mode="json")}
    checkpoint.save(path, {**state, "tokenizer": tokenizer.state_dict()})
    out = tmp_path / "onnx"
    assert nmt("export", str(path), "-o", str(out)).code == 0
    before = (out / "export.json").read_text()
    monkeypatch.setattr(LocationAttention, "alphas", _branching_location)
    result = nmt("export", str(path), "-o", str(out))
    assert result.error.startswith(
        "error: model.attention.score: 'location' does not export faithfully: the ONNX "
        "decoder step fails on a batch of other sizes than the one traced (its Where node"
    )
    assert (out / "export.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["location.pt", "onnx"]


def test_a_gru_exported_with_the_reset_gate_before_the_matmul_is_refused(exported) -> None:
    """pytorch#189225: ONNX's GRU with linear_before_reset=0 is another equation."""
    onnx = pytest.importorskip("onnx")
    _, graphs = exported("bahdanau-gru-additive")
    graph = onnx.load(str(graphs.directory / "encoder.onnx"))
    check_recurrences(graph, "model.encoder.rnn")
    for node in graph.graph.node:
        for attribute in node.attribute:
            if attribute.name == "linear_before_reset":
                attribute.i = 0
    with pytest.raises(ConfigError, match=r"^model.encoder.rnn: 'gru' was exported as ONNX's"):
        check_recurrences(graph, "model.encoder.rnn")


@pytest.fixture(scope="module")
def int8_dir(random_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """random_run exported with --quantize int8."""
    int8_dir = tmp_path_factory.mktemp("int8") / "out"
    result = nmt("export", str(random_run), "--quantize", "int8", "-o", str(int8_dir))
    assert result.code == 0, result.err
    assert "as int8 ONNX graphs" in result.err
    return int8_dir


def test_an_int8_export_quantizes_the_weights_and_stays_near_the_fp32_graphs(
    random_run: Path, int8_dir: Path, tmp_path: Path
) -> None:
    """--quantize int8: the graphs' MatMuls become integer ones with 7-bit weights and a
    scale per output column, export.json says so with
    the largest log-probability change it found, a step is near the fp32 export's step but
    not equal to it, and translate decodes with the int8 graphs."""
    fp32_dir = tmp_path / "fp32"
    assert nmt("export", str(random_run), "-o", str(fp32_dir)).code == 0
    metadata = json.loads((int8_dir / "export.json").read_text())
    assert metadata["quantize"] == "int8" and metadata["int8_error"] > 0
    import onnx
    from onnx import numpy_helper

    weights = 0
    for graph in ("encoder.onnx", "decoder_step.onnx"):
        loaded = onnx.load(str(int8_dir / graph)).graph
        ops = {node.op_type for node in loaded.node}
        assert "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops, (graph, ops)
        # a MatMul's weights in 7 bits (no 16-bit sum saturates without VNNI), a scale per
        # output column
        arrays = {i.name: numpy_helper.to_array(i) for i in loaded.initializer}
        for name, weight in arrays.items():
            if not name.endswith("_quantized") or weight.dtype.name != "int8":
                continue  # (a Gather's table: uint8, a scale per tensor)
            scale = arrays[name.removesuffix("_quantized") + "_scale"]
            assert int(abs(weight.astype(int)).max()) <= 64, name
            assert scale.shape == (weight.shape[1],), (name, scale.shape)
            weights += 1
    assert weights >= 2
    src, lengths = _source([5, 3, 7], seed=3)
    found = []
    for directory in (fp32_dir, int8_dir):
        model = load_exported(directory).model
        bos = torch.full((3,), BOS_ID, dtype=torch.long)
        log_probs, _, _ = model.step(bos, model.encode(src, lengths))
        found.append(log_probs)
    change = float((found[1] - found[0]).abs().max())
    assert 0 < change < 0.01 * float(found[0].abs().max()), change
    out = nmt(
        "translate", "-m", str(int8_dir), "--backend", "onnxruntime", "-b", "3",
        stdin=b"sol luna\n\nmar rio casa\n",
    )  # fmt: skip
    assert out.code == 0, out.err
    assert len(out.out.splitlines()) == 3 and out.out.splitlines()[1] == ""


def test_the_decoding_plan_of_an_int8_export_says_int8(int8_dir: Path) -> None:
    """It used to say fp32 (the exported fp32 graphs); --precision fp32 is refused."""
    reason = "onnxruntime: int8 weights, onnxruntime's dynamic quantization"
    result = nmt("translate", "-m", str(int8_dir), "--backend", "onnxruntime", stdin=b"sol\n")
    assert result.code == 0, result.err
    plan = result.err.splitlines()[-1]  # after any warning about the outputs
    assert plan.startswith(f"Decoding plan: int8 ({reason}), onnxruntime graphs")
    model = load(int8_dir, backend="onnxruntime")  # the Python API, as the server reports it
    assert model.plan.as_dict()["precision"] == "int8"
    assert (model.plan.reason, model.precision) == (reason, f"int8 ({reason})")
    refused = nmt(
        "translate", "-m", str(int8_dir), "--backend", "onnxruntime", "--precision", "fp32",
        stdin=b"sol\n",
    )  # fmt: skip
    assert refused.error.startswith(f"error: --precision fp32: {int8_dir} holds int8 graphs")


def test_the_exported_graphs_decode_batches_side_by_side(exported, tokenizer: Tokenizer) -> None:
    """--backend onnxruntime under decoding.workers: 2 workers give the hypotheses of one
    batch after another, exactly, and each worker runs the graphs with its share of the
    threads (sessions of 1 thread each, on 2), the caller with all of them."""
    from nmt.decoding.translator import Translator

    model, graphs = exported("bahdanau-gru-additive")
    config = Config()
    translator = Translator([], tokenizer, config, torch.device("cpu"), backend=graphs)
    generator = torch.Generator().manual_seed(31)
    sentences = [
        torch.randint(4, 40, (int(n),), generator=generator).tolist()
        for n in torch.randint(1, 7, (14,), generator=generator)
    ]
    seen: set[tuple[str, int]] = set()
    sessions = graphs.sessions

    def watched():
        pair = sessions()
        threads = {session.get_session_options().intra_op_num_threads for session in pair}
        who = "caller" if threading.current_thread() is caller else "worker"
        seen.add((who, *threads))
        return pair

    caller = threading.current_thread()
    graphs.sessions = watched  # type: ignore[method-assign]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outputs = {}
        for workers in (1, 2):
            decoding = config.decoding.model_copy(
                update={"beam_size": 3, "batch_size": 2, "workers": workers, "max_len_offset": 3}
            )
            hyps = translator.decode_ids(sentences, decoding, SearchOptions(n_best=2))
            outputs[workers] = [[(h.tokens, h.score) for h in row] for row in hyps]
    finally:
        torch.set_num_threads(before)
        del graphs.sessions
    assert outputs[2] == outputs[1]
    assert seen == {("caller", 2), ("worker", 1)}


def _damaged(graphs: ExportedModel, folder: Path, name: str, damage: str) -> Path:
    """A copy of an exported directory with the graph ``name`` damaged; returns the graph."""
    shutil.copytree(graphs.directory, folder)
    data = (folder / name).read_bytes()
    damaged = {
        "random": random.Random(0).randbytes(5000),  # not a protobuf
        "truncated": data[: len(data) // 2],
        "empty": b"",  # a protobuf without a graph
    }
    (folder / name).write_bytes(damaged[damage])
    return folder / name


@pytest.mark.parametrize(
    ("name", "damage"), [(ENCODER, "random"), (STEP, "truncated"), (ENCODER, "empty")]
)
def test_a_damaged_graph_is_one_line_naming_it(
    exported, tmp_path: Path, name: str, damage: str
) -> None:
    """It used to be onnxruntime's InvalidProtobuf or InvalidArgument, with a traceback."""
    graph = _damaged(exported("luong-gru-dot")[1], tmp_path / "out", name, damage)
    result = nmt("translate", "-m", str(graph.parent), "--backend", "onnxruntime", stdin=b"a\n")
    assert result.error == (
        f"error: {graph}: damaged or not written by nmt export; export the run again"
    )


def test_a_graph_damaged_before_a_workers_first_use_is_one_line(
    exported, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Workers make their sessions on first use, in their own threads (a thread count of
    their own): a graph damaged by then is the same error, raised in the caller."""
    from nmt.decoding.translator import Translator

    folder = tmp_path / "out"
    shutil.copytree(exported("luong-gru-dot")[1].directory, folder)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        graphs = load_exported(folder).model  # the caller's sessions: 2 threads
        (folder / STEP).write_bytes(b"")
        translator = Translator([], tokenizer, Config(), torch.device("cpu"), backend=graphs)
        decoding = Config().decoding.model_copy(update={"batch_size": 1, "workers": 2})
        with pytest.raises(CheckpointError, match="decoder_step.onnx: damaged or not written"):
            translator.decode_ids([[5, 6], [7, 8]], decoding, SearchOptions())
    finally:
        torch.set_num_threads(before)
