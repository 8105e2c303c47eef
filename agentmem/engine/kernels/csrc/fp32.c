/* The kernel library for fp32 rows, on CPUs with AVX2, FMA and F16C (kernels/cpu_fp32.py loads
   it; the engine runs fp32 where the CPU has no AVX512-BF16): the few-row products of int8,
   4-bit and fp32 weights, RMSNorm, RoPE, SiLU x up, the decode attention over an fp32 or fp16
   pool, the causal attention of query rows, and the fused decode layer, which calls the others.

   One translation unit in three variants (kernels/build.py): `avx2`; `vnni512` (-DAGENTMEM_AVX512
   -DAGENTMEM_VNNI512: 512-bit product tiles on vpdpwssd/vpdpbusd) and `avx512bw`
   (-DAGENTMEM_AVX512 -DAGENTMEM_AVX512BW: 512-bit tiles without VNNI). The products give the same
   bits in every variant. The kernel files are included in an order where each follows what it
   calls; compiled together, the fused layer inlines the same tiles as the separate calls. */
#include "fp32/common.h"
#include "fp32/gemv_q8.c"
#include "fp32/gemv_q4.c"
#include "fp32/gemm_f32.c"
#include "fp32/rmsnorm.c"
#include "fp32/rope.c"
#include "fp32/attention_decode.c"
#include "fp32/silu_mul.c"
#include "fp32/fused_decode.c"
#include "fp32/attention_rows.c"
