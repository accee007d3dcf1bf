#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize, for `kthena bench serve|trace --peer llama.cpp`.
#
# Usage:  bash benchmarks/peers/build_llama_cpp.sh [PEER_DIR]      (default: benchmarks/peers/llama.cpp)
#
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI (the only
# place llama.cpp reaches this machine from). Each step is skipped when its result is there:
#
#   1. pip download --no-deps --no-binary :all: llama-cpp-python==$VERSION   -> PEER_DIR/sdist/
#   2. unpack it                                                              -> PEER_DIR/src/
#   3. cmake configure: Release, static, CPU only (no CUDA/Metal/Vulkan/BLAS), no TLS, no web UI
#      download; GGML_NATIVE stays at llama.cpp's default (on: tuned for this CPU)
#   4. cmake --build the two targets with JOBS parallel jobs (default 2)     -> PEER_DIR/build/
#   5. copy both binaries                                                    -> PEER_DIR/bin/
#
# PEER_DIR is git-ignored. Nothing in `make test` runs this: it takes ~10+ minutes on 2 cores.
# Environment: PYTHON (default python3, needs pip), JOBS (default 2).
set -euo pipefail

VERSION=0.3.36
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEER_DIR="$(mkdir -p "${1:-$HERE/llama.cpp}" && cd "${1:-$HERE/llama.cpp}" && pwd)"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
SDIST="$PEER_DIR/sdist/llama_cpp_python-$VERSION.tar.gz"
TREE="$PEER_DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$PEER_DIR/build"
TARGETS=(llama-server llama-quantize)

say() { echo "build_llama_cpp: $*"; }
for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || { say "missing '$tool'; install it (apt-get install cmake build-essential)" >&2; exit 1; }
done
start=$(date +%s)
say "start $(date -u +%FT%TZ): llama-cpp-python $VERSION into $PEER_DIR with -j$JOBS"

if [[ ! -f "$SDIST" ]]; then
  say "download $SDIST"
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
    -d "$PEER_DIR/sdist"
fi
if [[ ! -f "$TREE/CMakeLists.txt" ]]; then
  say "unpack into $PEER_DIR/src"
  mkdir -p "$PEER_DIR/src"
  tar -xzf "$SDIST" -C "$PEER_DIR/src"
fi

say "configure $BUILD"
cmake -S "$TREE" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$PEER_DIR/configure.log" 2>&1 || {
  tail -25 "$PEER_DIR/configure.log" >&2; say "configure failed; full log: $PEER_DIR/configure.log" >&2; exit 1; }

say "compile ${TARGETS[*]} (log: $PEER_DIR/compile.log)"
cmake --build "$BUILD" --parallel "$JOBS" --target "${TARGETS[@]}" >"$PEER_DIR/compile.log" 2>&1 || {
  tail -25 "$PEER_DIR/compile.log" >&2; say "compile failed; full log: $PEER_DIR/compile.log" >&2; exit 1; }

mkdir -p "$PEER_DIR/bin"
for target in "${TARGETS[@]}"; do
  cp "$BUILD/bin/$target" "$PEER_DIR/bin/$target"
done
"$PEER_DIR/bin/llama-server" --version 2>&1 | sed -n 1,2p | sed 's/^/build_llama_cpp: /'
say "done $(date -u +%FT%TZ) in $(( $(date +%s) - start ))s: ${TARGETS[*]} in $PEER_DIR/bin"
