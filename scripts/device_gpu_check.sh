#!/usr/bin/env bash
# The GPU backend on real hardware (the `device` machine: one NVIDIA H200), as one
# prepared run: the GPU parity and whole-model tests on the real adapter (GPT-2 and the
# Llama fixtures), cpu/gpu lockstep on GPT-2 and Llama files (HF folders and GGUF), forge
# bench on random GPT-2 124M and XL (f32, f16, and Q8_0/Q4_0 GGUF written on the machine by
# `forge quantize`: blocks resident on the device, and decoded to f16 for comparison;
# batched decode of 1, 16 and 64 sequences, and the batch-invariant matmul whole against
# split over K), SmolLM2 Q4_1 when $SMOLLM2 names it (the file
# is over the 64 MiB carry), and HF transformers on CUDA with the same configs and files.
# Writes everything under $OUT (or ./device-out).
#
# The machine is bare: it needs the Vulkan loader (see the device README: download
# libvulkan1 & co. into .gl/ here, carry .gl, unpack at the start) and the binaries built
# here (same x86-64): carry target/release/forge and, where the 64 MiB carry allows, the
# three GPU test binaries (missing ones are skipped).
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
# cpu and gpu in lockstep on every fixture checkpoint (f32 and f16 weights, f16 KV):
# the max logit difference per step, and an error at the first differing argmax.
for ck in tiny-gpt2 tiny-gpt2-hf-saved tiny-gpt2-f16; do
    for flags in "" "--dtype f16" "--kv-dtype f16"; do
        echo "== $ck $flags"
        # shellcheck disable=SC2086
        $FORGE generate -m tests/fixtures/$ck "Hello, I'm a language model," -n 40 --greedy --backend both $flags | tail -1
    done
done 2>&1 | tee "$OUT/lockstep.txt"
# Llama-family models: the gpu's blocks decoded in its kernels against the cpu's f32 path
# over the same decoded values (what --backend both runs without --dtype).
for f in tests/fixtures/tiny-llama tests/fixtures/tiny-llama/tiny-llama.q4_0.gguf \
    tests/fixtures/tiny-llama/tiny-llama.q8_0.gguf tests/fixtures/tiny-llama/tiny-llama.q5_1.gguf \
    tests/fixtures/tiny-llama-k/tiny-llama-k.q4_k.gguf tests/fixtures/tiny-llama-k/tiny-llama-k.q6_k.gguf \
    tests/fixtures/tiny-llama-odd/tiny-llama-odd.f16.gguf ${SMOLLM2:-}; do
    echo "== $f"
    $FORGE generate -m "$f" "The quick brown fox" -n 24 --greedy --ignore-eos --backend both | tail -1
done 2>&1 | tee -a "$OUT/lockstep.txt"
# Parity and whole-model tests on the real adapter (when their binaries were carried).
for t in backend_parity gpu_backend model_hf_gpu model_llama cli; do
    bin=$(ls target/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1)
    [ -n "$bin" ] && CI=true "$bin" --test-threads 1 --nocapture 2>&1 | grep -E "gpu|test result|panicked"
done 2>&1 | tee "$OUT/parity.txt"
for m in gpt2 gpt2-xl; do
    $FORGE bench --random $m --backend gpu -p 512 -n 128 -r 5
    $FORGE bench --random $m --backend gpu --dtype f16 -p 512 -n 128 -r 5
    # Quantized GGUF made here from a random folder (GPT-2's tokenizer from the fixtures).
    $FORGE random-model --preset $m --out /tmp/rand-$m --force --tokenizer-from tests/fixtures/gpt2-tokenizer >/dev/null
    for t in q8_0 q4_0; do
        $FORGE quantize /tmp/rand-$m /tmp/rand-$m.$t.gguf --type $t >/dev/null
        # The gpu's in-register decoding against the cpu's f32 path, step by step.
        $FORGE generate -m /tmp/rand-$m.$t.gguf "Hello" -n 16 --greedy --ignore-eos --backend both | tail -1
        $FORGE bench -m /tmp/rand-$m.$t.gguf --backend gpu -p 512 -n 128 --npl 1,16,64 -r 5
        # What the server runs: the batch-invariant matmul for every row count, whole
        # against split over K (the default on a GPU for decode batches of up to 64 rows).
        for sk in off auto; do
            $FORGE bench -m /tmp/rand-$m.$t.gguf --backend gpu --batch-invariant --split-k $sk -p 512 -n 128 --npl 1,16,64 -r 3
        done
        $FORGE bench -m /tmp/rand-$m.$t.gguf --backend gpu --dtype f16 -p 512 -n 128 -r 5
        $FORGE bench -m /tmp/rand-$m.$t.gguf --backend cpu -p 512 -n 128 -r 3
    done
done 2>&1 | tee "$OUT/bench.txt"
if [ -n "${SMOLLM2:-}" ] && [ -f "$SMOLLM2" ]; then
    $FORGE bench -m "$SMOLLM2" --backend gpu -p 512 -n 128 --npl 1,16,64 -r 5
    $FORGE bench -m "$SMOLLM2" --backend gpu --dtype f16 -p 512 -n 128 -r 5
    $FORGE generate -m "$SMOLLM2" --backend gpu --chat "What is the capital of France?" -n 32 --greedy
else
    echo "SmolLM2 skipped: set SMOLLM2=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf"
fi 2>&1 | tee "$OUT/bench_llama.txt"
# HF on CUDA, same random configs (the weights differ; the speed does not depend on them).
python3 -c "import torch, transformers" 2>/dev/null || { echo "no torch/transformers here: HF on CUDA skipped" | tee "$OUT/hf_cuda.txt"; exit 0; }
for m in gpt2 gpt2-xl; do
    $FORGE random-model --preset $m --out /tmp/rand-$m --force >/dev/null
    python3 scripts/hf_bench.py /tmp/rand-$m --device cuda -p 512 -n 128 -r 5
    python3 scripts/hf_bench.py /tmp/rand-$m --device cuda --dtype f16 -p 512 -n 128 -r 5 --npl 1,16,64
done 2>&1 | tee "$OUT/hf_cuda.txt"
# SmolLM2 through transformers' GGUF loader (dequantized: HF has no quantized kernels for it).
if [ -n "${SMOLLM2:-}" ] && [ -f "$SMOLLM2" ] && python3 -c "import gguf, accelerate" 2>/dev/null; then
    python3 scripts/hf_bench.py "$SMOLLM2" --device cuda --dtype f16 -p 512 -n 128 -r 5 --npl 1,16,64
else
    echo "HF on SmolLM2 skipped: set SMOLLM2 and pip install gguf accelerate"
fi 2>&1 | tee -a "$OUT/hf_cuda.txt"
