//! The device half of a verdict's key: everything about the device and its
//! driver that can change what a kernel computes.

/// Which device and driver a verdict holds for: the graphics API, the
/// adapter's name, vendor and device ids, and the driver's name and
/// version (for CUDA: the device, its compute capability and architecture
/// compiled for, the driver's and NVRTC's versions).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceKey {
    /// `Vulkan`, `Metal`, `Dx12`, `Gl`, `BrowserWebGpu` or `CUDA`.
    pub api: String,
    /// The adapter's (or CUDA device's) name.
    pub adapter: String,
    /// The PCI vendor id (0x10de on CUDA).
    pub vendor: u32,
    /// The PCI device id (on CUDA: the compute capability as 10·major + minor).
    pub device: u32,
    /// The driver's name.
    pub driver: String,
    /// The driver's version and build (wgpu's `driver_info`).
    pub driver_info: String,
}

impl DeviceKey {
    /// The key of a wgpu adapter.
    pub fn of_adapter(info: &wgpu::AdapterInfo) -> Self {
        Self {
            api: format!("{:?}", info.backend),
            adapter: info.name.clone(),
            vendor: info.vendor,
            device: info.device,
            driver: info.driver.clone(),
            driver_info: info.driver_info.clone(),
        }
    }

    /// The key's text in the verdict cache (tabs and line breaks, which the
    /// cache's format uses, become spaces).
    pub fn text(&self) -> String {
        format!(
            "{} {} [{:04x}:{:04x}] driver {} {}",
            self.api, self.adapter, self.vendor, self.device, self.driver, self.driver_info
        )
        .replace(['\t', '\n', '\r'], " ")
    }
}

impl std::fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text())
    }
}
