/* avx512_emu.c: src/attn/x86/attn_avx512.c compiled for AVX2, its 512-bit intrinsics emulated
 * (src/attn/x86/avx512_emu.h), as pkv__attn_fill_avx512_emu: test_attn's backend "avx512-emu".
 * A file of its own so that it gets its own flags (CMake gives attn_avx512.c -mavx512f). */
#define PKV_AVX512_EMU 1
#include "attn/x86/attn_avx512.c"
