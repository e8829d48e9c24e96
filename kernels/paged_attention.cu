// Paged attention, decode step (one query token per sequence), reading K/V through
// block tables. Compiled by NVRTC once per specialisation with these defines:
//
//   HEAD_DIM     elements per head (its bytes must be a multiple of 16)
//   BLOCK_SIZE   tokens per page
//   GQA_GROUP    query heads per KV head
//   KV_DTYPE     cache dtype code (see common.cuh)
//   NUM_THREADS  threads per CTA (default 128)
//   UNROLL       tokens per token group in flight (default: 2, or 1 when registers are tight)
//   VEC_BYTES    bytes per vector load, 16 or 8 (default 16; 8 for fp8 when 16 one-byte
//                elements per lane times the group exceed 128 accumulators, which would
//                spill. fp8 GQA 8 d128 takes 16: 128 accumulators, no spill, and half the
//                instructions per byte of 8-byte loads in the static model)
//
// Cache layout of one layer region (strides in elements come from KvLayout::strides):
//   [block][K|V][kv_head][token][dim]
//
// Grid: x = KV head, y = sequence, z = split of the context. One CTA serves every
// query head of its GQA group from one load of each K/V vector. Lanes are grouped
// LANES_PER_TOKEN to a token; each lane loads VEC_BYTES vectors; each token group keeps
// its own online-softmax state (base-2 logits), merged across the CTA at the end.
// With more than one split the CTA writes a normalised partial output and its
// log-sum-exp, and `paged_attention_merge` combines them.
//
// Bounds: the host validates, before every launch, that every table entry the kernel
// can read (entries 0..ceil(ctx / BLOCK_SIZE) of each row) names a block inside the
// region and that each row covers its context length. The kernel reads only tokens
// [max(split_begin, ctx - window), min(split_end, ctx)) of each sequence.

#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif

typedef typename DTypeOf<KV_DTYPE>::T cache_t;

#define ELEMS_PER_LANE_16B (HEAD_DIM / ((HEAD_DIM * (int)sizeof(cache_t) / 16) < 32 ? (HEAD_DIM * (int)sizeof(cache_t) / 16) : 32))
#ifndef VEC_BYTES
#define VEC_BYTES ((sizeof(cache_t) == 1 && GQA_GROUP * ELEMS_PER_LANE_16B > 128) ? 8 : 16)
#endif
#define VEC_ELEMS (VEC_BYTES / (int)sizeof(cache_t))
#define VECS_PER_TOKEN (HEAD_DIM / VEC_ELEMS)
#define LANES_PER_TOKEN (VECS_PER_TOKEN < 32 ? VECS_PER_TOKEN : 32)
#define VECS_PER_LANE (VECS_PER_TOKEN / LANES_PER_TOKEN)
#define ELEMS_PER_LANE (VECS_PER_LANE * VEC_ELEMS)
#define TOKEN_GROUPS (NUM_THREADS / LANES_PER_TOKEN)
// Tokens each group has in flight per iteration: 2 unless the accumulators already
// fill the register file, where a second token would spill.
#ifndef UNROLL
#define UNROLL (GQA_GROUP * ELEMS_PER_LANE <= 32 ? 2 : 1)
#endif

// The raw vector type of one load.
template <int BYTES> struct VecOf;
template <> struct VecOf<16> { typedef uint4 T; };
template <> struct VecOf<8> { typedef uint2 T; };
typedef typename VecOf<VEC_BYTES>::T vec_t;

static_assert((HEAD_DIM * (int)sizeof(cache_t)) % 16 == 0, "head bytes must be a multiple of 16");
static_assert((LANES_PER_TOKEN & (LANES_PER_TOKEN - 1)) == 0, "lanes per token must be a power of two");
static_assert(VECS_PER_TOKEN % LANES_PER_TOKEN == 0, "vectors must divide among lanes");
static_assert(VEC_BYTES == 16 || VEC_BYTES == 8, "8- or 16-byte vectors");
static_assert(NUM_THREADS % 32 == 0 && NUM_THREADS <= 1024, "whole warps");
static_assert(GQA_GROUP >= 1 && BLOCK_SIZE >= 1, "positive group and block size");

// 2^x with the SFU's approximation (MUFU.EX2, about 2 ulp; -inf gives +0, subnormal
// results flush to 0). exp2f adds a range test and two multiplies around the same
// instruction, for subnormal results a softmax weight can do without.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two e4m3 bytes (low byte first) to floats. sm_89 and later convert the pair in one
// instruction to an f16 pair, exactly (NaN stays NaN); older targets take the scalar path.
__device__ __forceinline__ void fp8x2_to_f32(u16 two, float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
    out[0] = f16_to_f32((u16)(h2 & 0xffffu));
    out[1] = f16_to_f32((u16)(h2 >> 16));
#else
    out[0] = fp8_to_f32((u8)(two & 0xff));
    out[1] = fp8_to_f32((u8)(two >> 8));
#endif
}

// Decodes one vector of the cache into floats (fp8: two elements per conversion).
__device__ __forceinline__ void decode_vec(vec_t raw, float* out) {
    if constexpr (KV_DTYPE == PKV_FP8) {
        const u16* pairs = reinterpret_cast<const u16*>(&raw);
#pragma unroll
        for (int i = 0; i < VEC_ELEMS / 2; ++i) {
            fp8x2_to_f32(pairs[i], &out[2 * i]);
        }
    } else {
        const cache_t* e = reinterpret_cast<const cache_t*>(&raw);
#pragma unroll
        for (int i = 0; i < VEC_ELEMS; ++i) {
            out[i] = to_f32<KV_DTYPE>(e[i]);
        }
    }
}

// Dimension of element `e` of vector `j` held by lane `lt` of a token group: vectors
// are interleaved so the lanes of a group read consecutive chunks.
__device__ __forceinline__ int lane_dim(int lt, int j, int e) {
    return (lt + j * LANES_PER_TOKEN) * VEC_ELEMS + e;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_decode(
    float* __restrict__ out,             // [batch, q_heads, (splits,) HEAD_DIM]
    float* __restrict__ lse,             // [batch, q_heads (, splits)], natural log
    const float* __restrict__ q,         // [batch, q_heads, HEAD_DIM]
    const cache_t* __restrict__ cache,   // this layer's region
    const u32* __restrict__ block_ids,   // padded rows, or CSR indices
    const u32* __restrict__ indptr,      // CSR row offsets [batch + 1], or null for padded
    const u32* __restrict__ lens,        // padded: context lengths; CSR: last_page_len
    u32 row_stride,                      // padded: max_blocks
    u64 stride_block, u64 stride_kv, u64 stride_head, u64 stride_token,
    const float* __restrict__ alibi_slopes,  // [q_heads] or null
    float scale_log2,                    // softmax scale * k_scale * log2(e)
    float v_scale,
    u32 sliding_window,                  // 0: none
    u32 tokens_per_split,                // a multiple of BLOCK_SIZE
    u32 num_splits) {
    const int kv_head = blockIdx.x;
    const int seq = blockIdx.y;
    const u32 split = blockIdx.z;
    const int num_kv_heads = gridDim.x;
    const int q_heads = num_kv_heads * GQA_GROUP;
    const int tid = threadIdx.x;
    const int tg = tid / LANES_PER_TOKEN;  // token group
    const int lt = tid % LANES_PER_TOKEN;  // lane in the group

    u64 row;
    u32 ctx;
    if (indptr != nullptr) {
        row = indptr[seq];
        u32 nb = indptr[seq + 1] - indptr[seq];
        ctx = nb == 0 ? 0 : (nb - 1) * BLOCK_SIZE + lens[seq];
    } else {
        row = (u64)seq * row_stride;
        ctx = lens[seq];
    }
    u32 begin = split * tokens_per_split;
    u32 end = begin + tokens_per_split < ctx ? begin + tokens_per_split : ctx;
    if (sliding_window != 0 && ctx > sliding_window && begin < ctx - sliding_window) {
        begin = ctx - sliding_window;
    }

    __shared__ float q_sh[GQA_GROUP][HEAD_DIM];
    __shared__ float acc_sh[GQA_GROUP][HEAD_DIM];
    __shared__ float m_sh[TOKEN_GROUPS][GQA_GROUP];
    __shared__ float l_sh[TOKEN_GROUPS][GQA_GROUP];
    __shared__ float mtot_sh[GQA_GROUP];
    __shared__ float ltot_sh[GQA_GROUP];

    for (int i = tid; i < GQA_GROUP * HEAD_DIM; i += NUM_THREADS) {
        int g = i / HEAD_DIM;
        int d = i % HEAD_DIM;
        q_sh[g][d] = q[((u64)seq * q_heads + kv_head * GQA_GROUP + g) * HEAD_DIM + d];
        acc_sh[g][d] = 0.0f;
    }
    // ALiBi slopes in base-2 units, in shared memory: registers go to the accumulators.
    __shared__ float slope_sh[GQA_GROUP];
    for (int g = tid; g < GQA_GROUP; g += NUM_THREADS) {
        slope_sh[g] = alibi_slopes != nullptr ? alibi_slopes[kv_head * GQA_GROUP + g] * PKV_LOG2E : 0.0f;
    }
    __syncthreads();

    float m[GQA_GROUP], l[GQA_GROUP], acc[GQA_GROUP][ELEMS_PER_LANE];
#pragma unroll
    for (int g = 0; g < GQA_GROUP; ++g) {
        m[g] = -PKV_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < ELEMS_PER_LANE; ++i) acc[g][i] = 0.0f;
    }

    const cache_t* head_base = cache + (u64)kv_head * stride_head;
    // Every warp runs the same number of iterations so the shuffles see all lanes.
    // Each iteration first issues the raw 16-byte loads of UNROLL tokens per group, then
    // decodes and consumes them, so more bytes are in flight per warp.
    for (u32 base = begin; base < end; base += TOKEN_GROUPS * UNROLL) {
        vec_t kraw[UNROLL][VECS_PER_LANE], vraw[UNROLL][VECS_PER_LANE];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 t = base + u * TOKEN_GROUPS + tg;
            if (t < end) {
                const u32 blk = block_ids[row + t / BLOCK_SIZE];
                const cache_t* kp = head_base + (u64)blk * stride_block + (u64)(t % BLOCK_SIZE) * stride_token;
#pragma unroll
                for (int j = 0; j < VECS_PER_LANE; ++j) {
                    kraw[u][j] = __ldg(reinterpret_cast<const vec_t*>(kp + lane_dim(lt, j, 0)));
                    vraw[u][j] = __ldg(reinterpret_cast<const vec_t*>(kp + stride_kv + lane_dim(lt, j, 0)));
                }
            } else {
#pragma unroll
                for (int j = 0; j < VECS_PER_LANE; ++j) {
                    kraw[u][j] = vec_t{};
                    vraw[u][j] = vec_t{};
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 t = base + u * TOKEN_GROUPS + tg;
            const bool valid = t < end;
            float k[ELEMS_PER_LANE];
#pragma unroll
            for (int j = 0; j < VECS_PER_LANE; ++j) decode_vec(kraw[u][j], &k[j * VEC_ELEMS]);
            float s[GQA_GROUP];
#pragma unroll
            for (int g = 0; g < GQA_GROUP; ++g) {
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < VECS_PER_LANE; ++j) {
#pragma unroll
                    for (int e = 0; e < VEC_ELEMS; ++e) {
                        part += q_sh[g][lane_dim(lt, j, e)] * k[j * VEC_ELEMS + e];
                    }
                }
#pragma unroll
                for (int off = LANES_PER_TOKEN / 2; off > 0; off /= 2) {
                    part += __shfl_xor_sync(0xffffffffu, part, off);
                }
                s[g] = part * scale_log2 + slope_sh[g] * ((float)t - (float)(ctx - 1));
            }
            if (valid) {
                float v[ELEMS_PER_LANE];
#pragma unroll
                for (int j = 0; j < VECS_PER_LANE; ++j) decode_vec(vraw[u][j], &v[j * VEC_ELEMS]);
#pragma unroll
                for (int g = 0; g < GQA_GROUP; ++g) {
                    // s is finite for a valid token, so m_new is too, and the first
                    // token's correction is exp2(-inf) = 0: no test for an empty state.
                    const float m_new = fmaxf(m[g], s[g]);
                    const float corr = fast_exp2(m[g] - m_new);
                    const float p = fast_exp2(s[g] - m_new);
                    l[g] = l[g] * corr + p;
#pragma unroll
                    for (int i = 0; i < ELEMS_PER_LANE; ++i) acc[g][i] = acc[g][i] * corr + p * v[i];
                    m[g] = m_new;
                }
            }
        }
    }

    // Merge the token groups: global max and sum per query head, then rescaled sums.
    if (lt == 0) {
#pragma unroll
        for (int g = 0; g < GQA_GROUP; ++g) {
            m_sh[tg][g] = m[g];
            l_sh[tg][g] = l[g];
        }
    }
    __syncthreads();
    if (tid < GQA_GROUP) {
        float mt = -PKV_INF;
        for (int i = 0; i < TOKEN_GROUPS; ++i) mt = fmaxf(mt, m_sh[i][tid]);
        float lt_sum = 0.0f;
        if (mt != -PKV_INF) {
            for (int i = 0; i < TOKEN_GROUPS; ++i) {
                if (m_sh[i][tid] != -PKV_INF) lt_sum += l_sh[i][tid] * exp2f(m_sh[i][tid] - mt);
            }
        }
        mtot_sh[tid] = mt;
        ltot_sh[tid] = lt_sum;
    }
    __syncthreads();
    // The token groups add their rescaled sums into shared memory one after another,
    // in token-group order (no atomics), so the result is bitwise reproducible and
    // sums in the order the CPU replay in tests/cuda_attention.rs does.
    for (int i = 0; i < TOKEN_GROUPS; ++i) {
        if (tg == i) {
#pragma unroll
            for (int g = 0; g < GQA_GROUP; ++g) {
                if (m[g] != -PKV_INF) {
                    const float f = exp2f(m[g] - mtot_sh[g]);
#pragma unroll
                    for (int j = 0; j < VECS_PER_LANE; ++j) {
#pragma unroll
                        for (int e = 0; e < VEC_ELEMS; ++e) {
                            acc_sh[g][lane_dim(lt, j, e)] += acc[g][j * VEC_ELEMS + e] * f;
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    for (int i = tid; i < GQA_GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int g = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        const u64 qh = (u64)seq * q_heads + kv_head * GQA_GROUP + g;
        const float lsum = ltot_sh[g];
        const float val = lsum > 0.0f ? acc_sh[g][d] / lsum * v_scale : 0.0f;
        if (num_splits == 1) {
            out[qh * HEAD_DIM + d] = val;
        } else {
            out[(qh * num_splits + split) * HEAD_DIM + d] = val;
        }
        if (d == 0) {
            const float lse_val = lsum > 0.0f ? (mtot_sh[g] + log2f(lsum)) * PKV_LN2 : -PKV_INF;
            if (num_splits == 1) {
                lse[qh] = lse_val;
            } else {
                lse[qh * num_splits + split] = lse_val;
            }
        }
    }
}

// Combines the partial outputs of the splits with their log-sum-exps.
// Grid: x = query head, y = sequence. Reads splits [0, num_splits) of one row.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_merge(
    float* __restrict__ out,            // [batch, q_heads, HEAD_DIM]
    float* __restrict__ lse,            // [batch, q_heads]
    const float* __restrict__ part_out, // [batch, q_heads, num_splits, HEAD_DIM]
    const float* __restrict__ part_lse, // [batch, q_heads, num_splits]
    u32 num_splits) {
    const u64 qh = (u64)blockIdx.y * gridDim.x + blockIdx.x;
    const float* pl = part_lse + qh * num_splits;
    float mx = -PKV_INF;
    for (u32 s = 0; s < num_splits; ++s) mx = fmaxf(mx, pl[s]);
    float wsum = 0.0f;
    if (mx != -PKV_INF) {
        for (u32 s = 0; s < num_splits; ++s) {
            if (pl[s] != -PKV_INF) wsum += expf(pl[s] - mx);
        }
    }
    for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
        float accum = 0.0f;
        if (wsum > 0.0f) {
            for (u32 s = 0; s < num_splits; ++s) {
                if (pl[s] != -PKV_INF) {
                    accum += expf(pl[s] - mx) * part_out[(qh * num_splits + s) * HEAD_DIM + d];
                }
            }
            accum /= wsum;
        }
        out[qh * HEAD_DIM + d] = accum;
    }
    if (threadIdx.x == 0) {
        lse[qh] = wsum > 0.0f ? mx + logf(wsum) : -PKV_INF;
    }
}
