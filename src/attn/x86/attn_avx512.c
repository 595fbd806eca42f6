/* attn_avx512.c: AVX-512 (F, BW, VL, DQ) primitives of paged attention (f32, f16, bf16 K/V). */
#include "../attn.h"

void pkv__attn_fill_avx512(pkv__attn_kernels *kt) { kt->name = "avx512"; }
