//! Shared by the shader tests (tests/shaders.rs, tests/shaders_coop.rs).

/// Bytes of `var<workgroup>` a module declares, as naga lays them out.
pub fn workgroup_bytes(module: &naga::Module) -> u32 {
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).unwrap();
    module
        .global_variables
        .iter()
        .filter(|(_, g)| g.space == naga::AddressSpace::WorkGroup)
        .map(|(_, g)| layouter[g.ty].size)
        .sum()
}
