// Shared by every pagedkv kernel. The Rust side prepends this file to each kernel
// source before handing it to NVRTC, so kernels need no include path and no CUDA
// headers: conversions are written with PTX `cvt` and bit operations.
//
// Dtype codes (the `-D` defines use them): 0 = f32, 1 = f16, 2 = bf16, 3 = fp8 e4m3
// ("fn" variant: bias 7, max 448, one NaN pattern 0x7f/0xff, no infinities).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define PKV_F32 0
#define PKV_F16 1
#define PKV_BF16 2
#define PKV_FP8 3

#define PKV_LOG2E 1.4426950408889634f
#define PKV_LN2 0.6931471805599453f
#define PKV_INF __uint_as_float(0x7f800000u)

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round-to-nearest-even; needs sm_80 or later, the oldest target pagedkv compiles for.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// e4m3 -> f32 through f16: moving the 7 magnitude bits up by 7 turns an e4m3 value
// into the f16 with the same mantissa and an exponent 8 lower (bias 15 vs 7), normal
// or subnormal alike, so a multiply by 2^8 finishes the job.
__device__ __forceinline__ float fp8_to_f32(u8 b) {
    if ((b & 0x7f) == 0x7f) {
        return __uint_as_float(0x7fc00000u);
    }
    u16 h = (u16)(((b & 0x80) << 8) | ((b & 0x7f) << 7));
    return f16_to_f32(h) * 256.0f;
}

// f32 -> e4m3, round-to-nearest-even, saturating to +-448; NaN -> 0x7f.
__device__ __forceinline__ u8 f32_to_fp8(float x) {
    u32 bits = __float_as_uint(x);
    u8 sign = (u8)((bits >> 24) & 0x80);
    float a = fabsf(x);
    if (a != a) {
        return 0x7f;
    }
    if (a >= 448.0f) {
        return sign | 0x7e;
    }
    if (a < 0.015625f) {  // below 2^-6: subnormal, steps of 2^-9
        u32 m = (u32)rintf(a * 512.0f);  // 0..=8; 8 is the smallest normal, 0x08
        return sign | (u8)m;
    }
    int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
    float q = rintf(ldexpf(a, 3 - e));  // in [8, 16]
    u32 r = (u32)q;
    if (r == 16) {
        r = 8;
        e += 1;
    }
    int biased = e + 7;
    if (biased > 15 || (biased == 15 && r - 8 == 7)) {
        return sign | 0x7e;
    }
    return sign | (u8)((biased << 3) | (r - 8));
}

template <int DT> struct DTypeOf;
template <> struct DTypeOf<PKV_F32> { typedef float T; };
template <> struct DTypeOf<PKV_F16> { typedef u16 T; };
template <> struct DTypeOf<PKV_BF16> { typedef u16 T; };
template <> struct DTypeOf<PKV_FP8> { typedef u8 T; };

template <int DT>
__device__ __forceinline__ float to_f32(typename DTypeOf<DT>::T v);
template <> __device__ __forceinline__ float to_f32<PKV_F32>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<PKV_F16>(u16 v) { return f16_to_f32(v); }
template <> __device__ __forceinline__ float to_f32<PKV_BF16>(u16 v) { return bf16_to_f32(v); }
template <> __device__ __forceinline__ float to_f32<PKV_FP8>(u8 v) { return fp8_to_f32(v); }

template <int DT>
__device__ __forceinline__ typename DTypeOf<DT>::T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<PKV_F32>(float v) { return v; }
template <> __device__ __forceinline__ u16 from_f32<PKV_F16>(float v) { return f32_to_f16(v); }
template <> __device__ __forceinline__ u16 from_f32<PKV_BF16>(float v) { return f32_to_bf16(v); }
template <> __device__ __forceinline__ u8 from_f32<PKV_FP8>(float v) { return f32_to_fp8(v); }
