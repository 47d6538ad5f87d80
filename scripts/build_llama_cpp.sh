#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-tokenize and llama-server (CPU only) from the source distribution of the PyPI
# package llama-cpp-python, which vendors llama.cpp. For side-by-side benchmarks and
# tokenizer comparisons only:
# not used by the tests or CI, and nothing it produces is committed.
#
#   scripts/build_llama_cpp.sh [WORKDIR]      (default /tmp/llama.cpp-build)
#
# Needs: cmake and a C++ compiler (apt-get install -y cmake g++), pip.
# Result: $WORKDIR/build/bin/llama-bench, llama-tokenize and llama-server
set -euo pipefail
work=${1:-/tmp/llama.cpp-build}
mkdir -p "$work"
cd "$work"
if [ ! -d src ]; then
  pip download --no-deps --no-binary llama-cpp-python llama-cpp-python -d sdist
  mkdir src
  tar -xzf sdist/llama_cpp_python-*.tar.gz -C src --strip-components=1
fi
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build build --target llama-bench llama-tokenize llama-server -j "$(nproc)"
echo "built $work/build/bin/llama-bench, llama-tokenize and llama-server"
