// cargo run --release --example quickstart
use flashattn::{random::Rng, AttentionOptions, BackwardInputs, Engine, ForwardInputs, TensorView};

fn main() -> flashattn::Result<()> {
    let engine = Engine::new()?; // the best adapter, with its real limits
    let q_data = Rng::new(7).normal_vec(1024 * 8 * 64, 1.0); // seeded N(0, 1) inputs
    let kv_data = Rng::new(8).normal_vec(1024 * 2 * 64, 1.0);
    let q = TensorView::f32([1, 1024, 8, 64], &q_data); // (batch, seqlen, heads, head_dim)
    let k = TensorView::f32([1, 1024, 2, 64], &kv_data); // GQA: 8 query heads share 2 kv heads
    let v = TensorView::f32([1, 1024, 2, 64], &kv_data);
    let opts = AttentionOptions::default().causal(true);
    let inputs = ForwardInputs::new(q, k, v);
    let out = engine.forward(&inputs, &opts)?; // o: (1, 1024, 8, 64), lse: (1, 8, 1024)
    let d_o = TensorView::f32([1, 1024, 8, 64], &q_data); // stands in for the loss's gradient
    let inputs = BackwardInputs::new(inputs, &out, d_o)?;
    let grads = engine.backward(&inputs, &opts)?;
    println!("lse[0] {}, dq[0] {}", out.lse[0], grads.dq.to_f32()[0]);
    Ok(())
}
