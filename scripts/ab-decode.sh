#!/bin/bash
# ab-decode.sh: compare decode attention of two revisions of libpkv in one process, with their
# calls interleaved round by round (bench/ab_decode.c), so that the drift of a shared machine
# weighs on both sides alike. Builds each revision's static library in a scratch worktree (a
# Release build), renames revision A's global symbols with the prefix a_, links both into one
# binary and runs it.
#
#   scripts/ab-decode.sh REV_A REV_B [DTYPE CTX BATCH LAYERS THREADS paged|contig|shared|pc ROUNDS CALLS [EXT]]
#   e.g. scripts/ab-decode.sh HEAD~1 HEAD f16 4096 16 2 2 paged 21 6
# pc: A contiguous, B paged; HEAD HEAD f16 256 16 1 1 pc 21 100 is paged / contiguous in the L3.
# EXT: each call also extends one more sequence of CTX tokens by EXT queries, in one
# pkv_attn_prefill call with the decodes (a chunked prefill batched beside them).
# REV_B may be "work" for the working tree as it is (uncommitted changes included).
# AB_BLOCK_TOKENS=N in the environment: N-token blocks (default 16). AB_BUILD_TYPE: the two
# libraries' CMake build type (default Release; ctest's run of this script takes Debug, which
# compiles in a quarter of the time: it checks the script, not the speed). AB_FLAGS_A=F and
# AB_FLAGS_B=F: each side's pkv_attn_params.flags (1: PKV_ATTN_BF16_DOT), so HEAD HEAD with
# AB_FLAGS_B=1 times the flag against none in one build. AB_SHAPE=HQ,HKV,D[,VD]: query heads, kv
# heads, head_dim and, with VD, v_dim (V in K: AB_SHAPE=16,1,576,512 is DeepSeek's MLA on 16 heads).
# AB_ALIBI_A=1, AB_ALIBI_B=1: that side's calls take ALiBi slopes (HEAD HEAD with AB_ALIBI_B=1 times
# ALiBi against none in one build). AB_CHUNK_A=N, AB_CHUNK_B=N: that side's calls take chunks of N
# positions of local attention (pkv_attn_params.attn_chunk).
# Default run: f16 4096 16 2 2 paged 21 6 (a 256 MiB layer, two layers per side).
set -euo pipefail
if [ $# -lt 2 ]; then sed -n 2,23p "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
root=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
a=$1 b=$2; shift 2
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(f16 4096 16 2 2 paged 21 6)
tmp=$(mktemp -d /tmp/pkv-ab.XXXXXX)
cleanup() {
    for w in "$tmp"/wt-*; do [ -d "$w" ] && git -C "$root" worktree remove --force "$w" >/dev/null 2>&1 || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT

# build_lib REV NAME: libpkv.a of REV at $tmp/NAME.a ("work": the working tree)
build_lib() {
    local src=$root
    if [ "$1" != work ]; then
        src=$tmp/wt-$2
        git -C "$root" worktree add --detach -q "$src" "$1"
    fi
    cmake -S "$src" -B "$tmp/build-$2" -G Ninja -DCMAKE_BUILD_TYPE="${AB_BUILD_TYPE:-Release}" >/dev/null
    cmake --build "$tmp/build-$2" --target pkv_static >/dev/null
    cp "$tmp/build-$2/libpkv.a" "$tmp/$2.a"
}
build_lib "$a" A
build_lib "$b" B
nm --defined-only -g "$tmp/A.a" | awk 'NF == 3 { print $3 " a_" $3 }' | sort -u >"$tmp/syms"
objcopy --redefine-syms="$tmp/syms" "$tmp/A.a" "$tmp/A-renamed.a"
cc -O2 -std=c11 -Wall -Wextra -D_GNU_SOURCE -I"$root/include" -I"$root/tools" "$root/bench/ab_decode.c" \
    "$root/tools/tool_util.c" "$tmp/B.a" "$tmp/A-renamed.a" \
    -lpthread -lm -o "$tmp/ab_decode"
echo "A = $a ($(git -C "$root" rev-parse --short "$a" 2>/dev/null || echo "$a")), B = $b"
"$tmp/ab_decode" "${args[@]}"
