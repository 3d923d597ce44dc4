"""A model with an alignment head (model.alignment_head) through the CLI: training guides the
head, `nmt align`, `nmt translate --alignments` and the dev AER read it, `--attention` reads
the attention, and fine-tuning can add a head to a trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clirun import nmt, write_config
from synthetic import aligned_config, write_aligned_corpus

from nmt.commands.align import Extraction, align_pairs
from nmt.data.tokenizer import piece_words
from nmt.decoding.alignment import extract_links
from nmt.decoding.translator import Translator
from nmt.vocab import BOS_ID, EOS_ID


def _corpus(root: Path) -> Path:
    """The reversal corpus with its true alignment of the training pairs as guidance."""
    write_aligned_corpus(root, {"train": 300, "dev": 14})
    lines = []
    for line in (root / "train.es").read_text(encoding="utf-8").splitlines():
        n = len(line.split())
        lines.append(" ".join(f"{k}-{n - 1 - k}" for k in range(n)))
    (root / "train.align").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return root


def _config(root: Path, head: bool = True) -> dict:
    config = aligned_config(root)
    config["data"].update({"test": None, "dev_alignment": str(root / "dev.align")})
    config["model"]["alignment_head"] = head
    config["training"]["max_steps"] = 60  # a head sure of its links: no near ties
    config["training"]["guided_alignment"] = str(root / "train.align") if head else None
    return config


@pytest.fixture(scope="module")
def head_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = _corpus(tmp_path_factory.mktemp("head"))
    result = nmt("train", str(write_config(root / "config.yaml", _config(root))), "--quiet")
    assert result.code == 0, result.err
    return root


def _texts(root: Path) -> tuple[list[str], list[str]]:
    src = (root / "dev.es").read_text(encoding="utf-8").splitlines()
    trg = (root / "dev.en").read_text(encoding="utf-8").splitlines()
    return src, trg


def test_align_reads_the_head_and_attention_reads_the_attention(head_run: Path) -> None:
    """The forced pass gives the head's weights (Seq2Seq.read's beta, sentence by sentence)
    beside the attention; `nmt align` gives the argmax links of the head's weights and
    `--attention` those of the attention, which differ."""
    root = head_run
    src, trg = _texts(root)
    translator = Translator.from_checkpoint(root / "run" / "last.pt", "cpu")
    results = translator.score(src, trg, translator.config.decoding, True)
    model = translator.model.eval()
    expected_head, expected_attention = [], []
    for source, target, result in zip(src, trg, results, strict=True):
        assert result is not None and result.alignment is not None and result.alphas is not None
        src_ids = translator.tokenizer.encode_src([source])[0]
        trg_ids = translator.tokenizer.encode_trg([target])[0]
        with torch.no_grad():
            _, _, beta = model.read(
                torch.tensor([src_ids]),
                torch.tensor([len(src_ids)]),
                torch.tensor([[BOS_ID, *trg_ids]]),
                torch.tensor([[*trg_ids, EOS_ID]]),
            )
        assert beta is not None
        torch.testing.assert_close(result.alignment, beta[0], rtol=1e-5, atol=1e-6)
        words = (piece_words(translator.tokenizer.src, source),
                 piece_words(translator.tokenizer.trg, target))  # fmt: skip
        expected_head.append(extract_links(result.alignment, *words))
        expected_attention.append(extract_links(result.alphas, *words))
    assert align_pairs(translator, src, trg) == expected_head
    assert align_pairs(translator, src, trg, Extraction(attention=True)) == expected_attention
    assert expected_head != expected_attention

    hyp = root / "head.align"
    done = nmt("align", "-m", str(root / "run" / "last.pt"), "-i", str(root / "dev.es"),
               "-t", str(root / "dev.en"), "-o", str(hyp), "--device", "cpu")  # fmt: skip
    assert done.code == 0, done.err
    lines = hyp.read_text(encoding="utf-8").splitlines()
    assert lines == [" ".join(f"{i}-{j}" for i, j in links) for links in expected_head]


def test_dev_aer_is_the_heads(head_run: Path) -> None:
    """The last validation's dev AER is that of `nmt align` (the head) on its checkpoint."""
    root = head_run
    records = (root / "run" / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(r) for r in records if json.loads(r)["split"] == "dev"][-1]
    hyp = root / "dev_head.align"
    done = nmt("align", "-m", str(root / "run" / "last.pt"), "-i", str(root / "dev.es"),
               "-t", str(root / "dev.en"), "-o", str(hyp), "--device", "cpu")  # fmt: skip
    assert done.code == 0, done.err
    scored = nmt("eval", "--align", str(hyp), "--align-ref", str(root / "dev.align"), "--json")
    assert last["aer"] == pytest.approx(100 * json.loads(scored.out)["aer"], abs=1e-9)


def test_translate_alignments_are_the_heads_on_the_output(head_run: Path) -> None:
    """`translate --alignments` aligns each output as `nmt align` aligns it as a given
    translation; `--extract next` is refused for a head, and allowed with --attention."""
    root = head_run
    model = str(root / "run" / "last.pt")
    out, links = root / "out.en", root / "out.align"
    done = nmt("translate", "-m", model, "-i", str(root / "dev.es"), "-o", str(out),
               "--alignments", str(links), "--device", "cpu")  # fmt: skip
    assert done.code == 0, done.err
    forced = root / "forced.align"
    again = nmt("align", "-m", model, "-i", str(root / "dev.es"), "-t", str(out), "-o",
                str(forced), "--device", "cpu")  # fmt: skip
    assert again.code == 0, again.err
    assert links.read_text(encoding="utf-8") == forced.read_text(encoding="utf-8")

    refused = nmt("align", "-m", model, "--extract", "next", stdin=b"sol luna\tMOON SUN\n")
    assert "--extract next: the model's alignment head" in refused.error
    allowed = nmt("align", "-m", model, "--extract", "next", "--attention",
                  stdin=b"sol luna\tMOON SUN\n")  # fmt: skip
    assert allowed.code == 0, allowed.err


@pytest.fixture(scope="module")
def plain_run(head_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same config without the head and its guidance, on the same corpus."""
    config = _config(head_run, head=False)
    config["run"]["dir"] = str(head_run / "plain_run")
    path = write_config(tmp_path_factory.mktemp("plain") / "plain.yaml", config)
    done = nmt("train", str(path), "--quiet")
    assert done.code == 0, done.err
    return head_run / "plain_run"


def test_the_head_changes_no_translation_weight(head_run: Path, plain_run: Path) -> None:
    """Training with a head (dropout on) ends with every translation weight bit for bit that
    of the run without one: the head draws its initial weights aside, reads detached inputs
    and is clipped by its own norm."""
    with_head = torch.load(head_run / "run" / "last.pt", weights_only=False)["model"]
    without = torch.load(plain_run / "last.pt", weights_only=False)["model"]
    assert set(with_head) - set(without) == {"aligner.query.weight", "aligner.query.bias"}
    for name, value in without.items():
        assert torch.equal(with_head[name], value), name


def test_fine_tuning_adds_a_head_to_a_trained_model(
    head_run: Path, plain_run: Path, tmp_path: Path
) -> None:
    """A fine-tuning run from the run without a head, with a head and every other part
    frozen: the translation weights stay those of the first run, the head learns."""
    config = _config(head_run, head=True)
    tuned = head_run / "tuned_run"
    config["run"]["dir"] = str(tuned)
    config["training"].update(
        init_from=str(plain_run / "last.pt"),
        freeze=["embeddings", "encoder", "decoder", "attention"],
    )
    done = nmt("train", str(write_config(tmp_path / "tuned.yaml", config)), "--quiet")
    assert done.code == 0, done.err
    before = torch.load(plain_run / "last.pt", weights_only=False)["model"]
    after = torch.load(tuned / "last.pt", weights_only=False)["model"]
    assert set(after) - set(before) == {"aligner.query.weight", "aligner.query.bias"}
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    records = (tuned / "metrics.jsonl").read_text().splitlines()
    dev = [json.loads(r) for r in records if json.loads(r)["split"] == "dev"]
    assert dev[-1]["aer"] < dev[0]["aer"], "the head learns to align"


def test_a_context_head_trains_beside_the_same_model_and_aligns_outputs(
    head_run: Path, plain_run: Path, tmp_path: Path
) -> None:
    """model.alignment_head_context through the CLI: the backward GRU joins the head's
    weights, every translation weight is still that of the run without a head, and
    `translate --alignments` re-reads each whole output as `nmt align` reads it."""
    config = _config(head_run, head=True)
    config["model"]["alignment_head_context"] = True
    run = head_run / "context_run"
    config["run"]["dir"] = str(run)
    done = nmt("train", str(write_config(tmp_path / "context.yaml", config)), "--quiet")
    assert done.code == 0, done.err
    with_head = torch.load(run / "last.pt", weights_only=False)["model"]
    without = torch.load(plain_run / "last.pt", weights_only=False)["model"]
    added = set(with_head) - set(without)
    assert {"aligner.query.weight", "aligner.context.weight_hh_l0"} <= added
    assert all(name.startswith("aligner.") for name in added)
    for name, value in without.items():
        assert torch.equal(with_head[name], value), name

    out, links, forced = tmp_path / "out.en", tmp_path / "out.align", tmp_path / "forced.align"
    model = str(run / "last.pt")
    done = nmt("translate", "-m", model, "-i", str(head_run / "dev.es"), "-o", str(out),
               "--alignments", str(links), "--device", "cpu")  # fmt: skip
    assert done.code == 0, done.err
    again = nmt("align", "-m", model, "-i", str(head_run / "dev.es"), "-t", str(out), "-o",
                str(forced), "--device", "cpu")  # fmt: skip
    assert again.code == 0, again.err
    assert links.read_text(encoding="utf-8") == forced.read_text(encoding="utf-8")
    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in records if r["split"] == "dev"]
    assert dev[-1]["aer"] < dev[0]["aer"], "the head learns to align"
