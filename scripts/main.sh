#!/usr/bin/env bash
# main.sh: the project's main job: installs missing Debian packages, builds Release and runs the
# serving replay `./build/pkv sim` (arguments are passed on). Fails loudly if sim fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/deps.sh
source scripts/deps.sh

echo "=== build (Release)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
ninja -C build -j "${JOBS:-$(nproc)}"

echo "=== ./build/pkv sim $*"
rc=0
./build/pkv sim "$@" || rc=$?
if [ "$rc" -ne 0 ]; then
    echo "=== FAILED: ./build/pkv sim exited with status $rc" >&2
    exit "$rc"
fi
echo "=== pkv sim done"
