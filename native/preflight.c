/*
 * preflight.c - what a training graph would meet on the model's device, before any run: the ops
 * the device cannot run (they fall back to the CPU), counted per op kind, and the slow paths, nodes
 * the device runs but through a route known to cost more than the CPU build's (the CPU-only kernels
 * of convert.c and outer.c are not available there, or a mode asks for F32), each with the reason.
 * Both are kept in the engine and read back an entry at a time.
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

static void slow_paths(rg_engine * e, struct ggml_cgraph * gf) {
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

rg_status rg_engine_preflight(rg_engine * e, rg_lora * lora, int32_t n_tokens, int * n_unsupported) {
    if (n_unsupported) *n_unsupported = 0;
    e->pre_n = 0;
    e->slow_n = 0;
    if (n_tokens <= 0) return rg_fail(RG_ERR_ARG, "preflight needs a positive token count");
    rg_built o;
    rg_status st = rg_engine_build(e, lora, n_tokens, lora != NULL ? RG_BUILD_TRAIN : RG_BUILD_FORWARD, false, false, &o);
    if (st) return st;
    int counts[RG_OP_KEYS] = {0};
    const char * names[RG_OP_KEYS] = {0};
    int total = 0;
    for (int i = 0; i < ggml_graph_n_nodes(o.gf); i++) {
        struct ggml_tensor * node = ggml_graph_node(o.gf, i);
        if (ggml_backend_dev_supports_op(e->model->dev, node)) continue;
        const int key = rg_op_key(node);
        counts[key]++;
        names[key] = ggml_op_desc(node);
        total++;
    }
    for (int k = 0; k < RG_OP_KEYS; k++) {
        if (!counts[k]) continue;
        e->pre_count[e->pre_n] = counts[k];
        e->pre_name[e->pre_n] = names[k];
        e->pre_n++;
    }
    if (n_unsupported) *n_unsupported = total;
    slow_paths(e, o.gf);
    ggml_free(o.ctx);
    return RG_OK;
}

int rg_engine_preflight_count(const rg_engine * e) { return e->pre_n; }

rg_status rg_engine_preflight_get(const rg_engine * e, int index, const char ** op, int * count) {
    if (index < 0 || index >= e->pre_n) {
        return rg_fail(RG_ERR_ARG, "preflight entry %d out of range (%d entries)", index, e->pre_n);
    }
    if (op) *op = e->pre_name[index];
    if (count) *count = e->pre_count[index];
    return RG_OK;
}
