//! The GGUF reader against gguf-py (llama.cpp's Python package): files written by its
//! GGUFWriter and dumped by its GGUFReader (scripts/make_gguf_fixture.py) must read
//! back with the same metadata (keys, types, values) and the same tensor
//! table (names, ggml types, dims, absolute data offsets, sizes, bytes).
//!
//! `BATCH_FORGE_GGUF_CHECK=FILE.gguf:DUMP.json` checks any other file the same way
//! (used on SmolLM2-135M-Instruct.Q4_1.gguf; too large to commit).

mod common;

use std::path::Path;

use batch_forge::loaders::gguf::{GgufFile, MetaValue};
use serde_json::Value;

fn check(gguf: &Path, dump: &Path) {
    let g = GgufFile::open(gguf).unwrap();
    let want: Value = serde_json::from_str(&std::fs::read_to_string(dump).unwrap()).unwrap();
    let meta = want["metadata"].as_object().unwrap();
    let mut keys: Vec<&str> = g.metadata().iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    let mut want_keys: Vec<&str> = meta.keys().map(String::as_str).collect();
    want_keys.sort_unstable();
    assert_eq!(keys, want_keys, "metadata keys (sorted)");
    for (k, w) in meta {
        let got = g.get(k).unwrap();
        let ty = w["type"].as_str().unwrap();
        if ty == "array" {
            let items = got.as_array().unwrap_or_else(|| panic!("{k}: not an array"));
            let want_items = w["value"].as_array().unwrap();
            assert_eq!(items.len(), want_items.len(), "{k}");
            for (i, (g, w)) in items.iter().zip(want_items).enumerate() {
                assert!(same(g, w), "{k}[{i}]: {g:?} vs {w}");
            }
        } else {
            let expected_type = match ty {
                "UINT8" => "u8",
                "INT8" => "i8",
                "UINT16" => "u16",
                "INT16" => "i16",
                "UINT32" => "u32",
                "INT32" => "i32",
                "FLOAT32" => "f32",
                "BOOL" => "bool",
                "STRING" => "string",
                "UINT64" => "u64",
                "INT64" => "i64",
                "FLOAT64" => "f64",
                other => panic!("{k}: type {other}"),
            };
            assert_eq!(got.type_name(), expected_type, "{k}");
            assert!(same(got, &w["value"]), "{k}: {got:?} vs {}", w["value"]);
        }
    }
    let tensors = want["tensors"].as_array().unwrap();
    assert_eq!(g.tensor_infos().len(), tensors.len());
    let data_start = g.header().data_start;
    for (t, w) in g.tensor_infos().iter().zip(tensors) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        assert_eq!(t.ggml_type.name(), w["type"].as_str().unwrap(), "{}", t.name);
        let dims: Vec<u64> = w["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(data_start + t.offset, w["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.n_bytes, w["n_bytes"].as_u64().unwrap(), "{}", t.name);
        let bytes = g.tensor(&t.name).unwrap().bytes;
        let hex: String = bytes.iter().take(16).map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, w["first_bytes"].as_str().unwrap(), "{}", t.name);
    }
}

/// A metadata value equals its JSON dump (numbers exactly: f32 values are dumped as the
/// f64 they widen to).
fn same(got: &MetaValue, want: &Value) -> bool {
    match got {
        MetaValue::String(s) => want.as_str() == Some(s),
        MetaValue::Bool(b) => want.as_bool() == Some(*b),
        MetaValue::F32(_) | MetaValue::F64(_) => want.as_f64() == got.as_f64(),
        MetaValue::I8(v) => want.as_i64() == Some(i64::from(*v)),
        MetaValue::I16(v) => want.as_i64() == Some(i64::from(*v)),
        MetaValue::I32(v) => want.as_i64() == Some(i64::from(*v)),
        MetaValue::I64(v) => want.as_i64() == Some(*v),
        MetaValue::Array(..) => false,
        _ => want.as_u64() == got.as_u64(),
    }
}

#[test]
fn reads_what_gguf_py_writes() {
    for name in ["types.gguf", "aligned64.gguf"] {
        let dir = common::fixture("gguf");
        check(&dir.join(name), &dir.join(format!("{name}.json")));
    }
    let g = GgufFile::open(&common::fixture("gguf/aligned64.gguf")).unwrap();
    assert_eq!(g.header().alignment, 64);
    assert!(g.tensor_infos().iter().all(|t| t.offset % 64 == 0));
}

#[test]
fn checks_another_file_when_asked() {
    let Ok(spec) = std::env::var("BATCH_FORGE_GGUF_CHECK") else {
        eprintln!("(set BATCH_FORGE_GGUF_CHECK=FILE.gguf:DUMP.json to check another file against gguf-py)");
        return;
    };
    let (file, dump) = spec.split_once(':').expect("FILE.gguf:DUMP.json");
    check(Path::new(file), Path::new(dump));
}

/// Every prefix of a valid file is refused with an error, and no single-byte corruption
/// of its header panics (it is an error or, where the byte is free, another valid file).
#[test]
fn truncations_and_corruptions_are_errors() {
    let bytes = std::fs::read(common::fixture("gguf/types.gguf")).unwrap();
    let g = GgufFile::from_bytes("t", bytes.clone()).unwrap();
    let last_end = g.tensor_infos().iter().map(|t| g.header().data_start + t.offset + t.n_bytes).max().unwrap();
    for n in 0..last_end as usize {
        assert!(GgufFile::from_bytes("t", bytes[..n].to_vec()).is_err(), "a {n}-byte prefix was accepted");
    }
    for i in 0..g.header().data_start as usize {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= flip;
            let _ = GgufFile::from_bytes("t", b); // an error or a different valid file; never a panic
        }
    }
}
