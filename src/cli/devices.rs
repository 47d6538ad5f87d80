//! `forge devices`: the cpu kernels chosen for this CPU (ISA, vector width, FMA peak),
//! then the GPU adapters wgpu finds, with API, type, driver and limits. A machine with no
//! GPU adapter (or a build without the `gpu` feature) is a normal answer, not an error:
//! the cpu line stands, and a `gpu:` line says why `--backend gpu` is unavailable.

pub fn run() -> anyhow::Result<()> {
    {
        // The cpu backend's kernels, and a 50 ms FMA probe for its peak.
        let isa = batch_forge::backend::cpu::simd::Isa::detect();
        super::outln!("{}", isa.describe(Some(isa.fma_peak(0.05))));
    }
    #[cfg(feature = "gpu")]
    {
        use batch_forge::backend::gpu::device;
        let adapters = device::adapters();
        if adapters.is_empty() {
            super::outln!(
                "gpu: no adapter found (wgpu tried Vulkan, Metal and DX12), so --backend gpu is unavailable; \
                 on Linux install a Vulkan driver, e.g. `apt-get install mesa-vulkan-drivers libvulkan1` \
                 for the lavapipe software one"
            );
            return Ok(());
        }
        for (i, a) in adapters.iter().enumerate() {
            super::outln!("{}", device::describe(i, a));
        }
        let chosen = device::pick_adapter(adapters)?.get_info();
        super::outln!(
            "--backend gpu uses: {} ({:?}); set BATCH_FORGE_GPU=<index or name> to choose",
            chosen.name,
            chosen.backend
        );
        Ok(())
    }
    #[cfg(not(feature = "gpu"))]
    {
        super::outln!("gpu: {}", super::no_gpu_build());
        Ok(())
    }
}
