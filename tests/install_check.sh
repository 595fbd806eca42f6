#!/usr/bin/env bash
# install_check.sh BUILD_DIR SOURCE_DIR CC [PYTHON]: what the README promises of an installed
# pagedkv. Installs BUILD_DIR into a scratch prefix, then builds and runs the README example
# (examples/readme_example.c) against that prefix through pkg-config and through CMake's
# find_package(pkv) (also fully static), checks pkv.h as C++ (g++, clang++), then inside another project through add_subdirectory (and that project's
# install, libdir lib/x86_64-linux-gnu, through pkg-config), and, with PYTHON (one that imports numpy), imports the installed Python
# module from <prefix>/<libdir>/pkv/python and checks it loaded the installed library. Exits
# non-zero, saying which step failed, if any does.
set -euo pipefail
build=$1 src=$2 cc=$3 py=${4:-}
tmp=$(mktemp -d /tmp/pkv-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "install_check: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null || fail "cmake --install failed"
pc=$(find "$tmp/prefix" -name pkv.pc | head -n 1)
[ -n "$pc" ] || fail "no pkv.pc installed"
libdir=$(dirname "$(dirname "$pc")")

# pkg-config
flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags --libs pkv) || fail "pkg-config pkv failed"
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Werror -o "$tmp/example_pc" "$src/examples/readme_example.c" $flags ||
    fail "the README example does not build through pkg-config ($flags)"
LD_LIBRARY_PATH=$libdir "$tmp/example_pc" || fail "the README example built through pkg-config failed"
# (ldd's output captured first: grep -q stops reading at its match, and under pipefail the
# SIGPIPE that ldd may then get would fail the check at random)
deps=$(LD_LIBRARY_PATH=$libdir ldd "$tmp/example_pc" 2>&1) || fail "ldd failed: $deps"
grep -q "$libdir/libpkv.so" <<<"$deps" || fail "the pkg-config build did not load the installed libpkv: $deps"

# PKV_NODISCARD defined empty before pkv.h lets a cleanup path drop a status under -Werror
# (GCC warns even through a (void) cast while it is warn_unused_result)
cat >"$tmp/nodiscard.c" <<'C'
#include <pkv.h>
void drop(pkv_cache *c, pkv_seq s) { pkv_seq_release(c, s); }
C
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Werror -DPKV_NODISCARD= -c -o "$tmp/nodiscard.o" "$tmp/nodiscard.c" $flags ||
    fail "pkv.h with PKV_NODISCARD defined empty still warns of an unused status"
# shellcheck disable=SC2086
if "$cc" -std=c11 -Wall -Werror -c -o "$tmp/nodiscard.o" "$tmp/nodiscard.c" $flags 2>/dev/null; then
    fail "pkv.h does not warn of a dropped status (PKV_NODISCARD)"
fi

# C++17 through pkg-config's -I (warnings from pkv.h show; C++11 is ctest's cxx_header_check):
# PKV_NODISCARD is [[nodiscard]] there, so a (void) cast silences it and a dropped status still
# warns; and a user's own standard attribute for it compiles (it comes first in each declaration,
# where Clang wants one). With every C++ compiler here (g++, clang++).
cxxflags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags pkv) || fail "pkg-config --cflags pkv failed"
cat >"$tmp/cxx.cpp" <<'CXX'
#include <pkv.h>
void drop(pkv_cache *c, pkv_seq s) { (void)pkv_seq_release(c, s); }
pkv_seq none() { return PKV_SEQ_NONE; }
CXX
cat >"$tmp/cxx_drop.cpp" <<'CXX'
#include <pkv.h>
void drop(pkv_cache *c, pkv_seq s) { pkv_seq_release(c, s); }
CXX
n_cxx=0
for cxx in g++ clang++; do
    command -v "$cxx" >/dev/null || continue
    n_cxx=$((n_cxx + 1))
    w=(-Wall -Wextra -Wpedantic -Wold-style-cast -Werror)
    # shellcheck disable=SC2086
    "$cxx" -std=c++17 "${w[@]}" -c -o "$tmp/cxx.o" "$tmp/cxx.cpp" $cxxflags ||
        fail "pkv.h as C++17 with $cxx: a (void) cast does not silence PKV_NODISCARD, or it warns"
    # shellcheck disable=SC2086
    if "$cxx" -std=c++17 -Wall -Werror -c -o "$tmp/cxx.o" "$tmp/cxx_drop.cpp" $cxxflags 2>/dev/null; then
        fail "pkv.h as C++17 with $cxx does not warn of a dropped status"
    fi
    # shellcheck disable=SC2086
    "$cxx" -std=c++17 -Wall -Werror '-DPKV_NODISCARD=[[nodiscard]]' -c -o "$tmp/cxx.o" "$tmp/cxx.cpp" $cxxflags ||
        fail "pkv.h with PKV_NODISCARD defined as [[nodiscard]] does not compile with $cxx"
done
[ "$n_cxx" -gt 0 ] || fail "no C++ compiler (g++ or clang++) to check pkv.h as C++"

# find_package(pkv): consumer DIR TARGET [LINE] builds the README example in a project of its own
# linked to TARGET (LINE added to its CMakeLists.txt) and runs it
consumer() {
    local dir=$tmp/$1 tgt=$2 line=${3:-}
    mkdir -p "$dir"
    cat >"$dir/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(consumer C)
find_package(pkv 0.1 REQUIRED)
add_executable(example $src/examples/readme_example.c)
target_link_libraries(example PRIVATE $tgt)
$line
CMAKE
    cmake -S "$dir" -B "$dir/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_C_COMPILER="$cc" >"$dir.log" 2>&1 ||
        { cat "$dir.log"; fail "find_package(pkv) failed ($tgt)"; }
    cmake --build "$dir/build" >>"$dir.log" 2>&1 || { cat "$dir.log"; fail "the find_package build failed ($tgt $line)"; }
    "$dir/build/example" || fail "the README example built through find_package failed ($tgt $line)"
}
consumer consumer pkv::pkv
# a fully static program through pkv::pkv_static (no shared library named in its link interface:
# an -static link refuses any)
consumer static pkv::pkv_static "target_link_options(example PRIVATE -static)"

# add_subdirectory(pkv) in another project (what FetchContent does too), with a libdir two
# levels deep as Debian's: the parent's tree must not stand in for pagedkv's own, only the
# library is built, pkv::pkv links, and the parent's install gives a pkv.pc that points at it
mkdir -p "$tmp/parent"
cat >"$tmp/parent/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(parent C)
add_subdirectory($src pkv)
add_executable(example $src/examples/readme_example.c)
target_link_libraries(example PRIVATE pkv::pkv)
foreach(t pkv_cli test_core_basic)
  if(TARGET \${t})
    message(FATAL_ERROR "add_subdirectory(pkv) built \${t}: only the library is built inside another project")
  endif()
endforeach()
CMAKE
cmake -S "$tmp/parent" -B "$tmp/parent/build" -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_INSTALL_LIBDIR=lib/x86_64-linux-gnu >"$tmp/parent.log" 2>&1 ||
    { cat "$tmp/parent.log"; fail "add_subdirectory(pkv) failed to configure"; }
cmake --build "$tmp/parent/build" >>"$tmp/parent.log" 2>&1 || { cat "$tmp/parent.log"; fail "the add_subdirectory build failed"; }
"$tmp/parent/build/example" || fail "the README example built through add_subdirectory failed"
cmake --install "$tmp/parent/build" --prefix "$tmp/deep" >/dev/null || fail "the parent's cmake --install failed"
pc2="$tmp/deep/lib/x86_64-linux-gnu/pkgconfig"
[ -f "$pc2/pkv.pc" ] || fail "no pkv.pc in $pc2"
[ "$(PKG_CONFIG_PATH=$pc2 pkg-config --variable=includedir pkv)" -ef "$tmp/deep/include" ] ||
    fail "pkv.pc under lib/x86_64-linux-gnu names includedir $(PKG_CONFIG_PATH=$pc2 pkg-config --variable=includedir pkv)"
flags=$(PKG_CONFIG_PATH=$pc2 pkg-config --cflags --libs pkv) || fail "pkg-config pkv (deep libdir) failed"
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Werror -o "$tmp/example_deep" "$src/examples/readme_example.c" $flags ||
    fail "the README example does not build through pkg-config under lib/x86_64-linux-gnu ($flags)"
LD_LIBRARY_PATH="$tmp/deep/lib/x86_64-linux-gnu" "$tmp/example_deep" ||
    fail "the README example built through pkg-config under lib/x86_64-linux-gnu failed"

# the Python module, from where it was installed, with the library beside it
if [ -n "$py" ]; then
    [ -f "$libdir/pkv/python/pagedkv.py" ] || fail "pagedkv.py not installed in $libdir/pkv/python"
    (cd "$tmp" && env -u PKV_LIBRARY PYTHONPATH="$libdir/pkv/python" "$py" - "$libdir" <<'PY'
import os, sys
import numpy as np
import pagedkv
libdir = os.path.realpath(sys.argv[1])
loaded = os.path.realpath(pagedkv._lib._name)
assert loaded.startswith(libdir + os.sep), "loaded %s, not the installed library in %s" % (loaded, libdir)
with pagedkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4, n_threads=1) as c:
    s = c.seq_create()
    slots = c.append(s, [1, 2, 3])
    c.write_kv(0, slots, np.ones((3, 1, 32), np.float32), np.full((3, 1, 32), 2.0, np.float32))
    out = c.decode(0, [s], np.ones((1, 1, 32), np.float32))
    assert np.allclose(out, 2.0), out
print("install_check: python module ok (%s)" % loaded)
PY
    ) || fail "the installed Python module failed"
fi
echo "install_check: ok ($tmp/prefix)"
