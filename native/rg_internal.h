/*
 * rg_internal.h - structures shared by the native sources (not part of the ABI).
 */
#ifndef RG_INTERNAL_H
#define RG_INTERNAL_H

#include "retrograd.h"
#include "util.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <stdbool.h>

#define RG_MAX_LAYERS 256

typedef enum { RG_ARCH_LLAMA, RG_ARCH_QWEN2, RG_ARCH_QWEN3, RG_ARCH_GEMMA3 } rg_arch;

typedef struct {
    rg_arch arch;
    char    arch_name[32];
    int     n_layer, n_embd, n_head, n_head_kv, head_dim_k, head_dim_v, n_ff, n_vocab;
    int     n_ctx_train, n_rot, rope_mode, n_swa;
    float   rms_eps, rope_base, rope_base_swa, rope_freq_scale, attn_scale, embd_scale;
    bool    swa_layer[RG_MAX_LAYERS];
    bool    gelu_ffn;        /* GeGLU (tanh approximation) instead of SwiGLU */
    bool    post_norms;      /* gemma3: norm after attention and after the FFN */
} rg_hparams;

typedef struct {
    struct ggml_tensor * attn_norm;
    struct ggml_tensor * w[RG_N_TARGETS];   /* q k v o gate up down */
    struct ggml_tensor * bq, * bk, * bv, * bo;
    struct ggml_tensor * q_norm, * k_norm;
    struct ggml_tensor * attn_post_norm, * ffn_norm, * ffn_post_norm;
} rg_layer;

struct rg_model {
    rg_hparams              hp;
    struct gguf_context   * gguf;
    struct ggml_context   * wctx;        /* metadata of every tensor in the file */
    ggml_backend_dev_t      dev;
    int                     dev_index;
    ggml_backend_t          backend;     /* the device the weights live on */
    ggml_backend_t          backend_cpu; /* == backend on the CPU device */
    ggml_backend_buffer_t   wbuf;
    void                  * map_addr;
    size_t                  map_size;
    int                     n_threads;
    struct ggml_tensor    * tok_embd, * output_norm, * output, * rope_freqs;
    rg_layer                layers[RG_MAX_LAYERS];
    /* the F16 weight cache (wcache.c): [layer][target][0: as stored, 1: transposed], NULL if absent */
    struct ggml_context   * cache_ctx;
    ggml_backend_buffer_t   cache_buf;
    struct ggml_tensor    * cache[RG_MAX_LAYERS][RG_N_TARGETS][2];
    size_t                  cache_bytes;
    int                     cache_kernel;   /* the packed kernel the copies are packed for (RG_KERNEL_GGML: not packed) */
    int64_t                 n_params;
    size_t                  weight_bytes;
};

typedef struct {
    struct ggml_tensor * t[4];  /* RG_SLOT_*: param, grad, adam m, adam v */
} rg_lora_slotset;

typedef struct {
    int                  layer, target;
    rg_lora_slotset      a, b;
    rg_lora_slotset      m;        /* DoRA's magnitude [1, n_out]; unset for plain LoRA */
    struct ggml_tensor * w_norm2;  /* DoRA: ||W_o||^2 per output row o, [1, n_out], constant */
} rg_lora_pair;

struct rg_lora {
    rg_model            * model;
    int                   rank;
    float                 alpha, scale;
    uint32_t              target_mask;
    int                   variant;      /* RG_LORA_PLAIN or RG_LORA_DORA */
    int                   per_pair;     /* tensors per pair: 2 (A, B) or 3 (A, B, m) */
    int                   n_pairs;
    rg_lora_pair        * pairs;
    int                   pair_index[RG_MAX_LAYERS][RG_N_TARGETS];  /* -1 when absent */
    struct ggml_context * ctx;
    ggml_backend_buffer_t buf_param, buf_grad, buf_moments, buf_const;
    char               (* names)[96];   /* per_pair per pair: lora_a, lora_b (, dora_m) */
};

/* the slots of the adapter's tensor `index` (ABI order: per pair A, B, then DoRA's m) */
rg_lora_slotset * rg_lora_slots(const rg_lora * l, int index);

/* the frozen weights' products (matmul.c) ----------------------------------------------- */
/* How an engine (or a weight cache) multiplies the frozen base weights, decided once from a matmul
 * mode and a kernel request and read by everything that builds or fills a graph. */
typedef struct {
    int            mode;       /* RG_MATMUL_* */
    enum ggml_type conv_type;  /* the on-the-fly copies' type, F16 or BF16 (unused in F32 mode) */
    int            kernel;     /* what multiplies the copies: a packed kernel (RG_KERNEL_AVX512_BF16,
                                * _AMX_BF16, _AVX2_F16: gemm.c), or RG_KERNEL_GGML, ggml's product */
} rg_matmul;
/* RG_ERR_ARG for an unknown mode or kernel, RG_ERR_UNSUPPORTED for a kernel this CPU lacks. A
 * packed kernel is taken in the modes that convert for speed (auto, f16, bf16) when the copies are
 * its type (BF16 for the BF16 kernels, F16 for avx2-f16); otherwise out->kernel is RG_KERNEL_GGML. */
rg_status rg_matmul_decide(int mode, int kernel, rg_matmul * out);
/* whether a weight of this type is multiplied through an on-the-fly copy (of mm->conv_type) */
bool      rg_matmul_converts(const rg_matmul * mm, enum ggml_type type);
static inline bool rg_matmul_packed(const rg_matmul * mm) { return mm->kernel != RG_KERNEL_GGML; }

/* graph construction (graph.c) ------------------------------------------------------------ */
/* one layer's attention as graph.c builds it, for attention.c's rewrite */
typedef struct {
    struct ggml_tensor * q;       /* [hd, T, heads], the scores' queries (src1 of Q K^T) */
    struct ggml_tensor * k;       /* [hd, T, kv heads], a permuted view of k_rope (src0 of Q K^T) */
    struct ggml_tensor * k_rope;  /* [hd, kv heads, T] */
    struct ggml_tensor * v;       /* [hd, kv heads, T] */
    struct ggml_tensor * vt;      /* [T, hd, kv heads] contiguous (src0 of P V) */
    struct ggml_tensor * kqv;     /* [hd, T, heads], the attention's output before the heads are merged */
    float                scale;   /* of the scores before the softmax */
    int32_t              n_swa;   /* the sliding window of this layer, 0: none */
} rg_attn_nodes;

/* what attention.c's ops read besides their sources (the op's userdata) */
typedef struct {
    float   scale;
    int32_t n_swa;
    int32_t slots;    /* the threads the backward keeps a partial dQ for (the model's thread count) */
} rg_attn_params;

typedef struct {
    rg_model           * model;
    rg_lora            * lora;        /* NULL: base model */
    struct ggml_context * ctx;
    int32_t              n_tokens;
    struct ggml_tensor * inp_tokens;  /* I32 [T] */
    struct ggml_tensor * inp_pos;     /* I32 [T] */
    struct ggml_tensor * inp_mask;    /* F32 [T, T] causal + packing */
    struct ggml_tensor * inp_mask_swa;/* F32 [T, T] additionally windowed, NULL when unused */
    struct ggml_tensor * inp_vis;     /* I32 [T, 3]: sequence ids, shared-prefix ids, positions (attention.c) */
    rg_attn_nodes        attn[RG_MAX_LAYERS];        /* set by graph.c for each layer it builds */
    rg_attn_params       attn_params[RG_MAX_LAYERS]; /* attention.c's ops' userdata */
    struct ggml_tensor * inp_embd_noise; /* F32 [n_embd, T] added to the embeddings, NULL when unused */
    bool                 embed_noise; /* build with inp_embd_noise */
    bool                 dropout;     /* build with LoRA dropout masks (inp_dropout) */
    struct ggml_tensor * inp_dropout; /* I32 [4] seed and probability of the masks, NULL when unused */
    struct ggml_tensor * hidden;      /* F32 [n_embd, T] after the final norm */
    struct ggml_tensor * layer_in[RG_MAX_LAYERS + 1]; /* each layer's input; [n_layer]: the final norm's */
    bool                 train;       /* build for autodiff (composite ops with a backward) */
    bool                 exact_ops;   /* ggml's own ops only: no fused substitutes, no outer.c kernels */
    bool                 tiled_attention; /* attention.c's ops where they may run (rg_engine_set_attention) */
    bool                 on_cpu;      /* the weights live on the CPU: retrograd's CPU kernels (outer.c,
                                       * convert.c) may run; on another device only ggml's ops do */
    rg_matmul            matmul;      /* the engine's decision for the base weights' products */
    /* after the backward is built, consumers of subst_from[i] read subst_to[i] instead: the
     * forward value then comes from llama.cpp's own fused op (bit-equal outputs) while the
     * gradient comes from the composite that has a backward */
    struct ggml_tensor * subst_from[RG_MAX_LAYERS + 1];
    struct ggml_tensor * subst_to[RG_MAX_LAYERS + 1];
    int                  n_subst;
    char                 error[256];
} rg_graph_build;

/* LoRA dropout (dropout.c): the mask of one layer's target, [ne0, ne1], drawn from `params`
 * (an I32 [4] input that rg_dropout_params fills from the batch) */
struct ggml_tensor * rg_dropout_mask(struct ggml_context * ctx, struct ggml_tensor * params, int64_t ne0,
                                     int64_t ne1, int layer, int target);
void rg_dropout_params(const rg_batch * batch, int32_t out[4]);

/* Builds the trunk up to the final normed hidden state; returns false with b->error set. */
bool rg_build_trunk(rg_graph_build * b);
/* The pieces of the trunk, for graphs of one layer (activation checkpointing, recompute.c):
 * the inputs a layer reads (positions, masks, dropout), one layer (NULL with b->error set), the
 * final norm. */
void rg_build_layer_inputs(rg_graph_build * b);
struct ggml_tensor * rg_build_layer(rg_graph_build * b, int il, struct ggml_tensor * x);
struct ggml_tensor * rg_build_final_norm(rg_graph_build * b, struct ggml_tensor * x);
/* Fill the causal/packing (and sliding-window) masks for a batch. */
void rg_fill_masks(const rg_hparams * hp, const rg_batch * batch, float * mask, float * mask_swa);
/* Set a built graph's attention inputs from a batch: the masks where a node still reads them (the
 * composite attention), the ids and positions where attention.c's ops do. */
rg_status rg_set_attention_inputs(const rg_graph_build * b, const rg_batch * batch);

/* attention.c: layer il's attention (graph.c's composite, b->attn[il]) turned into the tiled ops
 * after the backward is built (false: left as it is, e.g. an unexpected shape) */
bool rg_attn_tile(rg_graph_build * b, struct ggml_cgraph * gf, int il);
/* the I32 [T, 3] visibility input of a batch */
void rg_attn_fill_vis(const rg_batch * batch, int32_t * out);

/* A transient F16 copy of a (quantized) weight, optionally transposed (convert.c). */
/* op kinds as counted by profiling and preflight: ggml ops, then unary ops */
#define RG_OP_KEYS (GGML_OP_COUNT + GGML_UNARY_OP_COUNT)
int          rg_op_key(const struct ggml_tensor * t);
const char * rg_op_key_name(int key);

/* profile.c: tallies by [phase: 0 forward, 1 backward][op kind][what the node works on: a
 * target's base weight (RG_TARGET_*), or one of the kinds below] */
enum { RG_KIND_LORA = RG_N_TARGETS, RG_KIND_ATTENTION, RG_KIND_OTHER, RG_PROF_KINDS };
typedef struct {
    double  ms[2][RG_OP_KEYS][RG_PROF_KINDS];
    double  flops[2][RG_OP_KEYS][RG_PROF_KINDS];
    int64_t n[2][RG_OP_KEYS][RG_PROF_KINDS];
} rg_profile;
void      rg_profile_add(rg_profile * p, const rg_model * m, int rank, const struct ggml_tensor * t, int backward, double ms);
int       rg_profile_count(const rg_profile * p);
rg_status rg_profile_get(const rg_profile * p, int index, rg_profile_entry * out);
void      rg_profile_reset(rg_profile * p);

/* rewrite.c (see there) */
bool                 rg_is_base_weight(const rg_model * m, const struct ggml_tensor * t);
/* the base weight a tensor was converted from (through casts and copies), or NULL */
struct ggml_tensor * rg_base_weight_of(const rg_model * m, struct ggml_tensor * t);
struct ggml_cgraph * rg_graph_rewrite(rg_graph_build * b, struct ggml_cgraph * gf, size_t size);

struct ggml_tensor * rg_dequant(struct ggml_context * ctx, struct ggml_tensor * w, bool transposed, enum ggml_type type);
/* the weight cache (wcache.c): w's cached copy of that type (NULL: none); a cached copy's base
 * weight (NULL: c is not one); freeing */
struct ggml_tensor * rg_model_cached(const rg_model * m, const struct ggml_tensor * w, bool transposed, enum ggml_type type);
struct ggml_tensor * rg_model_uncached(const rg_model * m, const struct ggml_tensor * c);
/* w's copy packed for the packed kernel `kernel` in that orientation (NULL: none; the cache holds
 * packed copies when the decision it was made for runs a packed kernel, and then rg_model_cached
 * finds none) */
struct ggml_tensor * rg_model_cached_packed(const rg_model * m, const struct ggml_tensor * w, bool transposed, int kernel);
void                 rg_model_free_weight_cache(rg_model * m);
/* dst [n0, n1, H] = sum over t of p[:, t, h / (H / Hp)] q[:, t, h]^T for p [n0, T, Hp], q [n1, T, H]
 * (outer.c); fits: F32, at most 3-D, each column contiguous */
struct ggml_tensor * rg_outer_sum(struct ggml_context * ctx, struct ggml_tensor * p, struct ggml_tensor * q);
bool rg_outer_sum_fits(const struct ggml_tensor * p, const struct ggml_tensor * q);
/* dst [n, T, H] = v [n, r, Hv] z [r, T, H] (v's heads shared by H / Hv of z's): LoRA's products over
 * the rank (the forward's B (A x) for r <= RG_RANK_EXPAND_MAX) and the input gradients of
 * products whose other operand has its contraction inside columns (outer.c) */
#define RG_RANK_EXPAND_MAX 64
struct ggml_tensor * rg_rank_expand(struct ggml_context * ctx, struct ggml_tensor * v, struct ggml_tensor * z);
bool rg_rank_expand_fits(const struct ggml_tensor * v, const struct ggml_tensor * z);

/* gemm.c: the frozen weights' 16-bit products through packed operands, by the packed kernel
 * `kernel` (RG_KERNEL_AVX512_BF16, _AMX_BF16 or _AVX2_F16, as rg_matmul decided). A weight packed as
 * stored (rows = n_out) or transposed (rows = n_in); activations [k, T] packed (fits: F32, 2-D,
 * columns contiguous); their product [rows, T]. The packed types and shapes follow the kernel:
 * rg_packed_weight_shape gives the weight's (and returns its type). */
struct ggml_tensor * rg_pack_weight(struct ggml_context * ctx, struct ggml_tensor * w, bool transposed, int kernel);
enum ggml_type       rg_packed_weight_shape(const struct ggml_tensor * w, bool transposed, int kernel, int64_t ne[2]);
/* whether a kept packed copy of w (the weight cache's, the LM head's) is in the kernel's layout (the
 * two BF16 kernels share theirs) */
bool                 rg_packed_weight_fits(const struct ggml_tensor * packed, const struct ggml_tensor * w,
                                           bool transposed, int kernel);
bool                 rg_pack_act_fits(const struct ggml_tensor * x);
struct ggml_tensor * rg_pack_act(struct ggml_context * ctx, struct ggml_tensor * x, int kernel);
struct ggml_tensor * rg_gemm(struct ggml_context * ctx, struct ggml_tensor * packed_w, struct ggml_tensor * packed_x,
                             int64_t rows, int64_t n_tokens);
/* the same product plus v z (v F32 [rows, r], z F32 [r, T], columns contiguous) in its epilogue:
 * LoRA's B (s A x) without its own [rows, T] tensor and the add */
bool                 rg_gemm_lowrank_fits(const struct ggml_tensor * v, const struct ggml_tensor * z, int64_t rows,
                                          int64_t n_tokens);
struct ggml_tensor * rg_gemm_lowrank(struct ggml_context * ctx, struct ggml_tensor * packed_w, struct ggml_tensor * packed_x,
                                     struct ggml_tensor * v, struct ggml_tensor * z);
/* the FLOPs of a gemm.c product node (its contraction rounded up to even, plus the low-rank term), else 0 */
double               rg_gemm_flops(const struct ggml_tensor * t);

/* LM head (head.c) -------------------------------------------------------------------------- */
typedef struct rg_head rg_head;
rg_head * rg_head_new(rg_model * model);
void      rg_head_free(rg_head * head);
/* Phase A: logits for the rows that have targets, log-probs of the targets, optional entropy.
 * Keeps the softmax for phase B when it fits the budget. */
rg_status rg_head_forward(rg_head * head, struct ggml_tensor * hidden, const rg_batch * batch,
                          float * logp, float * entropy, bool keep_for_backward, size_t budget);
/* Phase B: writes d(loss)/d(hidden) for all rows into grad_hidden ([n_embd, T] tensor). */
rg_status rg_head_backward(rg_head * head, struct ggml_tensor * hidden,
                           struct ggml_tensor * grad_hidden, const rg_batch * batch,
                           const float * logp, const float * coeff);
double    rg_head_ms(rg_head * head, bool reset);
/* the engine's decision (auto at creation): F32 mode is exact, the others convert W_out's slices in
 * the backward to mm->conv_type, and a packed kernel multiplies the quantized W_out's products */
void      rg_head_set_matmul(rg_head * head, const rg_matmul * mm);
/* The k most likely next tokens (ids, log-probs) at each target's row, best first, and the
 * targets' own log-probs when target_logp is not NULL. */
rg_status rg_head_topk(rg_head * head, struct ggml_tensor * hidden, const rg_batch * batch, int k,
                       int32_t * ids_out, float * logp_out, float * target_logp);

#endif /* RG_INTERNAL_H */
