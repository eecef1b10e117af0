"""Tests of drafter training."""
