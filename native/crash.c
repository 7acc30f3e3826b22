/*
 * crash.c - a last word on a fatal signal. A fault inside a device driver (issue 38: Mesa 22's
 * lavapipe faulting on its queue thread during training) kills the process where our code cannot
 * catch it; what it can do is say plainly, as the process dies, what happened and how the run goes
 * on. The caller leaves that text here (rg_crash_note_set); a SIGSEGV, SIGBUS, SIGILL, SIGFPE or
 * SIGABRT on any thread writes it to stderr and then dies of the same signal as before: the
 * handlers that were there first (Python's faulthandler, the default core dump) still run.
 */
#include "util.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static const int k_signals[] = { SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT };
enum { N_SIGNALS = sizeof(k_signals) / sizeof(k_signals[0]) };

/* two buffers, so that the text the handler may read is never the one being written */
static char g_note[2][2048];
static volatile sig_atomic_t g_current = -1;   /* the buffer that holds the note, or -1: none */
static struct sigaction g_previous[N_SIGNALS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_installed;

static void on_fatal(int sig) {
    const int cur = g_current;
    if (cur >= 0) {
        const char * text = g_note[cur];
        size_t left = strlen(text);
        while (left > 0) {                      /* write(2) is async-signal-safe; strlen is too */
            const ssize_t n = write(STDERR_FILENO, text, left);
            if (n <= 0) break;
            text += n;
            left -= (size_t) n;
        }
    }
    for (int i = 0; i < N_SIGNALS; i++) {
        if (k_signals[i] == sig) sigaction(sig, &g_previous[i], NULL);
    }
    /* The signal is blocked while this handler runs: raised now, it reaches the previous handler
     * (or the default action) as soon as this one returns. A hardware fault would also repeat
     * itself when the faulting instruction runs again. */
    raise(sig);
}

static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_fatal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_ONSTACK;       /* Python's faulthandler gives threads an alternate stack */
    for (int i = 0; i < N_SIGNALS; i++) sigaction(k_signals[i], &sa, &g_previous[i]);
    g_installed = 1;
}

rg_status rg_crash_note_set(const char * text) {
    pthread_mutex_lock(&g_lock);
    if (!text || !text[0]) {
        g_current = -1;
    } else {
        const int next = g_current == 0 ? 1 : 0;
        const size_t n = strlen(text);
        const size_t keep = n < sizeof(g_note[next]) - 2 ? n : sizeof(g_note[next]) - 2;
        memcpy(g_note[next], text, keep);
        size_t end = keep;
        if (keep == 0 || g_note[next][keep - 1] != '\n') g_note[next][end++] = '\n';
        g_note[next][end] = '\0';
        g_current = next;
        if (!g_installed) install();
    }
    pthread_mutex_unlock(&g_lock);
    return RG_OK;
}
