#!/bin/sh
# mw_matmul, one thread, thread CPU time, median of 10 (kernel_variants.py): the float k-quant
# kernels (-DMW_KQUANT_FLOAT, the code before this change) against the integer ones, AVX-512 and
# AVX2 builds (-mno-avx512f) of this checkout's weight_kernels.c, interleaved in one process.
uptime
V='"-DMW_KQUANT_FLOAT" "" "-mno-avx512f -DMW_KQUANT_FLOAT" "-mno-avx512f"'
for spec in "q6_k 202048x1024 1" "q4_k 202048x1024 1" "q4_k 5632x1024 1" "q6_k 1024x2816 1" "q5_k 5632x1024 1" \
            "q4_k 5632x1024 2" "q6_k 5632x1024 3" "q6_k 5632x1024 4" "q4_k 5632x1024 8" \
            "q4_k 5632x1024 256" "q6_k 1024x2816 256" "q4_k 5632x1024 512" "q6_k 1024x2816 512" "q5_k 5632x1024 256"; do
  set -- $spec
  echo "\$ python ../../cpu_kernel_variants.py $1 $2 $3 1 $V"
  eval python ../../cpu_kernel_variants.py $1 $2 $3 1 $V 2>&1 | grep "^q"
done
uptime
