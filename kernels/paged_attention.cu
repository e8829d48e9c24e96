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

// Queries and outputs in f32, f16 or bf16 (a runtime code, the same as the cache
// dtypes': 0 = f32, 1 = f16, 2 = bf16): read and written once per element, outside the
// token loop. Split partials and log-sum-exps stay f32.
__device__ __forceinline__ float load_io(const void* p, u64 i, u32 dt) {
    if (dt == PKV_F16) return f16_to_f32(reinterpret_cast<const u16*>(p)[i]);
    if (dt == PKV_BF16) return bf16_to_f32(reinterpret_cast<const u16*>(p)[i]);
    return reinterpret_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_io(void* p, u64 i, float v, u32 dt) {
    if (dt == PKV_F16) {
        reinterpret_cast<u16*>(p)[i] = f32_to_f16(v);
    } else if (dt == PKV_BF16) {
        reinterpret_cast<u16*>(p)[i] = f32_to_bf16(v);
    } else {
        reinterpret_cast<float*>(p)[i] = v;
    }
}

// The fixed-grid launch (DecodeGraphStep, capturable in a CUDA graph): the grid is
// (KV heads, max batch, max splits) whatever the step, and `step` points at device words
// [batch, tokens_per_split, num_splits] the step's upload wrote. A CTA past the batch or
// past the step's splits returns at once (the whole CTA, before any barrier); the others
// take the split cut from the device words. With `step` null (the per-call launch) the
// scalar arguments stand and every CTA runs, as before.
// Only the early exit and the cut are read here; the epilogue reads the split count
// again (`step_splits`) rather than keep it live across the token loop, where a
// register costs the page-8 specialisations a spill or occupancy.
__device__ __forceinline__ bool read_step(const u32* step, int seq, u32 split, u32& tokens_per_split) {
    if (step == nullptr) return true;
    if ((u32)seq >= step[0] || split >= step[2]) return false;
    tokens_per_split = step[1];
    return true;
}

__device__ __forceinline__ u32 step_splits(const u32* step, u32 num_splits) {
    return step == nullptr ? num_splits : step[2];
}

// The work-list launch: grid (KV heads, max items, 1); `work` holds
// [num_items, 0, 0, 0] then per item [seq, chunk | chunks << 16, begin, end], the
// chunks of each sequence's own live range (window included) as
// `build_work_list` cuts them. A CTA past `num_items` returns at once; the others
// take their sequence and token range from their item. With `work` null the grid
// path above stands.
__device__ __forceinline__ bool read_work(const u32* work, int& seq, u32& begin, u32& end) {
    if (blockIdx.y >= work[0]) return false;
    const u32* w = work + 4 * (blockIdx.y + 1);
    seq = (int)w[0];
    begin = w[2];
    end = w[3];
    return true;
}

// Chunks of this CTA's sequence in a work-list launch (1: the CTA writes the output).
__device__ __forceinline__ u32 work_chunks(const u32* work) {
    return work[4 * (blockIdx.y + 1) + 1] >> 16;
}

// One result element of a CTA: the output row (one split, or a work-list sequence of
// one chunk), else the split's partial (grid path: row qh's split `split`;
// work-list path: f32 partial row `item * q_heads + h`, h the query head within the
// sequence).
__device__ __forceinline__ void store_result(void* out, float* lse, const u32* work,
                                             float* part_out, float* part_lse, u32 num_splits,
                                             u32 split, u64 qh, int q_heads, int d, float val,
                                             float lse_val, u32 out_dtype) {
    if (work != nullptr && work_chunks(work) > 1) {
        const u64 row = (u64)blockIdx.y * q_heads + qh % q_heads;
        part_out[row * HEAD_DIM + d] = val;
        if (d == 0) part_lse[row] = lse_val;
    } else if (work != nullptr || num_splits == 1) {
        store_io(out, qh * HEAD_DIM + d, val, out_dtype);
        if (d == 0) lse[qh] = lse_val;
    } else {
        store_io(out, (qh * num_splits + split) * HEAD_DIM + d, val, out_dtype);
        if (d == 0) lse[qh * num_splits + split] = lse_val;
    }
}

// The fused merge of a work-list launch: after writing its partials a CTA counts
// itself in its (sequence, KV head) counter; the one that brings it to the chunk count
// merges the sequence's partials in chunk order (so the bits do not depend on which CTA
// came last; the same sums as `paged_attention_merge`), writes the output rows and
// resets the counter to 0 for the next launch (the counters start at 0 when allocated).
// Partials are read with ld.global.cg: the other CTAs' stores are in L2, not this SM's L1.
__device__ __noinline__ void fused_merge(void* out, float* lse, const u32* work, u32* counters,
                                         const float* part_out, const float* part_lse,
                                         int kv_head, int num_kv_heads, u32 out_dtype) {
    __shared__ u32 merge_last;
    const u32* w = work + 4 * (blockIdx.y + 1);
    const u32 seq = w[0], chunk = w[1] & 0xffffu, n = w[1] >> 16;
    if (n <= 1) return;
    u32* counter = counters + (u64)seq * num_kv_heads + kv_head;
    __threadfence();  // this CTA's partials before its count
    __syncthreads();
    if (threadIdx.x == 0) merge_last = atomicAdd(counter, 1u) == n - 1;
    __syncthreads();
    if (!merge_last) return;
    __threadfence();  // the others' partials after their counts
    const u32 first = blockIdx.y - chunk;
    const int q_heads = num_kv_heads * GQA_GROUP;
    for (int i = threadIdx.x; i < GQA_GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int d = i % HEAD_DIM;
        const u64 h = (u64)kv_head * GQA_GROUP + i / HEAD_DIM;
        float mx = -PKV_INF;
        for (u32 c = 0; c < n; ++c) mx = fmaxf(mx, __ldcg(part_lse + (first + c) * q_heads + h));
        float wsum = 0.0f;
        if (mx != -PKV_INF) {
            for (u32 c = 0; c < n; ++c) {
                const float x = __ldcg(part_lse + (first + c) * q_heads + h);
                if (x != -PKV_INF) wsum += expf(x - mx);
            }
        }
        float accum = 0.0f;
        if (wsum > 0.0f) {
            for (u32 c = 0; c < n; ++c) {
                const float x = __ldcg(part_lse + (first + c) * q_heads + h);
                if (x != -PKV_INF) {
                    accum += expf(x - mx) * __ldcg(part_out + ((first + c) * q_heads + h) * HEAD_DIM + d);
                }
            }
            accum /= wsum;
        }
        const u64 qh = (u64)seq * q_heads + h;
        store_io(out, qh * HEAD_DIM + d, accum, out_dtype);
        if (d == 0) lse[qh] = wsum > 0.0f ? mx + logf(wsum) : -PKV_INF;
    }
    if (threadIdx.x == 0) *counter = 0;
}

// Which decode path this specialisation compiles (the host mirrors this choice in
// src/attention/decode_mma.rs, `uses_mma`, to size the dynamic shared memory): tensor
// cores for GQA 3..16 over 16-bit and fp8 caches whose head rows are 64, 128, 256 or
// 512 bytes (d <= 256; power-of-two rows keep the lane quarters, V eighths and the
// swizzle whole), whose pages nest with 16-token tiles, and whose pages hold at least
// 32 of a tile's 16-byte chunks (a page of min(BLOCK_SIZE, 16) rows: the copy's page
// index is a compile-time constant only when each copy's 32 lanes stay in one page,
// see issue() below; this excludes e.g. bf16 d128 page 1, bf16 d64 pages 1-2, fp8
// d128 pages 1-2); the simple path otherwise (GQA 1-2, where an MMA would be 7/8
// padding, f32 caches, and those small pages).
#define PKV_KV_BYTES (KV_DTYPE == PKV_FP8 ? 1 : (KV_DTYPE == PKV_F32 ? 4 : 2))
#define PKV_PAGE_TILE_CHUNKS ((BLOCK_SIZE < 16 ? BLOCK_SIZE : 16) * HEAD_DIM * PKV_KV_BYTES / 16)
#ifndef DECODE_MMA
#define DECODE_MMA (KV_DTYPE != PKV_F32 && GQA_GROUP >= 3 && GQA_GROUP <= 16 && HEAD_DIM % 16 == 0 && \
                    HEAD_DIM <= 256 && HEAD_DIM * PKV_KV_BYTES >= 64 &&                             \
                    ((HEAD_DIM * PKV_KV_BYTES) & (HEAD_DIM * PKV_KV_BYTES - 1)) == 0 &&               \
                    (BLOCK_SIZE % 16 == 0 || 16 % BLOCK_SIZE == 0) && PKV_PAGE_TILE_CHUNKS % 32 == 0)
#endif

// ---------------------------------------------------------------------------------
// Tensor-core path (DECODE_MMA): GQA groups of 3..16 query heads over f16/bf16/fp8
// caches. Each warp owns tiles of 16 tokens (warp w takes tiles w, w + 4, ...) with its
// own online-softmax state; the 4 warps are merged at the end in warp order.
//
//  * S = Q K^T on mma.sync m16n8k16: A = the group's query heads as rows (padded to
//    16 with zeros), k = head dims, B = K with the tile's tokens as columns (two n-tiles
//    of 8). q is scaled by scale * log2(e) (* k_scale), rounded to the MMA type once,
//    and kept in registers as A fragments for the whole context.
//  * Softmax once per tile: row max over the 16 scores (4 per lane, then the lane quad),
//    one rescale of the accumulators per tile, p = 2^(s - m) packed into A fragments.
//  * O += P V on mma.sync m16n8k16: A = P (heads x 16 tokens), B = V (16 tokens x 8
//    dims per n-tile), f32 accumulators in C fragments.
//  * K/V tiles go to shared memory through a per-warp cp.async pipeline of
//    MMA_STAGES stages; the block ids of the next tile are loaded one iteration ahead.
//
// The k index of S (head dims) and the n index of O (output dims) are permuted so that
// every lane reads contiguous 16-byte chunks of shared memory (no ldmatrix): a lane
// with quad index j = lane % 4 owns chunks j, j + 4, ... of each K row, and its
// lane-local element i = 4s + e (k-step s, e = 0..3) is physical dim
// (j + 4 * (i / EPC)) * EPC + i % EPC, EPC elements per chunk. Its A fragment of q uses
// the same map. Output n-tile u, column n is physical dim n * (HEAD_DIM / 8) + u, so
// a lane with group index g = lane / 4 reads the contiguous eighth g of each V row.
// src/attention/decode_mma.rs replays exactly this ownership on the CPU.
//
// fp8: K pairs are converted with cvt.rn.f16x2.e4m3x2 (low byte to the low half, as
// the PTX ISA describes; unverified on hardware), V pairs are first interleaved from
// two token rows with prmt. The MMA type is f16 for f16 and fp8 caches, bf16 for bf16.

#if DECODE_MMA

#define MMA_WARPS (NUM_THREADS / 32)
#define MMA_TILE 16
#define ROW_BYTES (HEAD_DIM * (int)sizeof(cache_t))
#define ROW_CHUNKS (ROW_BYTES / 16)
#define EPC (16 / (int)sizeof(cache_t))
#define KSTEPS (HEAD_DIM / 16)
#define NTILES_O (HEAD_DIM / 8)
#define EIGHTH_BYTES (ROW_BYTES / 8)
#define TILE_BYTES (MMA_TILE * ROW_BYTES)
#define STAGE_BYTES (2 * TILE_BYTES)
#ifndef MMA_STAGES
#define MMA_STAGES ((3 * STAGE_BYTES * MMA_WARPS) <= 64 * 1024 ? 3 : 2)
#endif
#define PAGES_PER_TILE (BLOCK_SIZE >= MMA_TILE ? 1 : MMA_TILE / BLOCK_SIZE)
#define TWO_ROW_HALVES (GQA_GROUP > 8)
// K chunks each lane copies per tile (V the same).
#define COPY_PER_LANE (MMA_TILE * ROW_CHUNKS / 32)

static_assert(HEAD_DIM % 16 == 0 && ROW_BYTES >= 64 && (ROW_BYTES & (ROW_BYTES - 1)) == 0,
              "MMA path: head dims in whole k-steps, power-of-two rows of 64+ bytes");
static_assert(BLOCK_SIZE % MMA_TILE == 0 || MMA_TILE % BLOCK_SIZE == 0, "MMA path: pages and tiles nest");
static_assert(EIGHTH_BYTES % 8 == 0, "MMA path: an eighth of a row is whole 8-byte words");
static_assert((MMA_TILE * ROW_CHUNKS) % 32 == 0, "MMA path: chunks divide among lanes");
// issue() takes copy c's page as the compile-time ids[32 c / chunks per page]: right
// only when a page's chunks in a tile are whole multiples of 32, so that lanes 0..31
// of one copy never straddle two pages (smaller pages would silently read other
// tokens' K/V). DECODE_MMA's default and the host's `uses_mma` exclude such pages; a
// -DDECODE_MMA=1 forcing one, or a drift of the default, stops here.
static_assert(((MMA_TILE / PAGES_PER_TILE) * ROW_CHUNKS) % 32 == 0 &&
                  (MMA_TILE / PAGES_PER_TILE) * ROW_CHUNKS == PKV_PAGE_TILE_CHUNKS,
              "MMA path: a page holds a multiple of 32 of a tile's 16-byte chunks");

// Chunk swizzle of token row t (bank-conflict-free reads of the 256-byte and 128-byte
// rows of d128; the kernel is correct for any bijection, and the replay checks it).
__device__ __forceinline__ int mma_swizzle(int t) {
    if (ROW_CHUNKS < 8) return 0;
    const int low_bit = EIGHTH_BYTES >= 32 ? 0 : 1;
    return ((((t >> 1) & 1) << low_bit) | ((((t >> 2) ^ t) & 1) << 2)) & (ROW_CHUNKS - 1);
}

__device__ __forceinline__ u32 pack_mma(float lo, float hi) {
    u32 r;
    if constexpr (KV_DTYPE == PKV_BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    if constexpr (KV_DTYPE == PKV_BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two e4m3 bytes (low byte first) to an f16 pair, low byte in the low half.
__device__ __forceinline__ u32 fp8x2_to_f16x2(u32 two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h2;
    asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h2) : "r"(two));
    return h2;
#else  // sm_80: exact through f32 (every e4m3 value is an f16)
    return (u32)f32_to_f16(fp8_to_f32((u8)(two & 0xff))) | ((u32)f32_to_f16(fp8_to_f32((u8)((two >> 8) & 0xff))) << 16);
#endif
}

__device__ __forceinline__ void cp_async16(u32 smem, const void* gmem, bool valid) {
    const int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(n));
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_decode(
    void* __restrict__ out, float* __restrict__ lse, const void* __restrict__ q,
    const cache_t* __restrict__ cache, const u32* __restrict__ block_ids,
    const u32* __restrict__ indptr, const u32* __restrict__ lens, u32 row_stride,
    u64 stride_block, u64 stride_kv, u64 stride_head, u64 stride_token,
    const float* __restrict__ alibi_slopes, float scale_log2, float v_scale,
    u32 sliding_window, u32 tokens_per_split, u32 num_splits, u32 q_dtype, u32 out_dtype,
    const u32* __restrict__ step,
    const u32* __restrict__ work,        // null, or the work list (read_work)
    u32* __restrict__ counters,          // work list: [max batch, KV heads] arrival counts
    float* __restrict__ part_out,        // work list: [items, q_heads, HEAD_DIM] partials
    float* __restrict__ part_lse) {      // work list: [items, q_heads]
    extern __shared__ __align__(16) unsigned char mma_smem[];
    const int kv_head = blockIdx.x;
    int seq = blockIdx.y;
    const u32 split = blockIdx.z;
    u32 begin = 0, end = 0;
    if (work != nullptr) {
        if (!read_work(work, seq, begin, end)) return;
    } else if (!read_step(step, seq, split, tokens_per_split)) {
        return;
    }
    const int q_heads = gridDim.x * GQA_GROUP;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int g = lane / 4;  // row (head) of C/A fragments, column of B fragments
    const int j = lane % 4;  // quad index

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
    if (work == nullptr) {
        begin = split * tokens_per_split;
        end = begin + tokens_per_split < ctx ? begin + tokens_per_split : ctx;
        if (sliding_window != 0 && ctx > sliding_window && begin < ctx - sliding_window) {
            begin = ctx - sliding_window;
        }
    }
    // Tiles are aligned to 16 tokens, so a tile lies in one page (or whole pages).
    const u32 tile0 = begin / MMA_TILE * MMA_TILE;
    const int num_tiles = begin < end ? (int)((end - tile0 + MMA_TILE - 1) / MMA_TILE) : 0;

    // q as A fragments: rows g and g + 8, lane-local elements 4s + {0,1} and 4s + {2,3}.
    u32 qa[KSTEPS][4];
    {
        const u64 qrow0 = (u64)seq * q_heads + kv_head * GQA_GROUP;
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // row g, row g + 8
                const int r = g + 8 * half;
                float v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = 4 * s + e;
                    const int dim = (j + 4 * (i / EPC)) * EPC + i % EPC;
                    v[e] = r < GQA_GROUP ? load_io(q, (qrow0 + r) * HEAD_DIM + dim, q_dtype) * scale_log2 : 0.0f;
                }
                qa[s][half] = pack_mma(v[0], v[1]);      // k = 2j, 2j + 1
                qa[s][2 + half] = pack_mma(v[2], v[3]);  // k = 2j + 8, 2j + 9
            }
        }
    }
    float slope[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        slope[half] = (alibi_slopes != nullptr && r < GQA_GROUP) ? alibi_slopes[kv_head * GQA_GROUP + r] * PKV_LOG2E : 0.0f;
    }

    float o[NTILES_O][4];
#pragma unroll
    for (int u = 0; u < NTILES_O; ++u) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.0f;
    float m[2] = {-PKV_INF, -PKV_INF};
    float l[2] = {0.0f, 0.0f};  // this lane's partial sums

    const unsigned char* head_base = reinterpret_cast<const unsigned char*>(cache + (u64)kv_head * stride_head);
    const u64 sb = stride_block * sizeof(cache_t), skv = stride_kv * sizeof(cache_t), st = stride_token * sizeof(cache_t);
    unsigned char* wsm = mma_smem + warp * (MMA_STAGES * STAGE_BYTES);
    u32 wsm_addr;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(wsm_addr) : "l"(wsm));

    // Block ids of the next tile this warp issues, loaded one issue ahead.
    u32 next_ids[PAGES_PER_TILE];
    auto load_ids = [&](int tile, u32* ids) {
#pragma unroll
        for (int p = 0; p < PAGES_PER_TILE; ++p) {
            const u32 t = tile0 + (u32)tile * MMA_TILE + p * (MMA_TILE / PAGES_PER_TILE);
            ids[p] = (tile < num_tiles && t < end) ? block_ids[row + t / BLOCK_SIZE] : 0u;
        }
    };
    auto issue = [&](int tile, int stage, const u32* ids) {
        if (tile < num_tiles) {
#pragma unroll
            for (int c = 0; c < COPY_PER_LANE; ++c) {
                const int x = lane + 32 * c;
                const int tt = x / ROW_CHUNKS;  // token in the tile
                const int ch = x % ROW_CHUNKS;
                const u32 t = tile0 + (u32)tile * MMA_TILE + tt;
                const bool valid = t >= begin && t < end;
                // The page of copy c is known at compile time: a page holds
                // (16 / PAGES_PER_TILE) * ROW_CHUNKS chunks, a multiple of 32 (asserted
                // above), so lanes 0..31 of copy c all fall in page 32 c / that (a
                // runtime index into a register array would put it in local memory).
                const u32 blk = ids[(32 * c) / ((MMA_TILE / PAGES_PER_TILE) * ROW_CHUNKS)];
                const unsigned char* src = head_base + (u64)blk * sb + (u64)(t % BLOCK_SIZE) * st + ch * 16;
                const u32 dst = wsm_addr + stage * STAGE_BYTES + tt * ROW_BYTES + ((ch ^ mma_swizzle(tt)) * 16);
                cp_async16(dst, valid ? src : (const void*)head_base, valid);
                cp_async16(dst + TILE_BYTES, valid ? src + skv : (const void*)head_base, valid);
            }
        }
        asm volatile("cp.async.commit_group;");
    };

    load_ids(warp, next_ids);
#pragma unroll
    for (int p = 0; p < MMA_STAGES - 1; ++p) {
        u32 ids[PAGES_PER_TILE];
#pragma unroll
        for (int k = 0; k < PAGES_PER_TILE; ++k) ids[k] = next_ids[k];
        load_ids(warp + (p + 1) * MMA_WARPS, next_ids);
        issue(warp + p * MMA_WARPS, p, ids);
    }

    int stage = 0;
    for (int tile = warp; tile < num_tiles; tile += MMA_WARPS) {
        {
            const int ahead = tile + (MMA_STAGES - 1) * MMA_WARPS;
            u32 ids[PAGES_PER_TILE];
#pragma unroll
            for (int k = 0; k < PAGES_PER_TILE; ++k) ids[k] = next_ids[k];
            load_ids(ahead + MMA_WARPS, next_ids);
            issue(ahead, (stage + MMA_STAGES - 1) % MMA_STAGES, ids);
        }
        asm volatile("cp.async.wait_group %0;" ::"n"(MMA_STAGES - 1));
        __syncwarp();
        const unsigned char* ks = wsm + stage * STAGE_BYTES;
        const unsigned char* vs = ks + TILE_BYTES;

        // S = Q K^T: two n-tiles of 8 tokens.
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const int tt = 8 * nt + g;
            const unsigned char* krow = ks + tt * ROW_BYTES;
            u32 kw[ROW_CHUNKS / 4][4];
#pragma unroll
            for (int c = 0; c < ROW_CHUNKS / 4; ++c) {
                const uint4 w = *reinterpret_cast<const uint4*>(krow + (((j + 4 * c) ^ mma_swizzle(tt)) * 16));
                kw[c][0] = w.x; kw[c][1] = w.y; kw[c][2] = w.z; kw[c][3] = w.w;
            }
            const u32* kwf = &kw[0][0];
#pragma unroll
            for (int ks_ = 0; ks_ < KSTEPS; ++ks_) {
                u32 b0, b1;
                if constexpr (sizeof(cache_t) == 1) {
                    const u32 w = kwf[ks_];  // lane-local elements 4s..4s+3
                    b0 = fp8x2_to_f16x2(w & 0xffffu);
                    b1 = fp8x2_to_f16x2(w >> 16);
                } else {
                    b0 = kwf[2 * ks_];
                    b1 = kwf[2 * ks_ + 1];
                }
                mma_16816(s[nt], qa[ks_], b0, b1);
            }
        }
        // Mask and ALiBi; tile-relative token of s[nt][e] is 8 nt + 2 j + (e & 1).
        const u32 tbase = tile0 + (u32)tile * MMA_TILE;
        float tmax[2] = {-PKV_INF, -PKV_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 t = tbase + 8 * nt + 2 * j + (e & 1);
                float x = s[nt][e] + slope[e >> 1] * ((float)t - (float)(ctx - 1));
                x = (t >= begin && t < end) ? x : -PKV_INF;
                s[nt][e] = x;
                tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
            }
        }
        float corr[2];
#pragma unroll
        for (int half = 0; half < (TWO_ROW_HALVES ? 2 : 1); ++half) {
            tmax[half] = fmaxf(tmax[half], __shfl_xor_sync(0xffffffffu, tmax[half], 1));
            tmax[half] = fmaxf(tmax[half], __shfl_xor_sync(0xffffffffu, tmax[half], 2));
            const float m_new = fmaxf(m[half], tmax[half]);
            // A row with nothing valid yet keeps m = -inf; subtract 0 then (p = 0).
            const float m_use = m_new == -PKV_INF ? 0.0f : m_new;
            corr[half] = fast_exp2(m[half] - m_use);
            m[half] = m_new;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) s[nt][2 * half + e] = fast_exp2(s[nt][2 * half + e] - m_use);
            }
            l[half] = l[half] * corr[half] + ((s[0][2 * half] + s[0][2 * half + 1]) + (s[1][2 * half] + s[1][2 * half + 1]));
        }
        if (!TWO_ROW_HALVES) {
            corr[1] = 1.0f;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) s[nt][2] = s[nt][3] = 0.0f;
        }
        // P as the A fragment of the second MMA (k = tokens).
        u32 pa[4];
        pa[0] = pack_mma(s[0][0], s[0][1]);
        pa[1] = TWO_ROW_HALVES ? pack_mma(s[0][2], s[0][3]) : 0u;
        pa[2] = pack_mma(s[1][0], s[1][1]);
        pa[3] = TWO_ROW_HALVES ? pack_mma(s[1][2], s[1][3]) : 0u;

        // V: eighth g of the rows of tokens 2j, 2j + 1, 2j + 8, 2j + 9.
        u32 vw[4][EIGHTH_BYTES / 4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int tt = 2 * j + (r & 1) + 8 * (r >> 1);
            const unsigned char* vrow = vs + tt * ROW_BYTES;
#pragma unroll
            for (int c = 0; c < (EIGHTH_BYTES + 15) / 16; ++c) {
                const int byte = g * EIGHTH_BYTES + c * 16;
                const unsigned char* src = vrow + (((byte / 16) ^ mma_swizzle(tt)) * 16) + byte % 16;
                if constexpr (EIGHTH_BYTES >= 16) {
                    const uint4 w = *reinterpret_cast<const uint4*>(src);
                    vw[r][4 * c] = w.x; vw[r][4 * c + 1] = w.y; vw[r][4 * c + 2] = w.z; vw[r][4 * c + 3] = w.w;
                } else {
                    const uint2 w = *reinterpret_cast<const uint2*>(src);
                    vw[r][0] = w.x; vw[r][1] = w.y;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < NTILES_O; ++u) {
            o[u][0] *= corr[0];
            o[u][1] *= corr[0];
            if (TWO_ROW_HALVES) {
                o[u][2] *= corr[1];
                o[u][3] *= corr[1];
            }
            u32 b[2];
#pragma unroll
            for (int kh = 0; kh < 2; ++kh) {  // tokens 2j, 2j+1 | 2j+8, 2j+9
                const u32 a = vw[2 * kh][u * (int)sizeof(cache_t) / 4];
                const u32 c = vw[2 * kh + 1][u * (int)sizeof(cache_t) / 4];
                if constexpr (sizeof(cache_t) == 1) {
                    const int byte = u % 4;  // byte `byte` of a and of c
                    const u32 pair = __byte_perm(a, c, byte | ((byte + 4) << 4));
                    b[kh] = fp8x2_to_f16x2(pair);
                } else {
                    b[kh] = __byte_perm(a, c, (u % 2) == 0 ? 0x5410 : 0x7632);
                }
            }
            mma_16816(o[u], pa, b[0], b[1]);
        }
        __syncwarp();
        stage = (stage + 1) % MMA_STAGES;
    }
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();

    // Per-lane partial sums to row sums (the lane quad holds one row).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
        l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    }
    // Merge the warps in warp order through shared memory (the pipeline's, now idle):
    // [warp][16 rows] m and l, then [warp][16 rows][HEAD_DIM] o.
    float* m_sh = reinterpret_cast<float*>(mma_smem);
    float* l_sh = m_sh + MMA_WARPS * 16;
    float* o_sh = l_sh + MMA_WARPS * 16;
    if (j == 0) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            m_sh[warp * 16 + g + 8 * half] = m[half];
            l_sh[warp * 16 + g + 8 * half] = l[half];
        }
    }
#pragma unroll
    for (int u = 0; u < NTILES_O; ++u) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = g + 8 * (e >> 1);
            const int dim = (2 * j + (e & 1)) * NTILES_O + u;
            o_sh[(warp * 16 + r) * HEAD_DIM + dim] = o[u][e];
        }
    }
    __syncthreads();
    num_splits = step_splits(step, num_splits);
    for (int i = threadIdx.x; i < GQA_GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int r = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        float mt = -PKV_INF;
        for (int w = 0; w < MMA_WARPS; ++w) mt = fmaxf(mt, m_sh[w * 16 + r]);
        float lsum = 0.0f, acc = 0.0f;
        if (mt != -PKV_INF) {
            for (int w = 0; w < MMA_WARPS; ++w) {
                const float mw = m_sh[w * 16 + r];
                if (mw != -PKV_INF) {
                    const float f = exp2f(mw - mt);
                    lsum += l_sh[w * 16 + r] * f;
                    acc += o_sh[(w * 16 + r) * HEAD_DIM + d] * f;
                }
            }
        }
        const u64 qh = (u64)seq * q_heads + kv_head * GQA_GROUP + r;
        const float val = lsum > 0.0f ? acc / lsum * v_scale : 0.0f;
        const float lse_val = lsum > 0.0f ? (mt + log2f(lsum)) * PKV_LN2 : -PKV_INF;
        store_result(out, lse, work, part_out, part_lse, num_splits, split, qh, q_heads, d, val,
                     lse_val, out_dtype);
    }
    if (work != nullptr) {
        fused_merge(out, lse, work, counters, part_out, part_lse, kv_head, gridDim.x, out_dtype);
    }
}

#else  // the simple path: CUDA cores, one token per lane group

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_decode(
    void* __restrict__ out,              // [batch, q_heads, (splits,) HEAD_DIM], out_dtype
    float* __restrict__ lse,             // [batch, q_heads (, splits)], natural log
    const void* __restrict__ q,          // [batch, q_heads, HEAD_DIM], q_dtype
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
    u32 num_splits,
    u32 q_dtype,                         // 0 f32, 1 f16, 2 bf16
    u32 out_dtype,                       // the same codes (f32 when writing split partials)
    const u32* __restrict__ step,        // null, or the fixed-grid step words (read_step)
    const u32* __restrict__ work,        // null, or the work list (read_work)
    u32* __restrict__ counters,          // work list: [max batch, KV heads] arrival counts
    float* __restrict__ part_out,        // work list: [items, q_heads, HEAD_DIM] partials
    float* __restrict__ part_lse) {      // work list: [items, q_heads]      // null, or the fixed-grid step words (read_step)
    const int kv_head = blockIdx.x;
    int seq = blockIdx.y;
    const u32 split = blockIdx.z;
    u32 begin = 0, end = 0;
    if (work != nullptr) {
        if (!read_work(work, seq, begin, end)) return;
    } else if (!read_step(step, seq, split, tokens_per_split)) {
        return;
    }
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
    if (work == nullptr) {
        begin = split * tokens_per_split;
        end = begin + tokens_per_split < ctx ? begin + tokens_per_split : ctx;
        if (sliding_window != 0 && ctx > sliding_window && begin < ctx - sliding_window) {
            begin = ctx - sliding_window;
        }
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
        q_sh[g][d] = load_io(q, ((u64)seq * q_heads + kv_head * GQA_GROUP + g) * HEAD_DIM + d, q_dtype);
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

    num_splits = step_splits(step, num_splits);
    for (int i = tid; i < GQA_GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int g = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        const u64 qh = (u64)seq * q_heads + kv_head * GQA_GROUP + g;
        const float lsum = ltot_sh[g];
        const float val = lsum > 0.0f ? acc_sh[g][d] / lsum * v_scale : 0.0f;
        const float lse_val = lsum > 0.0f ? (mtot_sh[g] + log2f(lsum)) * PKV_LN2 : -PKV_INF;
        store_result(out, lse, work, part_out, part_lse, num_splits, split, qh, q_heads, d, val,
                     lse_val, out_dtype);
    }
    if (work != nullptr) {
        fused_merge(out, lse, work, counters, part_out, part_lse, kv_head, num_kv_heads, out_dtype);
    }
}

#endif  // DECODE_MMA

// Combines the partial outputs of the splits with their log-sum-exps.
// Grid: x = query head, y = sequence. Reads splits [0, num_splits) of one row.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_merge(
    void* __restrict__ out,             // [batch, q_heads, HEAD_DIM], out_dtype
    float* __restrict__ lse,            // [batch, q_heads]
    const float* __restrict__ part_out, // [batch, q_heads, num_splits, HEAD_DIM]
    const float* __restrict__ part_lse, // [batch, q_heads, num_splits]
    u32 num_splits,
    u32 out_dtype,
    const u32* __restrict__ step) {      // null, or the fixed-grid step words (read_step)
    u32 unused_tokens = 0;
    if (!read_step(step, blockIdx.y, 0, unused_tokens)) return;
    num_splits = step_splits(step, num_splits);
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
        store_io(out, qh * HEAD_DIM + d, accum, out_dtype);
    }
    if (threadIdx.x == 0) {
        lse[qh] = wsum > 0.0f ? mx + logf(wsum) : -PKV_INF;
    }
}
