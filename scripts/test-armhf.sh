#!/usr/bin/env bash
# test-armhf.sh: cross-builds the library and tests for 32-bit ARM (armv7 hard-float, Debian's
# armhf) and runs them under qemu-arm. Not a stage of scripts/test.sh (CI's 20 minutes have no
# room for it); run it where a change touches sizes, alignment or portable C. The NEON kernels
# are aarch64 code, so this build runs the reference kernels: it checks 32-bit ARM's ABI
# (unsigned char, 8-byte aligned 64-bit fields, a 32-bit size_t) against every unit test.
# Installs what it needs, as scripts/test-arm64.sh does (dpkg multiarch: adds armhf).
# Environment: JOBS (default nproc), BUILD_DIR (default build-armhf), PKV_ARMHF_THREAD=1 also
# runs the threaded tests (test_thr_attn takes minutes under qemu).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/deps.sh
source scripts/deps.sh
if ! dpkg --print-foreign-architectures | grep -qx armhf; then
    if [ "$(id -u)" -ne 0 ]; then sudo dpkg --add-architecture armhf; else dpkg --add-architecture armhf; fi
fi
pkv_install_missing gcc-arm-linux-gnueabihf libc6-dev-armhf-cross qemu-user libxxhash-dev:armhf libcmocka-dev:armhf

JOBS=${JOBS:-$(nproc)}
BUILD_DIR=${BUILD_DIR:-build-armhf}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/arm-linux-gnueabihf.cmake -DCMAKE_BUILD_TYPE=Release \
    -DPKV_TEST_SHARDS=3
ninja -C "$BUILD_DIR" -j "$JOBS"
cd "$BUILD_DIR"
labels=unit
[ "${PKV_ARMHF_THREAD:-0}" = 1 ] && labels='unit|thread'
# the CLI tests spawn pkv, which cannot be exec'd without binfmt_misc (as in the arm64 stage)
env PKV_ATTN_TEST_MAX_LEN="${PKV_ARMHF_ATTN_MAX_LEN:-120}" PKV_STRESS_OPS=20000 \
    ctest --output-on-failure -j "$JOBS" -L "$labels" -E '^test_(run|run_checkpoint|sim|bench_cli)$' --timeout 900
