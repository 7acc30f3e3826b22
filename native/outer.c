/*
 * outer.c - the thin products of LoRA and attention, with one register-tiled kernel.
 *
 * Two shapes of product are slow through ggml's CPU kernels on a training micro-batch:
 *  - weight-style gradients, sum over tokens of p_t q_t^T (LoRA's dA and dB, attention's dK and
 *    dV). ggml differentiates into OUT_PROD, whose CPU kernel is a series of short axpys, and the
 *    route through MUL_MAT needs both operands transposed first, which cost more than the
 *    product. Both operands already hold one token per column: `rg_outer_sum` reads them as they are.
 *  - products whose inner dimension is the LoRA rank (B (A x) forward, A d(ax) backward): a
 *    16-long dot product per output, which ggml's matmul runs at a fifth of its speed.
 *    `rg_rank_expand` writes each output column as a sum of rank columns instead.
 * Both come down to one kernel: an 8 x 32 tile of the result held in registers while the
 * contraction runs, each step loading 32 values of one operand (the "vector" side) and 8 scalars
 * of the other (the "broadcast" side) for 16 AVX-512 multiply-adds (half the loads per FMA of a
 * 4 x 16 tile in AVX2 registers, which ran at about half the FMA units' rate). CPUs without AVX-512
 * run the tile as four 4 x 16 quarters. Tiles go to the threads in runs (outer sums) or round
 * robin (rank_expand); every output is one FMA chain over the contraction in order, so results
 * depend neither on the thread count nor on the kernel.
 * The profile that led here is in docs/benchmarks.md.
 */
#include "rg_internal.h"
#include "kernels.h"

#include <string.h>

#define VW 32   /* vector side of a tile */
#define BW 8    /* broadcast side of a tile */
#define QV 16   /* vector side of a quarter tile (the AVX2 and portable kernels) */
#define QB 4    /* broadcast side of a quarter tile */
#define RG_PF 32 /* steps the vector side is prefetched ahead */

/* One tile's operands: step s of the contraction reads V[s * ldv + 0..15] and
 * B[s * ldb + i * sb] for i = 0..3. */
typedef struct {
    const float * V;
    size_t        ldv;
    const float * B;
    size_t        ldb, sb;
    int64_t       steps;
} rg_tile;

/* The portable version uses the compiler's vector extension (SSE2 or NEON registers); x86-64
 * CPUs with AVX2 and FMA take the intrinsics version, chosen once at run time (the library is
 * built for the baseline ISA). */
typedef float rg_v4 __attribute__((vector_size(16)));

static inline rg_v4 load4(const float * p) {
    rg_v4 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static void tile_portable(const rg_tile * t, float acc[QB][QV]) {
    rg_v4 a[QB][QV / 4];
    memset(a, 0, sizeof(a));
    for (int64_t s = 0; s < t->steps; s++) {
        const float * v = t->V + (size_t) s * t->ldv;
        const float * b = t->B + (size_t) s * t->ldb;
        rg_v4 x[QV / 4];
        for (int j = 0; j < QV / 4; j++) x[j] = load4(v + 4 * j);
        for (int i = 0; i < QB; i++) {
            for (int j = 0; j < QV / 4; j++) a[i][j] += b[i * t->sb] * x[j];
        }
    }
    memcpy(acc, a, sizeof(a));
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RG_HAVE_AVX2_PATH 1

/* whether this CPU has AVX2 and FMA, asked once (benign race: every thread computes the same answer) */
static bool have_avx2_fma(void) {
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return have;
}

/* one 4 x 16 quarter: acc rows ldc floats apart; pointers stepped, not recomputed, each step */
__attribute__((target("avx2,fma")))
static inline void quarter_avx2(const float * v, size_t ldv, const float * b, size_t ldb, size_t sb, int64_t steps,
                                float * acc, size_t ldc) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    const float * b1 = b + sb, * b2 = b + 2 * sb, * b3 = b + 3 * sb;
    for (int64_t s = 0; s < steps; s++) {
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        __m256 x = _mm256_broadcast_ss(b);
        a00 = _mm256_fmadd_ps(x, v0, a00);
        a01 = _mm256_fmadd_ps(x, v1, a01);
        x = _mm256_broadcast_ss(b1);
        a10 = _mm256_fmadd_ps(x, v0, a10);
        a11 = _mm256_fmadd_ps(x, v1, a11);
        x = _mm256_broadcast_ss(b2);
        a20 = _mm256_fmadd_ps(x, v0, a20);
        a21 = _mm256_fmadd_ps(x, v1, a21);
        x = _mm256_broadcast_ss(b3);
        a30 = _mm256_fmadd_ps(x, v0, a30);
        a31 = _mm256_fmadd_ps(x, v1, a31);
        v += ldv;
        b += ldb;
        b1 += ldb;
        b2 += ldb;
        b3 += ldb;
    }
    _mm256_storeu_ps(acc, a00);
    _mm256_storeu_ps(acc + 8, a01);
    _mm256_storeu_ps(acc + ldc, a10);
    _mm256_storeu_ps(acc + ldc + 8, a11);
    _mm256_storeu_ps(acc + 2 * ldc, a20);
    _mm256_storeu_ps(acc + 2 * ldc + 8, a21);
    _mm256_storeu_ps(acc + 3 * ldc, a30);
    _mm256_storeu_ps(acc + 3 * ldc + 8, a31);
}

__attribute__((target("avx2,fma")))
static void tile_avx2(const rg_tile * t, float acc[QB][QV]) {
    quarter_avx2(t->V, t->ldv, t->B, t->ldb, t->sb, t->steps, acc[0], QV);
}

/* a whole 8 x 32 tile as its four quarters, written straight into acc (the rank-16 products of
 * LoRA have 16 steps a tile: a call, a dispatch and a copy per quarter were a third of their time) */
__attribute__((target("avx2,fma")))
static void tile_avx2_full(const rg_tile * t, float acc[BW][VW]) {
    for (int bi = 0; bi < BW; bi += QB) {
        for (int vj = 0; vj < VW; vj += QV) {
            quarter_avx2(t->V + vj, t->ldv, t->B + (size_t) bi * t->sb, t->ldb, t->sb, t->steps, &acc[bi][vj], VW);
        }
    }
}

/* a whole tile: 32 vector values (masked past nv) by 8 broadcast rows (rows past nb read row 0
 * again and are dropped by the caller), each output one FMA chain over the steps */
__attribute__((target("avx512f")))
static void tile_avx512(const rg_tile * t, int nv, int nb, float acc[BW][VW]) {
    const __mmask16 m0 = rg_lanes16(nv), m1 = rg_lanes16(nv - 16);
    size_t off[BW];
    for (int i = 0; i < BW; i++) off[i] = (size_t) (i < nb ? i : 0) * t->sb;
#define RG_Z(i) __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = _mm512_setzero_ps();
    RG_Z(0) RG_Z(1) RG_Z(2) RG_Z(3) RG_Z(4) RG_Z(5) RG_Z(6) RG_Z(7)
    for (int64_t s = 0; s < t->steps; s++) {
        const float * v = t->V + (size_t) s * t->ldv;
        const float * b = t->B + (size_t) s * t->ldb;
        /* the vector side is one short run per step, a column stride apart: past a page the
         * hardware prefetcher loses it, and the loads waited on L3 for most of the kernel's time */
        _mm_prefetch((const char *) (v + RG_PF * t->ldv), _MM_HINT_T0);
        _mm_prefetch((const char *) (v + RG_PF * t->ldv + 16), _MM_HINT_T0);
        const __m512 v0 = _mm512_maskz_loadu_ps(m0, v), v1 = _mm512_maskz_loadu_ps(m1, v + 16);
#define RG_F(i) do {                                              \
            const __m512 x = _mm512_set1_ps(b[off[i]]);            \
            a##i##0 = _mm512_fmadd_ps(x, v0, a##i##0);            \
            a##i##1 = _mm512_fmadd_ps(x, v1, a##i##1);            \
        } while (0)
        RG_F(0); RG_F(1); RG_F(2); RG_F(3); RG_F(4); RG_F(5); RG_F(6); RG_F(7);
#undef RG_F
    }
#define RG_S(i) _mm512_storeu_ps(acc[i], a##i##0); _mm512_storeu_ps(acc[i] + 16, a##i##1);
    RG_S(0) RG_S(1) RG_S(2) RG_S(3) RG_S(4) RG_S(5) RG_S(6) RG_S(7)
#undef RG_S
#undef RG_Z
}
#endif

/* a quarter tile through the fastest kernel this CPU has, or one cut by the edge of the result
 * through a plain loop */
static void quarter(const rg_tile * t, int nv, int nb, float acc[QB][QV]) {
    if (nv == QV && nb == QB) {
#ifdef RG_HAVE_AVX2_PATH
        if (have_avx2_fma()) {
            tile_avx2(t, acc);
            return;
        }
#endif
        tile_portable(t, acc);
        return;
    }
    memset(acc, 0, sizeof(float) * QB * QV);
    for (int64_t s = 0; s < t->steps; s++) {
        const float * v = t->V + (size_t) s * t->ldv;
        const float * b = t->B + (size_t) s * t->ldb;
        for (int i = 0; i < nb; i++) {
            for (int j = 0; j < nv; j++) acc[i][j] += b[i * t->sb] * v[j];
        }
    }
}

/* the nv x nb corner of a tile into acc */
static void tile(const rg_tile * t, int nv, int nb, float acc[BW][VW]) {
#ifdef RG_HAVE_AVX2_PATH
    static int have512 = -1;
    if (have512 < 0) {
        __builtin_cpu_init();
        have512 = __builtin_cpu_supports("avx512f");
    }
    if (have512) {
        tile_avx512(t, nv, nb, acc);
        return;
    }
    if (nv == VW && nb == BW && have_avx2_fma()) {
        tile_avx2_full(t, acc);
        return;
    }
#endif
    float q[QB][QV];
    for (int bi = 0; bi < nb; bi += QB) {
        for (int vj = 0; vj < nv; vj += QV) {
            rg_tile tq = *t;
            tq.V += vj;
            tq.B += (size_t) bi * t->sb;
            const int cb = nb - bi < QB ? nb - bi : QB, cv = nv - vj < QV ? nv - vj : QV;
            quarter(&tq, cv, cb, q);
            for (int i = 0; i < cb; i++) memcpy(acc[bi + i] + vj, q[i], sizeof(float) * (size_t) cv);
        }
    }
}

void rg_tile_product(const float * V, size_t ldv, const float * B, size_t ldb, size_t sb, int64_t steps, int nv, int nb,
                     float acc[BW][VW]) {
    const rg_tile t = { .V = V, .ldv = ldv, .B = B, .ldb = ldb, .sb = sb, .steps = steps };
    tile(&t, nv, nb, acc);
}

/* ---- sum of outer products ------------------------------------------------------------------ */
/* dst [n0, n1, H] = sum_t p[:, t, h'] q[:, t, h]^T for p = src[0] [n0, T, Hp], q = src[1] [n1, T, H],
 * h' = h / (H / Hp) (grouped-query attention shares a key head between H / Hp query heads) */
static void outer_sum(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * p = dst->src[0], * q = dst->src[1];
    const int64_t n0 = p->ne[0], n1 = q->ne[0], H = q->ne[2], rep = H / p->ne[2];
    const bool p_vec = n0 >= n1;                     /* the wider operand is the vector side */
    const struct ggml_tensor * vt = p_vec ? p : q, * bt = p_vec ? q : p;
    const int64_t nv = vt->ne[0], nbr = bt->ne[0];
    const int64_t tv = (nv + VW - 1) / VW, tb = (nbr + BW - 1) / BW, per_head = tv * tb;
    const size_t ld_out = dst->nb[1] / sizeof(float);
    float acc[BW][VW];
    /* v-major order, each thread a contiguous run: a thread's consecutive tiles share the vector
     * block (one run of the wide operand per token, 32 KiB over 256 tokens), so the second and later
     * reads of it hit L1. Dealt round robin, the two tiles of LoRA's rank 16 went to both threads and
     * each read the block from memory, which is where this op's time went. */
    const int64_t n_tiles = per_head * H;
    for (int64_t k = n_tiles * ith / nth; k < n_tiles * (ith + 1) / nth; k++) {
        const int64_t h = k / per_head, kk = k % per_head;
        const int64_t v0 = (kk / tb) * VW, b0 = (kk % tb) * BW;
        const int cv = (int) (nv - v0 < VW ? nv - v0 : VW), cb = (int) (nbr - b0 < BW ? nbr - b0 : BW);
        const char * pv = (const char *) p->data + (h / rep) * p->nb[2], * qv = (const char *) q->data + h * q->nb[2];
        const rg_tile t = {
            .V = (const float *) (p_vec ? pv : qv) + v0, .ldv = vt->nb[1] / sizeof(float),
            .B = (const float *) (p_vec ? qv : pv) + b0, .ldb = bt->nb[1] / sizeof(float), .sb = 1,
            .steps = p->ne[1],
        };
        tile(&t, cv, cb, acc);
        float * out = (float *) ((char *) dst->data + h * dst->nb[2]);
        for (int i = 0; i < cb; i++) {
            for (int j = 0; j < cv; j++) {
                const int64_t i0 = p_vec ? v0 + j : b0 + i, i1 = p_vec ? b0 + i : v0 + j;
                out[i0 + i1 * (int64_t) ld_out] = acc[i][j];
            }
        }
    }
}

bool rg_outer_sum_fits(const struct ggml_tensor * p, const struct ggml_tensor * q) {
    return p->type == GGML_TYPE_F32 && q->type == GGML_TYPE_F32 && p->nb[0] == sizeof(float) &&
           q->nb[0] == sizeof(float) && p->ne[1] == q->ne[1] && p->ne[3] == 1 && q->ne[3] == 1 &&
           q->ne[2] % p->ne[2] == 0 && p->nb[1] % sizeof(float) == 0 && q->nb[1] % sizeof(float) == 0;
}

struct ggml_tensor * rg_outer_sum(struct ggml_context * ctx, struct ggml_tensor * p, struct ggml_tensor * q) {
    struct ggml_tensor * args[2] = { p, q };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, p->ne[0], q->ne[0], q->ne[2], 1, args, 2, outer_sum, GGML_N_TASKS_MAX, NULL);
}

/* ---- products over a short inner dimension ------------------------------------------------ */
/* dst [n, T, H] = v [n, r, h'] z [r, T, h]: dst[:, t, h] = sum_j z[j, t, h] v[:, j, h'], h' = h / (H / Hv) */
static void rank_expand(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * v = dst->src[0], * z = dst->src[1];
    const int64_t n = v->ne[0], T = z->ne[1], H = z->ne[2], rep = H / v->ne[2];
    const int64_t tv = (n + VW - 1) / VW, tb = (T + BW - 1) / BW, per_head = tv * tb;
    const size_t ld_out = dst->nb[1] / sizeof(float), ldz = z->nb[1] / sizeof(float);
    float acc[BW][VW];
    for (int64_t k = ith; k < per_head * H; k += nth) {
        const int64_t h = k / per_head, kk = k % per_head;
        const int64_t v0 = (kk / tb) * VW, t0 = (kk % tb) * BW;
        const int cv = (int) (n - v0 < VW ? n - v0 : VW), cb = (int) (T - t0 < BW ? T - t0 : BW);
        const rg_tile t = {
            .V = (const float *) ((const char *) v->data + (h / rep) * v->nb[2]) + v0, .ldv = v->nb[1] / sizeof(float),
            .B = (const float *) ((const char *) z->data + h * z->nb[2]) + (size_t) t0 * ldz, .ldb = 1, .sb = ldz,
            .steps = v->ne[1],
        };
        tile(&t, cv, cb, acc);
        float * out = (float *) ((char *) dst->data + h * dst->nb[2]);
        for (int i = 0; i < cb; i++) memcpy(out + (size_t) (t0 + i) * ld_out + v0, acc[i], sizeof(float) * (size_t) cv);
    }
}

bool rg_rank_expand_fits(const struct ggml_tensor * v, const struct ggml_tensor * z) {
    return v->type == GGML_TYPE_F32 && z->type == GGML_TYPE_F32 && v->nb[0] == sizeof(float) &&
           z->nb[0] == sizeof(float) && v->ne[1] == z->ne[0] && v->ne[3] == 1 && z->ne[3] == 1 &&
           z->ne[2] % v->ne[2] == 0 && v->nb[1] % sizeof(float) == 0 && z->nb[1] % sizeof(float) == 0;
}

struct ggml_tensor * rg_rank_expand(struct ggml_context * ctx, struct ggml_tensor * v, struct ggml_tensor * z) {
    struct ggml_tensor * args[2] = { v, z };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, v->ne[0], z->ne[1], z->ne[2], 1, args, 2, rank_expand, GGML_N_TASKS_MAX, NULL);
}
