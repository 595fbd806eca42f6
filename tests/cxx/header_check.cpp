// header_check.cpp: pkv.h from C++ (built as C++11 with -Wall -Wextra -Wpedantic -Wold-style-cast
// -Werror: PKV_SEQ_NONE below, a cast in C, must not be an old-style one here): the header
// compiles there and links against libpkv; a one-token decode returns that token's V.
#include <pkv.h>

#include <cstdio>
#include <vector>

int main() {
    pkv_config cfg = pkv_config_default();
    cfg.n_kv_heads = 1;
    cfg.head_dim = 32;
    cfg.n_blocks = 4;
    cfg.n_threads = 1;
    pkv_cache *c = nullptr;
    pkv_seq s = PKV_SEQ_NONE;
    int32_t tok = 7, slot = -1;
    std::vector<float> k(32, 0.25f), v(32, 3.0f), q(32, 1.0f), out(32, 0.0f);
    int rc = pkv_cache_create(&cfg, &c);
    if (!rc) rc = pkv_seq_create(c, nullptr, 0, &s);
    if (!rc) rc = pkv_seq_append(c, s, &tok, 1, &slot);
    if (!rc) rc = pkv_write_kv(c, 0, &slot, 1, k.data(), v.data(), PKV_DTYPE_F32);
    pkv_attn_params p = pkv_attn_params_default();
    if (!rc) rc = pkv_attn_decode(c, 0, &s, 1, q.data(), out.data(), &p);
    for (float x : out)
        if (!rc && x != 3.0f) rc = PKV_ECORRUPT; // f16 holds 3.0 exactly; one key: its V
    if (rc) std::fprintf(stderr, "header_check: %s\n", pkv_strerror(rc));
    pkv_cache_destroy(c);
    return rc ? 1 : 0;
}
