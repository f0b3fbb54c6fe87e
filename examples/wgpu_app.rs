//! A wgpu app that owns its device and calls flashattn only for attention.
//!
//! The app opens its own adapter, device and queue and hands clones to
//! `Engine::from_device`. Its model is a tiny random-weight transformer
//! (2 layers, 4 query heads sharing 2 K/V heads of dim 32, d_model 128,
//! RMSNorm, a SiLU MLP, vocab 64). Its own WGSL (`wgpu_app.wgsl`) does the
//! embedding lookup, the norms, the QKV, output and MLP projections, the
//! residual adds, the logits and a greedy argmax. The K/V caches are the
//! app's own buffers, dense `(1, max_seq, heads_kv, head_dim)` per layer,
//! which flashattn sees as a `KvCache` on their ranges
//! (`Engine::kv_cache_in`). Attention is flashattn's decoding step,
//! recorded into the same command encoder ([`encode_attention`]): it
//! appends the position's K and V to the cache and attends over it.
//!
//! Every decoding step is one encoder and one `queue.submit`; the argmax is
//! written on the device into the token buffer the next step's embedding
//! reads, so no step reads anything back. After the last step the app reads
//! back the final logits and the token ids once, and checks both against
//! the same model on the host (f64, with flashattn's CPU backend for
//! attention).
//!
//! ```text
//! cargo run --release --example wgpu_app
//! ```

use flashattn::random::Rng;
use flashattn::{
    AttentionOptions, CacheLayout, CacheShape, DecodeBindings, DecodeSpec, Engine, ForwardInputs,
    KvCache, Precision, TensorView,
};
use std::time::Instant;
use wgpu::util::DeviceExt;

/// The example's errors: wgpu's, flashattn's and its own, as text.
pub type AppResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The largest difference allowed between a device logit and the host's.
/// The device runs in f32 (sums of at most 256 terms, flashattn's f32
/// attention), the host in f64 but for attention (the CPU backend in f32),
/// on logits of size about 1: they differ by about 1e-5. A wrong weight,
/// position or cache row moves logits by 0.1 or more.
pub const LOGIT_TOLERANCE: f64 = 1e-3;

/// The model and the generation.
#[derive(Clone, Debug)]
pub struct Config {
    pub vocab: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// The MLP's hidden width.
    pub hidden: usize,
    /// Token ids fed before generation (at least 2: all but the last warm
    /// the pipelines up).
    pub prompt: Vec<u32>,
    /// Tokens generated, one per decoding step.
    pub tokens: usize,
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            vocab: 64,
            d_model: 128,
            layers: 2,
            heads_q: 4,
            heads_kv: 2,
            head_dim: 32,
            hidden: 256,
            prompt: vec![1, 17, 42, 5],
            tokens: 128,
            seed: 7,
        }
    }
}

impl Config {
    fn q_dim(&self) -> usize {
        self.heads_q * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.heads_kv * self.head_dim
    }

    fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// Positions the caches hold: the prompt's and every generated token's
    /// but the last (which no step reads).
    fn max_seq(&self) -> usize {
        self.prompt.len() + self.tokens - 1
    }

    fn check(&self) -> AppResult<()> {
        if self.prompt.len() < 2 || self.tokens == 0 {
            return Err("the prompt needs 2 tokens or more, and tokens 1 or more".into());
        }
        if let Some(t) = self.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(format!("prompt token {t} is outside the vocab").into());
        }
        Ok(())
    }
}

/// One layer's weights; matrices are row-major `(inputs, outputs)`.
pub struct LayerWeights {
    attn_norm: Vec<f32>,
    wqkv: Vec<f32>,
    wo: Vec<f32>,
    mlp_norm: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// The model's weights, random from the config's seed.
pub struct Weights {
    embed: Vec<f32>,
    layers: Vec<LayerWeights>,
    final_norm: Vec<f32>,
    unembed: Vec<f32>,
}

impl Weights {
    /// Normal weights scaled by `1/√inputs`, so activations stay near 1;
    /// norm gains near 1.
    pub fn random(c: &Config) -> Self {
        let mut rng = Rng::new(c.seed);
        // Embedding rows of norm about √d_model, like a trained model's.
        let embed = rng.normal_vec(c.vocab * c.d_model, 1.0);
        let mut matrix =
            |rows: usize, cols: usize| rng.normal_vec(rows * cols, 1.0 / (rows as f32).sqrt());
        let mut layers = Vec::new();
        for _ in 0..c.layers {
            layers.push(LayerWeights {
                attn_norm: Vec::new(),
                wqkv: matrix(c.d_model, c.qkv_dim()),
                wo: matrix(c.q_dim(), c.d_model),
                mlp_norm: Vec::new(),
                w_up: matrix(c.d_model, c.hidden),
                w_down: matrix(c.hidden, c.d_model),
            });
        }
        let unembed = matrix(c.d_model, c.vocab);
        let mut rng = Rng::new(c.seed ^ 1);
        let mut gain = || -> Vec<f32> {
            let noise = rng.normal_vec(c.d_model, 0.1);
            noise.iter().map(|n| 1.0 + n).collect()
        };
        for l in &mut layers {
            l.attn_norm = gain();
            l.mlp_norm = gain();
        }
        Self {
            embed,
            layers,
            final_norm: gain(),
            unembed,
        }
    }
}

/// An adapter from the environment (`WGPU_BACKEND` and friends).
pub fn adapter() -> Result<wgpu::Adapter, wgpu::RequestAdapterError> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    pollster::block_on(instance.request_adapter(&Default::default()))
}

/// The app: its device and queue, flashattn as a guest on them, and the
/// submits and read-backs it has made.
pub struct App {
    device: wgpu::Device,
    queue: wgpu::Queue,
    engine: Engine,
    /// The adapter's name.
    pub adapter: String,
    pub submits: u64,
    pub readbacks: u64,
}

impl App {
    /// Open a device on `adapter` with its real limits, and an engine on it.
    pub fn new(adapter: &wgpu::Adapter) -> AppResult<Self> {
        let (device, queue) =
            pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
                label: Some("wgpu_app"),
                required_limits: adapter.limits(),
                ..Default::default()
            }))?;
        let engine = Engine::from_device(adapter, device.clone(), queue.clone())?;
        Ok(Self {
            device,
            queue,
            engine,
            adapter: adapter.get_info().name,
            submits: 0,
            readbacks: 0,
        })
    }

    /// The engine, to ask what it submitted itself.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Every submit of the app goes through here.
    fn submit(&mut self, encoder: wgpu::CommandEncoder) {
        self.queue.submit([encoder.finish()]);
        self.submits += 1;
    }

    /// Block until the device has run everything submitted.
    fn wait(&self) -> AppResult<()> {
        self.device.poll(wgpu::PollType::wait_indefinitely())?;
        Ok(())
    }

    /// Copy `buffers` to one staging buffer (one submit) and map it: one
    /// read-back.
    fn read_back(&mut self, buffers: &[&wgpu::Buffer]) -> AppResult<Vec<Vec<u8>>> {
        let total = buffers.iter().map(|b| b.size()).sum();
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgpu_app readback"),
            size: total,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        let mut offset = 0;
        for b in buffers {
            encoder.copy_buffer_to_buffer(b, 0, &staging, offset, b.size());
            offset += b.size();
        }
        self.submit(encoder);
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .slice(..)
            .map_async(wgpu::MapMode::Read, move |r| drop(tx.send(r)));
        self.readbacks += 1;
        self.wait()?;
        rx.recv()??;
        let data = staging.slice(..).get_mapped_range()?.to_vec();
        let mut offset = 0;
        Ok(buffers
            .iter()
            .map(|b| {
                let part = data[offset..offset + b.size() as usize].to_vec();
                offset += b.size() as usize;
                part
            })
            .collect())
    }

    /// A storage buffer holding `data`.
    fn buffer(&self, label: &str, data: &[u8]) -> wgpu::Buffer {
        use wgpu::BufferUsages as U;
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: data,
                usage: U::STORAGE | U::COPY_SRC | U::COPY_DST,
            })
    }

    /// A zeroed storage buffer of `floats` f32s.
    fn zeros(&self, label: &str, floats: usize) -> wgpu::Buffer {
        self.buffer(label, bytemuck::cast_slice(&vec![0f32; floats]))
    }

    /// One layer's K/V cache: two zeroed buffers of the app's, dense
    /// `(1, max_seq, heads_kv, head_dim)` f32, handed to flashattn as ranges.
    fn cache(&self, c: &Config) -> AppResult<KvCache> {
        let layout = CacheLayout::Dense {
            batch: 1,
            capacity: c.max_seq(),
        };
        let shape = CacheShape::new(layout, c.heads_kv, c.head_dim)?;
        let k = self.zeros("k_cache", c.max_seq() * c.kv_dim());
        let v = self.zeros("v_cache", c.max_seq() * c.kv_dim());
        let cache = self.engine.kv_cache_in(
            shape,
            Precision::F32,
            k.as_entire_buffer_binding(),
            v.as_entire_buffer_binding(),
        )?;
        Ok(cache)
    }

    fn uniform(&self, words: [u32; 4]) -> wgpu::Buffer {
        use wgpu::BufferUsages as U;
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("wgpu_app uniform"),
                contents: bytemuck::cast_slice(&words),
                usage: U::UNIFORM | U::COPY_DST,
            })
    }
}

/// Binding numbers of `wgpu_app.wgsl`.
mod slot {
    pub const DIMS: u32 = 0;
    pub const STEP: u32 = 1;
    pub const X_IN: u32 = 2;
    pub const GAIN: u32 = 3;
    pub const WEIGHT: u32 = 4;
    pub const OUT: u32 = 5;
    pub const RESIDUAL: u32 = 6;
    pub const K_NEW: u32 = 7;
    pub const V_NEW: u32 = 8;
    pub const TOKENS_IN: u32 = 9;
    pub const TOKENS_OUT: u32 = 10;
}

/// The app's compute pipelines, one per entry point of `wgpu_app.wgsl`.
struct Kernels {
    embed: wgpu::ComputePipeline,
    norm_matvec: wgpu::ComputePipeline,
    qkv: wgpu::ComputePipeline,
    matvec_add: wgpu::ComputePipeline,
    argmax: wgpu::ComputePipeline,
}

impl Kernels {
    fn new(device: &wgpu::Device) -> Self {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("wgpu_app.wgsl"),
            source: wgpu::ShaderSource::Wgsl(include_str!("wgpu_app.wgsl").into()),
        });
        let pipeline = |entry: &str| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        Self {
            embed: pipeline("embed"),
            norm_matvec: pipeline("norm_matvec"),
            qkv: pipeline("qkv"),
            matvec_add: pipeline("matvec_add"),
            argmax: pipeline("argmax"),
        }
    }
}

/// One dispatch the app records each step: built once, with its bindings.
struct Dispatch {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: u32,
}

impl Dispatch {
    /// `pipeline` over `dims` (`[rows, cols, q_cols, silu]`, in a uniform
    /// of its own) and `buffers` at their slots; one invocation per output.
    fn new(
        app: &App,
        pipeline: &wgpu::ComputePipeline,
        dims: [u32; 4],
        buffers: &[(u32, &wgpu::Buffer)],
    ) -> Self {
        let dims_buffer = app.uniform(dims);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: slot::DIMS,
            resource: dims_buffer.as_entire_binding(),
        }];
        entries.extend(buffers.iter().map(|(slot, b)| wgpu::BindGroupEntry {
            binding: *slot,
            resource: b.as_entire_binding(),
        }));
        let bind = app.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        Self {
            pipeline: pipeline.clone(),
            bind,
            groups: dims[1].div_ceil(64),
        }
    }
}

/// Record `dispatches` in one compute pass (wgpu orders the dispatches'
/// reads after the writes before them).
fn record(encoder: &mut wgpu::CommandEncoder, dispatches: &[Dispatch]) {
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some("wgpu_app"),
        timestamp_writes: None,
    });
    for d in dispatches {
        pass.set_pipeline(&d.pipeline);
        pass.set_bind_group(0, &d.bind, &[]);
        pass.dispatch_workgroups(d.groups, 1, 1);
    }
}

/// One layer's weights and K/V caches on the device.
struct DeviceLayer {
    attn_norm: wgpu::Buffer,
    wqkv: wgpu::Buffer,
    wo: wgpu::Buffer,
    mlp_norm: wgpu::Buffer,
    w_up: wgpu::Buffer,
    w_down: wgpu::Buffer,
    /// The app's dense `(1, max_seq, heads_kv, head_dim)` f32 K and V
    /// buffers, as flashattn sees them.
    cache: KvCache,
}

/// The model on the device: weights, caches, activations, and each step's
/// dispatches in segments around the attention calls.
struct Model {
    config: Config,
    /// `[pos, prompt_len, 0, 0]`, written before each step's submit.
    step: wgpu::Buffer,
    /// The prompt, then each step's argmax.
    tokens: wgpu::Buffer,
    q: wgpu::Buffer,
    /// This position's K and V, which attention appends to the caches.
    k_new: wgpu::Buffer,
    v_new: wgpu::Buffer,
    /// Attention's outputs, in buffers of their own: flashattn binds them
    /// writable, so no input may be bound from them.
    o: wgpu::Buffer,
    lse: wgpu::Buffer,
    logits: wgpu::Buffer,
    layers: Vec<DeviceLayer>,
    /// `segments[l]` runs before layer `l`'s attention; the last one after
    /// the last layer's.
    segments: Vec<Vec<Dispatch>>,
}

/// Activations one step passes between dispatches.
struct Activations {
    x: wgpu::Buffer,
    hidden: wgpu::Buffer,
}

impl Model {
    fn new(app: &App, config: &Config, weights: &Weights) -> AppResult<Self> {
        let c = config;
        let f32s = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
        let layers = weights
            .layers
            .iter()
            .map(|w| {
                Ok(DeviceLayer {
                    attn_norm: app.buffer("attn_norm", &f32s(&w.attn_norm)),
                    wqkv: app.buffer("wqkv", &f32s(&w.wqkv)),
                    wo: app.buffer("wo", &f32s(&w.wo)),
                    mlp_norm: app.buffer("mlp_norm", &f32s(&w.mlp_norm)),
                    w_up: app.buffer("w_up", &f32s(&w.w_up)),
                    w_down: app.buffer("w_down", &f32s(&w.w_down)),
                    cache: app.cache(c)?,
                })
            })
            .collect::<AppResult<_>>()?;
        let mut tokens = c.prompt.clone();
        tokens.resize(c.max_seq() + 1, 0);
        let mut model = Self {
            config: c.clone(),
            step: app.uniform([0; 4]),
            tokens: app.buffer("tokens", bytemuck::cast_slice(&tokens)),
            q: app.zeros("q", c.q_dim()),
            k_new: app.zeros("k_new", c.kv_dim()),
            v_new: app.zeros("v_new", c.kv_dim()),
            o: app.zeros("o", c.q_dim()),
            lse: app.zeros("lse", c.heads_q),
            logits: app.zeros("logits", c.vocab),
            layers,
            segments: Vec::new(),
        };
        let act = Activations {
            x: app.zeros("x", c.d_model),
            hidden: app.zeros("hidden", c.hidden),
        };
        model.segments = model.build_segments(app, &act, weights);
        Ok(model)
    }

    /// Embedding and layer 0's QKV; each layer's output projection and MLP
    /// with the next layer's QKV; the last layer's with the logits.
    fn build_segments(
        &self,
        app: &App,
        act: &Activations,
        weights: &Weights,
    ) -> Vec<Vec<Dispatch>> {
        let (c, k) = (&self.config, &Kernels::new(&app.device));
        let embed_table = app.buffer("embed", bytemuck::cast_slice(&weights.embed));
        let embed = Dispatch::new(
            app,
            &k.embed,
            [1, c.d_model as u32, 0, 0],
            &[
                (slot::STEP, &self.step),
                (slot::TOKENS_IN, &self.tokens),
                (slot::WEIGHT, &embed_table),
                (slot::OUT, &act.x),
            ],
        );
        let mut segments = vec![vec![embed]];
        for (l, layer) in self.layers.iter().enumerate() {
            segments[l].push(self.qkv(app, k, act, layer));
            segments.push(self.attention_tail(app, k, act, layer));
        }
        let last = segments
            .last_mut()
            .expect("one segment per layer and one more");
        last.extend(self.head(app, k, act, weights));
        segments
    }

    /// The QKV projection of the normed residual: q, and this position's K and V.
    fn qkv(&self, app: &App, k: &Kernels, act: &Activations, layer: &DeviceLayer) -> Dispatch {
        let c = &self.config;
        let dims = [c.d_model as u32, c.qkv_dim() as u32, c.q_dim() as u32, 0];
        let buffers = [
            (slot::X_IN, &act.x),
            (slot::GAIN, &layer.attn_norm),
            (slot::WEIGHT, &layer.wqkv),
            (slot::OUT, &self.q),
            (slot::K_NEW, &self.k_new),
            (slot::V_NEW, &self.v_new),
        ];
        Dispatch::new(app, &k.qkv, dims, &buffers)
    }

    /// After attention: `x += o·Wo`, then `x += SiLU(norm(x)·Wup)·Wdown`.
    fn attention_tail(
        &self,
        app: &App,
        k: &Kernels,
        act: &Activations,
        layer: &DeviceLayer,
    ) -> Vec<Dispatch> {
        let c = &self.config;
        let (d, q, h) = (c.d_model as u32, c.q_dim() as u32, c.hidden as u32);
        let add = |input, weight| {
            [
                (slot::X_IN, input),
                (slot::WEIGHT, weight),
                (slot::RESIDUAL, &act.x),
            ]
        };
        let up = [
            (slot::X_IN, &act.x),
            (slot::GAIN, &layer.mlp_norm),
            (slot::WEIGHT, &layer.w_up),
            (slot::OUT, &act.hidden),
        ];
        vec![
            Dispatch::new(app, &k.matvec_add, [q, d, 0, 0], &add(&self.o, &layer.wo)),
            Dispatch::new(app, &k.norm_matvec, [d, h, 0, 1], &up),
            Dispatch::new(
                app,
                &k.matvec_add,
                [h, d, 0, 0],
                &add(&act.hidden, &layer.w_down),
            ),
        ]
    }

    /// The final norm, the logits and the argmax into `tokens[pos + 1]`.
    fn head(&self, app: &App, k: &Kernels, act: &Activations, weights: &Weights) -> Vec<Dispatch> {
        let c = &self.config;
        let gain = app.buffer("final_norm", bytemuck::cast_slice(&weights.final_norm));
        let unembed = app.buffer("unembed", bytemuck::cast_slice(&weights.unembed));
        let logits = [
            (slot::X_IN, &act.x),
            (slot::GAIN, &gain),
            (slot::WEIGHT, &unembed),
            (slot::OUT, &self.logits),
        ];
        let argmax = [
            (slot::STEP, &self.step),
            (slot::X_IN, &self.logits),
            (slot::TOKENS_OUT, &self.tokens),
        ];
        let vocab = c.vocab as u32;
        vec![
            Dispatch::new(
                app,
                &k.norm_matvec,
                [c.d_model as u32, vocab, 0, 0],
                &logits,
            ),
            Dispatch::new(app, &k.argmax, [vocab, 1, 0, 0], &argmax),
        ]
    }
}

/// This step's attention in layer `layer`, recorded into the step's
/// encoder: the one place the app calls flashattn. With `append`, the
/// decoding step first appends k_new and v_new to the layer's cache at row
/// `pos`; either way the query attends over the cache's first `pos + 1`
/// rows (`cache_seqlens` counts the rows before this step's).
fn encode_attention(
    engine: &Engine,
    encoder: &mut wgpu::CommandEncoder,
    model: &Model,
    layer: usize,
    pos: usize,
    append: bool,
) -> flashattn::Result<()> {
    let c = &model.config;
    let cache_seqlens = [pos as i32];
    let spec = DecodeSpec::new([1, 1, c.heads_q, c.head_dim], &cache_seqlens).append(1);
    let range = |buffer| wgpu::BufferBinding {
        buffer,
        offset: 0,
        size: None,
    };
    let mut bindings = DecodeBindings::new(range(&model.q), range(&model.o), range(&model.lse));
    if append {
        bindings = bindings.append(range(&model.k_new), range(&model.v_new));
    }
    let cache = &model.layers[layer].cache;
    let opts = AttentionOptions::default();
    engine.encode_decode(encoder, cache, &spec, &bindings, &opts, None)?;
    Ok(())
}

/// What a generation did.
#[derive(Clone, Debug)]
pub struct Run {
    /// The prompt, then every generated token.
    pub tokens: Vec<u32>,
    /// The logits of the last step.
    pub logits: Vec<f32>,
    /// Decoding steps counted (one generated token each).
    pub steps: usize,
    /// Submits, read-backs and the engine's own submissions during them.
    pub submits: u64,
    pub readbacks: u64,
    pub engine_submissions: u64,
    /// Wall time of the counted steps, up to the device finishing them.
    pub seconds: f64,
}

impl Run {
    pub fn tokens_per_second(&self) -> f64 {
        self.steps as f64 / self.seconds
    }
}

impl App {
    /// One decoding step at `pos`: one encoder, one submit, nothing read.
    fn step(&mut self, model: &Model, pos: usize) -> AppResult<()> {
        let prompt = model.config.prompt.len() as u32;
        let words = [pos as u32, prompt, 0, 0];
        self.queue
            .write_buffer(&model.step, 0, bytemuck::cast_slice(&words));
        let mut encoder = self.device.create_command_encoder(&Default::default());
        for (layer, segment) in model.segments.iter().enumerate() {
            record(&mut encoder, segment);
            if layer < model.layers.len() {
                encode_attention(&self.engine, &mut encoder, model, layer, pos, true)?;
            }
        }
        self.submit(encoder);
        Ok(())
    }
}

impl App {
    /// Before anything is timed or counted: record attention at every
    /// cache length the generation meets, without the append, and run it
    /// once (one submit, its outputs unused). flashattn verifies its kernel
    /// family on first use with a known-answer check it submits itself (once
    /// per family and device), and plans a step by its cache length, so
    /// short caches have pipelines of their own, which the driver compiles
    /// when it first runs them.
    fn warm_up(&mut self, model: &Model) -> AppResult<()> {
        let mut encoder = self.device.create_command_encoder(&Default::default());
        for pos in 0..model.config.max_seq() {
            encode_attention(&self.engine, &mut encoder, model, 0, pos, false)?;
        }
        self.submit(encoder);
        self.wait()
    }
}

/// Generate `config.tokens` tokens greedily on the app's device.
pub fn decode(app: &mut App, config: &Config, weights: &Weights) -> AppResult<Run> {
    config.check()?;
    let model = Model::new(app, config, weights)?;
    app.warm_up(&model)?;
    // The prompt's tokens but the last only fill the caches: not counted.
    let first = config.prompt.len() - 1;
    for pos in 0..first {
        app.step(&model, pos)?;
    }
    app.wait()?;
    let before = (app.submits, app.readbacks, app.engine.submissions());
    let start = Instant::now();
    for pos in first..config.max_seq() {
        app.step(&model, pos)?;
    }
    app.wait()?;
    let seconds = start.elapsed().as_secs_f64();
    let (submits, readbacks) = (app.submits - before.0, app.readbacks - before.1);
    let engine_submissions = app.engine.submissions() - before.2;
    let data = app.read_back(&[&model.logits, &model.tokens])?;
    Ok(Run {
        logits: bytemuck::pod_collect_to_vec(&data[0]),
        tokens: bytemuck::pod_collect_to_vec(&data[1]),
        steps: config.max_seq() - first,
        submits,
        readbacks,
        engine_submissions,
        seconds,
    })
}

/// The same model on the host, in f64 but for attention, which is
/// flashattn's CPU backend on f32 caches.
struct HostModel<'a> {
    c: &'a Config,
    w: &'a Weights,
    /// Per layer: K and V, `(max_seq, heads_kv, head_dim)`.
    caches: Vec<(Vec<f32>, Vec<f32>)>,
}

/// `(RMSNorm(x) · gain) @ w`, `w` row-major `(x.len(), cols)`.
fn norm_matvec(x: &[f64], gain: &[f32], w: &[f32], cols: usize) -> Vec<f64> {
    let mean_square = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / (mean_square + 1e-5).sqrt();
    let normed: Vec<f64> = x
        .iter()
        .zip(gain)
        .map(|(v, g)| v * scale * *g as f64)
        .collect();
    matvec(&normed, w, cols)
}

fn matvec(x: &[f64], w: &[f32], cols: usize) -> Vec<f64> {
    let mut out = vec![0.0; cols];
    for (xi, row) in x.iter().zip(w.chunks_exact(cols)) {
        for (o, wij) in out.iter_mut().zip(row) {
            *o += xi * *wij as f64;
        }
    }
    out
}

fn add(x: &mut [f64], y: &[f64]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

impl<'a> HostModel<'a> {
    fn new(c: &'a Config, w: &'a Weights) -> Self {
        let cache = vec![0.0; c.max_seq() * c.kv_dim()];
        Self {
            c,
            w,
            caches: vec![(cache.clone(), cache); c.layers],
        }
    }

    /// The logits after `token` at `pos` (every earlier position fed).
    fn step(&mut self, token: u32, pos: usize) -> flashattn::Result<Vec<f64>> {
        let c = self.c;
        let row = &self.w.embed[token as usize * c.d_model..][..c.d_model];
        let mut x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        for (l, w) in self.w.layers.iter().enumerate() {
            let qkv = norm_matvec(&x, &w.attn_norm, &w.wqkv, c.qkv_dim());
            let (q, kv) = qkv.split_at(c.q_dim());
            let (k, v) = kv.split_at(c.kv_dim());
            let at = pos * c.kv_dim()..(pos + 1) * c.kv_dim();
            let (k_cache, v_cache) = &mut self.caches[l];
            k_cache[at.clone()]
                .iter_mut()
                .zip(k)
                .for_each(|(d, s)| *d = *s as f32);
            v_cache[at]
                .iter_mut()
                .zip(v)
                .for_each(|(d, s)| *d = *s as f32);
            let o = self.attention(l, q, pos)?;
            add(&mut x, &matvec(&o, &w.wo, c.d_model));
            let mut h = norm_matvec(&x, &w.mlp_norm, &w.w_up, c.hidden);
            h.iter_mut().for_each(|v| *v /= 1.0 + (-*v).exp());
            add(&mut x, &matvec(&h, &w.w_down, c.d_model));
        }
        Ok(norm_matvec(
            &x,
            &self.w.final_norm,
            &self.w.unembed,
            c.vocab,
        ))
    }

    fn attention(&self, layer: usize, q: &[f64], pos: usize) -> flashattn::Result<Vec<f64>> {
        let c = self.c;
        let q: Vec<f32> = q.iter().map(|&v| v as f32).collect();
        let (k, v) = &self.caches[layer];
        let n = (pos + 1) * c.kv_dim();
        let kv_shape = [1, pos + 1, c.heads_kv, c.head_dim];
        let out = flashattn::cpu::forward(
            &ForwardInputs::new(
                TensorView::f32([1, 1, c.heads_q, c.head_dim], &q),
                TensorView::f32(kv_shape, &k[..n]),
                TensorView::f32(kv_shape, &v[..n]),
            ),
            &AttentionOptions::default(),
        )?;
        Ok(out.o.to_f32().iter().map(|&v| v as f64).collect())
    }
}

/// How the device's generation compares with the host's model fed the same
/// tokens.
#[derive(Clone, Debug, Default)]
pub struct Check {
    /// Largest |device − host| over the final logits.
    pub max_logit_error: f64,
    /// Generated tokens that are the host's argmax too.
    pub agreeing: usize,
    /// Positions whose token is not the host's argmax but within
    /// [`LOGIT_TOLERANCE`] of it: a near tie f32 rounding may break either
    /// way (none with the default config).
    pub near_ties: Vec<usize>,
    /// Positions whose token the host's logits rule out.
    pub disagreeing: Vec<usize>,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.max_logit_error <= LOGIT_TOLERANCE && self.disagreeing.is_empty()
    }
}

/// Feed the device's tokens through the host model: at every generating
/// step the device's choice must be the host's argmax (or a near tie), and
/// the final logits must match.
pub fn check_on_cpu(config: &Config, weights: &Weights, run: &Run) -> AppResult<Check> {
    if run.tokens.len() != config.max_seq() + 1 || run.logits.len() != config.vocab {
        return Err("the run's tokens or logits have the wrong length".into());
    }
    let mut host = HostModel::new(config, weights);
    let mut check = Check::default();
    let mut logits = Vec::new();
    for pos in 0..config.max_seq() {
        logits = host.step(run.tokens[pos], pos)?;
        if pos + 1 < config.prompt.len() {
            continue;
        }
        let best = (0..logits.len())
            .reduce(|b, i| if logits[i] > logits[b] { i } else { b })
            .unwrap_or(0);
        let chosen = run.tokens[pos + 1] as usize;
        match logits.get(chosen) {
            _ if chosen == best => check.agreeing += 1,
            Some(l) if logits[best] - l <= LOGIT_TOLERANCE => check.near_ties.push(pos + 1),
            _ => check.disagreeing.push(pos + 1),
        }
    }
    check.max_logit_error = logits
        .iter()
        .zip(&run.logits)
        .map(|(h, d)| (h - *d as f64).abs())
        .fold(0.0, f64::max);
    Ok(check)
}

fn main() -> AppResult<()> {
    let config = Config::default();
    let weights = Weights::random(&config);
    let mut app = App::new(&adapter()?)?;
    let run = decode(&mut app, &config, &weights)?;
    let check = check_on_cpu(&config, &weights, &run)?;
    let generated = &run.tokens[config.prompt.len()..];
    println!("adapter: {}", app.adapter);
    println!(
        "{} tokens in {:.3} s: {:.1} tokens/s; per step {} submit(s), {} read-back(s), {} by flashattn",
        run.steps,
        run.seconds,
        run.tokens_per_second(),
        run.submits as f64 / run.steps as f64,
        run.readbacks as f64 / run.steps as f64,
        run.engine_submissions as f64 / run.steps as f64,
    );
    println!("generated: {generated:?}");
    println!(
        "against the CPU: {} of {} tokens the host's argmax, near ties at {:?}, \
         final logits within {:.2e} (tolerance {LOGIT_TOLERANCE:.0e})",
        check.agreeing, run.steps, check.near_ties, check.max_logit_error
    );
    if !check.passed() {
        return Err(format!("the device's generation does not match the host's: {check:?}").into());
    }
    Ok(())
}
