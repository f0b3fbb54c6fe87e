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
    let err = app
        .engine
        .encode_forward(&mut encoder, &case.problem(), &b)
        .unwrap_err();
    assert!(
        matches!(err, Error::BindingOutsideBuffer { tensor: "k", .. }),
        "{err:?}"
    );
    app.submit_and_read(encoder, &[]);
    app.handler_is_quiet();
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
        let err = app
            .engine
            .encode_forward(&mut encoder, &problem, &b)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::BindingOutsideBuffer { tensor: "lse", .. }
                    | Error::BufferTooSmall { buffer: "lse", .. }
            ),
            "{err:?}"
        );
        app.submit_and_read(encoder, &[]);
    }
    app.handler_is_quiet();
}

/// A buffer the app made without `STORAGE` cannot be bound: the call is a
/// typed error, and the app's encoder is still good for its own work.
#[test]
fn a_buffer_without_storage_usage_is_a_typed_error_and_the_encoder_stays_usable() {
    let Some(app) = app() else { return };
    let case = small_case();
    let good = FwdBuffers::new(app, &case, U::STORAGE | U::COPY_SRC);
    let no_storage = FwdBuffers::new(app, &case, U::COPY_SRC | U::COPY_DST);
    let problem = case.problem();
    let mut encoder = app.encoder();
    let mut b = good.bindings();
    b.q = no_storage.binding(0);
    let err = app
        .engine
        .encode_forward(&mut encoder, &problem, &b)
        .unwrap_err();
    // wgpu's validation error, as docs/architecture.md says.
    assert!(matches!(err, Error::Device { .. }), "{err:?}");
    // The app goes on recording into the same encoder: a good call, then
    // its submit.
    app.engine
        .encode_forward(&mut encoder, &problem, &good.bindings())
        .unwrap();
    let out = app.submit_and_read(encoder, &[&good.outputs]);
    app.handler_is_quiet();
    let (o, lse) = good.outputs(&out[0]);
    case.check(o, lse);
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
    let problem = case.problem();
    let mut encoder = app.encoder();
    let mut b = good.bindings();
    b.v = foreign.binding(2);
    let err = app
        .engine
        .encode_forward(&mut encoder, &problem, &b)
        .unwrap_err();
    // wgpu's validation error, as docs/architecture.md says.
    assert!(matches!(err, Error::Device { .. }), "{err:?}");
    app.engine
        .encode_forward(&mut encoder, &problem, &good.bindings())
        .unwrap();
    let out = app.submit_and_read(encoder, &[&good.outputs]);
    app.handler_is_quiet();
    let (o, lse) = good.outputs(&out[0]);
    case.check(o, lse);
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
