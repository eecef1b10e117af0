"""Tests of benchmark and plotting scripts."""
