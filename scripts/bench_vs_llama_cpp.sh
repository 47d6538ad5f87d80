#!/usr/bin/env bash
# Side-by-side benchmark: batch_forge vs llama.cpp on the same random-weight GPT-2 124M,
# f32 and f16, 1 and 2 threads, pp512 and tg128, 5 repetitions; plus the machine's
# memory read bandwidth. Not part of CI. Prints markdown tables.
#
#   scripts/build_llama_cpp.sh            # once: builds /tmp/llama.cpp-build/build/bin/llama-bench
#   pip install numpy safetensors gguf    # for the GGUF conversion
#   scripts/bench_vs_llama_cpp.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/bf-bench}
llama=${LLAMA_BENCH:-/tmp/llama.cpp-build/build/bin/llama-bench}
export PYTHONPATH=${PYTHONPATH:-/tmp/llama.cpp-build/src/vendor/llama.cpp/gguf-py}
mkdir -p "$work"
cargo build --release --bin forge
forge=target/release/forge
if [ ! -f "$work/gpt2/model.safetensors" ]; then
  $forge random-model --preset gpt2 --seed 0 --out "$work/gpt2" --tokenizer-from tests/fixtures/gpt2-tokenizer
fi
for dt in f32 f16; do
  [ -f "$work/gpt2-$dt.gguf" ] || python3 scripts/gpt2_to_gguf.py "$work/gpt2" "$work/gpt2-$dt.gguf" --dtype $dt
done
echo "## memory read bandwidth"
$forge bench --memory -t 1,2 -r 7
for dt in f32 f16; do
  echo "## $dt: llama.cpp"
  "$llama" -m "$work/gpt2-$dt.gguf" -p 512 -n 128 -r 5 -t 1,2 2>/dev/null | grep '^|'
  echo "## $dt: batch_forge"
  $forge bench -m "$work/gpt2" -p 512 -n 128 -r 5 -t 1,2 --dtype $dt
done
