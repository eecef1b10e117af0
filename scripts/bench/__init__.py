"""Pieces of `scripts/bench_peers.py`: the compared systems (`systems`) and the report (`report`)."""
