//! examples/wgpu_app.rs as a test: an app that owns its device decodes 128
//! tokens with flashattn's attention recorded into its own command
//! encoders, one submit and no read-back per step, no submission of the
//! engine's own among them, and the same tokens and final logits as the
//! model on the host with the CPU backend's attention.

#[allow(dead_code)]
#[path = "../examples/wgpu_app.rs"]
mod app;

use flashattn::{CacheLayout, CacheShape, Precision};
use flashattn_testkit::{available, Need};

#[test]
fn an_app_decodes_with_one_submit_per_step_and_matches_the_cpu() {
    let adapter = app::adapter();
    let probe = adapter.as_ref().map(|_| ()).map_err(|e| e.to_string());
    if !available(Need::Adapter, probe) {
        return;
    }
    let mut app = app::App::new(&adapter.unwrap()).unwrap();

    // The engine's counter counts: reading a cache back is a submission.
    let engine = app.engine();
    let before = engine.submissions();
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 4,
    };
    let cache = engine
        .kv_cache(CacheShape::new(layout, 1, 4).unwrap(), Precision::F32)
        .unwrap();
    engine.read_kv_cache(&cache).unwrap();
    assert!(engine.submissions() > before);

    let config = app::Config::default();
    let weights = app::Weights::random(&config);
    let run = app::decode(&mut app, &config, &weights).unwrap();
    println!(
        "{} tokens/s on {} ({} steps in {:.3} s)",
        run.tokens_per_second(),
        app.adapter,
        run.steps,
        run.seconds
    );
    assert_eq!(run.steps, 128);
    assert_eq!(run.submits, 128, "one submit per step");
    assert_eq!(run.readbacks, 0, "no read-back while decoding");
    assert_eq!(run.engine_submissions, 0, "the engine submitted nothing");
    assert_eq!(run.tokens.len(), config.prompt.len() + 128);
    assert_eq!(run.tokens[..config.prompt.len()], config.prompt[..]);
    assert!(run.tokens.iter().all(|&t| (t as usize) < config.vocab));

    let check = app::check_on_cpu(&config, &weights, &run).unwrap();
    println!("{check:?}");
    assert!(check.disagreeing.is_empty(), "{check:?}");
    assert_eq!(check.agreeing + check.near_ties.len(), 128, "{check:?}");
    assert!(check.max_logit_error <= app::LOGIT_TOLERANCE, "{check:?}");
    assert!(check.passed());
}
