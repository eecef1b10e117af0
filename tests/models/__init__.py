"""Tests of the networks against transformers'."""
