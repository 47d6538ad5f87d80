#!/usr/bin/env bash
# Run the library's unit tests that miri can execute under miri (nightly + the miri
# component: `rustup +nightly component add miri rust-src`): the safetensors parser on
# in-memory files, panel packing and the portable GEMV/GEMM/causal kernels on small
# shapes (their raw-pointer output writes), the reference ops, the tokenizer, the
# streaming decoder, the sampler, the error measures and the config checks.
#
# Flags: tree borrows (crossbeam-epoch, under rayon, trips the older stacked-borrows
# model), permissive provenance (crossbeam's integer-to-pointer casts), and leaked
# threads allowed (rayon's global pool outlives the test harness's main thread).
set -euo pipefail
cd "$(dirname "$0")/.."
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-tree-borrows -Zmiri-permissive-provenance -Zmiri-ignore-leaks}"
cargo +nightly miri test --lib --no-default-features -- \
    loaders::safetensors loaders::gguf backend::cpu backend::reference tokenizer engine::sampler compare loaders::config "$@"
