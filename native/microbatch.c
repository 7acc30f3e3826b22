/*
 * microbatch.c - one micro-batch's graph, shared by the engine's forward and training calls
 * (engine.c), activation checkpointing (recompute.c) and preflight (preflight.c): the batch checked
 * and padded, the graph built, allocated and given its inputs, and the eval callback that runs the
 * LM head at the hidden state.
 *
 * A training micro-batch is one ggml graph: the trunk up to the final hidden state h, a
 * surrogate loss sum(h * G) where G is an input, and ggml's backward of that loss. The graph
 * runs under a backend scheduler whose eval callback (rg_engine_on_node) stops right after h: there
 * the LM head (head.c) computes log-probs, the caller turns them into coefficients, and the head
 * writes G = d(loss)/d(h); then the scheduler carries on with the backward.
 *
 * Between ggml_build_backward_expand and the run, rewrite.c replaces the products ggml would
 * compute slowly (base-weight gradients, LoRA's and attention's thin products) and orders the
 * dequantized weight copies so that each is a short-lived transient (docs/architecture.md).
 */
#include "engine_impl.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Micro-batches are padded to a multiple of RG_PAD_TOKENS rows, each pad row a sequence of its
 * own. The attention matmuls then see the same row lengths llama.cpp's padded KV cache gives
 * them, so the same SIMD summation order: without it, rounding differences get amplified by the
 * 8-bit activation quantization of later matmuls into ~0.03 nats of per-token noise. */
#define RG_PAD_TOKENS 32

_Static_assert(RG_NO_PREFIX == INT32_MIN, "RG_NO_PREFIX must be INT32_MIN (retrograd.batch.NO_PREFIX)");

static int cmp_i32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

/* every prefix id is RG_NO_PREFIX or a sequence id of the batch */
static rg_status check_prefixes(const rg_batch * b) {
    if (!b->prefix_ids) return RG_OK;
    const size_t n = (size_t) b->n_tokens;
    int32_t * seqs = rg_malloc(sizeof(int32_t) * n, "the batch's sorted sequence ids");
    if (!seqs) return RG_ERR_NOMEM;
    memcpy(seqs, b->seq_ids, sizeof(int32_t) * n);
    qsort(seqs, n, sizeof(int32_t), cmp_i32);
    rg_status st = RG_OK;
    for (int i = 0; i < b->n_tokens; i++) {
        const int32_t p = b->prefix_ids[i];
        if (p != RG_NO_PREFIX && !bsearch(&p, seqs, n, sizeof(int32_t), cmp_i32)) {
            st = rg_fail(RG_ERR_ARG, "prefix id %d at row %d is neither RG_NO_PREFIX nor a sequence id of the batch", p, i);
            break;
        }
    }
    free(seqs);
    return st;
}

static rg_status check_batch(const rg_model * m, const rg_batch * b) {
    if (!b || b->n_tokens <= 0) return rg_fail(RG_ERR_ARG, "empty batch");
    if (b->n_targets < 0) return rg_fail(RG_ERR_ARG, "negative target count");
    if (!b->tokens || !b->positions || !b->seq_ids) return rg_fail(RG_ERR_ARG, "batch without tokens, positions or sequence ids");
    if (b->n_targets > 0 && (!b->target_rows || !b->target_ids)) return rg_fail(RG_ERR_ARG, "batch without target rows or ids");
    if (!(b->lora_dropout >= 0.0f && b->lora_dropout < 1.0f)) {
        return rg_fail(RG_ERR_ARG, "LoRA dropout must be in [0, 1), got %g", (double) b->lora_dropout);
    }
    for (int i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->hp.n_vocab) {
            return rg_fail(RG_ERR_ARG, "token %d at row %d is outside the vocabulary of %d", b->tokens[i], i, m->hp.n_vocab);
        }
        if (b->positions[i] < 0) return rg_fail(RG_ERR_ARG, "negative position at row %d", i);
        /* the pad rows take the ids just below the smallest one, and none may reach RG_NO_PREFIX */
        if (b->seq_ids[i] <= RG_NO_PREFIX + RG_PAD_TOKENS) {
            return rg_fail(RG_ERR_ARG, "sequence id %d at row %d is reserved (too close to RG_NO_PREFIX)", b->seq_ids[i], i);
        }
    }
    return check_prefixes(b);
}

static rg_status pad_batch(const rg_batch * in, int n_embd, rg_padded * out) {
    out->b = *in;
    out->owned = NULL;
    out->owned_noise = NULL;
    const int T = in->n_tokens;
    const int Tp = (T + RG_PAD_TOKENS - 1) / RG_PAD_TOKENS * RG_PAD_TOKENS;
    if (Tp == T) return RG_OK;
    if (in->embed_noise) {
        const size_t row = (size_t) n_embd;
        out->owned_noise = rg_malloc(sizeof(float) * row * (size_t) Tp, "the padded embedding noise");
        if (!out->owned_noise) return RG_ERR_NOMEM;
        memcpy(out->owned_noise, in->embed_noise, sizeof(float) * row * (size_t) T);
        memset(out->owned_noise + row * (size_t) T, 0, sizeof(float) * row * (size_t) (Tp - T));
        out->b.embed_noise = out->owned_noise;
    }
    out->owned = rg_malloc(sizeof(int32_t) * 4 * (size_t) Tp, "the padded batch");
    if (!out->owned) {
        free(out->owned_noise);
        return RG_ERR_NOMEM;
    }
    int32_t * tok = out->owned, * pos = tok + Tp, * seq = pos + Tp, * pre = seq + Tp;
    int32_t min_seq = 0;
    for (int i = 0; i < T; i++) {
        tok[i] = in->tokens[i];
        pos[i] = in->positions[i];
        seq[i] = in->seq_ids[i];
        pre[i] = in->prefix_ids ? in->prefix_ids[i] : RG_NO_PREFIX;
        if (seq[i] < min_seq) min_seq = seq[i];
    }
    for (int i = T; i < Tp; i++) {
        tok[i] = 0;
        pos[i] = 0;
        seq[i] = min_seq - 1 - (i - T);
        pre[i] = RG_NO_PREFIX;
    }
    out->b.n_tokens = Tp;
    out->b.tokens = tok;
    out->b.positions = pos;
    out->b.seq_ids = seq;
    out->b.prefix_ids = pre;
    return RG_OK;
}

/* ---- graph building ------------------------------------------------------------------------ */
struct ggml_tensor * rg_engine_grad_of_param(const rg_lora * l, const struct ggml_tensor * t) {
    for (int i = 0; i < rg_lora_tensor_count(l); i++) {
        const rg_lora_slotset * s = rg_lora_slots(l, i);
        if (s->t[RG_SLOT_PARAM] == t) return s->t[RG_SLOT_GRAD];
    }
    return NULL;
}

rg_status rg_engine_build(rg_engine * e, rg_lora * lora, int32_t n_tokens, int kind, bool noise, bool dropout,
                          rg_built * o) {
    const bool train = kind != RG_BUILD_FORWARD;
    const double t0 = rg_now_ms();
    memset(o, 0, sizeof(*o));
    struct ggml_init_params ip = { e->ctx_mem_size, e->ctx_mem, true };
    o->ctx = ggml_init(ip);
    if (!o->ctx) return rg_fail(RG_ERR_NOMEM, "out of host memory for a graph context");
    o->b.model = e->model;
    o->b.lora = lora;
    o->b.ctx = o->ctx;
    o->b.n_tokens = n_tokens;
    o->b.train = train;
    o->b.exact_ops = e->exact_ops;
    o->b.tiled_attention = !e->dense_attention;
    o->b.on_cpu = e->model->backend == e->model->backend_cpu;
    o->b.matmul = e->matmul;
    o->b.embed_noise = noise;
    o->b.dropout = dropout;
    if (!rg_build_trunk(&o->b)) {
        ggml_free(o->ctx);
        return rg_fail(RG_ERR_COMPUTE, "%s", o->b.error);
    }
    struct ggml_tensor * hidden = o->b.hidden;
    if (!train) {
        ggml_set_output(hidden);
        struct ggml_cgraph * gf = ggml_new_graph_custom(o->ctx, e->graph_size, false);
        ggml_build_forward_expand(gf, hidden);
        /* the training forward's kernels (gemm.c, outer.c), so scoring and training agree */
        o->gf = rg_graph_rewrite(&o->b, gf, e->graph_size);
        e->timings.build_ms += rg_now_ms() - t0;
        return RG_OK;
    }
    o->grad_hidden = ggml_new_tensor_2d(o->ctx, GGML_TYPE_F32, e->model->hp.n_embd, n_tokens);
    ggml_set_name(o->grad_hidden, "grad_hidden");
    ggml_set_input(o->grad_hidden);
    struct ggml_tensor * loss = ggml_sum(o->ctx, ggml_mul(o->ctx, hidden, o->grad_hidden));
    ggml_set_name(loss, "surrogate_loss");
    ggml_set_loss(loss);
    if (kind == RG_BUILD_TRAIN_FORWARD) {
        /* the head runs at the hidden state as in training (the eval callback), which also copies
         * each layer's input out for the backward pass (recompute.c) as soon as it is computed:
         * not outputs, so the graph's allocator reuses their memory and the forward needs about
         * one layer's activations, not every layer's input twice (here and in the copy) */
        struct ggml_cgraph * gf = ggml_new_graph_custom(o->ctx, e->graph_size, false);
        ggml_build_forward_expand(gf, loss);
        o->gf = rg_graph_rewrite(&o->b, gf, e->graph_size);
        e->timings.build_ms += rg_now_ms() - t0;
        return RG_OK;
    }
    struct ggml_cgraph * gf = ggml_new_graph_custom(o->ctx, e->graph_size, true);
    ggml_build_forward_expand(gf, loss);
    const int n_fwd = ggml_graph_n_nodes(gf);
    struct ggml_tensor ** accs = rg_calloc((size_t) n_fwd, sizeof(*accs), "the gradient accumulators");
    if (!accs) {
        ggml_free(o->ctx);
        return RG_ERR_NOMEM;
    }
    int n_params = 0;
    for (int i = 0; i < n_fwd; i++) {
        struct ggml_tensor * node = ggml_graph_node(gf, i);
        if (node->flags & GGML_TENSOR_FLAG_PARAM) {
            accs[i] = rg_engine_grad_of_param(lora, node);
            n_params += accs[i] != NULL;
        }
    }
    if (n_params == 0) {
        free(accs);
        ggml_free(o->ctx);
        return rg_fail(RG_ERR_ARG, "the LoRA adapter has no tensor in this model's graph");
    }
    ggml_build_backward_expand(o->ctx, gf, accs);
    free(accs);
    o->loss_grad = ggml_graph_get_grad_acc(gf, loss);
    ggml_set_input(o->loss_grad);
    if (!o->b.on_cpu) {
        /* grad_hidden is written by the eval callback at `hidden`, which ggml cannot see: a device
         * backend that reorders its graph (ggml-vulkan's graph_optimize) may hoist the backward's
         * first product, which reads only inputs, above `hidden` and read grad_hidden before the
         * head wrote it. Adding 0 x one element of `hidden` makes the order a data dependency;
         * built after the backward, so it has no gradient of its own. */
        struct ggml_tensor * after = ggml_scale(o->ctx, ggml_view_1d(o->ctx, hidden, 1, 0), 0.0f);
        struct ggml_tensor * gh = ggml_add(o->ctx, o->grad_hidden, after);
        ggml_set_name(gh, "grad_hidden (after the head)");
        o->b.subst_from[o->b.n_subst] = o->grad_hidden;
        o->b.subst_to[o->b.n_subst++] = gh;
    }
    o->gf = rg_graph_rewrite(&o->b, gf, e->graph_size);
    e->timings.build_ms += rg_now_ms() - t0;
    return RG_OK;
}

static rg_status alloc_and_set_inputs(rg_engine * e, rg_built * o, const rg_batch * batch) {
    const double t0 = rg_now_ms();
    ggml_backend_sched_reset(e->sched);
    if (o->grad_hidden) ggml_backend_sched_set_tensor_backend(e->sched, o->grad_hidden, e->model->backend);
    if (!ggml_backend_sched_alloc_graph(e->sched, o->gf)) {
        return rg_fail(RG_ERR_NOMEM, "could not allocate the compute graph (%d tokens)", batch->n_tokens);
    }
    const int T = batch->n_tokens;
    ggml_backend_tensor_set(o->b.inp_tokens, batch->tokens, 0, sizeof(int32_t) * (size_t) T);
    ggml_backend_tensor_set(o->b.inp_pos, batch->positions, 0, sizeof(int32_t) * (size_t) T);
    if (o->b.inp_embd_noise) ggml_backend_tensor_set(o->b.inp_embd_noise, batch->embed_noise, 0, ggml_nbytes(o->b.inp_embd_noise));
    if (o->b.inp_dropout && o->b.inp_dropout->buffer) {
        int32_t params[4];
        rg_dropout_params(batch, params);
        ggml_backend_tensor_set(o->b.inp_dropout, params, 0, sizeof(params));
    }
    const rg_status st = rg_set_attention_inputs(&o->b, batch);
    if (st != RG_OK) return st;
    if (o->loss_grad) {
        const float one = 1.0f;
        ggml_backend_tensor_set(o->loss_grad, &one, 0, sizeof(float));
    }
    e->timings.alloc_ms += rg_now_ms() - t0;
    e->timings.n_nodes = ggml_graph_n_nodes(o->gf);
    const double mib = (double) ggml_backend_sched_get_buffer_size(e->sched, e->model->backend) / (1024.0 * 1024.0);
    if (mib > e->timings.graph_mib) e->timings.graph_mib = mib;
    return RG_OK;
}

/* the hidden states in host memory: the tensor's own data, or a copy in *owned (NULL with the
 * error set when that cannot be allocated) */
static float * hidden_to_host(struct ggml_tensor * hidden, float ** owned) {
    *owned = NULL;
    if (ggml_backend_buffer_is_host(hidden->buffer)) return (float *) hidden->data;
    *owned = rg_malloc(ggml_nbytes(hidden), "a host copy of the hidden states");
    if (*owned) ggml_backend_tensor_get(hidden, *owned, 0, ggml_nbytes(hidden));
    return *owned;
}

/* ---- one micro-batch's graph ---------------------------------------------------------------- */
void rg_engine_release(rg_engine * e, rg_prepared * p) {
    ggml_backend_sched_reset(e->sched);
    ggml_free(p->o.ctx);
    free(p->pb.owned);
    free(p->pb.owned_noise);
}

/* On failure nothing is left to release. */
rg_status rg_engine_prepare(rg_engine * e, rg_lora * lora, const rg_batch * batch, int kind, rg_prepared * p) {
    rg_status st = check_batch(e->model, batch);
    if (st) return st;
    p->n_real = batch->n_tokens;
    if ((st = pad_batch(batch, e->model->hp.n_embd, &p->pb))) return st;
    if ((st = rg_engine_build(e, lora, p->pb.b.n_tokens, kind, batch->embed_noise != NULL, batch->lora_dropout > 0.0f, &p->o))) {
        free(p->pb.owned);
        free(p->pb.owned_noise);
        return st;
    }
    if ((st = alloc_and_set_inputs(e, &p->o, &p->pb.b))) rg_engine_release(e, p);
    return st;
}

/* ---- the eval callback ---------------------------------------------------------------------- */
/* il when t is the input of layer il that activation checkpointing keeps, else -1: the inputs are
 * computed in layer order (each depends on the one before), so only the next one is looked for */
static int saved_layer(const rg_run * r, const struct ggml_tensor * t) {
    return r->saved && r->n_copied < r->n_layer_in && r->layer_in[r->n_copied] == t ? r->n_copied : -1;
}

bool rg_engine_on_node(struct ggml_tensor * t, bool ask, void * user) {
    rg_run * r = user;
    rg_engine * pe = r->e;
    const int il = saved_layer(r, t);
    if (ask) return pe->profiling || pe->sync_nodes || rg_trace_nodes() || t == r->hidden || il >= 0;
    if (il >= 0) {
        ggml_backend_tensor_get(t, r->saved + (size_t) il * (size_t) ggml_nelements(t), 0, ggml_nbytes(t));
        r->n_copied++;
    }
    if (rg_trace_nodes()) {
        ggml_backend_t where = ggml_backend_sched_get_tensor_backend(pe->sched, t);
        fprintf(stderr, "retrograd: node done: %s %s [%lld,%lld,%lld,%lld] on %s\n", ggml_op_desc(t), ggml_get_name(t),
                (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3],
                where ? ggml_backend_name(where) : "?");
        fflush(stderr);
    }
    if (pe->profiling) {
        const double now = rg_now_ms();
        rg_profile_add(&pe->prof, pe->model, r->lora_rank, t, r->t_hidden > 0, now - pe->prof_last);
        pe->prof_last = now;
    }
    if (t != r->hidden) return true;
    rg_engine * e = r->e;
    const rg_batch * batch = r->batch;
    const int K = batch->n_targets, T = r->n_real, D = e->model->hp.n_embd;
    e->timings.forward_ms += rg_now_ms() - r->t_start;

    const size_t nk = (size_t) (K > 0 ? K : 1);
    float * coeff = rg_calloc(nk, sizeof(float), "the loss coefficients");
    float * entropy = r->want_entropy ? rg_calloc(nk, sizeof(float), "the entropies") : NULL;
    float * hgrad = r->want_hidden ? rg_calloc((size_t) T * D, sizeof(float), "the hidden-state gradient") : NULL;
    float * hidden_owned = NULL;
    const float * hidden = r->want_hidden ? hidden_to_host(r->hidden, &hidden_owned) : NULL;
    rg_status st = RG_OK;
    if (!coeff || (r->want_entropy && !entropy) || (r->want_hidden && (!hgrad || !hidden))) st = RG_ERR_NOMEM;
    if (st == RG_OK && K > 0) st = rg_head_forward(e->head, r->hidden, batch, r->logp, entropy, true, RG_HEAD_BUDGET);
    if (st == RG_OK) {
        const int rc = r->fn(r->user, K, r->logp, entropy, coeff, T, D, hidden, hgrad);
        if (rc != 0) st = rg_fail(RG_ERR_CALLBACK, "the loss callback failed (code %d)", rc);
    }
    if (st == RG_OK) {
        for (int k = 0; k < K; k++) {
            if (!isfinite(coeff[k]) || !isfinite(r->logp[k])) {
                st = rg_fail(RG_ERR_NONFINITE, "non-finite %s at target %d (row %d)",
                             isfinite(r->logp[k]) ? "loss coefficient" : "log-probability", k, batch->target_rows[k]);
                break;
            }
        }
    }
    if (st == RG_OK) {
        ggml_backend_tensor_memset(r->grad_hidden, 0, 0, ggml_nbytes(r->grad_hidden));
        if (K > 0) st = rg_head_backward(e->head, r->hidden, r->grad_hidden, batch, r->logp, coeff);
    }
    if (st == RG_OK && hgrad) {
        const size_t nb = (size_t) T * D * sizeof(float);
        float * g = rg_malloc(nb, "the combined hidden-state gradient");
        if (!g) {
            st = RG_ERR_NOMEM;
        } else {
            ggml_backend_tensor_get(r->grad_hidden, g, 0, nb);
            for (size_t i = 0; i < (size_t) T * D; i++) g[i] += hgrad[i];
            ggml_backend_tensor_set(r->grad_hidden, g, 0, nb);
            free(g);
        }
    }
    e->timings.head_ms += rg_head_ms(e->head, true);
    free(entropy);
    free(coeff);
    free(hgrad);
    free(hidden_owned);
    r->status = st;
    if (st != RG_OK) snprintf(r->error, sizeof(r->error), "%s", rg_last_error());
    r->t_hidden = rg_now_ms();
    pe->prof_last = r->t_hidden;
    return st == RG_OK;
}
