"""Speculative drafting: per-segment lookup corpora and draft models (the next milestone)."""
