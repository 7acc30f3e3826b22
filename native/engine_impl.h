/*
 * engine_impl.h - the engine's state, a training micro-batch's run state, and the steps of
 * preparing a micro-batch (microbatch.c), shared by engine.c, microbatch.c, recompute.c (activation
 * checkpointing) and preflight.c. Private to those files; the C ABI is retrograd.h.
 */
#ifndef RG_ENGINE_IMPL_H
#define RG_ENGINE_IMPL_H

#include "rg_internal.h"

struct rg_engine {
    rg_model           * model;
    ggml_backend_sched_t sched;
    ggml_gallocr_t       opt_galloc;
    rg_head            * head;
    void               * ctx_mem;
    size_t               ctx_mem_size;
    size_t               graph_size;
    bool                 exact_ops;
    bool                 dense_attention;   /* rg_engine_set_attention */
    bool                 recompute;   /* activation checkpointing (recompute.c) */
    rg_matmul            matmul;      /* rg_engine_set_matmul, decided once (matmul.c) */
    bool                 profiling;
    /* every node of the training graph is waited for (its eval callback asks for it): set on
     * Mesa's lavapipe, where without it the driver's queue thread crashed in 10 of 36 runs
     * (issue 38, engine.c) */
    bool                 sync_nodes;
    rg_profile           prof;
    double               prof_last;
    /* the last preflight: pre_n op kinds (in ggml op order) with their unsupported nodes */
    int                  pre_n;
    int                  pre_count[RG_OP_KEYS];
    const char         * pre_name[RG_OP_KEYS];
    /* and its slow paths (preflight.c): kinds with their node counts */
    int                  slow_n;
    int                  slow_kind[8];
    int                  slow_count[8];
    rg_timings           timings;
};

/* the LM head's softmax store at most (beyond it the head recomputes the softmax in its backward) */
#define RG_HEAD_BUDGET ((size_t) 512 << 20)

/* state of one accumulate() call, visible to the eval callback */
typedef struct {
    rg_engine          * e;
    const rg_batch     * batch;
    int32_t              n_real;      /* rows before padding */
    struct ggml_tensor * hidden;
    struct ggml_tensor * grad_hidden;
    rg_coeff_fn          fn;
    void               * user;
    int                  want_entropy, want_hidden;
    int                  lora_rank;
    float              * logp;
    rg_status            status;
    double               t_start, t_hidden;
    /* activation checkpointing: each layer's input copied here as the forward computes it, so the
     * forward graph need not keep them (layer_in[il] to saved + il * n_embd * tokens) */
    float              * saved;
    struct ggml_tensor * const * layer_in;
    int                  n_layer_in, n_copied;
    char                 error[1024];
} rg_run;

typedef struct {
    rg_batch  b;
    int32_t * owned;
    float   * owned_noise;  /* the embedding noise with zero rows for the padding */
} rg_padded;

typedef struct {
    struct ggml_context * ctx;
    struct ggml_cgraph  * gf;
    rg_graph_build        b;
    struct ggml_tensor  * grad_hidden;
    struct ggml_tensor  * loss_grad;
} rg_built;

/* A checked, padded batch with its graph built and allocated and its inputs set. */
typedef struct {
    rg_padded pb;
    rg_built  o;
    int32_t   n_real;     /* rows before padding */
} rg_prepared;

/* the graph kinds build() makes */
enum {
    RG_BUILD_FORWARD,        /* the trunk, no gradients */
    RG_BUILD_TRAIN,          /* the trunk, the surrogate loss and its backward */
    RG_BUILD_TRAIN_FORWARD,  /* the trunk and the surrogate loss without a backward, each layer's input kept
                              * (an output): activation checkpointing's first pass */
};

/* the graph of a micro-batch of n_tokens rows (padded) of that kind, built but not allocated */
rg_status rg_engine_build(rg_engine * e, rg_lora * lora, int32_t n_tokens, int kind, bool noise, bool dropout,
                          rg_built * o);
/* A checked, padded batch with its graph built and allocated and its inputs set; on failure nothing
 * is left to release. */
rg_status rg_engine_prepare(rg_engine * e, rg_lora * lora, const rg_batch * batch, int kind, rg_prepared * p);
void      rg_engine_release(rg_engine * e, rg_prepared * p);
bool      rg_engine_on_node(struct ggml_tensor * t, bool ask, void * user);
struct ggml_tensor * rg_engine_grad_of_param(const rg_lora * l, const struct ggml_tensor * t);
/* the micro-batch's gradient with each layer's activations recomputed in the backward (recompute.c) */
rg_status rg_engine_accumulate_recompute(rg_engine * e, rg_lora * lora, const rg_batch * batch, rg_coeff_fn fn,
                                         void * user, int want_entropy, int want_hidden, float * logp_out);

#endif
