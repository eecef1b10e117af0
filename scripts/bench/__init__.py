"""Pieces of `scripts/bench_peers.py`: the compared systems (`systems`) and the report (`report`); random-weight
models of a real shape for `scripts/bench_steps.py` (`random_models`); and the serving load generator of
`scripts/bench_serve.py` (`chat_prompts`, `chat_request`, `load_generator`, `latency_summary`, `server_process`,
`serving_report`)."""
