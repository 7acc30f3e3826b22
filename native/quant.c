/*
 * quant.c - rows of a weight to floats and back with ggml's own conversions (the quantizer
 * llama.cpp's tools use), for writing a DoRA adapter merged into the base model's weights.
 */
#include "rg_internal.h"

#include <string.h>

static rg_status check_type(int type, int64_t n_per_row) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_type_size((enum ggml_type) type) == 0) {
        return rg_fail(RG_ERR_ARG, "ggml type %d is not a weight format of this ggml", type);
    }
    if (n_per_row % ggml_blck_size((enum ggml_type) type) != 0) {
        return rg_fail(RG_ERR_ARG, "rows of %lld values do not fill whole %s blocks of %lld", (long long) n_per_row,
                       ggml_type_name((enum ggml_type) type), (long long) ggml_blck_size((enum ggml_type) type));
    }
    return RG_OK;
}

size_t rg_rows_bytes(int type, int64_t n_rows, int64_t n_per_row) {
    if (check_type(type, n_per_row)) return 0;
    return (size_t) n_rows * ggml_row_size((enum ggml_type) type, n_per_row);
}

rg_status rg_rows_dequantize(int type, const void * src, float * dst, int64_t n_rows, int64_t n_per_row) {
    rg_status st = check_type(type, n_per_row);
    if (st) return st;
    const enum ggml_type t = (enum ggml_type) type;
    if (t == GGML_TYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t) (n_rows * n_per_row));
        return RG_OK;
    }
    const struct ggml_type_traits * tr = ggml_get_type_traits(t);
    if (!tr->to_float) return rg_fail(RG_ERR_ARG, "ggml cannot convert %s to floats", ggml_type_name(t));
    tr->to_float(src, dst, n_rows * n_per_row);
    return RG_OK;
}

rg_status rg_rows_quantize(int type, const float * src, void * dst, int64_t n_rows, int64_t n_per_row) {
    rg_status st = check_type(type, n_per_row);
    if (st) return st;
    const enum ggml_type t = (enum ggml_type) type;
    if (ggml_quantize_requires_imatrix(t)) {
        return rg_fail(RG_ERR_ARG, "%s needs an importance matrix to quantize; retrograd has none",
                       ggml_type_name(t));
    }
    if (t == GGML_TYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t) (n_rows * n_per_row));
        return RG_OK;
    }
    ggml_quantize_chunk(t, src, dst, 0, n_rows, n_per_row, NULL);
    return RG_OK;
}
