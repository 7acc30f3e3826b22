/*
 * util.c - the thread's error message, checked host allocations, the clock and node tracing: the
 * few things every other file needs, kept here so that none of them depends on another for them
 * (model.c held them before, which tied every file to the model loader).
 */
#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static __thread char g_error[1024];

const char * rg_last_error(void) { return g_error; }

rg_status rg_fail(rg_status status, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof(g_error), fmt, ap);
    va_end(ap);
    return status;
}

void * rg_malloc(size_t bytes, const char * what) {
    void * p = malloc(bytes ? bytes : 1);
    if (!p) rg_fail(RG_ERR_NOMEM, "out of host memory: %zu bytes for %s", bytes, what);
    return p;
}

void * rg_calloc(size_t n, size_t size, const char * what) {
    void * p = calloc(n ? n : 1, size ? size : 1);
    if (!p) rg_fail(RG_ERR_NOMEM, "out of host memory: %zu x %zu bytes for %s", n, size, what);
    return p;
}

double rg_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* a process-wide debugging switch, VAR=1, read the first time it is asked for */
static bool env_switch(const char * var, int * cache) {
    if (*cache < 0) {
        const char * v = getenv(var);
        *cache = v && strcmp(v, "1") == 0;
    }
    return *cache == 1;
}

/* graphs name their nodes as they run (scripts/vk_opcheck.sh), not a setting */
bool rg_trace_nodes(void) {
    static int on = -1;
    return env_switch("RETRO_TRACE_NODES", &on);
}

/* the A/B switch of issue 38's containment on lavapipe (engine.c) */
bool rg_vk_no_sync(void) {
    static int on = -1;
    return env_switch("RETRO_VK_NO_SYNC", &on);
}
