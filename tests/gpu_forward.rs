mod common;

use common::{engine, run_gpu, Case};
use flashattn::AttentionOptions;

#[test]
fn smoke() {
    let Some(e) = engine() else { return };
    run_gpu(e, &Case::new(97, 113, 64));
    run_gpu(e, &Case::new(97, 113, 64).f16());
    run_gpu(
        e,
        &Case::new(33, 20, 59).opts(AttentionOptions::default().causal(true)),
    );
}
