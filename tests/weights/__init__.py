"""Tests of demo models and GGUF conversion."""
