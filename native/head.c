/*
 * head.c - the LM head, computed outside autodiff.
 *
 * The trunk graph stops at the final hidden state h. Here we compute, only for the rows that
 * carry targets, logits = W_out h, the softmax, and the log-probs of the requested tokens
 * (phase A). Given per-target coefficients c_k = d(loss)/d(logp_k), the gradient at the logits
 * of row r is  sum_k c_k onehot(y_k) - (sum_k c_k) softmax_r,  and d(loss)/d(h) = W_out^T of it
 * (phase B). Doing this by hand instead of through ggml's autodiff keeps the [vocab x tokens]
 * tensors to one softmax store, and lets the W_out^T product go through a dequantized,
 * transposed copy of one vocabulary slice at a time (ggml's default would run OUT_PROD on the
 * quantized matrix, ~10x slower on the CPU).
 *
 * log p is computed as logit - lse with lse = logit[argmax] - log softmax[argmax], which stays
 * exact where log(softmax) of a tiny probability would not.
 */
#include "rg_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* transient logits per chunk: 32 MiB (170 rows of the default model's vocabulary) kept a GRPO step
 * of the default model within 1 GiB, where 64 MiB did not; but at least HEAD_MIN_CHUNK rows, since
 * each chunk's product reads all of W_out (320 MiB packed on Gemma 3's 262k vocabulary) */
#define HEAD_LOGITS_BYTES (32u << 20)
#define HEAD_MIN_CHUNK    64
#define HEAD_VOCAB_SLICE  8192          /* rows of W_out dequantized at a time in phase B */
#define HEAD_MAX_NODES    512

struct rg_head {
    rg_model            * model;
    /* the backend the head's graphs run on: the model's on the CPU; on another device an instance
     * of its own, because the head runs inside the training graph's eval callback and graphs of a
     * second owner on the scheduler's Vulkan instance corrupted memory on lavapipe (issue 14) */
    ggml_backend_t        backend;
    ggml_gallocr_t        galloc;
    /* softmax store: P [n_vocab, cap] */
    struct ggml_context * store_ctx;
    ggml_backend_buffer_t store_buf;
    struct ggml_tensor  * store;
    int                   store_cap;
    bool                  store_valid;     /* holds the softmax of every selected row */
    /* selected rows of the current batch */
    int32_t             * rows;            /* sorted unique target rows */
    int                   n_rows;
    int32_t             * col_of_target;   /* column in rows[] of each target */
    int                   cap_rows, cap_targets;
    int                   chunk;           /* columns per chunk */
    /* the engine's decision (rg_head_set_matmul): exact (F32 mode) multiplies by an F32 transposed
     * W_out in phase B (the finite-difference tests), the others by W_out slices converted to
     * mm.conv_type (F16 or BF16), or through mm.kernel where that is a packed kernel */
    rg_matmul             mm;
    bool                  exact;
    /* W_out packed for gemm.c as stored, made by the first forward that multiplies through it and
     * kept, as the base never changes (V x n_embd 16-bit values: 54 MiB on the default model); packed
     * again only for an engine whose kernel reads another layout */
    struct ggml_context * wpack_ctx;
    ggml_backend_buffer_t wpack_buf;
    struct ggml_tensor  * wpack;
    double                ms;
};

rg_head * rg_head_new(rg_model * model) {
    rg_head * h = rg_calloc(1, sizeof(*h), "the LM head");
    if (!h) return NULL;
    h->model = model;
    rg_matmul mm;
    rg_matmul_decide(RG_MATMUL_AUTO, RG_KERNEL_AUTO, &mm);    /* the default, always valid */
    rg_head_set_matmul(h, &mm);
    h->backend = model->backend == model->backend_cpu ? model->backend : ggml_backend_dev_init(model->dev, NULL);
    h->galloc = h->backend ? ggml_gallocr_new(ggml_backend_get_default_buffer_type(model->backend)) : NULL;
    if (!h->galloc) {
        if (h->backend && h->backend != model->backend) ggml_backend_free(h->backend);
        free(h);
        rg_fail(RG_ERR_NOMEM, "could not create the LM head's graph allocator");
        return NULL;
    }
    return h;
}

static void free_store(rg_head * h) {
    if (h->store_buf) ggml_backend_buffer_free(h->store_buf);
    if (h->store_ctx) ggml_free(h->store_ctx);
    h->store_buf = NULL;
    h->store_ctx = NULL;
    h->store = NULL;
    h->store_cap = 0;
    h->store_valid = false;
}

static void free_wpack(rg_head * h) {
    if (h->wpack_buf) ggml_backend_buffer_free(h->wpack_buf);
    if (h->wpack_ctx) ggml_free(h->wpack_ctx);
    h->wpack_buf = NULL;
    h->wpack_ctx = NULL;
    h->wpack = NULL;
}

/* whether the head's products go through gemm.c: a quantized W_out (an F32 or F16 one keeps ggml's
 * product, which rounds nothing or less) on the CPU, where the engine's decision names a packed
 * kernel (BF16 ones on an AVX512-BF16 CPU, F16 ones on AVX2, or the one forced) */
static bool packed_route(const rg_head * h) {
    return !h->exact && ggml_is_quantized(h->model->output->type) && h->model->backend == h->model->backend_cpu &&
           rg_matmul_packed(&h->mm);
}

/* the packing op's own output is the kept tensor: no transient copy of W_out */
static rg_status ensure_wpack(rg_head * h) {
    if (h->wpack && rg_packed_weight_fits(h->wpack, h->model->output, false, h->mm.kernel)) return RG_OK;
    free_wpack(h);      /* none yet, or packed for another kernel (the engine's setting changed since) */
    const size_t meta = ggml_tensor_overhead() * 4 + ggml_graph_overhead_custom(4, false);
    struct ggml_init_params ip = { meta, NULL, true };
    h->wpack_ctx = ggml_init(ip);
    struct ggml_context * gctx = ggml_init(ip);
    rg_status st = RG_OK;
    if (!h->wpack_ctx || !gctx) {
        st = rg_fail(RG_ERR_NOMEM, "out of host memory for the LM head's packed W_out");
    } else {
        h->wpack = rg_pack_weight(h->wpack_ctx, h->model->output, false, h->mm.kernel);
        h->wpack_buf = ggml_backend_alloc_ctx_tensors_from_buft(h->wpack_ctx, ggml_backend_cpu_buffer_type());
        if (!h->wpack_buf) {
            st = rg_fail(RG_ERR_NOMEM, "could not allocate the LM head's packed W_out (%.0f MiB)",
                         (double) ggml_nbytes(h->wpack) / (1 << 20));
        } else {
            struct ggml_cgraph * gf = ggml_new_graph_custom(gctx, 4, false);
            ggml_build_forward_expand(gf, h->wpack);
            if (ggml_backend_graph_compute(h->model->backend_cpu, gf) != GGML_STATUS_SUCCESS) {
                st = rg_fail(RG_ERR_COMPUTE, "could not pack the LM head's W_out");
            }
        }
    }
    if (gctx) ggml_free(gctx);
    if (st) free_wpack(h);
    return st;
}

void rg_head_free(rg_head * h) {
    if (!h) return;
    free_store(h);
    free_wpack(h);
    ggml_gallocr_free(h->galloc);
    if (h->backend != h->model->backend) ggml_backend_free(h->backend);
    free(h->rows);
    free(h->col_of_target);
    free(h);
}

void rg_head_set_matmul(rg_head * h, const rg_matmul * mm) {
    h->mm = *mm;
    h->exact = mm->mode == RG_MATMUL_F32;
}

double rg_head_ms(rg_head * h, bool reset) {
    const double ms = h->ms;
    if (reset) h->ms = 0;
    return ms;
}

static rg_status ensure_store(rg_head * h, int cols) {
    if (h->store && h->store_cap >= cols) return RG_OK;
    free_store(h);
    struct ggml_init_params ip = { ggml_tensor_overhead() * 2, NULL, true };
    h->store_ctx = ggml_init(ip);
    if (!h->store_ctx) return rg_fail(RG_ERR_NOMEM, "out of host memory for the LM head softmax store");
    h->store = ggml_new_tensor_2d(h->store_ctx, GGML_TYPE_F32, h->model->hp.n_vocab, cols);
    ggml_set_name(h->store, "head_softmax_store");
    h->store_buf = ggml_backend_alloc_ctx_tensors_from_buft(
        h->store_ctx, ggml_backend_get_default_buffer_type(h->model->backend));
    if (!h->store_buf) {
        free_store(h);
        return rg_fail(RG_ERR_NOMEM, "could not allocate the LM head softmax store (%d rows)", cols);
    }
    h->store_cap = cols;
    return RG_OK;
}

static int cmp_i32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

static rg_status select_rows(rg_head * h, const rg_batch * batch) {
    const int K = batch->n_targets;
    if (K > h->cap_targets) {
        /* on failure the old arrays (still cap_targets long) stay */
        int32_t * rows = realloc(h->rows, sizeof(int32_t) * (size_t) K);
        if (rows) h->rows = rows;
        int32_t * cols = rows ? realloc(h->col_of_target, sizeof(int32_t) * (size_t) K) : NULL;
        if (cols) h->col_of_target = cols;
        if (!rows || !cols) return rg_fail(RG_ERR_NOMEM, "out of host memory for the rows of %d targets", K);
        h->cap_targets = K;
    }
    for (int k = 0; k < K; k++) {
        const int32_t r = batch->target_rows[k], y = batch->target_ids[k];
        if (r < 0 || r >= batch->n_tokens) return rg_fail(RG_ERR_ARG, "target %d: row %d outside the batch of %d tokens", k, r, batch->n_tokens);
        if (y < 0 || y >= h->model->hp.n_vocab) return rg_fail(RG_ERR_ARG, "target %d: token id %d outside the vocabulary of %d", k, y, h->model->hp.n_vocab);
        h->rows[k] = r;
    }
    qsort(h->rows, (size_t) K, sizeof(int32_t), cmp_i32);
    int n = 0;
    for (int k = 0; k < K; k++) {
        if (n == 0 || h->rows[n - 1] != h->rows[k]) h->rows[n++] = h->rows[k];
    }
    h->n_rows = n;
    for (int k = 0; k < K; k++) {
        const int32_t * hit = bsearch(&batch->target_rows[k], h->rows, (size_t) n, sizeof(int32_t), cmp_i32);
        h->col_of_target[k] = (int32_t) (hit - h->rows);
    }
    const size_t col_bytes = (size_t) h->model->hp.n_vocab * sizeof(float);
    h->chunk = (int) (HEAD_LOGITS_BYTES / col_bytes);
    if (h->chunk < HEAD_MIN_CHUNK) h->chunk = HEAD_MIN_CHUNK;
    if (h->chunk > n) h->chunk = n > 0 ? n : 1;
    return RG_OK;
}

static rg_status compute(rg_head * h, struct ggml_cgraph * gf) {
    if (!ggml_gallocr_alloc_graph(h->galloc, gf)) return rg_fail(RG_ERR_NOMEM, "could not allocate the LM head's graph");
    return RG_OK;
}

static rg_status run(rg_head * h, struct ggml_cgraph * gf) {
    if (rg_trace_nodes()) {
        for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
            const struct ggml_tensor * t = ggml_graph_node(gf, i);
            fprintf(stderr, "retrograd: LM head node: %s %s [%lld,%lld]%s\n", ggml_op_desc(t), ggml_get_name(t),
                    (long long) t->ne[0], (long long) t->ne[1],
                    ggml_backend_dev_supports_op(h->model->dev, t) ? "" : " (not supported by the device)");
        }
        fflush(stderr);
    }
    if (ggml_backend_graph_compute(h->backend, gf) != GGML_STATUS_SUCCESS) {
        return rg_fail(RG_ERR_COMPUTE, "LM head: graph computation failed");
    }
    if (rg_trace_nodes()) {
        ggml_backend_synchronize(h->backend);
        fprintf(stderr, "retrograd: LM head graph done\n");
        fflush(stderr);
    }
    return RG_OK;
}

/* logits [V, n] for columns c0..c0+n of the selected rows */
static struct ggml_tensor * chunk_logits(rg_head * h, struct ggml_context * ctx, struct ggml_tensor * hidden,
                                         struct ggml_tensor ** idx_out, int n) {
    struct ggml_tensor * idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_name(idx, "head_rows");
    ggml_set_input(idx);
    *idx_out = idx;
    /* a parentless alias, so this graph does not pull in the trunk that produced hidden */
    struct ggml_tensor * hs = ggml_get_rows(ctx, ggml_view_tensor(ctx, hidden), idx);
    struct ggml_tensor * w = h->model->output;
    /* exact mode: no rounding of activations anywhere, so the head is smooth too */
    if (h->exact && w->type != GGML_TYPE_F32) w = ggml_cast(ctx, w, GGML_TYPE_F32);
    struct ggml_tensor * logits = h->wpack && packed_route(h) && rg_pack_act_fits(hs)
        ? rg_gemm(ctx, h->wpack, rg_pack_act(ctx, hs, h->mm.kernel), w->ne[1], n)
        : ggml_mul_mat(ctx, w, hs);
    ggml_set_name(logits, "head_logits");
    return logits;
}

/* the graph of one chunk of selected rows: its own context, and the chunk's logits (with the input
 * idx of their rows) unless no hidden state is given */
typedef struct {
    struct ggml_context * ctx;
    struct ggml_cgraph  * gf;
    struct ggml_tensor  * idx, * logits;
} rg_chunk;

static rg_status chunk_open(rg_head * h, struct ggml_tensor * hidden, int n, rg_chunk * c) {
    struct ggml_init_params ip = {
        ggml_tensor_overhead() * HEAD_MAX_NODES + ggml_graph_overhead_custom(HEAD_MAX_NODES, false), NULL, true,
    };
    memset(c, 0, sizeof(*c));
    if (hidden && packed_route(h)) {
        rg_status st = ensure_wpack(h);
        if (st) return st;
    }
    c->ctx = ggml_init(ip);
    if (!c->ctx) return rg_fail(RG_ERR_NOMEM, "out of host memory for an LM head graph");
    c->gf = ggml_new_graph_custom(c->ctx, HEAD_MAX_NODES, false);
    if (hidden) c->logits = chunk_logits(h, c->ctx, hidden, &c->idx, n);
    return RG_OK;
}

rg_status rg_head_forward(rg_head * h, struct ggml_tensor * hidden, const rg_batch * batch,
                          float * logp, float * entropy, bool keep, size_t budget) {
    const double t0 = rg_now_ms();
    rg_status st = select_rows(h, batch);
    if (st) return st;
    const int V = h->model->hp.n_vocab;
    const int K = batch->n_targets;
    h->store_valid = false;
    /* host scratch in one block: per selected row lse, dot; per target tl, flat, which; per chunk
     * column pm, lm */
    const size_t nr = (size_t) (h->n_rows > 0 ? h->n_rows : 1), nk = (size_t) (K > 0 ? K : 1);
    float * scratch = rg_malloc(sizeof(float) * (2 * nr + 3 * nk + 2 * (size_t) h->chunk), "the LM head");
    if (!scratch) return RG_ERR_NOMEM;
    float * lse = scratch, * dot = lse + nr, * tl = dot + nr;
    int32_t * flat = (int32_t *) (tl + nk), * which = flat + nk;
    float * pm = (float *) (which + nk), * lm = pm + h->chunk;
    if (keep && (size_t) V * (size_t) h->n_rows * sizeof(float) <= budget) {
        if ((st = ensure_store(h, h->n_rows))) {
            free(scratch);
            return st;
        }
        h->store_valid = true;
    }
    const bool want_entropy = entropy != NULL;

    for (int c0 = 0; c0 < h->n_rows && st == RG_OK; c0 += h->chunk) {
        const int n = h->n_rows - c0 < h->chunk ? h->n_rows - c0 : h->chunk;
        /* targets whose row falls in this chunk */
        int nk = 0;
        for (int k = 0; k < K; k++) {
            const int col = h->col_of_target[k];
            if (col >= c0 && col < c0 + n) {
                which[nk] = k;
                flat[nk] = (col - c0) * V + batch->target_ids[k];
                nk++;
            }
        }
        rg_chunk c;
        if ((st = chunk_open(h, hidden, n, &c))) break;
        struct ggml_context * ctx = c.ctx;
        struct ggml_cgraph * gf = c.gf;
        struct ggml_tensor * logits = c.logits;
        struct ggml_tensor * p = ggml_soft_max(ctx, logits);
        ggml_set_name(p, "head_softmax");
        if (h->store_valid) {
            /* compute the softmax straight into the store */
            ggml_backend_tensor_alloc(h->store_buf, p, (char *) h->store->data + (size_t) c0 * h->store->nb[1]);
        }
        struct ggml_tensor * am = ggml_argmax(ctx, logits);
        struct ggml_tensor * pmax = ggml_get_rows(ctx, ggml_reshape_3d(ctx, p, 1, V, n), ggml_reshape_2d(ctx, am, 1, n));
        struct ggml_tensor * lmax = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, V, n), ggml_reshape_2d(ctx, am, 1, n));
        struct ggml_tensor * fidx = NULL, * tgt = NULL, * pl = NULL;
        if (nk > 0) {
            fidx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, nk);
            ggml_set_input(fidx);
            tgt = ggml_get_rows(ctx, ggml_reshape_2d(ctx, logits, 1, (int64_t) V * n), fidx);
            ggml_set_output(tgt);
            ggml_build_forward_expand(gf, tgt);
        }
        if (want_entropy) {
            pl = ggml_sum_rows(ctx, ggml_mul(ctx, p, logits));
            ggml_set_output(pl);
            ggml_build_forward_expand(gf, pl);
        }
        ggml_set_output(pmax);
        ggml_set_output(lmax);
        ggml_build_forward_expand(gf, p);
        ggml_build_forward_expand(gf, pmax);
        ggml_build_forward_expand(gf, lmax);
        st = compute(h, gf);
        if (st == RG_OK) {
            ggml_backend_tensor_set(c.idx, h->rows + c0, 0, sizeof(int32_t) * (size_t) n);
            if (fidx) ggml_backend_tensor_set(fidx, flat, 0, sizeof(int32_t) * (size_t) nk);
            st = run(h, gf);
        }
        if (st == RG_OK) {
            ggml_backend_tensor_get(pmax, pm, 0, sizeof(float) * (size_t) n);
            ggml_backend_tensor_get(lmax, lm, 0, sizeof(float) * (size_t) n);
            for (int j = 0; j < n; j++) lse[c0 + j] = lm[j] - logf(pm[j]);
            if (pl) ggml_backend_tensor_get(pl, dot + c0, 0, sizeof(float) * (size_t) n);
            if (nk > 0) {
                ggml_backend_tensor_get(tgt, tl, 0, sizeof(float) * (size_t) nk);
                for (int i = 0; i < nk; i++) logp[which[i]] = tl[i] - lse[h->col_of_target[which[i]]];
            }
        }
        ggml_free(ctx);
    }
    if (st == RG_OK && want_entropy) {
        for (int k = 0; k < K; k++) {
            const int col = h->col_of_target[k];
            entropy[k] = lse[col] - dot[col];
        }
    }
    if (st != RG_OK) h->store_valid = false;
    free(scratch);
    h->ms += rg_now_ms() - t0;
    return st;
}

/* W_out^T d for d = [V, n]: one dequantized, transposed vocabulary slice at a time (through gemm.c
 * where it runs, the slice packed transposed) */
static struct ggml_tensor * head_transpose_product(rg_head * h, struct ggml_context * ctx, struct ggml_tensor * d, bool f32) {
    struct ggml_tensor * w = h->model->output;
    const int64_t V = w->ne[1];
    const bool packed = !f32 && packed_route(h);
    struct ggml_tensor * acc = NULL;
    for (int64_t v0 = 0; v0 < V; v0 += HEAD_VOCAB_SLICE) {
        const int64_t nv = V - v0 < HEAD_VOCAB_SLICE ? V - v0 : HEAD_VOCAB_SLICE;
        struct ggml_tensor * ws = ggml_view_2d(ctx, w, w->ne[0], nv, w->nb[1], (size_t) v0 * w->nb[1]);
        struct ggml_tensor * ds = ggml_view_2d(ctx, d, nv, d->ne[1], d->nb[1], (size_t) v0 * sizeof(float));
        struct ggml_tensor * part;   /* [n_embd, n] */
        if (packed && rg_pack_act_fits(ds)) {
            part = rg_gemm(ctx, rg_pack_weight(ctx, ws, true, h->mm.kernel), rg_pack_act(ctx, ds, h->mm.kernel), w->ne[0],
                           d->ne[1]);
        } else {
            struct ggml_tensor * wt = f32 ? ggml_cont(ctx, ggml_transpose(ctx, ggml_cast(ctx, ws, GGML_TYPE_F32)))
                                          : rg_dequant(ctx, ws, true, h->mm.conv_type);   /* [nv, n_embd] */
            part = ggml_mul_mat(ctx, wt, ds);
        }
        acc = acc ? ggml_add(ctx, acc, part) : part;
    }
    return acc;
}

rg_status rg_head_backward(rg_head * h, struct ggml_tensor * hidden, struct ggml_tensor * grad_hidden,
                           const rg_batch * batch, const float * logp, const float * coeff) {
    const double t0 = rg_now_ms();
    const int V = h->model->hp.n_vocab;
    const int K = batch->n_targets;
    rg_status st = RG_OK;
    /* host scratch in one block: per target sidx, sval; per selected row csum; per chunk column negs */
    const size_t nr = (size_t) (h->n_rows > 0 ? h->n_rows : 1), nk = (size_t) (K > 0 ? K : 1);
    /* with the softmax stored, every row in one pass: each vocabulary slice of W_out is converted
     * once per micro-batch, not once per chunk of the forward's (on Gemma 3's 262k vocabulary the
     * forward's chunks are 64 rows, and converting all of W_out 4 times a micro-batch was a third
     * of the step). Without the store the logits are recomputed, a chunk's worth at a time. */
    const int chunk = h->store_valid ? (int) nr : h->chunk;
    int64_t * sidx = rg_malloc(sizeof(int64_t) * nk + sizeof(float) * (nk + nr + (size_t) chunk), "the LM head gradient");
    if (!sidx) {
        h->store_valid = false;
        return RG_ERR_NOMEM;
    }
    float * sval = (float *) (sidx + nk), * csum = sval + nk, * negs = csum + nr;
    memset(csum, 0, sizeof(float) * nr);
    for (int k = 0; k < K; k++) csum[h->col_of_target[k]] += coeff[k];

    for (int c0 = 0; c0 < h->n_rows && st == RG_OK; c0 += chunk) {
        const int n = h->n_rows - c0 < chunk ? h->n_rows - c0 : chunk;
        /* sparse entries: at (col, y) the gradient is sum of its coefficients - csum * p(y) */
        int ns = 0;
        for (int k = 0; k < K; k++) {
            const int col = h->col_of_target[k];
            if (col < c0 || col >= c0 + n) continue;
            const int64_t f = (int64_t) (col - c0) * V + batch->target_ids[k];
            int found = -1;
            for (int i = 0; i < ns; i++) if (sidx[i] == f) { found = i; break; }
            if (found < 0) {
                found = ns++;
                sidx[found] = f;
                sval[found] = -csum[col] * expf(logp[k]);
            }
            sval[found] += coeff[k];
        }
        for (int j = 0; j < n; j++) negs[j] = -csum[c0 + j];

        rg_chunk c;   /* without the store, the softmax is recomputed from the logits */
        if ((st = chunk_open(h, h->store_valid ? NULL : hidden, n, &c))) break;
        struct ggml_context * ctx = c.ctx;
        struct ggml_cgraph * gf = c.gf;
        struct ggml_tensor * ridx;
        struct ggml_tensor * p = h->store_valid
            ? ggml_view_2d(ctx, h->store, V, n, h->store->nb[1], (size_t) c0 * h->store->nb[1])
            : ggml_soft_max(ctx, c.logits);
        struct ggml_tensor * s = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, n);
        ggml_set_input(s);
        struct ggml_tensor * d = ggml_mul_inplace(ctx, p, s);
        struct ggml_tensor * si = NULL, * sv = NULL;
        if (ns > 0) {
            si = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, ns);
            sv = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, ns);
            ggml_set_input(si);
            ggml_set_input(sv);
            struct ggml_tensor * dflat = ggml_set_rows(ctx, ggml_reshape_2d(ctx, d, 1, (int64_t) V * n), sv, si);
            d = ggml_reshape_2d(ctx, dflat, V, n);
        }
        /* convert.c's op is a CPU kernel: another device casts with ggml's own ops (this graph runs on
         * the model's backend as a whole, with no scheduler to move a node to the CPU) */
        const bool own_kernel = !h->exact && h->model->backend == h->model->backend_cpu;
        struct ggml_tensor * dh = head_transpose_product(h, ctx, d, !own_kernel);
        ridx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        ggml_set_input(ridx);
        struct ggml_tensor * out = ggml_set_rows(ctx, ggml_view_tensor(ctx, grad_hidden), dh, ridx);
        ggml_build_forward_expand(gf, out);
        st = compute(h, gf);
        if (st == RG_OK) {
            if (c.idx) ggml_backend_tensor_set(c.idx, h->rows + c0, 0, sizeof(int32_t) * (size_t) n);
            ggml_backend_tensor_set(ridx, h->rows + c0, 0, sizeof(int32_t) * (size_t) n);
            ggml_backend_tensor_set(s, negs, 0, sizeof(float) * (size_t) n);
            if (ns > 0) {
                ggml_backend_tensor_set(si, sidx, 0, sizeof(int64_t) * (size_t) ns);
                ggml_backend_tensor_set(sv, sval, 0, sizeof(float) * (size_t) ns);
            }
            st = run(h, gf);
        }
        ggml_free(ctx);
    }
    h->store_valid = false;   /* consumed: the store now holds gradients */
    free(sidx);
    h->ms += rg_now_ms() - t0;
    return st;
}

/* ---- top-k ---------------------------------------------------------------------------------- */
/* The k largest of row[0..V) by value, best first, into ids/vals (insertion into a sorted list:
 * after the first few hundred entries almost every value fails the first comparison). */
static void row_topk(const float * row, int V, int k, int32_t * ids, float * vals) {
    int n = 0;
    for (int v = 0; v < V; v++) {
        const float x = row[v];
        if (n == k && x <= vals[k - 1]) continue;
        int i = n < k ? n++ : k - 1;
        while (i > 0 && vals[i - 1] < x) {
            vals[i] = vals[i - 1];
            ids[i] = ids[i - 1];
            i--;
        }
        vals[i] = x;
        ids[i] = v;
    }
}

rg_status rg_head_topk(rg_head * h, struct ggml_tensor * hidden, const rg_batch * batch, int k,
                       int32_t * ids_out, float * logp_out, float * target_logp) {
    const double t0 = rg_now_ms();
    rg_status st = select_rows(h, batch);
    if (st) return st;
    const int V = h->model->hp.n_vocab;
    const int K = batch->n_targets;
    if (k < 1 || k > V) return rg_fail(RG_ERR_ARG, "top-k: k = %d outside 1..%d", k, V);
    h->store_valid = false;
    /* host scratch in one block: the logits of a chunk, its rows' lse, per selected row the top k */
    const size_t nr = (size_t) (h->n_rows > 0 ? h->n_rows : 1), chunk = (size_t) h->chunk;
    float * host = rg_malloc(sizeof(float) * ((size_t) V * chunk + chunk + 2 * (size_t) k * nr), "the top-k logits");
    if (!host) return RG_ERR_NOMEM;
    float * lses = host + (size_t) V * chunk, * rlp = lses + chunk;
    int32_t * rid = (int32_t *) (rlp + (size_t) k * nr);
    for (int c0 = 0; c0 < h->n_rows && st == RG_OK; c0 += h->chunk) {
        const int n = h->n_rows - c0 < h->chunk ? h->n_rows - c0 : h->chunk;
        rg_chunk c;
        if ((st = chunk_open(h, hidden, n, &c))) break;
        ggml_set_output(c.logits);
        ggml_build_forward_expand(c.gf, c.logits);
        st = compute(h, c.gf);
        if (st == RG_OK) {
            ggml_backend_tensor_set(c.idx, h->rows + c0, 0, sizeof(int32_t) * (size_t) n);
            st = run(h, c.gf);
        }
        if (st == RG_OK) {
            ggml_backend_tensor_get(c.logits, host, 0, sizeof(float) * (size_t) V * (size_t) n);
            for (int j = 0; j < n; j++) {
                const float * row = host + (size_t) j * V;
                int32_t * ids = rid + (size_t) (c0 + j) * k;
                float * vals = rlp + (size_t) (c0 + j) * k;
                row_topk(row, V, k, ids, vals);
                double sum = 0.0;
                for (int v = 0; v < V; v++) sum += exp((double) row[v] - vals[0]);
                const float lse = vals[0] + (float) log(sum);
                for (int i = 0; i < k; i++) vals[i] -= lse;
                lses[j] = lse;
            }
            if (target_logp) {
                for (int t = 0; t < K; t++) {
                    const int col = h->col_of_target[t];
                    if (col < c0 || col >= c0 + n) continue;
                    target_logp[t] = host[(size_t) (col - c0) * V + batch->target_ids[t]] - lses[col - c0];
                }
            }
        }
        ggml_free(c.ctx);
    }
    if (st == RG_OK) {
        for (int t = 0; t < K; t++) {
            const int col = h->col_of_target[t];
            memcpy(ids_out + (size_t) t * k, rid + (size_t) col * k, sizeof(int32_t) * (size_t) k);
            memcpy(logp_out + (size_t) t * k, rlp + (size_t) col * k, sizeof(float) * (size_t) k);
        }
    }
    free(host);
    h->ms += rg_now_ms() - t0;
    return st;
}
