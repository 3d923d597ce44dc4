# Thin wrappers; everything the project needs is installed by `make setup` (with the extra
# `serve`, nmt serve's FastAPI and uvicorn).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU build of torch first (a GPU machine may set TORCH_SPEC to its own build or to "").
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup test test-slow lint docs demo bench bench-data synthetic corpus align-baseline attention-table clean

setup:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install --quiet -e '.[dev,serve,onnx]'

test:
	$(BIN)/python -m pytest

test-slow:
	$(BIN)/python -m pytest -m slow

lint:
	$(BIN)/ruff check nmt tests scripts
	$(BIN)/ruff format --check nmt tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site (mkdocs.yml), offline and strict, into site/; docs/cli.md and
# docs/config.md are regenerated first from the code.
docs:
	$(BIN)/python scripts/cli_reference.py
	$(BIN)/python scripts/config_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo:
	$(BIN)/nmt train configs/demo.yaml

bench:
	$(BIN)/python scripts/bench.py

# The data path's scale figures (docs/benchmarks.md): synthetic corpora of 0.1M, 1M, 4.5M pairs.
bench-data:
	$(BIN)/python scripts/bench_data.py --markdown

# A synthetic parallel corpus with WMT14 en-de's length statistics: make synthetic PAIRS=1000000
PAIRS ?= 1000000
SYNTHETIC ?= runs/synthetic-$(PAIRS)
synthetic:
	$(BIN)/python scripts/synthetic_corpus.py --pairs $(PAIRS) --out $(SYNTHETIC)

# eflomal's alignment of the demo test split, scored against the shipped reference
# (eflomal is an optional extra, installed here, never needed by nmt itself)
align-baseline:
	$(BIN)/python -m pip install --quiet -e '.[align]'
	$(BIN)/python scripts/eflomal_baseline.py --split test

# Every score function with both decoders, 2,000 updates each: test BLEU and AER (docs/alignment.md);
# rows already run are skipped, so it can be run a few rows at a time: make attention-table ROWS="luong:dot"
ROWS ?=
attention-table:
	$(BIN)/python scripts/attention_table.py $(if $(ROWS),--rows $(ROWS))

corpus:
	$(BIN)/python scripts/build_corpus.py --out data/bible

clean:
	rm -rf $(VENV) runs site .pytest_cache
