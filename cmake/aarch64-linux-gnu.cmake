# Cross build for 64-bit ARM (NEON) on a Debian x86-64 host; tests run under qemu-aarch64.
# Needs: gcc-aarch64-linux-gnu qemu-user, and the arm64 libraries (dpkg --add-architecture arm64;
# apt-get install libxxhash-dev:arm64 libcmocka-dev:arm64). See scripts/test-arm64.sh.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
# The multiarch loader, run explicitly: a dynamic guest started through qemu -L hangs in
# pthread_create under qemu 7.2 here, started through its loader it does not.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;/lib/ld-linux-aarch64.so.1)
