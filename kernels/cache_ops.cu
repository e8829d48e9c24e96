// Cache maintenance kernels: batched block copies and the K/V scatter of a step.
// One compile serves every dtype: each (input dtype, cache dtype) pair is its own
// `extern "C"` entry point, so these need no `-D` defines.

// Copies whole blocks in every layer: CTA (pair, layer) copies `block_bytes` bytes of
// block `pairs[2 * pair]` onto block `pairs[2 * pair + 1]` in region `layer_bases[layer]`.
// Copy-on-write plans and defragmentation moves both arrive here as src -> dst pairs.
//
// Bounds: the host validates every id against the arena's block count before the
// launch and that no destination is also a source, so CTAs never race.
extern "C" __global__ void copy_blocks(
    const u64* __restrict__ layer_bases,  // [num_layers] device addresses of regions
    const u32* __restrict__ pairs,        // [num_pairs][2] = (src, dst)
    u64 block_bytes) {
    const u32 pair = blockIdx.x;
    const u32 layer = blockIdx.y;
    u8* base = reinterpret_cast<u8*>(layer_bases[layer]);
    const u8* src = base + (u64)pairs[2 * pair] * block_bytes;
    u8* dst = base + (u64)pairs[2 * pair + 1] * block_bytes;
    if ((block_bytes & 15) == 0) {
        // Regions start on a 2 MiB boundary, so 16-byte multiples keep every block aligned.
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const u64 n = block_bytes / 16;
        for (u64 i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    } else {
        for (u64 i = threadIdx.x; i < block_bytes; i += blockDim.x) dst[i] = src[i];
    }
}

// Scatters new K/V, `[tokens, kv_heads, head_dim]` of dtype IN, into their slots of
// one layer region with cache dtype CACHE (converting, and quantising to fp8 as
// x / scale, the correctly rounded f32 quotient as pagedkv::convert::encode computes it,
// then round-to-nearest-even and saturation). CTA = one token.
//
// Bounds: a slot at or past `num_slots` (= blocks * block_size of the region) is
// skipped, so a padding slot or a stale mapping never writes outside the region; the
// host-side entry points also reject such slots before launching.
template <int IN, int CACHE>
__device__ __forceinline__ void reshape_and_cache_impl(
    typename DTypeOf<CACHE>::T* __restrict__ cache,
    const typename DTypeOf<IN>::T* __restrict__ key,
    const typename DTypeOf<IN>::T* __restrict__ value,
    const u64* __restrict__ slots,
    u32 num_kv_heads, u32 head_dim, u32 block_size,
    u64 stride_block, u64 stride_kv, u64 stride_head, u64 stride_token,
    u64 num_slots, float k_scale, float v_scale) {
    const u32 token = blockIdx.x;
    const u64 slot = slots[token];
    if (slot >= num_slots) {
        return;
    }
    const u64 blk = slot / block_size;
    const u64 off = slot % block_size;
    const u64 n = (u64)num_kv_heads * head_dim;
    const bool quantise = CACHE == PKV_FP8 && IN != PKV_FP8;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        const u64 h = i / head_dim;
        const u64 d = i % head_dim;
        const u64 dst = blk * stride_block + h * stride_head + off * stride_token + d;
        const u64 src = (u64)token * n + i;
        if (IN == CACHE) {
            cache[dst] = key[src];
            cache[dst + stride_kv] = value[src];
        } else {
            float kf = to_f32<IN>(key[src]);
            float vf = to_f32<IN>(value[src]);
            if (quantise) {
                kf = kf / k_scale;
                vf = vf / v_scale;
            }
            cache[dst] = from_f32<CACHE>(kf);
            cache[dst + stride_kv] = from_f32<CACHE>(vf);
        }
    }
}

#define PKV_RESHAPE(NAME, IN, CACHE)                                                   \
    extern "C" __global__ void NAME(                                                   \
        typename DTypeOf<CACHE>::T* __restrict__ cache,                                \
        const typename DTypeOf<IN>::T* __restrict__ key,                               \
        const typename DTypeOf<IN>::T* __restrict__ value,                             \
        const u64* __restrict__ slots, u32 num_kv_heads, u32 head_dim, u32 block_size, \
        u64 stride_block, u64 stride_kv, u64 stride_head, u64 stride_token,            \
        u64 num_slots, float k_scale, float v_scale) {                                 \
        reshape_and_cache_impl<IN, CACHE>(cache, key, value, slots, num_kv_heads,      \
            head_dim, block_size, stride_block, stride_kv, stride_head, stride_token,  \
            num_slots, k_scale, v_scale);                                              \
    }

PKV_RESHAPE(reshape_and_cache_f32_f32, PKV_F32, PKV_F32)
PKV_RESHAPE(reshape_and_cache_f32_f16, PKV_F32, PKV_F16)
PKV_RESHAPE(reshape_and_cache_f32_bf16, PKV_F32, PKV_BF16)
PKV_RESHAPE(reshape_and_cache_f32_fp8, PKV_F32, PKV_FP8)
PKV_RESHAPE(reshape_and_cache_f16_f16, PKV_F16, PKV_F16)
PKV_RESHAPE(reshape_and_cache_f16_fp8, PKV_F16, PKV_FP8)
PKV_RESHAPE(reshape_and_cache_bf16_bf16, PKV_BF16, PKV_BF16)
PKV_RESHAPE(reshape_and_cache_bf16_fp8, PKV_BF16, PKV_FP8)
PKV_RESHAPE(reshape_and_cache_fp8_fp8, PKV_FP8, PKV_FP8)

// Rotary embeddings fused with the K/V scatter (the CUDA side of
// pagedkv::attention::rope_and_cache): CTA = one token at position `positions[token]`.
// Rotates the token's queries in place, and writes its keys rotated and its values as
// they are into their slot of one layer region in cache dtype CACHE (fp8: x / scale,
// as reshape_and_cache). `neox` != 0 pairs (i, i + rotary_dim / 2), else (2i, 2i + 1);
// dimensions past `rotary_dim` are not rotated. The angle pos * theta^(-2i / rotary_dim)
// and its cosine and sine are computed in double and rounded once, as on the host, so
// long positions lose nothing to an f32 angle.
//
// Bounds: queries and keys are read and written only inside the token's own rows; a
// slot at or past `num_slots` skips the cache write (the host-side entry points reject
// such slots before launching). Each query pair is read and written by one thread; a
// key element's partner is read from the const input, never from the cache.
__device__ __forceinline__ void rope_cos_sin(u64 pos, u32 pair, u32 rotary_dim, double theta,
                                             float* c, float* s) {
    const double angle = (double)pos * pow(theta, -2.0 * (double)pair / (double)rotary_dim);
    double sd, cd;
    sincos(angle, &sd, &cd);
    *c = (float)cd;
    *s = (float)sd;
}

template <int CACHE>
__device__ __forceinline__ void rope_and_cache_impl(
    typename DTypeOf<CACHE>::T* __restrict__ cache,
    float* __restrict__ query,            // [tokens, q_heads, head_dim], rotated in place
    const float* __restrict__ key,        // [tokens, kv_heads, head_dim]
    const float* __restrict__ value,      // [tokens, kv_heads, head_dim]
    const u64* __restrict__ positions,    // [tokens]
    const u64* __restrict__ slots,        // [tokens]
    u32 num_q_heads, u32 num_kv_heads, u32 head_dim, u32 rotary_dim, u32 neox,
    double theta, u32 block_size,
    u64 stride_block, u64 stride_kv, u64 stride_head, u64 stride_token,
    u64 num_slots, float k_scale, float v_scale) {
    const u32 token = blockIdx.x;
    const u64 pos = positions[token];
    const u32 half = rotary_dim / 2;
    float* q = query + (u64)token * num_q_heads * head_dim;
    const u64 q_pairs = (u64)num_q_heads * half;
    for (u64 i = threadIdx.x; i < q_pairs; i += blockDim.x) {
        const u32 h = (u32)(i / half);
        const u32 j = (u32)(i % half);
        const u32 a = neox ? j : 2 * j;
        const u32 b = neox ? j + half : 2 * j + 1;
        float c, s;
        rope_cos_sin(pos, j, rotary_dim, theta, &c, &s);
        float* x = q + (u64)h * head_dim;
        const float x0 = x[a];
        const float x1 = x[b];
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
    const u64 slot = slots[token];
    if (slot >= num_slots) {
        return;
    }
    const u64 blk = slot / block_size;
    const u64 off = slot % block_size;
    const u64 n = (u64)num_kv_heads * head_dim;
    const float* k = key + (u64)token * n;
    const float* v = value + (u64)token * n;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        const u64 h = i / head_dim;
        const u32 d = (u32)(i % head_dim);
        float kf = k[i];
        if (d < rotary_dim) {
            const bool first = neox ? d < half : (d % 2) == 0;
            const u32 j = neox ? d % half : d / 2;
            const u32 partner = neox ? (first ? d + half : d - half) : (first ? d + 1 : d - 1);
            const float other = k[h * head_dim + partner];
            float c, s;
            rope_cos_sin(pos, j, rotary_dim, theta, &c, &s);
            kf = first ? kf * c - other * s : other * s + kf * c;
        }
        float vf = v[i];
        if (CACHE == PKV_FP8) {
            kf = kf / k_scale;
            vf = vf / v_scale;
        }
        const u64 dst = blk * stride_block + h * stride_head + off * stride_token + d;
        cache[dst] = from_f32<CACHE>(kf);
        cache[dst + stride_kv] = from_f32<CACHE>(vf);
    }
}

#define PKV_ROPE_CACHE(NAME, CACHE)                                                     \
    extern "C" __global__ void NAME(                                                    \
        typename DTypeOf<CACHE>::T* __restrict__ cache, float* __restrict__ query,      \
        const float* __restrict__ key, const float* __restrict__ value,                 \
        const u64* __restrict__ positions, const u64* __restrict__ slots,               \
        u32 num_q_heads, u32 num_kv_heads, u32 head_dim, u32 rotary_dim, u32 neox,      \
        double theta, u32 block_size, u64 stride_block, u64 stride_kv,                  \
        u64 stride_head, u64 stride_token, u64 num_slots, float k_scale,                \
        float v_scale) {                                                                \
        rope_and_cache_impl<CACHE>(cache, query, key, value, positions, slots,          \
            num_q_heads, num_kv_heads, head_dim, rotary_dim, neox, theta, block_size,   \
            stride_block, stride_kv, stride_head, stride_token, num_slots, k_scale,     \
            v_scale);                                                                   \
    }

PKV_ROPE_CACHE(rope_and_cache_f32_f32, PKV_F32)
PKV_ROPE_CACHE(rope_and_cache_f32_f16, PKV_F16)
PKV_ROPE_CACHE(rope_and_cache_f32_bf16, PKV_BF16)
PKV_ROPE_CACHE(rope_and_cache_f32_fp8, PKV_FP8)
