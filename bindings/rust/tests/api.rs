//! The Rust bindings against libpkv and a float64 reference computed here: the struct layouts
//! against the C compiler's (PKV_ABI_LAYOUT: tests/python/abi_layout.c built), decode and ragged
//! prefill against contiguous attention, soft-cap, window and the LSE merge, attention sinks
//! against that merge, prefix reuse, fork and copy-on-write, the exports, statuses as errors,
//! the binding's own length checks, the `_into` forms, decodes from several threads at once, K/V
//! writes of one layer beside decodes of another, the prefix-index events against the hashes
//! `prefix_hashes` computes, tree attention against the reference over each node's keys, with
//! `keep` of an accepted path, and a cache whose V lives in K (MLA, v_dim): its attention against
//! the reference over K's rows, its outputs' sizes and its refusals of V. Run by ctest
//! (test_rust) with PKV_LIB_DIR set.

use pagedkv::*;
use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::ptr::addr_of;

/// A small deterministic generator (xorshift64*), normal-ish values in [-2, 2).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545F4914F6CDD1D) >> 40;
        (x as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// One query's attention over K, V [T][H][D] seeing positions [T - window, T) (window 0: all).
/// q [Hq][D]; query head h reads kv head h / (Hq / H). Returns out [Hq][D] and lse [Hq].
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    hq: usize,
    h: usize,
    d: usize,
    scale: f64,
    cap: f64,
    window: usize,
) -> (Vec<f64>, Vec<f64>) {
    let t = k.len() / (h * d);
    let lo = if window > 0 && t > window { t - window } else { 0 };
    let mut out = vec![0f64; hq * d];
    let mut lse = vec![0f64; hq];
    for qh in 0..hq {
        let kh = qh / (hq / h);
        let mut s: Vec<f64> = (lo..t)
            .map(|p| {
                (0..d)
                    .map(|i| q[qh * d + i] as f64 * k[(p * h + kh) * d + i] as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        if cap > 0.0 {
            s.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = w.iter().sum();
        for (j, p) in (lo..t).enumerate() {
            for i in 0..d {
                out[qh * d + i] += w[j] * v[(p * h + kh) * d + i] as f64 / sum;
            }
        }
        lse[qh] = m + sum.ln();
    }
    (out, lse)
}

/// The largest |g - w|; NaN where any is NaN (f64::max would drop it and pass).
fn max_err<'a>(pairs: impl Iterator<Item = (&'a f32, &'a f64)>) -> f64 {
    pairs.fold(0f64, |a, (g, w)| {
        let e = (*g as f64 - w).abs();
        if a.is_nan() || e.is_nan() {
            f64::NAN
        } else {
            a.max(e)
        }
    })
}

fn assert_close(got: &[f32], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{}: lengths", what);
    let scale = want.iter().fold(1f64, |a, x| a.max(x.abs()));
    let err = max_err(got.iter().zip(want));
    assert!(
        err <= rel * scale,
        "{}: max abs error {:e} over {:e}",
        what,
        err,
        rel * scale
    );
}

/// Asserts got (one query's [hq][d] output) against the reference over K, V with the default
/// scale, no soft-cap and no window.
#[allow(clippy::too_many_arguments)]
fn expect_attn(got: &[f32], q: &[f32], k: &[f32], v: &[f32], hq: usize, h: usize, d: usize, what: &str) {
    let (w, _) = reference(q, k, v, hq, h, d, 1.0 / (d as f64).sqrt(), 0.0, 0);
    assert_close(got, &w, 1e-5, what);
}

fn cfg(h: u32, d: u32, n_blocks: u32, dt: Dtype) -> Config {
    Config {
        n_kv_heads: h,
        head_dim: d,
        n_blocks,
        k_dtype: dt,
        v_dtype: dt,
        n_threads: 2,
        ..Config::default()
    }
}

/// Appends n tokens to s, writes random f32 K/V for layer 0, commits.
fn fill(c: &mut Cache, s: Seq, n: usize, rng: &mut Rng) {
    let toks: Vec<i32> = (0..n).map(|i| ((i * 7 + 100) % 500) as i32).collect();
    let slots = c.append(s, &toks).unwrap();
    let len = n * (c.config().n_kv_heads * c.config().head_dim) as usize;
    let (k, v) = (rng.vec(len), rng.vec(len));
    c.write_kv(0, &slots, Some(KvData::F32(&k)), Some(KvData::F32(&v)))
        .unwrap();
    let t = c.seq_info(s).unwrap().n_tokens;
    c.commit(s, t).unwrap();
}

/// Checks sizeof($t) and each field's offset against the C values in $c (name -> value), and
/// that C has no field of $name the list leaves out.
macro_rules! offsets {
    ($c:expr, $name:expr, $t:ty, [$($f:ident),*]) => {{
        let c: &HashMap<String, usize> = $c;
        let get = |k: &str| *c.get(k).unwrap_or_else(|| panic!("{} not printed by abi_layout", k));
        let u = MaybeUninit::<$t>::uninit();
        let base = u.as_ptr() as usize;
        assert_eq!(std::mem::size_of::<$t>(), get($name), "sizeof({})", $name);
        let mut n = 0;
        $(
            let at = unsafe { addr_of!((*u.as_ptr()).$f) } as usize - base;
            assert_eq!(at, get(concat!($name, ".", stringify!($f))), "{}.{}", $name, stringify!($f));
            n += 1;
        )*
        let in_c = c.keys().filter(|k| k.starts_with(concat!($name, "."))).count();
        assert_eq!(n, in_c, "{}: fields in Rust against fields in C", $name);
    }};
}

#[test]
fn struct_layouts_match_c() {
    // PKV_ABI_LAYOUT, else the checkout's build/abi_layout (where build.rs finds libpkv.so)
    let exe = std::env::var("PKV_ABI_LAYOUT")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../../build/abi_layout").to_string());
    let run = std::process::Command::new(&exe).output();
    let run = run.unwrap_or_else(|e| {
        panic!(
            "{}: {} (build it: ninja -C build abi_layout, or set PKV_ABI_LAYOUT)",
            exe, e
        )
    });
    let text = String::from_utf8(run.stdout).unwrap();
    let m: HashMap<String, usize> = text
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect();
    let m = &m;
    offsets!(
        m,
        "pkv_config",
        ffi::pkv_config,
        [
            n_layers,
            n_kv_heads,
            head_dim,
            block_tokens,
            n_blocks,
            mem_budget_bytes,
            k_dtype,
            v_dtype,
            max_seqs,
            max_blocks_per_seq,
            n_threads,
            enable_prefix_cache,
            huge_pages,
            allocator,
            log,
            log_ctx,
            executor,
            event_capacity,
            v_dim,
            spin_us
        ]
    );
    offsets!(m, "pkv_allocator", ffi::pkv_allocator, [alloc, free, ctx]);
    offsets!(m, "pkv_executor", ffi::pkv_executor, [parallel_for, ctx, n_workers]);
    offsets!(
        m,
        "pkv_layout",
        ffi::pkv_layout,
        [
            k_base,
            v_base,
            layer_stride_bytes,
            k_row_bytes,
            v_row_bytes,
            k_block_bytes,
            v_block_bytes,
            n_blocks,
            block_tokens,
            n_kv_heads,
            head_dim,
            n_layers,
            k_dtype,
            v_dtype,
            v_dim
        ]
    );
    offsets!(
        m,
        "pkv_seq_info",
        ffi::pkv_seq_info,
        [n_tokens, n_committed, n_blocks, n_shared, n_reused, n_dropped]
    );
    offsets!(
        m,
        "pkv_stats",
        ffi::pkv_stats,
        [
            n_blocks,
            n_free,
            n_cached,
            n_active,
            n_seqs,
            n_pins,
            n_tokens,
            n_slots_used,
            kv_bytes,
            kv_bytes_per_block,
            meta_bytes,
            frag_slots,
            cow_copies,
            peak_active,
            prefix_lookups,
            prefix_tokens_queried,
            prefix_tokens_hit,
            prefix_miss_new,
            prefix_miss_evicted,
            prefix_miss_namespace,
            n_indexed,
            evictions,
            attn_reqs_pool,
            attn_reqs_table,
            attn_shared_keys,
            n_tombstones,
            prefix_tomb_hits
        ]
    );
    offsets!(
        m,
        "pkv_attn_params",
        ffi::pkv_attn_params,
        [
            n_q_heads,
            scale,
            softcap,
            window,
            lse,
            flags,
            sinks,
            alibi_slopes,
            attn_chunk
        ]
    );
    offsets!(m, "pkv_attn_req", ffi::pkv_attn_req, [seq, q_start, n_q]);
    offsets!(m, "pkv_attn_req", AttnReq, [seq, q_start, n_q]); // the safe type handed over as one
    offsets!(
        m,
        "pkv_attn_tree_req",
        ffi::pkv_attn_tree_req,
        [seq, q_start, n_nodes, parent]
    );
    offsets!(m, "pkv_append_req", ffi::pkv_append_req, [seq, tokens, n, slots_out]);
    offsets!(m, "pkv_rope", ffi::pkv_rope, [dim0, n_rot, style, theta, inv_freq]);
    offsets!(
        m,
        "pkv_tier_stats",
        ffi::pkv_tier_stats,
        [
            entries,
            bytes,
            capacity,
            evictions,
            saved,
            save_present,
            save_no_room,
            loaded_blocks,
            loaded_tokens,
            load_misses,
            rejected,
            errors,
            prefetched,
            prefetch_hits,
            prefetch_dropped,
            staged_entries,
            staged_bytes
        ]
    );
    offsets!(
        m,
        "pkv_event",
        ffi::pkv_event,
        [seqno, hash, parent_hash, lost, kind, depth, block, reserved]
    );
}

#[test]
fn library_basics() {
    let hdr = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../include/pkv.h")).unwrap();
    let line = hdr
        .lines()
        .find(|l| l.starts_with("#define PKV_VERSION_STRING"))
        .unwrap();
    assert_eq!(format!("\"{}\"", version()), line.split_whitespace().nth(2).unwrap());
    let d = Config::default();
    assert_eq!(
        (d.n_layers, d.n_kv_heads, d.head_dim, d.block_tokens, d.n_blocks),
        (1, 8, 128, 16, 1024)
    );
    assert_eq!(
        (d.k_dtype, d.v_dtype, d.max_seqs, d.prefix_cache, d.spin_us),
        (Dtype::F16, Dtype::F16, 256, true, 50)
    );
    assert_eq!(Dtype::from_name("fp8").unwrap(), Dtype::Fp8E4m3);
    assert_eq!(Dtype::Q8_0.name(), "q8_0");
    assert_eq!(Dtype::from_name("f64").unwrap_err().code(), EINVAL);
    assert_eq!(Dtype::from_name("f16\0").unwrap_err().code(), EINVAL);
    assert_eq!(Dtype::Q8_0.row_bytes(128), 4 * 34);
    let want = Config {
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 64,
        block_tokens: 8,
        n_blocks: 40,
        k_dtype: Dtype::Bf16,
        v_dtype: Dtype::Q8_0,
        max_seqs: 7,
        max_blocks_per_seq: 9,
        n_threads: 2,
        prefix_cache: false,
        huge_pages: false,
        mem_budget_bytes: 0,
        event_capacity: 5,
        v_dim: 0,
        spin_us: 700,
    };
    let c = Cache::new(&want).unwrap();
    assert_eq!(c.config(), &want);
    let lo = c.layout().unwrap();
    assert_eq!(
        (lo.n_blocks, lo.n_kv_heads, lo.k_row_bytes, lo.v_row_bytes),
        (40, 2, 128, 68)
    );
    assert!(!c.backend().is_empty());
    let e = Cache::new(&Config {
        head_dim: 0,
        ..Config::default()
    })
    .err()
    .unwrap();
    assert_eq!((e.code(), e.name()), (EINVAL, "EINVAL"));
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    // every status has a kind of its own; OK and codes past pkv.h's are Unknown
    let codes = [EINVAL, ENOMEM, ENOSPC, ENOENT, ELIMIT, ECORRUPT, EIO, ENOTSUP, EBUSY];
    let kinds: std::collections::HashSet<ErrorKind> = codes.iter().map(|&c| ErrorKind::from_code(c)).collect();
    assert_eq!(kinds.len(), codes.len());
    assert!(!kinds.contains(&ErrorKind::Unknown));
    assert_eq!(ErrorKind::from_code(ENOTSUP), ErrorKind::NotSupported);
    assert_eq!(ErrorKind::from_code(OK), ErrorKind::Unknown);
    assert_eq!(ErrorKind::from_code(-100), ErrorKind::Unknown);
    assert!(e.to_string().starts_with("pkv_cache_create: "), "{}", e);
    // what libpkv's log said about it
    assert!(e.to_string().contains("head_dim 0 not in 1..1024"), "{}", e);
}

#[test]
fn decode_and_prefill_match_reference() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for dt in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
        let (h, d, hq) = (2usize, 64usize, 8usize);
        let mut c = Cache::new(&cfg(h as u32, d as u32, 64, dt)).unwrap();
        let lens = [1usize, 15, 16, 17, 100, 257];
        let seqs: Vec<Seq> = lens.iter().map(|_| c.seq_create(b"").unwrap()).collect();
        for start in (0..257).step_by(16) {
            for (s, &n) in seqs.iter().zip(&lens) {
                if start < n {
                    fill(&mut c, *s, (n - start).min(16), &mut rng);
                }
            }
        }
        let q = rng.vec(seqs.len() * hq * d);
        let mut out = vec![0f32; q.len()];
        let mut lse = vec![0f32; seqs.len() * hq];
        let p = AttnParams {
            n_q_heads: hq as u32,
            ..AttnParams::default()
        };
        c.decode(0, &seqs, &q, &mut out, &p, Some(&mut lse)).unwrap();
        for (i, (&s, &n)) in seqs.iter().zip(&lens).enumerate() {
            let (k, v) = c.gather(s, 0, 0, n as u32).unwrap();
            let (w, wl) = reference(
                &q[i * hq * d..][..hq * d],
                &k,
                &v,
                hq,
                h,
                d,
                1.0 / (d as f64).sqrt(),
                0.0,
                0,
            );
            assert_close(
                &out[i * hq * d..][..hq * d],
                &w,
                1e-5,
                &format!("{:?} decode, {} tokens", dt, n),
            );
            assert_close(&lse[i * hq..][..hq], &wl, 1e-5, "decode lse");
        }
        let reqs = [
            AttnReq {
                seq: seqs[5],
                q_start: 237,
                n_q: 20,
            },
            AttnReq {
                seq: seqs[4],
                q_start: 97,
                n_q: 3,
            },
            AttnReq {
                seq: seqs[2],
                q_start: 15,
                n_q: 1,
            },
        ];
        let qp = rng.vec(24 * hq * d);
        let mut op = vec![0f32; qp.len()];
        c.prefill(0, &reqs, &qp, &mut op, &p, None).unwrap();
        let mut row = 0;
        for r in &reqs {
            for j in 0..r.n_q {
                let pos = r.q_start + j;
                let (k, v) = c.gather(r.seq, 0, 0, pos + 1).unwrap();
                let what = format!("{:?} prefill, position {}", dt, pos);
                expect_attn(
                    &op[row * hq * d..][..hq * d],
                    &qp[row * hq * d..][..hq * d],
                    &k,
                    &v,
                    hq,
                    h,
                    d,
                    &what,
                );
                row += 1;
            }
        }
    }
}

/// The reference of one query on a cache whose V lives in K (MLA): [`reference`] over K as both
/// K and V (one kv head), each query head's first dv values. out [hq][dv], lse [hq].
fn mla_reference(q: &[f32], k: &[f32], hq: usize, d: usize, dv: usize, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (w, lse) = reference(q, k, k, hq, 1, d, scale, 0.0, 0);
    (w.chunks(d).flat_map(|h| h[..dv].to_vec()).collect(), lse)
}

/// A cache whose V lives in K (MLA: one kv head of 96, v_dim 64), f32 and q8_0: K written alone;
/// decode, prefill and a chain of tree attention against the reference over the gathered K (V =
/// its first 64 values), q head_dim wide and out v_dim wide (the only out length taken); the
/// config and layout; V writes and reads refused, K's stored rows moved alone.
#[test]
fn mla_v_lives_in_k() {
    let mut rng = Rng(0x3d1a);
    let (d, dv, hq) = (96usize, 64usize, 8usize);
    // q8_0 K scores int8 queries (pkv.h): a coarser tolerance
    for (dt, tol) in [(Dtype::F32, 1e-5), (Dtype::Q8_0, 2e-2)] {
        let conf = Config {
            v_dim: dv as u32,
            ..cfg(1, d as u32, 64, dt)
        };
        let mut c = Cache::new(&conf).unwrap();
        assert_eq!(c.config().v_dim, dv as u32);
        let lo = c.layout().unwrap();
        assert_eq!(
            (lo.v_dim, lo.v_base, lo.v_row_bytes, lo.v_block_bytes),
            (dv as u32, lo.k_base, lo.k_row_bytes, lo.k_block_bytes)
        );
        let lens = [1usize, 17, 100];
        let mut seqs = Vec::new();
        for (i, &n) in lens.iter().enumerate() {
            let s = c.seq_create(b"").unwrap();
            let toks: Vec<i32> = (0..n as i32).map(|t| t * 3 + i as i32).collect();
            let slots = c.append(s, &toks).unwrap();
            let k = rng.vec(n * d);
            if i == 0 {
                c.write_kv_seq(s, 0, 0, Some(KvData::F32(&k)), None).unwrap();
            } else {
                c.write_kv(0, &slots, Some(KvData::F32(&k)), None).unwrap();
            }
            c.commit(s, n as u32).unwrap();
            seqs.push(s);
        }
        let p = AttnParams {
            n_q_heads: hq as u32,
            ..AttnParams::default()
        };
        let scale = 1.0 / (d as f64).sqrt();
        let q = rng.vec(seqs.len() * hq * d);
        let mut out = vec![0f32; seqs.len() * hq * dv];
        let mut lse = vec![0f32; seqs.len() * hq];
        c.decode(0, &seqs, &q, &mut out, &p, Some(&mut lse)).unwrap();
        for (i, (&s, &n)) in seqs.iter().zip(&lens).enumerate() {
            let (k, v) = c.gather(s, 0, 0, n as u32).unwrap();
            assert!(v.is_empty(), "gather gives no V where V lives in K");
            let (w, wl) = mla_reference(&q[i * hq * d..][..hq * d], &k, hq, d, dv, scale);
            let what = format!("{:?} MLA decode, {} tokens", dt, n);
            assert_close(&out[i * hq * dv..][..hq * dv], &w, tol, &what);
            assert_close(&lse[i * hq..][..hq], &wl, tol, &what);
        }
        // prefill with a scale of the model's (not 1/sqrt(head_dim)), and a chain of tree nodes
        let ps = AttnParams {
            scale: 1.0 / 48f32.sqrt(),
            ..p
        };
        let reqs = [
            AttnReq {
                seq: seqs[2],
                q_start: 90,
                n_q: 10,
            },
            AttnReq {
                seq: seqs[1],
                q_start: 0,
                n_q: 17,
            },
        ];
        let qp = rng.vec(27 * hq * d);
        let mut op = vec![0f32; 27 * hq * dv];
        c.prefill(0, &reqs, &qp, &mut op, &ps, None).unwrap();
        let chain: Vec<i32> = (-1..11).collect();
        let tr = [TreeReq {
            seq: seqs[2],
            q_start: 88,
            parent: &chain,
        }];
        let qt = rng.vec(12 * hq * d);
        let mut ot = vec![0f32; 12 * hq * dv];
        c.tree(0, &tr, &qt, &mut ot, &ps, None).unwrap();
        let mut rows = Vec::new(); // (call, row, sequence, position)
        for r in &reqs {
            for j in 0..r.n_q {
                rows.push(("prefill", rows.len(), r.seq, r.q_start + j));
            }
        }
        rows.extend((0..12).map(|j| ("tree", j, seqs[2], 88 + j as u32)));
        for (call, row, s, pos) in rows {
            let (qs, os) = if call == "tree" { (&qt, &ot) } else { (&qp, &op) };
            let (k, _) = c.gather(s, 0, 0, pos + 1).unwrap();
            let (w, _) = mla_reference(&qs[row * hq * d..][..hq * d], &k, hq, d, dv, ps.scale as f64);
            let what = format!("{:?} MLA {}, position {}", dt, call, pos);
            assert_close(&os[row * hq * dv..][..hq * dv], &w, tol, &what);
        }
        // outputs v_dim wide, queries head_dim wide: a head_dim-wide out is refused, as is a q
        // of v_dim
        let mut wide = vec![0f32; seqs.len() * hq * d];
        let e = c.decode(0, &seqs, &q, &mut wide, &p, None).unwrap_err();
        assert_eq!(e.code(), EINVAL, "{}", e);
        assert!(e.to_string().contains("out"), "{}", e);
        let qn = &q[..seqs.len() * hq * dv];
        assert_eq!(c.decode(0, &seqs, qn, &mut out, &p, None).unwrap_err().code(), EINVAL);
        let mut wide = vec![0f32; 27 * hq * d];
        assert_eq!(
            c.prefill(0, &reqs, &qp, &mut wide, &ps, None).unwrap_err().code(),
            EINVAL
        );
        let mut wide = vec![0f32; 12 * hq * d];
        assert_eq!(c.tree(0, &tr, &qt, &mut wide, &ps, None).unwrap_err().code(), EINVAL);
        // V written or read: refused, nothing written
        let s = seqs[1];
        let before = c.gather(s, 0, 0, 17).unwrap();
        let slots = c.slots(s, 0, 17).unwrap();
        let k = rng.vec(17 * d);
        let (mut kbuf, mut vbuf) = (vec![0f32; 17 * d], vec![0f32; 17 * d]);
        let (ks, vs) = c.read_stored(s, 0, 0, 17).unwrap();
        assert_eq!((ks.len(), vs.len()), (17 * dt.row_bytes(d as u32), 0));
        let s2 = c.seq_create(b"x").unwrap();
        c.append(s2, &[1; 17]).unwrap();
        let refused = [
            c.write_kv(0, &slots, Some(KvData::F32(&k)), Some(KvData::F32(&k))),
            c.write_kv(0, &slots, None, Some(KvData::F32(&k))),
            c.write_kv_seq(s2, 0, 0, Some(KvData::F32(&k)), Some(KvData::F32(&k))),
            c.gather_into(s, 0, 0, Some(&mut kbuf), Some(&mut vbuf)),
            c.read_stored_into(s, 0, 0, None, Some(&mut vec![0u8; ks.len()])),
            c.write_stored(s2, 0, 0, Some(&ks), Some(&ks)),
        ];
        for (i, r) in refused.into_iter().enumerate() {
            let e = r.unwrap_err();
            assert_eq!(e.code(), EINVAL, "{:?} V case {}: {}", dt, i, e);
            assert!(e.to_string().contains("V lives in K"), "{}", e);
        }
        assert_eq!(c.gather(s, 0, 0, 17).unwrap(), before);
        // K alone: gathered into a buffer, and its stored rows moved bit for bit
        c.gather_into(s, 0, 0, Some(&mut kbuf), None).unwrap();
        assert_eq!(kbuf, before.0);
        c.write_stored(s2, 0, 0, Some(&ks), None).unwrap();
        assert_eq!(c.read_stored(s2, 0, 0, 17).unwrap(), (ks, vs));
        c.check().unwrap();
    }
    // v_dim past head_dim, and a v_dtype other than k_dtype: refused
    for bad in [
        Config {
            v_dim: 97,
            ..cfg(1, 96, 64, Dtype::F32)
        },
        Config {
            v_dim: 64,
            v_dtype: Dtype::F16,
            ..cfg(1, 96, 64, Dtype::F32)
        },
    ] {
        assert_eq!(Cache::new(&bad).err().unwrap().code(), EINVAL, "{:?}", bad);
    }
}

/// bf16_dot: where the cache takes it (bf16_dot_used), the output is the reference's over the
/// queries times scale rounded to bf16, within 2^-7 of max |V| (pkv.h: 2^-8); elsewhere the
/// same bits as without it.
#[test]
fn bf16_dot_rounds_as_documented() {
    let mut rng = Rng(0xbf16);
    let (h, d, hq) = (2usize, 64usize, 8usize);
    let mut c = Cache::new(&cfg(h as u32, d as u32, 64, Dtype::Bf16)).unwrap();
    let seqs: Vec<Seq> = (0..3).map(|_| c.seq_create(b"").unwrap()).collect();
    for _ in 0..12 {
        for s in &seqs {
            fill(&mut c, *s, 16, &mut rng);
        }
    }
    let q = rng.vec(seqs.len() * hq * d);
    let (mut plain, mut out) = (vec![0f32; q.len()], vec![0f32; q.len()]);
    let p = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    c.decode(0, &seqs, &q, &mut plain, &p, None).unwrap();
    c.decode(0, &seqs, &q, &mut out, &AttnParams { bf16_dot: true, ..p }, None)
        .unwrap();
    let used = c.bf16_dot_used();
    assert_eq!(plain != out, used);
    let scale = 1.0 / (d as f32).sqrt();
    let round = |x: f32| {
        let u = x.to_bits();
        f32::from_bits(u.wrapping_add(0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
    };
    let qr: Vec<f32> = q
        .iter()
        .map(|&x| if used { round(x * scale) } else { x * scale })
        .collect();
    for (i, &s) in seqs.iter().enumerate() {
        let n = c.seq_info(s).unwrap().n_tokens;
        let (k, v) = c.gather(s, 0, 0, n).unwrap();
        let (w, _) = reference(&qr[i * hq * d..][..hq * d], &k, &v, hq, h, d, 1.0, 0.0, 0);
        let vmax = v.iter().fold(0f64, |a, x| a.max(x.abs() as f64));
        let err = max_err(out[i * hq * d..][..hq * d].iter().zip(&w));
        let tol = if used { vmax / 128.0 } else { 1e-5 * vmax.max(1.0) };
        assert!(err <= tol, "bf16_dot decode {}: error {:e} over {:e}", i, err, tol);
    }
    let c16 = Cache::new(&cfg(h as u32, d as u32, 8, Dtype::F16)).unwrap();
    assert!(!c16.bf16_dot_used());
}

/// f16_as_bf16: where the cache takes it (f16_as_bf16_used: backend avx512-amx), a prefill of 40
/// positions (160 query rows a kv head: the tiles) is the reference's over K and the queries
/// times scale rounded to bf16, within 2^-7 of max |V|, and differs from the call without it; a
/// decode (8 rows a kv head) gives the same bits.
#[test]
fn f16_as_bf16_rounds_as_documented() {
    let mut rng = Rng(0xf16b);
    let (h, d, hq) = (2usize, 64usize, 8usize);
    let mut c = Cache::new(&cfg(h as u32, d as u32, 64, Dtype::F16)).unwrap();
    let s = c.seq_create(b"").unwrap();
    for _ in 0..13 {
        fill(&mut c, s, 16, &mut rng);
    }
    let used = c.f16_as_bf16_used();
    assert_eq!(used, c.backend() == "avx512-amx");
    let p = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    let pf = AttnParams { f16_as_bf16: true, ..p };
    let q = rng.vec(hq * d);
    let (mut plain, mut out) = (vec![0f32; q.len()], vec![0f32; q.len()]);
    c.decode(0, &[s], &q, &mut plain, &p, None).unwrap();
    c.decode(0, &[s], &q, &mut out, &pf, None).unwrap();
    assert_eq!(plain, out);
    let (start, n) = (160u32, 40u32);
    let req = AttnReq {
        seq: s,
        q_start: start,
        n_q: n,
    };
    let qp = rng.vec(n as usize * hq * d);
    let (mut plain, mut out) = (vec![0f32; qp.len()], vec![0f32; qp.len()]);
    c.prefill(0, &[req], &qp, &mut plain, &p, None).unwrap();
    c.prefill(0, &[req], &qp, &mut out, &pf, None).unwrap();
    assert_eq!(plain != out, used);
    let scale = 1.0 / (d as f32).sqrt();
    let round = |x: f32| {
        if !used {
            return x;
        }
        let u = x.to_bits();
        f32::from_bits(u.wrapping_add(0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
    };
    let qr: Vec<f32> = qp.iter().map(|&x| round(x * scale)).collect();
    for j in 0..n as usize {
        let (k, v) = c.gather(s, 0, 0, start + j as u32 + 1).unwrap();
        let kr: Vec<f32> = k.iter().map(|&x| round(x)).collect();
        let (w, _) = reference(&qr[j * hq * d..][..hq * d], &kr, &v, hq, h, d, 1.0, 0.0, 0);
        let vmax = v.iter().fold(0f64, |a, x| a.max(x.abs() as f64));
        let err = max_err(out[j * hq * d..][..hq * d].iter().zip(&w));
        let tol = if used { vmax / 128.0 } else { 1e-5 * vmax.max(1.0) };
        assert!(err <= tol, "f16_as_bf16 prefill {}: error {:e} over {:e}", j, err, tol);
    }
}

/// drop_front under a window of 24: the first 16 positions' block goes, decode over the rest
/// matches the reference, a read of the front and a decode without the window are EINVAL. In a
/// cache that indexes prefixes the dropped blocks stay indexed (CACHED): the same prompt is
/// matched whole and reads them back.
#[test]
fn drop_front_window() {
    let mut rng = Rng(11);
    let (h, d, hq) = (2usize, 64usize, 4usize);
    let mut conf = cfg(h as u32, d as u32, 32, Dtype::F32);
    conf.prefix_cache = false;
    let mut c = Cache::new(&conf).unwrap();
    let s = c.seq_create(b"").unwrap();
    fill(&mut c, s, 40, &mut rng);
    let (k, v) = c.gather(s, 0, 0, 40).unwrap();
    let active = c.stats().unwrap().n_active;
    c.drop_front(s, 40 - 24).unwrap();
    assert_eq!(c.seq_info(s).unwrap().n_dropped, 16);
    assert_eq!(c.stats().unwrap().n_active, active - 1);
    assert_eq!(c.block_table(s).unwrap()[0], -1);
    let q: Vec<f32> = rng.vec(hq * d);
    let p = AttnParams {
        n_q_heads: hq as u32,
        window: 24,
        ..AttnParams::default()
    };
    let mut out = vec![0f32; hq * d];
    c.decode(0, &[s], &q, &mut out, &p, None).unwrap();
    let (w, _) = reference(&q, &k, &v, hq, h, d, 1.0 / (d as f64).sqrt(), 0.0, 24);
    assert_close(&out, &w, 1e-5, "decode over a dropped front");
    let all = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    let e = c.decode(0, &[s], &q, &mut out, &all, None).unwrap_err();
    assert_eq!(e.code(), EINVAL);
    assert_eq!(c.gather(s, 0, 15, 1).unwrap_err().code(), EINVAL);
    let mut cp = Cache::new(&cfg(h as u32, d as u32, 32, Dtype::F32)).unwrap();
    let t = cp.seq_create(b"").unwrap();
    fill(&mut cp, t, 40, &mut rng);
    let (kp, vp) = cp.gather(t, 0, 0, 40).unwrap();
    cp.drop_front(t, 32).unwrap(); // blocks 0 and 1, indexed, held by t alone
    let st = cp.stats().unwrap();
    assert_eq!((st.n_cached, st.n_indexed), (2, 2));
    let toks: Vec<i32> = (0..40).map(|i| ((i * 7 + 100) % 500) as i32).collect(); // fill's
    let u = cp.seq_create(b"").unwrap();
    assert_eq!(cp.match_prefix(u, &toks).unwrap(), 39); // 2 blocks, then 7 of t's tail copied
    let (ku, vu) = cp.gather(u, 0, 0, 39).unwrap();
    assert_eq!(ku[..], kp[..ku.len()]);
    assert_eq!(vu[..], vp[..vu.len()]);
}

/// A dropped front's evicted block leaves a tombstone: `match_prefix` stops there,
/// `match_prefix_window` goes past it and takes only the blocks its window sees.
#[test]
fn match_prefix_window_tombstone() {
    let mut rng = Rng(12);
    let mut c = Cache::new(&cfg(2, 32, 8, Dtype::F32)).unwrap();
    let put = |c: &mut Cache, s: Seq, toks: &[i32], rng: &mut Rng| {
        let slots = c.append(s, toks).unwrap();
        let len = toks.len() * 2 * 32;
        let (k, v) = (rng.vec(len), rng.vec(len));
        c.write_kv(0, &slots, Some(KvData::F32(&k)), Some(KvData::F32(&v)))
            .unwrap();
        let t = c.seq_info(s).unwrap().n_tokens;
        c.commit(s, t).unwrap();
    };
    let toks: Vec<i32> = (0..64).map(|i| (i * 7 + 3) % 500).collect();
    let other: Vec<i32> = (0..80).map(|i| (i * 11 + 5) % 500).collect();
    let s = c.seq_create(b"").unwrap();
    put(&mut c, s, &toks, &mut rng); // blocks 0-3
    let (k, v) = c.gather(s, 0, 0, 64).unwrap();
    let f = c.fork(s).unwrap();
    c.truncate(f, 32).unwrap();
    c.drop_front(f, 16).unwrap(); // f keeps block 1
    c.drop_front(s, 16).unwrap(); // block 0: nobody's, block 1 in use below it
    let w = c.seq_create(b"").unwrap();
    put(&mut c, w, &other[..64], &mut rng); // the 4 free blocks
    assert_eq!(c.stats().unwrap().evictions, 0);
    put(&mut c, w, &other[64..], &mut rng); // block 0 evicted: a tombstone in its place
    let st = c.stats().unwrap();
    assert_eq!((st.evictions, st.n_tombstones, st.n_indexed), (1, 1, 8));
    c.check().unwrap();
    let t = c.seq_create(b"").unwrap();
    assert_eq!(c.match_prefix(t, &toks).unwrap(), 0);
    assert_eq!(c.match_prefix_window(t, &toks, 20).unwrap(), 63); // a query at 63 sees from 44
    assert_eq!(c.seq_info(t).unwrap().n_dropped, 32);
    assert_eq!(c.stats().unwrap().prefix_tomb_hits, 1);
    let (kt, vt) = c.gather(t, 0, 32, 31).unwrap();
    let row = 2 * 32;
    assert_eq!(kt[..], k[32 * row..63 * row]);
    assert_eq!(vt[..], v[32 * row..63 * row]);
    c.check().unwrap();
    let u = c.seq_create(b"").unwrap();
    assert_eq!(c.match_prefix_window(u, &toks, 0).unwrap_err().code(), EINVAL);
}

/// A dropped front is saved from the front on (the ids before it from the index), and
/// `tier_load_window` restores into an empty cache only what a window of 20 reads.
#[test]
fn tier_load_window() {
    let mut rng = Rng(13);
    let mut a = Cache::new(&cfg(2, 32, 8, Dtype::F32)).unwrap();
    let mut b = Cache::new(&cfg(2, 32, 8, Dtype::F32)).unwrap();
    let t = Tier::host(1 << 24).unwrap();
    let mut toks: Vec<i32> = (0..64).map(|i| (i * 7 + 3) % 500).collect();
    let s = a.seq_create(b"").unwrap();
    let slots = a.append(s, &toks).unwrap();
    let (k, v) = (rng.vec(64 * 2 * 32), rng.vec(64 * 2 * 32));
    a.write_kv(0, &slots, Some(KvData::F32(&k)), Some(KvData::F32(&v)))
        .unwrap();
    a.commit(s, 64).unwrap();
    a.drop_front(s, 45).unwrap(); // a query at 64 sees from 45: blocks 0-1 go
    assert_eq!(a.tier_save(&t, s).unwrap(), 2);
    toks.push(7);
    t.prefetch_start(1 << 22).unwrap(); // the window's blocks staged ahead of the load
    assert_eq!(t.prefetch_window(&b, b"", &toks, 0).unwrap_err().code(), EINVAL);
    t.prefetch_window(&b, b"", &toks, 20).unwrap();
    t.prefetch_wait().unwrap();
    assert_eq!(t.stats().unwrap().prefetched, 2);
    let u = b.seq_create(b"").unwrap();
    assert_eq!(b.tier_load_window(&t, u, &toks, 20).unwrap(), 64);
    assert_eq!(t.stats().unwrap().prefetch_hits, 2);
    assert_eq!(b.seq_info(u).unwrap().n_dropped, 32);
    let st = b.stats().unwrap();
    assert_eq!((st.n_tombstones, st.n_indexed), (2, 2));
    let (kb, vb) = b.gather(u, 0, 32, 32).unwrap();
    let row = 2 * 32;
    assert_eq!(kb[..], k[32 * row..64 * row]);
    assert_eq!(vb[..], v[32 * row..64 * row]);
    assert_eq!(t.stats().unwrap().loaded_tokens, 32);
    b.check().unwrap();
    let x = b.seq_create(b"").unwrap();
    assert_eq!(b.match_prefix_window(x, &toks, 20).unwrap(), 64); // b's pool has it now
    let y = b.seq_create(b"").unwrap();
    assert_eq!(b.tier_load_window(&t, y, &toks, 0).unwrap_err().code(), EINVAL);
    assert_eq!(b.seq_info(y).unwrap().n_tokens, 0);
}

/// An f32 cache of 2 kv heads of 64, one sequence of 40 random tokens in it, and their K and V
/// as gathered.
fn forty_tokens(rng: &mut Rng) -> (Cache, Seq, Vec<f32>, Vec<f32>) {
    let mut c = Cache::new(&cfg(2, 64, 32, Dtype::F32)).unwrap();
    let s = c.seq_create(b"").unwrap();
    fill(&mut c, s, 40, rng);
    let (k, v) = c.gather(s, 0, 0, 40).unwrap();
    (c, s, k, v)
}

#[test]
fn softcap_window_merge() {
    let mut rng = Rng(7);
    let (h, d, hq) = (2usize, 64usize, 4usize);
    let (mut c, s, k, v) = forty_tokens(&mut rng);
    let q: Vec<f32> = rng.vec(hq * d).iter().map(|x| 3.0 * x).collect();
    for (cap, win) in [(5.0f32, 0u32), (0.0, 7), (5.0, 7)] {
        let p = AttnParams {
            n_q_heads: hq as u32,
            scale: 0.2,
            softcap: cap,
            window: win,
            bf16_dot: false,
            sinks: None,
            alibi_slopes: None,
            attn_chunk: 0,
            noncausal: false,
            f16_as_bf16: false,
        };
        let (mut out, mut lse) = (vec![0f32; hq * d], vec![0f32; hq]);
        c.decode(0, &[s], &q, &mut out, &p, Some(&mut lse)).unwrap();
        let (w, wl) = reference(&q, &k, &v, hq, h, d, 0.2, cap as f64, win as usize);
        assert_close(&out, &w, 1e-5, &format!("softcap {} window {}", cap, win));
        assert_close(&lse, &wl, 1e-5, "lse");
    }
    // chunks of 16 (Llama 4's local attention): the query at 39 sees [32, 39], as a window of 8
    let pc = AttnParams {
        n_q_heads: hq as u32,
        scale: 0.2,
        attn_chunk: 16,
        ..AttnParams::default()
    };
    let (mut oc, mut lc) = (vec![0f32; hq * d], vec![0f32; hq]);
    c.decode(0, &[s], &q, &mut oc, &pc, Some(&mut lc)).unwrap();
    let (w, wl) = reference(&q, &k, &v, hq, h, d, 0.2, 0.0, 8);
    assert_close(&oc, &w, 1e-5, "chunks of 16");
    assert_close(&lc, &wl, 1e-5, "chunks of 16: lse");
    // non-causal: 3 queries of one request each over all 40 positions, as a decode's query sees
    let qn: Vec<f32> = rng.vec(3 * hq * d);
    let pn = AttnParams {
        n_q_heads: hq as u32,
        scale: 0.2,
        noncausal: true,
        ..AttnParams::default()
    };
    let (mut on, mut ln) = (vec![0f32; 3 * hq * d], vec![0f32; 3 * hq]);
    let req = AttnReq {
        seq: s,
        q_start: 0,
        n_q: 3,
    };
    c.prefill(0, &[req], &qn, &mut on, &pn, Some(&mut ln)).unwrap();
    for i in 0..3 {
        let qi = &qn[i * hq * d..(i + 1) * hq * d];
        let (w, wl) = reference(qi, &k, &v, hq, h, d, 0.2, 0.0, 0);
        assert_close(&on[i * hq * d..(i + 1) * hq * d], &w, 1e-5, "non-causal");
        assert_close(&ln[i * hq..(i + 1) * hq], &wl, 1e-5, "non-causal: lse");
    }
    let bad = AttnParams { window: 8, ..pn };
    assert_eq!(
        c.prefill(0, &[req], &qn, &mut on, &bad, None).unwrap_err().code(),
        EINVAL
    );
    // keys [0, 20) through a truncated fork, [20, 40) through a window of 20: merged, the whole
    let f = c.fork(s).unwrap();
    c.truncate(f, 20).unwrap();
    let p = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    let (mut oa, mut la, mut ob, mut lb, mut ow, mut lw) = (
        vec![0f32; hq * d],
        vec![0f32; hq],
        vec![0f32; hq * d],
        vec![0f32; hq],
        vec![0f32; hq * d],
        vec![0f32; hq],
    );
    c.decode(0, &[f], &q, &mut oa, &p, Some(&mut la)).unwrap();
    c.decode(0, &[s], &q, &mut ob, &AttnParams { window: 20, ..p }, Some(&mut lb))
        .unwrap();
    c.decode(0, &[s], &q, &mut ow, &p, Some(&mut lw)).unwrap();
    let (mut om, mut lm) = (vec![0f32; hq * d], vec![0f32; hq]);
    merge(d as u32, &oa, &la, &ob, &lb, &mut om, Some(&mut lm)).unwrap();
    assert_close(
        &om,
        &ow.iter().map(|x| *x as f64).collect::<Vec<_>>(),
        1e-5,
        "merged halves",
    );
    assert_close(
        &lm,
        &lw.iter().map(|x| *x as f64).collect::<Vec<_>>(),
        1e-5,
        "merged lse",
    );
    let (w, _) = reference(&q, &k[..20 * h * d], &v[..20 * h * d], hq, h, d, 1.0 / 8.0, 0.0, 0);
    assert_close(&oa, &w, 1e-5, "the fork truncated to 20");
}

/// Bits, to compare results exactly (NaN included).
fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Attention sinks: sinks of -1e30 give the same bits as none (decode and prefill); finite ones
/// give the result without them merged with a part of out 0 and lse sinks[h] (pkv.h), out and
/// lse; a sink that is not finite and a sinks slice of another length than n_q_heads are EINVAL.
#[test]
fn sinks_merge_as_a_key_of_value_zero() {
    let mut rng = Rng(0x5111c5);
    let (h, d, hq) = (2usize, 64usize, 8usize);
    let mut c = Cache::new(&cfg(h as u32, d as u32, 64, Dtype::F32)).unwrap();
    let lens = [1usize, 17, 40];
    let seqs: Vec<Seq> = lens.iter().map(|_| c.seq_create(b"").unwrap()).collect();
    for (s, &n) in seqs.iter().zip(&lens) {
        fill(&mut c, *s, n, &mut rng);
    }
    let q: Vec<f32> = rng.vec(seqs.len() * hq * d).iter().map(|x| 2.0 * x).collect();
    let reqs = [
        AttnReq {
            seq: seqs[2],
            q_start: 30,
            n_q: 10,
        },
        AttnReq {
            seq: seqs[0],
            q_start: 0,
            n_q: 1,
        },
        AttnReq {
            seq: seqs[1],
            q_start: 5,
            n_q: 4,
        },
    ];
    let qp = rng.vec(15 * hq * d);
    let far = vec![-1e30f32; hq];
    let finite: Vec<f32> = (0..hq).map(|_| 1.0 + rng.next()).collect(); // [-1, 3)
    assert!(finite.iter().all(|x| (-1.0..3.0).contains(x)));
    for (win, cap) in [(0u32, 0f32), (6, 0.0), (0, 4.0)] {
        let p = AttnParams {
            n_q_heads: hq as u32,
            softcap: cap,
            window: win,
            ..AttnParams::default()
        };
        let what = format!("window {} softcap {}", win, cap);
        // decode and prefill: without sinks, with far-below sinks (the same bits), with finite sinks
        let attn = |prefill: bool, sinks: Option<&[f32]>| {
            let (qq, rows) = if prefill { (&qp, 15) } else { (&q, seqs.len()) };
            let (mut out, mut lse) = (vec![0f32; rows * hq * d], vec![0f32; rows * hq]);
            let ps = AttnParams { sinks, ..p };
            if prefill {
                c.prefill(0, &reqs, qq, &mut out, &ps, Some(&mut lse)).unwrap();
            } else {
                c.decode(0, &seqs, qq, &mut out, &ps, Some(&mut lse)).unwrap();
            }
            (out, lse)
        };
        for prefill in [false, true] {
            let what = format!("{} {}", if prefill { "prefill" } else { "decode" }, what);
            let (o0, l0) = attn(prefill, None);
            let (of, lf) = attn(prefill, Some(&far));
            assert_eq!(bits(&of), bits(&o0), "{}: out with sinks -1e30", what);
            assert_eq!(bits(&lf), bits(&l0), "{}: lse with sinks -1e30", what);
            let (os, ls) = attn(prefill, Some(&finite));
            let rows = l0.len();
            let zeros = vec![0f32; rows * d];
            let lse_sink: Vec<f32> = (0..rows).map(|r| finite[r % hq]).collect();
            let (mut om, mut lm) = (vec![0f32; rows * d], vec![0f32; rows]);
            merge(d as u32, &o0, &l0, &zeros, &lse_sink, &mut om, Some(&mut lm)).unwrap();
            let wide = |x: &[f32]| x.iter().map(|v| *v as f64).collect::<Vec<_>>();
            assert_close(&os, &wide(&om), 1e-5, &format!("{}: out with sinks", what));
            assert_close(&ls, &wide(&lm), 1e-5, &format!("{}: lse with sinks", what));
            assert!(os != o0, "{}: sinks changed nothing", what);
            // the sink's term only adds to the sum: lse does not fall
            for r in 0..rows {
                assert!(ls[r] >= l0[r], "{}: row {}: lse {} under {}", what, r, ls[r], l0[r]);
            }
        }
    }
    // n_q_heads 0 is n_kv_heads: h sinks
    let p0 = AttnParams::default();
    let (mut o0, mut l0) = (vec![0f32; h * d], vec![0f32; h]);
    let (mut o1, mut l1) = (vec![0f32; h * d], vec![0f32; h]);
    c.decode(0, &seqs[2..], &q[..h * d], &mut o0, &p0, Some(&mut l0))
        .unwrap();
    let sinks_h = [-1e30f32; 2];
    let ps = AttnParams {
        sinks: Some(&sinks_h),
        ..p0
    };
    c.decode(0, &seqs[2..], &q[..h * d], &mut o1, &ps, Some(&mut l1))
        .unwrap();
    assert_eq!((bits(&o1), bits(&l1)), (bits(&o0), bits(&l0)), "n_q_heads 0, h sinks");
    // refusals: the wrong length (the binding's check, before libpkv reads past the slice), and a
    // sink that is not finite (libpkv's)
    let p = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    let mut out = vec![0f32; q.len()];
    let mut outp = vec![0f32; qp.len()];
    for n in [0usize, hq - 1, hq + 1] {
        let bad = vec![0f32; n];
        let pb = AttnParams { sinks: Some(&bad), ..p };
        let e = c.decode(0, &seqs, &q, &mut out, &pb, None).unwrap_err();
        assert_eq!(e.code(), EINVAL, "{} sinks", n);
        let want = format!("decode: sinks: {} elements, {} needed", n, hq);
        assert!(e.to_string().starts_with(&want), "{}", e);
        let e = c.prefill(0, &reqs, &qp, &mut outp, &pb, None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{} sinks, prefill", n);
        assert!(e.to_string().starts_with("prefill: sinks: "), "{}", e);
    }
    assert_eq!(
        c.decode(
            0,
            &seqs[2..],
            &q[..h * d],
            &mut o1,
            &AttnParams {
                sinks: Some(&finite),
                ..p0
            },
            None
        )
        .unwrap_err()
        .code(),
        EINVAL,
        "n_q_heads 0 with n_q_heads sinks"
    );
    for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut bad = finite.clone();
        bad[3] = x;
        let pb = AttnParams { sinks: Some(&bad), ..p };
        let e = c.decode(0, &seqs, &q, &mut out, &pb, None).unwrap_err();
        assert_eq!(e.code(), EINVAL, "sink {}", x);
        assert!(e.to_string().contains("sinks[3]"), "{}", e);
        let e = c.prefill(0, &reqs, &qp, &mut outp, &pb, None).unwrap_err();
        assert_eq!(e.code(), EINVAL, "sink {}, prefill", x);
    }
}

/// ALiBi: decode with slopes against a reference that adds slope x (k - p) after the soft-cap;
/// zero slopes give the same bits as none (no soft-cap); a slope that is NaN or past 65536 and a slice of
/// another length than n_q_heads are EINVAL.
#[test]
fn alibi_against_reference() {
    let mut rng = Rng(0xa11b1);
    let (h, d, hq) = (2usize, 64usize, 8usize);
    let mut c = Cache::new(&cfg(h as u32, d as u32, 64, Dtype::F32)).unwrap();
    let seqs: Vec<Seq> = [9usize, 40].iter().map(|_| c.seq_create(b"").unwrap()).collect();
    fill(&mut c, seqs[0], 9, &mut rng);
    fill(&mut c, seqs[1], 40, &mut rng);
    let q: Vec<f32> = rng.vec(seqs.len() * hq * d).iter().map(|x| 2.0 * x).collect();
    let slopes: Vec<f32> = (0..hq)
        .map(|i| (2f32).powf(-8.0 * (i + 1) as f32 / hq as f32))
        .collect();
    let (scale, cap) = (0.2f64, 4.0f64);
    let p = AttnParams {
        n_q_heads: hq as u32,
        scale: scale as f32,
        softcap: cap as f32,
        alibi_slopes: Some(&slopes),
        ..AttnParams::default()
    };
    let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; seqs.len() * hq]);
    c.decode(0, &seqs, &q, &mut out, &p, Some(&mut lse)).unwrap();
    for (i, s) in seqs.iter().enumerate() {
        let t = c.seq_info(*s).unwrap().n_tokens as usize;
        let (k, v) = c.gather(*s, 0, 0, t as u32).unwrap();
        let (mut wo, mut wl) = (vec![0f64; hq * d], vec![0f64; hq]);
        for qh in 0..hq {
            let kh = qh / (hq / h);
            let qr = &q[(i * hq + qh) * d..(i * hq + qh + 1) * d];
            let x: Vec<f64> = (0..t)
                .map(|pos| {
                    let dot: f64 = (0..d).map(|j| qr[j] as f64 * k[(pos * h + kh) * d + j] as f64).sum();
                    cap * (dot * scale / cap).tanh() + slopes[qh] as f64 * (pos as f64 - (t - 1) as f64)
                })
                .collect();
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = x.iter().map(|y| (y - m).exp()).sum();
            for (pos, y) in x.iter().enumerate() {
                for j in 0..d {
                    wo[qh * d + j] += (y - m).exp() / sum * v[(pos * h + kh) * d + j] as f64;
                }
            }
            wl[qh] = m + sum.ln();
        }
        assert_close(
            &out[i * hq * d..(i + 1) * hq * d],
            &wo,
            1e-5,
            &format!("ALiBi sequence {}", i),
        );
        assert_close(
            &lse[i * hq..(i + 1) * hq],
            &wl,
            1e-5,
            &format!("ALiBi lse sequence {}", i),
        );
    }
    let zeros = vec![0f32; hq];
    let (mut o0, mut o1) = (vec![0f32; q.len()], vec![0f32; q.len()]);
    // (without the soft-cap: with ALiBi the cap is taken by the bias pass, in other arithmetic)
    let pn = AttnParams {
        alibi_slopes: None,
        softcap: 0.0,
        ..p
    };
    c.decode(0, &seqs, &q, &mut o0, &pn, None).unwrap();
    let pz = AttnParams {
        alibi_slopes: Some(&zeros),
        ..pn
    };
    c.decode(0, &seqs, &q, &mut o1, &pz, None).unwrap();
    assert_eq!(bits(&o0), bits(&o1), "zero slopes");
    for bad in [
        vec![0.5f32; hq - 1],
        {
            let mut b = slopes.clone();
            b[2] = f32::NAN;
            b
        },
        {
            let mut b = slopes.clone();
            b[5] = 1e6;
            b
        },
    ] {
        let pb = AttnParams {
            alibi_slopes: Some(&bad),
            ..p
        };
        let e = c.decode(0, &seqs, &q, &mut out, &pb, None).unwrap_err();
        assert_eq!(e.code(), EINVAL, "{:?}", bad);
    }
}

#[test]
fn prefix_fork_cow_exports() {
    let mut rng = Rng(11);
    let mut c = Cache::new(&Config {
        n_threads: 1,
        ..cfg(2, 32, 32, Dtype::F32)
    })
    .unwrap();
    let a = c.seq_create(b"tenant-1").unwrap();
    fill(&mut c, a, 40, &mut rng);
    // blocks an append would take (16-token blocks, 8 tokens in a's tail)
    let counts: Vec<u32> = [0, 8, 9, 100].iter().map(|&n| c.append_blocks(a, n).unwrap()).collect();
    assert_eq!(counts, vec![0, 0, 1, 6]);
    assert_eq!(c.append_blocks(a, 32 * 16).unwrap_err().code(), ELIMIT);
    let toks: Vec<i32> = (0..40i32).map(|i| (i * 7 + 100) % 500).collect();
    let b = c.seq_create(b"tenant-1").unwrap();
    let reused = c.match_prefix(b, &toks).unwrap();
    assert!((32..40).contains(&reused), "reused {}", reused);
    assert_eq!(c.gather(a, 0, 0, reused).unwrap(), c.gather(b, 0, 0, reused).unwrap());
    let other = c.seq_create(b"tenant-2").unwrap();
    assert_eq!(c.match_prefix(other, &toks).unwrap(), 0);
    c.release(other).unwrap();
    // (the miss reasons are best effort, from fingerprint tables: design.md, Prefix caching)
    let st = c.stats().unwrap();
    assert_eq!(
        (
            st.prefix_lookups,
            st.prefix_tokens_hit,
            st.prefix_miss_namespace,
            st.n_indexed
        ),
        (2, reused as u64, 1, 2)
    );

    let child = c.fork(a).unwrap();
    assert_eq!(c.seq_info(child).unwrap().n_shared, 3);
    let slots = c.append(child, &[7]).unwrap(); // the shared tail block is copied first
    assert_eq!(c.stats().unwrap().cow_copies, st.cow_copies + 1);
    let k = rng.vec(2 * 32);
    c.write_kv(0, &slots, Some(KvData::F32(&k)), Some(KvData::F32(&k)))
        .unwrap();
    let (ta, tc) = (c.block_table(a).unwrap(), c.block_table(child).unwrap());
    assert_eq!(ta[..2], tc[..2]);
    assert_ne!(ta[2], tc[2]);
    let (kc, vc) = c.gather(child, 0, 0, 41).unwrap();
    assert_eq!(&kc[40 * 64..], &k[..]);
    assert_eq!(&kc[..40 * 64], &c.gather(a, 0, 0, 40).unwrap().0[..]);
    let q = rng.vec(4 * 32);
    let mut out = vec![0f32; 4 * 32];
    c.decode(
        0,
        &[child],
        &q,
        &mut out,
        &AttnParams {
            n_q_heads: 4,
            ..AttnParams::default()
        },
        None,
    )
    .unwrap();
    expect_attn(&out, &q, &kc, &vc, 4, 2, 32, "decode of the fork after CoW");

    let seqs = [a, b, child];
    let (tables, lens) = c.export_dense(&seqs, 8).unwrap();
    // wider than any table can be: refused before the tables are allocated (u32::MAX columns
    // would be 48 GiB here)
    let mbps = c.config().max_blocks_per_seq;
    assert_eq!(c.export_dense(&seqs, mbps).unwrap().0.len(), 3 * mbps as usize);
    for wide in [mbps + 1, u32::MAX] {
        assert_eq!(c.export_dense(&seqs, wide).unwrap_err().code(), EINVAL);
    }
    let (indptr, indices, last) = c.export_csr(&seqs).unwrap();
    for (i, &s) in seqs.iter().enumerate() {
        let t = c.block_table(s).unwrap();
        let n = c.seq_info(s).unwrap().n_tokens as i32;
        assert_eq!(lens[i], n);
        assert_eq!(&tables[i * 8..][..t.len()], &t[..]);
        assert!(tables[i * 8 + t.len()..(i + 1) * 8].iter().all(|&x| x == -1));
        assert_eq!(&indices[indptr[i] as usize..indptr[i + 1] as usize], &t[..]);
        assert_eq!(last[i], n - (t.len() as i32 - 1) * 16);
        let sl = c.slots(s, 0, n as u32).unwrap();
        for p in 0..n as usize {
            assert_eq!(sl[p], t[p / 16] * 16 + (p % 16) as i32);
        }
    }
    let pin = c.pin(a, 32).unwrap();
    for s in seqs {
        c.release(s).unwrap();
    }
    let st = c.stats().unwrap();
    assert_eq!((st.n_seqs, st.n_pins, st.n_active), (0, 1, 2));
    c.check().unwrap();
    c.pin_release(pin).unwrap();
    c.reset().unwrap();
    assert_eq!(c.stats().unwrap().n_free, 32);
    c.check().unwrap();
}

#[test]
fn compact_exchanges_cached_blocks() {
    let mut rng = Rng(6);
    let mut c = Cache::new(&Config {
        n_threads: 1,
        ..cfg(2, 32, 8, Dtype::F16)
    })
    .unwrap();
    // b under another salt: its block is not a duplicate of a's first, so it stays CACHED
    let (a, b) = (c.seq_create(b"").unwrap(), c.seq_create(b"b").unwrap());
    fill(&mut c, a, 16, &mut rng);
    fill(&mut c, b, 16, &mut rng);
    fill(&mut c, a, 20, &mut rng); // blocks 2 and 3
    assert_eq!(c.block_table(a).unwrap(), vec![0, 2, 3]);
    let before = c.gather(a, 0, 0, 36).unwrap();
    c.release(b).unwrap();
    let st = c.stats().unwrap();
    assert_eq!(st.n_cached, 1);
    assert_eq!(c.compact(a, false, false).unwrap(), 0); // 1 is CACHED
    assert_eq!(c.compact(a, false, true).unwrap(), 2); // 0 and 1 exchanged: two copies
    assert_eq!(c.block_table(a).unwrap(), vec![1, 2, 3]);
    let st2 = c.stats().unwrap();
    assert_eq!(
        (st.n_cached, st.n_free, st.n_indexed, st.evictions),
        (st2.n_cached, st2.n_free, st2.n_indexed, st2.evictions)
    );
    assert_eq!(c.gather(a, 0, 0, 36).unwrap(), before);
    c.check().unwrap();
}

/// batch_compact's cached flag: a and d interleave (blocks 0 2 and 1 3), b's two committed blocks
/// are CACHED (4 5), 6 7 FREE. Without it a takes the FREE 6 7 and d closes up to 1 2 (3 moves);
/// with it a takes the CACHED 4 5 by exchange and d exchanges 3 with the CACHED block now at 2
/// (6 copies), b's prefix then lying at 0 3, still matched, with its K/V.
#[test]
fn batch_compact_exchanges_cached_blocks() {
    for (cached, n_want, ta, td, tp) in [
        (false, 3u32, vec![6, 7], vec![1, 2], vec![4, 5]),
        (true, 6, vec![4, 5], vec![1, 2], vec![0, 3]),
    ] {
        let mut rng = Rng(12);
        let mut c = Cache::new(&Config {
            n_threads: 1,
            ..cfg(2, 32, 8, Dtype::F16)
        })
        .unwrap();
        let a = c.seq_create(b"a").unwrap();
        let d = c.seq_create(b"d").unwrap();
        let b = c.seq_create(b"b").unwrap();
        for s in [a, d, a, d] {
            fill(&mut c, s, 16, &mut rng);
        }
        fill(&mut c, b, 32, &mut rng);
        let (kva, kvb) = (c.gather(a, 0, 0, 32).unwrap(), c.gather(b, 0, 0, 32).unwrap());
        c.release(b).unwrap();
        let st = c.stats().unwrap();
        assert_eq!(
            c.batch_compact(&[a, d], 0, false, cached).unwrap(),
            n_want,
            "cached {}",
            cached
        );
        assert_eq!(c.block_table(a).unwrap(), ta, "cached {}", cached);
        assert_eq!(c.block_table(d).unwrap(), td, "cached {}", cached);
        let st2 = c.stats().unwrap();
        assert_eq!((st.n_cached, st.evictions), (st2.n_cached, st2.evictions));
        let m = c.seq_create(b"b").unwrap();
        let mut toks: Vec<i32> = (0..32).map(|i| (i * 7 + 100) % 500).collect();
        toks.push(1);
        assert_eq!(c.match_prefix(m, &toks).unwrap(), 32);
        assert_eq!(c.block_table(m).unwrap(), tp, "cached {}", cached);
        assert_eq!(c.gather(a, 0, 0, 32).unwrap(), kva);
        assert_eq!(c.gather(m, 0, 0, 32).unwrap(), kvb);
        c.check().unwrap();
    }
}

#[test]
fn compact_moves_runs_and_keeps_data() {
    let mut rng = Rng(5);
    let mut c = Cache::new(&Config {
        n_threads: 1,
        prefix_cache: false,
        ..cfg(2, 32, 8, Dtype::F16)
    })
    .unwrap();
    let (a, b) = (c.seq_create(b"").unwrap(), c.seq_create(b"").unwrap());
    fill(&mut c, a, 16, &mut rng);
    fill(&mut c, b, 16, &mut rng);
    fill(&mut c, a, 20, &mut rng); // blocks 2 and 3
    assert_eq!(c.block_table(a).unwrap(), vec![0, 2, 3]);
    let before = c.gather(a, 0, 0, 36).unwrap();
    let q = rng.vec(4 * 32);
    let p = AttnParams {
        n_q_heads: 4,
        ..AttnParams::default()
    };
    let (mut out0, mut out1) = (vec![0f32; 4 * 32], vec![0f32; 4 * 32]);
    c.decode(0, &[a], &q, &mut out0, &p, None).unwrap();
    assert_eq!(c.compact(a, false, false).unwrap(), 0); // block 1 is b's
    c.release(b).unwrap();
    let st = c.stats().unwrap();
    assert_eq!(c.compact(a, false, false).unwrap(), 1); // 0 moves to 1: one copy, where 2, 3 to 1, 2 is two
    assert_eq!(c.block_table(a).unwrap(), vec![1, 2, 3]);
    let st2 = c.stats().unwrap();
    assert_eq!(
        (st.n_free, st.n_active, st.n_slots_used),
        (st2.n_free, st2.n_active, st2.n_slots_used)
    );
    assert_eq!(c.gather(a, 0, 0, 36).unwrap(), before);
    c.decode(0, &[a], &q, &mut out1, &p, None).unwrap();
    assert_eq!(out0, out1);
    c.check().unwrap();
    assert_eq!(c.compact(b, true, false).unwrap_err().code(), ENOENT);
    // a full pool: the batch's blocks are exchanged into one run a sequence
    let d = c.seq_create(b"").unwrap();
    fill(&mut c, d, 80, &mut rng);
    assert_eq!(c.block_table(d).unwrap(), vec![4, 5, 6, 7, 0]);
    let (da, aa) = (c.gather(d, 0, 0, 80).unwrap(), c.gather(a, 0, 0, 36).unwrap());
    assert_eq!(c.batch_compact(&[d, a], 0, false, false).unwrap(), 0); // a is laid out; no stretch of 5 beside it
    assert_eq!(c.block_table(d).unwrap(), vec![4, 5, 6, 7, 0]);
    assert_eq!(c.batch_compact(&[d, a], 0, true, false).unwrap(), 8); // four exchanges
    assert_eq!(c.block_table(d).unwrap(), vec![0, 1, 2, 3, 4]);
    assert_eq!(c.block_table(a).unwrap(), vec![5, 6, 7]);
    assert_eq!(c.batch_compact(&[d, a], 0, false, true).unwrap(), 0); // laid out: kept
    assert_eq!(c.gather(d, 0, 0, 80).unwrap(), da);
    assert_eq!(c.gather(a, 0, 0, 36).unwrap(), aa);
    c.check().unwrap();
    assert_eq!(c.batch_compact(&[a, a], 0, true, false).unwrap_err().code(), EINVAL);
}

#[test]
fn statuses_and_length_checks() {
    let mut c = Cache::new(&Config {
        n_threads: 1,
        max_seqs: 2,
        max_blocks_per_seq: 8,
        ..cfg(1, 32, 4, Dtype::F16)
    })
    .unwrap();
    let s = c.seq_create(b"").unwrap();
    c.append(s, &[1, 2, 3]).unwrap();
    c.release(s).unwrap();
    assert_eq!(c.seq_info(s).unwrap_err().code(), ENOENT);
    assert_eq!(c.append(s, &[1]).unwrap_err().kind(), ErrorKind::NotFound);
    let (x, y) = (c.seq_create(b"").unwrap(), c.seq_create(b"").unwrap());
    assert_eq!(c.seq_create(b"").unwrap_err().kind(), ErrorKind::Limit);
    // a handle of another cache, at a slot that is live here: refused, not another sequence's
    let mut other = Cache::new(c.config()).unwrap();
    let o = other.seq_create(b"").unwrap();
    assert_eq!(o.0 & 0xffff_ffff, x.0 & 0xffff_ffff);
    assert_eq!(c.seq_info(o).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(c.append(o, &[1]).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(c.release(o).unwrap_err().kind(), ErrorKind::NotFound);
    drop(other);
    // libpkv says why a call refused (pkv.h); the Error carries it, each thread its own
    let e = c.seq_info(s).unwrap_err();
    assert!(
        e.to_string().starts_with(&format!(
            "pkv_seq_get_info: sequence {:#x} is unknown: never made, released, or another cache's",
            s.0
        )),
        "{}",
        e
    );
    std::thread::scope(|sc| {
        let c = &c;
        let a = sc.spawn(move || {
            (0..100)
                .map(|_| c.seq_info(Seq(s.0 + 5)).unwrap_err().to_string())
                .collect::<Vec<_>>()
        });
        let b = sc.spawn(move || {
            (0..100)
                .map(|_| c.seq_info(s).unwrap_err().to_string())
                .collect::<Vec<_>>()
        });
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        assert!(
            a.iter().all(|m| m.contains(&format!("{:#x} is unknown", s.0 + 5))),
            "{:?}",
            a[0]
        );
        assert!(
            b.iter().all(|m| m.contains(&format!("{:#x} is unknown", s.0))),
            "{:?}",
            b[0]
        );
    });
    let full = c.append(x, &[0; 80]).unwrap_err();
    assert_eq!((full.code(), full.kind()), (ENOSPC, ErrorKind::NoSpace));
    assert!(
        full.to_string()
            .contains("80 positions need 5 blocks, 4 FREE and 0 CACHED are left"),
        "{}",
        full
    );
    assert_eq!(c.seq_info(x).unwrap().n_tokens, 0);
    let slots = c.append(y, &[1, 2, 3, 4]).unwrap();
    let ones = vec![1f32; 4 * 32];
    c.write_kv(0, &slots, Some(KvData::F32(&ones)), Some(KvData::F32(&ones)))
        .unwrap();
    let p = AttnParams::default();
    let mut q = vec![1f32; 32];
    let mut out = vec![0f32; 32];
    q[5] = f32::NAN;
    assert_eq!(c.decode(0, &[y], &q, &mut out, &p, None).unwrap_err().code(), EINVAL); // the library's check
    q[5] = 1.0;
    assert_eq!(c.decode(1, &[y], &q, &mut out, &p, None).unwrap_err().code(), EINVAL); // layer out of range
    let mut bad = ones.clone();
    bad[40] = f32::INFINITY;
    assert_eq!(
        c.write_kv(0, &slots, Some(KvData::F32(&bad)), None).unwrap_err().code(),
        EINVAL
    );
    assert!(c.gather(y, 0, 0, 4).unwrap().0.iter().all(|&x| x == 1.0)); // nothing written
                                                                        // refused by the binding before libpkv sees the slices
    let short = vec![1f32; 31];
    let mut lse = vec![0f32; 2];
    let h16 = vec![0u16; 4 * 32];
    let refused: Vec<Result<()>> = vec![
        c.decode(0, &[y], &short, &mut out, &p, None),
        c.decode(0, &[y], &q, &mut out[..31], &p, None),
        c.decode(0, &[y, y], &q, &mut out, &p, None),
        c.decode(0, &[y], &q, &mut out, &p, Some(&mut lse)),
        c.prefill(
            0,
            &[AttnReq {
                seq: y,
                q_start: 0,
                n_q: 2,
            }],
            &q,
            &mut out,
            &p,
            None,
        ),
        merge(32, &q, &[0.0], &short, &[0.0], &mut out, None),
        merge(0, &q, &[0.0], &q, &[0.0], &mut out, None),
        // rows x heads x head_dim past usize: an error, not a panic (debug) or a wrapped length
        c.prefill(
            0,
            &vec![
                AttnReq {
                    seq: y,
                    q_start: 0,
                    n_q: u32::MAX,
                };
                1025
            ],
            &q,
            &mut out,
            &AttnParams {
                n_q_heads: 1 << 31,
                ..AttnParams::default()
            },
            None,
        ),
    ];
    for (i, r) in refused.into_iter().enumerate() {
        assert_eq!(r.unwrap_err().code(), EINVAL, "case {}", i);
    }
    let refused_mut = [
        c.write_kv(0, &slots, Some(KvData::F32(&short)), None),
        c.write_kv(0, &slots, Some(KvData::F32(&ones)), Some(KvData::F16(&h16))),
        c.write_kv(0, &slots, None, None),
        c.write_kv(0, &slots[..3], Some(KvData::Bf16(&h16)), None),
    ];
    for (i, r) in refused_mut.iter().enumerate() {
        assert_eq!(r.as_ref().unwrap_err().code(), EINVAL, "write case {}", i);
    }
    // ranges past the sequence: refused before an output of n rows is allocated
    for (start, n) in [(0, u32::MAX), (u32::MAX, 1), (3, 2), (5, 0)] {
        assert_eq!(
            c.gather(y, 0, start, n).unwrap_err().code(),
            EINVAL,
            "gather {} {}",
            start,
            n
        );
        assert_eq!(
            c.slots(y, start, n).unwrap_err().code(),
            EINVAL,
            "slots {} {}",
            start,
            n
        );
    }
    assert_eq!(c.gather(x, 0, 0, u32::MAX).unwrap_err().code(), EINVAL); // an empty sequence
    assert_eq!(c.gather(s, 0, 0, 1).unwrap_err().code(), ENOENT); // a released one
    assert_eq!(c.gather(y, 0, 4, 0).unwrap().0.len(), 0);
    assert_eq!(c.slots(y, 1, 3).unwrap(), slots[1..].to_vec());
    c.check().unwrap();
}

#[test]
fn decodes_from_several_threads() {
    let mut rng = Rng(99);
    let mut c = Cache::new(&cfg(2, 32, 256, Dtype::F32)).unwrap();
    let seqs: Vec<Seq> = (0..8).map(|_| c.seq_create(b"").unwrap()).collect();
    for (i, &s) in seqs.iter().enumerate() {
        fill(&mut c, s, 10 + 37 * i, &mut rng);
    }
    let p = AttnParams {
        n_q_heads: 4,
        ..AttnParams::default()
    };
    let qs: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(8 * 4 * 32)).collect();
    let c = &c; // shared: decode takes &self
    let seqs = &seqs;
    std::thread::scope(|sc| {
        for q in &qs {
            sc.spawn(move || {
                for _ in 0..20 {
                    let mut out = vec![0f32; q.len()];
                    c.decode(0, seqs, q, &mut out, &p, None).unwrap();
                    for (i, &s) in seqs.iter().enumerate() {
                        let n = c.seq_info(s).unwrap().n_tokens;
                        let (k, v) = c.gather(s, 0, 0, n).unwrap();
                        expect_attn(
                            &out[i * 128..][..128],
                            &q[i * 128..][..128],
                            &k,
                            &v,
                            4,
                            2,
                            32,
                            "a thread's decode",
                        );
                    }
                }
            });
        }
    });
    c.check().unwrap();
}

#[test]
fn value_max_is_the_write_limit() {
    // in a pool that holds it (f32): PKV_VALUE_MAX is taken, the next float refused
    let mut c = Cache::new(&cfg(1, 32, 4, Dtype::F32)).unwrap();
    let s = c.seq_create(b"").unwrap();
    let slots = c.append(s, &[1, 2]).unwrap();
    let mut big = vec![1f32; 2 * 32];
    big[40] = VALUE_MAX as f32;
    c.write_kv(0, &slots, Some(KvData::F32(&big)), Some(KvData::F32(&big)))
        .unwrap();
    assert_eq!(c.gather(s, 0, 0, 2).unwrap().0[40] as f64, VALUE_MAX);
    big[40] = f32::from_bits((VALUE_MAX as f32).to_bits() + 1);
    let err = c.write_kv(0, &slots, Some(KvData::F32(&big)), None).unwrap_err();
    assert_eq!(err.code(), EINVAL);
    assert_eq!(c.gather(s, 0, 0, 2).unwrap().0[40] as f64, VALUE_MAX); // nothing written
}

#[test]
fn into_forms_and_writes_beside_attention() {
    let mut rng = Rng(7);
    let mut c = Cache::new(&Config {
        n_layers: 2,
        ..cfg(2, 32, 64, Dtype::F32)
    })
    .unwrap();
    let s = c.seq_create(b"").unwrap();
    // the _into forms against the Vec forms, and their buffers' lengths
    let toks: Vec<i32> = (0..40).collect();
    let mut slots = vec![0i32; 40];
    assert_eq!(c.append_into(s, &toks, &mut slots[..39]).unwrap_err().code(), EINVAL);
    assert_eq!(c.seq_info(s).unwrap().n_tokens, 0); // nothing appended
    c.append_into(s, &toks, &mut slots).unwrap();
    assert_eq!(c.slots(s, 0, 40).unwrap(), slots);
    let mut part = vec![0i32; 10];
    c.slots_into(s, 30, &mut part).unwrap();
    assert_eq!(part, slots[30..]);
    assert_eq!(c.slots_into(s, 31, &mut part).unwrap_err().code(), EINVAL); // past the length
    let table = c.block_table(s).unwrap();
    let bt = c.config().block_tokens as usize;
    assert_eq!(table.len(), (40 + bt - 1) / bt);
    let mut t = vec![-1i32; table.len() + 2];
    assert_eq!(c.block_table_into(s, &mut t).unwrap(), table.len());
    assert_eq!(t[..table.len()], table[..]);
    assert_eq!(t[table.len()..], [-1, -1]);
    let short = c.block_table_into(s, &mut t[..table.len() - 1]).unwrap_err();
    assert_eq!(short.code(), EINVAL);
    assert!(
        short.to_string().contains(&format!("the table {}", table.len())),
        "{}",
        short
    );

    let row = 2 * 32;
    let kv: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(40 * row)).collect(); // K, V of layer 0, then 1
    c.write_kv(0, &slots, Some(KvData::F32(&kv[0])), Some(KvData::F32(&kv[1])))
        .unwrap();
    // layer 1 written through &self while other threads decode layer 0 (committed after: a
    // committed position's rows are read-only)
    let p = AttnParams {
        n_q_heads: 4,
        ..AttnParams::default()
    };
    let q = rng.vec(4 * 32);
    let (cs, kv, slots) = (&c, &kv, &slots);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| {
                let mut out = vec![0f32; q.len()];
                for _ in 0..50 {
                    cs.decode(0, &[s], &q, &mut out, &p, None).unwrap();
                    expect_attn(&out, &q, &kv[0], &kv[1], 4, 2, 32, "layer 0 beside layer 1's writes");
                }
            });
        }
        sc.spawn(|| {
            for round in 0..50 {
                let at = (round * 7) % 40; // every slot, in two calls a round
                for (a, b) in [(at, 40), (0, at)] {
                    let (k, v) = (&kv[2][a * row..b * row], &kv[3][a * row..b * row]);
                    // SAFETY: nothing reads or writes layer 1 while these run
                    unsafe { cs.write_kv_shared(1, &slots[a..b], Some(KvData::F32(k)), Some(KvData::F32(v))) }.unwrap();
                }
            }
        });
    });
    c.commit(s, 40).unwrap();
    let mut out = vec![0f32; q.len()];
    c.decode(1, &[s], &q, &mut out, &p, None).unwrap();
    expect_attn(&out, &q, &kv[2], &kv[3], 4, 2, 32, "layer 1 after the shared writes");
    let (mut k, mut v) = (vec![0f32; 5 * row], vec![0f32; 5 * row]);
    c.gather_into(s, 1, 35, Some(&mut k), Some(&mut v)).unwrap();
    assert_eq!((&k[..], &v[..]), (&kv[2][35 * row..], &kv[3][35 * row..]));
    c.gather_into(s, 0, 35, None, Some(&mut v)).unwrap();
    assert_eq!(v, kv[1][35 * row..]);
    assert_eq!(c.gather_into(s, 1, 36, Some(&mut k), None).unwrap_err().code(), EINVAL); // past the length
    assert_eq!(
        c.gather_into(s, 1, 0, Some(&mut k[..row + 1]), None)
            .unwrap_err()
            .code(),
        EINVAL
    );
    assert_eq!(
        c.gather_into(s, 1, 0, Some(&mut k), Some(&mut v[..row]))
            .unwrap_err()
            .code(),
        EINVAL
    );
    assert_eq!(c.gather_into(s, 1, 0, None, None).unwrap_err().code(), EINVAL);
    c.check().unwrap();
}

#[test]
fn batch_append_all_none_or_a_leading_run() {
    // 6 blocks of 16: a holds 20 positions (2 blocks), b 16 (1): 3 FREE
    let mut c = Cache::new(&Config {
        block_tokens: 16,
        ..cfg(1, 32, 6, Dtype::F32)
    })
    .unwrap();
    let (a, b, d) = (
        c.seq_create(b"").unwrap(),
        c.seq_create(b"").unwrap(),
        c.seq_create(b"").unwrap(),
    );
    let toks: Vec<i32> = (0..40).collect();
    c.append(a, &toks[..20]).unwrap();
    c.append(b, &toks[..16]).unwrap();
    let (mut sa, mut sb) = ([0i32; 2], [0i32; 3]);
    let mut reqs = [
        AppendReq {
            seq: a,
            tokens: &toks[..2],
            slots: Some(&mut sa),
        },
        AppendReq {
            seq: b,
            tokens: &toks[..3],
            slots: Some(&mut sb),
        },
        AppendReq {
            seq: d,
            tokens: &[],
            slots: None,
        },
    ];
    assert_eq!(c.batch_append(&mut reqs, false).unwrap(), 3);
    assert_eq!(sa.to_vec(), c.slots(a, 20, 2).unwrap()); // a's tail had room
    assert_eq!(sb.to_vec(), c.slots(b, 16, 3).unwrap());
    assert_eq!(c.stats().unwrap().n_free, 2);
    // 2 FREE: b + 20 takes 1, d + 40 takes 3: all or none, none
    let before = (c.stats().unwrap(), c.seq_info(b).unwrap(), c.seq_info(d).unwrap());
    let mut two = [
        AppendReq {
            seq: b,
            tokens: &toks[..20],
            slots: None,
        },
        AppendReq {
            seq: d,
            tokens: &toks[..40],
            slots: None,
        },
    ];
    let e = c.batch_append(&mut two, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace);
    assert_eq!(
        before,
        (c.stats().unwrap(), c.seq_info(b).unwrap(), c.seq_info(d).unwrap())
    );
    // first come, first served: b's fits, d's does not
    assert_eq!(c.batch_append(&mut two, true).unwrap(), 1);
    assert_eq!(
        (c.seq_info(b).unwrap().n_tokens, c.seq_info(d).unwrap().n_tokens),
        (39, 0)
    );
    assert_eq!(c.batch_append(&mut [], true).unwrap(), 0);
    // refused, changing nothing: a sequence named twice, slots of the wrong length
    let mut short = [0i32; 1];
    for mut bad in [
        vec![
            AppendReq {
                seq: a,
                tokens: &toks[..1],
                slots: None,
            },
            AppendReq {
                seq: a,
                tokens: &toks[..1],
                slots: None,
            },
        ],
        vec![AppendReq {
            seq: a,
            tokens: &toks[..2],
            slots: Some(&mut short),
        }],
    ] {
        let e = c.batch_append(&mut bad, false).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
    assert_eq!(c.seq_info(a).unwrap().n_tokens, 22);
    c.check().unwrap();
}

#[test]
fn write_kv_seq_by_position() {
    // fragmented tables (a and b appended in turns): by position == by slot, byte for byte
    let mut c = Cache::new(&Config {
        block_tokens: 4,
        n_layers: 2,
        ..cfg(2, 32, 12, Dtype::F16)
    })
    .unwrap();
    let (a, b) = (c.seq_create(b"").unwrap(), c.seq_create(b"").unwrap());
    let toks: Vec<i32> = (0..12).collect();
    for _ in 0..4 {
        c.append(a, &toks[..3]).unwrap();
        c.append(b, &toks[..2]).unwrap();
    }
    let mut rng = Rng(77);
    let row = 2 * 32;
    let (k, v) = (rng.vec(12 * row), rng.vec(12 * row));
    c.write_kv_seq(a, 1, 0, Some(KvData::F32(&k)), Some(KvData::F32(&v)))
        .unwrap();
    let sb = c.slots(b, 0, 8).unwrap();
    c.write_kv(
        1,
        &sb,
        Some(KvData::F32(&k[..8 * row])),
        Some(KvData::F32(&v[..8 * row])),
    )
    .unwrap();
    let (ka, va) = c.gather(a, 1, 0, 8).unwrap();
    assert_eq!((ka, va), c.gather(b, 1, 0, 8).unwrap());
    // V only, f16 bits, positions 9..11: K stays, V is 1.0 there
    let (k_all, v_all) = c.gather(a, 1, 0, 12).unwrap();
    let h16 = vec![0x3c00u16; 3 * row]; // 1.0
    c.write_kv_seq(a, 1, 9, None, Some(KvData::F16(&h16))).unwrap();
    let (k2, v2) = c.gather(a, 1, 0, 12).unwrap();
    assert_eq!(k2, k_all);
    assert_eq!(&v2[..9 * row], &v_all[..9 * row]);
    assert!(v2[9 * row..].iter().all(|&x| x == 1.0));
    // refusals change nothing
    // layer 0 defined: the refusals below must leave it
    c.write_kv_seq(a, 0, 0, Some(KvData::F32(&v)), Some(KvData::F32(&k)))
        .unwrap();
    c.commit(a, 4).unwrap();
    let before = c.gather(a, 0, 0, 12).unwrap();
    let one = vec![0.5f32; row];
    let two = vec![0.5f32; 2 * row];
    let cases: Vec<(Result<()>, i32)> = vec![
        (c.write_kv_seq(a, 0, 3, Some(KvData::F32(&two)), None), EINVAL), // position 3 committed
        (c.write_kv_seq(a, 0, 11, Some(KvData::F32(&two)), None), EINVAL), // past the length
        (c.write_kv_seq(a, 2, 4, Some(KvData::F32(&one)), None), EINVAL), // layer 2 of 2
        (c.write_kv_seq(a, 0, 4, None, None), EINVAL),
        (c.write_kv_seq(a, 0, 4, Some(KvData::F32(&one[1..])), None), EINVAL), // not whole rows
        (
            c.write_kv_seq(a, 0, 4, Some(KvData::F32(&one)), Some(KvData::F32(&two))),
            EINVAL,
        ),
        (
            c.write_kv_seq(a, 0, 4, Some(KvData::F32(&one)), Some(KvData::F16(&h16[..row]))),
            EINVAL,
        ),
    ];
    for (i, (r, want)) in cases.into_iter().enumerate() {
        assert_eq!(r.unwrap_err().code(), want, "case {}", i);
    }
    assert_eq!(before, c.gather(a, 0, 0, 12).unwrap());
    let d = c.fork(a).unwrap();
    let e = c.write_kv_seq(d, 0, 6, Some(KvData::F32(&one)), None).unwrap_err();
    assert!(
        e.to_string()
            .contains("pkv_seq_write_kv: position 6 (row 0) is in block"),
        "{}",
        e
    );
    c.release(d).unwrap();
    let e = c.write_kv_seq(d, 0, 0, Some(KvData::F32(&one)), None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    c.check().unwrap();
}

#[test]
fn stored_rows_move_a_sequence() {
    // a sequence moved to another cache through its stored rows: bit for bit, mixed dtypes
    let pairs = [
        (Dtype::F32, Dtype::F16),
        (Dtype::Bf16, Dtype::Q8_0),
        (Dtype::Q4_0, Dtype::Fp8E4m3),
    ];
    let mut rng = Rng(91);
    for (kd, vd) in pairs {
        let conf = |n_blocks| Config {
            block_tokens: 4,
            n_layers: 2,
            v_dtype: vd,
            ..cfg(2, 32, n_blocks, kd)
        };
        let mut a = Cache::new(&conf(8)).unwrap();
        let mut b = Cache::new(&conf(16)).unwrap();
        let sa = a.seq_create(b"").unwrap();
        let (sb, filler) = (b.seq_create(b"").unwrap(), b.seq_create(b"").unwrap());
        let toks: Vec<i32> = (0..10).collect();
        a.append(sa, &toks).unwrap();
        for i in 0..3 {
            b.append(sb, &toks[4 * i..(4 * i + 4).min(10)]).unwrap();
            b.append(filler, &toks[..4]).unwrap();
        }
        let row = 2 * 32;
        let (kb, vb) = (2 * kd.row_bytes(32), 2 * vd.row_bytes(32));
        for layer in 0..2 {
            let (k, v) = (rng.vec(10 * row), rng.vec(10 * row));
            a.write_kv_seq(sa, layer, 0, Some(KvData::F32(&k)), Some(KvData::F32(&v)))
                .unwrap();
            let (ks, vs) = a.read_stored(sa, layer, 0, 10).unwrap();
            assert_eq!((ks.len(), vs.len()), (10 * kb, 10 * vb));
            b.write_stored(sb, layer, 0, Some(&ks[..6 * kb]), None).unwrap();
            b.write_stored(sb, layer, 0, None, Some(&vs[..6 * vb])).unwrap();
            b.write_stored(sb, layer, 6, Some(&ks[6 * kb..]), Some(&vs[6 * vb..]))
                .unwrap();
            assert_eq!(b.read_stored(sb, layer, 0, 10).unwrap(), (ks.clone(), vs.clone()));
            assert_eq!(b.gather(sb, layer, 0, 10).unwrap(), a.gather(sa, layer, 0, 10).unwrap());
            assert_eq!(b.read_stored(sb, layer, 3, 2).unwrap().0, ks[3 * kb..5 * kb].to_vec());
            let mut vpart = vec![0u8; 3 * vb]; // into the caller's buffer: V alone, 3 positions
            b.read_stored_into(sb, layer, 4, None, Some(&mut vpart)).unwrap();
            assert_eq!(vpart, vs[4 * vb..7 * vb].to_vec());
            let mut odd = vec![0u8; vb + 1];
            let e = b.read_stored_into(sb, layer, 0, None, Some(&mut odd)).unwrap_err();
            assert_eq!(e.code(), EINVAL); // not whole positions
            assert!(b.read_stored_into(sb, layer, 0, None, None).is_err());
        }
        b.commit(sb, 8).unwrap();
        let before = b.read_stored(sb, 0, 0, 10).unwrap();
        let (ks, vs) = before.clone();
        let mut spoiled = ks[..kb].to_vec();
        match kd {
            Dtype::F32 => spoiled[4 * 3..4 * 4].copy_from_slice(&f32::NAN.to_ne_bytes()),
            Dtype::Bf16 => spoiled[2 * 5..2 * 6].copy_from_slice(&0x7fc0u16.to_ne_bytes()),
            _ => spoiled[..2].copy_from_slice(&0x7c00u16.to_ne_bytes()), // q4_0: an infinite scale
        }
        let cases: Vec<(Result<()>, i32)> = vec![
            (b.write_stored(sb, 0, 9, Some(&spoiled), None), EINVAL),
            (b.write_stored(sb, 0, 7, Some(&ks[..2 * kb]), None), EINVAL), // position 7 committed
            (b.write_stored(sb, 0, 9, Some(&ks[..2 * kb]), None), EINVAL), // past the length
            (b.write_stored(sb, 2, 9, Some(&ks[..kb]), None), EINVAL),     // layer 2 of 2
            (b.write_stored(sb, 0, 9, None, None), EINVAL),
            (b.write_stored(sb, 0, 9, Some(&ks[..kb - 1]), None), EINVAL), // not whole positions
            (b.write_stored(sb, 0, 9, Some(&ks[..kb]), Some(&vs[..2 * vb])), EINVAL),
        ];
        for (i, (r, want)) in cases.into_iter().enumerate() {
            assert_eq!(r.unwrap_err().code(), want, "{:?}/{:?} case {}", kd, vd, i);
        }
        assert_eq!(before, b.read_stored(sb, 0, 0, 10).unwrap());
        b.check().unwrap();
    }
}

/// Positions [0, 40) of x's sequence xs and y's ys hold the same stored rows, both layers.
fn same_stored(x: &Cache, xs: Seq, y: &Cache, ys: Seq) {
    for layer in 0..2 {
        assert_eq!(
            x.read_stored(xs, layer, 0, 40).unwrap(),
            y.read_stored(ys, layer, 0, 40).unwrap()
        );
    }
}

/// The tier tests' shape: 2 layers, 2 kv heads x 32, blocks of 8, f16 K and q8_0 V.
fn tier_conf(n_blocks: u32) -> Config {
    Config {
        block_tokens: 8,
        n_layers: 2,
        v_dtype: Dtype::Q8_0,
        prefix_cache: true,
        ..cfg(2, 32, n_blocks, Dtype::F16)
    }
}

/// A cache of 16 blocks holding a 45-token prompt (first..first + 45) in namespace salt, its
/// K/V random from seed and committed: the sequence and the prompt.
fn tier_source(salt: &[u8], first: i32, seed: u64) -> (Cache, Seq, Vec<i32>) {
    let mut rng = Rng(seed);
    let mut a = Cache::new(&tier_conf(16)).unwrap();
    let prompt: Vec<i32> = (first..first + 45).collect();
    let sa = a.seq_create(salt).unwrap();
    a.append(sa, &prompt).unwrap();
    for layer in 0..2 {
        let (k, v) = (rng.vec(45 * 64), rng.vec(45 * 64));
        a.write_kv_seq(sa, layer, 0, Some(KvData::F32(&k)), Some(KvData::F32(&v)))
            .unwrap();
    }
    a.commit(sa, 45).unwrap();
    (a, sa, prompt)
}

#[test]
fn tiers_move_prefix_blocks() {
    // a prompt's blocks saved from one cache into host and file tiers and loaded into another,
    // byte for byte; another namespace misses; refusals
    let (a, sa, prompt) = tier_source(b"ten", 300, 17);
    let mut b = Cache::new(&tier_conf(40)).unwrap();
    let dir = std::env::temp_dir().join(format!("pkv-rust-tier-{}", std::process::id()));
    let host = Tier::host(1 << 24).unwrap();
    let file = Tier::file(&dir, 1 << 24).unwrap();
    for t in [&host, &file] {
        assert_eq!(a.tier_save(t, sa).unwrap(), 5);
        assert_eq!(a.tier_save(t, sa).unwrap(), 0);
        let st = t.stats().unwrap();
        assert_eq!((st.entries, st.saved, st.save_present), (5, 5, 5));
        let mut c = Cache::new(&tier_conf(40)).unwrap();
        let sc = c.seq_create(b"ten").unwrap();
        assert_eq!(c.match_prefix(sc, &prompt).unwrap(), 0);
        assert_eq!(c.tier_load(t, sc, &prompt).unwrap(), 40);
        same_stored(&c, sc, &a, sa);
        let other = c.seq_create(b"other").unwrap();
        assert_eq!(c.tier_load(t, other, &prompt).unwrap(), 0);
        assert_eq!(t.stats().unwrap().load_misses, 1);
    }
    let sb = b.seq_create(b"ten").unwrap();
    b.append(sb, &prompt[..3]).unwrap();
    let e = b.tier_load(&host, sb, &prompt).unwrap_err(); // uncommitted positions
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(b.tier_save(&host, Seq(12345)).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(Tier::host(0).err().unwrap().kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        Tier::file(std::path::Path::new("/nonexistent-pkv/a/b"), 1 << 20)
            .err()
            .unwrap()
            .kind(),
        ErrorKind::Io
    );
    let r = Tier::redis("127.0.0.1", 1, None, 100).err().unwrap().kind(); // nothing listens there
    assert!(r == ErrorKind::Io || r == ErrorKind::NotSupported);
    assert_eq!(
        Tier::redis("a\0b", 6379, None, 0).err().unwrap().kind(),
        ErrorKind::InvalidArgument
    );
    drop(file);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tier_prefetch_stages_a_prompt() {
    // tests/test_tier.c test_prefetch, its first part, on a file tier: a prompt saved from one
    // cache is prefetched for another, staged, and loaded from staging byte for byte; refusals
    let (a, sa, prompt) = tier_source(b"ns", 500, 29);
    let dir = std::env::temp_dir().join(format!("pkv-rust-prefetch-{}", std::process::id()));
    let t = Tier::file(&dir, 1 << 24).unwrap();
    assert_eq!(a.tier_save(&t, sa).unwrap(), 5);
    let mut b = Cache::new(&tier_conf(60)).unwrap();
    // not started: refused
    let kind = |r: Result<()>| r.unwrap_err().kind();
    assert_eq!(kind(t.prefetch(&b, b"ns", &prompt)), ErrorKind::InvalidArgument);
    assert_eq!(kind(t.prefetch_wait()), ErrorKind::InvalidArgument);
    assert_eq!(kind(t.prefetch_start(0)), ErrorKind::InvalidArgument);
    t.prefetch_start(1 << 24).unwrap();
    assert_eq!(kind(t.prefetch_start(1 << 24)), ErrorKind::InvalidArgument); // once
    assert_eq!(kind(t.prefetch(&b, &[0u8; 257], &prompt)), ErrorKind::InvalidArgument);
    t.prefetch(&b, b"ns", &prompt[..7]).unwrap(); // no full block: nothing to do
    t.prefetch(&b, b"ns", &[]).unwrap();
    // staged: every full block
    t.prefetch(&b, b"ns", &prompt).unwrap();
    t.prefetch_wait().unwrap();
    let st = t.stats().unwrap();
    assert_eq!((st.prefetched, st.staged_entries, st.prefetch_hits), (5, 5, 0));
    assert!(st.staged_bytes > 0 && st.staged_bytes % 5 == 0, "{:?}", st);
    t.prefetch(&b, b"ns", &prompt).unwrap(); // staged already: kept, not fetched again
    t.prefetch_wait().unwrap();
    assert_eq!(t.stats().unwrap(), st);
    let held = st.staged_bytes;
    // the load takes them from staging
    let sb = b.seq_create(b"ns").unwrap();
    assert_eq!(b.match_prefix(sb, &prompt).unwrap(), 0);
    assert_eq!(b.tier_load(&t, sb, &prompt).unwrap(), 40);
    let st = t.stats().unwrap();
    assert_eq!((st.prefetch_hits, st.loaded_blocks, st.load_misses), (5, 5, 0));
    // none staged; their buffers kept for the next fetches, within the staging bytes
    assert_eq!((st.staged_entries, st.staged_bytes), (0, held));
    same_stored(&b, sb, &a, sa);
    // another namespace: the first block is missing, nothing staged
    t.prefetch(&b, b"other", &prompt).unwrap();
    t.prefetch_wait().unwrap();
    let st = t.stats().unwrap();
    assert_eq!((st.prefetched, st.staged_entries), (5, 0));
    // queued prefetches for a cache dropped before they run; the tier dropped with staged entries
    let c = Cache::new(&tier_conf(60)).unwrap();
    t.prefetch(&c, b"ns", &prompt).unwrap();
    drop(c);
    t.prefetch_wait().unwrap();
    assert_eq!(t.stats().unwrap().staged_entries, 5);
    b.check().unwrap();
    drop(t);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tier_write_back() {
    // tests/test_tier.c test_write_back, on a file tier: a save's puts left to the tier's thread,
    // the sequence released before they run; flush waits for them; refusals
    let (mut a, sa, prompt) = tier_source(b"wb", 700, 31);
    let dir = std::env::temp_dir().join(format!("pkv-rust-write-back-{}", std::process::id()));
    let t = Tier::file(&dir, 1 << 24).unwrap();
    // not started: refused
    let host = Tier::host(1 << 24).unwrap();
    let e = a.tier_save_async(&host, sa).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(host.flush().unwrap_err().kind(), ErrorKind::InvalidArgument);
    t.prefetch_start(1 << 24).unwrap();
    assert_eq!(
        a.tier_save_async(&t, Seq(12345)).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // queued: the sequence may go before the puts run
    let s2 = a.fork(sa).unwrap();
    assert_eq!(a.tier_save_async(&t, s2).unwrap(), 5);
    a.release(s2).unwrap();
    t.flush().unwrap();
    let st = t.stats().unwrap();
    assert_eq!((st.saved, st.save_present, st.errors), (5, 0, 0));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 5);
    // they load as a synchronous save's do
    let mut b = Cache::new(&tier_conf(60)).unwrap();
    let sb = b.seq_create(b"wb").unwrap();
    assert_eq!(b.tier_load(&t, sb, &prompt).unwrap(), 40);
    same_stored(&b, sb, &a, sa);
    // again: the thread finds them there
    assert_eq!(a.tier_save_async(&t, sa).unwrap(), 5);
    t.flush().unwrap();
    let st = t.stats().unwrap();
    assert_eq!((st.saved, st.save_present), (5, 5));
    // nothing queued
    t.flush().unwrap();
    // puts that fail (the directory gone): the flush says so, once
    let (c, sc, _) = tier_source(b"wb2", 700, 37);
    let gone = std::env::temp_dir().join(format!("pkv-rust-write-back-gone-{}", std::process::id()));
    let t2 = Tier::file(&gone, 1 << 24).unwrap();
    t2.prefetch_start(1 << 24).unwrap();
    std::fs::remove_dir_all(&gone).unwrap();
    assert_eq!(c.tier_save_async(&t2, sc).unwrap(), 5);
    assert_eq!(t2.flush().unwrap_err().kind(), ErrorKind::Io);
    t2.flush().unwrap();
    let st = t2.stats().unwrap();
    assert_eq!((st.saved, st.errors), (0, 5), "{:?}", st);
    drop(t2);
    // queued at drop: put first
    assert_eq!(c.tier_save_async(&t, sc).unwrap(), 5);
    drop(t);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 10);
    a.check().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn media_tokens_key_images() {
    // an image's positions keyed by its content: the C library's ids (pinned in
    // tests/test_prefix.c), piece by piece the same, and a prompt with another image matches
    // only the text before it
    assert_eq!(
        media_tokens(b"pagedkv", 0, 3).unwrap(),
        [-1780325367, -650806929, -969049132]
    );
    assert_eq!(media_tokens(b"pagedkv", u32::MAX, 1).unwrap(), [-49490191]);
    let a = media_tokens(b"digest of image a", 0, 40).unwrap();
    let b = media_tokens(b"digest of image b", 0, 40).unwrap();
    assert!(a.iter().all(|&x| x < 0));
    assert_eq!(a.iter().zip(&b).filter(|(x, y)| x == y).count(), 0);
    let mut pieces = media_tokens(b"digest of image a", 0, 15).unwrap();
    pieces.extend(media_tokens(b"digest of image a", 15, 25).unwrap());
    assert_eq!(pieces, a);
    assert_eq!(media_tokens(b"x", 0, 0).unwrap(), []);
    let prompt = |img: &[i32]| -> Vec<i32> { (100..120).chain(img.iter().copied()).chain(200..212).collect() };
    let (pa, pb) = (prompt(&a), prompt(&b));
    let mut c = Cache::new(&Config {
        n_kv_heads: 1,
        head_dim: 8,
        block_tokens: 16,
        n_blocks: 16,
        n_threads: 1,
        ..Config::default()
    })
    .unwrap();
    let s = c.seq_create(b"").unwrap();
    c.append(s, &pa).unwrap();
    c.commit(s, pa.len() as u32).unwrap();
    let t = c.seq_create(b"").unwrap();
    assert_eq!(c.match_prefix(t, &pb).unwrap(), 20); // the text before the image only
    let u = c.seq_create(b"").unwrap();
    assert_eq!(c.match_prefix(u, &pa).unwrap(), pa.len() as u32 - 1); // the same image: all
    c.check().unwrap();
    for (id, off, n) in [(&b""[..], 0, 4), (&b"x"[..], u32::MAX, 2)] {
        let e = media_tokens(id, off, n).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{:?} {} {}", id, off, n);
    }
}

#[test]
fn prefix_index_events() {
    // a router's view of a cache: the events name the blocks by the hashes prefix_hashes
    // computes from the prompt, with no cache; eviction removes them leaf first; a snapshot
    // gives the same; a reset says cleared; a full ring says overflow
    let b = 4u32;
    let prompt: Vec<i32> = (1000..1010).collect();
    let mut c = Cache::new(&Config {
        n_kv_heads: 1,
        head_dim: 8,
        block_tokens: b,
        n_blocks: 4,
        n_threads: 1,
        event_capacity: 16,
        ..Config::default()
    })
    .unwrap();
    assert_eq!(c.config().event_capacity, 16);
    let h = prefix_hashes(b"t", b, &prompt).unwrap();
    assert_eq!(h.len(), 2);
    assert_ne!(h, prefix_hashes(b"", b, &prompt).unwrap()); // another namespace
    let s = c.seq_create(b"t").unwrap();
    c.append(s, &prompt).unwrap();
    c.commit(s, 10).unwrap();
    let ev = c.take_events(1024, true).unwrap();
    assert_eq!(
        ev.iter().map(|e| e.kind).collect::<Vec<_>>(),
        [EventKind::Stored, EventKind::Stored]
    );
    assert_eq!(ev.iter().map(|e| e.hash).collect::<Vec<_>>(), h);
    assert_eq!(ev.iter().map(|e| e.parent_hash).collect::<Vec<_>>(), [0, h[0]]);
    assert_eq!(ev.iter().map(|e| e.depth).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(ev.iter().map(|e| e.seqno).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(ev.iter().map(|e| e.lost).collect::<Vec<_>>(), [0, 0]);
    assert_eq!(ev[0].tokens.as_deref(), Some(&prompt[0..4]));
    assert_eq!(ev[1].tokens.as_deref(), Some(&prompt[4..8]));
    let table = c.block_table(s).unwrap();
    assert_eq!((ev[0].block as i32, ev[1].block as i32), (table[0], table[1]));
    assert!(c.take_events(1024, false).unwrap().is_empty());
    let snap = c.prefix_snapshot(false).unwrap();
    assert_eq!(
        snap.iter()
            .map(|e| (e.kind, e.hash, e.parent_hash, e.seqno, e.tokens.clone()))
            .collect::<Vec<_>>(),
        [
            (EventKind::Stored, h[0], 0, 0, None),
            (EventKind::Stored, h[1], h[0], 0, None)
        ]
    );
    let snap = c.prefix_snapshot(true).unwrap();
    assert_eq!(snap[1].tokens.as_deref(), Some(&prompt[4..8]));
    c.release(s).unwrap();
    let s2 = c.seq_create(b"").unwrap();
    c.append(s2, &(0..16).collect::<Vec<i32>>()).unwrap(); // all 4 blocks: both cached ones evicted, the leaf first
    let ev = c.take_events(1024, false).unwrap();
    assert_eq!(
        ev.iter().map(|e| (e.kind, e.hash)).collect::<Vec<_>>(),
        [(EventKind::Removed, h[1]), (EventKind::Removed, h[0])]
    );
    assert_eq!(ev[0].tokens, None);
    assert_eq!(c.take_events(1024, false).unwrap(), []);
    c.commit(s2, 16).unwrap();
    assert_eq!(c.take_events(3, false).unwrap().len(), 3);
    assert_eq!(c.take_events(1024, false).unwrap().len(), 1);
    assert_eq!(c.take_events(0, false).unwrap(), []);
    c.reset().unwrap();
    let ev = c.take_events(1024, true).unwrap();
    assert_eq!(
        ev.iter()
            .map(|e| (e.kind, e.hash, e.tokens.clone()))
            .collect::<Vec<_>>(),
        [(EventKind::Cleared, 0, None)]
    );
    for _ in 0..5 {
        // 20 events for a ring of 16
        let s = c.seq_create(b"").unwrap();
        c.append(s, &(0..16).collect::<Vec<i32>>()).unwrap();
        c.commit(s, 16).unwrap();
        c.release(s).unwrap();
        c.reset().unwrap();
    }
    // seqno 9 was the last taken; 10-25 filled the ring, 26 found it full
    let ev = c.take_events(usize::MAX, false).unwrap();
    assert_eq!((ev[0].kind, ev[0].seqno, ev[0].lost), (EventKind::Overflow, 26, 17));
    assert_eq!(
        ev[1..].iter().map(|e| e.seqno).collect::<Vec<_>>(),
        (27..35).collect::<Vec<u64>>()
    );
    assert_eq!(c.prefix_snapshot(true).unwrap(), []);
    c.check().unwrap();

    // event_capacity 0: nothing recorded; a snapshot works all the same
    let mut c = Cache::new(&Config {
        n_blocks: 8,
        n_threads: 1,
        ..Config::default()
    })
    .unwrap();
    assert_eq!(c.config().event_capacity, 0);
    let e = c.take_events(1024, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("event_capacity 0"), "{}", e);
    let s = c.seq_create(b"").unwrap();
    c.append(s, &(0..40).collect::<Vec<i32>>()).unwrap();
    c.commit(s, 40).unwrap();
    let snap = c.prefix_snapshot(false).unwrap();
    assert_eq!(snap.len(), 2);
    assert_eq!(
        snap.iter().map(|e| e.hash).collect::<Vec<_>>(),
        prefix_hashes(b"", 16, &(0..40).collect::<Vec<i32>>()).unwrap()
    );

    // prefix_hashes' refusals
    for bt in [0, 1025] {
        let e = prefix_hashes(b"", bt, &[1, 2]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "block_tokens {}", bt);
    }
    assert_eq!(
        prefix_hashes(&[7u8; 257], 2, &[1, 2]).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(prefix_hashes(&[7u8; 256], 2, &[1, 2, 3]).unwrap().len(), 1);
    assert_eq!(prefix_hashes(b"", 16, &[]).unwrap(), []);
}

/// The float64 reference of node `i` of a tree whose nodes are at positions [q_start, ..) of K, V
/// (`[T][h][d]`, gathered): its keys are the prefix [0, q_start) and its path, root first, in
/// text order (the path's nodes at q_start + depth), so `reference`'s window counts back from
/// the node's own position q_start + depth(i), as pkv_attn_tree's does.
#[allow(clippy::too_many_arguments)]
fn tree_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (hq, h, d): (usize, usize, usize),
    q_start: usize,
    parent: &[i32],
    i: usize,
    (scale, cap, window): (f64, f64, usize),
) -> (Vec<f64>, Vec<f64>) {
    let mut path = Vec::new();
    let mut j = i as i32;
    while j >= 0 {
        assert!(j < parent.len() as i32 && parent[j as usize] < j, "not a tree");
        path.push(q_start + j as usize);
        j = parent[j as usize];
    }
    path.reverse();
    let keys: Vec<usize> = (0..q_start).chain(path).collect();
    let row = h * d;
    let pick = |x: &[f32]| -> Vec<f32> { keys.iter().flat_map(|&p| x[p * row..][..row].iter().copied()).collect() };
    reference(q, &pick(k), &pick(v), hq, h, d, scale, cap, window)
}

/// Tree attention (pkv_attn_tree) against the float64 reference over each node's keys (a prefix
/// of 37 tokens and a tree of 9 nodes with branches and two roots, beside a request of another
/// sequence and an empty one; GQA; window, soft-cap, scale, sinks, lse); a chain against prefill;
/// the refusals, which write nothing; then keep (pkv_seq_keep) of the accepted path: the length
/// start + 3 and the K/V of start + idx[k] at start + k, and a keep that is refused changes
/// nothing.
#[test]
fn tree_attention_and_keep() {
    let mut rng = Rng(0x7ee5eed);
    let (h, d, hq) = (2usize, 32usize, 4usize);
    let dims = (hq, h, d);
    let row = hq * d;
    let mut c = Cache::new(&cfg(h as u32, d as u32, 64, Dtype::F32)).unwrap();
    let (s, s2) = (c.seq_create(b"").unwrap(), c.seq_create(b"").unwrap());
    const P: usize = 37; // the prefix, committed
    const P2: usize = 20;
    fill(&mut c, s, P, &mut rng);
    fill(&mut c, s2, P2, &mut rng);
    // the trees: s's 9 nodes at 37 .. 45, roots 0 and 4, branches at 0 (1, 2) and 2 (5, ...);
    // s2's 3 at 20 .. 22
    let parent: [i32; 9] = [-1, 0, 0, 1, -1, 2, 4, 3, 5];
    let parent2: [i32; 3] = [-1, 0, 0];
    for (seq, n) in [(s, parent.len()), (s2, parent2.len())] {
        let start = c.seq_info(seq).unwrap().n_tokens;
        c.append(seq, &(0..n as i32).map(|i| 900 + i).collect::<Vec<i32>>())
            .unwrap();
        let (k, v) = (rng.vec(n * h * d), rng.vec(n * h * d));
        c.write_kv_seq(seq, 0, start, Some(KvData::F32(&k)), Some(KvData::F32(&v)))
            .unwrap();
    }
    let len = P + parent.len();
    let (k, v) = c.gather(s, 0, 0, len as u32).unwrap();
    let (k2, v2) = c.gather(s2, 0, 0, (P2 + parent2.len()) as u32).unwrap();
    let reqs = [
        TreeReq {
            seq: s,
            q_start: P as u32,
            parent: &parent,
        },
        TreeReq {
            seq: s2,
            q_start: 5,
            parent: &[],
        },
        TreeReq {
            seq: s2,
            q_start: P2 as u32,
            parent: &parent2,
        },
    ];
    let rows = parent.len() + parent2.len();
    let q = rng.vec(rows * row);
    let sinks: Vec<f32> = (0..hq).map(|_| 1.0 + rng.next()).collect();
    for (scale, cap, window, with_sinks) in [
        (0f32, 0f32, 0u32, false),
        (0.0, 0.0, 3, false),
        (0.3, 6.0, 0, false),
        (0.0, 0.0, 38, true),
        (0.0, 0.0, 0, true),
    ] {
        let what = format!(
            "tree scale {} softcap {} window {} sinks {}",
            scale, cap, window, with_sinks
        );
        let p = AttnParams {
            n_q_heads: hq as u32,
            scale,
            softcap: cap,
            window,
            sinks: if with_sinks { Some(&sinks) } else { None },
            ..AttnParams::default()
        };
        let (mut out, mut lse) = (vec![0f32; rows * row], vec![0f32; rows * hq]);
        c.tree(0, &reqs, &q, &mut out, &p, Some(&mut lse)).unwrap();
        let sc = if scale > 0.0 {
            scale as f64
        } else {
            1.0 / (d as f64).sqrt()
        };
        let mut at = 0;
        for (par, q0, kk, vv) in [(&parent[..], P, &k, &v), (&parent2[..], P2, &k2, &v2)] {
            for i in 0..par.len() {
                let (mut w, mut wl) = tree_reference(
                    &q[at * row..][..row],
                    kk,
                    vv,
                    dims,
                    q0,
                    par,
                    i,
                    (sc, cap as f64, window as usize),
                );
                if with_sinks {
                    // one more key of logit sinks[h] and value 0: out scaled by e^lse / (e^lse +
                    // e^sink), lse the log of that sum
                    for (hh, l) in wl.iter_mut().enumerate() {
                        let m = l.max(sinks[hh] as f64);
                        let l2 = m + ((*l - m).exp() + (sinks[hh] as f64 - m).exp()).ln();
                        w[hh * d..][..d].iter_mut().for_each(|x| *x *= (*l - l2).exp());
                        *l = l2;
                    }
                }
                let node = format!("{}: node {} at {}", what, i, q0 + i);
                assert_close(&out[at * row..][..row], &w, 1e-5, &node);
                assert_close(&lse[at * hq..][..hq], &wl, 1e-5, &format!("{} lse", node));
                at += 1;
            }
        }
    }

    // a chain is what prefill gives over the same positions
    let chain: Vec<i32> = (-1..parent.len() as i32 - 1).collect();
    let p = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    let n = parent.len();
    let (mut ot, mut lt) = (vec![0f32; n * row], vec![0f32; n * hq]);
    let (mut op, mut lp) = (vec![0f32; n * row], vec![0f32; n * hq]);
    let cr = [TreeReq {
        seq: s,
        q_start: P as u32,
        parent: &chain,
    }];
    c.tree(0, &cr, &q[..n * row], &mut ot, &p, Some(&mut lt)).unwrap();
    let pr = [AttnReq {
        seq: s,
        q_start: P as u32,
        n_q: n as u32,
    }];
    c.prefill(0, &pr, &q[..n * row], &mut op, &p, Some(&mut lp)).unwrap();
    let f64s = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<f64>>();
    assert_close(&ot, &f64s(&op), 1e-5, "chain against prefill");
    assert_close(&lt, &f64s(&lp), 1e-5, "chain against prefill: lse");

    // refusals: EINVAL (ENOENT for a stale sequence), out untouched. out as q cannot be written in
    // safe Rust (q is borrowed shared, out mutably), so that refusal of libpkv's is not reachable.
    let qn = &q[..n * row];
    let mut out = vec![7f32; n * row];
    let mut lse = vec![7f32; n * hq];
    let tree1 = |c: &Cache, par: &[i32], q_start: u32, out: &mut [f32], lse: &mut [f32]| {
        let r = [TreeReq {
            seq: s,
            q_start,
            parent: par,
        }];
        c.tree(0, &r, qn, out, &p, Some(lse)).unwrap_err()
    };
    for (i, bad) in [(3usize, 3i32), (3, 5), (3, -2), (8, 8), (0, 0)] {
        let mut par = parent;
        par[i] = bad;
        let e = tree1(&c, &par, P as u32, &mut out, &mut lse);
        assert_eq!(e.code(), EINVAL, "parent[{}] = {}: {}", i, bad, e);
        assert!(e.to_string().starts_with("pkv_attn_tree: "), "{}", e);
        assert!(
            e.to_string()
                .contains(&format!("node {}'s parent {} is not in", i, bad)),
            "{}",
            e
        );
    }
    let e = tree1(&c, &parent, P as u32 + 1, &mut out, &mut lse); // nodes at 38 .. 46: past the length
    assert_eq!(e.code(), EINVAL, "{}", e);
    assert!(e.to_string().contains("past the sequence's length 46"), "{}", e);
    assert!(out.iter().chain(&lse).all(|&x| x == 7.0), "a refusal wrote out or lse");
    // more than TREE_MAX_NODES nodes (all roots)
    let many = vec![-1i32; TREE_MAX_NODES as usize + 1];
    let r = [TreeReq {
        seq: s,
        q_start: 0,
        parent: &many,
    }];
    let qm = vec![0.5f32; many.len() * row];
    let mut om = vec![0f32; many.len() * row];
    let e = c.tree(0, &r, &qm, &mut om, &p, None).unwrap_err();
    assert_eq!(e.code(), EINVAL, "{}", e);
    assert!(e.to_string().contains("PKV_TREE_MAX_NODES"), "{}", e);
    // the binding's own length checks: q, out, lse, sinks for the nodes' count
    let r = [TreeReq {
        seq: s,
        q_start: P as u32,
        parent: &parent,
    }];
    let e = c.tree(0, &r, &q[..n * row - 1], &mut out, &p, None).unwrap_err();
    assert!(e.code() == EINVAL && e.to_string().starts_with("tree: q: "), "{}", e);
    let e = c.tree(0, &r, qn, &mut out[..n * row - 1], &p, None).unwrap_err();
    assert!(e.code() == EINVAL && e.to_string().starts_with("tree: out: "), "{}", e);
    let e = c
        .tree(0, &r, qn, &mut out, &p, Some(&mut lse[..n * hq - 1]))
        .unwrap_err();
    assert!(e.code() == EINVAL && e.to_string().starts_with("tree: lse: "), "{}", e);
    let e = c
        .tree(
            0,
            &r,
            qn,
            &mut out,
            &AttnParams {
                sinks: Some(&sinks[1..]),
                ..p
            },
            None,
        )
        .unwrap_err();
    assert!(
        e.code() == EINVAL && e.to_string().starts_with("tree: sinks: "),
        "{}",
        e
    );
    assert!(out.iter().chain(&lse).all(|&x| x == 7.0), "a refusal wrote out or lse");
    // a stale sequence
    let gone = c.seq_create(b"").unwrap();
    c.release(gone).unwrap();
    let r = [TreeReq {
        seq: gone,
        q_start: 0,
        parent: &[],
    }];
    assert_eq!(c.tree(0, &r, &[], &mut [], &p, None).unwrap_err().code(), ENOENT);
    // no requests: nothing to do
    c.tree(0, &[], &[], &mut [], &p, None).unwrap();

    // keep: refusals first, each changing nothing
    let same = |c: &Cache| {
        let info = c.seq_info(s).unwrap();
        assert_eq!((info.n_tokens, info.n_committed), (len as u32, P as u32));
        let (k1, v1) = c.gather(s, 0, 0, len as u32).unwrap();
        assert!(k1 == k && v1 == v, "a refused keep changed K/V");
    };
    for (start, idx) in [
        (P as u32, &[0u32, 2, 2][..]),  // not strictly ascending
        (P as u32, &[2, 0, 5][..]),     // descending
        (P as u32, &[0, 2, 9][..]),     // past the length
        (P as u32 - 1, &[0, 2, 5][..]), // a committed position
    ] {
        let e = c.keep(s, start, idx).unwrap_err();
        assert_eq!(e.code(), EINVAL, "keep({}, {:?}): {}", start, idx, e);
        assert!(e.to_string().starts_with("pkv_seq_keep: "), "{}", e);
        same(&c);
    }
    assert_eq!(c.keep(gone, P as u32, &[0]).unwrap_err().code(), ENOENT);
    same(&c);
    // the accepted path 0 -> 2 -> 5
    let idx = [0u32, 2, 5];
    c.keep(s, P as u32, &idx).unwrap();
    let info = c.seq_info(s).unwrap();
    assert_eq!((info.n_tokens, info.n_committed), ((P + idx.len()) as u32, P as u32));
    let (k1, v1) = c.gather(s, 0, 0, info.n_tokens).unwrap();
    let kv = h * d;
    assert!(
        k1[..P * kv] == k[..P * kv] && v1[..P * kv] == v[..P * kv],
        "keep changed the prefix"
    );
    for (j, &i) in idx.iter().enumerate() {
        let (at, from) = ((P + j) * kv, (P + i as usize) * kv);
        assert!(
            k1[at..][..kv] == k[from..][..kv] && v1[at..][..kv] == v[from..][..kv],
            "position {}: not what position {} held",
            P + j,
            P + i as usize
        );
    }
    // the sequence reads as one written with the path: decode at its last position
    let qd = rng.vec(row);
    let mut od = vec![0f32; row];
    c.decode(0, &[s], &qd, &mut od, &p, None).unwrap();
    expect_attn(&od, &qd, &k1, &v1, hq, h, d, "decode after keep");
    // an empty idx truncates to start
    c.keep(s, P as u32 + 1, &[]).unwrap();
    assert_eq!(c.seq_info(s).unwrap().n_tokens, P as u32 + 1);
    c.check().unwrap();
}

/// Forks of a 560-token prompt decoded together read their 35 shared blocks once for all three
/// (`attn_shared_keys`: 2 x 560 positions, past the default 512); each output and lse is the one
/// decoded alone, which shares nothing.
#[test]
fn shared_prefix_decode() {
    let mut rng = Rng(7);
    let (d, hq) = (64usize, 8usize);
    let mut c = Cache::new(&cfg(2, d as u32, 64, Dtype::F32)).unwrap();
    let s = c.seq_create(b"").unwrap();
    for _ in 0..35 {
        fill(&mut c, s, 16, &mut rng);
    }
    let mut seqs = vec![s];
    for _ in 0..2 {
        seqs.push(c.fork(s).unwrap());
    }
    for &x in &seqs {
        fill(&mut c, x, 1, &mut rng);
    }
    let q = rng.vec(3 * hq * d);
    let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; 3 * hq]);
    let p = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    c.decode(0, &seqs, &q, &mut out, &p, Some(&mut lse)).unwrap();
    let shared = c.stats().unwrap().attn_shared_keys;
    assert_eq!(shared, 2 * 560);
    for (i, &x) in seqs.iter().enumerate() {
        let (mut o1, mut l1) = (vec![0f32; hq * d], vec![0f32; hq]);
        c.decode(0, &[x], &q[i * hq * d..][..hq * d], &mut o1, &p, Some(&mut l1))
            .unwrap();
        let w: Vec<f64> = o1.iter().map(|&v| v as f64).collect();
        let wl: Vec<f64> = l1.iter().map(|&v| v as f64).collect();
        assert_close(&out[i * hq * d..][..hq * d], &w, 1e-5, "shared-prefix decode");
        assert_close(&lse[i * hq..][..hq], &wl, 1e-5, "shared-prefix lse");
    }
    assert_eq!(c.stats().unwrap().attn_shared_keys, shared);
}

/// pkv_attn_prefill_masked: an extend of 30 queries from 10 over 40 positions, causal with a
/// bidirectional span [20, 32), one row empty, beside a request left causal; each query against
/// the reference over the keys its row sets; pack_mask's bit order; a short mask, a count of
/// masks other than the requests' and a window with a mask are EINVAL, out untouched.
#[test]
fn prefill_masked_against_reference() {
    let mut rng = Rng(11);
    let (h, d, hq) = (2usize, 64usize, 4usize);
    let (c, s, k, v) = forty_tokens(&mut rng);
    assert_eq!(
        pack_mask(&[true, false, false, true, false, false, false, false, true]),
        vec![9u8, 1]
    );
    let (q0, nq, kv) = (10usize, 30usize, 40usize);
    let mut want = vec![false; nq * kv];
    for j in 0..nq {
        let p = q0 + j;
        for t in 0..kv {
            let span = (20..32).contains(&p) && (20..32).contains(&t);
            want[j * kv + t] = j != 7 && (t <= p || span);
        }
    }
    let mask = pack_mask(&want);
    let reqs = [
        AttnReq {
            seq: s,
            q_start: q0 as u32,
            n_q: nq as u32,
        },
        AttnReq {
            seq: s,
            q_start: 30,
            n_q: 5,
        },
    ];
    let q: Vec<f32> = rng.vec((nq + 5) * hq * d);
    let p = AttnParams {
        n_q_heads: hq as u32,
        ..AttnParams::default()
    };
    let mut out = vec![0f32; (nq + 5) * hq * d];
    c.prefill_masked(0, &reqs, &[Some(&mask), None], &q, &mut out, &p, None)
        .unwrap();
    for j in 0..nq + 5 {
        let (qj, oj) = (&q[j * hq * d..(j + 1) * hq * d], &out[j * hq * d..(j + 1) * hq * d]);
        let seen: Vec<usize> = if j < nq {
            (0..kv).filter(|&t| want[j * kv + t]).collect()
        } else {
            (0..=30 + j - nq).collect() // the causal request
        };
        if seen.is_empty() {
            assert!(oj.iter().all(|&x| x == 0.0), "an empty row gives 0");
            continue;
        }
        let pick = |x: &[f32]| -> Vec<f32> {
            seen.iter()
                .flat_map(|&t| x[t * h * d..(t + 1) * h * d].to_vec())
                .collect()
        };
        expect_attn(oj, qj, &pick(&k), &pick(&v), hq, h, d, &format!("masked query {}", j));
    }
    let keep = out.clone();
    let short = &mask[..mask.len() - 1];
    let wp = AttnParams { window: 8, ..p };
    for (m, pp) in [([Some(short), None], &p), ([Some(&mask[..]), None], &wp)] {
        assert_eq!(
            c.prefill_masked(0, &reqs, &m, &q, &mut out, pp, None)
                .unwrap_err()
                .code(),
            EINVAL
        );
    }
    assert_eq!(
        c.prefill_masked(0, &reqs, &[None], &q, &mut out, &p, None)
            .unwrap_err()
            .code(),
        EINVAL
    );
    assert_eq!(bits(&out), bits(&keep));
}

/// Context shift (pkv_seq_shift): K written as RoPE(raw, position) (the test's own RoPE, float64),
/// 9 positions removed after 4 kept: each K row reads RoPE(raw, its new position), V moved bit for
/// bit; without a rope rows move as stored; refusals.
#[test]
fn shift_turns_k_back() {
    let mut rng = Rng(0x5e1f7);
    let (h, d) = (2usize, 32usize);
    let rope = |x: &[f32], pos: usize| -> Vec<f64> {
        // neox pairs (i, i + d / 2) of every kv head's row
        let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for hh in 0..h {
            for i in 0..d / 2 {
                let a = pos as f64 * 10000f64.powf(-2.0 * i as f64 / d as f64);
                let (u, w) = (x[hh * d + i] as f64, x[hh * d + i + d / 2] as f64);
                y[hh * d + i] = u * a.cos() - w * a.sin();
                y[hh * d + i + d / 2] = u * a.sin() + w * a.cos();
            }
        }
        y
    };
    let mut c = Cache::new(&cfg(h as u32, d as u32, 64, Dtype::F32)).unwrap();
    let s = c.seq_create(b"").unwrap();
    c.append(s, &(0..30).collect::<Vec<i32>>()).unwrap();
    let raw: Vec<Vec<f32>> = (0..30).map(|_| rng.vec(h * d)).collect();
    let v = rng.vec(30 * h * d);
    for p in 0..30 {
        let k: Vec<f32> = rope(&raw[p], p).iter().map(|&x| x as f32).collect();
        c.write_kv_seq(
            s,
            0,
            p as u32,
            Some(KvData::F32(&k)),
            Some(KvData::F32(&v[p * h * d..(p + 1) * h * d])),
        )
        .unwrap();
    }
    c.commit(s, 30).unwrap();
    c.shift(s, 4, 13, Some(&Rope::new(d as u32, 10000.0, RopeStyle::Neox)))
        .unwrap();
    assert_eq!(c.seq_info(s).unwrap().n_tokens, 21);
    let (k2, v2) = c.gather(s, 0, 0, 21).unwrap();
    for p in 0..21 {
        let o = if p < 4 { p } else { p + 9 };
        let want = rope(&raw[o], p);
        for i in 0..h * d {
            assert!(
                (k2[p * h * d + i] as f64 - want[i]).abs() <= 1e-5,
                "K at {} value {}",
                p,
                i
            );
        }
        assert_eq!(&v2[p * h * d..(p + 1) * h * d], &v[o * h * d..(o + 1) * h * d]);
    }
    c.shift(s, 0, 1, None).unwrap(); // moved as stored
    assert_eq!(c.gather(s, 0, 0, 20).unwrap().0[..], k2[h * d..]);
    assert_eq!(c.shift(s, 10, 5, None).unwrap_err().code(), EINVAL);
    let f = [0.5f32; 3];
    let bad = Rope {
        dim0: 0,
        n_rot: d as u32,
        style: RopeStyle::Gptj,
        theta: 1.0,
        inv_freq: Some(&f),
    };
    assert_eq!(c.shift(s, 1, 2, Some(&bad)).unwrap_err().code(), EINVAL);
    assert_eq!(
        c.shift(s, 1, 2, Some(&Rope::new(31, 10000.0, RopeStyle::Neox)))
            .unwrap_err()
            .code(),
        EINVAL
    );
    assert_eq!(c.seq_info(s).unwrap().n_tokens, 20);
    c.check().unwrap();
}
