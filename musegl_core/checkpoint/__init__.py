"""Checkpoint formats: GGUF (llama.cpp converter layout) and Hugging Face directories.

Readers produce a :class:`TextConfig` plus float32 numpy weights named and laid
out as transformers names them (Q/K rows un-permuted, centered norms as ``w``
with the +1 removed), so every executor starts from the same weights.
"""
