// MLA decode in the absorbed form (DeepSeek-V2/V3/R1, Kimi K2), reading a latent
// cache through block tables. Compiled by NVRTC once per specialisation with:
//
//   KV_LORA_RANK   latent elements that are also the values (512 for DeepSeek-V3)
//   ROPE_DIM       roped key elements after them (64)
//   BLOCK_SIZE     tokens per page
//   KV_DTYPE       cache dtype code (see common.cuh)
//   HEADS_PER_CTA  query heads per CTA, one warp each (NUM_THREADS = 32 x this)
//
// Cache layout of one layer region (KvLayout with KvKind::Latent):
//   [block][token][KV_LORA_RANK + ROPE_DIM]
//
// Semantics (src/attention/mla.rs): for query head h with absorbed query q[h] of
// KV_LORA_RANK + ROPE_DIM elements,
//   logit[t] = scale * q[h] . latent[t]
//   out[h]   = sum_t softmax(logit)[t] * latent[t][0 .. KV_LORA_RANK]
//   lse[h]   = ln(sum_t exp(logit[t]))
// with fp8 latents dequantised as code * kv_scale.
//
// Grid: x = group of HEADS_PER_CTA query heads, y = sequence, z = split of the
// sequence's pages. The CTA copies each page of latents into shared memory once with
// 16-byte loads, then every warp (one query head) walks its tokens: lane l owns
// dimensions l, l + 32, ... of the latent, so the score is a per-lane partial dot
// and a warp reduction, and the value accumulators (KV_LORA_RANK / 32 per lane) need
// no reduction at all. Every head of the group reuses the page from shared memory;
// that reuse is what makes MLA decode compute-bound rather than bandwidth-bound at
// DeepSeek's 128 heads. Each split writes a normalised partial output and its lse;
// `mla_decode_merge` combines them (one split needs no merge).
//
// Bounds: the host validates, before every launch, that entries
// 0..ceil(ctx / BLOCK_SIZE) of each table row name blocks inside the region and that
// the rows cover their context lengths. The kernel reads only those entries, and only
// pages [split * blocks_per_split, min((split + 1) * blocks_per_split, pages)).

#ifndef HEADS_PER_CTA
#define HEADS_PER_CTA 8
#endif

#define LATENT_DIM (KV_LORA_RANK + ROPE_DIM)
#define MLA_THREADS (HEADS_PER_CTA * 32)
#define DIMS_PER_LANE (LATENT_DIM / 32)
#define VALUE_DIMS_PER_LANE (KV_LORA_RANK / 32)

typedef DTypeOf<KV_DTYPE>::T cache_t;

#define PAGE_BYTES (BLOCK_SIZE * LATENT_DIM * (int)sizeof(cache_t))
#define PAGE_VECS (PAGE_BYTES / 16)
#define VECS_PER_THREAD ((PAGE_VECS + MLA_THREADS - 1) / MLA_THREADS)

static_assert(KV_LORA_RANK % 32 == 0, "KV_LORA_RANK must be a multiple of 32");
static_assert(LATENT_DIM % 32 == 0, "KV_LORA_RANK + ROPE_DIM must be a multiple of 32");
static_assert(PAGE_BYTES % 16 == 0, "a page must be a whole number of 16-byte vectors");
static_assert(PAGE_BYTES <= 40 * 1024, "a page must fit in 40 KiB of static shared memory");
static_assert(HEADS_PER_CTA >= 1 && HEADS_PER_CTA <= 32, "HEADS_PER_CTA must be 1..=32");

// 2^x with the SFU's approximation (MUFU.EX2).
__device__ __forceinline__ float mla_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS) mla_decode(
    const cache_t* __restrict__ cache,      // the layer region
    const float* __restrict__ q,            // [batch, num_q_heads, LATENT_DIM]
    const u32* __restrict__ block_tables,   // [batch, max_blocks]
    const u32* __restrict__ context_lens,   // [batch]
    float* __restrict__ out,                // [num_splits, batch, num_q_heads, KV_LORA_RANK]
    float* __restrict__ lse,                // [num_splits, batch, num_q_heads]
    u32 num_q_heads,
    u32 max_blocks,
    u32 blocks_per_split,
    float scale,
    float kv_scale) {
    __shared__ __align__(16) cache_t page[BLOCK_SIZE * LATENT_DIM];
    const u32 warp = threadIdx.x / 32;
    const u32 lane = threadIdx.x % 32;
    const u32 seq = blockIdx.y;
    const u32 batch = gridDim.y;
    const u32 split = blockIdx.z;
    const u32 head = blockIdx.x * HEADS_PER_CTA + warp;
    // A warp past the last head still copies its share of every page.
    const bool active = head < num_q_heads;
    const u32 ctx = context_lens[seq];
    const u32 pages = (ctx + BLOCK_SIZE - 1) / BLOCK_SIZE;
    const u32 first = split * blocks_per_split;
    const u32 last = min(first + blocks_per_split, pages);

    // Logits in base 2: q is prescaled by scale * log2(e) (and kv_scale for fp8).
    const float q_scale = scale * PKV_LOG2E * (KV_DTYPE == PKV_FP8 ? kv_scale : 1.0f);
    float qr[DIMS_PER_LANE];
    const float* qh = q + ((u64)seq * num_q_heads + (active ? head : 0)) * LATENT_DIM;
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; ++j) {
        qr[j] = active ? qh[lane + 32 * j] * q_scale : 0.0f;
    }
    float acc[VALUE_DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < VALUE_DIMS_PER_LANE; ++j) {
        acc[j] = 0.0f;
    }
    float m = -PKV_INF;
    float l = 0.0f;

    const u32* table = block_tables + (u64)seq * max_blocks;
    for (u32 b = first; b < last; ++b) {
        const uint4* src = reinterpret_cast<const uint4*>(
            cache + (u64)table[b] * (BLOCK_SIZE * LATENT_DIM));
        uint4* dst = reinterpret_cast<uint4*>(page);
#pragma unroll
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const u32 i = k * MLA_THREADS + threadIdx.x;
            if (i < PAGE_VECS) {
                dst[i] = src[i];
            }
        }
        __syncthreads();
        const u32 n = min((u32)BLOCK_SIZE, ctx - b * BLOCK_SIZE);
        if (active) {
#pragma unroll
            for (int t = 0; t < BLOCK_SIZE; ++t) {
                if ((u32)t < n) {
                    const cache_t* x = page + t * LATENT_DIM;
                    float xs[DIMS_PER_LANE];
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < DIMS_PER_LANE; ++j) {
                        xs[j] = to_f32<KV_DTYPE>(x[lane + 32 * j]);
                        s = fmaf(qr[j], xs[j], s);
                    }
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) {
                        s += __shfl_xor_sync(0xffffffffu, s, o);
                    }
                    const float m_new = fmaxf(m, s);
                    const float corr = mla_exp2(m - m_new);
                    const float p = mla_exp2(s - m_new);
                    l = fmaf(l, corr, p);
#pragma unroll
                    for (int j = 0; j < VALUE_DIMS_PER_LANE; ++j) {
                        acc[j] = fmaf(acc[j], corr, p * xs[j]);
                    }
                    m = m_new;
                }
            }
        }
        __syncthreads();
    }
    if (!active) {
        return;
    }
    const u64 row = ((u64)split * batch + seq) * num_q_heads + head;
    const float inv = l > 0.0f ? (KV_DTYPE == PKV_FP8 ? kv_scale : 1.0f) / l : 0.0f;
    float* o = out + row * KV_LORA_RANK;
#pragma unroll
    for (int j = 0; j < VALUE_DIMS_PER_LANE; ++j) {
        o[lane + 32 * j] = acc[j] * inv;
    }
    if (lane == 0) {
        lse[row] = l > 0.0f ? (m + log2f(l)) * PKV_LN2 : -PKV_INF;
    }
}

// Combines the partial outputs of `num_splits` splits with their lse.
// Grid: x = query head, y = sequence; MLA_THREADS threads stride over KV_LORA_RANK.
extern "C" __global__ void __launch_bounds__(MLA_THREADS) mla_decode_merge(
    const float* __restrict__ partial_out,  // [num_splits, batch, num_q_heads, KV_LORA_RANK]
    const float* __restrict__ partial_lse,  // [num_splits, batch, num_q_heads]
    float* __restrict__ out,                // [batch, num_q_heads, KV_LORA_RANK]
    float* __restrict__ lse,                // [batch, num_q_heads]
    u32 num_q_heads,
    u32 num_splits) {
    const u32 head = blockIdx.x;
    const u32 seq = blockIdx.y;
    const u32 batch = gridDim.y;
    const u64 row = (u64)seq * num_q_heads + head;
    const u64 split_stride = (u64)batch * num_q_heads;
    float m = -PKV_INF;
    for (u32 s = 0; s < num_splits; ++s) {
        m = fmaxf(m, partial_lse[s * split_stride + row]);
    }
    float total = 0.0f;
    if (m != -PKV_INF) {
        for (u32 s = 0; s < num_splits; ++s) {
            total += mla_exp2((partial_lse[s * split_stride + row] - m) * PKV_LOG2E);
        }
    }
    for (u32 d = threadIdx.x; d < KV_LORA_RANK; d += MLA_THREADS) {
        float v = 0.0f;
        if (total > 0.0f) {
            for (u32 s = 0; s < num_splits; ++s) {
                const float w =
                    mla_exp2((partial_lse[s * split_stride + row] - m) * PKV_LOG2E) / total;
                v = fmaf(w, partial_out[(s * split_stride + row) * KV_LORA_RANK + d], v);
            }
        }
        out[row * KV_LORA_RANK + d] = v;
    }
    if (threadIdx.x == 0) {
        lse[row] = total > 0.0f ? m + logf(total) : -PKV_INF;
    }
}
