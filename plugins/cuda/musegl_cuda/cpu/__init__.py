"""CPU kernels that read weights in their stored form (f16, bf16, GGUF Q8_0/Q4_0/Q4_K)."""
