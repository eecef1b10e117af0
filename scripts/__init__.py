"""Benchmarks, drafter training and export, and the GPU-machine scripts; they import the project, never a test."""
