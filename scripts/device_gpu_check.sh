#!/usr/bin/env bash
# The GPU backend on real hardware (the `device` machine: one NVIDIA H200), as one
# prepared run: the GPU parity and whole-model tests on the real adapter, forge bench on
# random GPT-2 124M and XL, and HF transformers on CUDA with the same configs for a
# 128-token greedy generation. Writes everything under $OUT (or ./device-out).
#
# The machine is bare: it needs the Vulkan loader (see the device README: download
# libvulkan1 & co. into .gl/ here, carry .gl, unpack at the start) and the binaries built
# here (same x86-64): carry target/release/forge and the three GPU test binaries.
#   for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; bash scripts/device_gpu_check.sh
set -uo pipefail
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
export BATCH_FORGE_GPU=${BATCH_FORGE_GPU:-NVIDIA}
FORGE=./target/release/forge
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $FORGE devices
} 2>&1 | tee "$OUT/devices.txt"
# Parity and whole-model tests on the real adapter.
for t in backend_parity gpu_backend model_hf_gpu; do
    bin=$(ls target/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1)
    [ -n "$bin" ] && CI=true "$bin" --test-threads 1 --nocapture 2>&1 | grep -E "gpu|test result|panicked"
done 2>&1 | tee "$OUT/parity.txt"
for m in gpt2 gpt2-xl; do
    $FORGE bench --random $m --backend gpu -p 512 -n 128 -r 5
    $FORGE bench --random $m --backend gpu --dtype f16 -p 512 -n 128 -r 5
done 2>&1 | tee "$OUT/bench.txt"
# HF on CUDA, same random configs (the weights differ; the speed does not depend on them).
for m in gpt2 gpt2-xl; do
    $FORGE random-model --preset $m --out /tmp/rand-$m >/dev/null
    python3 scripts/hf_bench.py /tmp/rand-$m --device cuda -p 512 -n 128 -r 5
done 2>&1 | tee "$OUT/hf_cuda.txt"
