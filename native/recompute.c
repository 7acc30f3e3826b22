/*
 * recompute.c - activation checkpointing: a training micro-batch whose backward recomputes each
 * layer's activations from the layer's input instead of keeping every layer's activations alive.
 *
 * The one-graph path (engine.c) keeps what the backward of every layer needs from the forward:
 * per layer the attention scores ([T, T] per head) and the MLP's activations, so its memory grows
 * with layers x tokens (and tokens squared). Here:
 *  1. a forward graph of the whole trunk (the training graph's ops, without its backward) keeps
 *     only each layer's input, [n_embd, T] a layer; the head runs at the hidden state exactly as in
 *     training (rg_engine_on_node: log-probs, the caller's coefficients, the hidden state's gradient);
 *  2. from the last layer down, a graph of one layer takes the saved input as a parameter, recomputes
 *     the layer, and back-propagates the gradient of its output: the adapter's gradients of that layer
 *     accumulate into the GRAD slots and the gradient of its input feeds the layer below.
 * The same ops on the same inputs give the same activations, so the gradients are the one-graph
 * path's up to the order of float sums (tests/test_native.py); the price is a second forward pass.
 */
#include "engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    rg_engine      * e;
    rg_lora        * lora;
    const rg_batch * batch;      /* padded */
} rg_segments;

static rg_status segment_fail(struct ggml_context * ctx, rg_status st, const char * what) {
    ggml_free(ctx);
    return rg_fail(st, "%s", what);
}

/* Layer il's backward from its saved input x_in: g holds the gradient of the layer's output (the
 * final norm's for the top layer) on entry and the gradient of its input on return. */
static rg_status segment(const rg_segments * s, int il, const float * x_in, float * g, bool top) {
    rg_engine * e = s->e;
    const int D = e->model->hp.n_embd, T = s->batch->n_tokens;
    struct ggml_init_params ip = { e->ctx_mem_size, e->ctx_mem, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return rg_fail(RG_ERR_NOMEM, "out of host memory for a layer's graph context");
    rg_graph_build b = {
        .model = e->model, .lora = s->lora, .ctx = ctx, .n_tokens = T, .train = true, .exact_ops = e->exact_ops, .tiled_attention = !e->dense_attention,
        .matmul = e->matmul, .dropout = s->batch->lora_dropout > 0.0f,
        .on_cpu = e->model->backend == e->model->backend_cpu,
    };
    rg_build_layer_inputs(&b);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D, T);
    ggml_format_name(x, "layer_in-%d", il);
    ggml_set_input(x);
    if (il > 0) ggml_set_param(x);        /* the layer below needs this input's gradient */
    struct ggml_tensor * y = rg_build_layer(&b, il, x);
    if (!y) return segment_fail(ctx, RG_ERR_COMPUTE, b.error);
    if (top) y = rg_build_final_norm(&b, y);
    struct ggml_tensor * gy = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D, T);
    ggml_set_name(gy, "grad_out");
    ggml_set_input(gy);
    struct ggml_tensor * loss = ggml_sum(ctx, ggml_mul(ctx, y, gy));
    ggml_set_name(loss, "surrogate_loss");
    ggml_set_loss(loss);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, e->graph_size, true);
    ggml_build_forward_expand(gf, loss);
    const int n_fwd = ggml_graph_n_nodes(gf);
    struct ggml_tensor ** accs = rg_calloc((size_t) n_fwd, sizeof(*accs), "the gradient accumulators");
    if (!accs) return segment_fail(ctx, RG_ERR_NOMEM, "out of memory for the gradient accumulators");
    int n_params = 0;
    for (int i = 0; i < n_fwd; i++) {
        struct ggml_tensor * node = ggml_graph_node(gf, i);
        if ((node->flags & GGML_TENSOR_FLAG_PARAM) && node != x) {
            accs[i] = rg_engine_grad_of_param(s->lora, node);
            n_params += accs[i] != NULL;
        }
    }
    if (n_params == 0 && il == 0) {       /* nothing to train here and nothing below */
        free(accs);
        ggml_free(ctx);
        return RG_OK;
    }
    ggml_build_backward_expand(ctx, gf, accs);
    free(accs);
    struct ggml_tensor * loss_grad = ggml_graph_get_grad_acc(gf, loss);
    ggml_set_input(loss_grad);
    struct ggml_tensor * gx = il > 0 ? ggml_graph_get_grad(gf, x) : NULL;
    if (il > 0 && !gx) return segment_fail(ctx, RG_ERR_COMPUTE, "internal error: a layer's input got no gradient");
    if (gx) ggml_set_output(gx);
    struct ggml_cgraph * run = rg_graph_rewrite(&b, gf, e->graph_size);

    ggml_backend_sched_reset(e->sched);
    ggml_backend_sched_set_tensor_backend(e->sched, x, e->model->backend);
    ggml_backend_sched_set_tensor_backend(e->sched, gy, e->model->backend);
    if (!ggml_backend_sched_alloc_graph(e->sched, run)) {
        ggml_free(ctx);
        return rg_fail(RG_ERR_NOMEM, "could not allocate layer %d's graph (%d tokens)", il, T);
    }
    const double mib = (double) ggml_backend_sched_get_buffer_size(e->sched, e->model->backend) / (1024.0 * 1024.0);
    if (mib > e->timings.graph_mib) e->timings.graph_mib = mib;
    const size_t act = sizeof(float) * (size_t) D * (size_t) T;
    ggml_backend_tensor_set(b.inp_pos, s->batch->positions, 0, sizeof(int32_t) * (size_t) T);
    const rg_status sa = rg_set_attention_inputs(&b, s->batch);
    if (sa != RG_OK) {
        ggml_backend_sched_reset(e->sched);
        ggml_free(ctx);
        return sa;
    }
    if (b.inp_dropout && b.inp_dropout->buffer) {
        int32_t params[4];
        rg_dropout_params(s->batch, params);
        ggml_backend_tensor_set(b.inp_dropout, params, 0, sizeof(params));
    }
    ggml_backend_tensor_set(x, x_in, 0, act);
    ggml_backend_tensor_set(gy, g, 0, act);
    const float one = 1.0f;
    ggml_backend_tensor_set(loss_grad, &one, 0, sizeof(float));
    rg_status st = RG_OK;
    if (ggml_backend_sched_graph_compute(e->sched, run) != GGML_STATUS_SUCCESS) {
        st = rg_fail(RG_ERR_COMPUTE, "layer %d's recomputed backward failed", il);
    } else if (gx) {
        ggml_backend_tensor_get(gx, g, 0, act);
    }
    ggml_backend_sched_reset(e->sched);
    ggml_free(ctx);
    return st;
}

rg_status rg_engine_accumulate_recompute(rg_engine * e, rg_lora * lora, const rg_batch * batch, rg_coeff_fn fn,
                                         void * user, int want_entropy, int want_hidden, float * logp_out) {
    rg_prepared p;
    rg_status st = rg_engine_prepare(e, lora, batch, RG_BUILD_TRAIN_FORWARD, &p);
    if (st) return st;
    batch = &p.pb.b;
    const int L = e->model->hp.n_layer, D = e->model->hp.n_embd, T = batch->n_tokens;
    const size_t act = (size_t) D * (size_t) T;
    /* every layer's input (copied by the eval callback as the forward reaches it) and the hidden
     * state's gradient */
    float * saved = rg_malloc(sizeof(float) * act * (size_t) (L + 1), "the layers' saved inputs");
    if (!saved) {
        rg_engine_release(e, &p);
        return RG_ERR_NOMEM;
    }
    rg_run r = {
        .e = e, .batch = batch, .n_real = p.n_real, .hidden = p.o.b.hidden, .grad_hidden = p.o.grad_hidden, .fn = fn,
        .user = user, .want_entropy = want_entropy, .want_hidden = want_hidden, .logp = logp_out, .status = RG_OK,
        .lora_rank = lora->rank, .saved = saved, .layer_in = p.o.b.layer_in, .n_layer_in = L,
    };
    r.t_start = rg_now_ms();
    e->prof_last = r.t_start;
    ggml_backend_sched_set_eval_callback(e->sched, rg_engine_on_node, &r);
    const enum ggml_status gs = ggml_backend_sched_graph_compute(e->sched, p.o.gf);
    ggml_backend_sched_set_eval_callback(e->sched, NULL, NULL);
    if (r.status != RG_OK) st = rg_fail(r.status, "%s", r.error);
    else if (gs != GGML_STATUS_SUCCESS) st = rg_fail(RG_ERR_COMPUTE, "training forward computation failed");
    else if (r.t_hidden == 0) st = rg_fail(RG_ERR_COMPUTE, "the scheduler never reached the hidden state");
    else if (r.n_copied != L) st = rg_fail(RG_ERR_COMPUTE, "internal error: %d of %d layer inputs reached", r.n_copied, L);
    float * g = saved + act * (size_t) L;
    if (st == RG_OK) ggml_backend_tensor_get(p.o.grad_hidden, g, 0, sizeof(float) * act);
    /* the graph context's memory is e->ctx_mem, which the layers' graphs reuse */
    ggml_backend_sched_reset(e->sched);
    ggml_free(p.o.ctx);
    p.o.ctx = NULL;
    const double t0 = rg_now_ms();
    const rg_segments s = { e, lora, batch };
    for (int il = L - 1; il >= 0 && st == RG_OK; il--) {
        st = segment(&s, il, saved + act * (size_t) il, g, il == L - 1);
    }
    e->timings.backward_ms += rg_now_ms() - t0;
    free(saved);
    rg_engine_release(e, &p);
    return st;
}
