//! `forge devices`: the cpu kernels chosen for this CPU (ISA, vector width, FMA peak),
//! then the GPU adapters wgpu finds, with API, type, driver and limits.

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
        anyhow::ensure!(!adapters.is_empty(), "{}", device::no_adapter_message());
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
        Err(super::no_gpu_build())
    }
}
