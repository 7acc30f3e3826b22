/*
 * engine.c - the engine's face: creation and settings, forward, top-k, gradient accumulation,
 * AdamW and the profile. A micro-batch's graph (checked and padded batch, build, allocation, the
 * eval callback that runs the LM head) is microbatch.c's; activation checkpointing's training path
 * is recompute.c's; preflight is preflight.c's.
 */
#include "engine_impl.h"
#include "retrograd_test.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t graph_size_for(const rg_model * m) {
    return 4096 + (size_t) m->hp.n_layer * 1024;
}

/* Everything an engine holds; on failure the caller frees what was made. */
static rg_status engine_setup(rg_engine * e, rg_model * model) {
    e->model = model;
    e->graph_size = graph_size_for(model);
    ggml_backend_t backends[2] = { model->backend, model->backend_cpu };
    const int n_backends = model->backend_cpu != model->backend ? 2 : 1;
    e->sched = ggml_backend_sched_new(backends, NULL, n_backends, e->graph_size, false, false);
    if (!e->sched) return rg_fail(RG_ERR_DEVICE, "could not create the backend scheduler");
    /* Issue 38: on Mesa's lavapipe (llvmpipe, a Vulkan device on the CPU) device training died in
     * 10 of 36 runs - a SIGSEGV or a glibc heap abort on the driver's queue thread during the first
     * AdamW step, calling through a freed object. Waiting for each node of the training graph (as
     * node tracing and profiling do) made it go away; serializing ggml-vulkan's submissions
     * (GGML_VK_SERIALIZE_SUBMISSIONS) and LP_NUM_THREADS=0 did not. A race between the driver and
     * ggml-vulkan, contained here, not fixed: ~10% of a step on lavapipe, nothing elsewhere. */
    const char * desc = ggml_backend_dev_description(model->dev);
    e->sync_nodes = model->backend != model->backend_cpu && desc && strstr(desc, "llvmpipe") &&
                    !rg_vk_no_sync();
    e->opt_galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(model->backend));
    if (!e->opt_galloc) return rg_fail(RG_ERR_NOMEM, "could not create the optimizer's graph allocator");
    e->head = rg_head_new(model);
    if (!e->head) return RG_ERR_NOMEM;
    rg_matmul_decide(RG_MATMUL_AUTO, RG_KERNEL_AUTO, &e->matmul);    /* the default, always valid */
    rg_head_set_matmul(e->head, &e->matmul);
    /* tensors and graphs of one build: forward + backward + rewrite */
    e->ctx_mem_size = ggml_tensor_overhead() * e->graph_size * 4 + ggml_graph_overhead_custom(e->graph_size, true) * 2;
    e->ctx_mem = rg_malloc(e->ctx_mem_size, "the graph metadata");
    return e->ctx_mem ? RG_OK : RG_ERR_NOMEM;
}

rg_status rg_engine_init(rg_model * model, rg_engine ** out) {
    *out = NULL;
    rg_engine * e = rg_calloc(1, sizeof(*e), "the engine");
    if (!e) return RG_ERR_NOMEM;
    const rg_status st = engine_setup(e, model);
    if (st == RG_OK) *out = e;
    else rg_engine_free(e);
    return st;
}

void rg_engine_free(rg_engine * e) {
    if (!e) return;
    rg_head_free(e->head);
    ggml_gallocr_free(e->opt_galloc);
    ggml_backend_sched_free(e->sched);
    free(e->ctx_mem);
    free(e);
}

rg_status rg_engine_set_matmul(rg_engine * e, int mode, int kernel) {
    rg_matmul mm;
    const rg_status st = rg_matmul_decide(mode, kernel, &mm);
    if (st) return st;      /* the engine as it was */
    e->matmul = mm;
    rg_head_set_matmul(e->head, &mm);
    return RG_OK;
}

/* a switch's value: 0 or 1, else RG_ERR_ARG naming the setting */
static rg_status switch_value(int on, const char * what, bool * out) {
    if (on != 0 && on != 1) return rg_fail(RG_ERR_ARG, "%s: expected 0 or 1, got %d", what, on);
    *out = on == 1;
    return RG_OK;
}

rg_status rg_engine_set_exact_ops(rg_engine * e, int on) { return switch_value(on, "exact ops", &e->exact_ops); }

rg_status rg_engine_set_attention(rg_engine * e, int mode) {
    if (mode != RG_ATTENTION_TILED && mode != RG_ATTENTION_DENSE) return rg_fail(RG_ERR_ARG, "unknown attention mode %d", mode);
    e->dense_attention = mode == RG_ATTENTION_DENSE;
    return RG_OK;
}

rg_status rg_engine_set_recompute(rg_engine * e, int on) {
    return switch_value(on, "activation checkpointing", &e->recompute);
}

void rg_engine_get_timings(const rg_engine * e, rg_timings * out) { *out = e->timings; }

/* ---- forward only ---------------------------------------------------------------------------- */
/* The trunk, then the targets' log-probs (logp_out) and, with topk > 0, each target row's top-k. */
static rg_status forward_impl(rg_engine * e, rg_lora * lora, const rg_batch * batch, float * logp_out,
                              float * entropy_out, float * hidden_out, int topk, int32_t * topk_ids,
                              float * topk_logp) {
    rg_prepared p;
    rg_status st = rg_engine_prepare(e, lora, batch, RG_BUILD_FORWARD, &p);
    if (st) return st;
    batch = &p.pb.b;
    const rg_built * o = &p.o;
    const double t0 = rg_now_ms();
    ggml_backend_sched_set_eval_callback(e->sched, NULL, NULL);
    if (ggml_backend_sched_graph_compute(e->sched, o->gf) != GGML_STATUS_SUCCESS) {
        st = rg_fail(RG_ERR_COMPUTE, "forward computation failed");
    }
    e->timings.forward_ms += rg_now_ms() - t0;
    if (st == RG_OK && batch->n_targets > 0) {
        st = topk > 0 ? rg_head_topk(e->head, o->b.hidden, batch, topk, topk_ids, topk_logp, logp_out)
                      : rg_head_forward(e->head, o->b.hidden, batch, logp_out, entropy_out, false, 0);
        e->timings.head_ms += rg_head_ms(e->head, true);
    }
    if (st == RG_OK && hidden_out) {
        ggml_backend_tensor_get(o->b.hidden, hidden_out, 0, (size_t) p.n_real * o->b.hidden->nb[1]);
    }
    rg_engine_release(e, &p);
    return st;
}

rg_status rg_engine_forward(rg_engine * e, rg_lora * lora, const rg_batch * batch,
                            float * logp_out, float * entropy_out, float * hidden_out) {
    return forward_impl(e, lora, batch, logp_out, entropy_out, hidden_out, 0, NULL, NULL);
}

rg_status rg_engine_topk(rg_engine * e, rg_lora * lora, const rg_batch * batch, int k,
                         int32_t * ids_out, float * logp_out, float * target_logp_out) {
    if (k < 1) return rg_fail(RG_ERR_ARG, "top-k: k must be >= 1, got %d", k);
    return forward_impl(e, lora, batch, target_logp_out, NULL, NULL, k, ids_out, logp_out);
}

/* ---- training micro-batch --------------------------------------------------------------------- */
rg_status rg_engine_accumulate(rg_engine * e, rg_lora * lora, const rg_batch * batch,
                               rg_coeff_fn fn, void * user, int want_entropy, int want_hidden,
                               float * logp_out) {
    if (!lora) return rg_fail(RG_ERR_ARG, "training needs a LoRA adapter");
    if (lora->model != e->model) return rg_fail(RG_ERR_ARG, "the LoRA adapter belongs to another model");
    if (e->recompute) return rg_engine_accumulate_recompute(e, lora, batch, fn, user, want_entropy, want_hidden, logp_out);
    rg_prepared p;
    rg_status st = rg_engine_prepare(e, lora, batch, RG_BUILD_TRAIN, &p);
    if (st) return st;
    batch = &p.pb.b;
    const rg_built * o = &p.o;
    rg_run r = {
        .e = e, .batch = batch, .n_real = p.n_real, .hidden = o->b.hidden, .grad_hidden = o->grad_hidden, .fn = fn, .user = user,
        .want_entropy = want_entropy, .want_hidden = want_hidden, .logp = logp_out, .status = RG_OK,
        .lora_rank = lora->rank,
    };
    r.t_start = rg_now_ms();
    e->prof_last = r.t_start;
    ggml_backend_sched_set_eval_callback(e->sched, rg_engine_on_node, &r);
    const enum ggml_status gs = ggml_backend_sched_graph_compute(e->sched, o->gf);
    ggml_backend_sched_set_eval_callback(e->sched, NULL, NULL);
    if (rg_trace_nodes()) fprintf(stderr, "retrograd: training graph done (status %d)\n", (int) gs);
    const double t1 = rg_now_ms();
    if (r.t_hidden > 0) e->timings.backward_ms += t1 - r.t_hidden;
    if (r.status != RG_OK) {
        st = rg_fail(r.status, "%s", r.error);
    } else if (gs != GGML_STATUS_SUCCESS) {
        st = rg_fail(RG_ERR_COMPUTE, "training graph computation failed");
    } else if (r.t_hidden == 0) {
        st = rg_fail(RG_ERR_COMPUTE, "the scheduler never reached the hidden state");
    }
    rg_engine_release(e, &p);
    return st;
}

/* ---- optimizer ------------------------------------------------------------------------------ */
/* NULL (error set) when host memory runs out */
static struct ggml_context * opt_ctx(const rg_lora * l) {
    const size_t n = (size_t) rg_lora_tensor_count(l) * 6 + 16;
    struct ggml_init_params ip = { ggml_tensor_overhead() * n + ggml_graph_overhead_custom(n, false), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) rg_fail(RG_ERR_NOMEM, "out of host memory for the optimizer graph");
    return ctx;
}

static size_t opt_graph_size(const rg_lora * l) { return (size_t) rg_lora_tensor_count(l) * 6 + 16; }

rg_status rg_engine_adamw(rg_engine * e, rg_lora * l, const rg_adamw * p, float * grad_norm_out) {
    const double t0 = rg_now_ms();
    if (p->step < 1) return rg_fail(RG_ERR_ARG, "AdamW step must be >= 1, got %lld", (long long) p->step);
    if (rg_trace_nodes()) fprintf(stderr, "retrograd: optimizer step %lld\n", (long long) p->step);
    const int n = rg_lora_tensor_count(l);
    struct ggml_tensor ** grads = rg_malloc(sizeof(*grads) * 4 * (size_t) n, "the optimizer's tensor lists");
    if (!grads) return RG_ERR_NOMEM;
    struct ggml_tensor ** params = grads + n, ** ms = params + n, ** vs = ms + n;
    for (int i = 0; i < n; i++) {
        const rg_lora_slotset * s = rg_lora_slots(l, i);
        params[i] = s->t[RG_SLOT_PARAM];
        grads[i] = s->t[RG_SLOT_GRAD];
        ms[i] = s->t[RG_SLOT_ADAM_M];
        vs[i] = s->t[RG_SLOT_ADAM_V];
    }
    rg_status st = RG_OK;

    /* global norm of the accumulated gradient */
    float sq = 0;
    struct ggml_context * ctx = opt_ctx(l);
    if (!ctx) st = RG_ERR_NOMEM;
    if (ctx) {
        struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, opt_graph_size(l), false);
        struct ggml_tensor * total = NULL;
        for (int i = 0; i < n; i++) {
            struct ggml_tensor * s = ggml_sum(ctx, ggml_sqr(ctx, grads[i]));
            total = total ? ggml_add(ctx, total, s) : s;
        }
        ggml_set_output(total);
        ggml_build_forward_expand(gf, total);
        if (!ggml_gallocr_alloc_graph(e->opt_galloc, gf)) {
            st = rg_fail(RG_ERR_NOMEM, "could not allocate the gradient norm's graph");
        } else if (ggml_backend_graph_compute(e->model->backend, gf) != GGML_STATUS_SUCCESS) {
            st = rg_fail(RG_ERR_COMPUTE, "gradient norm computation failed");
        } else {
            ggml_backend_tensor_get(total, &sq, 0, sizeof(float));
        }
        if (rg_trace_nodes()) fprintf(stderr, "retrograd: gradient norm^2 %g\n", (double) sq);
        ggml_free(ctx);
    }
    const float norm = sqrtf(sq) * fabsf(p->grad_scale);
    if (grad_norm_out) *grad_norm_out = norm;
    if (st == RG_OK && !isfinite(norm)) {
        st = rg_fail(RG_ERR_NONFINITE, "the gradient norm is not finite; the update was skipped");
    }
    float coef = p->grad_scale;
    if (p->grad_clip > 0 && norm > p->grad_clip) coef *= p->grad_clip / norm;
    if (st == RG_OK && !(ctx = opt_ctx(l))) st = RG_ERR_NOMEM;
    if (st == RG_OK) {
        struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, opt_graph_size(l), false);
        /* hyper-parameters of the A matrices, of the B matrices (LoRA+ gives them their own lr)
         * and of DoRA's magnitudes (A's lr, no weight decay: m is a row norm, not a correction
         * that should shrink towards zero) */
        struct ggml_tensor * hp = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 7);
        struct ggml_tensor * hp_b = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 7);
        struct ggml_tensor * hp_m = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 7);
        ggml_set_input(hp);
        ggml_set_input(hp_b);
        ggml_set_input(hp_m);
        for (int i = 0; i < n; i++) {
            struct ggml_tensor * g = coef == 1.0f ? grads[i] : ggml_scale(ctx, grads[i], coef);
            const int kind = i % l->per_pair;
            ggml_build_forward_expand(gf, ggml_opt_step_adamw(ctx, params[i], g, ms[i], vs[i],
                                                              kind == 0 ? hp : kind == 1 ? hp_b : hp_m));
        }
        if (!ggml_gallocr_alloc_graph(e->opt_galloc, gf)) {
            st = rg_fail(RG_ERR_NOMEM, "could not allocate the optimizer's graph");
        } else {
            const float b1h = 1.0f / (1.0f - powf(p->beta1, (float) p->step));
            const float b2h = 1.0f / (1.0f - powf(p->beta2, (float) p->step));
            const float v[7] = { p->lr, p->beta1, p->beta2, p->eps, p->weight_decay, b1h, b2h };
            const float ratio = p->lr_b_ratio > 0 ? p->lr_b_ratio : 1.0f;
            const float vb[7] = { p->lr * ratio, p->beta1, p->beta2, p->eps, p->weight_decay, b1h, b2h };
            const float vm[7] = { p->lr, p->beta1, p->beta2, p->eps, 0.0f, b1h, b2h };
            ggml_backend_tensor_set(hp, v, 0, sizeof(v));
            ggml_backend_tensor_set(hp_b, vb, 0, sizeof(vb));
            if (hp_m->buffer) ggml_backend_tensor_set(hp_m, vm, 0, sizeof(vm));
            if (ggml_backend_graph_compute(e->model->backend, gf) != GGML_STATUS_SUCCESS) {
                st = rg_fail(RG_ERR_COMPUTE, "optimizer step failed");
            }
            if (rg_trace_nodes()) fprintf(stderr, "retrograd: AdamW graph done\n");
        }
        ggml_free(ctx);
    }
    rg_lora_zero(l, RG_SLOT_GRAD);
    free(grads);
    e->timings.optimizer_ms += rg_now_ms() - t0;
    return st;
}

/* ---- profiling ------------------------------------------------------------------------------ */
rg_status rg_engine_set_profiling(rg_engine * e, int on) { return switch_value(on, "profiling", &e->profiling); }
int rg_engine_profile_count(const rg_engine * e) { return rg_profile_count(&e->prof); }
rg_status rg_engine_profile_get(const rg_engine * e, int index, rg_profile_entry * out) {
    return rg_profile_get(&e->prof, index, out);
}
void rg_engine_profile_reset(rg_engine * e) { rg_profile_reset(&e->prof); }
