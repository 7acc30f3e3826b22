/*
 * profile.c - per-op tallies of a training graph: time, count and FLOPs by phase (forward up to
 * the hidden state, then the backward), ggml op, and what the node works on (a LoRA target's base
 * weight, the adapter, attention, other). The engine times each node from its eval callback.
 */
#include "rg_internal.h"

#include <string.h>

#define RG_PROF_CELLS (2 * RG_OP_KEYS * RG_PROF_KINDS)

int rg_op_key(const struct ggml_tensor * t) {
    return t->op == GGML_OP_UNARY ? GGML_OP_COUNT + (int) ggml_get_unary_op(t) : (int) t->op;
}

/* Profiling: which weight a node works on. A node that reads a base weight (through casts and
 * copies) is that weight's target; a product with the adapter's rank as a dimension is LoRA; a
 * product batched over heads is attention; everything else is "other". */
static int node_kind(const rg_model * m, int rank, const struct ggml_tensor * t) {
    for (int j = 0; j < 2; j++) {
        struct ggml_tensor * w = t->src[j] ? rg_base_weight_of(m, t->src[j]) : NULL;
        if (!w) continue;
        for (int il = 0; il < m->hp.n_layer; il++) {
            for (int k = 0; k < RG_N_TARGETS; k++) if (m->layers[il].w[k] == w) return k;
        }
    }
    const bool outer = t->op == GGML_OP_CUSTOM && t->src[1] != NULL;    /* outer.c's op */
    if (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_OUT_PROD && !outer) return RG_KIND_OTHER;
    const struct ggml_tensor * a = t->src[0];
    if (t->ne[0] == rank || t->ne[1] == rank || a->ne[0] == rank || a->ne[1] == rank) return RG_KIND_LORA;
    return t->ne[2] > 1 || t->ne[3] > 1 ? RG_KIND_ATTENTION : RG_KIND_OTHER;
}

static double node_flops(const struct ggml_tensor * t) {
    const double gemm = rg_gemm_flops(t);
    if (gemm > 0) return gemm;
    if (t->op == GGML_OP_MUL_MAT) return 2.0 * (double) t->src[0]->ne[0] * (double) ggml_nelements(t);
    if (t->op == GGML_OP_OUT_PROD || (t->op == GGML_OP_CUSTOM && t->src[1] != NULL)) {
        return 2.0 * (double) t->src[0]->ne[1] * (double) ggml_nelements(t);
    }
    return 0.0;
}

const char * rg_op_key_name(int key) {
    return key < GGML_OP_COUNT ? ggml_op_name((enum ggml_op) key)
                               : ggml_unary_op_name((enum ggml_unary_op) (key - GGML_OP_COUNT));
}

static const char * kind_name(int kind) {
    if (kind < RG_N_TARGETS) return rg_target_name(kind);
    return kind == RG_KIND_LORA ? "lora" : kind == RG_KIND_ATTENTION ? "attention" : "other";
}

/* the tallied (phase, op, kind) cells as flat indices, most time first; returns how many */
static int profile_order(const rg_profile * p, int * order) {
    const double * ms = &p->ms[0][0][0];
    const int64_t * cnt = &p->n[0][0][0];
    int n = 0;
    for (int c = 0; c < RG_PROF_CELLS; c++) {
        if (!cnt[c]) continue;
        int i = n++;
        while (i > 0 && ms[order[i - 1]] < ms[c]) {
            order[i] = order[i - 1];
            i--;
        }
        order[i] = c;
    }
    return n;
}

int rg_profile_count(const rg_profile * p) {
    static __thread int order[RG_PROF_CELLS];
    return profile_order(p, order);
}

rg_status rg_profile_get(const rg_profile * p, int index, rg_profile_entry * out) {
    static __thread int order[RG_PROF_CELLS];
    const int n = profile_order(p, order);
    if (index < 0 || index >= n) return rg_fail(RG_ERR_ARG, "profile entry %d out of range (%d entries)", index, n);
    const int c = order[index];
    const int ph = c / (RG_OP_KEYS * RG_PROF_KINDS), k = (c / RG_PROF_KINDS) % RG_OP_KEYS, kind = c % RG_PROF_KINDS;
    out->op = rg_op_key_name(k);
    out->kind = kind_name(kind);
    out->backward = ph;
    out->ms = p->ms[ph][k][kind];
    out->flops = p->flops[ph][k][kind];
    out->count = p->n[ph][k][kind];
    return RG_OK;
}

void rg_profile_reset(rg_profile * p) { memset(p, 0, sizeof(*p)); }

void rg_profile_add(rg_profile * p, const rg_model * m, int rank, const struct ggml_tensor * t, int backward, double ms) {
    const int k = rg_op_key(t), kind = node_kind(m, rank, t), ph = backward != 0;
    p->ms[ph][k][kind] += ms;
    p->flops[ph][k][kind] += node_flops(t);
    p->n[ph][k][kind]++;
}
