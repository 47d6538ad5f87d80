#!/bin/bash
# Side by side, per model and thread count: llama-bench, forge bench, forge bench --kv-dtype f16
# (each -p 512 -n 128 -r 3), two rounds. GPT-2 GGUFs (f32/f16/bf16/q8_0/q4_0.gguf) in $GPT2_GGUF_DIR:
# f32 and f16 by scripts/gpt2_to_gguf.py, the others by `forge quantize f32.gguf T.gguf --type T`
# (byte-identical to llama-quantize's; docs/benchmarks.md shows the commands; a missing file is
# skipped); llama.cpp from scripts/build_llama_cpp.sh.
# Alternates the engines per model and thread count (this host's speed drifts by the minute);
# scripts/bench_vs_llama_cpp.sh makes the GPT-2 f32/f16 files and runs each engine once.
LLAMA=${LLAMA:-/tmp/llama.cpp-build/build/bin}; export LD_LIBRARY_PATH=$LLAMA
F=${F:-target/release/forge}
S=${SMOLLM2:-$HOME/.cache/batch_forge/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}; G=${GPT2_GGUF_DIR:-/tmp/g2}
for round in 1 2; do
for spec in "f32:$G/f32.gguf" "f16:$G/f16.gguf" "bf16:$G/bf16.gguf" "q8_0:$G/q8_0.gguf" "q4_0:$G/q4_0.gguf" "smollm2:$S"; do
  name=${spec%%:*}; M=${spec#*:}
  [ -f "$M" ] || { echo "skipped $name: no $M"; continue; }
  for t in 1 2; do
    l=$($LLAMA/llama-bench -m $M -t $t -r 3 -p 512 -n 128 2>/dev/null | grep -E "\| +(tg|pp)" | awk -F'|' '{printf "%s=%s ", $(NF-2), $(NF-1)}')
    a=$($F bench -m $M -t $t -r 3 -p 512 -n 128 2>/dev/null | grep -E "\| (tg|pp)" | awk -F'|' '{printf "%s=%s ", $8, $9}')
    b=$($F bench -m $M -t $t -r 3 -p 512 -n 128 --kv-dtype f16 2>/dev/null | grep -E "\| (tg|pp)" | awk -F'|' '{printf "%s=%s ", $8, $9}')
    echo "R$round $name t$t | llama: $l | forge: $a | forge-kv16: $b"
  done
done
done
