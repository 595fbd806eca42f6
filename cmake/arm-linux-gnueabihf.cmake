# Cross build for 32-bit ARM (armv7 hard-float, Debian's armhf) on a Debian x86-64 host; tests
# run under qemu-arm. The NEON kernels are aarch64 code: this build uses the reference kernels
# (the portable path every target has). Needs: gcc-arm-linux-gnueabihf qemu-user, and the armhf
# libraries (dpkg --add-architecture armhf; apt-get install libxxhash-dev:armhf
# libcmocka-dev:armhf).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR armv7l)
set(CMAKE_C_COMPILER arm-linux-gnueabihf-gcc)
set(CMAKE_LIBRARY_ARCHITECTURE arm-linux-gnueabihf)
set(CMAKE_FIND_ROOT_PATH /usr/arm-linux-gnueabihf)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-arm;/lib/ld-linux-armhf.so.3)
