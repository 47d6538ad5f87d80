//! `forge devices`: the GPU adapters wgpu finds, with API, type, driver and limits.

pub fn run() -> anyhow::Result<()> {
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
