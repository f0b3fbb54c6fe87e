// The app's own kernels for examples/wgpu_app.rs: everything in a decoding
// step but attention. Vectors are f32; a matrix W (rows × cols) is row-major,
// so output j of a matrix-vector product is sum_i x[i] * W[i * cols + j].
// One invocation computes one output element: the model is tiny, and the
// point is the command flow, not a fast matvec.

struct Dims {
    // Input length.
    rows: u32,
    // Output length.
    cols: u32,
    // qkv: outputs below this go to q; the rest are K then V (equal halves).
    q_cols: u32,
    // norm_matvec: 1 applies SiLU to the output.
    silu: u32,
}

// Written by the host before each step's submit.
struct Step {
    // Position of the token this step reads (and of the K/V it writes).
    pos: u32,
    // The argmax is written to tokens[pos + 1] only past the prompt.
    prompt_len: u32,
    pad0: u32,
    pad1: u32,
}

// Every binding has its own number: each entry point's layout (derived by
// wgpu) holds just the ones it uses.
@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> x_in: array<f32>;
@group(0) @binding(3) var<storage, read> gain: array<f32>;
@group(0) @binding(4) var<storage, read> weight: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read_write> residual: array<f32>;
@group(0) @binding(7) var<storage, read_write> k_new: array<f32>;
@group(0) @binding(8) var<storage, read_write> v_new: array<f32>;
@group(0) @binding(9) var<storage, read> tokens_in: array<u32>;
@group(0) @binding(10) var<storage, read_write> tokens_out: array<u32>;

const RMS_EPS: f32 = 1e-5;

// Output j of (RMSNorm(x) * gain) @ W. Every invocation sums the squares
// itself: rows is at most a few hundred.
fn normed_dot(j: u32) -> f32 {
    var squares = 0.0;
    for (var i = 0u; i < dims.rows; i++) {
        squares += x_in[i] * x_in[i];
    }
    let scale = inverseSqrt(squares / f32(dims.rows) + RMS_EPS);
    var acc = 0.0;
    for (var i = 0u; i < dims.rows; i++) {
        acc += x_in[i] * scale * gain[i] * weight[i * dims.cols + j];
    }
    return acc;
}

// out = row tokens[pos] of the embedding table (cols wide).
@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) id: vec3<u32>) {
    let j = id.x;
    if j >= dims.cols {
        return;
    }
    out[j] = weight[tokens_in[step.pos] * dims.cols + j];
}

// out = (RMSNorm(x) * gain) @ W, through SiLU where dims.silu is 1.
@compute @workgroup_size(64)
fn norm_matvec(@builtin(global_invocation_id) id: vec3<u32>) {
    let j = id.x;
    if j >= dims.cols {
        return;
    }
    var y = normed_dot(j);
    if dims.silu == 1u {
        y = y / (1.0 + exp(-y));
    }
    out[j] = y;
}

// The QKV projection: q into out, this position's K and V into k_new and
// v_new (heads_kv, head_dim), which flashattn's decoding step appends to
// the layer's cache before it attends.
@compute @workgroup_size(64)
fn qkv(@builtin(global_invocation_id) id: vec3<u32>) {
    let j = id.x;
    if j >= dims.cols {
        return;
    }
    let y = normed_dot(j);
    let kv_cols = (dims.cols - dims.q_cols) / 2u;
    if j < dims.q_cols {
        out[j] = y;
    } else if j < dims.q_cols + kv_cols {
        k_new[j - dims.q_cols] = y;
    } else {
        v_new[j - dims.q_cols - kv_cols] = y;
    }
}

// residual += x @ W: the output projection and the MLP's down projection.
@compute @workgroup_size(64)
fn matvec_add(@builtin(global_invocation_id) id: vec3<u32>) {
    let j = id.x;
    if j >= dims.cols {
        return;
    }
    var acc = 0.0;
    for (var i = 0u; i < dims.rows; i++) {
        acc += x_in[i] * weight[i * dims.cols + j];
    }
    residual[j] += acc;
}

// Greedy choice on the device: the first index of the largest of the rows
// logits becomes the next step's token, so no step reads anything back.
@compute @workgroup_size(1)
fn argmax() {
    var best = 0u;
    for (var i = 1u; i < dims.rows; i++) {
        if x_in[i] > x_in[best] {
            best = i;
        }
    }
    if step.pos + 1u >= step.prompt_len {
        tokens_out[step.pos + 1u] = best;
    }
}
