/* avx512_q_emu.c: src/attn/x86/attn_q_avx512.c (fp8 e4m3) compiled for AVX2, its 512-bit
 * intrinsics emulated (src/attn/x86/avx512_emu.h), as pkv__attn_fill_q_avx512_emu. A file of its
 * own so that it gets its own flags. */
#define PKV_AVX512_EMU 1
#include "attn/x86/attn_q_avx512.c"
