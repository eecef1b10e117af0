"""Tests of scheduling, sampling, speculative decoding, failures."""
