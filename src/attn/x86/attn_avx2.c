/* attn_avx2.c: AVX2 + FMA + F16C primitives of paged attention (f32, f16, bf16 K/V). */
#include "../attn.h"

void pkv__attn_fill_avx2(pkv__attn_kernels *kt) { kt->name = "avx2"; }
