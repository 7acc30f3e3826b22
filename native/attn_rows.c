/*
 * attn_rows.c - the element-wise work of attention.c's tiles, one row of a score tile at a time:
 * scaling and masking the scores, the row's maximum and sum, exp, and the softmax gradient.
 *
 * Written as plain loops that GCC vectorises, each function built for AVX-512, AVX2 and the
 * baseline and picked at load time (the library itself targets the baseline ISA). Two flags make
 * the loops vectorisable, and neither changes what a loop computes:
 *  - no-trapping-math: the float to int conversion inside exp may not be if-converted otherwise.
 *    Before it, exp ran one value at a time and took 14% of a 2,048-token step.
 *  - associative-math, for the sums only, so that they add in vector lanes. A row's sum then rounds
 *    differently from a left-to-right loop, within the float rounding of that sum.
 * The visibility mask is computed here, vectorised, from the tile's sequence ids and positions,
 * instead of an m x n byte mask built per tile, head and pass.
 */
#include "kernels.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define RG_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), optimize("no-trapping-math")))
#define RG_SUM_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), \
                                     optimize("no-trapping-math", "associative-math", "no-signed-zeros")))
#else
#define RG_ROW_CLONES
#define RG_SUM_CLONES
#endif

/* s[j] = scale s[j] where key j is visible to the query, -inf where not (v NULL: all visible) */
RG_ROW_CLONES
void rg_attn_scale_row(float * restrict s, int n, float scale, const rg_attn_row_vis * v) {
    if (!v) {
        for (int j = 0; j < n; j++) s[j] *= scale;
        return;
    }
    const int32_t * restrict ks = v->kseq, * restrict kp = v->kpos;
    const int32_t seq = v->seq, prefix = v->prefix, pos = v->pos, swa = rg_attn_window(v->n_swa);
    for (int j = 0; j < n; j++) s[j] = rg_attn_sees(seq, prefix, pos, swa, ks[j], kp[j]) ? s[j] * scale : -INFINITY;
}

/* the largest of s[0..n), -inf for n = 0; exact in any order */
RG_SUM_CLONES
float rg_attn_row_max(const float * restrict s, int n) {
    float top = -INFINITY;
    for (int j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}

/* s[j] = exp(s[j] - shift) for s[j] - shift <= 0 or -inf (gives 0). 2^(x log2 e) split into an
 * integer power (rounded by adding and subtracting 1.5 * 2^23, which needs no SSE4.1 floor) and a
 * polynomial on [-1/2, 1/2] (relative error below 2e-7); expf called once a score was slower than
 * the tile products it follows */
RG_ROW_CLONES
void rg_attn_exp_row(float * restrict s, int n, float shift) {
    for (int j = 0; j < n; j++) {
        const float x = s[j] - shift;
        float t = x * 1.44269504088896341f;
        t = t < -126.0f ? -126.0f : t;
        const float k = (t + 12582912.0f) - 12582912.0f;
        const float f = (t - k) * 0.69314718055994531f;
        float p = 1.0f / 720.0f;
        p = p * f + 1.0f / 120.0f;
        p = p * f + 1.0f / 24.0f;
        p = p * f + 1.0f / 6.0f;
        p = p * f + 0.5f;
        p = p * f + 1.0f;
        p = p * f + 1.0f;
        const int32_t bits = ((int32_t) k + 127) << 23;
        float two_k;
        memcpy(&two_k, &bits, sizeof(two_k));
        s[j] = x < -87.0f ? 0.0f : p * two_k;
    }
}

RG_SUM_CLONES
float rg_attn_row_sum(const float * restrict s, int n) {
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += s[j];
    return sum;
}

RG_SUM_CLONES
float rg_attn_row_dot(const float * restrict a, const float * restrict b, int n) {
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += a[j] * b[j];
    return sum;
}

/* the softmax gradient of a row: ds[j] = p[j] (ds[j] - D), ds holding dO v^T on entry */
RG_ROW_CLONES
void rg_attn_softmax_grad_row(float * restrict ds, const float * restrict p, float D, int n) {
    for (int j = 0; j < n; j++) ds[j] = p[j] * (ds[j] - D);
}

/* y[j] += x[j] */
RG_ROW_CLONES
void rg_attn_add_row(float * restrict y, const float * restrict x, int n) {
    for (int j = 0; j < n; j++) y[j] += x[j];
}
