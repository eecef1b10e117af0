"""Model runners: static buffers, CUDA graph ladders and eager/graph dispatch, shared by the target and drafters."""
