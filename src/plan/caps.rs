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
    /// The subgroup sizes the adapter may run, where the device has
    /// SUBGROUP (subgroup reductions in GPU kernels); `None` without.
    pub subgroup: Option<SubgroupSizes>,
    /// The cooperative-matrix shapes the device runs, where it has
    /// EXPERIMENTAL_COOPERATIVE_MATRIX (none otherwise).
    pub coop_matrix: CoopMatrixShapes,
    /// A GPU that says it is one (discrete, integrated or virtual; not a CPU
    /// adapter such as lavapipe, nor the browser's unnamed adapter): there
    /// the planner defaults to the registers kernels.
    pub hardware: bool,
}

#[cfg(test)]
impl DeviceCaps {
    /// Lavapipe's limits and features (8-wide subgroups, the lanes kernels),
    /// for the planners' unit tests.
    pub(crate) fn lavapipe() -> Self {
        DeviceCaps {
            max_workgroup_storage: 32768,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            shader_f16: true,
            lane_subgroup: Some(8),
            subgroup: Some(SubgroupSizes { min: 8, max: 8 }),
            coop_matrix: CoopMatrixShapes::default(),
            hardware: false,
        }
    }
}

/// The range of subgroup sizes an adapter may choose for a kernel
/// (`AdapterInfo::subgroup_min_size..=subgroup_max_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SubgroupSizes {
    pub min: u32,
    pub max: u32,
}

/// Which cooperative-matrix configurations (`C = A·B + C`) a device runs,
/// among those WGSL's `coop_mat8x8`/`coop_mat16x16` can express.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CoopMatrixShapes {
    /// 8×8×8, f32 inputs and accumulators.
    pub f32_8x8: bool,
    /// 16×16×16, f16 inputs, f32 accumulators.
    pub f16_16x16_f32: bool,
    /// 16×16×16, f16 inputs and accumulators.
    pub f16_16x16_f16: bool,
}

impl CoopMatrixShapes {
    /// The shapes in `props` WGSL can express (square 8 or 16, saturating or not).
    pub fn from_properties(props: &[wgpu::CooperativeMatrixProperties]) -> Self {
        use wgpu::CooperativeScalarType::{F16, F32};
        let mut shapes = Self::default();
        for p in props {
            let square = |n: u32| p.m_size == n && p.n_size == n && p.k_size == n;
            match (p.ab_type, p.cr_type) {
                (F32, F32) if square(8) => shapes.f32_8x8 = true,
                (F16, F32) if square(16) => shapes.f16_16x16_f32 = true,
                (F16, F16) if square(16) => shapes.f16_16x16_f16 = true,
                _ => {}
            }
        }
        shapes
    }

    /// Whether the device runs any of them.
    pub fn any(&self) -> bool {
        self.f32_8x8 || self.f16_16x16_f32 || self.f16_16x16_f16
    }
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
            subgroup: None,
            coop_matrix: CoopMatrixShapes::default(),
            hardware: false,
        }
    }

    /// The limits of a device on this adapter: [`DeviceCaps::from_wgpu`]
    /// plus its subgroup sizes, the lanes kernels on CPU adapters with
    /// fixed-size subgroups, and the cooperative-matrix shapes in `coop`
    /// (`Adapter::cooperative_matrix_properties`, used only where the
    /// device has the feature).
    pub fn from_adapter(
        limits: &wgpu::Limits,
        features: wgpu::Features,
        info: &wgpu::AdapterInfo,
        coop: &[wgpu::CooperativeMatrixProperties],
    ) -> Self {
        let fixed = info.subgroup_min_size == info.subgroup_max_size;
        let lanes = info.device_type == wgpu::DeviceType::Cpu
            && features.contains(wgpu::Features::SUBGROUP)
            && fixed
            && LANE_SUBGROUPS.contains(&info.subgroup_min_size);
        let subgroup = features
            .contains(wgpu::Features::SUBGROUP)
            .then_some(SubgroupSizes {
                min: info.subgroup_min_size,
                max: info.subgroup_max_size,
            });
        let coop_matrix = if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            CoopMatrixShapes::from_properties(coop)
        } else {
            CoopMatrixShapes::default()
        };
        Self {
            lane_subgroup: lanes.then_some(info.subgroup_min_size),
            subgroup,
            coop_matrix,
            hardware: matches!(
                info.device_type,
                wgpu::DeviceType::DiscreteGpu
                    | wgpu::DeviceType::IntegratedGpu
                    | wgpu::DeviceType::VirtualGpu
            ),
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
            subgroup: None,
            coop_matrix: CoopMatrixShapes::default(),
            hardware: false,
        }
    }

    /// Most invocations one workgroup may have along x.
    pub fn max_workgroup(&self) -> u32 {
        self.max_invocations.min(self.max_workgroup_size_x).max(1)
    }
}
