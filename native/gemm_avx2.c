/*
 * gemm_avx2.c - gemm.c's packed product for x86 CPUs without AVX512-BF16: F16 weights times F32
 * activations with AVX2, FMA and F16C (every x86 CPU since 2013-2015, AVX-512F ones included).
 *
 * Without a BF16 dot product the graph converts the frozen quantized weights to F16 and ggml's F16
 * product multiplies them: it rounds the activations to F16 first, then widens both operands back
 * to F32 inside its loop (a conversion for every FMA). Here both operands are packed so that the
 * inner loop reads two contiguous streams and keeps its sums in registers, as gemm.c does for BF16:
 *  - a weight of `rows` x k as F16 [row block of 16][k][16 rows]: one k step of a block is 32
 *    contiguous bytes, two VCVTPH2PS (the loads folded in) to two ymm of 8 floats. Written straight
 *    from the quantized rows in either orientation (the forward's W, the backward's W^T), rounded as
 *    ggml rounds F32 to F16, so the weight's bits are those of the F16 route's converted copy;
 *  - activations (k x tokens, F32) as F32 [token block of 6][k][6 tokens], not rounded: a product
 *    of an F16 and an F32 value is exact in an FMA, so each output is the exact sum rounded only by
 *    its F32 accumulation, where ggml's route also loses the activations' low 13 bits.
 * The tile is 16 rows x 6 tokens: 12 ymm accumulators, 2 for the weight's k step and 1 for the
 * token's broadcast value, 15 of AVX2's 16 registers. Each k step has 2 conversions and 6 broadcasts
 * (load-port work) for 12 FMAs, enough to keep both FMA pipes busy. 24 x 4 would fill the registers
 * too, but with 3 conversions per 12 FMAs instead of 2; 8 x 12 (one conversion, 12 broadcasts per 12
 * FMAs) measured about 10% slower than 16 x 6 on a Zen 3 EPYC.
 * Padding rows and tokens are zeros written by the packing ops, so every tile runs one loop; the
 * edges are cut when stored (masked stores). k needs no padding: one step is one k value.
 */
#include "rg_internal.h"
#include "kernels.h"

#include <string.h>

#define MR    RG_AVX2_MR   /* rows of a weight block */
#define NR    RG_AVX2_NR   /* tokens of an activation block */
#define SPAN  256          /* values of a row converted at a time: a multiple of every ggml block size */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

bool rg_avx2_ready(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* ---- packing a weight ----------------------------------------------------------------------- */

/* Q4_1 and Q8_0 blocks straight to F16, 32 values a block (ggml's to_float for them is scalar).
 * Each value is computed as ggml's dequantization computes it (q d + m as a product, then a sum:
 * the library is built in ISO C mode, where GCC fuses no multiply-add the source does not ask for),
 * then rounded to nearest even as ggml_cpu_fp32_to_fp16 rounds: the same bits as the general path. */
__attribute__((target("avx2,fma,f16c")))
static void q4_1_to_f16(const uint8_t * blk, int64_t nb, uint16_t * out) {
    for (int64_t b = 0; b < nb; b++, blk += 20, out += 32) {      /* fp16 d, fp16 m, 16 bytes of nibbles */
        uint16_t hd, hm;
        memcpy(&hd, blk, 2);
        memcpy(&hm, blk + 2, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd)), m = _mm256_set1_ps(_cvtsh_ss(hm));
        const __m128i q = _mm_loadu_si128((const __m128i *) (blk + 4)), low = _mm_set1_epi8(0xf);
        /* values 0-15 are the low nibbles, 16-31 the high ones */
        const __m128i half[2] = { _mm_and_si128(q, low), _mm_and_si128(_mm_srli_epi16(q, 4), low) };
        for (int h = 0; h < 2; h++) {
            const __m256 y0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half[h]));
            const __m256 y1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(half[h], 8)));
            _mm_storeu_si128((__m128i *) (out + 16 * h), _mm256_cvtps_ph(_mm256_add_ps(_mm256_mul_ps(y0, d), m), 0));
            _mm_storeu_si128((__m128i *) (out + 16 * h + 8), _mm256_cvtps_ph(_mm256_add_ps(_mm256_mul_ps(y1, d), m), 0));
        }
    }
}

__attribute__((target("avx2,fma,f16c")))
static void q8_0_to_f16(const uint8_t * blk, int64_t nb, uint16_t * out) {
    for (int64_t b = 0; b < nb; b++, blk += 34, out += 32) {      /* fp16 d, 32 signed bytes */
        uint16_t hd;
        memcpy(&hd, blk, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
        for (int i = 0; i < 32; i += 8) {
            const __m256 y = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (blk + 2 + i))));
            _mm_storeu_si128((__m128i *) (out + i), _mm256_cvtps_ph(_mm256_mul_ps(y, d), 0));
        }
    }
}

/* values [i0, i0 + n) of row r of a weight as F16, through convert.c's row reader */
static void row_span_f16(const struct ggml_tensor * w, int64_t r, int64_t i0, int64_t n, float * tmp, uint16_t * out) {
    if ((w->type == GGML_TYPE_Q4_1 || w->type == GGML_TYPE_Q8_0) && i0 % 32 == 0 && n % 32 == 0) {
        const uint8_t * blk = (const uint8_t *) w->data + r * w->nb[1] + (size_t) (i0 / 32) * ggml_type_size(w->type);
        if (w->type == GGML_TYPE_Q4_1) q4_1_to_f16(blk, n / 32, out);
        else q8_0_to_f16(blk, n / 32, out);
        return;
    }
    const ggml_to_float_t to_float = w->type == GGML_TYPE_F32 ? NULL : ggml_get_type_traits(w->type)->to_float;
    rg_row_span_f32(w, (const char *) w->data + r * w->nb[1], i0, n, to_float, tmp);
    ggml_cpu_fp32_to_fp16(tmp, (ggml_fp16_t *) out, n);
}

/* 8 k values of the 16 rows of a block, half[r][i .. i + 8), to o[(i' - i) MR + r]: rows r and r + 8
 * share a ymm (one per 128-bit lane), so one 8 x 8 transpose of 16-bit values within the lanes gives
 * each k value's 16 rows in order in one ymm */
__attribute__((target("avx2")))
static void transpose_16x8(uint16_t (*half)[SPAN], int64_t i, uint16_t * o) {
    __m256i r[8], t[8], u[8];
    for (int j = 0; j < 8; j++) {
        r[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) (half[j] + i))),
                                       _mm_loadu_si128((const __m128i *) (half[j + 8] + i)), 1);
    }
    for (int j = 0; j < 4; j++) {      /* rows 2j, 2j + 1 interleaved: k values 0-3, then 4-7 */
        t[j] = _mm256_unpacklo_epi16(r[2 * j], r[2 * j + 1]);
        t[j + 4] = _mm256_unpackhi_epi16(r[2 * j], r[2 * j + 1]);
    }
    for (int h = 0; h < 2; h++) {      /* rows 0-3 (4-7) of k values 4h .. 4h + 3, two k values a register */
        u[4 * h + 0] = _mm256_unpacklo_epi32(t[4 * h + 0], t[4 * h + 1]);
        u[4 * h + 1] = _mm256_unpackhi_epi32(t[4 * h + 0], t[4 * h + 1]);
        u[4 * h + 2] = _mm256_unpacklo_epi32(t[4 * h + 2], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi32(t[4 * h + 2], t[4 * h + 3]);
    }
    for (int h = 0; h < 2; h++) {
        for (int j = 0; j < 2; j++) {
            _mm256_storeu_si256((__m256i *) (o + (4 * h + 2 * j) * MR), _mm256_unpacklo_epi64(u[4 * h + j], u[4 * h + j + 2]));
            _mm256_storeu_si256((__m256i *) (o + (4 * h + 2 * j + 1) * MR), _mm256_unpackhi_epi64(u[4 * h + j], u[4 * h + j + 2]));
        }
    }
}

/* userdata NULL: the weight as stored (rows = its n_out, k = n_in); else transposed (rows = n_in,
 * k = n_out). dst: F16 [MR k, row blocks]. */
void rg_avx2_pack_weight(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * w = dst->src[0];
    const bool tr = userdata != NULL;
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    const int64_t rows = tr ? n_in : n_out, k = tr ? n_out : n_in, nblk = dst->ne[1];
    uint16_t * out = dst->data;
    float tmp[SPAN];
    if (!tr) {
        /* a block of 16 weight rows at a time, SPAN values of each, transposed into k order */
        uint16_t half[MR][SPAN];
        for (int64_t b = ith; b < nblk; b += nth) {
            const int64_t nr = rows - b * MR < MR ? rows - b * MR : MR;
            uint16_t * ob = out + b * k * MR;
            for (int64_t i0 = 0; i0 < k; i0 += SPAN) {
                const int64_t ns = k - i0 < SPAN ? k - i0 : SPAN;
                for (int64_t r = 0; r < MR; r++) {
                    if (r < nr) row_span_f16(w, b * MR + r, i0, ns, tmp, half[r]);
                    else memset(half[r], 0, sizeof(half[r]));
                }
                int64_t i = 0;
                for (; i + 8 <= ns; i += 8) transpose_16x8(half, i, ob + (i0 + i) * MR);
                for (; i < ns; i++) {
                    for (int r = 0; r < MR; r++) ob[(i0 + i) * MR + r] = half[r][i];
                }
            }
        }
        return;
    }
    /* transposed: weight row o is k value o of every block, 16 consecutive values a block */
    uint16_t h[SPAN + MR];
    for (int64_t o = k * ith / nth; o < k * (ith + 1) / nth; o++) {
        for (int64_t i0 = 0; i0 < n_in; i0 += SPAN) {
            const int64_t ns = n_in - i0 < SPAN ? n_in - i0 : SPAN;
            row_span_f16(w, o, i0, ns, tmp, h);
            memset(h + ns, 0, sizeof(uint16_t) * MR);     /* the last block's padding rows */
            for (int64_t i = 0; i < ns; i += MR) memcpy(out + ((i0 + i) / MR * k + o) * MR, h + i, sizeof(uint16_t) * MR);
        }
    }
}

/* ---- the product ---------------------------------------------------------------------------- */

/* x: F32 [k, T] (columns contiguous, any column stride); dst: F32 [NR k, token blocks], zeros for the
 * tokens past T. Scalar: a pass over k T values beside a product of 2 k T rows FLOPs. */
void rg_avx2_pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * x = dst->src[0];
    const int64_t k = x->ne[0], T = x->ne[1], ntb = dst->ne[1];
    static const float zeros[1] = { 0.0f };
    for (int64_t tb = ntb * ith / nth; tb < ntb * (ith + 1) / nth; tb++) {
        float * ob = (float *) dst->data + tb * k * NR;
        const float * col[NR];
        int64_t step[NR];          /* 0 for a padding token: it reads one zero k times */
        for (int j = 0; j < NR; j++) {
            const int64_t t = tb * NR + j;
            col[j] = t < T ? (const float *) ((const char *) x->data + t * x->nb[1]) : zeros;
            step[j] = t < T;
        }
        for (int64_t p = 0; p < k; p++) {
            for (int j = 0; j < NR; j++) ob[p * NR + j] = col[j][p * step[j]];
        }
    }
}

/* C[t * ldc + r] = sum over k of A(r, k) B(k, t) for the nr rows and nt tokens of one tile; A and
 * B point at the tile's packed blocks (k steps each) */
__attribute__((target("avx2,fma,f16c")))
static void tile_16x6(const uint16_t * A, const float * B, int64_t k, float * C, int64_t ldc, int nr, int nt,
                      const rg_lowrank * lr) {
#define RG_ZERO(j) __m256 c##j##a = _mm256_setzero_ps(), c##j##b = _mm256_setzero_ps();
    RG_ZERO(0) RG_ZERO(1) RG_ZERO(2) RG_ZERO(3) RG_ZERO(4) RG_ZERO(5)
    for (int64_t p = 0; p < k; p++) {
        const __m256 a0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) A));
        const __m256 a1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (A + 8)));
#define RG_STEP(j) do {                                         \
            const __m256 bj = _mm256_broadcast_ss(B + (j));     \
            c##j##a = _mm256_fmadd_ps(a0, bj, c##j##a);         \
            c##j##b = _mm256_fmadd_ps(a1, bj, c##j##b);         \
        } while (0)
        RG_STEP(0); RG_STEP(1); RG_STEP(2); RG_STEP(3); RG_STEP(4); RG_STEP(5);
        A += MR;
        B += NR;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i ma = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lane), mb = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8), lane);
    if (lr) {
        /* + V Z over the rank, in F32: V's 16 rows of column q times token j's value q (masked loads:
         * V has no padding rows, and a masked-off lane reads nothing) */
        for (int q = 0; q < lr->r; q++) {
            const __m256 v0 = _mm256_maskload_ps(lr->V + q * lr->ldv, ma);
            const __m256 v1 = _mm256_maskload_ps(lr->V + q * lr->ldv + 8, mb);
#define RG_LR(j) if (j < nt) {                                               \
            const __m256 zj = _mm256_set1_ps(lr->Z[(j) * lr->ldz + q]);      \
            c##j##a = _mm256_fmadd_ps(v0, zj, c##j##a);                      \
            c##j##b = _mm256_fmadd_ps(v1, zj, c##j##b);                      \
        }
            RG_LR(0) RG_LR(1) RG_LR(2) RG_LR(3) RG_LR(4) RG_LR(5)
#undef RG_LR
        }
    }
    if (nr == MR) {
#define RG_STORE(j) if (j < nt) {                               \
            _mm256_storeu_ps(C + (j) * ldc, c##j##a);           \
            _mm256_storeu_ps(C + (j) * ldc + 8, c##j##b);       \
        }
        RG_STORE(0) RG_STORE(1) RG_STORE(2) RG_STORE(3) RG_STORE(4) RG_STORE(5)
#undef RG_STORE
        return;
    }
#define RG_STORE(j) if (j < nt) {                                       \
        _mm256_maskstore_ps(C + (j) * ldc, ma, c##j##a);                \
        _mm256_maskstore_ps(C + (j) * ldc + 8, mb, c##j##b);            \
    }
    RG_STORE(0) RG_STORE(1) RG_STORE(2) RG_STORE(3) RG_STORE(4) RG_STORE(5)
#undef RG_STORE
#undef RG_ZERO
#undef RG_STEP
}

/* dst [rows, T] F32 from the packed weight src[0] and the packed activations src[1] (+ src[2] src[3]).
 * Each thread takes a contiguous run of tiles, weight block by weight block, so a block stays in
 * cache while the activations stream past it. */
void rg_avx2_gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1], * v = dst->src[2], * z = dst->src[3];
    const int64_t rows = dst->ne[0], T = dst->ne[1], k = a->ne[0] / MR;
    const int64_t nblk = a->ne[1], ntb = b->ne[1], n = nblk * ntb;
    const int64_t ldc = dst->nb[1] / sizeof(float);
    const int64_t i0 = n * ith / nth, i1 = n * (ith + 1) / nth;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t blk = i / ntb, tb = i % ntb;
        const int nr = (int) (rows - blk * MR < MR ? rows - blk * MR : MR);
        const int nt = (int) (T - tb * NR < NR ? T - tb * NR : NR);
        const rg_lowrank lr = v ? rg_lowrank_at(v, z, blk * MR, tb * NR) : (rg_lowrank) { 0 };
        tile_16x6((const uint16_t *) a->data + blk * k * MR, (const float *) b->data + tb * k * NR, k,
                  (float *) dst->data + tb * NR * ldc + blk * MR, ldc, nr, nt, v ? &lr : NULL);
    }
}
#else
/* never run: rg_avx2_ready() is false */
bool rg_avx2_ready(void) { return false; }
void rg_avx2_pack_weight(struct ggml_tensor * dst, int ith, int nth, void * userdata) { (void) dst; (void) ith; (void) nth; (void) userdata; }
void rg_avx2_pack_act(struct ggml_tensor * dst, int ith, int nth, void * userdata) { (void) dst; (void) ith; (void) nth; (void) userdata; }
void rg_avx2_gemm(struct ggml_tensor * dst, int ith, int nth, void * userdata) { (void) dst; (void) ith; (void) nth; (void) userdata; }
#endif
