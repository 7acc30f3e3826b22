/*
 * model.c - devices, and loading a GGUF model with its weights in their stored types.
 *
 * On the CPU the file is memory-mapped and the tensors point into the mapping, so a quantized
 * model costs its file size in page cache and nothing more; on other devices the tensor data
 * is read into a device buffer. No weight is ever converted to F32 here.
 */
#include "rg_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* devices --------------------------------------------------------------------------------- */
static bool backend_is_host(ggml_backend_t backend) {
    return ggml_backend_dev_type(ggml_backend_get_device(backend)) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

static int to_rg_device_type(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:  return RG_DEVICE_CPU;
        case GGML_BACKEND_DEVICE_TYPE_GPU:  return RG_DEVICE_GPU;
        case GGML_BACKEND_DEVICE_TYPE_IGPU: return RG_DEVICE_IGPU;
        default:                            return RG_DEVICE_ACCEL;
    }
}

int rg_device_count(void) { return (int) ggml_backend_dev_count(); }

rg_status rg_device_get_info(int index, rg_device_info * out) {
    if (index < 0 || index >= rg_device_count()) {
        return rg_fail(RG_ERR_ARG, "device index %d out of range (%d devices)", index, rg_device_count());
    }
    ggml_backend_dev_t dev = ggml_backend_dev_get(index);
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s", ggml_backend_dev_name(dev));
    snprintf(out->description, sizeof(out->description), "%s", ggml_backend_dev_description(dev));
    out->type = to_rg_device_type(ggml_backend_dev_type(dev));
    ggml_backend_dev_memory(dev, &out->memory_free, &out->memory_total);
    return RG_OK;
}

rg_status rg_device_select(const char * want, int * index_out) {
    const int n = rg_device_count();
    int cpu = -1, gpu = -1;
    for (int i = 0; i < n; i++) {
        enum ggml_backend_dev_type t = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (t == GGML_BACKEND_DEVICE_TYPE_CPU && cpu < 0) cpu = i;
        if ((t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) && gpu < 0) gpu = i;
    }
    if (!want || !*want || strcmp(want, "auto") == 0) {
        *index_out = gpu >= 0 ? gpu : cpu;
    } else if (strcmp(want, "cpu") == 0) {
        *index_out = cpu;
    } else if (strcmp(want, "gpu") == 0) {
        if (gpu < 0) {
            return rg_fail(RG_ERR_DEVICE,
                "--device gpu: no GPU device is available in this build of ggml (devices: %s); "
                "rebuild llama-cpp-python with CMAKE_ARGS=\"-DGGML_VULKAN=on\" (or CUDA/Metal) "
                "or use --device cpu", n > 0 ? ggml_backend_dev_name(ggml_backend_dev_get(0)) : "none");
        }
        *index_out = gpu;
    } else {
        *index_out = -1;
        for (int i = 0; i < n; i++) {
            if (strcmp(ggml_backend_dev_name(ggml_backend_dev_get(i)), want) == 0) *index_out = i;
        }
        if (*index_out < 0) {
            return rg_fail(RG_ERR_DEVICE, "no device named '%s' (expected auto, cpu, gpu or a device name)", want);
        }
    }
    if (*index_out < 0) {
        return rg_fail(RG_ERR_DEVICE, "no CPU device registered in ggml");
    }
    return RG_OK;
}

/* GGUF metadata --------------------------------------------------------------------------- */
static bool kv_int(const struct gguf_context * g, const char * key, int64_t * out) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  *out = gguf_get_val_u8(g, id);  return true;
        case GGUF_TYPE_INT8:   *out = gguf_get_val_i8(g, id);  return true;
        case GGUF_TYPE_UINT16: *out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_INT16:  *out = gguf_get_val_i16(g, id); return true;
        case GGUF_TYPE_UINT32: *out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32:  *out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: *out = (int64_t) gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64:  *out = gguf_get_val_i64(g, id); return true;
        default: return false;
    }
}

static bool kv_float(const struct gguf_context * g, const char * key, float * out) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(g, id); return true;
        case GGUF_TYPE_FLOAT64: *out = (float) gguf_get_val_f64(g, id); return true;
        default: {
            int64_t v;
            if (kv_int(g, key, &v)) { *out = (float) v; return true; }
            return false;
        }
    }
}

static const char * kv_str(const struct gguf_context * g, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) return NULL;
    return gguf_get_val_str(g, id);
}

static rg_status need_int(const struct gguf_context * g, const char * arch, const char * suffix,
                          int * out, const char * path) {
    char key[160];
    snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    int64_t v;
    if (!kv_int(g, key, &v)) {
        const int64_t id = gguf_find_key(g, key);
        if (id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY) {
            return rg_fail(RG_ERR_UNSUPPORTED, "%s: key %s is a per-layer array; only uniform values are supported", path, key);
        }
        return rg_fail(RG_ERR_FORMAT, "%s: GGUF metadata key %s is missing or not an integer", path, key);
    }
    *out = (int) v;
    return RG_OK;
}

static int opt_int(const struct gguf_context * g, const char * arch, const char * suffix, int dflt) {
    char key[160];
    snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    int64_t v;
    return kv_int(g, key, &v) ? (int) v : dflt;
}

static float opt_float(const struct gguf_context * g, const char * arch, const char * suffix, float dflt) {
    char key[160];
    snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    float v;
    return kv_float(g, key, &v) ? v : dflt;
}

static rg_status read_hparams(rg_model * m, const char * path) {
    rg_hparams * hp = &m->hp;
    const struct gguf_context * g = m->gguf;
    const char * arch = kv_str(g, "general.architecture");
    if (!arch) return rg_fail(RG_ERR_FORMAT, "%s: no general.architecture key (not a model GGUF?)", path);
    const char * type = kv_str(g, "general.type");
    if (type && strcmp(type, "model") != 0) {
        return rg_fail(RG_ERR_FORMAT, "%s: general.type is '%s', expected a model (is this an adapter?)", path, type);
    }
    snprintf(hp->arch_name, sizeof(hp->arch_name), "%s", arch);
    if      (strcmp(arch, "llama")  == 0) hp->arch = RG_ARCH_LLAMA;
    else if (strcmp(arch, "qwen2")  == 0) hp->arch = RG_ARCH_QWEN2;
    else if (strcmp(arch, "qwen3")  == 0) hp->arch = RG_ARCH_QWEN3;
    else if (strcmp(arch, "gemma3") == 0) hp->arch = RG_ARCH_GEMMA3;
    else {
        return rg_fail(RG_ERR_UNSUPPORTED,
            "%s: architecture '%s' is not supported; supported: llama (Llama, Mistral, SmolLM), qwen2, qwen3, gemma3",
            path, arch);
    }
    rg_status st;
    if ((st = need_int(g, arch, "block_count", &hp->n_layer, path)))             return st;
    if ((st = need_int(g, arch, "embedding_length", &hp->n_embd, path)))         return st;
    if ((st = need_int(g, arch, "feed_forward_length", &hp->n_ff, path)))        return st;
    if ((st = need_int(g, arch, "attention.head_count", &hp->n_head, path)))     return st;
    hp->n_head_kv   = opt_int(g, arch, "attention.head_count_kv", hp->n_head);
    hp->head_dim_k  = opt_int(g, arch, "attention.key_length", hp->n_embd / hp->n_head);
    hp->head_dim_v  = opt_int(g, arch, "attention.value_length", hp->head_dim_k);
    hp->n_rot       = opt_int(g, arch, "rope.dimension_count", hp->head_dim_k);
    hp->n_ctx_train = opt_int(g, arch, "context_length", 2048);
    hp->rope_base   = opt_float(g, arch, "rope.freq_base", 10000.0f);
    hp->rms_eps     = opt_float(g, arch, "attention.layer_norm_rms_epsilon", 1e-5f);
    hp->rope_freq_scale = 1.0f;
    if (hp->n_layer <= 0 || hp->n_layer > RG_MAX_LAYERS) {
        return rg_fail(RG_ERR_UNSUPPORTED, "%s: %d layers (at most %d supported)", path, hp->n_layer, RG_MAX_LAYERS);
    }
    if (hp->n_head <= 0 || hp->n_head_kv <= 0 || hp->n_head % hp->n_head_kv != 0) {
        return rg_fail(RG_ERR_FORMAT, "%s: head_count %d is not a multiple of head_count_kv %d", path, hp->n_head, hp->n_head_kv);
    }
    if (hp->head_dim_k != hp->head_dim_v) {
        return rg_fail(RG_ERR_UNSUPPORTED, "%s: key length %d differs from value length %d", path, hp->head_dim_k, hp->head_dim_v);
    }
    {
        char key[160];
        snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
        const char * scaling = kv_str(g, key);
        if (scaling && strcmp(scaling, "none") != 0) {
            if (strcmp(scaling, "linear") != 0) {
                return rg_fail(RG_ERR_UNSUPPORTED, "%s: rope scaling '%s' is not supported (only linear)", path, scaling);
            }
            const float factor = opt_float(g, arch, "rope.scaling.factor", 1.0f);
            hp->rope_freq_scale = factor > 0 ? 1.0f / factor : 1.0f;
        }
    }
    {
        char key[160];
        snprintf(key, sizeof(key), "%s.final_logit_softcapping", arch);
        float cap = 0;
        if (kv_float(g, key, &cap) && cap != 0.0f) {
            return rg_fail(RG_ERR_UNSUPPORTED, "%s: final logit soft-capping is not supported", path);
        }
    }
    hp->attn_scale  = 1.0f / sqrtf((float) hp->head_dim_k);
    hp->embd_scale  = 1.0f;
    hp->rope_mode   = GGML_ROPE_TYPE_NEOX;
    hp->rope_base_swa = hp->rope_base;
    switch (hp->arch) {
        case RG_ARCH_LLAMA:
            hp->rope_mode = GGML_ROPE_TYPE_NORMAL;
            break;
        case RG_ARCH_QWEN2:
        case RG_ARCH_QWEN3:
            break;
        case RG_ARCH_GEMMA3: {
            hp->gelu_ffn   = true;
            hp->post_norms = true;
            hp->embd_scale = sqrtf((float) hp->n_embd);
            hp->n_swa      = opt_int(g, arch, "attention.sliding_window", 0);
            hp->rope_base_swa = opt_float(g, arch, "rope.freq_base_swa", 10000.0f);
            const int pattern = opt_int(g, arch, "attention.sliding_window_pattern", 6);
            for (int il = 0; il < hp->n_layer; il++) {
                /* every pattern-th layer is global, the others use the sliding window */
                hp->swa_layer[il] = hp->n_swa > 0 && (pattern == 0 || il % pattern < pattern - 1);
            }
            if (hp->n_layer == 62) {  /* the 27B variant scales by the model width per head */
                hp->attn_scale = 1.0f / sqrtf((float) (hp->n_embd / hp->n_head));
            }
        } break;
    }
    return RG_OK;
}

/* tensors --------------------------------------------------------------------------------- */
static struct ggml_tensor * find(rg_model * m, const char * fmt, int il) {
    char name[GGML_MAX_NAME];
    snprintf(name, sizeof(name), fmt, il);
    return ggml_get_tensor(m->wctx, name);
}

static rg_status require(struct ggml_tensor * t, const char * what, int il, const char * path) {
    if (t) return RG_OK;
    char name[GGML_MAX_NAME];
    snprintf(name, sizeof(name), what, il);
    return rg_fail(RG_ERR_FORMAT, "%s: required tensor '%s' is missing", path, name);
}

static rg_status check_shape(struct ggml_tensor * t, int64_t ne0, int64_t ne1, const char * path) {
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1) {
        return rg_fail(RG_ERR_FORMAT, "%s: tensor '%s' has shape [%lld, %lld, %lld], expected [%lld, %lld]",
                       path, t->name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                       (long long) ne0, (long long) ne1);
    }
    return RG_OK;
}

static const char * k_weight_names[RG_N_TARGETS] = {
    "blk.%d.attn_q.weight", "blk.%d.attn_k.weight", "blk.%d.attn_v.weight", "blk.%d.attn_output.weight",
    "blk.%d.ffn_gate.weight", "blk.%d.ffn_up.weight", "blk.%d.ffn_down.weight",
};

static rg_status bind_tensors(rg_model * m, const char * path) {
    const rg_hparams * hp = &m->hp;
    rg_status st;
    m->tok_embd    = find(m, "token_embd.weight", 0);
    m->output_norm = find(m, "output_norm.weight", 0);
    m->output      = find(m, "output.weight", 0);
    m->rope_freqs  = find(m, "rope_freqs.weight", 0);
    if ((st = require(m->tok_embd, "token_embd.weight", 0, path)))       return st;
    if ((st = require(m->output_norm, "output_norm.weight", 0, path)))   return st;
    m->hp.n_vocab = (int) m->tok_embd->ne[1];
    if ((st = check_shape(m->tok_embd, hp->n_embd, hp->n_vocab, path)))  return st;
    if (!m->output) m->output = m->tok_embd;   /* tied embeddings */
    if ((st = check_shape(m->output, hp->n_embd, hp->n_vocab, path)))    return st;

    const int64_t q_out = (int64_t) hp->n_head * hp->head_dim_k;
    const int64_t kv_out = (int64_t) hp->n_head_kv * hp->head_dim_k;
    const int64_t dims[RG_N_TARGETS][2] = {
        {hp->n_embd, q_out}, {hp->n_embd, kv_out}, {hp->n_embd, kv_out}, {q_out, hp->n_embd},
        {hp->n_embd, hp->n_ff}, {hp->n_embd, hp->n_ff}, {hp->n_ff, hp->n_embd},
    };
    for (int il = 0; il < hp->n_layer; il++) {
        rg_layer * L = &m->layers[il];
        L->attn_norm = find(m, "blk.%d.attn_norm.weight", il);
        L->ffn_norm  = find(m, "blk.%d.ffn_norm.weight", il);
        if ((st = require(L->attn_norm, "blk.%d.attn_norm.weight", il, path))) return st;
        if ((st = require(L->ffn_norm, "blk.%d.ffn_norm.weight", il, path)))   return st;
        for (int t = 0; t < RG_N_TARGETS; t++) {
            L->w[t] = find(m, k_weight_names[t], il);
            if ((st = require(L->w[t], k_weight_names[t], il, path))) return st;
            if ((st = check_shape(L->w[t], dims[t][0], dims[t][1], path))) return st;
        }
        L->bq = find(m, "blk.%d.attn_q.bias", il);
        L->bk = find(m, "blk.%d.attn_k.bias", il);
        L->bv = find(m, "blk.%d.attn_v.bias", il);
        L->bo = find(m, "blk.%d.attn_output.bias", il);
        L->q_norm = find(m, "blk.%d.attn_q_norm.weight", il);
        L->k_norm = find(m, "blk.%d.attn_k_norm.weight", il);
        if (hp->arch == RG_ARCH_QWEN3 || hp->arch == RG_ARCH_GEMMA3) {
            if ((st = require(L->q_norm, "blk.%d.attn_q_norm.weight", il, path))) return st;
            if ((st = require(L->k_norm, "blk.%d.attn_k_norm.weight", il, path))) return st;
        }
        if (hp->post_norms) {
            L->attn_post_norm = find(m, "blk.%d.post_attention_norm.weight", il);
            L->ffn_post_norm  = find(m, "blk.%d.post_ffw_norm.weight", il);
            if ((st = require(L->attn_post_norm, "blk.%d.post_attention_norm.weight", il, path))) return st;
            if ((st = require(L->ffn_post_norm, "blk.%d.post_ffw_norm.weight", il, path)))        return st;
        }
        if (find(m, "blk.%d.ffn_gate_inp.weight", il)) {
            return rg_fail(RG_ERR_UNSUPPORTED, "%s: mixture-of-experts layers are not supported", path);
        }
    }
    return RG_OK;
}

static rg_status load_data(rg_model * m, const char * path) {
    const size_t data_off = gguf_get_data_offset(m->gguf);
    const int64_t n_tensors = gguf_get_n_tensors(m->gguf);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return rg_fail(RG_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) { close(fd); return rg_fail(RG_ERR_IO, "%s: %s", path, strerror(errno)); }
    const size_t file_size = (size_t) sb.st_size;

    for (int64_t i = 0; i < n_tensors; i++) {
        struct ggml_tensor * t = ggml_get_tensor(m->wctx, gguf_get_tensor_name(m->gguf, i));
        const size_t off = data_off + gguf_get_tensor_offset(m->gguf, i);
        if (!t || off + ggml_nbytes(t) > file_size) {
            close(fd);
            return rg_fail(RG_ERR_FORMAT, "%s: tensor '%s' lies beyond the end of the file (truncated download?)",
                           path, gguf_get_tensor_name(m->gguf, i));
        }
        m->weight_bytes += ggml_nbytes(t);
        m->n_params += ggml_nelements(t);
    }

    if (backend_is_host(m->backend)) {
        void * addr = mmap(NULL, file_size, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (addr == MAP_FAILED) return rg_fail(RG_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
        m->map_addr = addr;
        m->map_size = file_size;
        m->wbuf = ggml_backend_cpu_buffer_from_ptr(addr, file_size);
        if (!m->wbuf) return rg_fail(RG_ERR_DEVICE, "%s: could not wrap the mapping in a CPU buffer", path);
        ggml_backend_buffer_set_usage(m->wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        for (int64_t i = 0; i < n_tensors; i++) {
            struct ggml_tensor * t = ggml_get_tensor(m->wctx, gguf_get_tensor_name(m->gguf, i));
            void * p = (char *) addr + data_off + gguf_get_tensor_offset(m->gguf, i);
            if (ggml_backend_tensor_alloc(m->wbuf, t, p) != GGML_STATUS_SUCCESS) {
                return rg_fail(RG_ERR_FORMAT, "%s: tensor '%s' is misaligned in the file", path, t->name);
            }
        }
        return RG_OK;
    }

    m->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(m->wctx, ggml_backend_dev_buffer_type(m->dev));
    if (!m->wbuf) { close(fd); return rg_fail(RG_ERR_NOMEM, "%s: could not allocate the weights on %s", path, ggml_backend_dev_name(m->dev)); }
    ggml_backend_buffer_set_usage(m->wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    size_t cap = 0;
    void * staging = NULL;
    for (int64_t i = 0; i < n_tensors; i++) {
        struct ggml_tensor * t = ggml_get_tensor(m->wctx, gguf_get_tensor_name(m->gguf, i));
        const size_t n = ggml_nbytes(t);
        if (n > cap) { free(staging); cap = n; staging = rg_malloc(cap, "staging a weight"); }
        if (!staging) { close(fd); return RG_ERR_NOMEM; }
        const ssize_t got = pread(fd, staging, n, (off_t) (data_off + gguf_get_tensor_offset(m->gguf, i)));
        if (got != (ssize_t) n) { free(staging); close(fd); return rg_fail(RG_ERR_IO, "%s: short read of '%s'", path, t->name); }
        ggml_backend_tensor_set(t, staging, 0, n);
    }
    free(staging);
    close(fd);
    return RG_OK;
}

/* n_threads <= 0: every online core */
static void set_threads(rg_model * m, int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int) n : 1;
    }
    m->n_threads = n_threads;
    ggml_backend_cpu_set_n_threads(m->backend_cpu, n_threads);
}

rg_status rg_model_init(const char * path, int device_index, int n_threads, rg_model ** out) {
    *out = NULL;
    if (!path) return rg_fail(RG_ERR_ARG, "no model path");
    if (access(path, R_OK) != 0) return rg_fail(RG_ERR_IO, "%s: %s", path, strerror(errno));
    if (device_index < 0 || device_index >= rg_device_count()) {
        return rg_fail(RG_ERR_DEVICE, "device index %d out of range (%d devices)", device_index, rg_device_count());
    }
    rg_model * m = rg_calloc(1, sizeof(*m), "the model");
    if (!m) return RG_ERR_NOMEM;
    m->cache_kernel = RG_KERNEL_GGML;     /* no weight cache yet (wcache.c) */
    struct gguf_init_params gp = { .no_alloc = true, .ctx = &m->wctx };
    m->gguf = gguf_init_from_file(path, gp);
    if (!m->gguf) {
        free(m);
        return rg_fail(RG_ERR_FORMAT, "%s: not a readable GGUF file", path);
    }
    rg_status st = read_hparams(m, path);
    if (st == RG_OK) st = bind_tensors(m, path);
    if (st == RG_OK) {
        m->dev_index = device_index;
        m->dev = ggml_backend_dev_get(device_index);
        m->backend = ggml_backend_dev_init(m->dev, NULL);
        if (!m->backend) st = rg_fail(RG_ERR_DEVICE, "could not initialise device %s", ggml_backend_dev_name(m->dev));
    }
    if (st == RG_OK) {
        if (backend_is_host(m->backend)) {
            m->backend_cpu = m->backend;
        } else {
            m->backend_cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
            if (!m->backend_cpu) st = rg_fail(RG_ERR_DEVICE, "could not initialise the CPU backend");
        }
    }
    if (st == RG_OK) st = load_data(m, path);
    if (st == RG_OK) set_threads(m, n_threads);
    if (st != RG_OK) {
        rg_model_free(m);
        return st;
    }
    *out = m;
    return RG_OK;
}

void rg_model_free(rg_model * m) {
    if (!m) return;
    rg_model_free_weight_cache(m);
    if (m->wbuf) ggml_backend_buffer_free(m->wbuf);
    if (m->map_addr) munmap(m->map_addr, m->map_size);
    if (m->backend_cpu && m->backend_cpu != m->backend) ggml_backend_free(m->backend_cpu);
    if (m->backend) ggml_backend_free(m->backend);
    if (m->wctx) ggml_free(m->wctx);
    if (m->gguf) gguf_free(m->gguf);
    free(m);
}

void rg_model_get_info(const rg_model * m, rg_model_info * out) {
    const rg_hparams * hp = &m->hp;
    memset(out, 0, sizeof(*out));
    snprintf(out->arch, sizeof(out->arch), "%s", hp->arch_name);
    out->n_layer = hp->n_layer;   out->n_embd = hp->n_embd;     out->n_head = hp->n_head;
    out->n_head_kv = hp->n_head_kv; out->head_dim = hp->head_dim_k; out->n_ff = hp->n_ff;
    out->n_vocab = hp->n_vocab;   out->n_ctx_train = hp->n_ctx_train; out->n_rot = hp->n_rot;
    out->rms_eps = hp->rms_eps;   out->rope_base = hp->rope_base; out->rope_base_swa = hp->rope_base_swa;
    out->rope_freq_scale = hp->rope_freq_scale; out->attn_scale = hp->attn_scale;
    out->embd_scale = hp->embd_scale; out->rope_mode = hp->rope_mode; out->n_swa = hp->n_swa;
    for (int il = 0; il < hp->n_layer; il++) out->n_swa_layers += hp->swa_layer[il];
    out->tied_output = m->output == m->tok_embd;
    out->has_qk_norm = m->layers[0].q_norm != NULL;
    out->n_params = m->n_params;
    out->weight_bytes = m->weight_bytes;
    out->device_index = m->dev_index;
    snprintf(out->device_name, sizeof(out->device_name), "%s", ggml_backend_dev_name(m->dev));
    out->mmapped = m->map_addr != NULL;
    out->n_threads = m->n_threads;
}

int rg_model_tensor_count(const rg_model * m) { return (int) gguf_get_n_tensors(m->gguf); }

rg_status rg_model_tensor_info(const rg_model * m, int index, const char ** name,
                               const char ** type_name, int64_t * ne) {
    if (index < 0 || index >= rg_model_tensor_count(m)) return rg_fail(RG_ERR_ARG, "tensor index %d out of range", index);
    struct ggml_tensor * t = ggml_get_tensor(m->wctx, gguf_get_tensor_name(m->gguf, index));
    *name = t->name;
    *type_name = ggml_type_name(t->type);
    for (int i = 0; i < 4; i++) ne[i] = t->ne[i];
    return RG_OK;
}
