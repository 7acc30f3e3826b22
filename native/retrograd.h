/*
 * retrograd.h - the whole C ABI of retrograd's native training engine.
 *
 * The engine loads a GGUF model with its weights kept in their stored (usually quantized) types,
 * builds a training graph per architecture family over the public ggml API, attaches LoRA A/B
 * tensors, and turns per-token log-probabilities into gradients: the caller supplies, per
 * (row, token id) target, the coefficient c of d(loss)/d(logp), so every loss (cross-entropy,
 * policy gradient, KL, preference, distillation) is a small recipe on the Python side while the
 * expensive parts stay here.
 *
 * Conventions: functions are rg_<thing>_<verb>; objects come in init/free pairs; every fallible
 * call, setters included, returns an rg_status and leaves a message for rg_last_error(). Nothing
 * here aborts the process on bad input, and every allocation made here is checked: running out of
 * memory is reported as RG_ERR_NOMEM with the object left as it was (or freed, for an init).
 * (ggml's own internal allocations are ggml's: it aborts when one of those fails.) The entry points
 * for tests and benchmarks are in retrograd_test.h, in the same library.
 *
 * Constants are the enums below; the Python side reads them from the compiled library (lib.RG_*)
 * rather than keeping copies. Results of variable size (preflight, profile) are kept in the
 * engine and read back one entry at a time through typed getters, never as text.
 *
 * The block between RG_CDEF_BEGIN and RG_CDEF_END is fed verbatim to cffi, so it holds plain
 * declarations only (no macros, no includes).
 */
#ifndef RETROGRAD_H
#define RETROGRAD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* RG_CDEF_BEGIN */
typedef enum {
    RG_OK              = 0,
    RG_ERR_ARG         = 1,  /* a caller error: bad index, size, shape or option */
    RG_ERR_IO          = 2,  /* a file could not be opened, read or mapped */
    RG_ERR_FORMAT      = 3,  /* a file is not what it claims (GGUF structure, missing tensor) */
    RG_ERR_UNSUPPORTED = 4,  /* an architecture, tensor type or feature we do not handle */
    RG_ERR_DEVICE      = 5,  /* no such device, or a backend could not be initialised */
    RG_ERR_COMPUTE     = 6,  /* a graph's computation failed */
    RG_ERR_NONFINITE   = 7,  /* a loss or gradient is NaN or infinite */
    RG_ERR_CALLBACK    = 8,  /* the caller's coefficient callback reported an error */
    RG_ERR_NOMEM       = 9   /* memory ran out: a host allocation, or a buffer of the device's */
} rg_status;

enum {
    RG_TARGET_Q = 0, RG_TARGET_K = 1, RG_TARGET_V = 2, RG_TARGET_O = 3,
    RG_TARGET_GATE = 4, RG_TARGET_UP = 5, RG_TARGET_DOWN = 6, RG_N_TARGETS = 7
};

/* Short name of a LoRA target ("q", "k", "v", "o", "gate", "up", "down"), NULL out of range. */
const char * rg_target_name(int target);

enum { RG_SLOT_PARAM = 0, RG_SLOT_GRAD = 1, RG_SLOT_ADAM_M = 2, RG_SLOT_ADAM_V = 3 };

enum { RG_DEVICE_CPU = 0, RG_DEVICE_GPU = 1, RG_DEVICE_IGPU = 2, RG_DEVICE_ACCEL = 3 };

/* prefix_ids entry of a row that sees only its own sequence: INT32_MIN (written out, since this
 * block allows no macros) */
enum { RG_NO_PREFIX = -2147483647 - 1 };

/* Thread-local message describing the last failure in this thread. */
const char * rg_last_error(void);

/* A note for a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT on any thread, such as a
 * device driver's): the process writes `text` to stderr, then dies of the signal as it would have
 * (handlers installed before the first note, e.g. Python's faulthandler, still run). Replaces the
 * previous note; NULL or "" clears it. The first note installs the handlers. Always RG_OK. */
rg_status rg_crash_note_set(const char * text);

/* ---- devices ------------------------------------------------------------------------------ */
typedef struct {
    char   name[128];
    char   description[256];
    int    type;            /* RG_DEVICE_* */
    size_t memory_free;
    size_t memory_total;
} rg_device_info;

int       rg_device_count(void);
rg_status rg_device_get_info(int index, rg_device_info * out);
/* want: "auto" (a GPU if present, else the CPU), "cpu", "gpu" (fails without one), or a name. */
rg_status rg_device_select(const char * want, int * index_out);

/* ---- the frozen weights' products --------------------------------------------------------- */
/* How base-weight matmuls are computed: RG_MATMUL_AUTO (default) converts to a 16-bit copy on the
 * fly (BF16 where the CPU has AVX512-BF16, else F16; rg_matmul_conv_type) for the types whose
 * native CPU kernels are slower than that at training batch sizes (Q4_1, Q5_x, K-quants) and keeps
 * the native kernel otherwise; RG_MATMUL_NATIVE always uses ggml's quantized kernel (bit-equal to
 * llama.cpp); RG_MATMUL_F16 / RG_MATMUL_BF16 always convert to that type; RG_MATMUL_F32 dequantizes
 * to F32 forward and backward: slow, but no activation is rounded, so the forward is a smooth
 * function (finite-difference tests on real models). */
enum { RG_MATMUL_AUTO = 0, RG_MATMUL_NATIVE = 1, RG_MATMUL_F16 = 2, RG_MATMUL_F32 = 3, RG_MATMUL_BF16 = 4 };
/* Which kernel multiplies the 16-bit copies: RG_KERNEL_AUTO (default) the CPU's own packed kernel
 * (gemm.c: "amx-bf16" where the CPU has AMX tiles and Linux grants them, else "avx512-bf16" where it
 * has AVX512-BF16, else "avx2-f16", F16 weights times F32 activations, where it has AVX2, FMA and
 * F16C); RG_KERNEL_GGML ggml's own product; the others force that packed kernel (benchmarks and
 * comparisons; RG_ERR_UNSUPPORTED where the CPU lacks it). A packed kernel multiplies copies of its
 * own type (BF16 for the BF16 kernels, F16 for avx2-f16) in the modes that convert for speed (auto,
 * f16, bf16); in any other case ggml's product does. */
enum { RG_KERNEL_AUTO = 0, RG_KERNEL_GGML = 1, RG_KERNEL_AVX512_BF16 = 2, RG_KERNEL_AMX_BF16 = 3,
       RG_KERNEL_AVX2_F16 = 4 };
/* The type ("f16" or "bf16") a mode's on-the-fly copies of base weights have on this CPU: AUTO is
 * BF16 where the CPU has AVX512-BF16 dot products (1.6-2x F16's product speed on a Zen 4, docs/benchmarks.md), else F16.
 * NATIVE still converts for the backward's transposed products. F32 mode: "f32". */
const char * rg_matmul_conv_type(int mode);
/* The kernel that multiplies the copies of an engine set to (mode, kernel) on this CPU: *name gets
 * "amx-bf16", "avx512-bf16", "avx2-f16" or "ggml" (static storage). Fails as rg_engine_set_matmul. */
rg_status    rg_matmul_kernel(int mode, int kernel, const char ** name);

/* ---- models ------------------------------------------------------------------------------- */
typedef struct rg_model rg_model;

typedef struct {
    char    arch[32];
    int     n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train, n_rot;
    float   rms_eps, rope_base, rope_base_swa, rope_freq_scale, attn_scale, embd_scale;
    int     rope_mode;      /* 0 normal (adjacent pairs), 2 neox (halves) */
    int     n_swa;          /* sliding window of local layers, 0 when none */
    int     n_swa_layers;
    int     tied_output;
    int     has_qk_norm;
    int64_t n_params;
    size_t  weight_bytes;
    int     device_index;
    char    device_name[128];
    int     mmapped;
    int     n_threads;
} rg_model_info;

rg_status rg_model_init(const char * path, int device_index, int n_threads, rg_model ** out);
void      rg_model_free(rg_model * model);
void      rg_model_get_info(const rg_model * model, rg_model_info * out);
int       rg_model_tensor_count(const rg_model * model);
rg_status rg_model_tensor_info(const rg_model * model, int index, const char ** name,
                               const char ** type_name, int64_t * ne /* [4] */);
/* The weight cache: persistent 16-bit copies of the quantized target weights, within budget_bytes
 * (0 frees it), so training graphs on the CPU stop converting them per micro-batch; transposed
 * copies (the backward's) first. The copies are of the type (and, where a packed kernel runs, in the
 * layout) an engine set to (matmul_mode, kernel) multiplies, and hold the numbers its on-the-fly
 * conversion makes, so results do not change (an engine with other settings finds no copy it can
 * read and converts). used_bytes (may be NULL) receives what was allocated. An invalid mode or
 * kernel fails as rg_engine_set_matmul and leaves the cache as it was. */
rg_status rg_model_set_weight_cache(rg_model * model, size_t budget_bytes, int matmul_mode, int kernel,
                                    size_t * used_bytes);

/* ---- LoRA adapters ------------------------------------------------------------------------ */
typedef struct rg_lora rg_lora;

enum { RG_LORA_PLAIN = 0, RG_LORA_DORA = 1 };

/* A and B (F32) for every layer and every target bit set in target_mask (1 << RG_TARGET_*),
 * all slots zero; the caller initialises A. Scale applied in the forward is alpha / rank.
 * RG_LORA_DORA adds per pair a magnitude m ([1, n_out], tensor name "...dora_m", after A and B)
 * and computes y = m / ||W + scale B A||_row (W x + scale B A x), the norm differentiated in
 * full; m starts at the row norms of W (a fresh adapter leaves the model unchanged). */
rg_status rg_lora_init(rg_model * model, uint32_t target_mask, int rank, float alpha, int variant,
                       rg_lora ** out);
/* DoRA: sets every magnitude to the row norms of W + scale B A for the current A and B. */
rg_status rg_lora_magnitude_reset(rg_lora * lora);
void      rg_lora_free(rg_lora * lora);
int       rg_lora_tensor_count(const rg_lora * lora);
/* name is the llama.cpp adapter name ("blk.3.attn_q.weight.lora_a"); ne0 is the fastest dim. */
rg_status rg_lora_tensor_info(const rg_lora * lora, int index, const char ** name,
                              int64_t * ne0, int64_t * ne1);
rg_status rg_lora_read(const rg_lora * lora, int index, int slot, float * dst, size_t n);
rg_status rg_lora_write(rg_lora * lora, int index, int slot, const float * src, size_t n);
rg_status rg_lora_zero(rg_lora * lora, int slot);
float     rg_lora_scale(const rg_lora * lora);

/* ---- batches ------------------------------------------------------------------------------ */
/* One micro-batch: n_tokens tokens of one or more packed sequences. Row i attends to the rows j
 * with positions[j] <= positions[i] whose seq_ids[j] is seq_ids[i] or, when prefix_ids is given,
 * prefix_ids[i]: several continuations can share one copy of their prompt (give the prompt rows a
 * seq id of their own and the continuations that id as prefix, positions continuing the prompt's).
 * Each prefix_ids entry is RG_NO_PREFIX or a seq id that occurs in the batch (else RG_ERR_ARG).
 * A target (row r, id y) asks for log p(y | what row r sees, up to and including row r). */
typedef struct {
    int32_t         n_tokens;
    const int32_t * tokens;
    const int32_t * positions;
    const int32_t * seq_ids;
    const int32_t * prefix_ids;   /* may be NULL */
    int32_t         n_targets;
    const int32_t * target_rows;
    const int32_t * target_ids;
    const float   * embed_noise;  /* may be NULL: [n_tokens][n_embd], added to the token embeddings
                                   * before any embedding scale (NEFTune) */
    float           lora_dropout; /* 0: none; in [0, 1): each LoRA input element is zeroed with this
                                   * probability and the rest scaled by 1 / (1 - p), a mask per layer
                                   * and target drawn from dropout_seed (the same seed, the same mask) */
    uint64_t        dropout_seed;
} rg_batch;

/* ---- engine ------------------------------------------------------------------------------- */
typedef struct rg_engine rg_engine;

typedef struct {
    double build_ms;    /* graph construction and rewrite */
    double alloc_ms;    /* scheduling and allocation */
    double forward_ms;  /* trunk forward up to the final hidden state */
    double head_ms;     /* LM head: logits, softmax, gathers, head gradient */
    double backward_ms; /* everything after the head */
    double optimizer_ms;
    int    n_nodes;
    double graph_mib;   /* the largest compute buffer a graph needed so far (activations, transients) */
} rg_timings;

/* Called once per micro-batch with the log-probs of the targets (and, when asked for, the
 * entropy of the distribution at each target's row and the final hidden states [n_tokens x
 * n_embd], row-major by token). It writes d(loss)/d(logp) per target into coeff and may add
 * d(loss)/d(hidden) into hidden_grad (zeroed beforehand). Non-zero return aborts the step. */
typedef int (*rg_coeff_fn)(void * user, int32_t n_targets, const float * logp,
                           const float * entropy, float * coeff, int32_t n_tokens,
                           int32_t n_embd, const float * hidden, float * hidden_grad);

rg_status rg_engine_init(rg_model * model, rg_engine ** out);
void      rg_engine_free(rg_engine * engine);
/* How attention is computed on the CPU: RG_ATTENTION_TILED (default) a tile of queries by keys at a
 * time, forward and backward, never storing a head's [tokens x tokens] scores (memory grows with the
 * tokens, not their square; attention.c); RG_ATTENTION_DENSE as ggml ops on the whole score matrix
 * (the path ggml's autodiff writes; kept for comparison). Another device, the native matmul mode
 * and exact ops always use the dense ops. RG_ERR_ARG for another value. */
enum { RG_ATTENTION_TILED = 0, RG_ATTENTION_DENSE = 1 };
rg_status rg_engine_set_attention(rg_engine * engine, int mode);
/* Activation checkpointing (on: 1, off: 0, the default; RG_ERR_ARG otherwise): accumulate keeps
 * only each layer's input from the forward pass and recomputes the layer in the backward (memory
 * grows with one layer's activations, not all of them; a second forward pass's time). */
rg_status rg_engine_set_recompute(rg_engine * engine, int on);
/* How base-weight products are computed (RG_MATMUL_*) and by which kernel (RG_KERNEL_*), decided
 * once here for every graph the engine builds afterwards. RG_ERR_ARG for an unknown value,
 * RG_ERR_UNSUPPORTED for a kernel this CPU cannot run; either leaves the engine as it was. */
rg_status rg_engine_set_matmul(rg_engine * engine, int mode, int kernel);
/* Forward only (evaluation, reference policy). lora may be NULL (the base model). entropy_out
 * and hidden_out may be NULL. */
rg_status rg_engine_forward(rg_engine * engine, rg_lora * lora, const rg_batch * batch,
                            float * logp_out, float * entropy_out, float * hidden_out);
/* Forward only: for each target's row, the k most likely next tokens, best first: ids_out and
 * logp_out hold n_targets * k entries. target_logp_out (may be NULL) gets the targets' own
 * log-probs from the same pass, as rg_engine_forward would. For distillation teachers and
 * top-1 agreement. */
rg_status rg_engine_topk(rg_engine * engine, rg_lora * lora, const rg_batch * batch, int k,
                         int32_t * ids_out, float * logp_out, float * target_logp_out);
/* Forward, head, callback, backward: adds the gradient of sum(coeff * logp) (plus whatever the
 * callback put in hidden_grad) to the lora's GRAD slot. want_hidden passes hidden states. */
rg_status rg_engine_accumulate(rg_engine * engine, rg_lora * lora, const rg_batch * batch,
                               rg_coeff_fn fn, void * user, int want_entropy, int want_hidden,
                               float * logp_out);

typedef struct {
    float   lr, beta1, beta2, eps, weight_decay;
    float   grad_scale;   /* multiplies the accumulated gradient before clipping */
    float   grad_clip;    /* max global L2 norm; <= 0 disables */
    int64_t step;         /* 1-based AdamW step for bias correction */
    float   lr_b_ratio;   /* LoRA+: the B matrices learn at lr * lr_b_ratio; <= 0 means 1 */
} rg_adamw;

/* Global gradient norm (after grad_scale), clipping, one AdamW update, gradients zeroed.
 * RG_ERR_NONFINITE leaves parameters and moments untouched and zeroes the gradients. */
rg_status rg_engine_adamw(rg_engine * engine, rg_lora * lora, const rg_adamw * params,
                          float * grad_norm_out);
/* Builds (does not run) the training graph for n_tokens tokens (the forward graph when lora is
 * NULL) and keeps in the engine, per op kind, how many of its nodes the model's device cannot
 * run; *n_unsupported (may be NULL) gets the total. The entries, in ggml op order, are read with
 * rg_engine_preflight_count/_get and stay until the next preflight. */
rg_status rg_engine_preflight(rg_engine * engine, rg_lora * lora, int32_t n_tokens,
                              int * n_unsupported);
int       rg_engine_preflight_count(const rg_engine * engine);
/* op: the op's name (static storage); count: its unsupported nodes. RG_ERR_ARG out of range. */
rg_status rg_engine_preflight_get(const rg_engine * engine, int index, const char ** op,
                                  int * count);
/* The same preflight's slow paths: nodes the device runs, through a route known to be slower than
 * the CPU build's. what and reason are static strings; count: the nodes (or head slices). */
int       rg_engine_slow_path_count(const rg_engine * engine);
rg_status rg_engine_slow_path_get(const rg_engine * engine, int index, const char ** what, int * count,
                                  const char ** reason);
void      rg_engine_get_timings(const rg_engine * engine, rg_timings * out);
/* Per-op profiling of training graphs (slower: every node is computed on its own). The tallies
 * add up over accumulate calls until reset, per phase (forward up to the hidden state, then the
 * backward), ggml op kind and what the node works on: a LoRA target's base weight ("q" ... "down"),
 * "lora", "attention" (head-batched products) or "other". flops counts multiply-adds x 2 of
 * MUL_MAT and OUT_PROD nodes (0 for other ops). Entries come largest time first. */
typedef struct {
    const char * op;        /* ggml op name (static storage) */
    const char * kind;      /* static storage */
    int          backward;  /* 0 forward, 1 backward */
    double       ms;
    double       flops;
    int64_t      count;
} rg_profile_entry;
/* on: 1 or 0 (the default); RG_ERR_ARG otherwise */
rg_status rg_engine_set_profiling(rg_engine * engine, int on);
int       rg_engine_profile_count(const rg_engine * engine);
/* RG_ERR_ARG out of range. */
rg_status rg_engine_profile_get(const rg_engine * engine, int index, rg_profile_entry * out);
void      rg_engine_profile_reset(rg_engine * engine);
/* ---- weight formats ------------------------------------------------------------------------ */
/* type is a ggml type number (GGUF stores the same). Bytes of n_rows rows (0: not a format whose
 * blocks fill rows of n_per_row values); rows to floats; floats to rows with ggml's quantizer
 * (RG_ERR_ARG for formats that need an importance matrix). */
size_t    rg_rows_bytes(int type, int64_t n_rows, int64_t n_per_row);
rg_status rg_rows_dequantize(int type, const void * src, float * dst, int64_t n_rows, int64_t n_per_row);
rg_status rg_rows_quantize(int type, const float * src, void * dst, int64_t n_rows, int64_t n_per_row);

/* RG_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* RETROGRAD_H */
