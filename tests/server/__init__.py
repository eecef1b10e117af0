"""Tests of the OpenAI-compatible server."""
