/* attn_q_avxvnni.c: attn_q_vnni.c's 4-key q8_0 / q4_0 score compiled for AVX2 with AVX-VNNI
 * (the VEX-encoded 256-bit vpdpbusd of Intel's cores without AVX-512: Alder Lake and later
 * client cores, the Sierra Forest and Grand Ridge Xeons), as pkv__attn_fill_q_avxvnni: the
 * backend "avx2-vnni", the avx2 table with these entries over it. A file of its own so that it
 * gets its own flags (CMakeLists.txt: -mavx2 -mfma -mf16c -mavxvnni). */
#define PKV_AVXVNNI 1
#include "attn_q_vnni.c"
