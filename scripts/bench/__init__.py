"""Pieces of `scripts/bench_peers.py`: the compared systems (`systems`) and the report (`report`); and
random-weight models of a real shape for `scripts/bench_steps.py` (`random_models`)."""
