/* vnni_emu.c: src/attn/x86/attn_q_vnni.c (q8_0 / q4_0 score) compiled for AVX2, vpdpbusd
 * emulated through SIMDe (src/attn/x86/avx512_emu.h), and the filler of test_quant_attn's backend
 * "avx512-vnni-emu": the avx2 table with every AVX-512 file's kernels over it, emulated, as the
 * backend avx512-vnni has them natively. */
#define PKV_AVX512_EMU 1
#include "attn/x86/attn_q_vnni.c"

void pkv__attn_fill_avx512_emu(pkv__attn_kernels *kt);
void pkv__attn_fill_q_avx512_emu(pkv__attn_kernels *kt);
void pkv__attn_fill_q_emu(pkv__attn_kernels *kt);
void pkv__attn_fill_q_emu_wide(pkv__attn_kernels *kt);

void pkv__attn_fill_q_emu(pkv__attn_kernels *kt) {
    pkv__attn_fill_avx512_emu(kt);
    pkv__attn_fill_q_avx512_emu(kt);
    pkv__attn_fill_q_vnni_emu(kt);
}

/* "avx512-vnni-wide-emu": the same with the score over 16 keys transposed, as CPUs with
 * full-width 512-bit units run it */
void pkv__attn_fill_q_emu_wide(pkv__attn_kernels *kt) {
    pkv__attn_fill_q_emu(kt);
    pkv__attn_fill_q_vnni_wide_emu(kt);
}
