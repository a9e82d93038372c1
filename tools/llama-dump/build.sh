#!/bin/bash
# Builds libllama from a llama.cpp source tree and glmdiff-llama-dump against it.
#
#   bash tools/llama-dump/build.sh LLAMA_CPP_SRC BUILD_DIR [--cuda [ARCH]]
#
# LLAMA_CPP_SRC: a llama.cpp checkout (or llama-cpp-python's sdist vendor/llama.cpp). BUILD_DIR gets
# llama.cpp's build and BUILD_DIR/glmdiff-llama-dump. --cuda builds llama.cpp's CUDA backend for one
# architecture (default 90, Hopper; 120 for Blackwell RTX PRO); llama.cpp's tools, tests, examples and
# server are not built. The llama.cpp commit is $LLAMA_COMMIT, or git's when LLAMA_CPP_SRC is a checkout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 2 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
src=$(cd "$1" && pwd -P) || { echo "build.sh: no directory $1" >&2; exit 2; }
build=$2
shift 2
cuda=OFF arch=90
if [ "${1:-}" = "--cuda" ]; then
    cuda=ON
    shift
    if [ -n "${1:-}" ]; then arch=$1; shift; fi
    case $arch in (*[!0-9]*|'') echo "build.sh: --cuda $arch: expected an architecture number (90, 120)" >&2; exit 2;; esac
fi
[ $# -eq 0 ] || { echo "build.sh: unexpected argument $1 (usage: build.sh LLAMA_CPP_SRC BUILD_DIR [--cuda [ARCH]])" >&2; exit 2; }
[ -f "$src/include/llama.h" ] || { echo "build.sh: $src is not a llama.cpp source tree (no include/llama.h)" >&2; exit 2; }
# the commit of the source tree itself only (not of a checkout it was unpacked into)
top=$(git -C "$src" rev-parse --show-toplevel 2>/dev/null || true)
if [ -z "${LLAMA_COMMIT:-}" ] && [ "$top" = "$src" ]; then
    LLAMA_COMMIT=$(git -C "$src" rev-parse --short=12 HEAD)
fi
commit=${LLAMA_COMMIT:-unknown}
mkdir -p "$build"
build=$(cd "$build" && pwd -P)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_CUDA=$cuda -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF > "$build/cmake-configure.log" 2>&1 \
    || { tail -30 "$build/cmake-configure.log" >&2; exit 2; }
cmake --build "$build" -j"$(nproc)" --target llama > "$build/cmake-build.log" 2>&1 \
    || { tail -30 "$build/cmake-build.log" >&2; exit 2; }
lib=$(dirname "$(find "$build" -name 'libllama.so' | head -1)")
${CXX:-g++} -std=c++17 -O2 -Wall -Wextra -I"$src/include" -I"$src/ggml/include" \
    -DGLMDIFF_LLAMA_COMMIT="\"$commit\"" "$here/glmdiff-llama-dump.cpp" \
    -L"$lib" -lllama -lggml -lggml-base -Wl,-rpath,"$lib" -o "$build/glmdiff-llama-dump"
# the SHA-256 of the tool's model digest (sha256.h) against FIPS 180-4's known answers
${CXX:-g++} -std=c++17 -O2 -Wall -Wextra "$here/sha256_test.cpp" -o "$build/glmdiff-sha256-test"
"$build/glmdiff-sha256-test" > "$build/sha256-test.log" 2>&1 \
    || { cat "$build/sha256-test.log" >&2; echo "build.sh: the SHA-256 self-test failed ($build/sha256-test.log)" >&2; exit 2; }
backend=CPU
[ "$cuda" = ON ] && backend="CUDA sm_$arch"
echo "built $build/glmdiff-llama-dump (llama.cpp $commit, $backend; SHA-256 self-test passed)"
