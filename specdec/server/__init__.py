"""The OpenAI-compatible server: protocol, API, metrics, and the hosts that run the engine on a thread or in a process."""
