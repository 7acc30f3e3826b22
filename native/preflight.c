/*
 * preflight.c - the slow paths of a built training graph: nodes the device runs, but through a
 * route known to cost more than the CPU build's (the CPU-only kernels of convert.c and outer.c
 * are not available there, or a mode asks for F32), each with the reason. rg_engine_preflight
 * (engine.c) builds the graph and calls this after counting the ops that fall back.
 */
#include "engine_impl.h"

#include <string.h>

enum { SLOW_DEQUANT_F32, SLOW_OUT_PROD_QUANT, SLOW_HEAD_F32, SLOW_KINDS };

static const char * const k_what[SLOW_KINDS] = {
    "base weight -> F32 transposed copy",
    "OUT_PROD on quantized rows",
    "LM head backward in F32",
};

static const char * const k_why[SLOW_KINDS] = {
    "each quantized base weight the gradient passes through is dequantized to F32 (transposed for "
    "the backward) every micro-batch: twice the bytes and about half the matmul speed of the CPU "
    "build's F16 route, whose kernel runs only on the CPU",
    "ggml's generic outer-product kernel reads quantized rows; the rewrite to a matmul did not apply "
    "to these nodes",
    "the LM head's gradient casts each 8192-row slice of the output matrix to F32 and transposes it, "
    "every micro-batch (the CPU build dequantizes to F16 with its own kernel)",
};

static bool quantized(const struct ggml_tensor * t) {
    return t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_BF16;
}

/* the cast nodes `ggml_cast(w, F32)` of a quantized base weight (its view or itself) */
static bool is_weight_dequant(const rg_model * m, const struct ggml_tensor * node) {
    if (node->op != GGML_OP_CPY || node->type != GGML_TYPE_F32 || !node->src[0]) return false;
    struct ggml_tensor * w = rg_base_weight_of(m, node->src[0]);
    return w && quantized(w);
}

void rg_preflight_slow_paths(rg_engine * e, struct ggml_cgraph * gf) {
    int counts[SLOW_KINDS] = {0};
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        const struct ggml_tensor * node = ggml_graph_node(gf, i);
        if (is_weight_dequant(e->model, node)) counts[SLOW_DEQUANT_F32]++;
        if (node->op == GGML_OP_OUT_PROD && quantized(node->src[0])) counts[SLOW_OUT_PROD_QUANT]++;
    }
    if (e->model->backend != e->model->backend_cpu && quantized(e->model->output)) {
        counts[SLOW_HEAD_F32] = (int) ((e->model->output->ne[1] + 8191) / 8192);
    }
    e->slow_n = 0;
    for (int k = 0; k < SLOW_KINDS; k++) {
        if (!counts[k]) continue;
        e->slow_kind[e->slow_n] = k;
        e->slow_count[e->slow_n++] = counts[k];
    }
}

int rg_engine_slow_path_count(const rg_engine * e) { return e->slow_n; }

rg_status rg_engine_slow_path_get(const rg_engine * e, int index, const char ** what, int * count,
                                  const char ** reason) {
    if (index < 0 || index >= e->slow_n) {
        return rg_fail(RG_ERR_ARG, "slow-path entry %d out of range (%d entries)", index, e->slow_n);
    }
    if (what) *what = k_what[e->slow_kind[index]];
    if (count) *count = e->slow_count[index];
    if (reason) *reason = k_why[e->slow_kind[index]];
    return RG_OK;
}
