#!/usr/bin/env bash
# test-arm64.sh: cross-builds the library and tests for 64-bit ARM and runs them under qemu-user,
# so the NEON attention kernels are compared with the reference on every CI run (this machine
# class is x86-64). Installs what it needs: the cross compiler, qemu-user and the arm64 builds of
# libxxhash and cmocka (multiarch: adds the arm64 architecture to dpkg; scripts/deps.sh installs
# the rest). Called by test.sh as its "arm64" stage; runs alone too.
#
# Under emulation code runs 10-50x slower, so the stage runs the "unit" tests with
# PKV_ATTN_TEST_BACKENDS=neon (the reference is tested natively), shorter oracle contexts
# (PKV_ARM64_ATTN_MAX_LEN, default 80: test_attn's oracles took 287 s of CPU at 120, 189 s at 80,
# its prefills growing with the square of the context), PKV_TEST_EMULATED=1 (test_attn_api's
# 1-and-2-thread tests at 2 threads alone) and a shorter stress run; test_attn and test_quant_attn,
# the longest by far there, run as three ctest entries each (PKV_TEST_SHARDS, tests/tu_shard.h)
# so that ctest -j keeps every core busy to the end. The tests that spawn the pkv
# CLI (test_run*, test_sim, test_bench_cli) are left out: an arm64 binary cannot be exec'd
# without binfmt_misc, and the CLI has no architecture-specific code of its own.
# Environment: JOBS (default nproc), BUILD_DIR (default build-arm64).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/deps.sh
source scripts/deps.sh
# the arm64 libraries come from dpkg multiarch: the architecture must be known before apt-get update
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    if [ "$(id -u)" -ne 0 ]; then sudo dpkg --add-architecture arm64; else dpkg --add-architecture arm64; fi
fi
pkv_install_missing gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user libxxhash-dev:arm64 libcmocka-dev:arm64

JOBS=${JOBS:-$(nproc)}
BUILD_DIR=${BUILD_DIR:-build-arm64}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
    -DPKV_TEST_SHARDS=3
ninja -C "$BUILD_DIR" -j "$JOBS"
cd "$BUILD_DIR"
env PKV_TEST_EMULATED=1 PKV_ATTN_TEST_BACKENDS=neon PKV_ATTN_TEST_MAX_LEN="${PKV_ARM64_ATTN_MAX_LEN:-80}" PKV_STRESS_OPS=20000 \
    ctest --output-on-failure -j "$JOBS" -L unit -E '^test_(run|run_checkpoint|sim|bench_cli)$' --timeout 900
