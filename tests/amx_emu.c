/* amx_emu.c: src/attn/x86/attn_amx.c with its tile instructions emulated in C
 * (src/attn/x86/amx_emu.h), as pkv__attn_lp_fill_amx_emu: test_attn's backend "avx512-amx-emu"
 * on CPUs with AVX-512 BF16 and no AMX. A file of its own so that it gets its own flags
 * (AVX-512, no AMX). */
#define PKV_AMX_EMU 1
#include "attn/x86/attn_amx.c"
