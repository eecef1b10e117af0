"""Tests of the DFlash drafter: conformance, loading, storage."""
