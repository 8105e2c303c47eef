/* The kernel library for bf16 rows, on CPUs with AVX512-BF16 (kernels/cpu_bf16.py loads it): the
   few-row products of bf16, int8 and 4-bit weights, RMSNorm, RoPE, SiLU x up, the decode and the
   causal attention (vdpbf16ps, and AMX tiles), and the fused decode layer, which calls the others.

   One translation unit: the kernel files are included here in an order where each follows what it
   calls, and compiled together (kernels/build.py: the flags of the `bf16` variant), so the fused
   decode layer inlines the same product tiles and norms as the separate calls and gives their
   bits. The AVX512-VNNI and AMX kernels carry their own target attributes and run only where
   the CPU has them (cpu_bf16.vnni, cpu_bf16.amx_usable). */
#include "bf16/common.h"
#include "bf16/gemv_bf16.c"
#include "bf16/gemv_q8i16.c"
#include "bf16/gemv_q8u8.c"
#include "bf16/gemv_q4.c"
#include "bf16/rope.c"
#include "bf16/silu_mul.c"
#include "bf16/rmsnorm.c"
#include "bf16/attention_decode.c"
#include "bf16/attention_rows.c"
#include "bf16/fused_decode.c"
#include "bf16/attention_amx.c"
