#!/bin/sh
# One-thread CPU time of decode steps (and the fastest 256-token prefill step) on the Q4_K_M file,
# the float k-quant kernels against the integer ones, both builds, two interleaved rounds.
M=/root/.cache/musegl/tiny-e212cbaa4af7b0c4/model-q4_k_m.gguf
uptime
for round in 1 2; do
  for path in avx512 avx2; do
    for mode in float int; do
      echo "\$ MUSEGL_CPU_KERNELS=$path MUSEGL_CPU_KQUANT=$mode python ../../cpu_step_cputime.py --model $M --sequences 1 --prompt-tokens 256 --decode-steps 12"
      MUSEGL_CPU_KERNELS=$path MUSEGL_CPU_KQUANT=$mode python ../../cpu_step_cputime.py --model $M --sequences 1 --prompt-tokens 256 --decode-steps 12 2>&1 | tail -1
    done
  done
done
uptime
