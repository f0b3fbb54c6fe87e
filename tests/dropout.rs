//! Attention dropout (docs/dropout.md): the generator against Random123's
//! known answers in Rust, WGSL (naga-validated, run on the adapter) and
//! CUDA C (under the host emulation's header); the mask's keep rate and
//! independence; the CPU forward and backward against the f64 reference
//! (which draws the same mask) under the accuracy rule; determinism, p = 0,
//! and every error.

mod common;

use common::{causal, check_cpu, output_grad, Case};
use flashattn::api::dropout_rule::DropoutRule;
use flashattn::cpu::Cpu;
use flashattn::philox::{philox4x32_10, KNOWN_ANSWERS};
use flashattn::{
    dropout_mask, Alibi, AttentionOptions, AttentionShape, BackwardInputs, BlockMask, Error,
    ForwardInputs, Sinks,
};
use flashattn_testkit::{available, Need};
use std::path::PathBuf;
use std::process::Command;

fn dropout(p: f32, seed: u64) -> AttentionOptions {
    AttentionOptions::default().dropout(p).dropout_seed(seed)
}

#[test]
fn philox_matches_random123_known_answers() {
    for (counter, key, want) in KNOWN_ANSWERS {
        assert_eq!(philox4x32_10(counter, key), want);
    }
}

/// Keep bits of `n` consecutive elements of head 0: rows of `cols` keys.
fn bits(p: f32, seed: u64, rows: usize, cols: usize) -> Vec<bool> {
    let shape = AttentionShape::new(1, rows, cols, 1, 1, 8).unwrap();
    dropout_mask(&shape, &dropout(p, seed)).unwrap().keep
}

#[test]
fn keep_rate_is_within_four_sigma_over_a_million_entries() {
    for p in [0.1f64, 0.5] {
        let keep = bits(p as f32, 0x5eed ^ (p * 100.0) as u64, 1000, 1000);
        let n = keep.len() as f64;
        let kept = keep.iter().filter(|&&k| k).count() as f64;
        let sigma = (p * (1.0 - p) / n).sqrt();
        let rate = kept / n;
        assert!(
            (rate - (1.0 - p)).abs() < 4.0 * sigma,
            "p {p}: keep rate {rate}, 4σ = {}",
            4.0 * sigma
        );
    }
}

/// Chi-square of the 2×2 patterns of neighbours (a pair of bits along
/// rows, or along columns) against independent bits at the observed rate,
/// 3 degrees of freedom: below 16.27, the 99.9% critical value.
#[test]
fn neighbouring_bits_are_independent() {
    for (p, seed) in [(0.1f32, 1u64), (0.5, 2), (0.3, u64::MAX)] {
        let (rows, cols) = (1000, 1000);
        let keep = bits(p, seed, rows, cols);
        let rate = keep.iter().filter(|&&k| k).count() as f64 / keep.len() as f64;
        for (name, step) in [("columns", 1), ("rows", cols)] {
            let mut counts = [0f64; 4];
            for i in 0..rows {
                for j in 0..cols {
                    let at = i * cols + j;
                    let next = at + step;
                    if (step == 1 && j + 1 == cols) || next >= keep.len() {
                        continue;
                    }
                    counts[usize::from(keep[at]) * 2 + usize::from(keep[next])] += 1.0;
                }
            }
            let total: f64 = counts.iter().sum();
            let prob = |b: usize| if b == 1 { rate } else { 1.0 - rate };
            let chi2: f64 = (0..4)
                .map(|c| {
                    let expected = total * prob(c / 2) * prob(c % 2);
                    (counts[c] - expected).powi(2) / expected
                })
                .sum();
            assert!(
                chi2 < 16.27,
                "p {p}, {name}: chi-square {chi2}, counts {counts:?}"
            );
        }
    }
}

#[test]
fn a_packed_batch_draws_the_mask_of_the_padded_batch() {
    let (lens_q, lens_k) = ([5usize, 0, 9], [7usize, 3, 4]);
    let opts = dropout(0.4, 99).dropout_offset(11);
    let packed = Case::new(1, 1, 8).varlen(&lens_q, &lens_k).heads(3, 1);
    let shape = AttentionShape::new(1, packed.seqlen_q, packed.seqlen_k, 3, 1, 8).unwrap();
    let popts = packed.opts.clone().opts_with(&opts);
    let got = dropout_mask(&shape, &popts).unwrap();
    let dense = AttentionShape::new(3, 9, 7, 3, 1, 8).unwrap();
    let want = dropout_mask(&dense, &opts).unwrap();
    assert_eq!(got.dims, [3, 3, 9, 7]);
    for b in 0..3 {
        for h in 0..3 {
            for i in 0..9 {
                for j in 0..7 {
                    let at = ((b * 3 + h) * 9 + i) * 7 + j;
                    let inside = i < lens_q[b] && j < lens_k[b];
                    assert_eq!(
                        got.keep[at],
                        inside && want.keep[at],
                        "({b}, {h}, {i}, {j})"
                    );
                }
            }
        }
    }
}

/// Options with a packed batch take `dropout`'s settings.
trait With {
    fn opts_with(self, d: &AttentionOptions) -> AttentionOptions;
}
impl With for AttentionOptions {
    fn opts_with(mut self, d: &AttentionOptions) -> AttentionOptions {
        self.dropout = d.dropout;
        self
    }
}

/// The CPU forward and backward of `case` on every instruction set, each
/// checked against the f64 reference and the baseline (both drawing the
/// mask); the backward run twice must be bit-identical.
fn run(case: &Case) {
    check_cpu(case, |isa, cpu, inputs, bwd| {
        let again = cpu.backward(inputs, &case.opts).unwrap();
        for (a, b) in [
            (&bwd.dq, &again.dq),
            (&bwd.dk, &again.dk),
            (&bwd.dv, &again.dv),
        ] {
            let bits = |t: &flashattn::Tensor| -> Vec<u32> {
                t.to_f32().iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(a), bits(b), "{isa:?} backward not deterministic");
        }
    });
}

#[test]
fn cpu_odd_sizes_causal_and_gqa() {
    for (s, d) in [(1, 1), (3, 64), (113, 127), (113, 1), (3, 127)] {
        run(&Case::new(s, s, d).opts(dropout(0.1, s as u64)));
        run(&Case::new(s, s + 20, d)
            .heads(4, 2)
            .opts(causal().dropout(0.5).dropout_seed(3)));
    }
    run(&Case::new(113, 70, 64)
        .heads(4, 1)
        .opts(dropout(0.3, 5).dropout_offset(1 << 40)));
}

#[test]
fn cpu_low_precision() {
    for p in [flashattn::Precision::F16, flashattn::Precision::Bf16] {
        run(&Case::new(113, 113, 64).precision(p).opts(dropout(0.2, 8)));
        run(&Case::new(97, 113, 59)
            .heads(4, 2)
            .precision(p)
            .opts(causal().dropout(0.5).dropout_seed(9)));
    }
}

#[test]
fn cpu_layouts_varlen_alibi_sinks_block_masks() {
    let drop = |o: AttentionOptions| o.dropout(0.25).dropout_seed(77);
    run(&Case::new(1, 1, 32)
        .varlen(&[5, 0, 40, 113], &[7, 3, 40, 90])
        .heads(4, 2)
        .opts(drop(causal())));
    run(&Case::new(61, 77, 32)
        .heads(4, 2)
        .opts(drop(AttentionOptions::default().alibi(Alibi::standard(4)))));
    run(&Case::new(77, 61, 24)
        .heads(4, 1)
        .f16()
        .opts(drop(causal().sinks(Sinks::new(&[0.5, -1.0, 2.0, 0.0])))));
    let blocks: Vec<u8> = (0..2 * 7 * 4).map(|n| u8::from(n % 3 != 0)).collect();
    let mask = BlockMask::new([1, 2, 7, 4], (16, 24), &blocks).unwrap();
    run(&Case::new(100, 90, 40).opts(drop(AttentionOptions::default().block_mask(mask))));
    // Softcap takes the backward's loop with the softcap's derivative.
    run(&Case::new(50, 70, 32)
        .std(2.0)
        .opts(drop(AttentionOptions::default().softcap(5.0))));
    run(&Case::new(70, 50, 24)
        .f16()
        .opts(drop(causal().softcap(3.0).alibi(Alibi::standard(2)))));
    let shard = drop(causal()).positions(64, 32);
    run(&Case::new(40, 72, 16).opts(shard));
}

#[test]
fn dropout_zero_is_bit_identical_to_no_dropout() {
    let case = Case::new(113, 90, 64).heads(4, 2);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let (_, g) = output_grad(&case);
    let d_o = inputs.grad(&g);
    let none = causal();
    let zero = causal().dropout(0.0).dropout_seed(1234);
    let cpu = Cpu::new();
    let f = |o: &AttentionOptions| cpu.forward(&ForwardInputs::new(q, k, v), o).unwrap();
    let (a, b) = (f(&none), f(&zero));
    assert_eq!(a.o, b.o);
    assert_eq!(a.lse, b.lse);
    let bwd = BackwardInputs::new(ForwardInputs::new(q, k, v), &a, d_o).unwrap();
    let (x, y) = (
        cpu.backward(&bwd, &none).unwrap(),
        cpu.backward(&bwd, &zero).unwrap(),
    );
    assert_eq!((x.dq, x.dk, x.dv), (y.dq, y.dk, y.dv));
}

#[test]
fn dropout_changes_o_but_not_lse() {
    let case = Case::new(50, 60, 16);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let cpu = Cpu::new();
    let plain = cpu
        .forward(&ForwardInputs::new(q, k, v), &AttentionOptions::default())
        .unwrap();
    let dropped = cpu
        .forward(&ForwardInputs::new(q, k, v), &dropout(0.5, 1))
        .unwrap();
    assert_ne!(plain.o, dropped.o);
    for (a, b) in plain.lse.iter().zip(&dropped.lse) {
        assert_eq!(a.to_bits(), b.to_bits());
    }
}

#[test]
fn errors_are_typed() {
    let x = vec![0.5f32; 2 * 3 * 4];
    let view = flashattn::TensorView::f32([1, 3, 2, 4], &x);
    let inputs = ForwardInputs::new(view, view, view);
    for p in [-0.1f32, 1.0, 1.5, f32::NAN, f32::INFINITY] {
        let err = flashattn::cpu::forward(&inputs, &dropout(p, 1)).unwrap_err();
        assert!(
            matches!(err, Error::InvalidDropout { .. }),
            "p {p}: {err:?}"
        );
    }
    let err = flashattn::cpu::forward(&inputs, &AttentionOptions::default().dropout(0.2));
    assert!(matches!(err, Err(Error::MissingDropoutSeed { p }) if p == 0.2));
    // A seed alone (p = 0) is no dropout.
    let seed_only = AttentionOptions::default().dropout_seed(3);
    assert!(flashattn::cpu::forward(&inputs, &seed_only).is_ok());
    // Paths without dropout kernels refuse it by name.
    let unsupported = |r: flashattn::Result<()>| {
        assert!(
            matches!(
                r,
                Err(Error::Unsupported {
                    feature: "dropout",
                    ..
                })
            ),
            "{r:?}"
        )
    };
    unsupported(dropout(0.1, 1).for_decoding(1, 2));
    let layout = flashattn::CacheLayout::Dense {
        batch: 1,
        capacity: 8,
    };
    let cache_shape = flashattn::CacheShape::new(layout, 2, 4).unwrap();
    let mut cache = flashattn::HostKvCache::zeros(cache_shape, flashattn::Precision::F32);
    let q = flashattn::TensorView::f32([1, 1, 2, 4], &x[..8]);
    let step = flashattn::DecodeStep::new(q, &[3]);
    let decoded = Cpu::new().decode(&mut cache, &step, &dropout(0.1, 1), None);
    unsupported(decoded.map(drop));
    assert!(flashattn::AttentionBackend::capabilities(&Cpu::new()).dropout);
}

#[test]
fn the_mask_function_matches_the_rule() {
    let shape = AttentionShape::new(2, 5, 11, 3, 1, 8).unwrap();
    let opts = causal().dropout(0.3).dropout_seed(17).dropout_offset(5);
    let m = dropout_mask(&shape, &opts).unwrap();
    assert_eq!(m.dims, [2, 3, 5, 11]);
    for (b, seq) in flashattn::api::varlen::sequences(&shape, None)
        .iter()
        .enumerate()
    {
        for h in 0..3 {
            let rule = DropoutRule::new(&opts, seq.index, h, 3).unwrap();
            for i in 0..5 {
                for j in 0..11 {
                    let at = ((b * 3 + h) * 5 + i) * 11 + j;
                    assert_eq!(m.keep[at], rule.keeps(i, j));
                }
            }
        }
    }
    // Without dropout every pair is kept.
    let all = dropout_mask(&shape, &AttentionOptions::default()).unwrap();
    assert!(all.keep.iter().all(|&k| k));
}

/// The coordinates the WGSL and CUDA copies are checked on: (key, stream,
/// threshold, row, col) from seeds, offsets and positions that cross word
/// boundaries, and the Rust rule's bit for each.
fn mask_cases() -> Vec<([u32; 7], bool)> {
    let mut out = Vec::new();
    for (n, &(p, seed, offset)) in [
        (0.1f32, 0u64, 0u64),
        (0.5, 0xdead_beef_cafe_f00d, u32::MAX as u64 - 2),
        (0.9, u64::MAX, u64::MAX),
    ]
    .iter()
    .enumerate()
    {
        let opts = dropout(p, seed).dropout_offset(offset);
        let d = opts.dropout;
        for (b, h, i) in [(0, 0, 0), (1, 3, 77), (7, 1, 100_000)] {
            let rule = DropoutRule::new(&opts, b, h, 4).unwrap();
            let [s0, s1] = d.stream(b, h, 4);
            let [k0, k1] = d.key();
            for j in (0..70).chain([1 << 20, (1 << 29) + 5]) {
                let words = [k0, k1, s0, s1, d.threshold(), i as u32, j as u32];
                out.push((words, rule.keeps(i, j)));
            }
        }
        assert!(n < 3);
    }
    out
}

/// A compute kernel over philox.wgsl: the known answers' outputs, the mask
/// cases' bits, then each case's run of `1 + c % 32` bits from its column
/// (`dropout_run`, what the kernels draw).
const WGSL_TEST: &str = r#"
@group(0) @binding(0) var<storage, read> kat_in: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> cases: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let n = id.x;
    let kats = arrayLength(&kat_in) / 2u;
    if (n < kats) {
        let r = philox4x32_10(kat_in[2u * n], kat_in[2u * n + 1u].xy);
        out[4u * n] = r.x;
        out[4u * n + 1u] = r.y;
        out[4u * n + 2u] = r.z;
        out[4u * n + 3u] = r.w;
        return;
    }
    let c = n - kats;
    if (c >= arrayLength(&cases) / 7u) {
        return;
    }
    let w = 7u * c;
    let key = vec2<u32>(cases[w], cases[w + 1u]);
    let stream = vec2<u32>(cases[w + 2u], cases[w + 3u]);
    let keep = dropout_keeps(key, stream, cases[w + 4u], cases[w + 5u], cases[w + 6u]);
    out[4u * kats + c] = select(0u, 1u, keep);
    let n_cases = arrayLength(&cases) / 7u;
    out[4u * kats + n_cases + c] = dropout_run(key, stream, cases[w + 4u], cases[w + 5u], cases[w + 6u], 1u + c % 32u);
}
"#;

fn wgsl_module() -> String {
    format!("{}\n{WGSL_TEST}", flashattn::kernels::compose::PHILOX)
}

#[test]
fn wgsl_philox_validates_with_naga() {
    let src = wgsl_module();
    let module =
        naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
    let caps = naga::valid::Capabilities::empty();
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
}

#[test]
fn wgsl_philox_and_mask_match_rust_bit_for_bit() {
    let Some(engine) = common::engine() else {
        return;
    };
    let (device, queue) = (engine.device(), engine.queue());
    let kat: Vec<u32> = KNOWN_ANSWERS
        .iter()
        .flat_map(|(c, k, _)| c.iter().copied().chain([k[0], k[1], 0, 0]))
        .collect();
    let cases = mask_cases();
    let words: Vec<u32> = cases.iter().flat_map(|(w, _)| *w).collect();
    let n_out = 4 * KNOWN_ANSWERS.len() + 2 * cases.len();
    let got = run_wgsl(device, queue, &kat, &words, n_out);
    for (n, (_, _, want)) in KNOWN_ANSWERS.iter().enumerate() {
        assert_eq!(&got[4 * n..4 * n + 4], want, "WGSL known answer {n}");
    }
    for (c, (w, keep)) in cases.iter().enumerate() {
        assert_eq!(
            got[4 * KNOWN_ANSWERS.len() + c] == 1,
            *keep,
            "WGSL mask case {w:?}"
        );
        // The run from this column: bit t for column col + t, 0 past n.
        let n = 1 + c % 32;
        let want = (0..n).fold(0u32, |bits, t| {
            bits | (u32::from(mapped_keep(w, t as u32)) << t)
        });
        let run = got[4 * KNOWN_ANSWERS.len() + cases.len() + c];
        assert_eq!(run, want, "WGSL run of {n} from mask case {w:?}");
    }
    // The engine's kernels draw it (tests/gpu_dropout.rs checks them).
    assert!(flashattn::AttentionBackend::capabilities(engine).dropout);
}

/// The documented mapping's bit of column `col + t` of a mask case's row.
fn mapped_keep(w: &[u32; 7], t: u32) -> bool {
    let col = w[6].wrapping_add(t);
    let out = philox4x32_10([col >> 3, w[5], w[2], w[3]], [w[0], w[1]]);
    let e = (col & 7) as usize;
    ((out[e >> 1] >> (16 * (e & 1))) & 0xffff) >= w[4]
}

fn run_wgsl(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    kat: &[u32],
    cases: &[u32],
    n_out: usize,
) -> Vec<u32> {
    use wgpu::util::DeviceExt;
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("philox test"),
        source: wgpu::ShaderSource::Wgsl(wgsl_module().into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("philox test"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let storage = |data: &[u32], usage| {
        device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(data),
            usage,
        })
    };
    let read = wgpu::BufferUsages::STORAGE;
    let (a, b) = (storage(kat, read), storage(cases, read));
    let bytes = (n_out * 4) as u64;
    let out = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: a.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: b.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: out.as_entire_binding(),
            },
        ],
    });
    let mut enc = device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups((n_out as u32).div_ceil(64), 1, 1);
    }
    enc.copy_buffer_to_buffer(&out, 0, &staging, 0, bytes);
    queue.submit([enc.finish()]);
    let slice = staging.slice(..);
    slice.map_async(wgpu::MapMode::Read, |r| r.unwrap());
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let data = slice.get_mapped_range().unwrap();
    bytemuck::cast_slice(&data).to_vec()
}

/// cuda/philox.cuh compiled as C++ with the host emulation's header
/// (cuda/emulate/host.h): the known answers and the mask cases.
#[test]
fn cuda_philox_and_mask_match_rust_under_host_emulation() {
    let cxx = std::env::var("FLASHATTN_CXX").unwrap_or_else(|_| "g++".into());
    let probe = Command::new(&cxx)
        .arg("--version")
        .output()
        .map_err(|e| format!("{cxx}: {e}"))
        .and_then(|o| {
            o.status
                .success()
                .then_some(())
                .ok_or(format!("{cxx} failed"))
        });
    if !available(Need::Cxx, probe) {
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    let cases = mask_cases();
    let mut main = String::from("#include <cstdio>\nint main() {\n");
    for (c, k, _) in KNOWN_ANSWERS {
        main += &format!(
            "  {{ Philox4 r = philox4x32_10(Philox4{{{}u, {}u, {}u, {}u}}, {}u, {}u); std::printf(\"%u %u %u %u\\n\", r.x, r.y, r.z, r.w); }}\n",
            c[0], c[1], c[2], c[3], k[0], k[1]
        );
    }
    for (w, _) in &cases {
        main += &format!(
            "  std::printf(\"%d\\n\", (int)dropout_keeps({}u, {}u, {}u, {}u, {}u, {}u, {}u));\n",
            w[0], w[1], w[2], w[3], w[4], w[5], w[6]
        );
    }
    main += "  return 0;\n}\n";
    let dir = std::env::temp_dir().join(format!("flashattn-philox-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("philox.cpp"), dir.join("philox"));
    let text = format!("{}\n{}\n{main}", read("emulate/host.h"), read("philox.cuh"));
    std::fs::write(&src, text).unwrap();
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8(ran.stdout).unwrap();
    let mut lines = text.lines();
    for (_, _, want) in KNOWN_ANSWERS {
        let got: Vec<u32> = lines
            .next()
            .unwrap()
            .split(' ')
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(got, want, "CUDA known answer");
    }
    for (w, keep) in &cases {
        assert_eq!(lines.next() == Some("1"), *keep, "CUDA mask case {w:?}");
    }
}
