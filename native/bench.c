/*
 * bench.c - one ggml product timed on the CPU: what the profile's FLOP rates are compared with.
 *
 * The profile of a training step says how many FLOP/s each op reached; this says what ggml's own
 * kernel reaches on a plain product of the same kind on this machine, in the same process, so the
 * two can be read side by side (a 2-core VM's speed drifts by a third from one minute to the
 * next, so a peak measured yesterday is no yardstick). The packed product (gemm.c, whichever kernel
 * runs: BF16, or F16 weights on AVX2) gets the same treatment: where it runs, it is the fastest
 * product the step uses, so the machine's peak. Here too the packed product's check against an
 * oracle (rg_gemm_check), the tests' way in to it.
 */
#include "rg_internal.h"
#include "retrograd_test.h"

#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

const void * rg_ggml_init_address(void) { return (const void *) ggml_init; }

/* values in [-1, 1): any will do, not zeros */
static void fill(float * x, int64_t n) {
    uint32_t s = 12345u;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float) ((int32_t) (s >> 9) - (1 << 22)) / (float) (1 << 22);
    }
}

/* seconds per computation of gf (one warm-up, then the mean of reps) */
static rg_status time_graph(struct ggml_cgraph * gf, int n_threads, int reps, const char * what, double * seconds_out) {
    struct ggml_cplan plan = ggml_graph_plan(gf, n_threads, NULL);
    void * work = plan.work_size ? malloc(plan.work_size) : NULL;
    if (plan.work_size && !work) return rg_fail(RG_ERR_NOMEM, "%s: out of host memory for the work buffer", what);
    plan.work_data = work;
    rg_status st = RG_OK;
    double t0 = 0;
    for (int r = -1; r < reps && st == RG_OK; r++) {           /* r = -1 warms up */
        if (r == 0) t0 = rg_now_ms();
        if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) st = rg_fail(RG_ERR_COMPUTE, "%s: the product failed", what);
    }
    free(work);
    if (st == RG_OK) *seconds_out = (rg_now_ms() - t0) / 1000.0 / reps;
    return st;
}

rg_status rg_matmul_bench(int type, int64_t m, int64_t n, int64_t k, int n_threads, int reps, double * seconds_out) {
    if (type < 0 || type >= GGML_TYPE_COUNT || m < 1 || n < 1 || k < 1 || n_threads < 1 || reps < 1) {
        return rg_fail(RG_ERR_ARG, "matmul bench: bad arguments (type %d, %lld x %lld x %lld, %d threads, %d reps)",
                       type, (long long) m, (long long) n, (long long) k, n_threads, reps);
    }
    const enum ggml_type t = (enum ggml_type) type;
    if (k % ggml_blck_size(t) != 0) return rg_fail(RG_ERR_ARG, "matmul bench: k must be a multiple of %lld", (long long) ggml_blck_size(t));
    const size_t bytes = ggml_row_size(t, k) * (size_t) m + sizeof(float) * (size_t) (k * n + m * n + k * m) +
                         ggml_tensor_overhead() * 8 + ggml_graph_overhead() + (1u << 20);
    struct ggml_init_params ip = { bytes, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return rg_fail(RG_ERR_NOMEM, "matmul bench: out of host memory (%zu bytes)", bytes);
    struct ggml_tensor * a = ggml_new_tensor_2d(ctx, t, k, m);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    float * src = malloc(sizeof(float) * (size_t) (k * m));
    if (!src) {
        ggml_free(ctx);
        return rg_fail(RG_ERR_NOMEM, "matmul bench: out of host memory");
    }
    fill(src, k * m);
    for (int64_t i = 0; i < k * n; i++) ((float *) x->data)[i] = src[i % (k * m)];
    if (t == GGML_TYPE_F32) {
        for (int64_t i = 0; i < k * m; i++) ((float *) a->data)[i] = src[i];
    } else if (t == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(src, a->data, k * m);
    } else {
        ggml_quantize_chunk(t, src, a->data, 0, m, k, NULL);
    }
    free(src);
    struct ggml_tensor * y = ggml_mul_mat(ctx, a, x);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    rg_status st = time_graph(gf, n_threads, reps, "matmul bench", seconds_out);
    ggml_free(ctx);
    return st;
}

/* the packed kernel a benchmark or check asked for (RG_KERNEL_AUTO: the CPU's own), decided as for an
 * engine in the mode that converts to its type */
static rg_status packed_kernel(int kernel, const char * what, int * out) {
    if (kernel == RG_KERNEL_GGML) return rg_fail(RG_ERR_ARG, "%s: ggml's product is no packed kernel", what);
    rg_matmul mm;
    const int mode = kernel == RG_KERNEL_AVX2_F16 ? RG_MATMUL_F16
                   : kernel == RG_KERNEL_AUTO     ? RG_MATMUL_AUTO : RG_MATMUL_BF16;
    const rg_status st = rg_matmul_decide(mode, kernel, &mm);
    if (st) return st;
    if (!rg_matmul_packed(&mm)) return rg_fail(RG_ERR_UNSUPPORTED, "%s: no packed kernel runs on this CPU", what);
    *out = mm.kernel;
    return RG_OK;
}

rg_status rg_gemm_bench(int kernel, int64_t m, int64_t n, int64_t k, int n_threads, int reps, double * seconds_out) {
    rg_status st = packed_kernel(kernel, "gemm bench", &kernel);
    if (st) return st;
    if (m < 1 || n < 1 || k < 1 || n_threads < 1 || reps < 1) {
        return rg_fail(RG_ERR_ARG, "gemm bench: bad arguments (%lld x %lld x %lld, %d threads, %d reps)",
                       (long long) m, (long long) n, (long long) k, n_threads, reps);
    }
    /* generous: both operands packed twice (the packing ops' outputs and their plain copies) */
    const size_t pad = 2 * (size_t) (k + 64) * (size_t) (m + n + 64);
    const size_t bytes = sizeof(float) * (size_t) (k * m + k * n + m * n) + 4 * pad + ggml_tensor_overhead() * 16 +
                         2 * ggml_graph_overhead() + (1u << 20);
    struct ggml_init_params ip = { bytes, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return rg_fail(RG_ERR_NOMEM, "gemm bench: out of host memory (%zu bytes)", bytes);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m), * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    fill(w->data, k * m);
    fill(x->data, k * n);
    /* pack once; the timed graph multiplies plain copies, so only the product runs */
    struct ggml_tensor * pw = rg_pack_weight(ctx, w, false, kernel), * px = rg_pack_act(ctx, x, kernel);
    struct ggml_cgraph * gp = ggml_new_graph(ctx);
    ggml_build_forward_expand(gp, pw);
    ggml_build_forward_expand(gp, px);
    st = ggml_graph_compute_with_ctx(ctx, gp, n_threads) == GGML_STATUS_SUCCESS
        ? RG_OK : rg_fail(RG_ERR_COMPUTE, "gemm bench: packing failed");
    if (st == RG_OK) {
        struct ggml_tensor * cw = ggml_dup_tensor(ctx, pw), * cx = ggml_dup_tensor(ctx, px);
        memcpy(cw->data, pw->data, ggml_nbytes(pw));
        memcpy(cx->data, px->data, ggml_nbytes(px));
        struct ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, rg_gemm(ctx, cw, cx, m, n));
        st = time_graph(gf, n_threads, reps, "gemm bench", seconds_out);
    }
    ggml_free(ctx);
    return st;
}

/* ---- the packed product checked against an oracle ------------------------------------------- */
rg_status rg_gemm_check(int kernel, int type, const float * w, int64_t n_out, int64_t n_in, const float * x,
                        int64_t n_tokens, int transposed, const float * v, const float * z, int rank, int n_threads,
                        float * out, float * w_dequant) {
    const rg_status valid = packed_kernel(kernel, "gemm check", &kernel);
    if (valid) return valid;
    if (type < 0 || type >= GGML_TYPE_COUNT || n_out < 1 || n_in < 1 || n_tokens < 1 || n_threads < 1) {
        return rg_fail(RG_ERR_ARG, "gemm check: bad arguments (type %d, %lld x %lld, %lld tokens, %d threads)", type,
                       (long long) n_out, (long long) n_in, (long long) n_tokens, n_threads);
    }
    const enum ggml_type t = (enum ggml_type) type;
    if (t != GGML_TYPE_F32 && (!ggml_is_quantized(t) || n_in % ggml_blck_size(t) != 0)) {
        return rg_fail(RG_ERR_ARG, "gemm check: type %s with rows of %lld", ggml_type_name(t), (long long) n_in);
    }
    const int64_t k = transposed ? n_out : n_in, rows = transposed ? n_in : n_out;
    /* generous for every kernel's packing: 16-bit weights and F32 activations, padded to 32 */
    const size_t pad = (size_t) (k + 32) * (size_t) (2 * (rows + 32) + 4 * (n_tokens + 32));
    const size_t bytes = ggml_row_size(t, n_in) * (size_t) n_out + sizeof(float) * (size_t) (k * n_tokens + rows * n_tokens) +
                         pad + sizeof(float) * (size_t) (rank * (rows + n_tokens)) + ggml_tensor_overhead() * 8 +
                         ggml_graph_overhead() + (1u << 20);
    struct ggml_init_params ip = { bytes, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return rg_fail(RG_ERR_NOMEM, "gemm check: out of host memory (%zu bytes)", bytes);
    struct ggml_tensor * wq = ggml_new_tensor_2d(ctx, t, n_in, n_out);
    ggml_set_name(wq, "w");
    if (t == GGML_TYPE_F32) memcpy(wq->data, w, sizeof(float) * (size_t) (n_in * n_out));
    else ggml_quantize_chunk(t, w, wq->data, 0, n_out, n_in, NULL);
    for (int64_t r = 0; r < n_out; r++) {
        const char * row = (const char *) wq->data + r * wq->nb[1];
        if (t == GGML_TYPE_F32) memcpy(w_dequant + r * n_in, row, sizeof(float) * (size_t) n_in);
        else ggml_get_type_traits(t)->to_float(row, w_dequant + r * n_in, n_in);
    }
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n_tokens);
    ggml_set_name(xt, "x");
    memcpy(xt->data, x, sizeof(float) * (size_t) (k * n_tokens));
    struct ggml_tensor * pw = rg_pack_weight(ctx, wq, transposed != 0, kernel), * px = rg_pack_act(ctx, xt, kernel), * y;
    if (rank > 0 && v && z) {
        struct ggml_tensor * vt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, rows, rank);
        struct ggml_tensor * zt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, rank, n_tokens);
        memcpy(vt->data, v, sizeof(float) * (size_t) (rows * rank));
        memcpy(zt->data, z, sizeof(float) * (size_t) (rank * n_tokens));
        y = rg_gemm_lowrank(ctx, pw, px, vt, zt);
    } else {
        y = rg_gemm(ctx, pw, px, rows, n_tokens);
    }
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    rg_status st = ggml_graph_compute_with_ctx(ctx, gf, n_threads) == GGML_STATUS_SUCCESS
        ? RG_OK : rg_fail(RG_ERR_COMPUTE, "gemm check: the product failed");
    if (st == RG_OK) memcpy(out, y->data, sizeof(float) * (size_t) (rows * n_tokens));
    ggml_free(ctx);
    return st;
}
