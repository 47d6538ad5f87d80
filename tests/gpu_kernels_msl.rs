//! The Metal path, checked on Linux: lavapipe runs our WGSL through naga's SPIR-V
//! backend, but on a Mac wgpu translates it to MSL. Every kernel variant the backend can
//! compile goes through naga's WGSL front end, validation and MSL back end here, so a
//! kernel that could not run on Metal fails CI without a Mac.
#![cfg(feature = "gpu")]

use batch_forge::backend::gpu::kernels::{ENTRY_POINTS, SUBGROUP_ENTRY, kernel_sources};

#[test]
fn every_kernel_translates_to_msl() {
    let sources = kernel_sources();
    assert!(
        sources.len() > ENTRY_POINTS.len(),
        "expected every kernel file and its f16 variants, got {}",
        sources.len()
    );
    for (label, src) in &sources {
        let module = naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
        // Validate with the capabilities the backend requests (shader-f16 for f16 weights,
        // subgroups for the subgroup GEMV).
        let caps = naga::valid::Capabilities::SHADER_FLOAT16
            | naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | naga::valid::Capabilities::SUBGROUP;
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
            .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
            .subgroup_operations(naga::valid::SubgroupOperationSet::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{label}: validation: {}", e.emit_to_string(src)));
        // MSL 2.4 (macOS 12 / Apple Silicon era) as wgpu's Metal backend targets.
        let options = naga::back::msl::Options { lang_version: (2, 4), ..Default::default() };
        let pipeline_options = naga::back::msl::PipelineOptions::default();
        let (msl, _) = naga::back::msl::write_string(&module, &info, &options, &pipeline_options)
            .unwrap_or_else(|e| panic!("{label}: MSL: {e}"));
        // Every declared entry point made it into the Metal source as a kernel.
        let file = label.split(' ').next().unwrap();
        let mut entries = ENTRY_POINTS.iter().find(|(f, _)| *f == file).unwrap().1.to_vec();
        if label.ends_with("+subgroups") {
            entries.push(SUBGROUP_ENTRY);
        }
        for entry in &entries {
            assert!(module.entry_points.iter().any(|e| e.name == *entry), "{label}: no entry point {entry}");
            assert!(msl.contains(&format!("kernel void {entry}")), "{label}: {entry} missing from the MSL");
        }
        assert_eq!(module.entry_points.len(), entries.len(), "{label}: ENTRY_POINTS is out of date");
    }
}
