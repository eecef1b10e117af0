"""Demo models from PyPI wheels and their GGUF conversion into HF model directories."""
