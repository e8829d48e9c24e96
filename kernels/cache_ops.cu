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
