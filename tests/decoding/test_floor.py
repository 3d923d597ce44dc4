"""Search's row floor (``nmt.decoding.floor``): the probe finds the fewest rows whose step
gives every row the same bits as in a full batch, rises where a step's round-off depends on
the row count, is kept per thread count; and greedy search that drops rows down to the
probed floor gives exactly the outputs of search that keeps every row."""

from __future__ import annotations

import pytest
import torch
from searchref import model, options, source

from nmt.decoding import floor, search
from nmt.decoding.ensemble import Ensemble, StepTables
from nmt.decoding.search import greedy_search

VOCAB = 40


def _tabled(seed: int) -> Ensemble:
    """A float32 Luong model's ensemble with the tables a Translator makes on a CPU."""
    m = model(VOCAB, seed=seed, style="luong", feeding=False)
    tables = [
        StepTables(
            m.decoder.gate_table(),
            m.fast.product(m.generator.weight),
            m.decoder.search_products(),
            m.encoder.source_tables(),
        )
    ]
    return Ensemble([m], tables=tables, floors={})


def test_the_probed_floor_is_a_row_count() -> None:
    assert 1 <= floor.probed_floor(_tabled(1)) <= floor.MIN_ROWS


@pytest.mark.parametrize(("below", "found"), [(3, 3), (9, 9), (66, floor.MIN_ROWS)])
def test_a_step_whose_round_off_depends_on_the_rows_raises_the_floor(
    below: int, found: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that rounds differently under ``below`` rows (as a matmul library's other
    kernels would): the floor is ``below``; MIN_ROWS where even a batch of 65 rows
    differs from a larger one."""
    step = Ensemble.step

    def rounding(self, prev, state):
        log_probs, alphas, following = step(self, prev, state)
        if prev.numel() < below:
            log_probs = log_probs + 1e-6
        return log_probs, alphas, following

    monkeypatch.setattr(Ensemble, "step", rounding)
    assert floor.probed_floor(_tabled(2)) == found


def test_the_floor_is_probed_once_per_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr("nmt.decoding.ensemble.probed_floor", lambda ensemble: calls.append(1) or 3)
    ensemble = _tabled(3)
    threads = torch.get_num_threads()
    assert ensemble.row_floor == 3 and ensemble.row_floor == 3
    assert ensemble.floors == {threads: 3} and len(calls) == 1
    restricted = ensemble.restricted(torch.arange(VOCAB), torch.ones(2, VOCAB, dtype=torch.bool))
    assert restricted.row_floor == 3 and len(calls) == 1  # the restricted share the floors
    assert Ensemble(ensemble.models).row_floor == floor.MIN_ROWS  # no floors: not probed


@pytest.mark.parametrize("restricted", [False, True])
def test_greedy_search_dropping_to_the_probed_floor_changes_nothing(
    restricted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32, 24 sentences of many lengths: rows dropped down to the probed floor (where
    it is under MIN_ROWS), against a batch that keeps every row: the same tokens and the
    same score bits."""
    ensemble = _tabled(4)
    if restricted:
        columns = torch.tensor([0, 1, 2, 3, *range(5, VOCAB, 2)])
        ensemble = ensemble.restricted(columns, torch.ones(24, len(columns), dtype=torch.bool))
    lengths = [2 + (i * 7) % 11 for i in range(24)]
    src, src_lengths = source(lengths, VOCAB, seed=5)
    decoding = options(beam_size=1, ratio=2.0, offset=4)
    drops = []
    select = Ensemble.select

    def counted(self, state, index):
        drops.append(index.numel())
        return select(self, state, index)

    monkeypatch.setattr(Ensemble, "select", counted)
    dropped = greedy_search(ensemble, src, src_lengths, decoding)
    if ensemble.row_floor < floor.MIN_ROWS:
        assert drops and min(drops) < floor.MIN_ROWS  # the batch went under the old floor
    monkeypatch.setattr(search, "kept_rows", lambda ended, width=1, floor=1: None)
    kept = greedy_search(ensemble, src, src_lengths, decoding)
    assert [h.tokens for h in dropped] == [h.tokens for h in kept]
    assert [h.score for h in dropped] == [h.score for h in kept]
    assert len({len(h.tokens) for h in kept}) > 3


def test_step_tables_list_every_weight_they_hold() -> None:
    """What a kept captured step is keyed on besides the model (``captured.kept_key``): the
    gate table and every product's weight, W_hh's, W_c's and W_ch's included, and the
    encoder's table and products."""
    table = _tabled(6).tables[0]
    assert table.gates is not None and table.output is not None and table.products is not None
    source = table.source
    assert source is not None
    weights = table.weights()
    products = [table.output, *table.products.all()]
    assert len(products) == 4  # W_o, W_hh (one layer), W_c, W_ch
    encoder = [p for layer in source.hidden for p in layer]
    assert len(encoder) == 2 and not source.inputs  # one bidirectional layer's W_hh
    assert [w.data_ptr() for w in weights] == [
        table.gates.data_ptr(),
        source.gates.data_ptr(),
        *(p.weight.data_ptr() for p in encoder),
        *(p.weight.data_ptr() for p in products),
    ]
    assert StepTables().weights() == []
