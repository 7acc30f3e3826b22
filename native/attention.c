/*
 * attention.c - the training graph's attention a tile at a time, without the [tokens x tokens]
 * scores of a head ever being stored (memory-efficient attention).
 *
 * graph.c builds attention as ggml ops (Q K^T, softmax, times V) so that ggml's autodiff writes its
 * backward. Kept as they are, those ops keep every layer's [T, T] scores and softmax per head alive
 * for the backward: 6.6 GB on an agentic GRPO step of a 135M model, 7.2 GB for one 2,048-token
 * SFT sequence. After the backward is built, rewrite.c turns the product that makes a layer's
 * output and the three products that make the gradients of Q, K and V into the four ops below;
 * the score nodes lose their users and are never allocated. Each op walks the scores in tiles of
 * RG_BQ queries by RG_BK keys:
 *  - forward: S = scale Q K^T a tile at a time, an online softmax (running row maximum and sum),
 *    O = P V accumulated; it also saves each row's log-sum-exp L (a [T, heads] side tensor);
 *  - dQ:  P = exp(S - L) recomputed, dP = dO V^T, dS = P (dP - D) with D = rowsum(dO * O),
 *    dQ = scale dS K, per (head, query tile);
 *  - dK and dV in one pass: the same P and dS, dK = scale dS^T Q, dV = P^T dO, per (key head, key
 *    tile), over the query heads that share the key head.
 * Visibility (same sequence or its shared prefix, causal by position, the sliding window) is read
 * from the batch's ids and positions (an I32 [T, 3] input), not from a [T, T] mask; a tile with no
 * visible pair is skipped, so causal attention does about half the work of the dense products.
 * Every product runs through outer.c's register-tiled kernel (rg_tile_product). Memory beyond the
 * inputs and outputs: a few tiles on each thread's stack and L, [T, heads] floats a layer.
 * CPU only: another device keeps ggml's ops (graph.c's composite).
 */
#include "rg_internal.h"
#include "kernels.h"

#include <math.h>
#include <string.h>

#define RG_BQ 32            /* queries a tile */
#define RG_BK 64            /* keys a tile */
#define RG_HD_MAX 256       /* the largest head size the tiles hold on the stack */

/* ---- small dense products over outer.c's kernel ------------------------------------------- */
/* c[i * ldc + j] (+)= sum_s a[i * sa + s * la] v[s * lv + j] for i < m, j < n, s < steps: `a` is read
 * with any strides (the kernel's broadcast side), `v` must be contiguous along j */
static void mm(float * c, size_t ldc, int m, int n, const float * a, size_t sa, size_t la, const float * v, size_t lv,
               int64_t steps, bool add) {
    float acc[8][32];
    for (int i0 = 0; i0 < m; i0 += 8) {
        const int nb = m - i0 < 8 ? m - i0 : 8;
        for (int j0 = 0; j0 < n; j0 += 32) {
            const int nv = n - j0 < 32 ? n - j0 : 32;
            rg_tile_product(v + j0, lv, a + (size_t) i0 * sa, la, sa, steps, nv, nb, acc);
            for (int i = 0; i < nb; i++) {
                float * row = c + (size_t) (i0 + i) * ldc + j0;
                if (add) {
                    rg_attn_add_row(row, acc[i], nv);
                } else {
                    memcpy(row, acc[i], sizeof(float) * (size_t) nv);
                }
            }
        }
    }
}

/* ---- visibility ----------------------------------------------------------------------------- */
typedef struct {
    const int32_t * seq, * prefix, * pos;   /* [T] each: sequence id, shared-prefix id, position */
    int32_t         n_swa;                  /* window in positions, 0: none */
} rg_vis;

static rg_vis vis_of(const struct ggml_tensor * t, const rg_attn_params * p) {
    const int32_t * d = (const int32_t *) t->data;
    const int64_t T = t->ne[0];
    return (rg_vis) { d, d + T, d + 2 * T, p->n_swa };
}

static bool sees(const rg_vis * v, int64_t i, int64_t j) {
    return rg_attn_sees(v->seq[i], v->prefix[i], v->pos[i], rg_attn_window(v->n_swa), v->seq[j], v->pos[j]);
}

/* what a tile of queries i0.. (m) by keys j0.. (n) sees: nothing, everything, or some pairs (then
 * each row is masked from the ids and positions by rg_attn_scale_row) */
enum { RG_SEE_NONE, RG_SEE_ALL, RG_SEE_SOME };

/* Decided from the tile's edges (O(m + n)) when queries and keys each lie in one sequence: most
 * tiles of a batch lie wholly inside one sequence's causal triangle or wholly outside it. Only a
 * tile across a sequence boundary is checked pair by pair. */
static int visible(const rg_vis * v, int64_t i0, int m, int64_t j0, int n) {
    const int32_t s = v->seq[i0], pf = v->prefix[i0];
    bool one_q = true, one_k = true;
    int32_t qmin = v->pos[i0], qmax = qmin, kmin = v->pos[j0], kmax = kmin;
    for (int i = 1; i < m; i++) {
        one_q &= v->seq[i0 + i] == s && v->prefix[i0 + i] == pf;
        const int32_t q = v->pos[i0 + i];
        qmin = q < qmin ? q : qmin;
        qmax = q > qmax ? q : qmax;
    }
    const int32_t sk = v->seq[j0];
    for (int j = 1; j < n; j++) {
        one_k &= v->seq[j0 + j] == sk;
        const int32_t k = v->pos[j0 + j];
        kmin = k < kmin ? k : kmin;
        kmax = k > kmax ? k : kmax;
    }
    if (one_q && one_k) {
        if ((sk != s && sk != pf) || kmin > qmax || (v->n_swa > 0 && qmin - kmax >= v->n_swa)) return RG_SEE_NONE;
        if (kmax <= qmin && (v->n_swa <= 0 || qmax - kmin < v->n_swa)) return RG_SEE_ALL;
        return RG_SEE_SOME;
    }
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) if (sees(v, i0 + i, j0 + j)) return RG_SEE_SOME;
    }
    return RG_SEE_NONE;
}

void rg_attn_fill_vis(const rg_batch * batch, int32_t * out) {
    const int T = batch->n_tokens;
    memcpy(out, batch->seq_ids, sizeof(int32_t) * (size_t) T);
    memcpy(out + T, batch->prefix_ids ? batch->prefix_ids : batch->seq_ids, sizeof(int32_t) * (size_t) T);
    memcpy(out + 2 * T, batch->positions, sizeof(int32_t) * (size_t) T);
}

/* ---- the operands of one head ------------------------------------------------------------- */
/* element (d, t, h) of a [hd, T, heads] tensor in its own strides, in floats */
typedef struct {
    const float * p;
    size_t        ld;   /* between tokens */
    size_t        lh;   /* between heads */
} rg_rows;

static rg_rows rows_of(const struct ggml_tensor * t) {
    return (rg_rows) { (const float *) t->data, t->nb[1] / sizeof(float), t->nb[2] / sizeof(float) };
}

static const float * row(const rg_rows * r, int64_t h, int64_t t) {
    return r->p + (size_t) h * r->lh + (size_t) t * r->ld;
}

/* sources shared by the ops (rg_attn_*): q, k, v as [hd, T, heads] views, k and v transposed as
 * [T + pad, hd, kv heads] (rows ldt apart), the visibility input, the log-sum-exp side tensor
 * [T, heads]; the backward adds dO (the output's gradient) and O */
enum { A_Q, A_K, A_V, A_KT, A_VT, A_VIS, A_LSE, A_DO, A_O, A_N };

typedef struct {
    rg_rows         q, k, v, dO, O;
    const float   * kt, * vt;
    size_t          ldt;
    float         * lse;        /* [T, heads] */
    rg_vis          vis;
    float           scale;
    int64_t         hd, T, H, Hkv, rep;
} rg_attn_args;

static rg_attn_args args_of(const struct ggml_tensor * dst, const rg_attn_params * p, bool backward) {
    struct ggml_tensor * const * s = dst->src;
    rg_attn_args a = {
        .q = rows_of(s[A_Q]), .k = rows_of(s[A_K]), .v = rows_of(s[A_V]),
        .kt = (const float *) s[A_KT]->data, .vt = (const float *) s[A_VT]->data, .ldt = (size_t) s[A_KT]->ne[0],
        .lse = (float *) s[A_LSE]->data, .vis = vis_of(s[A_VIS], p), .scale = p->scale,
        .hd = s[A_Q]->ne[0], .T = s[A_Q]->ne[1], .H = s[A_Q]->ne[2], .Hkv = s[A_K]->ne[2],
    };
    a.rep = a.H / a.Hkv;
    if (backward) {
        a.dO = rows_of(s[A_DO]);
        a.O = rows_of(s[A_O]);
    }
    return a;
}

/* S = scale q k^T for queries i0.. (m) of head h and keys j0.. (n); pairs not seen -inf (`see`:
 * visible()'s answer) */
static void scores(const rg_attn_args * a, int64_t h, int64_t i0, int m, int64_t j0, int n, int see,
                   float S[RG_BQ][RG_BK]) {
    const int64_t g = h / a->rep;
    mm(&S[0][0], RG_BK, m, n, row(&a->q, h, i0), a->q.ld, 1, a->kt + (size_t) g * a->hd * a->ldt + j0, a->ldt, a->hd,
       false);
    for (int i = 0; i < m; i++) {
        if (see == RG_SEE_ALL) {
            rg_attn_scale_row(S[i], n, a->scale, NULL);
        } else {
            const int64_t qi = i0 + i;
            const rg_attn_row_vis rv = { a->vis.seq[qi], a->vis.prefix[qi], a->vis.pos[qi], a->vis.n_swa,
                                         a->vis.seq + j0, a->vis.pos + j0 };
            rg_attn_scale_row(S[i], n, a->scale, &rv);
        }
    }
}

/* P = exp(S - L) (the softmax, from the saved row statistics) and dS = P (dO v^T - D), with
 * D = rowsum(dO * O) given per row */
static void probs(const rg_attn_args * a, int64_t h, int64_t i0, int m, int64_t j0, int n, const float * D,
                  float S[RG_BQ][RG_BK], float dS[RG_BQ][RG_BK]) {
    for (int i = 0; i < m; i++) rg_attn_exp_row(S[i], n, a->lse[(size_t) h * a->T + i0 + i]);
    const int64_t g = h / a->rep;
    mm(&dS[0][0], RG_BK, m, n, row(&a->dO, h, i0), a->dO.ld, 1, a->vt + (size_t) g * a->hd * a->ldt + j0, a->ldt,
       a->hd, false);
    for (int i = 0; i < m; i++) rg_attn_softmax_grad_row(dS[i], S[i], D[i], n);
}

static int min_int(int64_t a, int b) {
    return a < b ? (int) a : b;
}

/* ---- forward ---------------------------------------------------------------------------- */
static void attn_forward(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const rg_attn_args a = args_of(dst, userdata, false);
    const int64_t nqb = (a.T + RG_BQ - 1) / RG_BQ;
    const size_t ld_out = dst->nb[1] / sizeof(float), lh_out = dst->nb[2] / sizeof(float);
    float S[RG_BQ][RG_BK], O[RG_BQ][RG_HD_MAX], mx[RG_BQ], l[RG_BQ];
    /* units dealt round robin, query tile major: the later tiles of a causal mask cost more */
    for (int64_t u = ith; u < nqb * a.H; u += nth) {
        const int64_t h = u % a.H, i0 = (u / a.H) * RG_BQ, g = h / a.rep;
        const int m = min_int(a.T - i0, RG_BQ);
        for (int i = 0; i < m; i++) {
            mx[i] = -INFINITY;
            l[i] = 0.0f;
            memset(O[i], 0, sizeof(float) * (size_t) a.hd);
        }
        for (int64_t j0 = 0; j0 < a.T; j0 += RG_BK) {
            const int n = min_int(a.T - j0, RG_BK);
            const int see = visible(&a.vis, i0, m, j0, n);
            if (see == RG_SEE_NONE) continue;
            scores(&a, h, i0, m, j0, n, see, S);
            for (int i = 0; i < m; i++) {
                const float row_top = rg_attn_row_max(S[i], n), top = row_top > mx[i] ? row_top : mx[i];
                if (top == -INFINITY) {         /* nothing visible in this row of the tile */
                    memset(S[i], 0, sizeof(float) * (size_t) n);
                    continue;
                }
                float shift = mx[i];            /* the earlier tiles' terms, rescaled to the new maximum */
                rg_attn_exp_row(&shift, 1, top);
                rg_attn_exp_row(S[i], n, top);
                l[i] = l[i] * shift + rg_attn_row_sum(S[i], n);
                if (shift != 1.0f) rg_attn_scale_row(O[i], (int) a.hd, shift, NULL);
                mx[i] = top;
            }
            mm(&O[0][0], RG_HD_MAX, m, (int) a.hd, &S[0][0], RG_BK, 1, a.v.p + (size_t) g * a.v.lh + (size_t) j0 * a.v.ld,
               a.v.ld, n, true);
        }
        for (int i = 0; i < m; i++) {
            float * out = (float *) dst->data + (size_t) h * lh_out + (size_t) (i0 + i) * ld_out;
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            for (int64_t c = 0; c < a.hd; c++) out[c] = O[i][c] * inv;
            /* a row that sees nothing (none in practice: a row sees itself) gets probabilities 0 */
            a.lse[(size_t) h * a.T + i0 + i] = l[i] > 0.0f ? mx[i] + logf(l[i]) : INFINITY;
        }
    }
}

/* ---- the backward: dQ, dK and dV in one pass ----------------------------------------------- */
/* Per key head and key tile, over the query heads that share the key head and every query tile
 * that sees the key tile: P and dS once, then dV += P^T dO, dK += dS^T q and dQ += dS k. A query
 * tile's dQ gets terms from every key tile, which other threads hold, so each thread adds into a
 * [hd, T, heads] partial of its own and attn_dq sums them (per thread: hd T heads floats; the
 * split into a dQ pass and a dK/dV pass computed S, P and dO v^T twice).
 * dst: [hd, T, 2 kv heads + slots heads]: dK ([hd, T, kv heads]), dV as [T, hd, kv heads] (vt's
 * layout), then the partials, unscaled; a thread past the slots (more threads than the build
 * planned for) leaves its units to the first `slots` threads. */
static void attn_grad(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const rg_attn_params * p = userdata;
    const rg_attn_args a = args_of(dst, p, true);
    const int nt = nth < p->slots ? nth : p->slots;
    if (ith >= nt) return;
    const int64_t nkb = (a.T + RG_BK - 1) / RG_BK, nqb = (a.T + RG_BQ - 1) / RG_BQ;
    const size_t hd = (size_t) a.hd, n_kv = hd * (size_t) a.T * (size_t) a.Hkv;
    float * out_k = (float *) dst->data, * out_v = out_k + n_kv;
    float * dq = out_v + n_kv + (size_t) ith * hd * (size_t) a.T * (size_t) a.H;
    memset(dq, 0, sizeof(float) * hd * (size_t) a.T * (size_t) a.H);
    float S[RG_BQ][RG_BK], dS[RG_BQ][RG_BK], dK[RG_BK][RG_HD_MAX], dV[RG_BK][RG_HD_MAX], D[RG_BQ];
    for (int64_t u = ith; u < nkb * a.Hkv; u += nt) {
        const int64_t g = u % a.Hkv, j0 = (u / a.Hkv) * RG_BK;
        const int n = min_int(a.T - j0, RG_BK);
        for (int j = 0; j < n; j++) {
            memset(dK[j], 0, sizeof(float) * hd);
            memset(dV[j], 0, sizeof(float) * hd);
        }
        for (int64_t qb = 0; qb < nqb; qb++) {
            const int64_t i0 = qb * RG_BQ;
            const int m = min_int(a.T - i0, RG_BQ);
            const int see = visible(&a.vis, i0, m, j0, n);
            if (see == RG_SEE_NONE) continue;
            for (int64_t h = g * a.rep; h < (g + 1) * a.rep; h++) {
                for (int i = 0; i < m; i++) D[i] = rg_attn_row_dot(row(&a.O, h, i0 + i), row(&a.dO, h, i0 + i), (int) a.hd);
                scores(&a, h, i0, m, j0, n, see, S);
                probs(&a, h, i0, m, j0, n, D, S, dS);
                /* dV += P^T dO, dK += dS^T q: the tiles read down their columns */
                mm(&dV[0][0], RG_HD_MAX, n, (int) a.hd, &S[0][0], 1, RG_BK, row(&a.dO, h, i0), a.dO.ld, m, true);
                mm(&dK[0][0], RG_HD_MAX, n, (int) a.hd, &dS[0][0], 1, RG_BK, row(&a.q, h, i0), a.q.ld, m, true);
                mm(dq + ((size_t) h * (size_t) a.T + (size_t) i0) * hd, hd, m, (int) a.hd, &dS[0][0], RG_BK, 1,
                   row(&a.k, g, j0), a.k.ld, n, true);
            }
        }
        for (int j = 0; j < n; j++) {
            float * k = out_k + ((size_t) g * (size_t) a.T + (size_t) (j0 + j)) * hd;
            for (size_t c = 0; c < hd; c++) {
                k[c] = dK[j][c] * a.scale;
                out_v[((size_t) g * hd + c) * (size_t) a.T + (size_t) (j0 + j)] = dV[j][c];
            }
        }
    }
}

/* dQ = scale times the sum of attn_grad's partials (src[0]), [hd, T, heads], split by element */
static void attn_dq(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const rg_attn_params * p = userdata;
    const struct ggml_tensor * grad = dst->src[0];
    const int64_t n = ggml_nelements(dst), per = (n + nth - 1) / nth, lo = per * ith, hi = lo + per < n ? lo + per : n;
    if (lo >= hi) return;
    const int slots = nth < p->slots ? nth : p->slots;
    /* the partials follow dK and dV: grad is [hd, T, 2 kv heads + slots heads] */
    const int64_t n_kv2 = ggml_nelements(grad) - (int64_t) p->slots * n;
    const float * part = (const float *) grad->data + n_kv2;
    float * out = (float *) dst->data;
    for (int64_t i = lo; i < hi; i++) {
        float sum = part[i];
        for (int t = 1; t < slots; t++) sum += part[(size_t) t * (size_t) n + (size_t) i];
        out[i] = sum * p->scale;
    }
}

/* ---- k and v transposed for the score products ------------------------------------------- */
/* dst [T + pad, hd, kv heads] from src [hd, kv heads, T] (k after RoPE, or v; any strides): row
 * (d, g) holds dimension d of key head g for every token, the pad zero. Rows are padded to an odd
 * number of 64-byte lines: the score products read a tile's keys down 64 rows, and rows a power of
 * two of bytes apart (T = 256, 1,024, ...) all fell in a few sets of the L1 cache, whose misses
 * held up the kernel. One pass (ggml's permute-copy and pad took two, at a tenth of memory speed). */
static void transpose_pad(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * src = dst->src[0];
    const int64_t hd = src->ne[0], Hkv = src->ne[1], T = src->ne[2], ld = dst->ne[0], rows = hd * Hkv;
    const char * base = (const char *) src->data;
    for (int64_t r = ith; r < rows; r += nth) {
        const int64_t d = r % hd, g = r / hd;
        float * out = (float *) dst->data + (size_t) (g * hd + d) * (size_t) ld;
        const char * in = base + (size_t) d * src->nb[0] + (size_t) g * src->nb[1];
        for (int64_t t = 0; t < T; t++) out[t] = *(const float *) (in + (size_t) t * src->nb[2]);
        memset(out + T, 0, sizeof(float) * (size_t) (ld - T));
    }
}

/* ---- the rewrite -------------------------------------------------------------------------- */
static bool same_shape(const struct ggml_tensor * t, int64_t n0, int64_t n1, int64_t n2) {
    return t->ne[0] == n0 && t->ne[1] == n1 && t->ne[2] == n2 && t->ne[3] == 1 && ggml_is_contiguous(t) &&
           t->type == GGML_TYPE_F32;
}

static void become(struct ggml_tensor * node, const struct ggml_tensor * op) {
    node->op = op->op;
    memcpy(node->op_params, op->op_params, sizeof(node->op_params));
    for (int j = 0; j < GGML_MAX_SRC; j++) node->src[j] = op->src[j];
}

bool rg_attn_tile(rg_graph_build * b, struct ggml_cgraph * gf, int il) {
    rg_attn_nodes * A = &b->attn[il];
    if (!A->kqv || !b->inp_vis) return false;
    struct ggml_context * ctx = b->ctx;
    const int64_t hd = A->q->ne[0], T = A->q->ne[1], H = A->q->ne[2], Hkv = A->k->ne[2];
    if (hd > RG_HD_MAX || A->q->type != GGML_TYPE_F32 || A->k->type != GGML_TYPE_F32 || A->v->type != GGML_TYPE_F32 ||
        A->q->nb[0] != sizeof(float) || A->k->nb[0] != sizeof(float) || A->v->nb[0] != sizeof(float) ||
        !same_shape(A->kqv, hd, T, H) || H % Hkv != 0) {
        return false;
    }
    struct ggml_tensor * dO = ggml_graph_get_grad(gf, A->kqv);
    struct ggml_tensor * gq = ggml_graph_get_grad(gf, A->q);
    struct ggml_tensor * gk = ggml_graph_get_grad(gf, A->k);
    struct ggml_tensor * gv = ggml_graph_get_grad(gf, A->vt);
    if ((gq || gk || gv) && (!dO || dO->type != GGML_TYPE_F32 || dO->nb[0] != sizeof(float) || dO->ne[0] != hd ||
                             dO->ne[1] != T || dO->ne[2] != H)) {
        return false;
    }
    if ((gq && !same_shape(gq, hd, T, H)) || (gk && !same_shape(gk, hd, T, Hkv)) || (gv && !same_shape(gv, T, hd, Hkv))) {
        return false;
    }
    struct ggml_tensor * src[A_N];
    src[A_Q] = A->q;
    src[A_K] = A->k;
    src[A_V] = ggml_permute(ctx, A->v, 0, 2, 1, 3);                     /* [hd, T, kv heads] */
    /* K transposed for the forward, and K and V again for the backward: copies made where they are
     * read, so that none is kept from the forward to the backward (95 MiB at 2,048 tokens) */
    const int64_t ld = 16 * (((T + 15) / 16) | 1);      /* rows of an odd number of 64-byte lines */
    src[A_KT] = ggml_custom_4d(ctx, GGML_TYPE_F32, ld, hd, Hkv, 1, &A->k_rope, 1, transpose_pad, GGML_N_TASKS_MAX, NULL);
    src[A_VT] = src[A_KT];                              /* not read by the forward */
    src[A_VIS] = b->inp_vis;
    src[A_LSE] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, T, H);
    ggml_format_name(src[A_LSE], "attn_lse-%d", il);
    src[A_DO] = dO;
    src[A_O] = A->kqv;
    /* the op's userdata must outlive the graph: it lives in the build, beside the graph */
    const int slots = b->model->n_threads > 0 ? b->model->n_threads : 1;
    b->attn_params[il] = (rg_attn_params) { A->scale, A->n_swa, slots };
    void * ud = &b->attn_params[il];
    become(A->kqv, ggml_custom_4d(ctx, GGML_TYPE_F32, hd, T, H, 1, src, A_LSE + 1, attn_forward, GGML_N_TASKS_MAX, ud));
    if (gq || gk || gv) {
        /* dQ, dK and dV in one pass (attn_grad), each gradient node reading its part */
        src[A_KT] = ggml_custom_4d(ctx, GGML_TYPE_F32, ld, hd, Hkv, 1, &A->k_rope, 1, transpose_pad, GGML_N_TASKS_MAX,
                                   NULL);
        src[A_VT] = ggml_custom_4d(ctx, GGML_TYPE_F32, ld, hd, Hkv, 1, &A->v, 1, transpose_pad, GGML_N_TASKS_MAX, NULL);
        const int64_t n = hd * T * Hkv;
        struct ggml_tensor * grad = ggml_custom_4d(ctx, GGML_TYPE_F32, hd, T, 2 * Hkv + slots * H, 1, src, A_N, attn_grad,
                                                   GGML_N_TASKS_MAX, ud);
        ggml_format_name(grad, "attn_grad-%d", il);
        if (gk) become(gk, ggml_cont(ctx, ggml_view_3d(ctx, grad, hd, T, Hkv, hd * sizeof(float), hd * T * sizeof(float), 0)));
        if (gv) {
            become(gv, ggml_cont(ctx, ggml_view_3d(ctx, grad, T, hd, Hkv, T * sizeof(float), T * hd * sizeof(float),
                                                   (size_t) n * sizeof(float))));
        }
        if (gq) become(gq, ggml_custom_4d(ctx, GGML_TYPE_F32, hd, T, H, 1, &grad, 1, attn_dq, GGML_N_TASKS_MAX, ud));
    }
    return true;
}
