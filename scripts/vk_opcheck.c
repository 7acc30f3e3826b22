/*
 * vk_opcheck.c - the ops of retrograd's training graph, one small graph each, on a GPU backend
 * against the CPU: which op a device gets wrong or crashes on (issue 14's lavapipe crash).
 * Each case runs in a child process, so a crash in the driver names its op and the rest go on.
 *
 *   bash scripts/vk_opcheck.sh            (builds this against .venv-vulkan's ggml and runs it)
 *
 * Shapes are a SmolLM2 micro-batch's: T tokens, H heads of D dims, width E = H * D.
 */
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { H = 9, D = 64, E = H * D, F = 1536, R = 16 };
static int T = 64;       /* tokens: the first argument */

typedef struct ggml_tensor * (*build_fn)(struct ggml_context * ctx, struct ggml_tensor ** in, int * n_in);

/* inputs are filled with the same pseudo-random values on both backends */
static struct ggml_tensor * input(struct ggml_context * ctx, struct ggml_tensor ** in, int * n_in, int64_t a,
                                  int64_t b, int64_t c) {
    struct ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a, b, c);
    ggml_set_input(t);
    in[(*n_in)++] = t;
    return t;
}

static struct ggml_tensor * mask_input(struct ggml_context * ctx, struct ggml_tensor ** in, int * n_in) {
    struct ggml_tensor * m = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, T, T);
    ggml_set_input(m);
    ggml_set_name(m, "mask");
    in[(*n_in)++] = m;
    return m;
}

static struct ggml_tensor * c_soft_max(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * kq = input(ctx, in, n, T, T, H);
    return ggml_soft_max_ext(ctx, kq, mask_input(ctx, in, n), 0.125f, 0.0f);
}
static struct ggml_tensor * c_soft_max_back(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * dy = input(ctx, in, n, T, T, H);
    struct ggml_tensor * y = ggml_soft_max(ctx, input(ctx, in, n, T, T, H));
    return ggml_soft_max_ext_back(ctx, dy, y, 0.125f, 0.0f);
}
static struct ggml_tensor * c_rope(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * x = input(ctx, in, n, D, H, T);
    struct ggml_tensor * pos = ggml_arange(ctx, 0.0f, (float) T, 1.0f);
    pos = ggml_cast(ctx, pos, GGML_TYPE_I32);
    return ggml_rope_ext(ctx, x, pos, NULL, D, 2, 8192, 100000.0f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
}
static struct ggml_tensor * c_rope_back(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * x = input(ctx, in, n, D, H, T);
    struct ggml_tensor * pos = ggml_cast(ctx, ggml_arange(ctx, 0.0f, (float) T, 1.0f), GGML_TYPE_I32);
    return ggml_rope_ext_back(ctx, x, pos, NULL, D, 2, 8192, 100000.0f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
}
static struct ggml_tensor * c_rms_norm_back(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * dy = input(ctx, in, n, E, T, 1);
    return ggml_rms_norm_back(ctx, dy, input(ctx, in, n, E, T, 1), 1e-5f);
}
static struct ggml_tensor * c_out_prod(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * a = input(ctx, in, n, E, T, 1);
    struct ggml_tensor * b = input(ctx, in, n, R, T, 1);
    return ggml_out_prod(ctx, a, b);
}
static struct ggml_tensor * c_out_prod_t(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * a = input(ctx, in, n, E, T, 1);
    struct ggml_tensor * z = input(ctx, in, n, T, R, 1);
    return ggml_out_prod(ctx, a, ggml_transpose(ctx, z));     /* LoRA's weight gradient, as autodiff writes it */
}
static struct ggml_tensor * c_silu_back(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * dy = input(ctx, in, n, F, T, 1);
    return ggml_silu_back(ctx, dy, input(ctx, in, n, F, T, 1));
}
static struct ggml_tensor * c_swiglu(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * g = input(ctx, in, n, F, T, 1);
    return ggml_swiglu_split(ctx, g, input(ctx, in, n, F, T, 1));
}
static struct ggml_tensor * c_repeat_back(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * x = input(ctx, in, n, E, T, 1);
    return ggml_repeat_back(ctx, x, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, E));
}
static struct ggml_tensor * c_cont_permute(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * x = input(ctx, in, n, D, H, T);
    return ggml_cont(ctx, ggml_permute(ctx, x, 1, 2, 0, 3));
}
static struct ggml_tensor * c_mul_mat_heads(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * k = ggml_permute(ctx, input(ctx, in, n, D, H, T), 0, 2, 1, 3);
    struct ggml_tensor * q = ggml_permute(ctx, input(ctx, in, n, D, H, T), 0, 2, 1, 3);
    return ggml_mul_mat(ctx, k, q);
}
static struct ggml_tensor * c_add_back_chain(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    /* an attention block's forward and backward built by ggml's autodiff, on the device */
    struct ggml_tensor * q = input(ctx, in, n, D, H, T);
    struct ggml_tensor * k = input(ctx, in, n, D, H, T);
    ggml_set_param(q);
    struct ggml_tensor * kq = ggml_mul_mat(ctx, ggml_permute(ctx, k, 0, 2, 1, 3), ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3)));
    struct ggml_tensor * p = ggml_soft_max_ext(ctx, kq, mask_input(ctx, in, n), 0.125f, 0.0f);
    return ggml_sum(ctx, ggml_sqr(ctx, p));
}

/* the LM head works on whole vocabulary rows (V = 49152 on SmolLM2) */
enum { V = 49152, NR = 8 };
static struct ggml_tensor * c_head_soft_max(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    return ggml_soft_max(ctx, input(ctx, in, n, V, NR, 1));
}
static struct ggml_tensor * c_head_argmax(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    return ggml_cast(ctx, ggml_argmax(ctx, input(ctx, in, n, V, NR, 1)), GGML_TYPE_F32);
}
static struct ggml_tensor * c_head_sum_rows(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    return ggml_sum_rows(ctx, input(ctx, in, n, V, NR, 1));
}
static struct ggml_tensor * c_head_get_rows(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * x = input(ctx, in, n, E, T, 1);
    struct ggml_tensor * idx = ggml_cast(ctx, ggml_arange(ctx, 0.0f, (float) NR, 1.0f), GGML_TYPE_I32);
    return ggml_get_rows(ctx, x, idx);
}

static struct ggml_tensor * c_head_q8_to_f32(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * w = ggml_cast(ctx, input(ctx, in, n, E, 8192, 1), GGML_TYPE_Q8_0);
    return ggml_cont(ctx, ggml_transpose(ctx, ggml_cast(ctx, w, GGML_TYPE_F32)));
}
static struct ggml_tensor * c_head_q8_to_f32_view(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    /* the LM head's slice: a view 8192 rows into the embedding matrix, cast to F32 */
    struct ggml_tensor * w = ggml_cast(ctx, input(ctx, in, n, E, 16384, 1), GGML_TYPE_Q8_0);
    struct ggml_tensor * ws = ggml_view_2d(ctx, w, E, 8192, w->nb[1], 8192 * w->nb[1]);
    return ggml_cast(ctx, ws, GGML_TYPE_F32);
}
/* the LM head's backward product W^T d: the F32 transposed weight slice against the gradient of
 * the logits ([V, rows]); HV and HR come from the environment (defaults: SmolLM2's slice) */
static struct ggml_tensor * c_head_product(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    const int64_t hv = getenv("HV") ? atoll(getenv("HV")) : 8192, hr = getenv("HR") ? atoll(getenv("HR")) : T;
    const int64_t he = getenv("HE") ? atoll(getenv("HE")) : E;
    struct ggml_tensor * w = ggml_cast(ctx, input(ctx, in, n, he, hv, 1), GGML_TYPE_Q8_0);
    struct ggml_tensor * wt = ggml_cont(ctx, ggml_transpose(ctx, ggml_cast(ctx, w, GGML_TYPE_F32)));
    return ggml_mul_mat(ctx, wt, input(ctx, in, n, hv, hr, 1));
}
static struct ggml_tensor * c_head_set_rows(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * dst = input(ctx, in, n, E, 96, 1);
    struct ggml_tensor * src = input(ctx, in, n, E, 14, 1);
    struct ggml_tensor * idx = ggml_cast(ctx, ggml_arange(ctx, 0.0f, 14.0f, 1.0f), GGML_TYPE_I32);
    return ggml_set_rows(ctx, dst, src, idx);
}

static struct ggml_tensor * c_adamw(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * w = input(ctx, in, n, E, R, 1);
    struct ggml_tensor * g = input(ctx, in, n, E, R, 1);
    struct ggml_tensor * m = input(ctx, in, n, E, R, 1);
    struct ggml_tensor * v = ggml_sqr(ctx, input(ctx, in, n, E, R, 1));
    struct ggml_tensor * hp = input(ctx, in, n, 7, 1, 1);        /* filled with values in (-1, 1): checks the op only */
    ggml_set_param(w);
    return ggml_opt_step_adamw(ctx, w, g, m, v, ggml_abs(ctx, hp));
}
static struct ggml_tensor * c_grad_norm(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    return ggml_add(ctx, ggml_sum(ctx, ggml_sqr(ctx, input(ctx, in, n, E, R, 1))),
                    ggml_sum(ctx, ggml_sqr(ctx, input(ctx, in, n, R, E, 1))));
}

static struct ggml_tensor * c_grad_norm_420(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    /* the optimizer's norm graph: a sum of squares per adapter tensor (420 on SmolLM2), added up */
    struct ggml_tensor * x = input(ctx, in, n, E, 4 * 420, 1);
    struct ggml_tensor * total = NULL;
    for (int i = 0; i < 420; i++) {
        struct ggml_tensor * v = ggml_view_2d(ctx, x, E, 4, x->nb[1], (size_t) i * 4 * x->nb[1]);
        struct ggml_tensor * s = ggml_sum(ctx, ggml_sqr(ctx, v));
        total = total ? ggml_add(ctx, total, s) : s;
    }
    return total;
}

static struct ggml_tensor * c_repeat_scalar(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    /* the surrogate loss's backward: the unit gradient of a sum, repeated over [E, T] and multiplied */
    struct ggml_tensor * one = input(ctx, in, n, 1, 1, 1);
    struct ggml_tensor * g = input(ctx, in, n, E, T, 1);
    return ggml_mul(ctx, ggml_repeat(ctx, one, g), g);
}

typedef struct { const char * name; build_fn fn; bool backward; } op_case;

static const op_case k_cases[] = {
    { "SOFT_MAX (mask, scale)", c_soft_max, false },
    { "SOFT_MAX_BACK", c_soft_max_back, false },
    { "ROPE (neox)", c_rope, false },
    { "ROPE_BACK", c_rope_back, false },
    { "RMS_NORM_BACK", c_rms_norm_back, false },
    { "OUT_PROD", c_out_prod, false },
    { "OUT_PROD (transposed b)", c_out_prod_t, false },
    { "SILU_BACK", c_silu_back, false },
    { "SWIGLU (split)", c_swiglu, false },
    { "REPEAT_BACK", c_repeat_back, false },
    { "REPEAT of a scalar, then MUL", c_repeat_scalar, false },
    { "CONT (permuted)", c_cont_permute, false },
    { "MUL_MAT (permuted heads)", c_mul_mat_heads, false },
    { "attention + autodiff backward", c_add_back_chain, true },
    { "head: SOFT_MAX over the vocabulary", c_head_soft_max, false },
    { "head: ARGMAX over the vocabulary", c_head_argmax, false },
    { "head: SUM_ROWS over the vocabulary", c_head_sum_rows, false },
    { "head: GET_ROWS", c_head_get_rows, false },
    { "head: CPY Q8_0 -> F32, transposed", c_head_q8_to_f32, false },
    { "head: CPY Q8_0 view -> F32", c_head_q8_to_f32_view, false },
    { "head: SET_ROWS", c_head_set_rows, false },
    { "head: backward product W^T d", c_head_product, false },
    { "optimizer: OPT_STEP_ADAMW", c_adamw, false },
    { "optimizer: gradient norm", c_grad_norm, false },
    { "optimizer: gradient norm, 420 tensors", c_grad_norm_420, false },
};

static void fill(float * x, size_t n, unsigned seed, bool mask) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = ((float) (seed >> 8) / (float) (1u << 24)) * 2.0f - 1.0f;
        if (mask) x[i] = (i % T) <= (i / T) ? 0.0f : -INFINITY;
    }
}

/* runs the case on backend; result (floats) into out, returns its length (-1: failure) */
static long run_case(const op_case * c, ggml_backend_t be, float * out, size_t cap) {
    struct ggml_init_params ip = { ggml_tensor_overhead() * 4096 + ggml_graph_overhead_custom(4096, true), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * in[8] = { 0 };
    int n_in = 0;
    struct ggml_tensor * y = c->fn(ctx, in, &n_in);
    ggml_set_output(y);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4096, true);
    ggml_build_forward_expand(gf, y);
    struct ggml_tensor * grad_of = NULL;
    if (c->backward) {
        ggml_set_loss(y);
        ggml_build_backward_expand(ctx, gf, NULL);
        grad_of = ggml_graph_get_grad(gf, in[0]);
        ggml_set_output(grad_of);
    }
    ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
    if (!ggml_gallocr_alloc_graph(ga, gf)) return -1;
    for (int i = 0; i < n_in; i++) {
        size_t k = (size_t) ggml_nelements(in[i]);
        float * v = malloc(k * sizeof(float));
        fill(v, k, 1234u + (unsigned) i, strcmp(ggml_get_name(in[i]), "mask") == 0);
        ggml_backend_tensor_set(in[i], v, 0, k * sizeof(float));
        free(v);
    }
    ggml_graph_reset(gf);
    if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) return -1;
    struct ggml_tensor * r = grad_of ? grad_of : y;
    size_t k = (size_t) ggml_nelements(r);
    if (k > cap) k = cap;
    ggml_backend_tensor_get(r, out, 0, k * sizeof(float));
    ggml_gallocr_free(ga);
    ggml_free(ctx);
    return (long) k;
}

/* the engine's gradient accumulation: the training graph adds each gradient in place into a tensor
 * of the adapter's own buffer (ggml_build_backward_expand with grad_accs), through ggml_backend_sched
 * with the device and the CPU; returns the accumulator's sum after one run (the CPU alone: 0) */
static double accumulate_in_place(ggml_backend_t dev, ggml_backend_t cpu, bool use_sched) {
    struct ggml_init_params ip_acc = { ggml_tensor_overhead() * 4, NULL, true };
    struct ggml_context * actx = ggml_init(ip_acc);
    struct ggml_tensor * acc = ggml_new_tensor_2d(actx, GGML_TYPE_F32, E, R);
    ggml_backend_buffer_t abuf = ggml_backend_alloc_ctx_tensors(actx, dev);
    ggml_backend_buffer_clear(abuf, 0);
    struct ggml_init_params ip = { ggml_tensor_overhead() * 64 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, E, R);
    ggml_set_input(x);
    struct ggml_tensor * y = ggml_add_inplace(ctx, acc, ggml_scale(ctx, x, 2.0f));
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    float * v = malloc(sizeof(float) * E * R);
    for (int i = 0; i < E * R; i++) v[i] = 1.0f;
    if (use_sched) {
        ggml_backend_t bes[2] = { dev, cpu };
        ggml_backend_sched_t sched = ggml_backend_sched_new(bes, NULL, 2, 256, false, true);
        ggml_backend_sched_alloc_graph(sched, gf);
        ggml_backend_tensor_set(x, v, 0, sizeof(float) * E * R);
        ggml_backend_sched_graph_compute(sched, gf);
        ggml_backend_sched_free(sched);
    } else {
        ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_get_default_buffer_type(dev));
        ggml_gallocr_alloc_graph(ga, gf);
        ggml_backend_tensor_set(x, v, 0, sizeof(float) * E * R);
        ggml_backend_graph_compute(dev, gf);
        ggml_gallocr_free(ga);
    }
    ggml_backend_tensor_get(acc, v, 0, sizeof(float) * E * R);
    double sum = 0;
    for (int i = 0; i < E * R; i++) sum += v[i];
    free(v);
    ggml_free(ctx);
    ggml_backend_buffer_free(abuf);
    ggml_free(actx);
    return sum;
}

int main(int argc, char ** argv) {
    if (argc > 1) T = atoi(argv[1]);
    ggml_backend_load_all();
    ggml_backend_dev_t gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (!gpu) {
        fprintf(stderr, "no GPU device (GGML_VK_VISIBLE_DEVICES=0 for lavapipe)\n");
        return 1;
    }
    printf("device: %s (%s), %d tokens\n", ggml_backend_dev_name(gpu), ggml_backend_dev_description(gpu), T);
    const size_t cap = (size_t) T * T * H * 4 + (size_t) V * NR + (size_t) E * 16384;
    int bad = 0;
    for (size_t i = 0; i < sizeof(k_cases) / sizeof(k_cases[0]); i++) {
        const op_case * c = &k_cases[i];
        if (getenv("ONLY") && !strstr(c->name, getenv("ONLY"))) continue;   /* one case by name */
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            float * a = malloc(cap * sizeof(float)), * b = malloc(cap * sizeof(float));
            ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
            ggml_backend_t dev = ggml_backend_dev_init(gpu, NULL);
            long na = run_case(c, cpu, a, cap), nb = run_case(c, dev, b, cap);
            if (na < 0 || nb != na) {
                printf("  %-32s FAILED to run (cpu %ld values, device %ld)\n", c->name, na, nb);
                fflush(stdout);
                _exit(2);
            }
            double worst = 0, scale = 1e-12;
            int nan = 0;
            for (long j = 0; j < na; j++) {
                if (isnan(b[j]) != isnan(a[j])) nan++;
                if (isfinite(a[j]) && isfinite(b[j])) {
                    worst = fmax(worst, fabs((double) a[j] - b[j]));
                    scale = fmax(scale, fabs((double) a[j]));
                }
            }
            /* a device write past a buffer's end corrupts the host heap (lavapipe's memory is host
             * memory): run it again and free everything, so glibc notices here and not later */
            for (int r = 0; r < 3; r++) run_case(c, dev, b, cap);
            ggml_backend_free(dev);
            ggml_backend_free(cpu);
            free(malloc(1 << 20));
            const bool ok = nan == 0 && worst <= 1e-3 * scale;
            printf("  %-32s %s max |diff| %.3g (max |cpu| %.3g)%s\n", c->name, ok ? "ok  " : "DIFF", worst, scale,
                   nan ? " NaN where the CPU has none" : "");
            fflush(stdout);
            _exit(ok ? 0 : 1);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        if (WIFSIGNALED(status)) printf("  %-32s CRASHED (signal %d)\n", c->name, WTERMSIG(status));
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) bad++;
    }
    printf("%d of %zu cases differ or crash\n", bad, sizeof(k_cases) / sizeof(k_cases[0]));
    {
        ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
        ggml_backend_t dev = ggml_backend_dev_init(gpu, NULL);
        const double want = 2.0 * E * R;
        const double plain = accumulate_in_place(dev, cpu, false), sched = accumulate_in_place(dev, cpu, true);
        printf("  in-place add into an accumulator of another buffer: graph %g, scheduler %g (want %g)\n", plain, sched, want);
        if (plain != want || sched != want) bad++;
    }
    return bad ? 1 : 0;
}
