#!/usr/bin/env bash
# deps.sh: installs the Debian packages the build, tests and main job need, only those missing.
# Sourced by scripts/main.sh and scripts/test.sh (runs apt-get as root, or through sudo).
PKGS=(cmake ninja-build gcc clang libcmocka-dev libxxhash-dev gnuplot-nox libclang-rt-14-dev python3)
missing=()
for p in "${PKGS[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "=== installing: ${missing[*]}"
    SUDO=()
    [ "$(id -u)" -ne 0 ] && SUDO=(sudo)
    "${SUDO[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi
