/*
 * util.h - what every native source uses (util.c): the thread's error message, checked host
 * allocations, the clock and node tracing. Not part of the ABI; every other file may include it,
 * and util.c calls no other file of the library.
 */
#ifndef RG_UTIL_H
#define RG_UTIL_H

#include "retrograd.h"

#include <stdbool.h>
#include <stddef.h>

/* Leaves the message for rg_last_error() and returns status, so `return rg_fail(...)` reports. */
rg_status rg_fail(rg_status status, const char * fmt, ...) __attribute__((format(printf, 2, 3)));

/* malloc / calloc that, on failure, leave "out of host memory ... for <what>" for rg_last_error()
 * and return NULL: the caller frees what it holds and returns RG_ERR_NOMEM. Zero bytes allocate
 * one, so NULL always means failure. */
void * rg_malloc(size_t bytes, const char * what);
void * rg_calloc(size_t n, size_t size, const char * what);

/* a monotonic clock in milliseconds (timings, profiles, benchmarks) */
double rg_now_ms(void);

/* RETRO_TRACE_NODES=1, read once: graphs name their nodes on stderr as they run (microbatch.c), so
 * a crash inside a device's driver is placed at the node after the last one named */
bool rg_trace_nodes(void);
/* RETRO_VK_NO_SYNC=1, read once: turns off the per-node wait on lavapipe (engine.c, issue 38) */
bool rg_vk_no_sync(void);

#endif /* RG_UTIL_H */
