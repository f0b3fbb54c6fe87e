// Shared by the decode kernels (append, split-KV attention, merge): the
// decode parameters, each sequence's key count and the page table that
// places its tokens in the cache. The Rust twin of `DecodeParams` is
// `kernels::decode::DecodeParams` (a test compares the layouts).
//
// A dense cache is one page per sequence (its cache row) of `capacity`
// tokens, so both layouts read through cache_row().

struct DecodeParams {
    // Token t of sequence b is cache row
    // pages[b * max_pages + t / page_size] * page_size + t % page_size.
    page_size: u32,
    max_pages: u32,
    // Split s covers keys s * keys_per_split .. of every sequence.
    keys_per_split: u32,
    num_splits: u32,
    // Packed rows per kv head (query heads of a group × tokens), and the
    // blocks of RB of them.
    group_rows: u32,
    row_blocks: u32,
    // Elements between consecutive splits' partial o and lse.
    o_split_stride: u32,
    lse_split_stride: u32,
    // Tokens appended per sequence this step.
    seqlen_new: u32,
    // Workgroups along x of the append and merge grids (they wrap into y).
    groups_x: u32,
    // Where the page table starts in `index`.
    pages_at: u32,
    heads_kv: u32,
    // A quantized cache's scale blocks (kv_quant.wgsl): tokens per block
    // and blocks per page, and the words where K's and V's scales start in
    // their buffers (0 for a plain cache).
    block_tokens: u32,
    blocks_per_page: u32,
    k_scales_at: u32,
    v_scales_at: u32,
    // Elements between kv heads' rows of V (D in a latent cache, whose V
    // is a view of K's first DV columns, read with K's row stride
    // params.v_row_stride), and of one row of v_new (0 in a latent cache:
    // its append writes K alone).
    v_head_stride: u32,
    v_new_len: u32,
}

@group(0) @binding(17) var<uniform> decode: DecodeParams;
// One buffer (storage bindings are few): each sequence's keys after this
// step's append, then the page table from `pages_at`.
@group(0) @binding(18) var<storage, read> index: array<u32>;

// Keys of sequence b after this step's append.
fn seqlen_k(b: u32) -> u32 {
    return index[b];
}

// The cache row of token t of sequence b.
fn cache_row(b: u32, t: u32) -> u32 {
    let page = index[decode.pages_at + b * decode.max_pages + t / decode.page_size];
    return page * decode.page_size + t % decode.page_size;
}

// Offset of row (b, i, h) of q, of o, and of lse[b, h, i].
fn q_offset(b: u32, i: u32, h: u32) -> u32 {
    return b * params.q_batch_stride + i * params.q_row_stride + h * D;
}

fn o_offset(b: u32, i: u32, h: u32) -> u32 {
    return (b * params.seqlen_q + i) * params.o_row_stride + h * DV;
}

// Offset of kv head hk's row of V in cache row `row`.
fn v_offset(row: u32, hk: u32) -> u32 {
    return row * params.v_row_stride + hk * decode.v_head_stride;
}

fn lse_offset(b: u32, h: u32, i: u32) -> u32 {
    return b * params.lse_batch_stride + h * params.lse_head_stride + i;
}

// A row's running max and sum before its first key: the sinks join the
// softmax of split 0 only, so the merge counts each once.
fn decode_start(split: u32, h: u32) -> vec2<f32> {
    if (split == 0u) {
        return softmax_start(h);
    }
    return vec2<f32>(NEG_BIG, 0.0);
}

// The flat index of a 2-d grid of WG-invocation workgroups that wraps x into y.
fn wrapped(wg: vec3<u32>, tid: u32) -> u32 {
    return (wg.y * decode.groups_x + wg.x) * WG + tid;
}
