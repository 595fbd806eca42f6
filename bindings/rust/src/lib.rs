//! pagedkv: safe Rust bindings of libpkv, a paged KV cache and paged attention for LLM inference.
//!
//! Every method is one libpkv call. A status other than `PKV_OK` is an [`Error`] carrying it;
//! every slice's length is checked against the call before libpkv sees it (the C API cannot see
//! lengths), so a wrong shape is an `EINVAL` error, never a read or write past a slice.
//!
//! Borrowing follows libpkv's threading rule (pkv.h, docs/design.md "Threads"): calls that
//! change sequences or write K/V take `&mut self`; calls that only read (attention, gather,
//! block tables, stats, the checker) take `&self` and may run on several threads at once
//! (`Cache` is `Send` and `Sync`; attention calls are serialized inside the library). So no
//! block table or K/V row can change under a running read.
//!
//! ```no_run
//! use pagedkv::{AttnParams, Cache, Config, KvData};
//! let mut c = Cache::new(&Config { n_kv_heads: 2, head_dim: 64, n_blocks: 64, ..Config::default() })?;
//! let s = c.seq_create(b"")?;
//! let slots = c.append(s, &(100..120).collect::<Vec<i32>>())?;
//! let kv = vec![0.5f32; 20 * 2 * 64];
//! c.write_kv(0, &slots, Some(KvData::F32(&kv)), Some(KvData::F32(&kv)))?;
//! c.commit(s, 20)?;
//! let q = vec![1.0f32; 8 * 64]; // 8 query heads over 2 kv heads (GQA)
//! let mut out = vec![0.0f32; 8 * 64];
//! c.decode(0, &[s], &q, &mut out, &AttnParams { n_q_heads: 8, ..AttnParams::default() }, None)?;
//! # Ok::<(), pagedkv::Error>(())
//! ```

pub mod ffi;

use std::ffi::{CStr, CString};
use std::fmt;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::{self, NonNull};

/// Status codes (pkv.h; values never change once released).
pub const OK: i32 = 0;
pub const EINVAL: i32 = -1;
pub const ENOMEM: i32 = -2;
pub const ENOSPC: i32 = -3;
pub const ENOENT: i32 = -4;
pub const ELIMIT: i32 = -5;
pub const ECORRUPT: i32 = -6;
pub const EIO: i32 = -7;
pub const ENOTSUP: i32 = -8;
pub const EBUSY: i32 = -9;

/// `PKV_VALUE_MAX` (pkv.h): the largest |element| `write_kv` takes, and the largest |q| x scale
/// the attention calls take (2^56); past it, `EINVAL`.
pub const VALUE_MAX: f64 = 72057594037927936.0;

/// A libpkv status other than `PKV_OK` (or `EINVAL` from the binding's own checks), with what
/// was being done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    code: i32,
    context: String,
}

impl Error {
    fn new(code: i32, context: impl Into<String>) -> Error {
        Error {
            code,
            context: context.into(),
        }
    }

    /// The status code (`pagedkv::EINVAL`, ...).
    pub fn code(&self) -> i32 {
        self.code
    }

    /// The status as an [`ErrorKind`], to match on: an engine preempts on
    /// `ErrorKind::NoSpace` and drops a request on `ErrorKind::NotFound`.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::from_code(self.code)
    }

    /// The status's name: "EINVAL", "ENOENT", ...
    pub fn name(&self) -> &'static str {
        status(self.code).map_or("unknown status", |s| s.1)
    }
}

/// Each status other than `OK`: its code, name and kind.
const STATUSES: [(i32, &str, ErrorKind); 9] = [
    (EINVAL, "EINVAL", ErrorKind::InvalidArgument),
    (ENOMEM, "ENOMEM", ErrorKind::OutOfMemory),
    (ENOSPC, "ENOSPC", ErrorKind::NoSpace),
    (ENOENT, "ENOENT", ErrorKind::NotFound),
    (ELIMIT, "ELIMIT", ErrorKind::Limit),
    (ECORRUPT, "ECORRUPT", ErrorKind::Corrupt),
    (EIO, "EIO", ErrorKind::Io),
    (ENOTSUP, "ENOTSUP", ErrorKind::NotSupported),
    (EBUSY, "EBUSY", ErrorKind::Busy),
];

fn status(code: i32) -> Option<&'static (i32, &'static str, ErrorKind)> {
    STATUSES.iter().find(|s| s.0 == code)
}

/// What a libpkv status means, one variant a status (pkv.h's wording); [`Error::kind`]. A call
/// that fails changes no state of the cache, whatever the kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// `EINVAL`: a bad argument (a length or shape that does not match the call, a slot, layer
    /// or position out of range, a value past `VALUE_MAX`).
    InvalidArgument,
    /// `ENOMEM`: a host allocation failed.
    OutOfMemory,
    /// `ENOSPC`: no block available, even after evicting every cached block (an engine
    /// preempts a sequence here).
    NoSpace,
    /// `ENOENT`: an unknown or stale sequence.
    NotFound,
    /// `ELIMIT`: `max_seqs` or `max_blocks_per_seq` would be exceeded.
    Limit,
    /// `ECORRUPT`: the checker found a broken invariant.
    Corrupt,
    /// `EIO`: an I/O error of a storage tier's store (a directory that cannot be used, Redis
    /// not answering, a write-back put that failed: [`Tier::flush`]).
    Io,
    /// `ENOTSUP`: a valid request this build or configuration does not support.
    NotSupported,
    /// `EBUSY`: the object is in use (a block shared with another sequence, ...).
    Busy,
    /// A status this version of the binding does not know (`Error::code` has it).
    Unknown,
}

impl ErrorKind {
    /// The kind of a status code; `OK` and codes this binding does not know are `Unknown`.
    pub fn from_code(code: i32) -> ErrorKind {
        status(code).map_or(ErrorKind::Unknown, |s| s.2)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.context, strerror(self.code), self.name())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

thread_local! {
    /// Why the libpkv call refusing on this thread refused: libpkv says it through the log hook
    /// at PKV_LOG_ERROR, on the calling thread, before the call returns (pkv.h); `check` takes
    /// it for the [`Error`]'s context.
    static SAID: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// What libpkv said on this thread about the call that just refused, else `what`.
fn said_or(what: &str) -> String {
    SAID.with(|s| s.borrow_mut().take()).unwrap_or_else(|| what.to_string())
}

fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == OK {
        Ok(())
    } else {
        Err(Error::new(rc, said_or(what)))
    }
}

fn invalid(what: String) -> Error {
    Error::new(EINVAL, what)
}

fn len_u32(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| invalid(format!("{}: {} is past u32", what, n)))
}

/// a * b, or EINVAL where the product is past usize (a length no slice can have).
fn mul_len(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| invalid(format!("{}: {} x {} elements is past usize", what, a, b)))
}

fn want_len(have: usize, want: usize, what: &str) -> Result<()> {
    if have == want {
        Ok(())
    } else {
        Err(invalid(format!("{}: {} elements, {} needed", what, have, want)))
    }
}

/// The pointers and the one type of a write's K and V (either may be None, not both), each of
/// `want` elements.
fn kv_args(
    k: &Option<KvData<'_>>,
    v: &Option<KvData<'_>>,
    want: usize,
    what: &str,
) -> Result<([*const c_void; 2], Dtype)> {
    let mut dtype = None;
    let mut ptrs = [ptr::null(); 2];
    for (i, (x, side)) in [(k, "k"), (v, "v")].iter().enumerate() {
        if let Some(d) = x {
            let (len, p, t) = d.parts();
            want_len(len, want, &format!("{}: {}", what, side))?;
            if dtype.map_or(false, |t0| t0 != t) {
                return Err(invalid(format!("{}: k and v of different types", what)));
            }
            dtype = Some(t);
            ptrs[i] = p;
        }
    }
    let t = dtype.ok_or_else(|| invalid(format!("{}: neither k nor v given", what)))?;
    Ok((ptrs, t))
}

fn cstr(p: *const c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    // libpkv's strings are static and ASCII
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

/// libpkv's description of a status code.
pub fn strerror(code: i32) -> &'static str {
    cstr(unsafe { ffi::pkv_strerror(code) })
}

/// The version of the libpkv actually linked ("MAJOR.MINOR.PATCH").
pub fn version() -> &'static str {
    cstr(unsafe { ffi::pkv_version() })
}

/// Pool element formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Fp8E4m3,
}

impl Dtype {
    const ALL: [Dtype; 6] = [
        Dtype::F32,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::Q8_0,
        Dtype::Q4_0,
        Dtype::Fp8E4m3,
    ];

    fn raw(self) -> c_int {
        self as c_int
    }

    fn from_raw(v: c_int) -> Dtype {
        Dtype::ALL[v as usize]
    }

    /// libpkv's name: "f32", "f16", "bf16", "q8_0", "q4_0", "fp8_e4m3".
    pub fn name(self) -> &'static str {
        cstr(unsafe { ffi::pkv_dtype_name(self.raw()) })
    }

    /// Parses libpkv's names (and "fp8" for fp8_e4m3).
    pub fn from_name(name: &str) -> Result<Dtype> {
        let c = CString::new(name).map_err(|_| invalid(format!("dtype name {:?}", name)))?;
        let mut v: c_int = 0;
        check(
            unsafe { ffi::pkv_dtype_from_name(c.as_ptr(), &mut v) },
            "pkv_dtype_from_name",
        )?;
        Ok(Dtype::from_raw(v))
    }

    /// Bytes one token row of head_dim elements takes in the pool (0 if it cannot hold one).
    pub fn row_bytes(self, head_dim: u32) -> usize {
        unsafe { ffi::pkv_dtype_row_bytes(self.raw(), head_dim) }
    }
}

/// The cache's configuration (pkv_config without the hooks). `Config::default()` is
/// pkv_config_default(): 1 layer, 8 kv heads, head_dim 128, 16-token blocks, 1024 blocks,
/// f16 K and V, 256 sequences, prefix cache and huge pages on, every CPU, V rows of their own
/// (`v_dim` 0), threads polling 50 us after a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub block_tokens: u32,
    pub n_blocks: u32,
    pub mem_budget_bytes: u64,
    pub k_dtype: Dtype,
    pub v_dtype: Dtype,
    pub max_seqs: u32,
    pub max_blocks_per_seq: u32,
    pub n_threads: u32,
    pub prefix_cache: bool,
    pub huge_pages: bool,
    /// Prefix-index events kept for [`Cache::take_events`], at most 2^24; 0 (the default): none
    /// recorded.
    pub event_capacity: u32,
    /// 0 (the default): V has rows of its own, head_dim values of v_dtype. 1..head_dim: V lives
    /// in K (multi-head latent attention, MLA: DeepSeek-V2 / V3): the pool holds K rows only and
    /// a token's V is the first v_dim values of its K row (pkv.h, "MLA"). v_dtype must then be
    /// k_dtype (q8_0 / q4_0: v_dim a multiple of 32); writes and reads of V are `EINVAL` (pass
    /// K alone), and the attention calls' outputs are `[..][n_q_heads][v_dim]`, their queries
    /// still `[..][n_q_heads][head_dim]`.
    pub v_dim: u32,
    /// How long the cache's attention threads poll for the next call before they sleep, in
    /// microseconds, at most 1,000,000; 50 by default, 0: sleep at once. Raise it past the time
    /// between a model's attention calls where the cores are otherwise idle then: a sleeping
    /// thread's wake-up can take a large part of a call on a VM (pkv.h). A polling thread holds
    /// its core. Unused with an executor.
    pub spin_us: u32,
}

impl Config {
    fn from_raw(c: &ffi::pkv_config) -> Config {
        Config {
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_tokens: c.block_tokens,
            n_blocks: c.n_blocks,
            mem_budget_bytes: c.mem_budget_bytes,
            k_dtype: Dtype::from_raw(c.k_dtype),
            v_dtype: Dtype::from_raw(c.v_dtype),
            max_seqs: c.max_seqs,
            max_blocks_per_seq: c.max_blocks_per_seq,
            n_threads: c.n_threads,
            prefix_cache: c.enable_prefix_cache != 0,
            huge_pages: c.huge_pages != 0,
            event_capacity: c.event_capacity,
            v_dim: c.v_dim,
            spin_us: c.spin_us,
        }
    }

    fn to_raw(&self) -> ffi::pkv_config {
        let mut c = unsafe { ffi::pkv_config_default() };
        c.n_layers = self.n_layers;
        c.n_kv_heads = self.n_kv_heads;
        c.head_dim = self.head_dim;
        c.block_tokens = self.block_tokens;
        c.n_blocks = self.n_blocks;
        c.mem_budget_bytes = self.mem_budget_bytes;
        c.k_dtype = self.k_dtype.raw();
        c.v_dtype = self.v_dtype.raw();
        c.max_seqs = self.max_seqs;
        c.max_blocks_per_seq = self.max_blocks_per_seq;
        c.n_threads = self.n_threads;
        c.enable_prefix_cache = self.prefix_cache as c_int;
        c.huge_pages = self.huge_pages as c_int;
        c.event_capacity = self.event_capacity;
        c.v_dim = self.v_dim;
        c.spin_us = self.spin_us;
        c
    }
}

impl Default for Config {
    fn default() -> Config {
        Config::from_raw(&unsafe { ffi::pkv_config_default() })
    }
}

/// A sequence (or pin) handle: libpkv's generation-counted id. A released one is stale forever
/// (ENOENT). A handle is not tied to its [`Cache`] by type, but each cache numbers its handles
/// far from the others', so one passed to the wrong cache fails with ENOENT (a check that
/// catches the mistake, not a guarantee: see `pkv_seq` in pkv.h).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Seq(pub u64);

/// How RoPE pairs a K row's values ([`Rope`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Values dim0 + i and dim0 + i + n_rot / 2 (rotate_half: Llama and Qwen in Hugging Face's
    /// layout, GPT-NeoX, llama.cpp's NEOX mode).
    Neox,
    /// Values dim0 + 2i and dim0 + 2i + 1 (interleaved: GPT-J, llama.cpp's default mode, llama2.c).
    Gptj,
}

/// RoPE as the engine applied it to the K rows it wrote, for [`Cache::shift`] (pkv_rope): pair
/// i turned by position x theta^(-2i / n_rot) radians, or `inv_freq[i]` where given (n_rot / 2
/// values: Llama 3's or YaRN's scaled frequencies).
#[derive(Clone, Copy, Debug)]
pub struct Rope<'a> {
    pub dim0: u32,
    pub n_rot: u32,
    pub style: RopeStyle,
    pub theta: f32,
    pub inv_freq: Option<&'a [f32]>,
}

impl Rope<'_> {
    /// n_rot values from 0 turned, base theta, the given style.
    pub fn new(n_rot: u32, theta: f32, style: RopeStyle) -> Rope<'static> {
        Rope {
            dim0: 0,
            n_rot,
            style,
            theta,
            inv_freq: None,
        }
    }
}

/// One prefill / extend request: queries for positions [q_start, q_start + n_q) of seq.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnReq {
    pub seq: Seq,
    pub q_start: u32,
    pub n_q: u32,
}

/// Packs a row-major `[n_q][kv_len]` mask of bools as [`Cache::prefill_masked`] reads it: bit i
/// (the bool at i) is bit `i % 8` of byte `i / 8` (numpy's `packbits(bitorder="little")`).
pub fn pack_mask(bits: &[bool]) -> Vec<u8> {
    let mut out = vec![0u8; bits.len().div_ceil(8)];
    for (i, &b) in bits.iter().enumerate() {
        out[i / 8] |= (b as u8) << (i % 8);
    }
    out
}

/// `PKV_TREE_MAX_NODES` (pkv.h): the most nodes a [`TreeReq`] may have; past it, `EINVAL`.
pub const TREE_MAX_NODES: u32 = ffi::PKV_TREE_MAX_NODES;

/// One request of [`Cache::tree`]: a tree of draft tokens (speculative decoding) whose K/V `seq`
/// holds at positions [q_start, q_start + parent.len()), node i at q_start + i (pkv_attn_tree_req;
/// its n_nodes is `parent.len()`, at most [`TREE_MAX_NODES`]). `parent[i]` is node i's parent, in
/// [-1, i) (-1 for a root; several roots allowed): each node comes after its parent. Node i's
/// position in the text is q_start + depth(i) (a root has depth 0): the position its K was rotated
/// for, and the one a window counts from. An empty `parent` is an empty request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeReq<'a> {
    pub seq: Seq,
    pub q_start: u32,
    pub parent: &'a [i32],
}

/// One request of [`Cache::batch_append`]: `tokens` appended to `seq`, their slots written to
/// `slots` where given (`slots.len() == tokens.len()`).
#[derive(Debug)]
pub struct AppendReq<'a> {
    pub seq: Seq,
    pub tokens: &'a [i32],
    pub slots: Option<&'a mut [i32]>,
}

/// Attention parameters (pkv_attn_params without the lse pointer, which the calls take). The
/// lifetime is the borrow of [`AttnParams::sinks`] and [`AttnParams::alibi_slopes`]; without
/// them it is any.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams<'a> {
    /// Query heads, a multiple of n_kv_heads; 0 = n_kv_heads.
    pub n_q_heads: u32,
    /// 0 = 1/sqrt(head_dim).
    pub scale: f32,
    /// Logit soft-cap; 0 = off.
    pub softcap: f32,
    /// Sliding window; 0 = off.
    pub window: u32,
    /// PKV_ATTN_BF16_DOT: with bf16 K/V, queries and softmax weights rounded to bf16 and
    /// multiplied by bf16 dot products where the CPU has them; with fp8 e4m3, q8_0 and q4_0 K/V the
    /// same on avx512-amx's tiles, in units of 16 query rows a kv head and more (`Cache::bf16_dot_used`).
    pub bf16_dot: bool,
    /// Attention-sink logits (gpt-oss; pkv_attn_params.sinks), one per query head: exactly
    /// n_q_heads of them (n_kv_heads where `n_q_heads` is 0), else `EINVAL` before libpkv is
    /// called; each finite, else `EINVAL` from libpkv. Head h's softmax counts one more key, of
    /// logit `sinks[h]` (neither scaled nor capped) and value 0: out is
    /// `sum_t e^(s_t) v_t / (e^(sinks[h]) + sum_t e^(s_t))` over the scaled (capped) logits
    /// `s_t`, and lse includes the sink's term, so to [`merge`] partial results pass sinks to
    /// one part only. None = no sinks.
    pub sinks: Option<&'a [f32]>,
    /// ALiBi slopes (BLOOM, MPT; pkv_attn_params.alibi_slopes), one per query head: exactly
    /// n_q_heads of them, else `EINVAL` before libpkv is called; each finite with magnitude at
    /// most 65536, else `EINVAL` from libpkv. Head h's logit of the key at position k for the
    /// query at position p gains `alibi_slopes[h] * (k - p)` after the scale and the soft-cap
    /// (in [`Cache::tree`] a node's position is `q_start` + its depth). None = no ALiBi.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Chunked local attention (Llama 4's attention_chunk_size; pkv_attn_params.attn_chunk):
    /// the query at position p sees only the keys of its chunk, `[p - p % attn_chunk, p]` (with
    /// a window too, a key must pass both; in [`Cache::tree`] a node's position is `q_start` +
    /// its depth). 0 = off.
    pub attn_chunk: u32,
    /// PKV_ATTN_NONCAUSAL: each query of a [`Cache::prefill`] request sees its whole sequence,
    /// `[0, length)` (an encoder's self-attention; cross-attention over a sequence holding an
    /// encoder's K/V): `q_start` must be 0 and `n_q` may be any count up to what a sequence may
    /// hold; a window, `attn_chunk`
    /// or `alibi_slopes` with it (in any call), or a tree, is `EINVAL`; decode otherwise computes
    /// the same either way.
    pub noncausal: bool,
    /// PKV_ATTN_F16_AS_BF16: f16 K and the queries, f16 V and the softmax weights, rounded to
    /// bf16 in units of 16 query rows a kv head and more where the backend has bf16 tiles
    /// ("avx512-amx"; `Cache::f16_as_bf16_used`); elsewhere the same bits as without it.
    pub f16_as_bf16: bool,
}

impl Default for AttnParams<'_> {
    fn default() -> Self {
        AttnParams {
            n_q_heads: 0,
            scale: 0.0,
            softcap: 0.0,
            window: 0,
            bf16_dot: false,
            sinks: None,
            alibi_slopes: None,
            attn_chunk: 0,
            noncausal: false,
            f16_as_bf16: false,
        }
    }
}

/// K or V rows to write: `[n][n_kv_heads][head_dim]` elements.
#[derive(Clone, Copy, Debug)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    /// IEEE binary16 bit patterns.
    F16(&'a [u16]),
    /// bfloat16 bit patterns.
    Bf16(&'a [u16]),
}

impl KvData<'_> {
    fn parts(&self) -> (usize, *const c_void, Dtype) {
        match *self {
            KvData::F32(x) => (x.len(), x.as_ptr() as *const c_void, Dtype::F32),
            KvData::F16(x) => (x.len(), x.as_ptr() as *const c_void, Dtype::F16),
            KvData::Bf16(x) => (x.len(), x.as_ptr() as *const c_void, Dtype::Bf16),
        }
    }
}

pub type SeqInfo = ffi::pkv_seq_info;
pub type Stats = ffi::pkv_stats;

/// Merges two partial attention results of the same rows over disjoint key sets by their
/// log-sum-exps (pkv_attn_merge): out_a, out_b, out `[n_rows][head_dim]`; lse_a, lse_b, lse
/// `[n_rows]`. For outputs of a cache whose V lives in K (MLA), `head_dim` is its v_dim.
pub fn merge(
    head_dim: u32,
    out_a: &[f32],
    lse_a: &[f32],
    out_b: &[f32],
    lse_b: &[f32],
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    if head_dim == 0 {
        return Err(invalid("merge: head_dim 0".into()));
    }
    let rows = lse_a.len();
    let n = mul_len(rows, head_dim as usize, "merge")?;
    want_len(out_a.len(), n, "merge: out_a")?;
    want_len(out_b.len(), n, "merge: out_b")?;
    want_len(lse_b.len(), rows, "merge: lse_b")?;
    want_len(out.len(), n, "merge: out")?;
    let lp = match lse {
        Some(l) => {
            want_len(l.len(), rows, "merge: lse")?;
            l.as_mut_ptr()
        }
        None => ptr::null_mut(),
    };
    let r = unsafe {
        ffi::pkv_attn_merge(
            len_u32(rows, "merge: rows")?,
            head_dim,
            out_a.as_ptr(),
            lse_a.as_ptr(),
            out_b.as_ptr(),
            lse_b.as_ptr(),
            out.as_mut_ptr(),
            lp,
        )
    };
    check(r, "pkv_attn_merge")
}

/// What a prefix-index event says (pkv_event_kind; "prefix-index events" in pkv.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// A full committed block was indexed (a commit, a tier load, ...); a parent's comes before
    /// its children's.
    Stored,
    /// An indexed block was evicted to make room; children go before parents.
    Removed,
    /// [`Cache::reset`] emptied the index (no `Removed` for its blocks).
    Cleared,
    /// The ring was full: [`Event::lost`] events were dropped, and what the consumer knows of
    /// the index is stale: rebuild it from [`Cache::prefix_snapshot`].
    Overflow,
    /// A kind this version of the binding does not know (its pkv_event_kind value).
    Unknown(u32),
}

impl EventKind {
    fn from_raw(v: u32) -> EventKind {
        match v {
            ffi::PKV_EVENT_STORED => EventKind::Stored,
            ffi::PKV_EVENT_REMOVED => EventKind::Removed,
            ffi::PKV_EVENT_CLEARED => EventKind::Cleared,
            ffi::PKV_EVENT_OVERFLOW => EventKind::Overflow,
            v => EventKind::Unknown(v),
        }
    }
}

/// A prefix-index event (pkv_event), from [`Cache::take_events`] or [`Cache::prefix_snapshot`].
/// A block is named by its identity hash: what [`prefix_hashes`] computes from a prompt, with no
/// cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// 1, 2, 3, ... over the cache's life (lost events included); 0 in a snapshot.
    pub seqno: u64,
    pub kind: EventKind,
    /// `Stored` / `Removed`: the block's identity hash; else 0.
    pub hash: u64,
    /// `Stored` / `Removed`: its parent's, 0 for a first block.
    pub parent_hash: u64,
    /// `Stored` / `Removed`: the block's index in its chain (positions depth x B .. depth x B +
    /// B - 1).
    pub depth: u32,
    /// `Stored` / `Removed`: the pool block at the time (compaction may move it).
    pub block: u32,
    /// `Overflow`: the events dropped; else 0.
    pub lost: u64,
    /// `Stored` / `Removed`, when asked for: the block's block_tokens token ids; else None.
    pub tokens: Option<Vec<i32>>,
}

/// Room for `cap` events and, with tokens, their blocks' token ids (`b` an event).
struct EventBuf {
    raw: Vec<ffi::pkv_event>,
    toks: Option<Vec<i32>>,
    b: usize,
}

impl EventBuf {
    fn new(cap: usize, b: usize, with_tokens: bool, what: &str) -> Result<EventBuf> {
        let toks = if with_tokens {
            Some(vec![0i32; mul_len(cap, b, &format!("{}: tokens", what))?])
        } else {
            None
        };
        Ok(EventBuf {
            raw: vec![ffi::pkv_event::default(); cap],
            toks,
            b,
        })
    }

    /// The events' and the token ids' buffers for C (null: no token ids).
    fn ptrs(&mut self) -> (*mut ffi::pkv_event, *mut i32) {
        let tp = self.toks.as_mut().map_or(ptr::null_mut(), |t| t.as_mut_ptr());
        (self.raw.as_mut_ptr(), tp)
    }

    /// The first `n` as [`Event`]s.
    fn events(&self, n: usize) -> Vec<Event> {
        events(&self.raw, n, self.toks.as_deref(), self.b)
    }
}

/// The first `n` of `raw` as [`Event`]s; `toks`: their blocks' token ids, `b` an event, if taken.
fn events(raw: &[ffi::pkv_event], n: usize, toks: Option<&[i32]>, b: usize) -> Vec<Event> {
    raw[..n]
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let kind = EventKind::from_raw(e.kind);
            let tokens = match (toks, kind) {
                (Some(t), EventKind::Stored | EventKind::Removed) => Some(t[i * b..(i + 1) * b].to_vec()),
                _ => None,
            };
            Event {
                seqno: e.seqno,
                kind,
                hash: e.hash,
                parent_hash: e.parent_hash,
                depth: e.depth,
                block: e.block,
                lost: e.lost,
                tokens,
            }
        })
        .collect()
}

/// The identity hashes a cache with this `block_tokens` gives the full blocks of `tokens` under
/// the namespace `salt` (as [`Cache::seq_create`]'s), one a full block (pkv_prefix_hashes):
/// what the events of [`Cache::take_events`] name. Needs no cache: a router computes a prompt's
/// hashes and counts how many leading ones each engine's events say it holds. EINVAL for
/// block_tokens outside 1..1024 or a salt over 256 bytes.
pub fn prefix_hashes(salt: &[u8], block_tokens: u32, tokens: &[i32]) -> Result<Vec<u64>> {
    if block_tokens == 0 {
        return Err(invalid("prefix_hashes: block_tokens 0 not in 1..1024".into()));
    }
    let mut out = vec![0u64; tokens.len() / block_tokens as usize];
    let sp = if salt.is_empty() {
        ptr::null()
    } else {
        salt.as_ptr() as *const c_void
    };
    let mut n = 0usize;
    let rc = unsafe {
        ffi::pkv_prefix_hashes(
            sp,
            salt.len(),
            block_tokens,
            tokens.as_ptr(),
            tokens.len(),
            out.as_mut_ptr(),
            out.len(),
            &mut n,
        )
    };
    check(
        rc,
        "pkv_prefix_hashes: block_tokens not in 1..1024 or a salt over 256 bytes",
    )?;
    out.truncate(n);
    Ok(out)
}

/// Token ids (all negative) for `n` positions of an image, audio clip or other media in a
/// prompt, its positions `offset .. offset + n`, from `content_id`: a digest of the content and
/// of how it was preprocessed (SHA-256 of both) or the bytes themselves (pkv_media_tokens). The
/// prefix index compares token ids only, so a model's placeholder ids would let a prompt with
/// another image match this one: append these in their place (the model still embeds its own)
/// and pass them to [`Cache::match_prefix`] and [`prefix_hashes`]. EINVAL for an empty
/// `content_id`, `offset + n` over 2^32, or more ids than memory can hold here.
pub fn media_tokens(content_id: &[u8], offset: u32, n: u32) -> Result<Vec<i32>> {
    if content_id.is_empty() {
        return Err(invalid(
            "media_tokens: content_id is empty (content with no identity)".into(),
        ));
    }
    if u64::from(offset) + u64::from(n) > 1u64 << 32 {
        return Err(invalid("media_tokens: offset + n is over 2^32".into()));
    }
    // on a 32-bit target 4n bytes may be more than an allocation can be: refused, not a panic
    if u64::from(n) * 4 > isize::MAX as u64 {
        return Err(invalid(format!("media_tokens: {} ids do not fit in memory here", n)));
    }
    let mut out = vec![0i32; n as usize];
    let rc = unsafe {
        ffi::pkv_media_tokens(
            content_id.as_ptr() as *const c_void,
            content_id.len(),
            offset,
            n,
            out.as_mut_ptr(),
        )
    };
    check(rc, "pkv_media_tokens")?;
    Ok(out)
}

/// A storage tier (pkv_tier): whole prefix blocks kept out of the pool, in host memory, files or
/// Redis, for [`Cache::tier_load`] to copy back instead of recomputing them ("storage tiers" in
/// pkv.h). Thread-safe: one tier may serve several caches and threads. Freed on drop (a file
/// tier's files stay).
pub struct Tier {
    raw: NonNull<ffi::pkv_tier>,
}

/// A tier's counters ([`Tier::stats`]): the store's own (entries, bytes, capacity, evictions;
/// 0 for Redis), what saves and loads did, and the prefetch's ([`Tier::prefetch_start`]):
/// entries fetched into staging (prefetched), blocks loads took from it (prefetch_hits), staged
/// entries dropped unused for room (prefetch_dropped), and what staging holds now
/// (staged_entries, staged_bytes).
pub type TierStats = ffi::pkv_tier_stats;

unsafe impl Send for Tier {}
unsafe impl Sync for Tier {}

impl Drop for Tier {
    fn drop(&mut self) {
        unsafe { ffi::pkv_tier_destroy(self.raw.as_ptr()) }
    }
}

fn c_string(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| invalid(format!("{}: contains a NUL byte", what)))
}

impl Tier {
    fn made(rc: c_int, p: *mut ffi::pkv_tier, what: &str) -> Result<Tier> {
        check(rc, what)?;
        let raw = NonNull::new(p).ok_or_else(|| Error::new(ENOMEM, what))?;
        Ok(Tier { raw })
    }

    /// Host memory: at most `capacity_bytes` (> 0) of entries, the least recently used dropped.
    pub fn host(capacity_bytes: u64) -> Result<Tier> {
        let mut p = ptr::null_mut();
        let rc = unsafe { ffi::pkv_tier_host_create(capacity_bytes, ptr::null(), &mut p) };
        Tier::made(rc, p, "pkv_tier_host_create")
    }

    /// Files in `dir` (made if missing; entries already there are taken over), at most
    /// `capacity_bytes` of them, the least recently used dropped. `Io` where dir cannot be used.
    pub fn file(dir: &std::path::Path, capacity_bytes: u64) -> Result<Tier> {
        use std::os::unix::ffi::OsStrExt;
        let d = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| invalid("Tier::file: dir contains a NUL byte".into()))?;
        let mut p = ptr::null_mut();
        let rc = unsafe { ffi::pkv_tier_file_create(d.as_ptr(), capacity_bytes, ptr::null(), &mut p) };
        Tier::made(rc, p, "pkv_tier_file_create")
    }

    /// Redis at host:port, keys under `key_prefix` (None: "pkv:"); the server's maxmemory and
    /// maxmemory-policy decide what stays. `NotSupported` where libpkv was built without
    /// hiredis, `Io` where the server does not answer. timeout_ms 0: 1000.
    pub fn redis(host: &str, port: u16, key_prefix: Option<&str>, timeout_ms: u32) -> Result<Tier> {
        let h = c_string(host, "Tier::redis: host")?;
        let kp = key_prefix.map(|k| c_string(k, "Tier::redis: key_prefix")).transpose()?;
        let mut p = ptr::null_mut();
        let rc = unsafe {
            ffi::pkv_tier_redis_create(
                h.as_ptr(),
                port as c_int,
                kp.as_ref().map_or(ptr::null(), |k| k.as_ptr()),
                timeout_ms,
                ptr::null(),
                &mut p,
            )
        };
        Tier::made(rc, p, "pkv_tier_redis_create")
    }

    /// Its counters (pkv_tier_get_stats).
    pub fn stats(&self) -> Result<TierStats> {
        let mut st = TierStats::default();
        check(
            unsafe { ffi::pkv_tier_get_stats(self.raw.as_ptr(), &mut st) },
            "pkv_tier_get_stats",
        )?;
        Ok(st)
    }

    /// Starts the tier's prefetch thread (pkv_tier_prefetch_start), with `staging_bytes` (> 0)
    /// of host memory to stage entries in, the oldest dropped past it: [`Tier::prefetch`] then
    /// fetches a prompt's entries from the store ahead of the [`Cache::tier_load`] that copies
    /// them. Once a tier: `InvalidArgument` after that (and for staging_bytes 0); `OutOfMemory`
    /// where no thread can be started. Dropping the tier stops the thread.
    pub fn prefetch_start(&self, staging_bytes: u64) -> Result<()> {
        check(
            unsafe { ffi::pkv_tier_prefetch_start(self.raw.as_ptr(), staging_bytes) },
            "pkv_tier_prefetch_start: staging_bytes 0, or started already",
        )
    }

    /// Queues the entries of the full blocks of `tokens` (those a later [`Cache::tier_load`] of
    /// this prompt asks for) under the namespace `salt` (at most 256 bytes, as
    /// [`Cache::seq_create`]'s) for caches of `cache`'s shape, and returns
    /// (pkv_tier_prefetch): the prefetch thread fetches them in order into staging, up to the
    /// first the store lacks. Reads only the cache's shape; `cache` may be dropped before the
    /// fetch is done. `InvalidArgument` before [`Tier::prefetch_start`]; `Busy` while 64
    /// prefetches are queued.
    pub fn prefetch(&self, cache: &Cache, salt: &[u8], tokens: &[i32]) -> Result<()> {
        self.prefetch_in(cache, salt, tokens, 0)
    }

    /// [`Tier::prefetch`] for a [`Cache::tier_load_window`] of the prompt into an empty sequence
    /// (pkv_tier_prefetch_window): the thread fetches the blocks the window of the whole prompt
    /// reads, in order, up to the first the store lacks. `InvalidArgument` for window 0 too.
    pub fn prefetch_window(&self, cache: &Cache, salt: &[u8], tokens: &[i32], window: u32) -> Result<()> {
        if window == 0 {
            return Err(invalid("Tier::prefetch_window: window 0".to_string()));
        }
        self.prefetch_in(cache, salt, tokens, window)
    }

    fn prefetch_in(&self, cache: &Cache, salt: &[u8], tokens: &[i32], window: u32) -> Result<()> {
        let what = if window == 0 {
            "Tier::prefetch"
        } else {
            "Tier::prefetch_window"
        };
        if salt.len() > 256 {
            return Err(invalid(format!("{}: salt of {} bytes, at most 256", what, salt.len())));
        }
        let n = len_u32(tokens.len(), &format!("{}: tokens", what))?;
        let sp = if salt.is_empty() {
            ptr::null()
        } else {
            salt.as_ptr() as *const c_void
        };
        let (t, c, tp) = (self.raw.as_ptr(), cache.p(), tokens.as_ptr());
        let rc = unsafe {
            if window == 0 {
                ffi::pkv_tier_prefetch(t, c, sp, salt.len(), tp, n)
            } else {
                ffi::pkv_tier_prefetch_window(t, c, sp, salt.len(), tp, n, window)
            }
        };
        let op = if window == 0 {
            "pkv_tier_prefetch"
        } else {
            "pkv_tier_prefetch_window"
        };
        check(
            rc,
            &match rc {
                EINVAL => format!("{}: prefetch_start not called", op),
                EBUSY => format!("{}: 64 prefetches queued", op),
                _ => op.to_string(),
            },
        )
    }

    /// Waits until every queued prefetch is done: staged, or stopped at an entry the store
    /// lacks (pkv_tier_prefetch_wait). `InvalidArgument` before [`Tier::prefetch_start`].
    pub fn prefetch_wait(&self) -> Result<()> {
        check(
            unsafe { ffi::pkv_tier_prefetch_wait(self.raw.as_ptr()) },
            "pkv_tier_prefetch_wait: prefetch_start not called",
        )
    }

    /// Waits until the writes queued by [`Cache::tier_save_async`] before the call are in the
    /// store, not those other threads queue after it (pkv_tier_flush). `Io` when a put failed since the last flush (counted in the stats'
    /// errors; that block is not stored); `InvalidArgument` before [`Tier::prefetch_start`].
    pub fn flush(&self) -> Result<()> {
        let rc = unsafe { ffi::pkv_tier_flush(self.raw.as_ptr()) };
        check(
            rc,
            match rc {
                EINVAL => "pkv_tier_flush: prefetch_start not called",
                EIO => "pkv_tier_flush: a queued put failed",
                _ => "pkv_tier_flush",
            },
        )
    }
}

/// A paged KV cache (pkv_cache): the pool, sequences, prefix index and attention. Freed on drop.
pub struct Cache {
    raw: NonNull<ffi::pkv_cache>,
    cfg: Config,
}

/// The log hook: keeps what libpkv says at PKV_LOG_ERROR (why a call refuses) for that call's
/// [`Error`] (`SAID`, this thread's).
unsafe extern "C" fn log_sink(_ctx: *mut c_void, level: c_int, msg: *const c_char) {
    if level != 0 || msg.is_null() {
        return; // PKV_LOG_ERROR only
    }
    let text = CStr::from_ptr(msg).to_string_lossy().into_owned();
    // (never unwinds into C: a thread being torn down has no SAID left to write)
    let _ = SAID.try_with(|s| s.try_borrow_mut().map(|mut s| *s = Some(text)));
}

// libpkv serializes metadata calls and attention calls inside; the &self / &mut self split
// (above) keeps K/V writes and sequence changes away from running reads.
unsafe impl Send for Cache {}
unsafe impl Sync for Cache {}

impl Drop for Cache {
    fn drop(&mut self) {
        unsafe { ffi::pkv_cache_destroy(self.raw.as_ptr()) }
    }
}

impl Cache {
    /// Creates a cache: the whole pool and every buffer attention needs are allocated here.
    pub fn new(cfg: &Config) -> Result<Cache> {
        let mut raw_cfg = cfg.to_raw();
        raw_cfg.log = Some(log_sink);
        raw_cfg.log_ctx = ptr::null_mut();
        let mut p: *mut ffi::pkv_cache = ptr::null_mut();
        // the Error's context is what libpkv said, e.g. "pkv_cache_create: head_dim 0 not in 1..1024"
        check(unsafe { ffi::pkv_cache_create(&raw_cfg, &mut p) }, "pkv_cache_create")?;
        let raw = NonNull::new(p).ok_or_else(|| Error::new(ENOMEM, "pkv_cache_create"))?;
        let mut eff = raw_cfg;
        let rc = unsafe { ffi::pkv_cache_config(raw.as_ptr(), &mut eff) };
        let c = Cache {
            raw,
            cfg: Config::from_raw(&eff),
        };
        check(rc, "pkv_cache_config")?;
        Ok(c)
    }

    fn p(&self) -> *mut ffi::pkv_cache {
        self.raw.as_ptr()
    }

    /// The effective configuration (n_blocks, max_blocks_per_seq, n_threads resolved).
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The attention kernel family in use ("ref", "avx2", "avx2-vnni", "avx512", "avx512-vnni", "neon", ...).
    pub fn backend(&self) -> &'static str {
        cstr(unsafe { ffi::pkv_attn_backend(self.p()) })
    }

    /// Whether `AttnParams::bf16_dot` changes this cache's attention (pkv_attn_flags_used): bf16
    /// K or V and a backend with bf16 dot products, or fp8 e4m3, q8_0 or q4_0 K or V and one with bf16
    /// tiles
    /// ("avx512-amx").
    pub fn bf16_dot_used(&self) -> bool {
        let used = unsafe { ffi::pkv_attn_flags_used(self.p()) };
        used & ffi::PKV_ATTN_BF16_DOT != 0
    }

    /// Whether `AttnParams::f16_as_bf16` changes this cache's attention (pkv_attn_flags_used):
    /// f16 K or V with head_dim (or v_dim) a multiple of 32, the other q8_0 or q4_0 only where
    /// `bf16_dot` is set too, and a backend with bf16 tiles.
    pub fn f16_as_bf16_used(&self) -> bool {
        let used = unsafe { ffi::pkv_attn_flags_used(self.p()) };
        used & ffi::PKV_ATTN_F16_AS_BF16 != 0
    }

    /// Where the pool lives (pkv_cache_layout), for kernels of the caller's own. Where V lives
    /// in K (MLA, [`Config::v_dim`]) its V fields are K's and its v_dim the config's.
    pub fn layout(&self) -> Result<ffi::pkv_layout> {
        let mut lo = std::mem::MaybeUninit::<ffi::pkv_layout>::zeroed();
        check(
            unsafe { ffi::pkv_cache_layout(self.p(), lo.as_mut_ptr()) },
            "pkv_cache_layout",
        )?;
        Ok(unsafe { lo.assume_init() })
    }

    /// Releases every sequence and pin and empties the prefix index.
    pub fn reset(&mut self) -> Result<()> {
        check(unsafe { ffi::pkv_cache_reset(self.p()) }, "pkv_cache_reset")
    }

    fn kv_elems(&self, n: usize) -> usize {
        n * self.cfg.n_kv_heads as usize * self.cfg.head_dim as usize
    }

    /// The values of an attention output row (a query head's): v_dim where V lives in K (MLA,
    /// [`Config::v_dim`]), else head_dim.
    fn out_dim(&self) -> u32 {
        if self.cfg.v_dim != 0 {
            self.cfg.v_dim
        } else {
            self.cfg.head_dim
        }
    }

    /// `EINVAL`, before libpkv sees it, where V is given to a cache whose V lives in K (MLA,
    /// [`Config::v_dim`]): its V is K's rows, written and read as K.
    fn no_v_in_k(&self, v_given: bool, what: &str) -> Result<()> {
        if v_given && self.cfg.v_dim != 0 {
            return Err(invalid(format!(
                "{}: v given, but V lives in K here (v_dim {}): pass k alone",
                what, self.cfg.v_dim
            )));
        }
        Ok(())
    }

    // ---- sequences ----

    /// A new empty sequence; salt (at most 256 bytes) names its prefix-index namespace.
    pub fn seq_create(&mut self, salt: &[u8]) -> Result<Seq> {
        let mut s = 0u64;
        let sp = if salt.is_empty() {
            ptr::null()
        } else {
            salt.as_ptr() as *const c_void
        };
        check(
            unsafe { ffi::pkv_seq_create(self.p(), sp, salt.len(), &mut s) },
            "pkv_seq_create",
        )?;
        Ok(Seq(s))
    }

    /// Appends positions with these token ids; returns their slots.
    pub fn append(&mut self, s: Seq, tokens: &[i32]) -> Result<Vec<i32>> {
        let mut slots = vec![0i32; tokens.len()];
        self.append_into(s, tokens, &mut slots)?;
        Ok(slots)
    }

    /// [`Cache::append`] into the caller's buffer (one slot a token, `slots.len() ==
    /// tokens.len()`), for a decode loop that allocates nothing a step.
    pub fn append_into(&mut self, s: Seq, tokens: &[i32], slots: &mut [i32]) -> Result<()> {
        want_len(slots.len(), tokens.len(), "append: slots")?;
        let n = len_u32(tokens.len(), "append: tokens")?;
        check(
            unsafe { ffi::pkv_seq_append(self.p(), s.0, tokens.as_ptr(), n, slots.as_mut_ptr()) },
            "pkv_seq_append",
        )
    }

    /// A scheduler step's appends in one call (pkv_batch_append): the requests name distinct
    /// sequences; the budget check and the appends happen under one hold of the cache's lock,
    /// so no other thread's append takes the blocks between them. Without `fit`, every request
    /// is appended, in order, or none ([`ErrorKind::NoSpace`]); with `fit`, the leading run of
    /// them that fits (first come, first served), the others left as they were. Returns how many
    /// were appended.
    pub fn batch_append(&mut self, reqs: &mut [AppendReq<'_>], fit: bool) -> Result<usize> {
        let n = len_u32(reqs.len(), "batch_append: requests")?;
        let mut raw = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter_mut().enumerate() {
            let len = len_u32(r.tokens.len(), "batch_append: tokens")?;
            let slots_out = match r.slots.as_deref_mut() {
                Some(s) => {
                    want_len(s.len(), r.tokens.len(), &format!("batch_append: reqs[{}].slots", i))?;
                    s.as_mut_ptr()
                }
                None => std::ptr::null_mut(),
            };
            raw.push(ffi::pkv_append_req {
                seq: r.seq.0,
                tokens: r.tokens.as_ptr(),
                n: len,
                slots_out,
            });
        }
        let flags = if fit { ffi::PKV_APPEND_FIT } else { 0 };
        let mut done = 0u32;
        check(
            unsafe { ffi::pkv_batch_append(self.p(), raw.as_ptr(), n, flags, &mut done) },
            "pkv_batch_append",
        )?;
        Ok(done as usize)
    }

    /// How many FREE or CACHED blocks appending `n` positions to `s` would take: the append
    /// succeeds iff that is at most `n_free + n_cached` (pkv_seq_append_blocks; ELIMIT past
    /// max_blocks_per_seq). Changes nothing: for budgeting a step before appending.
    pub fn append_blocks(&self, s: Seq, n: u32) -> Result<u32> {
        let mut need = 0u32;
        check(
            unsafe { ffi::pkv_seq_append_blocks(self.p(), s.0, n, &mut need) },
            "pkv_seq_append_blocks",
        )?;
        Ok(need)
    }

    /// Writes K and/or V of one layer at these slots (slot -1 skips a row): each
    /// `[slots.len()][n_kv_heads][head_dim]`; both of one type (K alone where V lives in K, MLA:
    /// a V is `EINVAL`). All-or-nothing. Slots name
    /// places in the pool, not a sequence: after a truncate, keep, release or compaction of
    /// their sequence they may lie in another sequence's blocks, and a write through them
    /// changes that one. Take them again ([`Cache::slots`]) after those calls.
    pub fn write_kv(&mut self, layer: u32, slots: &[i32], k: Option<KvData<'_>>, v: Option<KvData<'_>>) -> Result<()> {
        // SAFETY: `&mut self` excludes every other call on this cache
        unsafe { self.write_kv_shared(layer, slots, k, v) }
    }

    /// [`Cache::write_kv`] through `&self`, so that layer l + 1 of a new token can be written
    /// while attention reads layer l from another thread, as libpkv allows (pkv.h: "Threads").
    ///
    /// # Safety
    /// No other call may read or write the rows written (these slots' positions of this layer)
    /// while this one runs: not an attention call over a sequence holding them, a gather of
    /// them, a write to the same slots, nor a call that changes a sequence holding them (which
    /// takes `&mut self`, so it cannot overlap). The binding cannot check it: a write racing a
    /// read of the same rows is a data race in the library's memory. The slots must be current
    /// (see [`Cache::write_kv`]); argument errors are still returned, not undefined.
    pub unsafe fn write_kv_shared(
        &self,
        layer: u32,
        slots: &[i32],
        k: Option<KvData<'_>>,
        v: Option<KvData<'_>>,
    ) -> Result<()> {
        self.no_v_in_k(v.is_some(), "write_kv")?;
        let (ptrs, t) = kv_args(&k, &v, self.kv_elems(slots.len()), "write_kv")?;
        let n = len_u32(slots.len(), "write_kv: slots")?;
        let rc = unsafe { ffi::pkv_write_kv(self.p(), layer, slots.as_ptr(), n, ptrs[0], ptrs[1], t.raw()) };
        check(rc, "pkv_write_kv")
    }

    /// Writes K and/or V of one layer for positions `[start, start + n)` of `s`
    /// (pkv_seq_write_kv), n the rows of `k` or `v` (`[n][n_kv_heads][head_dim]` each, both of
    /// one type and length; `k` alone where V lives in K). All-or-nothing, with
    /// [`Cache::write_kv`]'s checks. By position, so no slots are needed and none can be stale:
    /// the rows written are `s`'s own.
    pub fn write_kv_seq(
        &mut self,
        s: Seq,
        layer: u32,
        start: u32,
        k: Option<KvData<'_>>,
        v: Option<KvData<'_>>,
    ) -> Result<()> {
        // SAFETY: `&mut self` excludes every other call on this cache
        unsafe { self.write_kv_seq_shared(s, layer, start, k, v) }
    }

    /// [`Cache::write_kv_seq`] through `&self`: layer l + 1 of a new token written while
    /// attention reads layer l from another thread (pkv.h: "Threads").
    ///
    /// # Safety
    /// No other call may read or write these positions of this layer of `s` while this one
    /// runs (an attention call over `s` at this layer, a gather of them, another write of them),
    /// and no call that changes `s` may overlap it (those take `&mut self`). The binding cannot
    /// check it: a write racing a read of the same rows is a data race in the library's memory.
    pub unsafe fn write_kv_seq_shared(
        &self,
        s: Seq,
        layer: u32,
        start: u32,
        k: Option<KvData<'_>>,
        v: Option<KvData<'_>>,
    ) -> Result<()> {
        self.no_v_in_k(v.is_some(), "write_kv_seq")?;
        let row = self.kv_elems(1);
        let have = k.as_ref().or(v.as_ref()).map_or(0, |d| d.parts().0);
        if have % row != 0 {
            return Err(invalid(format!(
                "write_kv_seq: {} elements, not whole rows of {} x {}",
                have, self.cfg.n_kv_heads, self.cfg.head_dim
            )));
        }
        let (ptrs, t) = kv_args(&k, &v, have, "write_kv_seq")?;
        let n = len_u32(have / row, "write_kv_seq: rows")?;
        let rc = unsafe { ffi::pkv_seq_write_kv(self.p(), s.0, layer, start, n, ptrs[0], ptrs[1], t.raw()) };
        check(rc, "pkv_seq_write_kv")
    }

    /// Positions [0, n_pos) now hold K/V for every layer.
    pub fn commit(&mut self, s: Seq, n_pos: u32) -> Result<()> {
        check(unsafe { ffi::pkv_seq_commit(self.p(), s.0, n_pos) }, "pkv_seq_commit")
    }

    /// A new sequence sharing every block of s (no data copied).
    pub fn fork(&mut self, s: Seq) -> Result<Seq> {
        let mut c = 0u64;
        check(unsafe { ffi::pkv_seq_fork(self.p(), s.0, &mut c) }, "pkv_seq_fork")?;
        Ok(Seq(c))
    }

    /// Keeps positions [0, n).
    pub fn truncate(&mut self, s: Seq, n: u32) -> Result<()> {
        check(unsafe { ffi::pkv_seq_truncate(self.p(), s.0, n) }, "pkv_seq_truncate")
    }

    /// Lets go of the blocks wholly before position `pos`, which a sliding window or chunked local
    /// attention no longer reads (pkv_seq_drop_front): positions before `seq_info(s).n_dropped`
    /// are then refused by every call. Where the cache indexes prefixes, the dropped blocks stay
    /// indexed until evicted, so the same prompt still matches.
    pub fn drop_front(&mut self, s: Seq, pos: u32) -> Result<()> {
        check(
            unsafe { ffi::pkv_seq_drop_front(self.p(), s.0, pos) },
            "pkv_seq_drop_front",
        )
    }

    /// Keeps the positions start + idx\[k\] of the sequence's uncommitted tail, moved to start + k
    /// (their token ids and every layer's K and V), and drops the rest of the tail: the length
    /// becomes start + idx.len() (pkv_seq_keep). After a [`Cache::tree`] over nodes at
    /// [start, ...), this keeps the accepted path (its node indices ascend from root to leaf);
    /// then [`Cache::commit`] what is kept. idx strictly ascending, start + its last < the length,
    /// start at or past the committed count, and each position moved into one that
    /// [`Cache::write_kv_seq`] could write (a block `s` holds alone, outside the prefix index, not
    /// committed): else `EINVAL` and nothing changes. An empty idx truncates to start. Slots
    /// taken before are stale for the moved positions.
    pub fn keep(&mut self, s: Seq, start: u32, idx: &[u32]) -> Result<()> {
        let n = len_u32(idx.len(), "keep: idx")?;
        check(
            unsafe { ffi::pkv_seq_keep(self.p(), s.0, start, idx.as_ptr(), n) },
            "pkv_seq_keep",
        )
    }

    /// Context shift (pkv_seq_shift): removes positions [from, to) of `s`; the positions after
    /// them move down by to - from with their token ids and K/V, each K row turned back by as
    /// many positions of `rope` (None: moved as stored, for K without RoPE). llama.cpp's context
    /// shift, StreamingLLM's cache. From `from` on, `s` then indexes nothing in the prefix cache
    /// and a tier saves nothing ([`Cache::truncate`] to `from` or below makes it exact again);
    /// shared or indexed blocks are copied first (`ENOSPC`, nothing changed, where no block can be
    /// had). `EINVAL` for a rope whose inv_freq is not n_rot / 2 values, and as pkv.h says.
    pub fn shift(&mut self, s: Seq, from: u32, to: u32, rope: Option<&Rope>) -> Result<()> {
        let r = match rope {
            None => None,
            Some(r) => {
                if let Some(f) = r.inv_freq {
                    if f.len() as u64 * 2 != r.n_rot as u64 {
                        return Err(invalid(format!(
                            "shift: inv_freq holds {} values, n_rot {} takes n_rot / 2",
                            f.len(),
                            r.n_rot
                        )));
                    }
                }
                Some(ffi::pkv_rope {
                    dim0: r.dim0,
                    n_rot: r.n_rot,
                    style: match r.style {
                        RopeStyle::Neox => ffi::PKV_ROPE_NEOX,
                        RopeStyle::Gptj => ffi::PKV_ROPE_GPTJ,
                    },
                    theta: r.theta,
                    inv_freq: r.inv_freq.map_or(std::ptr::null(), |f| f.as_ptr()),
                })
            }
        };
        let rp = r.as_ref().map_or(std::ptr::null(), |r| r as *const ffi::pkv_rope);
        check(
            unsafe { ffi::pkv_seq_shift(self.p(), s.0, from, to, rp) },
            "pkv_seq_shift",
        )
    }

    /// Moves runs of the sequence's blocks that it alone holds (no fork or pin shares them) into
    /// FREE blocks (with `evict`, also CACHED leaf blocks, evicted as an append would; with
    /// `cached`, any CACHED block, exchanged so that it stays findable) so that its block table
    /// holds longer runs of consecutive ids: at each gap, the shorter of the two runs beside it
    /// that fits moves to meet the other (pkv.h, pkv_seq_compact). Returns the number of block
    /// copies (two an exchange). Slots and block tables taken before are stale for the moved
    /// blocks.
    pub fn compact(&mut self, s: Seq, evict: bool, cached: bool) -> Result<u32> {
        let mut moved = 0u32;
        check(
            unsafe { ffi::pkv_seq_compact(self.p(), s.0, evict as u32 | (cached as u32) << 1, &mut moved) },
            "pkv_seq_compact",
        )?;
        Ok(moved)
    }

    /// Lays the blocks each of `seqs` holds alone out as one group a sequence in id order, over
    /// the FREE ids and the ids the batch holds, exchanging blocks where no room is free; a
    /// sequence laid out already stays (with `repack` every one is laid out again, from the
    /// lowest ids), the others move in the order given (pkv.h, pkv_batch_compact), leaving
    /// `slack` FREE ids after each where the FREE blocks allow. With `cached` the CACHED blocks
    /// of the prefix index are room too (exchanged: they stay findable). Returns the number of
    /// block copies. Slots and block tables of the batch taken before are stale.
    pub fn batch_compact(&mut self, seqs: &[Seq], slack: u32, repack: bool, cached: bool) -> Result<u32> {
        let n = len_u32(seqs.len(), "batch_compact: seqs")?;
        let mut moved = 0u32;
        check(
            unsafe {
                ffi::pkv_batch_compact(
                    self.p(),
                    Self::seq_ptr(seqs),
                    n,
                    slack,
                    repack as u32 | (cached as u32) << 1,
                    &mut moved,
                )
            },
            "pkv_batch_compact",
        )?;
        Ok(moved)
    }

    /// Drops the sequence; its id becomes stale.
    pub fn release(&mut self, s: Seq) -> Result<()> {
        check(unsafe { ffi::pkv_seq_release(self.p(), s.0) }, "pkv_seq_release")
    }

    pub fn seq_info(&self, s: Seq) -> Result<SeqInfo> {
        let mut i = SeqInfo::default();
        check(
            unsafe { ffi::pkv_seq_get_info(self.p(), s.0, &mut i) },
            "pkv_seq_get_info",
        )?;
        Ok(i)
    }

    /// EINVAL unless positions [start, start + n) are in the sequence (the C call's own check),
    /// made before an output of n rows is allocated: a huge n is an error, not an allocation of
    /// that size. The length cannot change before the call that follows: appends take `&mut self`.
    fn in_seq(&self, s: Seq, start: u32, n: u32, what: &str) -> Result<()> {
        let len = self.seq_info(s)?.n_tokens;
        if u64::from(start) + u64::from(n) > u64::from(len) {
            return Err(invalid(format!(
                "{}: positions [{}, {}) past the sequence's {}",
                what,
                start,
                u64::from(start) + u64::from(n),
                len
            )));
        }
        Ok(())
    }

    /// Slots of positions [start, start + n): vLLM's slot_mapping.
    pub fn slots(&self, s: Seq, start: u32, n: u32) -> Result<Vec<i32>> {
        self.in_seq(s, start, n, "pkv_seq_slots")?;
        let mut out = vec![0i32; n as usize];
        self.slots_into(s, start, &mut out)?;
        Ok(out)
    }

    /// [`Cache::slots`] of positions [start, start + out.len()) into the caller's buffer.
    pub fn slots_into(&self, s: Seq, start: u32, out: &mut [i32]) -> Result<()> {
        let n = len_u32(out.len(), "slots: out")?;
        check(
            unsafe { ffi::pkv_seq_slots(self.p(), s.0, start, n, out.as_mut_ptr()) },
            "pkv_seq_slots",
        )
    }

    /// The sequence's block ids.
    pub fn block_table(&self, s: Seq) -> Result<Vec<i32>> {
        let mut out = vec![0i32; self.seq_info(s)?.n_blocks as usize];
        let got = self.block_table_into(s, &mut out)?;
        out.truncate(got);
        Ok(out)
    }

    /// [`Cache::block_table`] into the caller's buffer; returns the table's length. EINVAL,
    /// nothing copied, where `out` is shorter than the table.
    pub fn block_table_into(&self, s: Seq, out: &mut [i32]) -> Result<usize> {
        let cap = u32::try_from(out.len()).unwrap_or(u32::MAX); // no table is longer
        let mut got = 0u32;
        let rc = unsafe { ffi::pkv_seq_block_table(self.p(), s.0, out.as_mut_ptr(), cap, &mut got) };
        if rc == EINVAL && got as usize > out.len() {
            return Err(invalid(format!(
                "pkv_seq_block_table: out holds {} ids, the table {}",
                out.len(),
                got
            )));
        }
        check(rc, "pkv_seq_block_table")?;
        Ok(got as usize)
    }

    /// K and V of positions [start, start + n) of one layer, f32 `[n][n_kv_heads][head_dim]`
    /// (dequantized). Where V lives in K (MLA, [`Config::v_dim`]) V is empty: a position's V is
    /// the first v_dim values of its K row.
    pub fn gather(&self, s: Seq, layer: u32, start: u32, n: u32) -> Result<(Vec<f32>, Vec<f32>)> {
        self.in_seq(s, start, n, "pkv_seq_gather")?;
        let len = self.kv_elems(n as usize);
        let mut k = vec![0f32; len];
        if self.cfg.v_dim != 0 {
            self.gather_into(s, layer, start, Some(&mut k), None)?;
            return Ok((k, Vec::new()));
        }
        let mut v = vec![0f32; len];
        self.gather_into(s, layer, start, Some(&mut k), Some(&mut v))?;
        Ok((k, v))
    }

    /// [`Cache::gather`] into the caller's buffers, K, V or both, each `[n][n_kv_heads][head_dim]`
    /// for n = its length / (n_kv_heads * head_dim) positions (both the same n). K alone where V
    /// lives in K (MLA): a V is `EINVAL`.
    pub fn gather_into(
        &self,
        s: Seq,
        layer: u32,
        start: u32,
        k: Option<&mut [f32]>,
        v: Option<&mut [f32]>,
    ) -> Result<()> {
        self.no_v_in_k(v.is_some(), "gather")?;
        let row = self.kv_elems(1);
        let len = match (&k, &v) {
            (Some(k), Some(v)) => {
                want_len(v.len(), k.len(), "gather: v (as k)")?;
                k.len()
            }
            (Some(x), None) | (None, Some(x)) => x.len(),
            (None, None) => return Err(invalid("gather: neither k nor v given".into())),
        };
        if len % row != 0 {
            return Err(invalid(format!(
                "gather: {} elements, not a whole number of rows of {}",
                len, row
            )));
        }
        let n = len_u32(len / row, "gather: positions")?;
        let kp = k.map_or(ptr::null_mut(), |x| x.as_mut_ptr());
        let vp = v.map_or(ptr::null_mut(), |x| x.as_mut_ptr());
        check(
            unsafe { ffi::pkv_seq_gather(self.p(), s.0, layer, start, n, kp, vp) },
            "pkv_seq_gather",
        )
    }

    /// Bytes of one position's stored rows, K and V: n_kv_heads rows of the pool's row bytes
    /// ([`Dtype::row_bytes`] of k_dtype and v_dtype; V none where V lives in K).
    fn stored_bytes(&self) -> (usize, usize) {
        let (d, h) = (self.cfg.head_dim, self.cfg.n_kv_heads as usize);
        let vb = if self.cfg.v_dim != 0 {
            0
        } else {
            h * self.cfg.v_dtype.row_bytes(d)
        };
        (h * self.cfg.k_dtype.row_bytes(d), vb)
    }

    /// K and V of positions [start, start + n) of one layer exactly as the pool stores them
    /// (pkv_seq_read_stored): `[n][n_kv_heads][row bytes]`, K in the cache's k_dtype and V in its
    /// v_dtype ([`Dtype::row_bytes`]; scales inline for the quantized dtypes).
    /// [`Cache::write_stored`] takes them back, into this cache or another of the same dtypes,
    /// head_dim and n_kv_heads (any block size), bit for bit: a sequence swapped out and in, or
    /// moved to another cache. Where V lives in K (MLA, [`Config::v_dim`]) V is empty: K's rows
    /// are all there is (and the other cache must have the same v_dim).
    pub fn read_stored(&self, s: Seq, layer: u32, start: u32, n: u32) -> Result<(Vec<u8>, Vec<u8>)> {
        self.in_seq(s, start, n, "pkv_seq_read_stored")?;
        let (kb, vb) = self.stored_bytes();
        let len = |per: usize| {
            (n as usize)
                .checked_mul(per)
                .ok_or_else(|| invalid(format!("read_stored: {} positions of {} bytes is past usize", n, per)))
        };
        let (mut k, mut v) = (vec![0u8; len(kb)?], vec![0u8; len(vb)?]);
        let vo = if self.cfg.v_dim != 0 { None } else { Some(&mut v[..]) };
        self.read_stored_into(s, layer, start, Some(&mut k), vo)?;
        Ok((k, v))
    }

    /// [`Cache::read_stored`] into the caller's buffers, K, V or both, each holding n positions'
    /// rows for n = its length / the bytes of one position's rows (both the same n). K alone where
    /// V lives in K (MLA): a V is `EINVAL`.
    pub fn read_stored_into(
        &self,
        s: Seq,
        layer: u32,
        start: u32,
        k: Option<&mut [u8]>,
        v: Option<&mut [u8]>,
    ) -> Result<()> {
        self.no_v_in_k(v.is_some(), "read_stored")?;
        let n = self.stored_positions(k.as_ref().map(|x| x.len()), v.as_ref().map(|x| x.len()), "read_stored")?;
        let kp = k.map_or(ptr::null_mut(), |x| x.as_mut_ptr() as *mut c_void);
        let vp = v.map_or(ptr::null_mut(), |x| x.as_mut_ptr() as *mut c_void);
        check(
            unsafe { ffi::pkv_seq_read_stored(self.p(), s.0, layer, start, n, kp, vp) },
            "pkv_seq_read_stored",
        )
    }

    /// The positions that buffers of these byte lengths (K, V; None: not given) hold, both the
    /// same, as whole positions of the stored rows.
    fn stored_positions(&self, k: Option<usize>, v: Option<usize>, what: &str) -> Result<u32> {
        let (kb, vb) = self.stored_bytes();
        let mut n = None;
        for (len, per, side) in [(k, kb, "k"), (v, vb, "v")] {
            if let Some(len) = len {
                if per == 0 || len % per != 0 {
                    return Err(invalid(format!(
                        "{}: {}: {} bytes, not whole positions of {}",
                        what, side, len, per
                    )));
                }
                let m = len / per;
                if n.map_or(false, |n0| n0 != m) {
                    return Err(invalid(format!(
                        "{}: k holds {} positions, v {}",
                        what,
                        n.unwrap_or(0),
                        m
                    )));
                }
                n = Some(m);
            }
        }
        let n = n.ok_or_else(|| invalid(format!("{}: neither k nor v given", what)))?;
        len_u32(n, &format!("{}: positions", what))
    }

    /// Writes rows as [`Cache::read_stored`] gives them to positions [start, start + n) of `s`
    /// (pkv_seq_write_stored), n the positions `k` or `v` holds (both the same). All-or-nothing,
    /// with [`Cache::write_kv_seq`]'s checks; the rows are checked too (a scale or value not
    /// finite, past PKV_VALUE_MAX, or a code the encoder never writes is an error, nothing
    /// written). `k` alone where V lives in K (MLA): a V is `EINVAL`.
    pub fn write_stored(&mut self, s: Seq, layer: u32, start: u32, k: Option<&[u8]>, v: Option<&[u8]>) -> Result<()> {
        self.no_v_in_k(v.is_some(), "write_stored")?;
        let n = self.stored_positions(k.map(|x| x.len()), v.map(|x| x.len()), "write_stored")?;
        let kp = k.map_or(ptr::null(), |x| x.as_ptr() as *const c_void);
        let vp = v.map_or(ptr::null(), |x| x.as_ptr() as *const c_void);
        check(
            unsafe { ffi::pkv_seq_write_stored(self.p(), s.0, layer, start, n, kp, vp) },
            "pkv_seq_write_stored",
        )
    }

    fn seq_ptr(seqs: &[Seq]) -> *const u64 {
        seqs.as_ptr() as *const u64 // Seq is repr(transparent) over u64
    }

    /// vLLM's dense block tables: (`[n_seqs][max_blocks]`, unused -1; seq_lens). EINVAL where
    /// max_blocks is over the cache's max_blocks_per_seq (no table is longer: the rest would be
    /// padding), checked before the tables are allocated.
    pub fn export_dense(&self, seqs: &[Seq], max_blocks: u32) -> Result<(Vec<i32>, Vec<i32>)> {
        let n = len_u32(seqs.len(), "export_dense: seqs")?;
        if max_blocks > self.cfg.max_blocks_per_seq {
            return Err(invalid(format!(
                "export_dense: max_blocks {} over the cache's max_blocks_per_seq {}",
                max_blocks, self.cfg.max_blocks_per_seq
            )));
        }
        let mut tables = vec![0i32; mul_len(seqs.len(), max_blocks as usize, "export_dense")?];
        let mut lens = vec![0i32; seqs.len()];
        let rc = unsafe {
            ffi::pkv_export_dense(
                self.p(),
                Self::seq_ptr(seqs),
                n,
                max_blocks,
                tables.as_mut_ptr(),
                lens.as_mut_ptr(),
            )
        };
        check(rc, "pkv_export_dense")?;
        Ok((tables, lens))
    }

    /// FlashInfer's paged layout: (indptr `[n_seqs + 1]`, indices, last_page_len `[n_seqs]`).
    pub fn export_csr(&self, seqs: &[Seq]) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let n = len_u32(seqs.len(), "export_csr: seqs")?;
        let mut indptr = vec![0i32; seqs.len() + 1];
        let mut last = vec![0i32; seqs.len()];
        let mut need = 0u32;
        // sizing call: no room, so PKV_EINVAL and the count (or PKV_OK when every table is empty)
        let rc = unsafe {
            ffi::pkv_export_csr(
                self.p(),
                Self::seq_ptr(seqs),
                n,
                indptr.as_mut_ptr(),
                ptr::null_mut(),
                0,
                last.as_mut_ptr(),
                &mut need,
            )
        };
        if rc != OK && rc != EINVAL {
            check(rc, "pkv_export_csr")?; // (with what libpkv said)
        }
        let mut indices = vec![0i32; need as usize];
        let rc = unsafe {
            ffi::pkv_export_csr(
                self.p(),
                Self::seq_ptr(seqs),
                n,
                indptr.as_mut_ptr(),
                indices.as_mut_ptr(),
                need,
                last.as_mut_ptr(),
                &mut need,
            )
        };
        check(rc, "pkv_export_csr")?;
        Ok((indptr, indices, last))
    }

    // ---- prefix cache ----

    /// For an empty sequence and its prompt: attaches the longest indexed prefix; returns the
    /// tokens reused (never the whole prompt). Matching full blocks are shared; the matching
    /// leading tokens of the next block are copied into a fresh block (best effort: the 64
    /// newest candidates; see `pkv_seq_match_prefix` in pkv.h).
    pub fn match_prefix(&mut self, s: Seq, tokens: &[i32]) -> Result<u32> {
        let mut r = 0u32;
        let n = len_u32(tokens.len(), "match_prefix: tokens")?;
        check(
            unsafe { ffi::pkv_seq_match_prefix(self.p(), s.0, tokens.as_ptr(), n, &mut r) },
            "pkv_seq_match_prefix",
        )?;
        Ok(r)
    }

    /// [`Cache::match_prefix`] for a cache whose layers attend through a sliding window of
    /// `window` positions (or chunks of attn_chunk: pass that): reuses the prefix whose last
    /// window's blocks hold K/V, matching through evicted blocks' tombstones before them, and
    /// leaves the sequence's front dropped before the first key its next query sees
    /// (`SeqInfo::n_dropped`; see `pkv_seq_match_prefix_window` in pkv.h). EINVAL for window 0.
    pub fn match_prefix_window(&mut self, s: Seq, tokens: &[i32], window: u32) -> Result<u32> {
        let mut r = 0u32;
        let n = len_u32(tokens.len(), "match_prefix_window: tokens")?;
        check(
            unsafe { ffi::pkv_seq_match_prefix_window(self.p(), s.0, tokens.as_ptr(), n, window, &mut r) },
            "pkv_seq_match_prefix_window",
        )?;
        Ok(r)
    }

    /// Stores the full committed blocks of `s` that `t` lacks (pkv_tier_save); returns how many
    /// it stored. A store refusing an entry for want of room is not an error; one failing
    /// otherwise (Redis unreachable: `Io`) fails the call, and the entries it stored are deleted
    /// again. Reads `s` as [`Cache::gather`] does.
    pub fn tier_save(&self, t: &Tier, s: Seq) -> Result<u32> {
        let mut n = 0u32;
        check(
            unsafe { ffi::pkv_tier_save(t.raw.as_ptr(), self.p(), s.0, &mut n) },
            "pkv_tier_save",
        )?;
        Ok(n)
    }

    /// As [`Cache::tier_save`], but the store's puts are left to `t`'s thread
    /// ([`Tier::prefetch_start`] first, else `InvalidArgument`) (pkv_tier_save_async): the
    /// entries of the full committed blocks are made now, into host memory within the tier's
    /// staging bytes, and queued, all of them or, on a failure, none; returns how many. `s` may
    /// be released as soon as it returns. Where staging has no room for them, it saves now, as
    /// [`Cache::tier_save`], and returns 0. The thread puts them before any queued prefetch,
    /// skipping those the store has, and counts them in [`Tier::stats`]; [`Tier::flush`] waits
    /// for them, and dropping the tier puts them first. Reads `s` as [`Cache::gather`] does.
    pub fn tier_save_async(&self, t: &Tier, s: Seq) -> Result<u32> {
        let mut n = 0u32;
        check(
            unsafe { ffi::pkv_tier_save_async(t.raw.as_ptr(), self.p(), s.0, &mut n) },
            "pkv_tier_save_async",
        )?;
        Ok(n)
    }

    /// For a sequence whose positions are all committed and are the prompt's first tokens (as
    /// [`Cache::match_prefix`] leaves it, or empty): appends, writes and commits the prompt's
    /// next blocks from `t`, up to the first it lacks, never the prompt's last token
    /// (pkv_tier_load); returns the positions added. A miss, a refused entry or a full pool ends
    /// the load.
    pub fn tier_load(&mut self, t: &Tier, s: Seq, tokens: &[i32]) -> Result<u32> {
        let n = len_u32(tokens.len(), "tier_load: tokens")?;
        let mut r = 0u32;
        check(
            unsafe { ffi::pkv_tier_load(t.raw.as_ptr(), self.p(), s.0, tokens.as_ptr(), n, &mut r) },
            "pkv_tier_load",
        )?;
        Ok(r)
    }

    /// [`Cache::tier_load`] for layers that attend through a sliding window of `window`
    /// positions (chunks of local attention: pass attn_chunk), the tier's side of
    /// [`Cache::match_prefix_window`] (pkv_tier_load_window). Into an empty sequence it loads
    /// only what the window of the longest prefix the tier can restore reads, and drops the
    /// front before it (`SeqInfo::n_dropped`); the positions returned count the front's. Into a
    /// sequence that holds positions it is `tier_load`. EINVAL for window 0.
    pub fn tier_load_window(&mut self, t: &Tier, s: Seq, tokens: &[i32], window: u32) -> Result<u32> {
        let n = len_u32(tokens.len(), "tier_load_window: tokens")?;
        let mut r = 0u32;
        check(
            unsafe { ffi::pkv_tier_load_window(t.raw.as_ptr(), self.p(), s.0, tokens.as_ptr(), n, window, &mut r) },
            "pkv_tier_load_window",
        )?;
        Ok(r)
    }

    /// Pins the committed full blocks of positions [0, n_pos) of s; returns the pin.
    pub fn pin(&mut self, s: Seq, n_pos: u32) -> Result<Seq> {
        let mut p = 0u64;
        check(
            unsafe { ffi::pkv_pin_create(self.p(), s.0, n_pos, &mut p) },
            "pkv_pin_create",
        )?;
        Ok(Seq(p))
    }

    pub fn pin_release(&mut self, pin: Seq) -> Result<()> {
        check(unsafe { ffi::pkv_pin_release(self.p(), pin.0) }, "pkv_pin_release")
    }

    // ---- prefix-index events ----

    /// Takes the oldest recorded prefix-index events, at most `max`, and forgets them
    /// (pkv_cache_take_events); none held: an empty Vec, at once. With `with_tokens`, each
    /// `Stored` / `Removed` event carries its block's token ids. EINVAL for a cache created with
    /// event_capacity 0. An [`EventKind::Overflow`] event says events were dropped: rebuild from
    /// [`Cache::prefix_snapshot`]. `&self`: it changes no sequence (the ring is the library's,
    /// under its lock); one consumer, though: two threads taking at once each get a share.
    pub fn take_events(&self, max: usize, with_tokens: bool) -> Result<Vec<Event>> {
        // the ring never holds more than event_capacity: no larger buffer is needed
        let cap = max.min(self.cfg.event_capacity as usize);
        let mut buf = EventBuf::new(cap, self.cfg.block_tokens as usize, with_tokens, "take_events")?;
        let mut n = 0usize;
        let (raw, tp) = buf.ptrs();
        check(
            unsafe { ffi::pkv_cache_take_events(self.p(), raw, cap, tp, &mut n) },
            "pkv_cache_take_events",
        )?;
        Ok(buf.events(n))
    }

    /// The whole prefix index now, as `Stored` events (seqno 0), every parent before its
    /// children, and the recorded events forgotten in the same step (pkv_prefix_snapshot): a
    /// consumer that applies it and then every event it takes afterwards stays exact. Works with
    /// event_capacity 0 as well. With `with_tokens`, each event carries its block's token ids.
    pub fn prefix_snapshot(&self, with_tokens: bool) -> Result<Vec<Event>> {
        let b = self.cfg.block_tokens as usize;
        let room = |n: u64| {
            usize::try_from(n)
                .ok()
                .and_then(|n| n.checked_add(64))
                .ok_or_else(|| invalid(format!("prefix_snapshot: {} indexed blocks is past usize", n)))
        };
        // room for what other threads index meanwhile, usually
        let st = self.stats()?;
        let mut cap = room(st.n_indexed.saturating_add(st.n_tombstones))?;
        loop {
            let mut buf = EventBuf::new(cap, b, with_tokens, "prefix_snapshot")?;
            let mut n = 0usize;
            let (raw, tp) = buf.ptrs();
            let rc = unsafe { ffi::pkv_prefix_snapshot(self.p(), raw, cap, tp, &mut n) };
            if rc == ELIMIT && n > cap {
                // the index grew past that: again, with room (forgetting the refusal it said)
                SAID.with(|s| s.borrow_mut().take());
                cap = room(n as u64)?;
                continue;
            }
            check(rc, "pkv_prefix_snapshot")?;
            return Ok(buf.events(n));
        }
    }

    // ---- statistics and checker ----

    pub fn stats(&self) -> Result<Stats> {
        let mut st = Stats::default();
        check(
            unsafe { ffi::pkv_cache_get_stats(self.p(), &mut st) },
            "pkv_cache_get_stats",
        )?;
        Ok(st)
    }

    /// Verifies every invariant; the error (ECORRUPT) names the first one broken.
    pub fn check(&self) -> Result<()> {
        let mut msg = [0 as c_char; 512];
        let rc = unsafe { ffi::pkv_cache_check(self.p(), msg.as_mut_ptr(), msg.len()) };
        if rc == OK {
            return Ok(());
        }
        let text = unsafe { CStr::from_ptr(msg.as_ptr()) }.to_string_lossy().into_owned();
        Err(Error::new(rc, said_or(&format!("pkv_cache_check: {}", text))))
    }

    // ---- attention ----

    /// One attention call of `items` sequences or requests and `rows` queries: the params built,
    /// q's (head_dim a head), out's ([`Cache::out_dim`] a head), lse's, sinks' and ALiBi slopes'
    /// lengths checked,
    /// then `call(cache, items, q, out, params)`.
    #[allow(clippy::too_many_arguments)]
    fn attn_call(
        &self,
        what: &str,
        items: usize,
        rows: usize,
        q: &[f32],
        out: &mut [f32],
        p: &AttnParams<'_>,
        lse: Option<&mut [f32]>,
        call: impl FnOnce(*mut ffi::pkv_cache, u32, *const f32, *mut f32, &ffi::pkv_attn_params) -> c_int,
    ) -> Result<()> {
        let hq = if p.n_q_heads == 0 {
            self.cfg.n_kv_heads
        } else {
            p.n_q_heads
        } as usize;
        let rows_hq = mul_len(rows, hq, what)?;
        let n = mul_len(rows_hq, self.cfg.head_dim as usize, what)?;
        want_len(q.len(), n, &format!("{}: q", what))?;
        let n_out = mul_len(rows_hq, self.out_dim() as usize, what)?;
        want_len(out.len(), n_out, &format!("{}: out", what))?;
        let ni = len_u32(items, what)?;
        let mut raw = unsafe { ffi::pkv_attn_params_default() };
        raw.n_q_heads = p.n_q_heads;
        raw.scale = p.scale;
        raw.softcap = p.softcap;
        raw.window = p.window;
        raw.attn_chunk = p.attn_chunk;
        raw.flags = if p.bf16_dot { ffi::PKV_ATTN_BF16_DOT } else { 0 }
            | if p.noncausal { ffi::PKV_ATTN_NONCAUSAL } else { 0 }
            | if p.f16_as_bf16 { ffi::PKV_ATTN_F16_AS_BF16 } else { 0 };
        if let Some(s) = p.sinks {
            // a shared borrow: it cannot overlap out or lse, which are borrowed mutably
            want_len(s.len(), hq, &format!("{}: sinks", what))?;
            raw.sinks = s.as_ptr();
        }
        if let Some(a) = p.alibi_slopes {
            want_len(a.len(), hq, &format!("{}: alibi_slopes", what))?;
            raw.alibi_slopes = a.as_ptr();
        }
        if let Some(l) = lse {
            want_len(l.len(), rows_hq, &format!("{}: lse", what))?;
            raw.lse = l.as_mut_ptr();
        }
        check(
            call(self.p(), ni, q.as_ptr(), out.as_mut_ptr(), &raw),
            &format!("pkv_attn_{}", what),
        )
    }

    /// Decode (pkv_attn_decode): one query per sequence at its last position. q and out:
    /// `[seqs.len()][n_q_heads][head_dim]` (out `[seqs.len()][n_q_heads][v_dim]` where V lives in
    /// K, MLA: [`Config::v_dim`]); lse, if given, `[seqs.len()][n_q_heads]`; `p.sinks`, if given,
    /// `[n_q_heads]`.
    pub fn decode(
        &self,
        layer: u32,
        seqs: &[Seq],
        q: &[f32],
        out: &mut [f32],
        p: &AttnParams<'_>,
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        self.attn_call(
            "decode",
            seqs.len(),
            seqs.len(),
            q,
            out,
            p,
            lse,
            |c, n, qp, op, raw| unsafe { ffi::pkv_attn_decode(c, layer, Self::seq_ptr(seqs), n, qp, op, raw) },
        )
    }

    /// Prefill / extend over a ragged batch (pkv_attn_prefill), causal. q and out: the requests'
    /// queries concatenated, `[sum n_q][n_q_heads][head_dim]` (out `[..][v_dim]` where V lives in
    /// K, as for [`Cache::decode`]); lse, if given, `[sum n_q][n_q_heads]`; `p.sinks`, if given,
    /// `[n_q_heads]`.
    pub fn prefill(
        &self,
        layer: u32,
        reqs: &[AttnReq],
        q: &[f32],
        out: &mut [f32],
        p: &AttnParams<'_>,
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        let total = reqs
            .iter()
            .try_fold(0usize, |t, r| t.checked_add(r.n_q as usize))
            .ok_or_else(|| invalid("prefill: the queries' count is past usize".to_string()))?;
        // AttnReq is laid out as pkv_attn_req (tests/api.rs checks the offsets)
        let rp = reqs.as_ptr() as *const ffi::pkv_attn_req;
        self.attn_call(
            "prefill",
            reqs.len(),
            total,
            q,
            out,
            p,
            lse,
            |c, n, qp, op, raw| unsafe { ffi::pkv_attn_prefill(c, layer, rp, n, qp, op, raw) },
        )
    }

    /// Prefill with a custom mask per request (pkv_attn_prefill_masked): `masks[i]` `None`
    /// leaves request i to [`Cache::prefill`]'s rule; `Some(bits)` makes its query j see key t
    /// exactly where bit `j * kv_len + t` of `bits` is set (bit i: bit `i % 8` of byte `i / 8`;
    /// [`pack_mask`] packs a row-major `[n_q][kv_len]` of bools), with kv_len = q_start + n_q, or
    /// the sequence's length with `p.noncausal`. Causality is the mask's to say: keys ahead of a
    /// query may be seen (bidirectional image or prefix tokens), a packed sequence's documents
    /// kept apart. A query that sees no key gets 0 (lse -inf, or the sink's). A mask shorter
    /// than its n_q x kv_len bits, or a count of masks other than the requests', is `EINVAL`
    /// here; a window or attn_chunk with a mask is libpkv's `EINVAL`. Otherwise as
    /// [`Cache::prefill`].
    pub fn prefill_masked(
        &self,
        layer: u32,
        reqs: &[AttnReq],
        masks: &[Option<&[u8]>],
        q: &[f32],
        out: &mut [f32],
        p: &AttnParams<'_>,
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        if masks.len() != reqs.len() {
            return Err(invalid(format!(
                "prefill_masked: {} masks for {} requests",
                masks.len(),
                reqs.len()
            )));
        }
        let mut ptrs = Vec::with_capacity(masks.len());
        for (i, (r, m)) in reqs.iter().zip(masks).enumerate() {
            let Some(m) = m else {
                ptrs.push(std::ptr::null());
                continue;
            };
            // the sequence cannot grow during the call: appending borrows the cache mutably
            let kv_len = if p.noncausal {
                self.seq_info(r.seq)?.n_tokens as u64
            } else {
                r.q_start as u64 + r.n_q as u64
            };
            let bytes = (r.n_q as u64 * kv_len).div_ceil(8);
            if (m.len() as u64) < bytes {
                return Err(invalid(format!(
                    "prefill_masked: mask {} has {} bytes, {} needed ({} x {} bits)",
                    i,
                    m.len(),
                    bytes,
                    r.n_q,
                    kv_len
                )));
            }
            ptrs.push(m.as_ptr());
        }
        let total = reqs
            .iter()
            .try_fold(0usize, |t, r| t.checked_add(r.n_q as usize))
            .ok_or_else(|| invalid("prefill_masked: the queries' count is past usize".to_string()))?;
        let rp = reqs.as_ptr() as *const ffi::pkv_attn_req;
        let mp = ptrs.as_ptr();
        self.attn_call(
            "prefill_masked",
            reqs.len(),
            total,
            q,
            out,
            p,
            lse,
            |c, n, qp, op, raw| unsafe { ffi::pkv_attn_prefill_masked(c, layer, rp, n, mp, qp, op, raw) },
        )
    }

    /// Tree attention (pkv_attn_tree) for speculative decoding (SpecInfer / Medusa / EAGLE
    /// verification): node i of a request sees the positions before its q_start (the prefix)
    /// and the nodes on its path to its root, itself included, not its siblings or other
    /// branches. With a window, a key is seen where the node's position (q_start + depth) minus
    /// the key's (its position in the prefix, or q_start + depth for a node) is under the window.
    /// q and out: the requests' nodes' queries concatenated, `[sum parent.len()][n_q_heads][head_dim]`
    /// (out `[..][v_dim]` where V lives in K, as for [`Cache::decode`]; out is never q: libpkv
    /// refuses that for this call, and the borrows keep them apart); lse, if given,
    /// `[sum parent.len()][n_q_heads]`; `p.sinks`, if given, `[n_q_heads]`; `p` means what it
    /// means for [`Cache::prefill`], per node. A chain (`parent[i] = i - 1`) gives what
    /// prefill gives over the same positions, up to float rounding. A parent outside [-1, i),
    /// more than [`TREE_MAX_NODES`] nodes, nodes past the sequence's length, and every refusal of
    /// prefill are `EINVAL`, nothing written. Accepting a path afterwards: [`Cache::truncate`] to
    /// drop the tree, or [`Cache::keep`].
    pub fn tree(
        &self,
        layer: u32,
        reqs: &[TreeReq<'_>],
        q: &[f32],
        out: &mut [f32],
        p: &AttnParams<'_>,
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        let mut total = 0usize;
        // pkv_attn_tree_req holds a pointer and a count where TreeReq holds a slice: built here
        let mut rs = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            let n = len_u32(r.parent.len(), &format!("tree: reqs[{}].parent", i))?;
            total = total
                .checked_add(r.parent.len())
                .ok_or_else(|| invalid("tree: the nodes' count is past usize".to_string()))?;
            rs.push(ffi::pkv_attn_tree_req {
                seq: r.seq.0,
                q_start: r.q_start,
                n_nodes: n,
                parent: r.parent.as_ptr(),
            });
        }
        let rp = rs.as_ptr();
        self.attn_call("tree", reqs.len(), total, q, out, p, lse, |c, n, qp, op, raw| unsafe {
            ffi::pkv_attn_tree(c, layer, rp, n, qp, op, raw)
        })
    }
}
