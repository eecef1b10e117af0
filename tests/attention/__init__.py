"""Tests of paged KV memory and attention kernels."""
