/* attn_stub.c: placeholder attention context until the kernels land: creates a context and
 * answers PKV_ENOTSUP to every run. */
#include "attn.h"

struct pkv__attn {
    pkv_allocator a;
    uint32_t n_threads;
};

int pkv__attn_create(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim, pkv__attn **out) {
    (void)lim;
    pkv__attn *at = pkv__alloc(a, sizeof *at, 64);
    if (!at) return PKV_ENOMEM;
    at->a = *a;
    at->n_threads = n_threads ? n_threads : pkv__n_cpus();
    *out = at;
    return PKV_OK;
}

void pkv__attn_destroy(pkv__attn *at) {
    if (!at) return;
    pkv_allocator a = at->a;
    pkv__free(&a, at, sizeof *at);
}

const char *pkv__attn_backend_name(const pkv__attn *at) { (void)at; return "none"; }
uint32_t pkv__attn_n_threads(const pkv__attn *at) { return at->n_threads; }

int pkv__attn_run(pkv__attn *at, const pkv__kv_view *kv, const pkv__attn_item *items, uint32_t n_items,
                  const pkv__attn_call *call) {
    (void)at, (void)kv, (void)items, (void)n_items, (void)call;
    return PKV_ENOTSUP;
}
