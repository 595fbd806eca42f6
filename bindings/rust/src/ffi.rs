//! The C API of pkv.h, declared by hand (no bindgen offline). `tests/api.rs` checks every
//! struct's size and field offsets against the C compiler's, through `tests/python/abi_layout.c`.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub type pkv_seq = u64;

#[repr(C)]
pub struct pkv_cache {
    _private: [u8; 0],
}

#[repr(C)]
pub struct pkv_tier {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct pkv_tier_stats {
    pub entries: u64,
    pub bytes: u64,
    pub capacity: u64,
    pub evictions: u64,
    pub saved: u64,
    pub save_present: u64,
    pub save_no_room: u64,
    pub loaded_blocks: u64,
    pub loaded_tokens: u64,
    pub load_misses: u64,
    pub rejected: u64,
    pub errors: u64,
    pub prefetched: u64,
    pub prefetch_hits: u64,
    pub prefetch_dropped: u64,
    pub staged_entries: u64,
    pub staged_bytes: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct pkv_allocator {
    pub alloc: Option<unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void>,
    pub free: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize)>,
    pub ctx: *mut c_void,
}

pub type pkv_task_fn = Option<unsafe extern "C" fn(*mut c_void, u32, u32)>;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct pkv_executor {
    pub parallel_for: Option<unsafe extern "C" fn(*mut c_void, pkv_task_fn, *mut c_void, u32)>,
    pub ctx: *mut c_void,
    pub n_workers: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct pkv_config {
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub block_tokens: u32,
    pub n_blocks: u32,
    pub mem_budget_bytes: u64,
    pub k_dtype: c_int,
    pub v_dtype: c_int,
    pub max_seqs: u32,
    pub max_blocks_per_seq: u32,
    pub n_threads: u32,
    pub enable_prefix_cache: c_int,
    pub huge_pages: c_int,
    pub allocator: pkv_allocator,
    pub log: Option<unsafe extern "C" fn(*mut c_void, c_int, *const c_char)>,
    pub log_ctx: *mut c_void,
    pub executor: pkv_executor,
    pub event_capacity: u32,
    pub v_dim: u32,
    pub spin_us: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct pkv_seq_info {
    pub n_tokens: u32,
    pub n_committed: u32,
    pub n_blocks: u32,
    pub n_shared: u32,
    pub n_reused: u32,
    pub n_dropped: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pkv_layout {
    pub k_base: *mut u8,
    pub v_base: *mut u8,
    pub layer_stride_bytes: usize,
    pub k_row_bytes: usize,
    pub v_row_bytes: usize,
    pub k_block_bytes: usize,
    pub v_block_bytes: usize,
    pub n_blocks: u32,
    pub block_tokens: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub n_layers: u32,
    pub k_dtype: c_int,
    pub v_dtype: c_int,
    pub v_dim: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct pkv_stats {
    pub n_blocks: u32,
    pub n_free: u32,
    pub n_cached: u32,
    pub n_active: u32,
    pub n_seqs: u32,
    pub n_pins: u32,
    pub n_tokens: u64,
    pub n_slots_used: u64,
    pub kv_bytes: u64,
    pub kv_bytes_per_block: u64,
    pub meta_bytes: u64,
    pub frag_slots: u64,
    pub cow_copies: u64,
    pub peak_active: u32,
    pub prefix_lookups: u64,
    pub prefix_tokens_queried: u64,
    pub prefix_tokens_hit: u64,
    pub prefix_miss_new: u64,
    pub prefix_miss_evicted: u64,
    pub prefix_miss_namespace: u64,
    pub n_indexed: u64,
    pub evictions: u64,
    pub attn_reqs_pool: u64,
    pub attn_reqs_table: u64,
    pub attn_shared_keys: u64,
    pub n_tombstones: u64,
    pub prefix_tomb_hits: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct pkv_attn_params {
    pub n_q_heads: u32,
    pub scale: f32,
    pub softcap: f32,
    pub window: u32,
    pub lse: *mut f32,
    pub flags: u32,
    pub sinks: *const f32,
    pub alibi_slopes: *const f32,
    pub attn_chunk: u32,
}

/// pkv_attn_params.flags: bf16 arithmetic allowed with bf16 K/V (pkv.h).
pub const PKV_ATTN_BF16_DOT: u32 = 1;
/// pkv_attn_params.flags: each prefill query sees its whole sequence (pkv.h).
pub const PKV_ATTN_NONCAUSAL: u32 = 2;
/// pkv_attn_params.flags: f16 K and V may be computed as bf16 where the backend has bf16 tiles (pkv.h).
pub const PKV_ATTN_F16_AS_BF16: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct pkv_attn_req {
    pub seq: pkv_seq,
    pub q_start: u32,
    pub n_q: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pkv_attn_tree_req {
    pub seq: pkv_seq,
    pub q_start: u32,
    pub n_nodes: u32,
    pub parent: *const i32,
}

pub const PKV_TREE_MAX_NODES: u32 = 1024;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pkv_append_req {
    pub seq: pkv_seq,
    pub tokens: *const i32,
    pub n: u32,
    pub slots_out: *mut i32,
}

pub const PKV_APPEND_FIT: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pkv_rope {
    pub dim0: u32,
    pub n_rot: u32,
    pub style: u32,
    pub theta: f32,
    pub inv_freq: *const f32,
}

pub const PKV_ROPE_NEOX: u32 = 0;
pub const PKV_ROPE_GPTJ: u32 = 1;

/// pkv_event_kind (pkv.h, "prefix-index events").
pub const PKV_EVENT_STORED: u32 = 1;
pub const PKV_EVENT_REMOVED: u32 = 2;
pub const PKV_EVENT_CLEARED: u32 = 3;
pub const PKV_EVENT_OVERFLOW: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct pkv_event {
    pub seqno: u64,
    pub hash: u64,
    pub parent_hash: u64,
    pub lost: u64,
    pub kind: u32,
    pub depth: u32,
    pub block: u32,
    pub reserved: u32,
}

extern "C" {
    pub fn pkv_strerror(rc: c_int) -> *const c_char;
    pub fn pkv_version() -> *const c_char;
    pub fn pkv_dtype_row_bytes(dtype: c_int, head_dim: u32) -> usize;
    pub fn pkv_dtype_name(dtype: c_int) -> *const c_char;
    pub fn pkv_dtype_from_name(name: *const c_char, out: *mut c_int) -> c_int;
    pub fn pkv_config_default() -> pkv_config;
    pub fn pkv_cache_create(cfg: *const pkv_config, out: *mut *mut pkv_cache) -> c_int;
    pub fn pkv_cache_destroy(c: *mut pkv_cache);
    pub fn pkv_cache_reset(c: *mut pkv_cache) -> c_int;
    pub fn pkv_cache_config(c: *const pkv_cache, out: *mut pkv_config) -> c_int;
    pub fn pkv_cache_layout(c: *const pkv_cache, out: *mut pkv_layout) -> c_int;
    pub fn pkv_seq_create(c: *mut pkv_cache, salt: *const c_void, salt_len: usize, out: *mut pkv_seq) -> c_int;
    pub fn pkv_seq_append(c: *mut pkv_cache, s: pkv_seq, tokens: *const i32, n: u32, slots_out: *mut i32) -> c_int;
    pub fn pkv_seq_append_blocks(c: *mut pkv_cache, s: pkv_seq, n: u32, n_blocks: *mut u32) -> c_int;
    pub fn pkv_batch_append(
        c: *mut pkv_cache,
        reqs: *const pkv_append_req,
        n_reqs: u32,
        flags: u32,
        n_done: *mut u32,
    ) -> c_int;
    pub fn pkv_write_kv(
        c: *mut pkv_cache,
        layer: u32,
        slots: *const i32,
        n: u32,
        k: *const c_void,
        v: *const c_void,
        in_dtype: c_int,
    ) -> c_int;
    pub fn pkv_seq_write_kv(
        c: *mut pkv_cache,
        s: pkv_seq,
        layer: u32,
        start: u32,
        n: u32,
        k: *const c_void,
        v: *const c_void,
        in_dtype: c_int,
    ) -> c_int;
    pub fn pkv_seq_commit(c: *mut pkv_cache, s: pkv_seq, n_pos: u32) -> c_int;
    pub fn pkv_seq_fork(c: *mut pkv_cache, parent: pkv_seq, child: *mut pkv_seq) -> c_int;
    pub fn pkv_seq_truncate(c: *mut pkv_cache, s: pkv_seq, n: u32) -> c_int;
    pub fn pkv_seq_drop_front(c: *mut pkv_cache, s: pkv_seq, pos: u32) -> c_int;
    pub fn pkv_seq_keep(c: *mut pkv_cache, s: pkv_seq, start: u32, idx: *const u32, n: u32) -> c_int;
    pub fn pkv_seq_shift(c: *mut pkv_cache, s: pkv_seq, from: u32, to: u32, rope: *const pkv_rope) -> c_int;
    pub fn pkv_seq_compact(c: *mut pkv_cache, s: pkv_seq, flags: u32, n_moved: *mut u32) -> c_int;
    pub fn pkv_batch_compact(
        c: *mut pkv_cache,
        seqs: *const pkv_seq,
        n: u32,
        slack: u32,
        flags: u32,
        n_moved: *mut u32,
    ) -> c_int;
    pub fn pkv_seq_release(c: *mut pkv_cache, s: pkv_seq) -> c_int;
    pub fn pkv_seq_get_info(c: *mut pkv_cache, s: pkv_seq, out: *mut pkv_seq_info) -> c_int;
    pub fn pkv_seq_slots(c: *mut pkv_cache, s: pkv_seq, start: u32, n: u32, slots: *mut i32) -> c_int;
    pub fn pkv_seq_block_table(c: *mut pkv_cache, s: pkv_seq, out: *mut i32, cap: u32, n_out: *mut u32) -> c_int;
    pub fn pkv_seq_gather(
        c: *mut pkv_cache,
        s: pkv_seq,
        layer: u32,
        start: u32,
        n: u32,
        k_out: *mut f32,
        v_out: *mut f32,
    ) -> c_int;
    pub fn pkv_seq_read_stored(
        c: *mut pkv_cache,
        s: pkv_seq,
        layer: u32,
        start: u32,
        n: u32,
        k_out: *mut c_void,
        v_out: *mut c_void,
    ) -> c_int;
    pub fn pkv_seq_write_stored(
        c: *mut pkv_cache,
        s: pkv_seq,
        layer: u32,
        start: u32,
        n: u32,
        k: *const c_void,
        v: *const c_void,
    ) -> c_int;
    pub fn pkv_export_dense(
        c: *mut pkv_cache,
        seqs: *const pkv_seq,
        n_seqs: u32,
        max_blocks: u32,
        block_tables: *mut i32,
        seq_lens: *mut i32,
    ) -> c_int;
    pub fn pkv_export_csr(
        c: *mut pkv_cache,
        seqs: *const pkv_seq,
        n_seqs: u32,
        indptr: *mut i32,
        indices: *mut i32,
        indices_cap: u32,
        last_page_len: *mut i32,
        n_needed: *mut u32,
    ) -> c_int;
    pub fn pkv_seq_match_prefix(c: *mut pkv_cache, s: pkv_seq, tokens: *const i32, n: u32, n_reused: *mut u32)
        -> c_int;
    pub fn pkv_seq_match_prefix_window(
        c: *mut pkv_cache,
        s: pkv_seq,
        tokens: *const i32,
        n: u32,
        window: u32,
        n_reused: *mut u32,
    ) -> c_int;
    pub fn pkv_pin_create(c: *mut pkv_cache, s: pkv_seq, n_pos: u32, pin: *mut pkv_seq) -> c_int;
    pub fn pkv_pin_release(c: *mut pkv_cache, pin: pkv_seq) -> c_int;
    pub fn pkv_cache_take_events(
        c: *mut pkv_cache,
        out: *mut pkv_event,
        cap: usize,
        tokens: *mut i32,
        n_out: *mut usize,
    ) -> c_int;
    pub fn pkv_prefix_snapshot(
        c: *mut pkv_cache,
        out: *mut pkv_event,
        cap: usize,
        tokens: *mut i32,
        n_out: *mut usize,
    ) -> c_int;
    pub fn pkv_prefix_hashes(
        salt: *const c_void,
        salt_len: usize,
        block_tokens: u32,
        tokens: *const i32,
        n: usize,
        hashes: *mut u64,
        cap: usize,
        n_out: *mut usize,
    ) -> c_int;
    pub fn pkv_media_tokens(id: *const c_void, id_len: usize, offset: u32, n: u32, out: *mut i32) -> c_int;
    pub fn pkv_cache_get_stats(c: *mut pkv_cache, out: *mut pkv_stats) -> c_int;
    pub fn pkv_tier_host_create(capacity_bytes: u64, alloc: *const pkv_allocator, out: *mut *mut pkv_tier) -> c_int;
    pub fn pkv_tier_file_create(
        dir: *const c_char,
        capacity_bytes: u64,
        alloc: *const pkv_allocator,
        out: *mut *mut pkv_tier,
    ) -> c_int;
    pub fn pkv_tier_redis_create(
        host: *const c_char,
        port: c_int,
        key_prefix: *const c_char,
        timeout_ms: u32,
        alloc: *const pkv_allocator,
        out: *mut *mut pkv_tier,
    ) -> c_int;
    pub fn pkv_tier_destroy(t: *mut pkv_tier);
    pub fn pkv_tier_get_stats(t: *mut pkv_tier, out: *mut pkv_tier_stats) -> c_int;
    pub fn pkv_tier_save(t: *mut pkv_tier, c: *mut pkv_cache, s: pkv_seq, n_saved: *mut u32) -> c_int;
    pub fn pkv_tier_load(
        t: *mut pkv_tier,
        c: *mut pkv_cache,
        s: pkv_seq,
        tokens: *const i32,
        n: u32,
        n_loaded: *mut u32,
    ) -> c_int;
    pub fn pkv_tier_load_window(
        t: *mut pkv_tier,
        c: *mut pkv_cache,
        s: pkv_seq,
        tokens: *const i32,
        n: u32,
        window: u32,
        n_loaded: *mut u32,
    ) -> c_int;
    pub fn pkv_tier_prefetch_start(t: *mut pkv_tier, staging_bytes: u64) -> c_int;
    pub fn pkv_tier_prefetch(
        t: *mut pkv_tier,
        c: *const pkv_cache,
        salt: *const c_void,
        salt_len: usize,
        tokens: *const i32,
        n: u32,
    ) -> c_int;
    pub fn pkv_tier_prefetch_window(
        t: *mut pkv_tier,
        c: *const pkv_cache,
        salt: *const c_void,
        salt_len: usize,
        tokens: *const i32,
        n: u32,
        window: u32,
    ) -> c_int;
    pub fn pkv_tier_prefetch_wait(t: *mut pkv_tier) -> c_int;
    pub fn pkv_tier_save_async(t: *mut pkv_tier, c: *mut pkv_cache, s: pkv_seq, n_queued: *mut u32) -> c_int;
    pub fn pkv_tier_flush(t: *mut pkv_tier) -> c_int;
    pub fn pkv_cache_check(c: *mut pkv_cache, msg: *mut c_char, msg_cap: usize) -> c_int;
    pub fn pkv_attn_params_default() -> pkv_attn_params;
    pub fn pkv_attn_decode(
        c: *mut pkv_cache,
        layer: u32,
        seqs: *const pkv_seq,
        n_seqs: u32,
        q: *const f32,
        out: *mut f32,
        p: *const pkv_attn_params,
    ) -> c_int;
    pub fn pkv_attn_prefill(
        c: *mut pkv_cache,
        layer: u32,
        reqs: *const pkv_attn_req,
        n_reqs: u32,
        q: *const f32,
        out: *mut f32,
        p: *const pkv_attn_params,
    ) -> c_int;
    pub fn pkv_attn_prefill_masked(
        c: *mut pkv_cache,
        layer: u32,
        reqs: *const pkv_attn_req,
        n_reqs: u32,
        masks: *const *const u8,
        q: *const f32,
        out: *mut f32,
        p: *const pkv_attn_params,
    ) -> c_int;
    pub fn pkv_attn_tree(
        c: *mut pkv_cache,
        layer: u32,
        reqs: *const pkv_attn_tree_req,
        n_reqs: u32,
        q: *const f32,
        out: *mut f32,
        p: *const pkv_attn_params,
    ) -> c_int;
    pub fn pkv_attn_merge(
        n_rows: u32,
        head_dim: u32,
        out_a: *const f32,
        lse_a: *const f32,
        out_b: *const f32,
        lse_b: *const f32,
        out: *mut f32,
        lse: *mut f32,
    ) -> c_int;
    pub fn pkv_attn_backend(c: *const pkv_cache) -> *const c_char;
    pub fn pkv_attn_flags_used(c: *const pkv_cache) -> u32;
}
