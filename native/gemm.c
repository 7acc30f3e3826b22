/*
 * gemm.c - the frozen weights' 16-bit products through packed operands: the packed layouts of each
 * kernel, the graph ops that pack and multiply, and the BF16 kernel for CPUs with AVX512-BF16 (F16 on AVX2: gemm_avx2.c).
 *
 * ggml's BF16 product (llamafile's tinyBLAS) clears each 4 x 6 block of accumulators through a
 * memset on the stack and reads it back before every block. On the thin products of a training
 * step (contractions of 192 to 1,536) that costs about a third of the product: perf put 6.5% of a
 * whole SFT step inside that memset, and the k/v input gradients (a contraction of 192) ran at
 * 90 GFLOP/s where a square product reaches 300. Here both operands are packed so that the inner
 * loop reads two contiguous streams and keeps its accumulators in registers:
 *  - a weight of `rows` x k as [row block of 32][k pair][32 rows][2]: each k pair of a block is one
 *    128-byte run, written straight from the quantized rows, in either orientation (the forward's
 *    W, the backward's W^T), so the conversion the graph already paid for now also packs;
 *  - activations (k x tokens, F32) as [token block of 12][k pair][12 tokens][2], converted to BF16
 *    with round-to-nearest-even like ggml's own conversion of a product's input.
 * A 32 x 12 tile of the result lives in 24 vector registers while the contraction runs; each step
 * loads 32 rows' pair and broadcasts one pair per token into VDPBF16PS. Padding rows, tokens and
 * an odd k are zeros written by the packing ops, so every tile runs the same loop and the edges
 * are cut only when stored. Each output sums its k products in order, in F32 (ggml splits the sum
 * over 16 lanes): results differ from ggml's in the last bits only.
 * On CPUs with AMX the same packed weights go through tiles instead (gemm_amx.c), with the
 * activations packed row-major for them; k is padded to 32 in every packing so both kernels read
 * one weight layout (and one weight cache). On x86 CPUs without AVX512-BF16, gemm_avx2.c multiplies
 * F16 weights by F32 activations in the same way, where the graph would otherwise convert to F16 for
 * ggml's product. Which kernel runs is matmul.c's decision, made once per engine; the packed layouts
 * follow it (layout()), and the product follows the layouts (product_of()).
 */
#include "rg_internal.h"
#include "kernels.h"

#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

#define MR    32    /* rows of a weight block */
#define NR    12    /* tokens of an activation block */
#define SPAN  256   /* values of a row converted at a time: a multiple of every ggml block size */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
/* k pairs of a packed operand: padded to 16, one AMX tile's depth, so both kernels share the weights */
static int64_t kpairs(int64_t k) { return 16 * cdiv(cdiv(k, 2), 16); }

/* The packed operands of a kernel, in one place: type and shape of a weight of rows x k and of
 * activations of k x T. The BF16 kernels share the weight's layout; avx2-f16 packs F16 weights and
 * F32 activations, k unpadded (gemm_avx2.c). */
typedef struct {
    enum ggml_type type;
    int64_t        ne[2];
} packed_shape;

static void layout(int kern, int64_t rows, int64_t k, int64_t T, packed_shape * w, packed_shape * x) {
    if (kern == RG_KERNEL_AVX2_F16) {
        *w = (packed_shape) { GGML_TYPE_F16, { RG_AVX2_MR * k, cdiv(rows, RG_AVX2_MR) } };
        *x = (packed_shape) { GGML_TYPE_F32, { RG_AVX2_NR * k, cdiv(T, RG_AVX2_NR) } };
        return;
    }
    const int64_t kp = kpairs(k);
    *w = (packed_shape) { GGML_TYPE_BF16, { 2 * MR * kp, cdiv(rows, MR) } };
    *x = kern == RG_KERNEL_AMX_BF16 ? (packed_shape) { GGML_TYPE_BF16, { 2 * kp, 32 * cdiv(T, 32) } }
                            : (packed_shape) { GGML_TYPE_BF16, { 2 * NR * kp, cdiv(T, NR) } };
}

static bool has_shape(const struct ggml_tensor * t, const packed_shape * s) {
    return t->type == s->type && t->ne[0] == s->ne[0] && t->ne[1] == s->ne[1];
}

/* from the node's operands alone: one profile may hold the products of engines with other kernels */
double rg_gemm_flops(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_CUSTOM || !t->src[0] || !t->src[1]) return 0.0;
    const struct ggml_tensor * a = t->src[0], * b = t->src[1], * v = t->src[2], * z = t->src[3];
    const bool f16 = a->type == GGML_TYPE_F16;
    const int64_t per_k = f16 ? RG_AVX2_MR : MR;    /* values of a packed weight's row per k value */
    if (a->ne[0] % (f16 ? RG_AVX2_MR : 2 * MR) != 0) return 0.0;
    const int64_t k = a->ne[0] / per_k;             /* padded to the layout's multiple already */
    /* the kernels whose weights have this type: avx2-f16, or the two BF16 ones */
    const int kernels[2] = { f16 ? RG_KERNEL_AVX2_F16 : RG_KERNEL_AVX512_BF16,
                             f16 ? RG_KERNEL_AVX2_F16 : RG_KERNEL_AMX_BF16 };
    bool fits = false;
    for (int i = 0; i < 2; i++) {
        packed_shape ws, xs;
        layout(kernels[i], t->ne[0], k, t->ne[1], &ws, &xs);
        fits |= has_shape(a, &ws) && has_shape(b, &xs);
    }
    if (!fits) return 0.0;
    const double r = v && z ? (double) v->ne[1] : 0.0;
    return 2.0 * ((double) k + r) * (double) ggml_nelements(t);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RG_PACK_SIMD 1
static bool pack_simd(void) {
    static int have = -1;    /* benign race: every thread computes the same answer */
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512bf16");
    }
    return have == 1;
}

/* Q4_1 and Q8_0 blocks straight to BF16, 32 values a block. ggml's own to_float for them is scalar
 * and was a tenth of an SFT step; each value here is computed as ggml computes it (q d + m as a
 * product then a sum, not fused), then rounded as ggml_cpu_fp32_to_bf16 rounds, so the packed
 * weight is bit for bit the one the general path writes. */
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c")))
static void q4_1_to_bf16(const uint8_t * blk, int64_t nb, uint16_t * out) {
    for (int64_t b = 0; b < nb; b++, blk += 20, out += 32) {      /* fp16 d, fp16 m, 16 bytes of nibbles */
        uint16_t hd, hm;
        memcpy(&hd, blk, 2);
        memcpy(&hm, blk + 2, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(hd)), m = _mm512_set1_ps(_cvtsh_ss(hm));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (blk + 4)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xf)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
        const __m512 ylo = _mm512_add_ps(_mm512_mul_ps(lo, d), m), yhi = _mm512_add_ps(_mm512_mul_ps(hi, d), m);
        _mm512_storeu_si512(out, (__m512i) _mm512_cvtne2ps_pbh(yhi, ylo));
    }
}

__attribute__((target("avx512f,avx512bw,avx512bf16,f16c")))
static void q8_0_to_bf16(const uint8_t * blk, int64_t nb, uint16_t * out) {
    for (int64_t b = 0; b < nb; b++, blk += 34, out += 32) {      /* fp16 d, 32 signed bytes */
        uint16_t hd;
        memcpy(&hd, blk, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(hd));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk + 2))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk + 18))));
        _mm512_storeu_si512(out, (__m512i) _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, d), _mm512_mul_ps(lo, d)));
    }
}
#endif

/* values [i0, i0 + n) of row r of a weight as BF16, through convert.c's row reader */
static void row_span_bf16(const struct ggml_tensor * w, int64_t r, int64_t i0, int64_t n, float * tmp, uint16_t * out) {
#ifdef RG_PACK_SIMD
    if ((w->type == GGML_TYPE_Q4_1 || w->type == GGML_TYPE_Q8_0) && i0 % 32 == 0 && n % 32 == 0 && pack_simd()) {
        const uint8_t * blk = (const uint8_t *) w->data + r * w->nb[1] + (size_t) (i0 / 32) * ggml_type_size(w->type);
        if (w->type == GGML_TYPE_Q4_1) q4_1_to_bf16(blk, n / 32, out);
        else q8_0_to_bf16(blk, n / 32, out);
        return;
    }
#endif
    const ggml_to_float_t to_float = w->type == GGML_TYPE_F32 ? NULL : ggml_get_type_traits(w->type)->to_float;
    rg_row_span_f32(w, (const char *) w->data + r * w->nb[1], i0, n, to_float, tmp);
    ggml_cpu_fp32_to_bf16(tmp, (ggml_bf16_t *) out, n);
}

/* ---- packing a weight ----------------------------------------------------------------------- */
/* The interleaving below in AVX-512 where the CPU has it (every CPU that runs the products does):
 * scalar, it was half of the packing's time, the other half being the weight's own dequantization. */
#ifdef RG_PACK_SIMD

/* o[2 r + j] = half[r][2 p + j] for the 32 rows of a block and pairs p in [p0, p1): pair p of the
 * 32 rows, one 32-bit word each, is a gather of 16 words twice */
__attribute__((target("avx512f,avx512bw")))
static void interleave_rows(uint16_t (*half)[SPAN], int64_t p0, int64_t p1, int64_t i0, uint16_t * ob) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(SPAN / 2));
    for (int64_t p = p0; p < p1; p++) {
        const int32_t * base = (const int32_t *) half[0] + (p - i0 / 2);
        _mm512_storeu_si512(ob + p * 2 * MR, _mm512_i32gather_epi32(idx, base, 4));
        _mm512_storeu_si512(ob + p * 2 * MR + MR, _mm512_i32gather_epi32(idx, base + 16 * (SPAN / 2), 4));
    }
}

/* 32 consecutive rows (one block's, from its first) of two k values: pairs (h0[i], h1[i]) */
__attribute__((target("avx512f,avx512bw")))
static void interleave_pair(const uint16_t * h0, const uint16_t * h1, uint16_t * o) {
    const __m512i lo = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006, 0x270007,
                                         0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e, 0x2f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const __m512i a = _mm512_loadu_si512(h0), b = _mm512_loadu_si512(h1);
    _mm512_storeu_si512(o, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(a, hi, b));
}
#endif

/* userdata NULL: the weight as stored (rows = its n_out, k = n_in); else transposed (rows = n_in,
 * k = n_out). dst: BF16 [2 MR kp, row blocks]. */
static void pack_weight(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * w = dst->src[0];
    const bool tr = userdata != NULL;
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    const int64_t rows = tr ? n_in : n_out, k = tr ? n_out : n_in, kr = cdiv(k, 2), kp = kpairs(k), nblk = cdiv(rows, MR);
    uint16_t * out = dst->data;
    float tmp[SPAN];
    for (int64_t b = ith; b < nblk; b += nth) {    /* the pairs past k: zeros, like the padding rows */
        memset(out + (b * kp + kr) * 2 * MR, 0, sizeof(uint16_t) * 2 * MR * (size_t) (kp - kr));
    }
    if (!tr) {
        /* a block of 32 weight rows at a time, SPAN values of each */
        uint16_t half[MR][SPAN];
        for (int64_t b = ith; b < nblk; b += nth) {
            const int64_t nr = rows - b * MR < MR ? rows - b * MR : MR;
            uint16_t * ob = out + b * kp * 2 * MR;
            for (int64_t i0 = 0; i0 < k; i0 += SPAN) {
                const int64_t ns = k - i0 < SPAN ? k - i0 : SPAN;
                for (int64_t r = 0; r < MR; r++) {
                    if (r < nr) row_span_bf16(w, b * MR + r, i0, ns, tmp, half[r]);
                    else memset(half[r], 0, sizeof(half[r]));
                    if (ns % 2) half[r][ns] = 0;    /* the odd k's partner */
                }
#ifdef RG_PACK_SIMD
                if (pack_simd()) {
                    interleave_rows(half, i0 / 2, (i0 + ns + 1) / 2, i0, ob);
                    continue;
                }
#endif
                for (int64_t p = i0 / 2; p < (i0 + ns + 1) / 2; p++) {
                    uint16_t * o = ob + p * 2 * MR;
                    const int64_t i = 2 * p - i0;
                    for (int r = 0; r < MR; r++) {
                        o[2 * r] = half[r][i];
                        o[2 * r + 1] = half[r][i + 1];
                    }
                }
            }
        }
        return;
    }
    /* transposed: the pair of weight rows 2p, 2p + 1 gives k pair p of every block */
    uint16_t h0[SPAN], h1[SPAN];
    for (int64_t p = kr * ith / nth; p < kr * (ith + 1) / nth; p++) {
        const bool second = 2 * p + 1 < n_out;
        for (int64_t i0 = 0; i0 < n_in; i0 += SPAN) {
            const int64_t ns = n_in - i0 < SPAN ? n_in - i0 : SPAN;
            row_span_bf16(w, 2 * p, i0, ns, tmp, h0);
            if (second) row_span_bf16(w, 2 * p + 1, i0, ns, tmp, h1);
            else memset(h1, 0, sizeof(h1));
            int64_t i = 0;
#ifdef RG_PACK_SIMD
            /* i0 is a multiple of SPAN, so 32 values from i on are one block's rows 0-31 */
            if (pack_simd()) {
                for (; i + MR <= ns; i += MR) interleave_pair(h0 + i, h1 + i, out + (((i0 + i) / MR) * kp + p) * 2 * MR);
            }
#endif
            for (; i < ns; i++) {
                const int64_t row = i0 + i;
                uint16_t * o = out + ((row / MR) * kp + p) * 2 * MR + 2 * (row % MR);
                o[0] = h0[i];
                o[1] = h1[i];
            }
        }
        for (int64_t row = rows; row < nblk * MR; row++) {    /* the last block's padding rows */
            uint16_t * o = out + ((row / MR) * kp + p) * 2 * MR + 2 * (row % MR);
            o[0] = o[1] = 0;
        }
    }
}

enum ggml_type rg_packed_weight_shape(const struct ggml_tensor * w, bool transposed, int kernel, int64_t ne[2]) {
    packed_shape ws, xs;
    layout(kernel, transposed ? w->ne[0] : w->ne[1], transposed ? w->ne[1] : w->ne[0], 1, &ws, &xs);
    ne[0] = ws.ne[0];
    ne[1] = ws.ne[1];
    return ws.type;
}

bool rg_packed_weight_fits(const struct ggml_tensor * packed, const struct ggml_tensor * w, bool transposed, int kernel) {
    int64_t ne[2];
    return rg_packed_weight_shape(w, transposed, kernel, ne) == packed->type && packed->ne[0] == ne[0] &&
           packed->ne[1] == ne[1];
}

struct ggml_tensor * rg_pack_weight(struct ggml_context * ctx, struct ggml_tensor * w, bool transposed, int kernel) {
    int64_t ne[2];
    const enum ggml_type type = rg_packed_weight_shape(w, transposed, kernel, ne);
    struct ggml_tensor * args[1] = { w };
    struct ggml_tensor * t = ggml_custom_4d(ctx, type, ne[0], ne[1], 1, 1, args, 1,
                                            type == GGML_TYPE_F16 ? rg_avx2_pack_weight : pack_weight,
                                            GGML_N_TASKS_MAX, transposed ? (void *) 1 : NULL);
    ggml_format_name(t, "%s (%s, packed%s)", w->name, ggml_type_name(type), transposed ? ", transposed" : "");
    return t;
}

/* ---- the product ---------------------------------------------------------------------------- */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* x: F32 [k, T] (columns contiguous, any column stride); dst: BF16 [2 NR kp, token blocks], one pair
 * a 32-bit word with the even k in its low half. 32 values of a token at a time: converted by the
 * instruction ggml converts a product's input with, scattered to their 16 pairs' places. */
__attribute__((target("avx512f,avx512bf16")))
static void pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * x = dst->src[0];
    const int64_t k = x->ne[0], T = x->ne[1], kp = kpairs(k), ntb = dst->ne[1];
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(NR));
    uint32_t * out = dst->data;
    for (int64_t tb = ntb * ith / nth; tb < ntb * (ith + 1) / nth; tb++) {
        uint32_t * ob = out + tb * kp * NR;
        for (int j = 0; j < NR; j++) {
            const int64_t t = tb * NR + j;
            const float * col = t < T ? (const float *) ((const char *) x->data + t * x->nb[1]) : NULL;
            for (int64_t p0 = 0; p0 < kp; p0 += 16) {
                const int64_t left = k - 2 * p0;     /* values from here to the column's end */
                const __mmask16 mlo = rg_lanes16(left), mhi = rg_lanes16(left - 16);
                __m512i v = _mm512_setzero_si512();
                if (col) {
                    const __m512 lo = _mm512_maskz_loadu_ps(mlo, col + 2 * p0);
                    const __m512 hi = _mm512_maskz_loadu_ps(mhi, col + 2 * p0 + 16);
                    v = (__m512i) _mm512_cvtne2ps_pbh(hi, lo);
                }
                const int64_t np = kp - p0 < 16 ? kp - p0 : 16;
                _mm512_mask_i32scatter_epi32(ob + p0 * NR + j, rg_lanes16(np), idx, v, 4);
            }
        }
    }
}

/* C[t * ldc + r] = sum over k of A(r, k) B(k, t) for the nr rows and nt tokens of one tile; A and
 * B point at the tile's packed blocks (kp pairs each) */
__attribute__((target("avx512f,avx512bf16")))
static void tile_32x12(const uint16_t * A, const uint32_t * B, int64_t kp, float * C, int64_t ldc, int nr, int nt,
                       const rg_lowrank * lr) {
#define RG_ZERO(j) __m512 c##j##a = _mm512_setzero_ps(), c##j##b = _mm512_setzero_ps();
    RG_ZERO(0) RG_ZERO(1) RG_ZERO(2) RG_ZERO(3) RG_ZERO(4) RG_ZERO(5)
    RG_ZERO(6) RG_ZERO(7) RG_ZERO(8) RG_ZERO(9) RG_ZERO(10) RG_ZERO(11)
    for (int64_t p = 0; p < kp; p++) {
        const __m512bh a0 = (__m512bh) _mm512_loadu_si512(A), a1 = (__m512bh) _mm512_loadu_si512(A + 32);
#define RG_STEP(j) do {                                                         \
            const __m512bh bj = (__m512bh) _mm512_set1_epi32((int) B[j]);    \
            c##j##a = _mm512_dpbf16_ps(c##j##a, a0, bj);                     \
            c##j##b = _mm512_dpbf16_ps(c##j##b, a1, bj);                     \
        } while (0)
        RG_STEP(0); RG_STEP(1); RG_STEP(2); RG_STEP(3); RG_STEP(4); RG_STEP(5);
        RG_STEP(6); RG_STEP(7); RG_STEP(8); RG_STEP(9); RG_STEP(10); RG_STEP(11);
        A += 2 * MR;
        B += NR;
    }
    const __mmask16 ma = rg_lanes16(nr), mb = rg_lanes16(nr - 16);
    if (lr) {
        /* + V Z over the rank, in F32: V's 32 rows of column q times token j's value q */
        for (int q = 0; q < lr->r; q++) {
            const __m512 v0 = _mm512_maskz_loadu_ps(ma, lr->V + q * lr->ldv);
            const __m512 v1 = _mm512_maskz_loadu_ps(mb, lr->V + q * lr->ldv + 16);
#define RG_LR(j) if (j < nt) {                                                   \
            const __m512 zj = _mm512_set1_ps(lr->Z[(j) * lr->ldz + q]);           \
            c##j##a = _mm512_fmadd_ps(v0, zj, c##j##a);                           \
            c##j##b = _mm512_fmadd_ps(v1, zj, c##j##b);                           \
        }
            RG_LR(0) RG_LR(1) RG_LR(2) RG_LR(3) RG_LR(4) RG_LR(5)
            RG_LR(6) RG_LR(7) RG_LR(8) RG_LR(9) RG_LR(10) RG_LR(11)
#undef RG_LR
        }
    }
#define RG_STORE(j) if (j < nt) {                                                \
        _mm512_mask_storeu_ps(C + (j) * ldc, ma, c##j##a);                    \
        _mm512_mask_storeu_ps(C + (j) * ldc + 16, mb, c##j##b);               \
    }
    RG_STORE(0) RG_STORE(1) RG_STORE(2) RG_STORE(3) RG_STORE(4) RG_STORE(5)
    RG_STORE(6) RG_STORE(7) RG_STORE(8) RG_STORE(9) RG_STORE(10) RG_STORE(11)
#undef RG_ZERO
#undef RG_STEP
#undef RG_STORE
}

/* dst [rows, T] F32 from the packed weight src[0] and the packed activations src[1]. Each thread
 * takes a contiguous run of tiles, weight block by weight block, so a block stays in cache while
 * the activations stream past it. */
static void gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1], * v = dst->src[2], * z = dst->src[3];
    const int64_t rows = dst->ne[0], T = dst->ne[1], kp = a->ne[0] / (2 * MR);
    const int64_t nblk = a->ne[1], ntb = b->ne[1], n = nblk * ntb;
    const int64_t ldc = dst->nb[1] / sizeof(float);
    const int64_t i0 = n * ith / nth, i1 = n * (ith + 1) / nth;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t blk = i / ntb, tb = i % ntb;
        const int nr = (int) (rows - blk * MR < MR ? rows - blk * MR : MR);
        const int nt = (int) (T - tb * NR < NR ? T - tb * NR : NR);
        const rg_lowrank lr = v ? rg_lowrank_at(v, z, blk * MR, tb * NR) : (rg_lowrank) { 0 };
        tile_32x12((const uint16_t *) a->data + blk * kp * 2 * MR, (const uint32_t *) b->data + tb * kp * NR, kp,
                   (float *) dst->data + tb * NR * ldc + blk * MR, ldc, nr, nt, v ? &lr : NULL);
    }
}
#else
/* never built: no packed kernel runs off x86 (matmul.c) */
static void pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata) { (void) dst; (void) ith; (void) nth; (void) userdata; }
static void gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata) { (void) dst; (void) ith; (void) nth; (void) userdata; }
#endif

bool rg_pack_act_fits(const struct ggml_tensor * x) {
    return x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1 &&
           x->nb[1] % sizeof(float) == 0;
}

/* the kernel is chosen here, by the activations' layout, and the product follows it */
struct ggml_tensor * rg_pack_act(struct ggml_context * ctx, struct ggml_tensor * x, int kern) {
    struct ggml_tensor * args[1] = { x };
    packed_shape ws, xs;
    layout(kern, 1, x->ne[0], x->ne[1], &ws, &xs);
    struct ggml_tensor * t = ggml_custom_4d(ctx, xs.type, xs.ne[0], xs.ne[1], 1, 1, args, 1,
                                            kern == RG_KERNEL_AMX_BF16 ? rg_amx_pack_act
                                            : kern == RG_KERNEL_AVX2_F16 ? rg_avx2_pack_act : pack_act,
                                            GGML_N_TASKS_MAX, NULL);
    ggml_format_name(t, "%s (%s, packed)", x->name, ggml_type_name(xs.type));
    return t;
}

static ggml_custom_op_t product_of(const struct ggml_tensor * packed_w, const struct ggml_tensor * packed_x) {
    if (packed_w->type == GGML_TYPE_F16) return rg_avx2_gemm;
    return packed_x->ne[0] == packed_w->ne[0] / MR ? rg_amx_gemm : gemm;
}

struct ggml_tensor * rg_gemm(struct ggml_context * ctx, struct ggml_tensor * packed_w, struct ggml_tensor * packed_x,
                             int64_t rows, int64_t n_tokens) {
    struct ggml_tensor * args[2] = { packed_w, packed_x };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, rows, n_tokens, 1, 1, args, 2, product_of(packed_w, packed_x),
                          GGML_N_TASKS_MAX, NULL);
}

bool rg_gemm_lowrank_fits(const struct ggml_tensor * v, const struct ggml_tensor * z, int64_t rows, int64_t n_tokens) {
    return v->type == GGML_TYPE_F32 && z->type == GGML_TYPE_F32 && v->nb[0] == sizeof(float) && z->nb[0] == sizeof(float) &&
           v->ne[0] == rows && z->ne[1] == n_tokens && v->ne[1] == z->ne[0] && v->ne[2] == 1 && z->ne[2] == 1 &&
           v->ne[3] == 1 && z->ne[3] == 1 && v->nb[1] % sizeof(float) == 0 && z->nb[1] % sizeof(float) == 0;
}

struct ggml_tensor * rg_gemm_lowrank(struct ggml_context * ctx, struct ggml_tensor * packed_w, struct ggml_tensor * packed_x,
                                     struct ggml_tensor * v, struct ggml_tensor * z) {
    struct ggml_tensor * args[4] = { packed_w, packed_x, v, z };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, v->ne[0], z->ne[1], 1, 1, args, 4, product_of(packed_w, packed_x),
                          GGML_N_TASKS_MAX, NULL);
}
