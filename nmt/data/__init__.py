"""Corpora (local files, Hugging Face datasets) -> cleaned pairs -> token ids -> batches; the
sentencepiece tokenizer."""
