// Paged attention, prefill / chunked prefill: variable-length query chunks read K/V
// through block tables. Query token j of sequence i (tokens query_start_loc[i] ..
// query_start_loc[i + 1]) sits at position p = ctx_i - qlen_i + j and attends to
// cached positions [window_start(p), p]: the cached prefix plus the chunk itself, causal
// within the chunk (the chunk's K/V are written to the cache first, e.g. by
// reshape_and_cache). This is `attention::reference::paged_prefill_reference`.
//
// Defines (NVRTC, one module per specialisation):
//   HEAD_DIM     elements per head, a multiple of 32 (each lane owns HEAD_DIM / 32)
//   BLOCK_SIZE   tokens per page
//   GQA_GROUP    query heads per KV head
//   KV_DTYPE     cache dtype code (common.cuh)
//   Q_TILE       query tokens per CTA (default 16 / GQA_GROUP, at least 1)
//   KV_TILE      keys per shared-memory tile (default 32, 16 for HEAD_DIM > 128)
//   NUM_WARPS    warps per CTA (default 4)
//
// Grid: x = KV head, y = query tile (the host's tile list: tile_seq[y], tile_q0[y]).
// One CTA serves ROWS = Q_TILE x GQA_GROUP query rows (tokens x heads of one GQA
// group), so every K/V tile, decoded once into shared memory as f32, is used by all of
// them: the reuse decode cannot have. Each warp owns rows w, w + NUM_WARPS, ...; per
// row and key tile, lane t computes the logit of key t (whole dot product from shared
// memory, no shuffles), the warp takes the tile's max and sum, and each lane updates
// its HEAD_DIM / 32 output dimensions (online softmax in base 2). CUDA cores only: a
// first, obviously-right version; tensor-core MMA tiles are the next step.
//
// Bounds: the host validates, before every launch, that each sequence's table covers
// its context, that every entry the kernel can read (0..ceil(ctx / BLOCK_SIZE)) names a
// block inside the region, that query_start_loc is non-decreasing with qlen <= ctx,
// and that each tile lies inside its sequence's queries. The kernel reads keys
// [window_start(p_first), min(p_last + 1, ctx)) of its sequence only.

#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif
#ifndef Q_TILE
#define Q_TILE ((16 / GQA_GROUP) > 0 ? (16 / GQA_GROUP) : 1)
#endif
#ifndef KV_TILE
#define KV_TILE (HEAD_DIM > 128 ? 16 : 32)
#endif
#define NUM_THREADS (NUM_WARPS * 32)
#define ROWS (Q_TILE * GQA_GROUP)
#define ROWS_PER_WARP ((ROWS + NUM_WARPS - 1) / NUM_WARPS)
#define DIMS_PER_LANE (HEAD_DIM / 32)
// Shared rows of K are padded by one float so lanes reading different keys at the same
// dimension hit different banks.
#define K_STRIDE (HEAD_DIM + 1)

typedef typename DTypeOf<KV_DTYPE>::T cache_t;

static_assert(HEAD_DIM % 32 == 0, "head_dim must be a multiple of 32");
static_assert(KV_TILE >= 1 && KV_TILE <= 32, "one key per lane");
static_assert(GQA_GROUP >= 1 && BLOCK_SIZE >= 1 && Q_TILE >= 1, "positive sizes");
static_assert((ROWS * HEAD_DIM + KV_TILE * (K_STRIDE + HEAD_DIM)) * 4 <= 48 * 1024,
              "static shared memory");

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_prefill(
    float* __restrict__ out,                   // [tokens, q_heads, HEAD_DIM]
    float* __restrict__ lse,                   // [tokens, q_heads], natural log
    const float* __restrict__ q,               // [tokens, q_heads, HEAD_DIM]
    const cache_t* __restrict__ cache,         // this layer's region
    const u32* __restrict__ block_ids,         // padded rows [batch, row_stride]
    const u32* __restrict__ ctx_lens,          // [batch], the chunk included
    const u32* __restrict__ query_start_loc,   // [batch + 1]
    const u32* __restrict__ tile_seq,          // [tiles]: the tile's sequence
    const u32* __restrict__ tile_q0,           // [tiles]: its first query token
    u32 row_stride,
    u64 stride_block, u64 stride_kv, u64 stride_head, u64 stride_token,
    const float* __restrict__ alibi_slopes,    // [q_heads] or null
    float scale_log2,                          // softmax scale * k_scale * log2(e)
    float v_scale,
    u32 sliding_window) {                      // 0: none
    const int kv_head = blockIdx.x;
    const int num_kv_heads = gridDim.x;
    const int q_heads = num_kv_heads * GQA_GROUP;
    const u32 seq = tile_seq[blockIdx.y];
    const u32 q0 = tile_q0[blockIdx.y];
    const u32 qa = query_start_loc[seq];
    const u32 qb = query_start_loc[seq + 1];
    const u32 ctx = ctx_lens[seq];
    const u32 qlen = qb - qa;
    const u32 ntok = (qb - q0) < (u32)Q_TILE ? (qb - q0) : (u32)Q_TILE;  // tokens in this tile
    const u32 p_first = ctx - qlen + (q0 - qa);
    const u32 p_last = p_first + ntok - 1;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;

    __shared__ float q_sh[ROWS][HEAD_DIM];
    __shared__ float k_sh[KV_TILE][K_STRIDE];
    __shared__ float v_sh[KV_TILE][HEAD_DIM];

    for (int i = tid; i < ROWS * HEAD_DIM; i += NUM_THREADS) {
        const int r = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        const int tok = r / GQA_GROUP;
        const int g = r % GQA_GROUP;
        q_sh[r][d] = tok < (int)ntok
            ? q[((u64)(q0 + tok) * q_heads + kv_head * GQA_GROUP + g) * HEAD_DIM + d]
            : 0.0f;
    }

    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][DIMS_PER_LANE];
    float slope[ROWS_PER_WARP];
#pragma unroll
    for (int k = 0; k < ROWS_PER_WARP; ++k) {
        m[k] = -PKV_INF;
        l[k] = 0.0f;
        const int r = warp + k * NUM_WARPS;
        const int g = r % GQA_GROUP;
        slope[k] = (alibi_slopes != nullptr && r < ROWS)
            ? alibi_slopes[kv_head * GQA_GROUP + g] * PKV_LOG2E : 0.0f;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[k][i] = 0.0f;
    }

    u32 kbegin = 0;
    if (sliding_window != 0 && p_first + 1 > sliding_window) {
        kbegin = p_first + 1 - sliding_window;
    }
    const u32 kend = p_last + 1 < ctx ? p_last + 1 : ctx;
    const u64 head_off = (u64)kv_head * stride_head;

    for (u32 base = kbegin; base < kend; base += KV_TILE) {
        __syncthreads();  // the previous tile is consumed (and q_sh written, first time)
        for (int i = tid; i < KV_TILE * HEAD_DIM; i += NUM_THREADS) {
            const int t = i / HEAD_DIM;
            const int d = i % HEAD_DIM;
            const u32 pos = base + t;
            float kf = 0.0f, vf = 0.0f;
            if (pos < kend) {
                const u32 blk = block_ids[(u64)seq * row_stride + pos / BLOCK_SIZE];
                const u64 off = (u64)blk * stride_block + head_off +
                                (u64)(pos % BLOCK_SIZE) * stride_token + d;
                kf = to_f32<KV_DTYPE>(cache[off]);
                vf = to_f32<KV_DTYPE>(cache[off + stride_kv]);
            }
            k_sh[t][d] = kf;
            v_sh[t][d] = vf;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < ROWS_PER_WARP; ++k) {
            const int r = warp + k * NUM_WARPS;
            if (r >= ROWS) continue;  // warp-uniform
            const int tok = r / GQA_GROUP;
            if (tok >= (int)ntok) continue;  // warp-uniform
            const u32 p = p_first + tok;
            const u32 wstart = (sliding_window != 0 && p + 1 > sliding_window) ? p + 1 - sliding_window : 0;
            const u32 pos = base + lane;
            const bool visible = lane < KV_TILE && pos < kend && pos <= p && pos >= wstart;
            float s = -PKV_INF;
            if (visible) {
                float dot = 0.0f;
#pragma unroll 8
                for (int d = 0; d < HEAD_DIM; ++d) dot += q_sh[r][d] * k_sh[lane][d];
                s = dot * scale_log2 + slope[k] * ((float)pos - (float)p);
            }
            float mt = s;
#pragma unroll
            for (int off = 16; off > 0; off /= 2) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
            if (mt == -PKV_INF) continue;  // nothing visible in this tile (warp-uniform)
            const float m_new = fmaxf(m[k], mt);
            const float corr = m[k] == -PKV_INF ? 0.0f : exp2f(m[k] - m_new);
            const float pr = visible ? exp2f(s - m_new) : 0.0f;
            float psum = pr;
#pragma unroll
            for (int off = 16; off > 0; off /= 2) psum += __shfl_xor_sync(0xffffffffu, psum, off);
            l[k] = l[k] * corr + psum;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) acc[k][i] *= corr;
            for (int t = 0; t < KV_TILE; ++t) {
                const float pt = __shfl_sync(0xffffffffu, pr, t);
#pragma unroll
                for (int i = 0; i < DIMS_PER_LANE; ++i) acc[k][i] += pt * v_sh[t][lane + 32 * i];
            }
            m[k] = m_new;
        }
    }

#pragma unroll
    for (int k = 0; k < ROWS_PER_WARP; ++k) {
        const int r = warp + k * NUM_WARPS;
        if (r >= ROWS) continue;
        const int tok = r / GQA_GROUP;
        if (tok >= (int)ntok) continue;
        const int g = r % GQA_GROUP;
        const u64 row = (u64)(q0 + tok) * q_heads + kv_head * GQA_GROUP + g;
        const float inv = l[k] > 0.0f ? v_scale / l[k] : 0.0f;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) out[row * HEAD_DIM + lane + 32 * i] = acc[k][i] * inv;
        if (lane == 0) lse[row] = l[k] > 0.0f ? (m[k] + log2f(l[k])) * PKV_LN2 : -PKV_INF;
    }
}
