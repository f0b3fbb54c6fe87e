//! The embedding API as an app that owns its device uses it: ranges of its
//! own buffers at odd offsets and sizes, buffers it made with the usages it
//! chose, several calls in one encoder beside its own passes, engines that
//! share its device. Every bad binding is a typed error that leaves the
//! app's encoder usable; every good one gives the accuracy rule's results.

use flashattn::accuracy::{check, forward_ratio};
use flashattn::random::Rng;
use flashattn::{
    reference, AttentionBindings, AttentionOptions, AttentionShape, Engine, Error, Precision,
    Problem, TensorData,
};
use flashattn_testkit::{available, Need};
use std::sync::{Arc, Mutex, OnceLock};
use wgpu::util::DeviceExt;
use wgpu::BufferUsages as U;

/// The app: its adapter, its device (its own features and limits), its
/// queue, flashattn as a guest on them, and what reached its handler.
struct App {
    adapter: wgpu::Adapter,
    device: wgpu::Device,
    queue: wgpu::Queue,
    engine: Engine,
    uncaptured: Arc<Mutex<Vec<String>>>,
}

fn open_device(adapter: &wgpu::Adapter) -> (wgpu::Device, wgpu::Queue) {
    let features = adapter.features() & (wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP);
    pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("the app's device"),
        required_features: features,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("the adapter opens a device with its own features and limits")
}

fn adapter() -> Option<wgpu::Adapter> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    match pollster::block_on(instance.request_adapter(&Default::default())) {
        Ok(a) => Some(a),
        Err(e) => {
            available(Need::Adapter, Err(e.to_string()));
            None
        }
    }
}

/// The process's app, or `None` (waived) where there is no adapter.
fn app() -> Option<&'static App> {
    static APP: OnceLock<Option<App>> = OnceLock::new();
    APP.get_or_init(|| {
        let adapter = adapter()?;
        let (device, queue) = open_device(&adapter);
        let uncaptured: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e| sink.lock().unwrap().push(e.to_string())));
        let engine = Engine::from_device(&adapter, device.clone(), queue.clone()).unwrap();
        Some(App {
            adapter,
            device,
            queue,
            engine,
            uncaptured,
        })
    })
    .as_ref()
}

impl App {
    fn buffer(&self, contents: &[u8], usage: U) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("app buffer"),
                contents,
                usage,
            })
    }

    fn align(&self) -> u64 {
        self.device.limits().min_storage_buffer_offset_alignment as u64
    }

    fn encoder(&self) -> wgpu::CommandEncoder {
        self.device.create_command_encoder(&Default::default())
    }

    /// Submit `encoder` with copies of `buffers` appended, and read them.
    fn submit_and_read(
        &self,
        mut encoder: wgpu::CommandEncoder,
        buffers: &[&wgpu::Buffer],
    ) -> Vec<Vec<u8>> {
        let staging: Vec<wgpu::Buffer> = buffers
            .iter()
            .map(|b| {
                let s = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("app readback"),
                    size: b.size(),
                    usage: U::MAP_READ | U::COPY_DST,
                    mapped_at_creation: false,
                });
                encoder.copy_buffer_to_buffer(b, 0, &s, 0, b.size());
                s
            })
            .collect();
        self.queue.submit([encoder.finish()]);
        for s in &staging {
            s.slice(..).map_async(wgpu::MapMode::Read, |_| {});
        }
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .unwrap();
        staging
            .iter()
            .map(|s| s.slice(..).get_mapped_range().unwrap().to_vec())
            .collect()
    }

    /// Nothing reached the app's handler since the last call.
    fn handler_is_quiet(&self) {
        let seen: Vec<String> = std::mem::take(&mut self.uncaptured.lock().unwrap());
        assert!(seen.is_empty(), "the app's handler saw {seen:?}");
    }

    /// The error of a forward on `b`, which must fail, recorded into `encoder`.
    fn forward_error(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        problem: &Problem,
        b: &AttentionBindings,
    ) -> Error {
        self.engine
            .encode_forward(encoder, problem, b)
            .expect_err("a forward on bad bindings fails")
    }

    /// A good forward recorded into `encoder` after a failed call, then its
    /// submit: the encoder is still the app's, and the result meets the rule.
    fn good_forward_after(&self, mut encoder: wgpu::CommandEncoder, case: &Fwd, good: &FwdBuffers) {
        self.engine
            .encode_forward(&mut encoder, &case.problem(), &good.bindings())
            .unwrap();
        let out = self.submit_and_read(encoder, &[&good.outputs]);
        self.handler_is_quiet();
        let (o, lse) = good.outputs(&out[0]);
        case.check(o, lse);
    }
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(bytes)
}

/// A forward case's host inputs (f32 values rounded to `precision`) and
/// their stored bytes.
struct Fwd {
    shape: AttentionShape,
    precision: Precision,
    opts: AttentionOptions,
    q: TensorData,
    k: TensorData,
    v: TensorData,
}

impl Fwd {
    fn new(shape: AttentionShape, precision: Precision, opts: AttentionOptions, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut data = |n| {
            let v: Vec<f32> = rng.normal_vec(n, 1.0);
            TensorData::from_f32(v, precision)
        };
        Self {
            q: data(shape.q_len()),
            k: data(shape.kv_len()),
            v: data(shape.v_len()),
            shape,
            precision,
            opts,
        }
    }

    fn problem(&self) -> Problem<'_> {
        Problem::new(self.shape, self.precision, &self.opts).unwrap()
    }

    /// Bytes of a tensor of `n` elements as the device holds it (f16 and
    /// bf16 pairs in a word).
    fn bytes(&self, n: usize) -> u64 {
        ((n * self.precision.bytes()).div_ceil(4) * 4) as u64
    }

    fn o_bytes(&self) -> u64 {
        self.bytes(self.shape.o_len())
    }

    fn lse_bytes(&self) -> u64 {
        (self.shape.lse_len() * 4) as u64
    }

    fn stored(t: &TensorData) -> Vec<u8> {
        let mut b = t.as_host().as_bytes().to_vec();
        b.resize(b.len().div_ceil(4) * 4, 0);
        b
    }

    /// o and lse against the f64 reference under the accuracy rule.
    fn check(&self, o: &[u8], lse: &[u8]) {
        let [q, k, v] = [
            self.q.view(self.shape.q_shape()),
            self.k.view(self.shape.kv_shape()),
            self.v.view(self.shape.v_shape()),
        ];
        let r = reference::forward(&q, &k, &v, &self.opts).unwrap();
        let b = reference::naive_baseline(&q, &k, &v, &self.opts).unwrap();
        let o = TensorData::from_bytes(o, self.precision, self.shape.o_len()).unwrap();
        let o64: Vec<f64> = o.to_f32().iter().map(|&x| x as f64).collect();
        let lse64: Vec<f64> = floats(lse)[..self.shape.lse_len()]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let ratio = forward_ratio(self.opts.softcap_value() > 0.0);
        for c in [
            check("o", &o64, &r.o, &b.o, self.precision, ratio),
            check("lse", &lse64, &r.lse, &b.lse, Precision::F32, ratio),
        ] {
            assert!(c.passed(), "{c}");
        }
    }
}

/// The app's forward tensors: q, k, v in one buffer, o and lse in another,
/// each at an aligned non-zero offset.
struct FwdBuffers {
    inputs: wgpu::Buffer,
    outputs: wgpu::Buffer,
    /// `(offset, bytes)` of q, k, v in `inputs`, then o, lse in `outputs`.
    at: [(u64, u64); 5],
}

impl FwdBuffers {
    fn new(app: &App, case: &Fwd, usage: U) -> Self {
        let align = app.align();
        let place = |sizes: &[u64], start: u64| -> (Vec<(u64, u64)>, u64) {
            let mut next = start;
            let mut at = Vec::new();
            for &s in sizes {
                at.push((next, s));
                next = (next + s).div_ceil(align) * align + align;
            }
            (at, next)
        };
        let ins: Vec<Vec<u8>> = [&case.q, &case.k, &case.v].map(Fwd::stored).to_vec();
        let (in_at, in_len) = place(
            &ins.iter().map(|b| b.len() as u64).collect::<Vec<_>>(),
            align,
        );
        let (out_at, out_len) = place(&[case.o_bytes(), case.lse_bytes()], align);
        let mut in_bytes = vec![0u8; in_len as usize];
        for (b, &(off, len)) in ins.iter().zip(&in_at) {
            in_bytes[off as usize..(off + len) as usize].copy_from_slice(b);
        }
        let out_bytes = vec![0xffu8; out_len as usize];
        Self {
            inputs: app.buffer(&in_bytes, usage),
            outputs: app.buffer(&out_bytes, usage),
            at: [in_at[0], in_at[1], in_at[2], out_at[0], out_at[1]],
        }
    }

    fn binding(&self, i: usize) -> wgpu::BufferBinding<'_> {
        let (offset, bytes) = self.at[i];
        wgpu::BufferBinding {
            buffer: if i < 3 { &self.inputs } else { &self.outputs },
            offset,
            size: wgpu::BufferSize::new(bytes),
        }
    }

    fn bindings(&self) -> AttentionBindings<'_> {
        AttentionBindings {
            q: self.binding(0),
            k: self.binding(1),
            v: self.binding(2),
            o: self.binding(3),
            lse: self.binding(4),
        }
    }

    /// o's and lse's bytes out of the read-back output buffer.
    fn outputs<'b>(&self, out: &'b [u8]) -> (&'b [u8], &'b [u8]) {
        let slice = |(o, n): (u64, u64)| &out[o as usize..(o + n) as usize];
        (slice(self.at[3]), slice(self.at[4]))
    }
}

fn small_case() -> Fwd {
    let shape = AttentionShape::new(1, 13, 21, 4, 2, 16).unwrap();
    Fwd::new(shape, Precision::F32, AttentionOptions::default(), 11)
}

/// An offset so large that offset + size wraps around u64 is outside the
/// buffer, not a range the check lets through.
#[test]
fn a_binding_whose_end_wraps_around_is_outside_its_buffer() {
    let Some(app) = app() else { return };
    let case = small_case();
    let bufs = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let mut b = bufs.bindings();
    let align = app.align();
    b.k.offset = (u64::MAX / align) * align;
    let mut encoder = app.encoder();
    let err = app.forward_error(&mut encoder, &case.problem(), &b);
    assert!(
        matches!(err, Error::BindingOutsideBuffer { tensor: "k", .. }),
        "{err:?}"
    );
    app.good_forward_after(encoder, &case, &bufs);
}

/// A range of the rest of the buffer (no size) that starts at its end, or
/// past it, binds nothing: too small, or outside.
#[test]
fn a_binding_of_the_rest_of_a_buffer_from_its_end_is_a_typed_error() {
    let Some(app) = app() else { return };
    let case = small_case();
    let bufs = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let problem = case.problem();
    for offset in [bufs.outputs.size(), bufs.outputs.size() + app.align()] {
        let mut b = bufs.bindings();
        b.lse = wgpu::BufferBinding {
            buffer: &bufs.outputs,
            offset,
            size: None,
        };
        let mut encoder = app.encoder();
        let err = app.forward_error(&mut encoder, &problem, &b);
        assert!(
            matches!(
                err,
                Error::BindingOutsideBuffer { tensor: "lse", .. }
                    | Error::BufferTooSmall { buffer: "lse", .. }
            ),
            "{err:?}"
        );
        app.good_forward_after(encoder, &case, &bufs);
    }
}

/// A buffer the app made without `STORAGE` cannot be bound: the call is a
/// typed error, and the app's encoder is still good for its own work.
#[test]
fn a_buffer_without_storage_usage_is_a_typed_error_and_the_encoder_stays_usable() {
    let Some(app) = app() else { return };
    let case = small_case();
    let good = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let no_storage = FwdBuffers::new(app, &case, U::COPY_SRC | U::COPY_DST);
    let mut encoder = app.encoder();
    let mut b = good.bindings();
    b.q = no_storage.binding(0);
    let err = app.forward_error(&mut encoder, &case.problem(), &b);
    assert!(
        matches!(
            err,
            Error::BufferUsage {
                tensor: "q",
                missing: "STORAGE"
            }
        ),
        "{err:?}"
    );
    app.good_forward_after(encoder, &case, &good);
}

/// A buffer of another device is the app's mistake, reported as a typed
/// error; the encoder stays usable.
#[test]
fn a_buffer_of_another_device_is_a_typed_error() {
    let Some(app) = app() else { return };
    let (other_device, other_queue) = open_device(&app.adapter);
    let case = small_case();
    let good = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let other_app = App {
        adapter: app.adapter.clone(),
        device: other_device.clone(),
        queue: other_queue.clone(),
        engine: Engine::from_device(&app.adapter, other_device, other_queue).unwrap(),
        uncaptured: Arc::default(),
    };
    let foreign = FwdBuffers::new(&other_app, &case, U::STORAGE | U::COPY_SRC);
    let mut encoder = app.encoder();
    let mut b = good.bindings();
    b.v = foreign.binding(2);
    let err = app.forward_error(&mut encoder, &case.problem(), &b);
    // wgpu's validation error, as docs/architecture.md says.
    assert!(matches!(err, Error::Device { .. }), "{err:?}");
    app.good_forward_after(encoder, &case, &good);
}

/// The app's own kernel: `dst[i] = src[i] · s` for `i < n`.
const SCALE_WGSL: &str = "
struct P { n: u32, s: f32, pad0: u32, pad1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    if g.x < p.n { dst[g.x] = src[g.x] * p.s; }
}
";

impl App {
    /// Record the app's own pass `dst = src · s` over `n` floats.
    fn scale(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        src: wgpu::BufferBinding,
        dst: wgpu::BufferBinding,
        n: usize,
        s: f32,
    ) {
        static PIPELINE: OnceLock<wgpu::ComputePipeline> = OnceLock::new();
        let pipeline = PIPELINE.get_or_init(|| {
            let module = self
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some("app scale"),
                    source: wgpu::ShaderSource::Wgsl(SCALE_WGSL.into()),
                });
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some("app scale"),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                })
        });
        let mut p = [0u8; 16];
        p[..4].copy_from_slice(&(n as u32).to_le_bytes());
        p[4..8].copy_from_slice(&s.to_le_bytes());
        let uniform = self.buffer(&p, U::UNIFORM);
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("app scale"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: uniform.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: wgpu::BindingResource::Buffer(src),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: wgpu::BindingResource::Buffer(dst),
                },
            ],
        });
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups((n as u32).div_ceil(64), 1, 1);
    }
}

/// The K and V ranges of a cache on the app's buffers must be disjoint: an
/// append writing both would otherwise write one over the other.
#[test]
fn kv_cache_in_with_intersecting_k_and_v_ranges_is_a_typed_error() {
    use flashattn::{CacheLayout, CacheShape};
    let Some(app) = app() else { return };
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 16,
    };
    let shape = CacheShape::new(layout, 2, 16).unwrap();
    let bytes = (shape.len() * 4) as u64;
    let align = app.align();
    let buffer = app.buffer(&vec![0u8; (3 * bytes) as usize], U::STORAGE | U::COPY_SRC);
    let at = |offset, size| wgpu::BufferBinding {
        buffer: &buffer,
        offset,
        size: wgpu::BufferSize::new(size),
    };
    // V the same range as K, and V starting inside K.
    for v_offset in [0, align] {
        let err = app
            .engine
            .kv_cache_in(shape, Precision::F32, at(0, bytes), at(v_offset, bytes))
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::OverlappingBindings {
                    output: "v cache",
                    other: "k cache"
                }
            ),
            "{err:?}"
        );
    }
    // Disjoint ranges of one buffer are a cache.
    let next = bytes.div_ceil(align) * align;
    app.engine
        .kv_cache_in(shape, Precision::F32, at(0, bytes), at(next, bytes))
        .unwrap();
    app.handler_is_quiet();
}

/// Something the app records into an encoder.
type Recording<'a> = Box<dyn Fn(&mut wgpu::CommandEncoder) + 'a>;

/// A forward, the app's pass feeding its o to a second forward as q, and a
/// backward of the second, all in one encoder with one submit, give the
/// bytes the same calls give each in an encoder and submit of its own.
#[test]
fn calls_in_one_encoder_between_the_apps_passes_equal_separate_submits() {
    let Some(app) = app() else { return };
    let shape = AttentionShape::new(1, 29, 29, 4, 2, 16).unwrap();
    let opts = AttentionOptions::default().causal(true);
    let case = Fwd::new(shape, Precision::F32, opts.clone(), 21);
    let problem = case.problem();
    let n = shape.q_len();
    let run = |one_encoder: bool| -> Vec<Vec<u8>> {
        let a = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC | U::COPY_DST);
        let b = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC | U::COPY_DST);
        let grads = app.buffer(&vec![0u8; 3 * n * 4 + 2 * 256], U::STORAGE | U::COPY_SRC);
        let g = |i: u64| wgpu::BufferBinding {
            buffer: &grads,
            offset: i * ((n * 4) as u64).next_multiple_of(256),
            size: wgpu::BufferSize::new((n * 4) as u64),
        };
        let mut steps: Vec<Recording> = Vec::new();
        // The app halves q in place... into b's q range (b's q is written
        // by the app, then read by flashattn).
        steps.push(Box::new(|e| {
            app.scale(e, a.binding(0), b.binding(0), n, 0.5)
        }));
        steps.push(Box::new(|e| {
            app.engine
                .encode_forward(e, &problem, &b.bindings())
                .unwrap();
        }));
        // b's o becomes a's q.
        steps.push(Box::new(|e| {
            app.scale(e, b.binding(3), a.binding(0), n, 1.0)
        }));
        steps.push(Box::new(|e| {
            app.engine
                .encode_forward(e, &problem, &a.bindings())
                .unwrap();
        }));
        steps.push(Box::new(|e| {
            let gb = flashattn::GradientBindings {
                q: a.binding(0),
                k: a.binding(1),
                v: a.binding(2),
                o: a.binding(3),
                d_o: b.binding(0),
                lse: a.binding(4),
                dq: g(0),
                dk: wgpu::BufferBinding {
                    size: wgpu::BufferSize::new((shape.kv_len() * 4) as u64),
                    ..g(1)
                },
                dv: wgpu::BufferBinding {
                    size: wgpu::BufferSize::new((shape.kv_len() * 4) as u64),
                    ..g(2)
                },
                scratch: None,
            };
            app.engine.encode_backward(e, &problem, &gb).unwrap();
        }));
        let all = [&a.inputs, &a.outputs, &b.inputs, &b.outputs, &grads];
        if one_encoder {
            let mut e = app.encoder();
            for s in &steps {
                s(&mut e);
            }
            app.submit_and_read(e, &all)
        } else {
            for s in &steps {
                let mut e = app.encoder();
                s(&mut e);
                app.queue.submit([e.finish()]);
            }
            app.submit_and_read(app.encoder(), &all)
        }
    };
    let one = run(true);
    let separate = run(false);
    app.handler_is_quiet();
    assert!(one == separate, "one encoder differs from separate submits");
    // And the first forward is right: q halved, o and lse by the rule.
    let halved: Vec<f32> = case.q.to_f32().iter().map(|x| x * 0.5).collect();
    let first = Fwd {
        q: TensorData::F32(halved),
        ..Fwd::new(shape, Precision::F32, opts.clone(), 21)
    };
    let b = FwdBuffers::new(app, &case, U::STORAGE);
    let (o, lse) = b.outputs(&one[3]);
    first.check(o, lse);
}

/// Two engines on the app's one device record into one encoder and give
/// the same bytes; a cache one of them wrapped is the other's only through
/// its own `kv_cache_in`; an engine dropped after recording leaves the
/// recorded work whole.
#[test]
fn engines_sharing_the_apps_device_and_an_engine_dropped_before_the_submit() {
    use flashattn::{CacheLayout, CacheShape, DecodeBindings, DecodeSpec};
    let Some(app) = app() else { return };
    let second = Engine::from_device(&app.adapter, app.device.clone(), app.queue.clone()).unwrap();
    let case = Fwd::new(
        AttentionShape::new(2, 7, 19, 2, 1, 16).unwrap(),
        Precision::F32,
        AttentionOptions::default().window(Some(3), Some(2)),
        5,
    );
    let problem = case.problem();
    let usage = U::STORAGE | U::COPY_SRC;
    let [a, b, c] = [0, 1, 2].map(|_| FwdBuffers::new(app, &case, usage));
    let mut encoder = app.encoder();
    app.engine
        .encode_forward(&mut encoder, &problem, &a.bindings())
        .unwrap();
    second
        .encode_forward(&mut encoder, &problem, &b.bindings())
        .unwrap();
    {
        let third =
            Engine::from_device(&app.adapter, app.device.clone(), app.queue.clone()).unwrap();
        third
            .encode_forward(&mut encoder, &problem, &c.bindings())
            .unwrap();
    }
    let out = app.submit_and_read(encoder, &[&a.outputs, &b.outputs, &c.outputs]);
    app.handler_is_quiet();
    assert!(out[0] == out[1] && out[0] == out[2], "the engines differ");
    let (o, lse) = a.outputs(&out[0]);
    case.check(o, lse);

    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 8,
    };
    let shape = CacheShape::new(layout, 1, 16).unwrap();
    let bytes = (shape.len() * 4) as u64;
    let kv = app.buffer(&vec![0u8; 2 * 256 + 2 * bytes as usize], usage);
    let at = |offset, size| wgpu::BufferBinding {
        buffer: &kv,
        offset,
        size: wgpu::BufferSize::new(size),
    };
    let v_at = bytes.next_multiple_of(app.align());
    let mine = app
        .engine
        .kv_cache_in(shape, Precision::F32, at(0, bytes), at(v_at, bytes))
        .unwrap();
    let lens = [3];
    let step = DecodeSpec::new([1, 1, 2, 16], &lens);
    let io = app.buffer(&vec![0u8; 1024], usage);
    let r = |i: u64, size| wgpu::BufferBinding {
        buffer: &io,
        offset: i * 256,
        size: wgpu::BufferSize::new(size),
    };
    let outputs = DecodeBindings::new(r(0, 128), r(1, 128), r(2, 8));
    let opts = AttentionOptions::default();
    let mut encoder = app.encoder();
    let err = second
        .encode_decode(&mut encoder, &mine, &step, &outputs, &opts, None)
        .unwrap_err();
    assert!(matches!(err, Error::ForeignCache), "{err:?}");
    let theirs = second
        .kv_cache_in(shape, Precision::F32, at(0, bytes), at(v_at, bytes))
        .unwrap();
    second
        .encode_decode(&mut encoder, &theirs, &step, &outputs, &opts, None)
        .unwrap();
    app.submit_and_read(encoder, &[]);
    app.handler_is_quiet();
}

/// The forward and the backward recorded on the app's ranges, against the
/// f64 reference: odd lengths (1, 3, 113), GQA, causal, a window, v's own
/// head dim, f16 and bf16.
#[test]
fn encoded_forward_and_backward_meet_the_accuracy_rule() {
    use flashattn::accuracy::BACKWARD_RATIO;
    use flashattn::GradientBindings;
    let Some(app) = app() else { return };
    let causal = AttentionOptions::default().causal(true);
    let window = AttentionOptions::default().window(Some(5), Some(0));
    let f16 = if app.engine.caps().shader_f16 {
        Precision::F16
    } else {
        Precision::Bf16
    };
    let cases = [
        (
            AttentionShape::new(1, 1, 1, 1, 1, 16),
            Precision::F32,
            AttentionOptions::default(),
        ),
        (
            AttentionShape::new(2, 3, 113, 4, 2, 32),
            f16,
            causal.clone(),
        ),
        (
            AttentionShape::new(1, 113, 3, 3, 1, 24),
            Precision::Bf16,
            window,
        ),
        (
            AttentionShape::new(1, 37, 45, 4, 4, 32).and_then(|s| s.with_head_dim_v(16)),
            Precision::F32,
            causal.clone(),
        ),
        (
            AttentionShape::new(1, 113, 113, 4, 2, 16),
            Precision::F32,
            causal,
        ),
    ];
    for (seed, (shape, precision, opts)) in cases.into_iter().enumerate() {
        let case = Fwd::new(shape.unwrap(), precision, opts, 100 + seed as u64);
        let s = case.shape;
        let bufs = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
        let problem = case.problem();
        let mut encoder = app.encoder();
        app.engine
            .encode_forward(&mut encoder, &problem, &bufs.bindings())
            .unwrap();
        // The backward on the forward's outputs, with an output gradient
        // and the gradients in a buffer of their own.
        let d_o = TensorData::from_f32(Rng::new(seed as u64).normal_vec(s.o_len(), 1.0), precision);
        let sizes = [
            case.bytes(s.o_len()),
            case.bytes(s.q_len()),
            case.bytes(s.kv_len()),
            case.bytes(s.v_len()),
        ];
        let slot = 4096u64.max(sizes.iter().copied().max().unwrap().next_multiple_of(256));
        let mut contents = vec![0u8; 4 * slot as usize];
        let d_o_bytes = Fwd::stored(&d_o);
        contents[..d_o_bytes.len()].copy_from_slice(&d_o_bytes);
        let grads = app.buffer(&contents, U::STORAGE | U::COPY_SRC);
        let g = |i: usize| wgpu::BufferBinding {
            buffer: &grads,
            offset: i as u64 * slot,
            size: wgpu::BufferSize::new(sizes[i]),
        };
        let gb = GradientBindings {
            q: bufs.binding(0),
            k: bufs.binding(1),
            v: bufs.binding(2),
            o: bufs.binding(3),
            d_o: g(0),
            lse: bufs.binding(4),
            dq: g(1),
            dk: g(2),
            dv: g(3),
            scratch: None,
        };
        app.engine
            .encode_backward(&mut encoder, &problem, &gb)
            .unwrap();
        let out = app.submit_and_read(encoder, &[&bufs.outputs, &grads]);
        app.handler_is_quiet();
        let (o, lse) = bufs.outputs(&out[0]);
        case.check(o, lse);
        let [q, k, v] = [
            case.q.view(s.q_shape()),
            case.k.view(s.kv_shape()),
            case.v.view(s.v_shape()),
        ];
        let gv = d_o.view(s.o_shape());
        let r = reference::backward(&q, &k, &v, &gv, &case.opts).unwrap();
        let base = reference::naive_backward_baseline(&q, &k, &v, &gv, &case.opts).unwrap();
        let lens = [s.q_len(), s.kv_len(), s.v_len()];
        for (i, (name, (want, base))) in [
            ("dq", (&r.dq, &base.dq)),
            ("dk", (&r.dk, &base.dk)),
            ("dv", (&r.dv, &base.dv)),
        ]
        .into_iter()
        .enumerate()
        {
            let at = (i + 1) * slot as usize;
            let got = TensorData::from_bytes(&out[1][at..], precision, lens[i]).unwrap();
            let got: Vec<f64> = got.to_f32().iter().map(|&x| x as f64).collect();
            let c = check(name, &got, want, base, precision, BACKWARD_RATIO);
            assert!(c.passed(), "case {seed}: {c}");
        }
    }
}

/// A dense cache on the app's buffer, its K and V ranges and every step's
/// inputs and outputs in ranges of the app's.
struct AppCache {
    shape: flashattn::CacheShape,
    kv: wgpu::Buffer,
    /// V's offset in `kv` (K's is 0).
    v_at: u64,
    bytes: u64,
}

impl AppCache {
    fn new(app: &App, shape: flashattn::CacheShape, k: &[f32], v: &[f32]) -> Self {
        let bytes = (shape.len() * 4) as u64;
        let v_at = bytes.next_multiple_of(app.align());
        let mut contents = vec![0u8; (v_at + bytes) as usize];
        contents[..k.len() * 4].copy_from_slice(bytemuck::cast_slice(k));
        contents[v_at as usize..][..v.len() * 4].copy_from_slice(bytemuck::cast_slice(v));
        Self {
            shape,
            kv: app.buffer(&contents, U::STORAGE | U::COPY_SRC),
            v_at,
            bytes,
        }
    }

    fn cache(&self, e: &Engine) -> flashattn::KvCache {
        let at = |offset| wgpu::BufferBinding {
            buffer: &self.kv,
            offset,
            size: wgpu::BufferSize::new(self.bytes),
        };
        e.kv_cache_in(self.shape, Precision::F32, at(0), at(self.v_at))
            .unwrap()
    }

    /// K's and V's values out of the read-back buffer.
    fn split(&self, bytes: &[u8]) -> (Vec<f32>, Vec<f32>) {
        let n = self.bytes as usize;
        (
            floats(&bytes[..n]),
            floats(&bytes[self.v_at as usize..][..n]),
        )
    }
}

/// Ranges of one buffer, each `slot` bytes apart.
struct Slots {
    buffer: wgpu::Buffer,
    slot: u64,
}

impl Slots {
    fn new(app: &App, contents: &[&[f32]], slot: u64) -> Self {
        let mut bytes = vec![0u8; contents.len() * slot as usize];
        for (i, c) in contents.iter().enumerate() {
            bytes[i * slot as usize..][..c.len() * 4].copy_from_slice(bytemuck::cast_slice(c));
        }
        Self {
            buffer: app.buffer(&bytes, U::STORAGE | U::COPY_SRC),
            slot,
        }
    }

    fn at(&self, i: usize, floats: usize) -> wgpu::BufferBinding<'_> {
        wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: i as u64 * self.slot,
            size: wgpu::BufferSize::new(floats as u64 * 4),
        }
    }

    fn read(&self, bytes: &[u8], i: usize, floats: usize) -> Vec<f32> {
        self::floats(&bytes[i * self.slot as usize..][..floats * 4])
    }
}

/// Several decoding steps in one encoder, each appending a token per
/// sequence to the app's cache and writing the SAME o and lse ranges, which
/// the app's own pass copies out after each step: every step meets the
/// rule against the f64 reference on the cache as it was before it, and
/// the cache ends holding every appended row.
#[test]
fn decoding_steps_in_one_encoder_reuse_the_apps_output_ranges() {
    use flashattn::{
        CacheLayout, CacheShape, DecodeBindings, DecodeSpec, DecodeStep, HostKvCache, TensorView,
    };
    let Some(app) = app() else { return };
    let (batch, heads_q, heads_kv, d, capacity, steps) = (2, 4, 2, 16, 24, 3);
    let shape = CacheShape::new(CacheLayout::Dense { batch, capacity }, heads_kv, d).unwrap();
    let mut rng = Rng::new(3);
    let k0 = rng.normal_vec(shape.len(), 1.0);
    let v0 = rng.normal_vec(shape.len(), 1.0);
    let app_cache = AppCache::new(app, shape, &k0, &v0);
    let cache = app_cache.cache(&app.engine);
    let (nq, nnew, nlse) = (batch * heads_q * d, batch * heads_kv * d, batch * heads_q);
    let qs: Vec<Vec<f32>> = (0..steps).map(|_| rng.normal_vec(nq, 1.0)).collect();
    let ks: Vec<Vec<f32>> = (0..steps).map(|_| rng.normal_vec(nnew, 1.0)).collect();
    let vs: Vec<Vec<f32>> = (0..steps).map(|_| rng.normal_vec(nnew, 1.0)).collect();
    // Inputs: q, k_new, v_new of each step; outputs: o, lse (reused);
    // history: each step's o and lse as the app copied them.
    let inputs: Vec<&[f32]> = (0..steps)
        .flat_map(|t| [&qs[t][..], &ks[t][..], &vs[t][..]])
        .collect();
    let ins = Slots::new(app, &inputs, 1024);
    let outs = Slots::new(app, &[&[7.0; 128], &[7.0; 8]], 512);
    let history = Slots::new(app, &vec![&[0f32; 128][..]; 2 * steps], 512);
    let lens0 = [5i32, 11];
    let lens: Vec<[i32; 2]> = (0..steps as i32).map(|t| lens0.map(|l| l + t)).collect();
    let opts = AttentionOptions::default().causal(true).softcap(5.0);
    let mut encoder = app.encoder();
    for (t, lens_t) in lens.iter().enumerate() {
        let spec = DecodeSpec::new([batch, 1, heads_q, d], lens_t).append(1);
        let b = DecodeBindings::new(ins.at(3 * t, nq), outs.at(0, nq), outs.at(1, nlse))
            .append(ins.at(3 * t + 1, nnew), ins.at(3 * t + 2, nnew));
        // Some steps in two splits, so the merge runs too.
        let splits = Some(1 + t % 2);
        app.engine
            .encode_decode(&mut encoder, &cache, &spec, &b, &opts, splits)
            .unwrap();
        app.scale(&mut encoder, outs.at(0, nq), history.at(2 * t, nq), nq, 1.0);
        app.scale(
            &mut encoder,
            outs.at(1, nlse),
            history.at(2 * t + 1, nlse),
            nlse,
            1.0,
        );
    }
    let out = app.submit_and_read(encoder, &[&history.buffer, &app_cache.kv]);
    app.handler_is_quiet();
    let mut host = HostKvCache::new(shape, TensorData::F32(k0), TensorData::F32(v0)).unwrap();
    for t in 0..steps {
        let step = DecodeStep::new(TensorView::f32([batch, 1, heads_q, d], &qs[t]), &lens[t])
            .append(
                TensorView::f32([batch, 1, heads_kv, d], &ks[t]),
                TensorView::f32([batch, 1, heads_kv, d], &vs[t]),
            );
        let [r, base] = reference::decode(&host, &step, &opts).unwrap();
        let widen = |x: Vec<f32>| -> Vec<f64> { x.into_iter().map(f64::from).collect() };
        let o = widen(history.read(&out[0], 2 * t, nq));
        let lse = widen(history.read(&out[0], 2 * t + 1, nlse));
        let ratio = forward_ratio(true);
        for c in [
            check("o", &o, &r.o, &base.o, Precision::F32, ratio),
            check("lse", &lse, &r.lse, &base.lse, Precision::F32, ratio),
        ] {
            assert!(c.passed(), "step {t}: {c}");
        }
        host = reference::decode_cache(&host, &step).unwrap();
    }
    let (k, v) = app_cache.split(&out[1]);
    assert_eq!(k, host.k.to_f32(), "the cache's K after the steps");
    assert_eq!(v, host.v.to_f32(), "the cache's V after the steps");
}

/// A step that cannot run — past the capacity, a negative length, a length
/// list of the wrong size, new rows bound over the cache they go to — is a
/// typed error from `encode_append` and `encode_decode` alike, records
/// nothing, and the app's cache ends as it began.
#[test]
fn bad_decoding_steps_are_typed_errors_and_leave_the_apps_cache_unchanged() {
    use flashattn::{CacheLayout, CacheShape, DecodeBindings, DecodeSpec};
    let Some(app) = app() else { return };
    let (batch, heads_q, heads_kv, d, capacity) = (2, 2, 1, 8, 6);
    let shape = CacheShape::new(CacheLayout::Dense { batch, capacity }, heads_kv, d).unwrap();
    let mut rng = Rng::new(4);
    let k0 = rng.normal_vec(shape.len(), 1.0);
    let v0 = rng.normal_vec(shape.len(), 1.0);
    let app_cache = AppCache::new(app, shape, &k0, &v0);
    let cache = app_cache.cache(&app.engine);
    let (nq, nnew, nlse) = (
        batch * heads_q * d,
        2 * batch * heads_kv * d,
        batch * heads_q,
    );
    let ins = Slots::new(
        app,
        &[
            &rng.normal_vec(nq, 1.0),
            &rng.normal_vec(nnew, 1.0),
            &rng.normal_vec(nnew, 1.0),
        ],
        256,
    );
    let outs = Slots::new(app, &[&[0f32; 32], &[0f32; 8]], 256);
    let opts = AttentionOptions::default();
    let bindings = DecodeBindings::new(ins.at(0, nq), outs.at(0, nq), outs.at(1, nlse))
        .append(ins.at(1, nnew), ins.at(2, nnew));
    let mut encoder = app.encoder();
    let mut both = |lens: &[i32], b: &DecodeBindings| -> [Error; 2] {
        let spec = DecodeSpec::new([batch, 1, heads_q, d], lens).append(2);
        let [k_new, v_new] = b.new_kv.clone().unwrap();
        [
            app.engine
                .encode_append(&mut encoder, &cache, &spec, k_new, v_new)
                .unwrap_err(),
            app.engine
                .encode_decode(&mut encoder, &cache, &spec, b, &opts, None)
                .unwrap_err(),
        ]
    };
    for e in both(&[5, 0], &bindings) {
        assert!(
            matches!(
                e,
                Error::CacheOverflow {
                    batch: 0,
                    capacity: 6,
                    ..
                }
            ),
            "{e:?}"
        );
    }
    for e in both(&[0, -1], &bindings) {
        assert!(matches!(e, Error::NegativeIndex { .. }), "{e:?}");
    }
    for e in both(&[0], &bindings) {
        assert!(matches!(e, Error::IndexLength { .. }), "{e:?}");
    }
    for e in both(&[i32::MAX, 0], &bindings) {
        assert!(matches!(e, Error::CacheOverflow { .. }), "{e:?}");
    }
    // k_new bound over the cache's V rows, which the append writes.
    let new_on_cache = wgpu::BufferBinding {
        buffer: &app_cache.kv,
        offset: app_cache.v_at,
        size: wgpu::BufferSize::new(nnew as u64 * 4),
    };
    let on_cache = DecodeBindings::new(ins.at(0, nq), outs.at(0, nq), outs.at(1, nlse))
        .append(new_on_cache, ins.at(2, nnew));
    for e in both(&[0, 0], &on_cache) {
        assert!(matches!(e, Error::OverlappingBindings { .. }), "{e:?}");
    }
    let out = app.submit_and_read(encoder, &[&app_cache.kv, &outs.buffer]);
    app.handler_is_quiet();
    let (k, v) = app_cache.split(&out[0]);
    assert!(k == k0 && v == v0, "a failed step changed the cache");
    assert!(
        floats(&out[1]).iter().all(|&x| x == 0.0),
        "a failed step wrote o or lse"
    );
}

/// The FP8 forward recorded on the app's ranges, with rows padded for the
/// Hadamard transform (d 24 → 32), gives the host call's bytes; an f16
/// problem (FP8 quantizes f32 inputs on the device) is a typed error.
#[test]
fn the_encoded_fp8_forward_gives_the_host_calls_bytes() {
    use flashattn::{ForwardInputs, Fp8Options};
    let Some(app) = app() else { return };
    let shape = AttentionShape::new(1, 19, 23, 2, 1, 24).unwrap();
    let case = Fwd::new(
        shape,
        Precision::F32,
        AttentionOptions::default().causal(true),
        9,
    );
    let fp8 = Fp8Options::hadamard(Fp8Options::DEFAULT_SEED);
    let problem = case.problem();
    let bufs = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let mut encoder = app.encoder();
    app.engine
        .encode_forward_fp8(&mut encoder, &problem, &fp8, &bufs.bindings(), None)
        .unwrap();
    let half = Problem::new(shape, Precision::F16, &case.opts).unwrap();
    let err = app
        .engine
        .encode_forward_fp8(&mut encoder, &half, &fp8, &bufs.bindings(), None)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Unsupported {
                what: "an encoded FP8 forward",
                ..
            }
        ),
        "{err:?}"
    );
    let out = app.submit_and_read(encoder, &[&bufs.outputs]);
    app.handler_is_quiet();
    let [q, k, v] = [
        case.q.view(shape.q_shape()),
        case.k.view(shape.kv_shape()),
        case.v.view(shape.v_shape()),
    ];
    let host = app
        .engine
        .forward_fp8(&ForwardInputs::new(q, k, v), &case.opts, &fp8)
        .unwrap();
    let (o, lse) = bufs.outputs(&out[0]);
    assert_eq!(floats(o), host.o.to_f32(), "o");
    assert_eq!(floats(lse), host.lse, "lse");
}

/// Sizes the app gets wrong: a shape of zero rows built field by field, a
/// step of zero queries, an f16 tensor of an odd element count bound
/// without its padding half, scratch smaller than the engine asked for.
#[test]
fn zero_sizes_unpadded_halves_and_short_scratch_are_typed_errors() {
    use flashattn::{CacheLayout, CacheShape, DecodeBindings, DecodeSpec, GradientBindings, Pass};
    let Some(app) = app() else { return };
    let opts = AttentionOptions::default();
    let shape = AttentionShape::new(1, 5, 5, 1, 1, 3).unwrap();
    let empty = AttentionShape {
        seqlen_q: 0,
        ..shape
    };
    let err = Problem::new(empty, Precision::F32, &opts).unwrap_err();
    assert!(matches!(err, Error::EmptyDim { .. }), "{err:?}");

    // (1, 5, 1, 3) f16: 15 halves, 30 bytes, bound as 32.
    let case = Fwd::new(shape, Precision::F16, opts.clone(), 1);
    let problem = case.problem();
    let bufs = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let mut unpadded = bufs.bindings();
    unpadded.q.size = wgpu::BufferSize::new(30);
    let mut encoder = app.encoder();
    let err = app
        .engine
        .encode_forward(&mut encoder, &problem, &unpadded)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferTooSmall {
                buffer: "q",
                size: 30,
                needed: 32
            }
        ),
        "{err:?}"
    );
    app.engine
        .encode_forward(&mut encoder, &problem, &bufs.bindings())
        .unwrap();
    let out = app.submit_and_read(encoder, &[&bufs.outputs]);
    let (o, lse) = bufs.outputs(&out[0]);
    case.check(o, lse);

    // A backward's scratch one word short.
    let f32_case = Fwd::new(shape, Precision::F32, opts.clone(), 2);
    let problem = f32_case.problem();
    let need = app.engine.scratch_size(Pass::Backward, &problem);
    assert!(need > 0);
    let fb = FwdBuffers::new(app, &f32_case, U::STORAGE | U::COPY_SRC);
    let grads = Slots::new(
        app,
        &[&[0f32; 16], &[0f32; 16], &[0f32; 16], &[0f32; 16]],
        256,
    );
    let gb = GradientBindings {
        q: fb.binding(0),
        k: fb.binding(1),
        v: fb.binding(2),
        o: fb.binding(3),
        d_o: fb.binding(0),
        lse: fb.binding(4),
        dq: grads.at(0, 15),
        dk: grads.at(1, 15),
        dv: grads.at(2, 15),
        scratch: Some(wgpu::BufferBinding {
            size: wgpu::BufferSize::new(need - 4),
            ..grads.at(3, 1)
        }),
    };
    let mut encoder = app.encoder();
    let err = app
        .engine
        .encode_backward(&mut encoder, &problem, &gb)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferTooSmall {
                buffer: "scratch",
                ..
            }
        ),
        "{err:?}"
    );

    // A decoding step of no queries, and one whose split scratch is short.
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 64,
    };
    let cshape = CacheShape::new(layout, 1, 8).unwrap();
    let app_cache = AppCache::new(app, cshape, &[], &[]);
    let cache = app_cache.cache(&app.engine);
    let io = Slots::new(
        app,
        &[&[0f32; 16], &[0f32; 16], &[0f32; 4], &[0f32; 64]],
        256,
    );
    let lens = [40];
    let none = DecodeSpec::new([1, 0, 2, 8], &lens);
    let b = DecodeBindings::new(io.at(0, 16), io.at(1, 16), io.at(2, 2));
    let err = app
        .engine
        .encode_decode(&mut encoder, &cache, &none, &b, &opts, None)
        .unwrap_err();
    assert!(matches!(err, Error::EmptyDim { .. }), "{err:?}");
    let spec = DecodeSpec::new([1, 1, 2, 8], &lens);
    let p = flashattn::DecodeProblem::of_spec(&spec, &cshape, Precision::F32).unwrap();
    let plan = app.engine.plan_decode(&p, &opts, Some(4)).unwrap();
    let need = app.engine.decode_scratch_size(&p, &plan);
    assert!(need > 4, "{plan:?}");
    let short = b.clone().scratch(wgpu::BufferBinding {
        size: wgpu::BufferSize::new(need - 4),
        ..io.at(3, 1)
    });
    let err = app
        .engine
        .encode_decode(&mut encoder, &cache, &spec, &short, &opts, Some(4))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferTooSmall {
                buffer: "scratch",
                ..
            }
        ),
        "{err:?}"
    );
    let out = app.submit_and_read(encoder, &[&io.buffer, &grads.buffer]);
    assert!(
        floats(&out[0]).iter().all(|&x| x == 0.0),
        "a failed step wrote"
    );
    assert!(
        floats(&out[1]).iter().all(|&x| x == 0.0),
        "a failed backward wrote"
    );
    app.handler_is_quiet();
}

/// k and v bound to one range (the same tensor, as the README's example
/// passes one slice for both), and recording adds no submission of the
/// engine's once the family is verified.
#[test]
fn k_and_v_on_one_range_and_no_submissions_of_the_engines() {
    let Some(app) = app() else { return };
    let shape = AttentionShape::new(1, 17, 17, 4, 1, 16).unwrap();
    let mut case = Fwd::new(shape, Precision::F32, AttentionOptions::default(), 8);
    case.v = case.k.clone();
    let bufs = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let mut b = bufs.bindings();
    b.v = bufs.binding(1);
    let problem = case.problem();
    // An engine of this test's own, which no other test's calls submit on.
    let engine = Engine::from_device(&app.adapter, app.device.clone(), app.queue.clone()).unwrap();
    let mut warm = app.encoder();
    engine.encode_forward(&mut warm, &problem, &b).unwrap();
    drop(warm);
    let before = engine.submissions();
    let mut encoder = app.encoder();
    engine.encode_forward(&mut encoder, &problem, &b).unwrap();
    assert_eq!(engine.submissions(), before, "recording submitted");
    let out = app.submit_and_read(encoder, &[&bufs.outputs]);
    app.handler_is_quiet();
    let (o, lse) = bufs.outputs(&out[0]);
    case.check(o, lse);
}

/// `forward_buffers` on the app's whole buffers: one too small or without
/// `STORAGE` is a typed error, neither reaching the app's handler; reading
/// back a cache on buffers without `COPY_SRC` is the device's validation
/// error, and a cache on buffers without `STORAGE` is refused when made.
#[test]
fn forward_buffers_and_cache_reads_on_unfit_buffers_are_errors() {
    use flashattn::{AttentionBuffers, CacheLayout, CacheShape, PlanOverrides};
    let Some(app) = app() else { return };
    let shape = AttentionShape::new(1, 9, 9, 2, 2, 8).unwrap();
    let case = Fwd::new(shape, Precision::F32, AttentionOptions::default(), 3);
    let whole = |t: &TensorData, usage| app.buffer(&Fwd::stored(t), usage);
    let usage = U::STORAGE | U::COPY_SRC;
    let (q, k, v) = (
        whole(&case.q, usage),
        whole(&case.k, usage),
        whole(&case.v, usage),
    );
    let o = app.buffer(&vec![0u8; case.o_bytes() as usize], usage);
    let short = app.buffer(&vec![0u8; case.lse_bytes() as usize - 4], usage);
    let unbindable = app.buffer(&vec![0u8; case.lse_bytes() as usize], U::COPY_SRC);
    let call = |lse| {
        let b = AttentionBuffers {
            q: &q,
            k: &k,
            v: &v,
            o: &o,
            lse,
        };
        app.engine.forward_buffers(
            &b,
            &shape,
            Precision::F32,
            &case.opts,
            &PlanOverrides::default(),
        )
    };
    let err = call(&short).unwrap_err();
    assert!(
        matches!(err, Error::BufferTooSmall { buffer: "lse", .. }),
        "{err:?}"
    );
    let err = call(&unbindable).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferUsage {
                tensor: "lse",
                missing: "STORAGE"
            }
        ),
        "{err:?}"
    );
    app.handler_is_quiet();
    let lse = app.buffer(&vec![0u8; case.lse_bytes() as usize], usage);
    call(&lse).unwrap();
    let out = app.submit_and_read(app.encoder(), &[&o, &lse]);
    case.check(&out[0], &out[1]);

    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 4,
    };
    let cshape = CacheShape::new(layout, 1, 8).unwrap();
    let bytes = (cshape.len() * 4) as u64;
    let v_at = bytes.next_multiple_of(app.align());
    let kv = app.buffer(&vec![0u8; (v_at + bytes) as usize], U::STORAGE);
    let at = |offset| wgpu::BufferBinding {
        buffer: &kv,
        offset,
        size: wgpu::BufferSize::new(bytes),
    };
    let cache = app
        .engine
        .kv_cache_in(cshape, Precision::F32, at(0), at(v_at))
        .unwrap();
    let err = app.engine.read_kv_cache(&cache).unwrap_err();
    assert!(matches!(err, Error::Device { .. }), "{err:?}");
    // A cache on a buffer that cannot be bound as storage is refused when
    // it is made, not at its first step.
    let unbound = app.buffer(&vec![0u8; (v_at + bytes) as usize], U::COPY_SRC);
    let at_unbound = |offset| wgpu::BufferBinding {
        buffer: &unbound,
        offset,
        size: wgpu::BufferSize::new(bytes),
    };
    let err = app
        .engine
        .kv_cache_in(cshape, Precision::F32, at_unbound(0), at_unbound(v_at))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferUsage {
                tensor: "k cache",
                missing: "STORAGE"
            }
        ),
        "{err:?}"
    );
    app.handler_is_quiet();
}

/// The web has only the `*_async` forms: the quantized caches' and
/// `forward_backward`'s give what their blocking forms give.
#[test]
fn the_async_forms_of_quantized_caches_and_forward_backward_equal_the_blocking_ones() {
    use flashattn::{
        CacheLayout, CacheQuant, CacheShape, DecodeStep, ForwardInputs, HostKvCache, QuantKvCache,
        TensorView,
    };
    use pollster::block_on;
    let Some(app) = app() else { return };
    let e = &app.engine;
    let shape = CacheShape::new(
        CacheLayout::Dense {
            batch: 1,
            capacity: 32,
        },
        1,
        16,
    )
    .unwrap();
    let mut rng = Rng::new(12);
    let (k0, v0) = (
        rng.normal_vec(shape.len(), 1.0),
        rng.normal_vec(shape.len(), 1.0),
    );
    let host = HostKvCache::new(shape, TensorData::F32(k0), TensorData::F32(v0)).unwrap();
    let quant = QuantKvCache::quantize(&host, CacheQuant::Int8).unwrap();
    let zeros =
        block_on(e.quantized_kv_cache_async(shape, CacheQuant::Int8, Precision::F32)).unwrap();
    assert_eq!(
        block_on(e.read_quantized_kv_cache_async(&zeros)).unwrap(),
        QuantKvCache::zeros(shape, CacheQuant::Int8, Precision::F32)
    );
    let device = block_on(e.upload_quantized_kv_cache_async(&quant)).unwrap();
    assert_eq!(
        block_on(e.read_quantized_kv_cache_async(&device)).unwrap(),
        quant
    );

    let q = rng.normal_vec(2 * 16, 1.0);
    let new = rng.normal_vec(16, 1.0);
    let lens = [20];
    let step = DecodeStep::new(TensorView::f32([1, 1, 2, 16], &q), &lens).append(
        TensorView::f32([1, 1, 1, 16], &new),
        TensorView::f32([1, 1, 1, 16], &new),
    );
    let opts = AttentionOptions::default();
    let (mut a, mut b) = (quant.clone(), quant);
    let sync = e.decode_quantized_host(&mut a, &step, &opts, None).unwrap();
    let fut = block_on(e.decode_quantized_host_async(&mut b, &step, &opts, None)).unwrap();
    assert_eq!((sync.o, sync.lse), (fut.o, fut.lse));
    assert_eq!(a, b);

    let case = Fwd::new(
        AttentionShape::new(1, 9, 11, 2, 1, 16).unwrap(),
        Precision::F32,
        AttentionOptions::default().causal(true),
        13,
    );
    let s = case.shape;
    let [q, k, v] = [
        case.q.view(s.q_shape()),
        case.k.view(s.kv_shape()),
        case.v.view(s.v_shape()),
    ];
    let inputs = ForwardInputs::new(q, k, v);
    let d_o = case.q.view(s.o_shape());
    let (f1, b1) = e.forward_backward(&inputs, &d_o, &case.opts).unwrap();
    let (f2, b2) = block_on(e.forward_backward_async(&inputs, &d_o, &case.opts)).unwrap();
    assert_eq!((f1.o, f1.lse), (f2.o, f2.lse));
    assert_eq!((b1.dq, b1.dk, b1.dv), (b2.dq, b2.dk, b2.dv));
    app.handler_is_quiet();
}
