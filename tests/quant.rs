//! Dequantization of every supported GGUF format, bit for bit equal to gguf-py's
//! `quants.dequantize` on blocks it quantized and on random blocks
//! (tests/fixtures/quant, made by scripts/make_quant_fixture.py).

mod common;

use batch_forge::loaders::gguf::GgmlType;
use batch_forge::quant::{SUPPORTED, dequantize};

#[test]
fn every_format_equals_gguf_py_bit_for_bit() {
    for ty in SUPPORTED {
        let dir = common::fixture("quant");
        let blocks = std::fs::read(dir.join(format!("{}.bin", ty.name()))).unwrap();
        let want: Vec<f32> = std::fs::read(dir.join(format!("{}.f32", ty.name())))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let got = dequantize(ty, &blocks).unwrap();
        assert_eq!(got.len(), want.len(), "{}", ty.name());
        // Bits, not values: NaN payloads, infinities and signed zeros must match too.
        let bad = got.iter().zip(&want).position(|(g, w)| g.to_bits() != w.to_bits());
        if let Some(i) = bad {
            panic!("{}: value {i} is {:#x} but gguf-py gives {:#x}", ty.name(), got[i].to_bits(), want[i].to_bits());
        }
        eprintln!("{}: {} values equal to gguf-py", ty.name(), got.len());
    }
}

#[test]
fn partial_blocks_and_unsupported_formats_are_errors() {
    assert!(dequantize(GgmlType::Q4K, &[0; 143]).unwrap_err().contains("whole Q4_K blocks"));
    assert!(dequantize(GgmlType::Iq2Xxs, &[0; 66]).unwrap_err().contains("not supported"));
    assert_eq!(dequantize(GgmlType::Q8_0, &[]).unwrap(), Vec::<f32>::new());
}
