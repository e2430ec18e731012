"""The CUDA path of the torch executor: what runs only where a CUDA GPU does.

Whether a GPU is usable (:mod:`~musegl_cuda.cuda.availability`, answered without
importing torch), the Triton kernels (:mod:`~musegl_cuda.cuda.kernels`), the host
plan they read (:mod:`~musegl_cuda.cuda.plan`), the captured decode graphs
(:mod:`~musegl_cuda.cuda.graphs`), torch's fused attention for long prefill chunks
(:mod:`~musegl_cuda.cuda.dense_attention`) and the decode graphs' sampler graphs with the device penalty
counts (:mod:`~musegl_cuda.cuda.sampling_graphs`, :mod:`~musegl_cuda.cuda.penalty_counts`).
Importing this package imports nothing (the front asks ``availability`` on every start).
"""
