/* abi_layout.c: prints the size of every public struct of pkv.h that the Python bindings mirror
 * in ctypes, and the offset of each of its fields, as "struct size" and "struct.field offset"
 * lines; test_pagedkv.py compares them with its ctypes structures, so a field added to pkv.h
 * and not to python/pagedkv.py fails that test instead of corrupting memory. */
#include <pkv.h>
#include <stddef.h>
#include <stdio.h>

#define SIZE(T) printf(#T " %zu\n", sizeof(T))
#define FIELD(T, f) printf(#T "." #f " %zu\n", offsetof(T, f))

int main(void) {
    SIZE(pkv_config);
    FIELD(pkv_config, n_layers), FIELD(pkv_config, n_kv_heads), FIELD(pkv_config, head_dim);
    FIELD(pkv_config, block_tokens), FIELD(pkv_config, n_blocks), FIELD(pkv_config, mem_budget_bytes);
    FIELD(pkv_config, k_dtype), FIELD(pkv_config, v_dtype), FIELD(pkv_config, max_seqs);
    FIELD(pkv_config, max_blocks_per_seq), FIELD(pkv_config, n_threads), FIELD(pkv_config, enable_prefix_cache);
    FIELD(pkv_config, huge_pages), FIELD(pkv_config, allocator), FIELD(pkv_config, log);
    FIELD(pkv_config, log_ctx), FIELD(pkv_config, executor), FIELD(pkv_config, event_capacity);
    FIELD(pkv_config, v_dim), FIELD(pkv_config, spin_us);
    SIZE(pkv_allocator);
    FIELD(pkv_allocator, alloc), FIELD(pkv_allocator, free), FIELD(pkv_allocator, ctx);
    SIZE(pkv_executor);
    FIELD(pkv_executor, parallel_for), FIELD(pkv_executor, ctx), FIELD(pkv_executor, n_workers);
    SIZE(pkv_rope);
    FIELD(pkv_rope, dim0), FIELD(pkv_rope, n_rot), FIELD(pkv_rope, style), FIELD(pkv_rope, theta);
    FIELD(pkv_rope, inv_freq);
    SIZE(pkv_layout);
    FIELD(pkv_layout, k_base), FIELD(pkv_layout, v_base), FIELD(pkv_layout, layer_stride_bytes);
    FIELD(pkv_layout, k_row_bytes), FIELD(pkv_layout, v_row_bytes), FIELD(pkv_layout, k_block_bytes);
    FIELD(pkv_layout, v_block_bytes), FIELD(pkv_layout, n_blocks), FIELD(pkv_layout, block_tokens);
    FIELD(pkv_layout, n_kv_heads), FIELD(pkv_layout, head_dim), FIELD(pkv_layout, n_layers);
    FIELD(pkv_layout, k_dtype), FIELD(pkv_layout, v_dtype), FIELD(pkv_layout, v_dim);
    SIZE(pkv_seq_info);
    FIELD(pkv_seq_info, n_tokens), FIELD(pkv_seq_info, n_committed), FIELD(pkv_seq_info, n_blocks);
    FIELD(pkv_seq_info, n_shared), FIELD(pkv_seq_info, n_reused), FIELD(pkv_seq_info, n_dropped);
    SIZE(pkv_stats);
    FIELD(pkv_stats, n_blocks), FIELD(pkv_stats, n_free), FIELD(pkv_stats, n_cached), FIELD(pkv_stats, n_active);
    FIELD(pkv_stats, n_seqs), FIELD(pkv_stats, n_pins), FIELD(pkv_stats, n_tokens), FIELD(pkv_stats, n_slots_used);
    FIELD(pkv_stats, kv_bytes), FIELD(pkv_stats, kv_bytes_per_block), FIELD(pkv_stats, meta_bytes);
    FIELD(pkv_stats, frag_slots), FIELD(pkv_stats, cow_copies), FIELD(pkv_stats, peak_active);
    FIELD(pkv_stats, prefix_lookups), FIELD(pkv_stats, prefix_tokens_queried), FIELD(pkv_stats, prefix_tokens_hit);
    FIELD(pkv_stats, prefix_miss_new), FIELD(pkv_stats, prefix_miss_evicted), FIELD(pkv_stats, prefix_miss_namespace);
    FIELD(pkv_stats, n_indexed), FIELD(pkv_stats, evictions), FIELD(pkv_stats, attn_reqs_pool);
    FIELD(pkv_stats, attn_reqs_table), FIELD(pkv_stats, attn_shared_keys);
    FIELD(pkv_stats, n_tombstones), FIELD(pkv_stats, prefix_tomb_hits);
    SIZE(pkv_attn_params);
    FIELD(pkv_attn_params, n_q_heads), FIELD(pkv_attn_params, scale), FIELD(pkv_attn_params, softcap);
    FIELD(pkv_attn_params, window), FIELD(pkv_attn_params, lse), FIELD(pkv_attn_params, flags);
    FIELD(pkv_attn_params, sinks), FIELD(pkv_attn_params, alibi_slopes), FIELD(pkv_attn_params, attn_chunk);
    SIZE(pkv_attn_req);
    FIELD(pkv_attn_req, seq), FIELD(pkv_attn_req, q_start), FIELD(pkv_attn_req, n_q);
    SIZE(pkv_attn_tree_req);
    FIELD(pkv_attn_tree_req, seq), FIELD(pkv_attn_tree_req, q_start), FIELD(pkv_attn_tree_req, n_nodes);
    FIELD(pkv_attn_tree_req, parent);
    SIZE(pkv_append_req);
    FIELD(pkv_append_req, seq), FIELD(pkv_append_req, tokens), FIELD(pkv_append_req, n);
    FIELD(pkv_append_req, slots_out);
    SIZE(pkv_tier_stats);
    FIELD(pkv_tier_stats, entries), FIELD(pkv_tier_stats, bytes), FIELD(pkv_tier_stats, capacity);
    FIELD(pkv_tier_stats, evictions), FIELD(pkv_tier_stats, saved), FIELD(pkv_tier_stats, save_present);
    FIELD(pkv_tier_stats, save_no_room), FIELD(pkv_tier_stats, loaded_blocks), FIELD(pkv_tier_stats, loaded_tokens);
    FIELD(pkv_tier_stats, load_misses), FIELD(pkv_tier_stats, rejected), FIELD(pkv_tier_stats, errors);
    FIELD(pkv_tier_stats, prefetched), FIELD(pkv_tier_stats, prefetch_hits), FIELD(pkv_tier_stats, prefetch_dropped);
    FIELD(pkv_tier_stats, staged_entries), FIELD(pkv_tier_stats, staged_bytes);
    SIZE(pkv_event);
    FIELD(pkv_event, seqno), FIELD(pkv_event, hash), FIELD(pkv_event, parent_hash), FIELD(pkv_event, lost);
    FIELD(pkv_event, kind), FIELD(pkv_event, depth), FIELD(pkv_event, block), FIELD(pkv_event, reserved);
    return 0;
}
