//! The device limits the planner reads: plain numbers, so plans can be made
//! and tested for any device without one.

/// Subgroup sizes the lanes kernels are generated for.
pub const LANE_SUBGROUPS: [u32; 3] = [4, 8, 16];

/// The device limits the planner reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceCaps {
    /// `max_compute_workgroup_storage_size`, bytes (M).
    pub max_workgroup_storage: u32,
    /// `max_compute_invocations_per_workgroup`.
    pub max_invocations: u32,
    /// `max_compute_workgroup_size_x`.
    pub max_workgroup_size_x: u32,
    /// SHADER_F16: native `f16` in storage buffers.
    pub shader_f16: bool,
    /// `Some(n)` on CPU adapters (lavapipe) whose subgroups are always `n`
    /// SIMD lanes and that support subgroup operations: there the lanes
    /// kernels ([`super::KernelFamily::Lanes`]) are the fast ones.
    pub lane_subgroup: Option<u32>,
}

impl DeviceCaps {
    /// The limits and features of a device, without the lanes kernels.
    pub fn from_wgpu(limits: &wgpu::Limits, features: wgpu::Features) -> Self {
        Self {
            max_workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_invocations: limits.max_compute_invocations_per_workgroup,
            max_workgroup_size_x: limits.max_compute_workgroup_size_x,
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            lane_subgroup: None,
        }
    }

    /// The limits of a device on this adapter: [`DeviceCaps::from_wgpu`]
    /// plus the lanes kernels on CPU adapters with fixed-size subgroups.
    pub fn from_adapter(
        limits: &wgpu::Limits,
        features: wgpu::Features,
        info: &wgpu::AdapterInfo,
    ) -> Self {
        let fixed = info.subgroup_min_size == info.subgroup_max_size;
        let lanes = info.device_type == wgpu::DeviceType::Cpu
            && features.contains(wgpu::Features::SUBGROUP)
            && fixed
            && LANE_SUBGROUPS.contains(&info.subgroup_min_size);
        Self {
            lane_subgroup: lanes.then_some(info.subgroup_min_size),
            ..Self::from_wgpu(limits, features)
        }
    }

    /// WebGPU's default limits (what a browser grants unless asked for more).
    pub fn webgpu_default() -> Self {
        Self {
            max_workgroup_storage: 16384,
            max_invocations: 256,
            max_workgroup_size_x: 256,
            shader_f16: false,
            lane_subgroup: None,
        }
    }

    /// Most invocations one workgroup may have along x.
    pub fn max_workgroup(&self) -> u32 {
        self.max_invocations.min(self.max_workgroup_size_x).max(1)
    }
}
