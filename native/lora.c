/*
 * lora.c - LoRA A/B tensors with their gradient accumulators and AdamW moments.
 *
 * Shapes follow llama.cpp's adapter format so export is a plain copy: for a base weight W with
 * ne = [n_in, n_out], A has ne = [n_in, rank] and B has ne = [rank, n_out]; the forward adds
 * scale * B(A x) with scale = alpha / rank. Parameters, gradients and moments live in three
 * separate buffers on the model's device so each can be zeroed in one call.
 */
#include "rg_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the one list of target names: the ABI's short names and llama.cpp's tensor names */
static const char * k_target_short[RG_N_TARGETS] = { "q", "k", "v", "o", "gate", "up", "down" };
static const char * k_target_names[RG_N_TARGETS] = {
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
};

const char * rg_target_name(int target) {
    return target >= 0 && target < RG_N_TARGETS ? k_target_short[target] : NULL;
}

rg_status rg_lora_init(rg_model * m, uint32_t target_mask, int rank, float alpha, rg_lora ** out) {
    *out = NULL;
    if (rank <= 0 || rank > 4096) return rg_fail(RG_ERR_ARG, "LoRA rank must be in 1..4096, got %d", rank);
    if (target_mask == 0 || target_mask >= (1u << RG_N_TARGETS)) {
        return rg_fail(RG_ERR_ARG, "LoRA target mask 0x%x selects no valid target", target_mask);
    }
    rg_lora * l = rg_calloc(1, sizeof(*l), "the LoRA adapter");
    if (!l) return RG_ERR_NOMEM;
    l->model = m;
    l->rank = rank;
    l->alpha = alpha;
    l->scale = alpha != 0.0f ? alpha / (float) rank : 1.0f;   /* llama.cpp's rule for alpha = 0 */
    l->target_mask = target_mask;
    memset(l->pair_index, -1, sizeof(l->pair_index));

    int n_targets = 0;
    for (int t = 0; t < RG_N_TARGETS; t++) n_targets += (target_mask >> t) & 1;
    const int n_pairs = m->hp.n_layer * n_targets;
    l->pairs = rg_calloc((size_t) n_pairs, sizeof(*l->pairs), "the LoRA pairs");
    l->names = l->pairs ? rg_calloc((size_t) n_pairs * 2, sizeof(*l->names), "the LoRA tensor names") : NULL;
    if (!l->names) {
        rg_lora_free(l);
        return RG_ERR_NOMEM;
    }

    struct ggml_init_params ip = {
        .mem_size = ggml_tensor_overhead() * ((size_t) n_pairs * 8 + 8),
        .mem_buffer = NULL,
        .no_alloc = true,
    };
    l->ctx = ggml_init(ip);
    if (!l->ctx) {
        rg_lora_free(l);
        return rg_fail(RG_ERR_NOMEM, "out of host memory for the LoRA tensor metadata");
    }

    /* three passes so that each slot family ends up in its own buffer */
    for (int slot = 0; slot < 4; slot++) {
        int p = 0;
        for (int il = 0; il < m->hp.n_layer; il++) {
            for (int t = 0; t < RG_N_TARGETS; t++) {
                if (!((target_mask >> t) & 1)) continue;
                const struct ggml_tensor * w = m->layers[il].w[t];
                rg_lora_pair * pr = &l->pairs[p];
                pr->layer = il;
                pr->target = t;
                l->pair_index[il][t] = p;
                pr->a.t[slot] = ggml_new_tensor_2d(l->ctx, GGML_TYPE_F32, w->ne[0], rank);
                pr->b.t[slot] = ggml_new_tensor_2d(l->ctx, GGML_TYPE_F32, rank, w->ne[1]);
                static const char * slot_suffix[4] = { "", " (grad)", " (adam m)", " (adam v)" };
                snprintf(l->names[2 * p], sizeof(l->names[0]), "blk.%d.%s.weight.lora_a", il, k_target_names[t]);
                snprintf(l->names[2 * p + 1], sizeof(l->names[0]), "blk.%d.%s.weight.lora_b", il, k_target_names[t]);
                ggml_format_name(pr->a.t[slot], "%s%s", l->names[2 * p], slot_suffix[slot]);
                ggml_format_name(pr->b.t[slot], "%s%s", l->names[2 * p + 1], slot_suffix[slot]);
                p++;
            }
        }
        if (slot == RG_SLOT_PARAM) {
            l->buf_param = ggml_backend_alloc_ctx_tensors_from_buft(l->ctx, ggml_backend_dev_buffer_type(m->dev));
        } else if (slot == RG_SLOT_GRAD) {
            l->buf_grad = ggml_backend_alloc_ctx_tensors_from_buft(l->ctx, ggml_backend_dev_buffer_type(m->dev));
        }
    }
    l->n_pairs = n_pairs;
    l->buf_moments = ggml_backend_alloc_ctx_tensors_from_buft(l->ctx, ggml_backend_dev_buffer_type(m->dev));
    if (!l->buf_param || !l->buf_grad || !l->buf_moments) {
        rg_lora_free(l);
        return rg_fail(RG_ERR_DEVICE, "could not allocate LoRA tensors on %s", ggml_backend_dev_name(m->dev));
    }
    for (int slot = 0; slot < 4; slot++) rg_lora_zero(l, slot);
    for (int p = 0; p < n_pairs; p++) {
        ggml_set_param(l->pairs[p].a.t[RG_SLOT_PARAM]);
        ggml_set_param(l->pairs[p].b.t[RG_SLOT_PARAM]);
    }
    *out = l;
    return RG_OK;
}

void rg_lora_free(rg_lora * l) {
    if (!l) return;
    if (l->buf_param) ggml_backend_buffer_free(l->buf_param);
    if (l->buf_grad) ggml_backend_buffer_free(l->buf_grad);
    if (l->buf_moments) ggml_backend_buffer_free(l->buf_moments);
    if (l->ctx) ggml_free(l->ctx);
    free(l->pairs);
    free(l->names);
    free(l);
}

int rg_lora_tensor_count(const rg_lora * l) { return 2 * l->n_pairs; }

float rg_lora_scale(const rg_lora * l) { return l->scale; }

static struct ggml_tensor * slot_tensor(const rg_lora * l, int index, int slot) {
    const rg_lora_pair * pr = &l->pairs[index / 2];
    return (index % 2 == 0 ? pr->a : pr->b).t[slot];
}

rg_status rg_lora_tensor_info(const rg_lora * l, int index, const char ** name, int64_t * ne0, int64_t * ne1) {
    if (index < 0 || index >= rg_lora_tensor_count(l)) return rg_fail(RG_ERR_ARG, "LoRA tensor index %d out of range", index);
    const struct ggml_tensor * t = slot_tensor(l, index, RG_SLOT_PARAM);
    *name = l->names[index];
    *ne0 = t->ne[0];
    *ne1 = t->ne[1];
    return RG_OK;
}

static rg_status check_access(const rg_lora * l, int index, int slot, size_t n) {
    if (index < 0 || index >= rg_lora_tensor_count(l)) return rg_fail(RG_ERR_ARG, "LoRA tensor index %d out of range", index);
    if (slot < 0 || slot > 3) return rg_fail(RG_ERR_ARG, "LoRA slot %d out of range", slot);
    const struct ggml_tensor * t = slot_tensor(l, index, slot);
    if ((size_t) ggml_nelements(t) != n) {
        return rg_fail(RG_ERR_ARG, "LoRA tensor '%s' holds %lld values, caller passed %zu",
                       l->names[index], (long long) ggml_nelements(t), n);
    }
    return RG_OK;
}

rg_status rg_lora_read(const rg_lora * l, int index, int slot, float * dst, size_t n) {
    rg_status st = check_access(l, index, slot, n);
    if (st) return st;
    ggml_backend_tensor_get(slot_tensor(l, index, slot), dst, 0, n * sizeof(float));
    return RG_OK;
}

rg_status rg_lora_write(rg_lora * l, int index, int slot, const float * src, size_t n) {
    rg_status st = check_access(l, index, slot, n);
    if (st) return st;
    ggml_backend_tensor_set(slot_tensor(l, index, slot), src, 0, n * sizeof(float));
    return RG_OK;
}

rg_status rg_lora_zero(rg_lora * l, int slot) {
    switch (slot) {
        case RG_SLOT_PARAM: ggml_backend_buffer_clear(l->buf_param, 0); break;
        case RG_SLOT_GRAD:  ggml_backend_buffer_clear(l->buf_grad, 0); break;
        case RG_SLOT_ADAM_M:
        case RG_SLOT_ADAM_V:
            for (int p = 0; p < l->n_pairs; p++) {
                ggml_backend_tensor_memset(l->pairs[p].a.t[slot], 0, 0, ggml_nbytes(l->pairs[p].a.t[slot]));
                ggml_backend_tensor_memset(l->pairs[p].b.t[slot], 0, 0, ggml_nbytes(l->pairs[p].b.t[slot]));
            }
            break;
        default: return rg_fail(RG_ERR_ARG, "LoRA slot %d out of range", slot);
    }
    return RG_OK;
}
