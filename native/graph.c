/*
 * graph.c - the transformer trunk as a ggml graph, per architecture family.
 *
 * Mirrors llama.cpp's own graphs for llama / qwen2 / qwen3 / gemma3 (same op order, same rope
 * modes, same scales) so that per-token log-probs agree with llama.cpp on the same tokens, but
 * uses only ops that have a ggml backward: no flash attention, no fused GELU (GELU is written
 * with softplus and exp), no in-place ops on values that need gradients.
 *
 * Layout: activations are [features, tokens]; all sequences of a micro-batch are packed into
 * one token axis and kept apart by the attention mask.
 */
#include "rg_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK_SHAPE(b, t, n0, n1, n2, what)                                                     \
    do {                                                                                        \
        if ((t)->ne[0] != (n0) || (t)->ne[1] != (n1) || (t)->ne[2] != (n2)) {                   \
            snprintf((b)->error, sizeof((b)->error),                                            \
                     "internal shape error at %s: got [%lld,%lld,%lld], expected [%lld,%lld,%lld]", \
                     what, (long long) (t)->ne[0], (long long) (t)->ne[1], (long long) (t)->ne[2], \
                     (long long) (n0), (long long) (n1), (long long) (n2));                     \
            return NULL;                                                                        \
        }                                                                                       \
    } while (0)

static struct ggml_tensor * named(struct ggml_tensor * t, const char * what, int il) {
    if (il >= 0) ggml_format_name(t, "%s-%d", what, il);
    else ggml_set_name(t, what);
    return t;
}

static struct ggml_tensor * rms_norm(rg_graph_build * b, struct ggml_tensor * x, struct ggml_tensor * w) {
    return ggml_mul(b->ctx, ggml_rms_norm(b->ctx, x, b->model->hp.rms_eps), w);
}

/* DoRA's per-row factor m / ||W + s B A||, as [n_out, 1]. Expanding the square,
 *   ||W_o + s (BA)_o||^2 = ||W_o||^2 + 2 s B_o . (W A^T)_o + s^2 B_o (A A^T) B_o^T,
 * so W enters only through one product with A (rank columns: the cost of `rank` more tokens)
 * and stays quantized. The norm is differentiated in full (PEFT detaches it to save memory; here
 * its terms are rank-sized). wq is W as the base product reads it. */
static struct ggml_tensor * dora_factor(rg_graph_build * b, const rg_lora_pair * pr, struct ggml_tensor * wq, int il) {
    struct ggml_context * ctx = b->ctx;
    struct ggml_tensor * A = pr->a.t[RG_SLOT_PARAM], * B = pr->b.t[RG_SLOT_PARAM];
    const int64_t n_out = B->ne[1];
    const float s = b->lora->scale;
    struct ggml_tensor * wa = ggml_cont(ctx, ggml_transpose(ctx, ggml_mul_mat(ctx, wq, A)));  /* [r, n_out] */
    struct ggml_tensor * cross = ggml_sum_rows(ctx, ggml_mul(ctx, wa, B));                     /* [1, n_out] */
    struct ggml_tensor * gram = ggml_mul_mat(ctx, A, A);                                       /* [r, r] */
    struct ggml_tensor * quad = ggml_sum_rows(ctx, ggml_mul(ctx, ggml_mul_mat(ctx, gram, B), B));
    struct ggml_tensor * n2 = ggml_add(ctx, pr->w_norm2, ggml_add(ctx, ggml_scale(ctx, cross, 2.0f * s), ggml_scale(ctx, quad, s * s)));
    CHECK_SHAPE(b, n2, 1, n_out, 1, "dora norm");
    struct ggml_tensor * f = ggml_div(ctx, pr->m.t[RG_SLOT_PARAM], ggml_sqrt(ctx, n2));
    return named(ggml_reshape_2d(ctx, f, n_out, 1), "dora_factor", il);
}

/* y = W x (+ scale * B A x) (+ bias) for LoRA target t of layer il; DoRA scales the sum's rows. */
static struct ggml_tensor * linear(rg_graph_build * b, int il, int t, struct ggml_tensor * x,
                                   struct ggml_tensor * bias) {
    struct ggml_context * ctx = b->ctx;
    struct ggml_tensor * w = b->model->layers[il].w[t];
    struct ggml_tensor * wq = w;          /* W as the products read it */
    if (b->matmul.mode == RG_MATMUL_F32 && w->type != GGML_TYPE_F32) {
        wq = ggml_cast(ctx, w, GGML_TYPE_F32);
    } else if (b->on_cpu && rg_matmul_converts(&b->matmul, w->type)) {
        const enum ggml_type ct = b->matmul.conv_type;
        wq = rg_model_cached(b->model, w, false, ct);
        if (!wq) wq = rg_dequant(ctx, w, false, ct);
    }
    struct ggml_tensor * y = ggml_mul_mat(ctx, wq, x);
    if (b->lora && b->lora->pair_index[il][t] >= 0) {
        const rg_lora_pair * pr = &b->lora->pairs[b->lora->pair_index[il][t]];
        struct ggml_tensor * xa = x;
        if (b->inp_dropout) {     /* dropout on the adapter's input only; the base product sees x */
            xa = ggml_mul(ctx, x, named(rg_dropout_mask(ctx, b->inp_dropout, x->ne[0], x->ne[1], il, t), "lora_mask", il));
            CHECK_SHAPE(b, xa, x->ne[0], x->ne[1], 1, "lora dropout");
        }
        struct ggml_tensor * ax = named(ggml_mul_mat(ctx, pr->a.t[RG_SLOT_PARAM], xa), "lora_ax", il);
        if (b->matmul.mode == RG_MATMUL_NATIVE) {
            /* llama.cpp's order, for bit-equal log-probs */
            y = ggml_add(ctx, y, ggml_scale(ctx, ggml_mul_mat(ctx, pr->b.t[RG_SLOT_PARAM], ax), b->lora->scale));
        } else {
            /* the same sum, scaled where it is rank-wide rather than output-wide */
            y = ggml_add(ctx, y, ggml_mul_mat(ctx, pr->b.t[RG_SLOT_PARAM], ggml_scale(ctx, ax, b->lora->scale)));
        }
        if (b->lora->variant == RG_LORA_DORA) {
            struct ggml_tensor * f = dora_factor(b, pr, wq, il);
            if (!f) return NULL;
            y = ggml_mul(ctx, y, f);
        }
    }
    if (bias) y = ggml_add(ctx, y, bias);
    CHECK_SHAPE(b, y, w->ne[1], x->ne[1], 1, rg_target_name(t));
    return named(y, rg_target_name(t), il);
}

/* GELU, tanh approximation, as x * sigmoid(2u) with u = sqrt(2/pi) (x + 0.044715 x^3) and
 * sigmoid(z) = exp(-softplus(-z)): every op used has a backward in ggml. */
static struct ggml_tensor * gelu_tanh(struct ggml_context * ctx, struct ggml_tensor * x) {
    const float c = 2.0f * sqrtf(2.0f / (float) M_PI);
    struct ggml_tensor * x3 = ggml_mul(ctx, ggml_sqr(ctx, x), x);
    struct ggml_tensor * z = ggml_scale(ctx, ggml_add(ctx, x, ggml_scale(ctx, x3, 0.044715f)), -c);
    struct ggml_tensor * sig = ggml_exp(ctx, ggml_neg(ctx, ggml_softplus(ctx, z)));
    return ggml_mul(ctx, x, sig);
}

static struct ggml_tensor * attention(rg_graph_build * b, int il, struct ggml_tensor * x) {
    struct ggml_context * ctx = b->ctx;
    const rg_hparams * hp = &b->model->hp;
    const rg_layer * L = &b->model->layers[il];
    const int T = b->n_tokens, hd = hp->head_dim_k;
    const bool swa = hp->swa_layer[il];

    struct ggml_tensor * q = linear(b, il, RG_TARGET_Q, x, L->bq);
    struct ggml_tensor * k = linear(b, il, RG_TARGET_K, x, L->bk);
    struct ggml_tensor * v = linear(b, il, RG_TARGET_V, x, L->bv);
    if (!q || !k || !v) return NULL;
    q = ggml_reshape_3d(ctx, q, hd, hp->n_head, T);
    k = ggml_reshape_3d(ctx, k, hd, hp->n_head_kv, T);
    v = ggml_reshape_3d(ctx, v, hd, hp->n_head_kv, T);
    if (L->q_norm) {
        q = rms_norm(b, q, L->q_norm);
        k = rms_norm(b, k, L->k_norm);
    }
    float kq_scale = hp->attn_scale;
    if (hp->arch == RG_ARCH_GEMMA3) {
        /* gemma scales the queries and uses kq scale 1. llama.cpp scales after rope; rope is
         * linear and the scale a power of two for these head sizes, so scaling first is the same
         * number, and its backward then sees a contiguous gradient */
        q = ggml_scale(ctx, q, hp->attn_scale);
        kq_scale = 1.0f;
    }
    const float base = swa ? hp->rope_base_swa : hp->rope_base;
    q = ggml_rope_ext(ctx, q, b->inp_pos, b->model->rope_freqs, hp->n_rot, hp->rope_mode, hp->n_ctx_train,
                      base, hp->rope_freq_scale, 0.0f, 1.0f, 32.0f, 1.0f);
    k = ggml_rope_ext(ctx, k, b->inp_pos, b->model->rope_freqs, hp->n_rot, hp->rope_mode, hp->n_ctx_train,
                      base, hp->rope_freq_scale, 0.0f, 1.0f, 32.0f, 1.0f);
    named(q, "q_rope", il);
    named(k, "k_rope", il);

    q = ggml_permute(ctx, q, 0, 2, 1, 3);                       /* [hd, T, n_head] */
    /* made contiguous, the product below runs through ggml's tiled matmul (2-3x faster than its
     * generic loop on the CPU). The native mode keeps llama.cpp's own route: its promise is
     * bit-equal log-probs, and a last-bit change in the scores moves some activations across a
     * rounding step of the quantized kernels (a 0.03 mean |diff| in log-prob, docs/numerics.md) */
    if (b->matmul.mode != RG_MATMUL_NATIVE) q = ggml_cont(ctx, q);
    k = ggml_permute(ctx, k, 0, 2, 1, 3);                       /* [hd, T, n_kv] */
    struct ggml_tensor * kq = ggml_mul_mat(ctx, k, q);          /* [T_k, T_q, n_head] */
    rg_attn_nodes * A = &b->attn[il];
    A->q = q;
    A->k = k;
    A->k_rope = k->src[0];
    A->v = v;
    A->scale = kq_scale;
    A->n_swa = swa ? hp->n_swa : 0;
    CHECK_SHAPE(b, kq, T, T, hp->n_head, "kq");
    kq = ggml_soft_max_ext(ctx, kq, swa ? b->inp_mask_swa : b->inp_mask, kq_scale, 0.0f);
    named(kq, "kq_softmax", il);
    struct ggml_tensor * vt = ggml_cont(ctx, ggml_permute(ctx, v, 1, 2, 0, 3)); /* [T, hd, n_kv] */
    struct ggml_tensor * kqv = ggml_mul_mat(ctx, vt, kq);       /* [hd, T_q, n_head] */
    CHECK_SHAPE(b, kqv, hd, T, hp->n_head, "kqv");
    A->vt = vt;
    A->kqv = kqv;
    kqv = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hd * hp->n_head, T);
    named(kqv, "kqv_out", il);
    return linear(b, il, RG_TARGET_O, kqv, L->bo);
}

static struct ggml_tensor * ffn(rg_graph_build * b, int il, struct ggml_tensor * x) {
    struct ggml_context * ctx = b->ctx;
    struct ggml_tensor * gate = linear(b, il, RG_TARGET_GATE, x, NULL);
    struct ggml_tensor * up = linear(b, il, RG_TARGET_UP, x, NULL);
    if (!gate || !up) return NULL;
    struct ggml_tensor * act;
    if (!b->model->hp.gelu_ffn) {
        act = ggml_swiglu_split(ctx, gate, up);
    } else if (!b->train && !b->exact_ops) {
        act = ggml_geglu_split(ctx, gate, up);
    } else if (b->exact_ops) {
        act = ggml_mul(ctx, gelu_tanh(ctx, gate), up);
    } else {
        /* ggml has no backward for GELU: differentiate the composite, compute with the fused op */
        act = ggml_mul(ctx, gelu_tanh(ctx, gate), up);
        b->subst_from[b->n_subst] = act;
        b->subst_to[b->n_subst] = ggml_geglu_split(ctx, gate, up);
        b->n_subst++;
    }
    return linear(b, il, RG_TARGET_DOWN, named(act, "ffn_act", il), NULL);
}

/* the inputs every layer reads: positions, attention masks, LoRA dropout's seed */
void rg_build_layer_inputs(rg_graph_build * b) {
    struct ggml_context * ctx = b->ctx;
    const rg_hparams * hp = &b->model->hp;
    const int T = b->n_tokens;
    b->inp_pos = named(ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T), "inp_pos", -1);
    b->inp_mask = named(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, T, T), "inp_mask", -1);
    ggml_set_input(b->inp_pos);
    ggml_set_input(b->inp_mask);
    b->inp_mask_swa = NULL;
    if (hp->n_swa > 0) {
        b->inp_mask_swa = named(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, T, T), "inp_mask_swa", -1);
        ggml_set_input(b->inp_mask_swa);
    }
    b->inp_vis = named(ggml_new_tensor_2d(ctx, GGML_TYPE_I32, T, 3), "inp_vis", -1);
    ggml_set_input(b->inp_vis);
    b->inp_dropout = NULL;
    if (b->dropout && b->lora) {
        b->inp_dropout = named(ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 4), "inp_dropout", -1);
        ggml_set_input(b->inp_dropout);
    }
}

struct ggml_tensor * rg_build_layer(rg_graph_build * b, int il, struct ggml_tensor * x) {
    struct ggml_context * ctx = b->ctx;
    const rg_hparams * hp = &b->model->hp;
    const rg_layer * L = &b->model->layers[il];
    struct ggml_tensor * h = rms_norm(b, x, L->attn_norm);
    struct ggml_tensor * a = attention(b, il, named(h, "attn_norm", il));
    if (!a) return NULL;
    if (L->attn_post_norm) a = named(rms_norm(b, a, L->attn_post_norm), "attn_post_norm", il);
    x = named(ggml_add(ctx, a, x), "attn_out", il);

    h = rms_norm(b, x, L->ffn_norm);
    struct ggml_tensor * f = ffn(b, il, named(h, "ffn_norm", il));
    if (!f) return NULL;
    if (L->ffn_post_norm) f = rms_norm(b, f, L->ffn_post_norm);
    x = named(ggml_add(ctx, f, x), "l_out", il);
    if (x->ne[0] != hp->n_embd || x->ne[1] != b->n_tokens) {
        snprintf(b->error, sizeof(b->error), "internal shape error at layer %d output", il);
        return NULL;
    }
    return x;
}

struct ggml_tensor * rg_build_final_norm(rg_graph_build * b, struct ggml_tensor * x) {
    return named(rms_norm(b, x, b->model->output_norm), "result_norm", -1);
}

bool rg_build_trunk(rg_graph_build * b) {
    struct ggml_context * ctx = b->ctx;
    rg_model * m = b->model;
    const rg_hparams * hp = &m->hp;
    const int T = b->n_tokens;

    b->inp_tokens = named(ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T), "inp_tokens", -1);
    ggml_set_input(b->inp_tokens);
    rg_build_layer_inputs(b);

    struct ggml_tensor * x = ggml_get_rows(ctx, m->tok_embd, b->inp_tokens);
    b->inp_embd_noise = NULL;
    if (b->embed_noise) {       /* NEFTune: noise on the looked-up embeddings, before the model's own scale */
        b->inp_embd_noise = named(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, hp->n_embd, T), "inp_embd_noise", -1);
        ggml_set_input(b->inp_embd_noise);
        x = ggml_add(ctx, x, b->inp_embd_noise);
    }
    if (hp->embd_scale != 1.0f) x = ggml_scale(ctx, x, hp->embd_scale);
    named(x, "inp_embd", -1);

    for (int il = 0; il < hp->n_layer; il++) {
        b->layer_in[il] = x;
        if (!(x = rg_build_layer(b, il, x))) return false;
    }
    b->layer_in[hp->n_layer] = x;
    b->hidden = rg_build_final_norm(b, x);
    return true;
}

void rg_fill_masks(const rg_hparams * hp, const rg_batch * batch, float * mask, float * mask_swa) {
    const int T = batch->n_tokens;
    for (int i = 0; i < T; i++) {           /* query row */
        float * row = mask + (size_t) i * T;
        float * row_swa = mask_swa ? mask_swa + (size_t) i * T : NULL;
        for (int j = 0; j < T; j++) {       /* key column */
            const bool same = batch->seq_ids[j] == batch->seq_ids[i] ||
                              (batch->prefix_ids && batch->seq_ids[j] == batch->prefix_ids[i]);
            const bool visible = same && batch->positions[j] <= batch->positions[i];
            row[j] = visible ? 0.0f : -INFINITY;
            if (row_swa) {
                const bool in_window = batch->positions[i] - batch->positions[j] < hp->n_swa;
                row_swa[j] = visible && in_window ? 0.0f : -INFINITY;
            }
        }
    }
}

rg_status rg_set_attention_inputs(const rg_graph_build * b, const rg_batch * batch) {
    const int T = batch->n_tokens;
    if (b->inp_vis && b->inp_vis->buffer) {
        int32_t * vis = rg_malloc(sizeof(int32_t) * 3 * (size_t) T, "the attention's ids and positions");
        if (!vis) return RG_ERR_NOMEM;
        rg_attn_fill_vis(batch, vis);
        ggml_backend_tensor_set(b->inp_vis, vis, 0, ggml_nbytes(b->inp_vis));
        free(vis);
    }
    /* a mask no node reads (tiled attention, or all layers local, or all global) is not allocated,
     * and not filled: [T, T] floats are 256 MiB at 8,192 tokens */
    const bool full = b->inp_mask && b->inp_mask->buffer, local = b->inp_mask_swa && b->inp_mask_swa->buffer;
    if (!full && !local) return RG_OK;
    const size_t TT = (size_t) T * (size_t) T;
    float * mask = rg_malloc(sizeof(float) * TT * (b->inp_mask_swa ? 2 : 1), "the attention masks");
    if (!mask) return RG_ERR_NOMEM;
    float * mask_swa = b->inp_mask_swa ? mask + TT : NULL;
    rg_fill_masks(&b->model->hp, batch, mask, mask_swa);
    if (full) ggml_backend_tensor_set(b->inp_mask, mask, 0, ggml_nbytes(b->inp_mask));
    if (local) ggml_backend_tensor_set(b->inp_mask_swa, mask_swa, 0, ggml_nbytes(b->inp_mask_swa));
    free(mask);
    return RG_OK;
}
