"""The networks (decoder layers, Llama / Qwen2 / Qwen3 causal LMs) and loading them from an HF model directory."""
