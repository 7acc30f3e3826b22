/*
 * lora.c - LoRA A/B tensors with their gradient accumulators and AdamW moments.
 *
 * Shapes follow llama.cpp's adapter format so export is a plain copy: for a base weight W with
 * ne = [n_in, n_out], A has ne = [n_in, rank] and B has ne = [rank, n_out]; the forward adds
 * scale * B(A x) with scale = alpha / rank. Parameters, gradients and moments live in three
 * separate buffers on the model's device so each can be zeroed in one call.
 *
 * DoRA adds a third trainable tensor per pair, the magnitude m (ne = [1, n_out], one per output
 * row), and a constant, the squared row norms of the frozen W (computed once, here, from W's
 * dequantized rows), from which the graph gets ||W + scale B A|| without dequantizing W whole.
 */
#include "rg_internal.h"

#include <math.h>
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


/* one row of a base weight as floats, whatever its type and device */
static void weight_row(const struct ggml_tensor * w, int64_t row, void * scratch, float * dst) {
    const size_t bytes = ggml_row_size(w->type, w->ne[0]);
    ggml_backend_tensor_get(w, scratch, (size_t) row * w->nb[1], bytes);
    if (w->type == GGML_TYPE_F32) memcpy(dst, scratch, bytes);
    else ggml_get_type_traits(w->type)->to_float(scratch, dst, w->ne[0]);
}

/* DoRA's constant: the squared norm of every row of every adapted W, summed in double */
static rg_status base_row_norms(rg_lora * l) {
    const rg_model * m = l->model;
    for (int p = 0; p < l->n_pairs; p++) {
        const struct ggml_tensor * w = m->layers[l->pairs[p].layer].w[l->pairs[p].target];
        if (w->type != GGML_TYPE_F32 && !ggml_get_type_traits(w->type)->to_float) {
            return rg_fail(RG_ERR_ARG, "DoRA: %s has type %s, which ggml cannot convert to floats",
                           ggml_get_name(w), ggml_type_name(w->type));
        }
        const int64_t n_in = w->ne[0], n_out = w->ne[1];
        float * row = rg_malloc(sizeof(float) * (size_t) (n_in + n_out), "DoRA's row norms");
        void * scratch = row ? rg_malloc(ggml_row_size(w->type, n_in), "DoRA's row norms") : NULL;
        if (!scratch) {
            free(row);
            return RG_ERR_NOMEM;
        }
        float * norms = row + n_in;
        for (int64_t o = 0; o < n_out; o++) {
            weight_row(w, o, scratch, row);
            double s = 0;
            for (int64_t i = 0; i < n_in; i++) s += (double) row[i] * row[i];
            norms[o] = (float) s;
        }
        ggml_backend_tensor_set(l->pairs[p].w_norm2, norms, 0, sizeof(float) * (size_t) n_out);
        free(scratch);
        free(row);
    }
    return RG_OK;
}

rg_status rg_lora_magnitude_reset(rg_lora * l) {
    if (l->variant != RG_LORA_DORA) return rg_fail(RG_ERR_ARG, "the adapter is not DoRA: it has no magnitude");
    const rg_model * m = l->model;
    for (int p = 0; p < l->n_pairs; p++) {
        const rg_lora_pair * pr = &l->pairs[p];
        const struct ggml_tensor * w = m->layers[pr->layer].w[pr->target];
        const int64_t n_in = w->ne[0], n_out = w->ne[1], r = l->rank;
        /* host copies: A [r][n_in], B [n_out][r], the base norms, the magnitudes, one row of W */
        float * buf = rg_malloc(sizeof(float) * (size_t) (r * n_in + n_out * r + 2 * n_out + n_in), "DoRA's magnitude");
        void * scratch = buf ? rg_malloc(ggml_row_size(w->type, n_in), "DoRA's magnitude") : NULL;
        if (!scratch) {
            free(buf);
            return RG_ERR_NOMEM;
        }
        float * A = buf, * B = A + r * n_in, * n2 = B + n_out * r, * mag = n2 + n_out, * wrow = mag + n_out;
        ggml_backend_tensor_get(pr->a.t[RG_SLOT_PARAM], A, 0, sizeof(float) * (size_t) (r * n_in));
        ggml_backend_tensor_get(pr->b.t[RG_SLOT_PARAM], B, 0, sizeof(float) * (size_t) (n_out * r));
        ggml_backend_tensor_get(pr->w_norm2, n2, 0, sizeof(float) * (size_t) n_out);
        for (int64_t o = 0; o < n_out; o++) {
            const float * bo = B + o * r;
            bool zero = true;
            for (int64_t k = 0; k < r; k++) zero = zero && bo[k] == 0.0f;
            if (zero) {             /* a fresh adapter: the norm is W's own */
                mag[o] = sqrtf(n2[o]);
                continue;
            }
            weight_row(w, o, scratch, wrow);
            double s = 0;
            for (int64_t i = 0; i < n_in; i++) {
                float ba = 0;
                for (int64_t k = 0; k < r; k++) ba += bo[k] * A[k * n_in + i];
                const double v = (double) wrow[i] + (double) l->scale * ba;
                s += v * v;
            }
            mag[o] = (float) sqrt(s);
        }
        ggml_backend_tensor_set(pr->m.t[RG_SLOT_PARAM], mag, 0, sizeof(float) * (size_t) n_out);
        free(scratch);
        free(buf);
    }
    return RG_OK;
}

rg_status rg_lora_init(rg_model * m, uint32_t target_mask, int rank, float alpha, int variant, rg_lora ** out) {
    *out = NULL;
    if (variant != RG_LORA_PLAIN && variant != RG_LORA_DORA) {
        return rg_fail(RG_ERR_ARG, "LoRA variant %d is neither RG_LORA_PLAIN nor RG_LORA_DORA", variant);
    }
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
    l->variant = variant;
    l->per_pair = variant == RG_LORA_DORA ? 3 : 2;
    memset(l->pair_index, -1, sizeof(l->pair_index));

    int n_targets = 0;
    for (int t = 0; t < RG_N_TARGETS; t++) n_targets += (target_mask >> t) & 1;
    const int n_pairs = m->hp.n_layer * n_targets;
    l->pairs = rg_calloc((size_t) n_pairs, sizeof(*l->pairs), "the LoRA pairs");
    l->names = l->pairs ? rg_calloc((size_t) n_pairs * 3, sizeof(*l->names), "the LoRA tensor names") : NULL;
    if (!l->names) {
        rg_lora_free(l);
        return RG_ERR_NOMEM;
    }

    struct ggml_init_params ip = {
        .mem_size = ggml_tensor_overhead() * ((size_t) n_pairs * 13 + 8),
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
                static const char * kind_suffix[3] = { "lora_a", "lora_b", "dora_m" };
                if (variant == RG_LORA_DORA) pr->m.t[slot] = ggml_new_tensor_2d(l->ctx, GGML_TYPE_F32, 1, w->ne[1]);
                for (int k = 0; k < l->per_pair; k++) {
                    const int i = l->per_pair * p + k;
                    snprintf(l->names[i], sizeof(l->names[0]), "blk.%d.%s.weight.%s", il, k_target_names[t], kind_suffix[k]);
                    ggml_format_name(rg_lora_slots(l, i)->t[slot], "%s%s", l->names[i], slot_suffix[slot]);
                }
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
    if (variant == RG_LORA_DORA && l->buf_moments) {
        for (int p = 0; p < n_pairs; p++) {
            l->pairs[p].w_norm2 = ggml_new_tensor_2d(l->ctx, GGML_TYPE_F32, 1, l->pairs[p].b.t[0]->ne[1]);
            ggml_format_name(l->pairs[p].w_norm2, "%s (base row norms^2)", l->names[3 * p + 2]);
        }
        l->buf_const = ggml_backend_alloc_ctx_tensors_from_buft(l->ctx, ggml_backend_dev_buffer_type(m->dev));
    }
    if (!l->buf_param || !l->buf_grad || !l->buf_moments || (variant == RG_LORA_DORA && !l->buf_const)) {
        rg_lora_free(l);
        return rg_fail(RG_ERR_NOMEM, "could not allocate LoRA tensors on %s", ggml_backend_dev_name(m->dev));
    }
    for (int slot = 0; slot < 4; slot++) rg_lora_zero(l, slot);
    for (int i = 0; i < rg_lora_tensor_count(l); i++) ggml_set_param(rg_lora_slots(l, i)->t[RG_SLOT_PARAM]);
    if (variant == RG_LORA_DORA) {
        rg_status st = base_row_norms(l);
        if (!st) st = rg_lora_magnitude_reset(l);
        if (st) {
            rg_lora_free(l);
            return st;
        }
    }
    *out = l;
    return RG_OK;
}

void rg_lora_free(rg_lora * l) {
    if (!l) return;
    if (l->buf_param) ggml_backend_buffer_free(l->buf_param);
    if (l->buf_grad) ggml_backend_buffer_free(l->buf_grad);
    if (l->buf_moments) ggml_backend_buffer_free(l->buf_moments);
    if (l->buf_const) ggml_backend_buffer_free(l->buf_const);
    if (l->ctx) ggml_free(l->ctx);
    free(l->pairs);
    free(l->names);
    free(l);
}

int rg_lora_tensor_count(const rg_lora * l) { return l->per_pair * l->n_pairs; }

float rg_lora_scale(const rg_lora * l) { return l->scale; }

rg_lora_slotset * rg_lora_slots(const rg_lora * l, int index) {
    rg_lora_pair * pr = &l->pairs[index / l->per_pair];
    const int k = index % l->per_pair;
    return k == 0 ? &pr->a : k == 1 ? &pr->b : &pr->m;
}

static struct ggml_tensor * slot_tensor(const rg_lora * l, int index, int slot) {
    return rg_lora_slots(l, index)->t[slot];
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
            for (int i = 0; i < rg_lora_tensor_count(l); i++) {
                struct ggml_tensor * t = slot_tensor(l, i, slot);
                ggml_backend_tensor_memset(t, 0, 0, ggml_nbytes(t));
            }
            break;
        default: return rg_fail(RG_ERR_ARG, "LoRA slot %d out of range", slot);
    }
    return RG_OK;
}
