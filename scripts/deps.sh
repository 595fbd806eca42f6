#!/usr/bin/env bash
# deps.sh: installs the Debian packages the build, tests and main job need, only those missing.
# Sourced by scripts/main.sh, scripts/test.sh and scripts/test-arm64.sh (runs apt-get as root,
# or through sudo); pkv_install_missing installs any other list the same way.
pkv_install_missing() {
    local missing=() p arch
    arch=$(dpkg --print-architecture)
    for p in "$@"; do
        # with a foreign architecture also installed (test-arm64.sh), a bare name is ambiguous
        dpkg -s "$p" >/dev/null 2>&1 || dpkg -s "$p:$arch" >/dev/null 2>&1 || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    echo "=== installing: ${missing[*]}"
    local sudo=()
    [ "$(id -u)" -ne 0 ] && sudo=(sudo)
    "${sudo[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
}

pkv_install_missing cmake ninja-build gcc g++ clang libcmocka-dev libxxhash-dev libsimde-dev gnuplot-nox libclang-rt-14-dev python3 python3-numpy \
    libhiredis-dev redis-server
# the Rust bindings' tests: any cargo on PATH (rustup's included), else Debian's
command -v cargo >/dev/null 2>&1 || pkv_install_missing cargo
# the Go bindings' tests: any go on PATH, else Debian's
command -v go >/dev/null 2>&1 || pkv_install_missing golang-go
