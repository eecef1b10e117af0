"""Tests, laid out like the code; tests/gpu needs CUDA and FlashInfer. Shared helpers live in *_helpers.py."""
