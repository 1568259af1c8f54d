/* SPDX-License-Identifier: MIT */
/* What the routed-expert kernels on tensor cores share (moe.cu: mma.sync, every image; moe_wgmma.cu:
 * wgmma for prefill chunks on sm_90a): the launch arguments, the FP4 decoder that turns a 32-bit word
 * of weights into bf16 MMA operands, the activations' operand order, a CTA's weight rows and the
 * clamped SwiGLU. Both kernels build every A operand with the same decoder from the same weight
 * bytes, so a token's outputs get the same bits from either (see moe_wgmma.cu). */
#ifndef DSV4_KERNELS_MOE_TILE_CUH
#define DSV4_KERNELS_MOE_TILE_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/cuda_util.cuh"
#include "kernels/dsv4cuda.h"
#include "kernels/mma.cuh"

#define MOE_TC_KT 128                           /* K values per k-tile */
#define MOE_TC_WROW (MOE_TC_KT / 2)             /* FP4 bytes per weight row per k-tile */
#define MOE_TC_XROW (MOE_TC_KT * 2)             /* bf16 activation bytes per token per k-tile */
#define MOE_TC_PASS 64                          /* tokens per pass: 8 n8 tiles */
#define MOE_TC_MAX_STAGES 7

enum { MOE_UP = 0, MOE_DOWN = 1 };

/* A CTA of `warps` warps: its threads, weight rows (one m16 tile a warp), rows of I a gate_up CTA
 * covers (w1 and w3 each) */
static __host__ __device__ constexpr int tc_threads(int warps) { return warps * DSV4_CUDA_WARP; }
static __host__ __device__ constexpr int tc_rows(int warps) { return warps * 16; }
static __host__ __device__ constexpr int tc_up_rows(int warps) { return warps * 8; }

struct moe_tc_args {
    const struct dsv4_cuda_expert *table;
    const int32_t *groups;
    int pairs, topk;
    const uint8_t *xa;          /* activations as bf16 operands: row r at xa + r * lda */
    int64_t lda;                /* bytes; gate_up rows are tokens (pair / topk), down rows are pairs */
    int nk;                     /* k-tiles of K */
    float limit;                /* SwiGLU clamp (gate_up) */
    float *y;                   /* gate_up: h [pairs, ldy] f32; down: out [pairs, ldy] */
    int64_t ldy;
    /* decode steps of a layer that fetches ahead: [E] where each expert's tiles are (NULL: the table) */
    const struct dsv4_cuda_fetch_redirect *redirect;
};

static __device__ __forceinline__ float swiglu(float g, float u, float limit)
{
    if (limit > 0.0f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

/* 8 consecutive values of K as bf16 in the order the FP4 decoder pairs nibbles (fp4x8_bf16):
 * [3, 7, 2, 6, 1, 5, 0, 4]. Exact for e4m3 x power-of-two values. */
static __device__ __forceinline__ uint4 bf16x8_operand(const float (&v)[8])
{
    return make_uint4(dsv4_bf16x2(v[3], v[7]), dsv4_bf16x2(v[2], v[6]), dsv4_bf16x2(v[1], v[5]),
                      dsv4_bf16x2(v[0], v[4]));
}

/* Operand chunk q of a row (bf16x8_operand of values 8q .. 8q + 7; rows are whole k-tiles, 16 chunks
 * each) stored for the mma.sync kernels (wg false: at chunk q, the 16 bytes a thread's fragment load
 * reads) or for the wgmma kernels (wg true: word p of chunk c = 4t + i of a k-tile at word 16i + 8(p >> 1)
 * + 4(p & 1) + t of that k-tile's 64). mma.sync feeds word p to k16 step 2i + (p >> 1) of the tile,
 * k-slots 2t, 2t + 1 (p even) or 2t + 8, 2t + 9 (p odd); wgmma reads a K-major B operand's k16 step s
 * from 32 contiguous bytes, k-slot k at byte 2k, so the wg order puts each word where the wgmma step
 * of the same k-slots reads it. */
static __device__ __forceinline__ void moe_store_operand(uint32_t *__restrict__ row, int64_t q, uint4 v, bool wg)
{
    if (!wg) {
        reinterpret_cast<uint4 *>(row)[q] = v;
        return;
    }
    uint32_t *kt = row + (q >> 4) * 64;
    const int i = (int)(q & 3), t = (int)((q >> 2) & 3);
    kt[16 * i + t] = v.x;
    kt[16 * i + 4 + t] = v.y;
    kt[16 * i + 8 + t] = v.z;
    kt[16 * i + 12 + t] = v.w;
}

/* bf16x2 a * b, exact here (powers of two times values of at most 3 significant bits) */
static __device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b)
{
    uint32_t d;
#if __CUDA_ARCH__ >= 900
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));    /* + (-0) */
#endif
    return d;
}

/* nibbles at bits 12-15 and 28-31 -> bf16x2 of their e2m1 values x 2^-126 */
static __device__ __forceinline__ uint32_t e2m1x2_raw(uint32_t v)
{
    return (v & 0x80008000u) | ((v >> 6) & 0x01c001c0u);
}

/* bf16x2 2^(e - 127) for a bf16 exponent field e in 1..254: e << 7 | e << 23, one multiply (the two
 * copies of e's 8 bits do not overlap) */
static __device__ __forceinline__ uint32_t bf16x2_pow2(uint32_t e)
{
    return e * 0x00800080u;
}

/* A word of tiled weights: the checkpoint's word of 8 e2m1 values (nibble k = value k, bits m, e0, e1,
 * s from the lowest) with its bits moved so that the decoder's pair (3, 7) already sits at its bf16x2
 * bits (E2M1X2_BITS: m, e0, e1 at 6-8, s at 15, and 16 higher), (2, 6) 3 bits below them, (1, 5) 6
 * below, and (0, 4) in the 8 bits left (E2M1X2_REST: e0, e1 at 10-11, s at 13, m at 14), which three
 * shifts by -3, -8 and +2 put in place. Nine groups of bits that move together. */
#define E2M1X2_BITS 0x81c081c0u
#define E2M1X2_REST 0x6c006c00u
static __host__ __device__ __forceinline__ uint32_t fp4_tile_word(uint32_t w)
{
    return (w & 0x80008000u) | ((w & 0x70007000u) >> 6) | ((w & 0x07000700u) >> 5) | ((w & 0x08000800u) << 1) |
           ((w & 0x00700070u) >> 4) | ((w & 0x00800080u) << 2) | ((w & 0x00010001u) << 14) |
           ((w & 0x00060006u) << 9) | ((w & 0x00080008u) << 10);
}

/* 8 e2m1 values (one 32-bit word, low nibble first; TILED: fp4_tile_word's order) x 2^(s-127) as bf16
 * pairs (3, 7), (2, 6), (1, 5), (0, 4); exact for s <= 128 (the caller finishes larger s). The last
 * tiled pair: the three shifted copies of its 8 bits land on disjoint bits (0, 5 and 10 up), so one
 * 64-bit multiply by 2^0 + 2^5 + 2^10 forms them without carries, 8 bits down from where they go. */
template <bool TILED>
static __device__ __forceinline__ void fp4x8_bf16(uint32_t w, uint32_t s, uint32_t (&p)[4])
{
    const uint32_t f = bf16x2_pow2(min(s, 128u) + 126u);
    if (TILED) {
        const uint64_t rest = (uint64_t)(w & E2M1X2_REST) * 0x421u;
        p[0] = bf16x2_mul(w & E2M1X2_BITS, f);
        p[1] = bf16x2_mul((w << 3) & E2M1X2_BITS, f);
        p[2] = bf16x2_mul((w << 6) & E2M1X2_BITS, f);
        p[3] = bf16x2_mul((uint32_t)(rest >> 8) & E2M1X2_BITS, f);
    } else {
        p[0] = bf16x2_mul(e2m1x2_raw(w), f);
        p[1] = bf16x2_mul(e2m1x2_raw(w << 4), f);
        p[2] = bf16x2_mul(e2m1x2_raw(w << 8), f);
        p[3] = bf16x2_mul(e2m1x2_raw(w << 12), f);
    }
}

/* Shared-memory row sr (0 .. 16 WARPS - 1) of a CTA's weight tile: gate_up tile rows [16w, 16w + 8)
 * are w1 rows and [16w + 8, 16w + 16) the w3 rows of the same I indices; down rows are w2 rows in
 * order. */
template <int MODE, int WARPS>
static __device__ __forceinline__ const struct dsv4_cuda_linear *tc_row(const struct dsv4_cuda_expert *ex, int tile,
                                                                       int sr, int64_t *row)
{
    if (MODE == MOE_UP) {
        *row = (int64_t)tile * tc_up_rows(WARPS) + (sr / 16) * 8 + sr % 8;
        return sr % 16 < 8 ? &ex->w1 : &ex->w3;
    }
    *row = (int64_t)tile * tc_rows(WARPS) + sr;
    return &ex->w2;
}

/* Word i of a thread's two weight rows (w0 of row g, w1 of row g + 8, scale bytes s0 and s1) as bf16
 * pairs (fp4x8_bf16), times the rest of 2^(s-1) where big (a scale of the warp's tile exceeds 2: the
 * caller decides it warp-uniformly, as every lane must take the same MMAs). */
template <bool TILED>
static __device__ __forceinline__ void tc_decode_rows(uint32_t w0, uint32_t w1, uint32_t s0, uint32_t s1, bool big,
                                                      uint32_t (&p0)[4], uint32_t (&p1)[4])
{
    fp4x8_bf16<TILED>(w0, s0, p0);
    fp4x8_bf16<TILED>(w1, s1, p1);
    if (big) {
        const uint32_t f0 = bf16x2_pow2(s0 > 128u ? s0 - 1u : 127u), f1 = bf16x2_pow2(s1 > 128u ? s1 - 1u : 127u);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            p0[q] = bf16x2_mul(p0[q], f0);
            p1[q] = bf16x2_mul(p1[q], f1);
        }
    }
}

/* Where a CTA of WARPS warps copies its weight tile from, k-tile 0: thread tid the 16-byte chunks tid
 * and tid + threads (row i / 4, 16 bytes i % 4: 4 rows = 2 x threads) and, tid < rows, row tid's scale
 * word; a k-tile further is wkt and skt bytes on (64 bytes along a row and 4 scale bytes, or a block
 * further when tiled). */
struct tc_wsrc {
    const uint8_t *w[2], *s;
    int64_t wkt, skt;
};

/* A decode CTA's tile read from a fetch slot (kernels/expert_fetch.cu) instead of where the table
 * points: w / s the slot's bases of w1, w3 and w2 (the table's layout), on: this tile's bytes are
 * there. */
struct tc_over {
    const uint8_t *w[3], *s[3];
    bool on;
};

/* The slot's base of the matrix shared-memory row sr of a tile comes from (tc_row's w1, w3 or w2),
 * weights or scales; selected, not indexed, so that tc_over stays in registers. */
template <int MODE>
static __device__ __forceinline__ const uint8_t *tc_over_base(const uint8_t *const (&b)[3], int sr)
{
    return MODE == MOE_UP ? (sr % 16 < 8 ? b[0] : b[1]) : b[2];
}

template <int MODE, int WARPS, bool TILED>
static __device__ __forceinline__ tc_wsrc tc_weight_src(const struct dsv4_cuda_expert *ex, int tile, int nk,
                                                        const tc_over &ov = tc_over{})
{
    const int tid = threadIdx.x;
    tc_wsrc src;
    src.s = nullptr;
    src.wkt = TILED ? DSV4_CUDA_TILE_BYTES : MOE_TC_WROW;
    src.skt = TILED ? DSV4_CUDA_TILE_SCALE_BYTES : 4;
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int i = tid + q * tc_threads(WARPS);
        int64_t row;
        const struct dsv4_cuda_linear *W = tc_row<MODE, WARPS>(ex, tile, i / 4, &row);
        const int64_t at = TILED ? (row / DSV4_CUDA_TILE_ROWS) * nk * DSV4_CUDA_TILE_BYTES +
                                       (row % DSV4_CUDA_TILE_ROWS) * MOE_TC_WROW
                                 : row * (W->row_stride / 2);
        src.w[q] = (ov.on ? tc_over_base<MODE>(ov.w, i / 4) : static_cast<const uint8_t *>(W->w)) + at + (i % 4) * 16;
    }
    if (tid < tc_rows(WARPS)) {
        int64_t row;
        const struct dsv4_cuda_linear *W = tc_row<MODE, WARPS>(ex, tile, tid, &row);
        const uint8_t *base = ov.on ? tc_over_base<MODE>(ov.s, tid) : W->scale;
        src.s = base + (TILED ? (row / DSV4_CUDA_TILE_ROWS) * nk * DSV4_CUDA_TILE_SCALE_BYTES +
                                    (row % DSV4_CUDA_TILE_ROWS) * 4
                              : row * W->scale_stride);
    }
    return src;
}

/* k-tile kt's weights into wb (rows x 64 bytes) and scale words into sb, this thread's share */
template <int WARPS>
static __device__ __forceinline__ void tc_load_weights(const tc_wsrc &src, uint8_t *wb, uint8_t *sb, int kt)
{
    const int tid = threadIdx.x;
    dsv4_cp_async16(wb + tid * 16, src.w[0] + kt * src.wkt);
    dsv4_cp_async16(wb + (tid + tc_threads(WARPS)) * 16, src.w[1] + kt * src.wkt);
    if (tid < tc_rows(WARPS))
        dsv4_cp_async4(sb + tid * 4, src.s + kt * src.skt);
}

/* moe_wgmma.cu, for moe.cu: *why_not NULL where its kernels run here (the sm_90a image, enough shared
 * memory; their shared-memory size set), else why not; a prefill chunk's gate_up (MOE_UP) or down
 * launch on them, with moe.cu's grid and arguments (activations in the wgmma order). */
int moe_wgmma_prepare(int smem_optin, const char **why_not);
void moe_wgmma_launch(int mode, bool tiled, dim3 grid, const moe_tc_args &a, cudaStream_t s);

#endif
