//! Finding a GPU: the wgpu instance (Vulkan, Metal and DX12 only — never a silent
//! OpenGL fallback), adapter listing for `forge devices`, adapter choice and the device
//! request with the limits the kernels need.

use crate::backend::{BackendError, BackendResult};

/// The wgpu backends this build can use.
pub fn backends() -> wgpu::Backends {
    wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12
}

pub fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backends(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    })
}

/// Every adapter the instance sees.
pub fn adapters() -> Vec<wgpu::Adapter> {
    pollster::block_on(instance().enumerate_adapters(backends()))
}

/// What the user sees when there is no adapter.
pub fn no_adapter_message() -> String {
    "no GPU adapter found (wgpu tried Vulkan, Metal and DX12; on Linux install a Vulkan driver, \
     e.g. `apt-get install mesa-vulkan-drivers libvulkan1` for the lavapipe software one, \
     and check `forge devices`)"
        .to_string()
}

/// One line per adapter for `forge devices`.
pub fn describe(index: usize, a: &wgpu::Adapter) -> String {
    let info = a.get_info();
    let limits = a.limits();
    let f16 = a.features().contains(wgpu::Features::SHADER_F16);
    let subgroups = if a.features().contains(wgpu::Features::SUBGROUP) {
        format!("{}..{} lanes", info.subgroup_min_size, info.subgroup_max_size)
    } else {
        "none".to_owned()
    };
    format!(
        "[{index}] {name} — {backend:?}, {kind:?}, driver {driver} {driver_info}\n    \
         shader-f16: {f16}, subgroups: {subgroups}, max storage binding: {bind} MiB, max buffer: {buf} MiB, \
         workgroup memory: {wgm} KiB, max invocations/workgroup: {inv}",
        name = info.name,
        backend = info.backend,
        kind = info.device_type,
        driver = info.driver,
        driver_info = info.driver_info,
        bind = limits.max_storage_buffer_binding_size >> 20,
        buf = limits.max_buffer_size >> 20,
        wgm = limits.max_compute_workgroup_storage_size >> 10,
        inv = limits.max_compute_invocations_per_workgroup,
    )
}

/// The adapter to use: `BATCH_FORGE_GPU` picks one by index or by a substring of its
/// name; otherwise a discrete GPU over an integrated one over a software one.
pub fn choose_adapter() -> BackendResult<wgpu::Adapter> {
    pick_adapter(adapters())
}

/// [`choose_adapter`]'s rule applied to a list already enumerated.
pub fn pick_adapter(mut all: Vec<wgpu::Adapter>) -> BackendResult<wgpu::Adapter> {
    if all.is_empty() {
        return Err(BackendError::Device(no_adapter_message()));
    }
    if let Ok(want) = std::env::var("BATCH_FORGE_GPU") {
        let pos = match want.parse::<usize>() {
            Ok(i) if i < all.len() => Some(i),
            _ => all.iter().position(|a| a.get_info().name.to_lowercase().contains(&want.to_lowercase())),
        };
        let i = pos.ok_or_else(|| {
            BackendError::Invalid(format!("BATCH_FORGE_GPU={want:?} matches no adapter (see `forge devices`)"))
        })?;
        return Ok(all.swap_remove(i));
    }
    let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    };
    all.sort_by_key(rank);
    Ok(all.swap_remove(0))
}

/// Request a device with the adapter's own limits (the defaults cap storage bindings
/// below what GPT-2's tables need), shader-f16 when asked for and available, and
/// subgroups when available. Returns (device, queue, f16, subgroups).
pub fn request_device(
    adapter: &wgpu::Adapter,
    want_f16: bool,
) -> BackendResult<(wgpu::Device, wgpu::Queue, bool, bool)> {
    let f16 = want_f16 && adapter.features().contains(wgpu::Features::SHADER_F16);
    let subgroups = adapter.features().contains(wgpu::Features::SUBGROUP);
    let mut features = wgpu::Features::empty();
    if f16 {
        features |= wgpu::Features::SHADER_F16;
    }
    if subgroups {
        features |= wgpu::Features::SUBGROUP;
    }
    let desc = wgpu::DeviceDescriptor {
        label: Some("batch_forge"),
        required_features: features,
        required_limits: adapter.limits(),
        experimental_features: Default::default(),
        memory_hints: wgpu::MemoryHints::Performance,
        trace: Default::default(),
    };
    let (device, queue) = pollster::block_on(adapter.request_device(&desc))
        .map_err(|e| BackendError::Device(format!("could not open GPU device {}: {e}", adapter.get_info().name)))?;
    Ok((device, queue, f16, subgroups))
}
