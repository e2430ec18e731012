#!/bin/sh
# Two-thread decode steps on the Q4_K_M file (wall, every StoredMatrix product timed): float
# k-quant kernels against the integer ones, both builds, two interleaved rounds.
M=/root/.cache/musegl/tiny-e212cbaa4af7b0c4/model-q4_k_m.gguf
uptime
for round in 1 2; do
  for path in avx512 avx2; do
    for mode in float int; do
      echo "\$ OMP_WAIT_POLICY=PASSIVE MUSEGL_CPU_KERNELS=$path MUSEGL_CPU_KQUANT=$mode python ../../cpu_step_profile.py --model $M --threads 2 --steps 24"
      OMP_WAIT_POLICY=PASSIVE MUSEGL_CPU_KERNELS=$path MUSEGL_CPU_KQUANT=$mode python ../../cpu_step_profile.py --model $M --threads 2 --steps 24 2>&1 | tail -1
    done
  done
done
uptime
