"""test_pagedkv.py: the Python bindings (python/pagedkv.py) against libpkv and a float64 numpy
reference: the config round trip (which catches a ctypes struct out of step with pkv.h),
decode and ragged prefill against contiguous attention computed here, soft-cap, window, the
LSE merge, prefix reuse, fork and copy-on-write, the block-table exports, bf16 and f16 input,
statuses as exceptions, and the binding's own size checks. Run by ctest (test_python) with
PKV_LIBRARY naming the built libpkv.so and PYTHONPATH the python/ folder."""

import ctypes
import gc
import os
import pickle
import re
import subprocess
import unittest
import weakref

import numpy as np

import pagedkv as pkv

SRC = os.environ.get("PKV_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def ref_attn(q, K, V, scale, softcap=0.0, window=0, sinks=None, alibi=None):
    """One query's attention over K, V [T][H][D] (float64), seeing positions [T - window, T)
    when window > 0. q [Hq][D]; GQA: query head h reads kv head h // (Hq // H); sinks [Hq]: one
    more key per head of that logit and value 0; alibi [Hq]: ALiBi slopes, slope x (k - (T - 1))
    added to each logit after the cap. V may be narrower than K (MLA: V [T][H][Dv]).
    Returns out [Hq][Dv] and the natural-log sum-exp [Hq] of the scaled (capped) logits (and
    the sink)."""
    T, H, _ = K.shape
    Hq = q.shape[0]
    lo = max(0, T - window) if window else 0
    out = np.empty((Hq, V.shape[2]))
    lse = np.empty(Hq)
    for h in range(Hq):
        kh = h // (Hq // H)
        s = K[lo:, kh, :].astype(np.float64) @ q[h].astype(np.float64) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if alibi is not None:
            s = s + float(alibi[h]) * (np.arange(lo, T, dtype=np.float64) - (T - 1))
        m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
        w = np.exp(s - m)
        total = w.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
        out[h] = w @ V[lo:, kh, :].astype(np.float64) / total
        lse[h] = m + np.log(total)
    return out, lse


class Base(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(1234)

    def fill(self, c, s, n, layers=1):
        """Appends n random tokens to s, writes random f32 K/V for every layer, commits; returns tokens."""
        H, D = c.config["n_kv_heads"], c.config["head_dim"]
        toks = self.rng.integers(0, 500, n)
        slots = c.append(s, toks)
        for layer in range(layers):
            k = self.rng.standard_normal((n, H, D)).astype(np.float32)
            v = self.rng.standard_normal((n, H, D)).astype(np.float32)
            c.write_kv(layer, slots, k, v)
        c.commit(s, c.seq_info(s).n_tokens)
        return toks

    def assertEinval(self, fn, *args, **kw):
        """fn(*args, **kw) raises PkvError with code EINVAL."""
        with self.assertRaises(pkv.PkvError) as e:
            fn(*args, **kw)
        self.assertEqual(e.exception.code, pkv.EINVAL)

    def assertClose(self, got, want, rel, what):
        scale = max(1.0, float(np.abs(want).max()))
        err = float(np.abs(got.astype(np.float64) - want).max())
        self.assertLessEqual(err, rel * scale, "%s: max abs error %.3g over %.3g" % (what, err, rel * scale))


class TestLibrary(Base):
    def test_version_matches_header(self):
        with open(os.path.join(SRC, "include", "pkv.h")) as f:
            hdr = f.read()
        want = re.search(r'#define PKV_VERSION_STRING "([^"]+)"', hdr).group(1)
        self.assertEqual(pkv.version(), want)

    def test_error_classes(self):
        # each status its own subclass, also when the caller builds the error; unknown codes stay PkvError
        classes = {pkv.EINVAL: pkv.InvalidArgumentError, pkv.ENOMEM: pkv.OutOfMemoryError,
                   pkv.ENOSPC: pkv.NoSpaceError, pkv.ENOENT: pkv.NotFoundError, pkv.ELIMIT: pkv.LimitError,
                   pkv.ECORRUPT: pkv.CorruptError, pkv.EIO: pkv.IoError, pkv.ENOTSUP: pkv.NotSupportedError,
                   pkv.EBUSY: pkv.BusyError}
        self.assertEqual(len(set(classes.values())), 9)
        for code, cls in classes.items():
            e = pkv.PkvError(code, "here")
            self.assertIs(type(e), cls)
            self.assertEqual((e.code, e.name), (code, pkv._CODE_NAMES[code]))
            self.assertTrue(str(e).startswith("here: "), str(e))
            self.assertIs(type(cls(code, "there")), cls)
            back = pickle.loads(pickle.dumps(e))
            self.assertEqual((type(back), back.code, str(back)), (cls, code, str(e)))
        self.assertIs(type(pkv.PkvError(-100, "x")), pkv.PkvError)
        with pkv.Cache(n_threads=1) as c:
            with self.assertRaises(pkv.NotFoundError):
                c.seq_info(12345)
            with self.assertRaises(pkv.InvalidArgumentError):
                c.decode(5, [], np.zeros((0, 8, 128), np.float32))

    def test_strerror_and_row_bytes(self):
        self.assertIn("sequence", pkv.strerror(pkv.ENOENT))
        self.assertEqual(pkv.strerror(2**40), pkv.strerror(-12345))  # unknown, not 0's "success"
        self.assertNotEqual(pkv.strerror(2**40), pkv.strerror(pkv.OK))
        self.assertEqual(pkv.dtype_row_bytes("f16", 128), 256)
        self.assertEqual(pkv.dtype_row_bytes("q8_0", 128), 4 * 34)
        self.assertEqual(pkv.dtype_row_bytes("q4_0", 48), 0)  # head_dim not a multiple of 32
        with self.assertRaises(pkv.PkvError):
            pkv.dtype_row_bytes("f64", 128)
        self.assertEqual(pkv.DTYPES, {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "fp8_e4m3": 5})
        self.assertEqual(pkv.dtype_row_bytes("fp8", 64), 4 + 64)  # libpkv's alias
        for bad in ("f16\0", "F16", "", None, 1):
            with self.assertRaises(pkv.PkvError) as e:
                pkv.Cache(k_dtype=bad)
            self.assertEqual(e.exception.code, pkv.EINVAL)

    def test_cache_cannot_be_copied(self):
        # a copy would share the C cache and free it twice (copy.copy then close: a segfault)
        import copy
        with pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4) as c:
            for f in (copy.copy, copy.deepcopy, pickle.dumps):
                with self.subTest(f=f.__name__), self.assertRaises(TypeError):
                    f(c)
            self.assertEqual(c.stats()["n_blocks"], 4)

    def test_config_defaults(self):
        with pkv.Cache(n_threads=1) as c:
            cfg = c.config
        self.assertEqual((cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"], cfg["block_tokens"]), (1, 8, 128, 16))
        self.assertEqual((cfg["n_blocks"], cfg["max_seqs"], cfg["max_blocks_per_seq"]), (1024, 256, 1024))
        self.assertEqual((cfg["k_dtype"], cfg["v_dtype"], cfg["enable_prefix_cache"]), ("f16", "f16", True))
        self.assertEqual(cfg["spin_us"], 50)
        with self.assertRaisesRegex(pkv.InvalidArgumentError, "spin_us 1000001 is over 1000000"):
            pkv.Cache(n_threads=1, spin_us=1000001)

    def test_config_round_trip(self):
        # every field after the two dtypes sits where pkv.h puts it, or these come back wrong
        with pkv.Cache(n_layers=3, n_kv_heads=2, head_dim=64, block_tokens=8, n_blocks=40, k_dtype="bf16",
                       v_dtype="q8_0", max_seqs=7, max_blocks_per_seq=9, n_threads=2, enable_prefix_cache=False,
                       huge_pages=False, event_capacity=5, spin_us=700) as c:
            cfg = c.config
            lo = c.layout()
            st = c.stats()
        self.assertEqual(cfg, dict(n_layers=3, n_kv_heads=2, head_dim=64, block_tokens=8, n_blocks=40, max_seqs=7,
                                   max_blocks_per_seq=9, n_threads=2, event_capacity=5, mem_budget_bytes=0, k_dtype="bf16",
                                   v_dtype="q8_0", enable_prefix_cache=False, huge_pages=False, v_dim=0, spin_us=700))
        self.assertEqual((lo.n_blocks, lo.block_tokens, lo.n_kv_heads, lo.head_dim, lo.n_layers), (40, 8, 2, 64, 3))
        self.assertEqual((lo.k_dtype, lo.v_dtype, lo.k_row_bytes, lo.v_row_bytes), ("bf16", "q8_0", 128, 68))
        self.assertEqual(lo.k_block_bytes, 2 * 8 * 128)
        self.assertEqual(lo.v_dim, 64)  # V rows of their own: head_dim values
        self.assertNotEqual(lo.k_base, 0)
        self.assertEqual(st["n_blocks"], 40)
        self.assertEqual(st["n_free"], 40)
        self.assertEqual(st["kv_bytes_per_block"], 3 * 2 * 8 * (128 + 68))
        self.assertEqual(st["attn_reqs_pool"] + st["attn_reqs_table"], 0)

    def test_struct_layouts_match_c(self):
        # the ctypes mirrors against sizeof / offsetof of pkv.h's structs, printed by abi_layout.c
        exe = os.environ.get("PKV_ABI_LAYOUT")
        self.assertTrue(exe, "PKV_ABI_LAYOUT (the abi_layout program) is not set")
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        lines = subprocess.run([exe], check=True, capture_output=True, text=True, env=env).stdout.split("\n")
        c = dict(line.rsplit(" ", 1) for line in lines if line)
        mirrors = {"pkv_config": pkv._Config, "pkv_allocator": pkv._Allocator, "pkv_executor": pkv._Executor,
                   "pkv_layout": pkv._Layout, "pkv_seq_info": pkv._SeqInfo, "pkv_stats": pkv._Stats,
                   "pkv_attn_params": pkv._AttnParams, "pkv_attn_req": pkv._AttnReq,
                   "pkv_append_req": pkv._AppendReq, "pkv_rope": pkv._Rope, "pkv_tier_stats": pkv._TierStats, "pkv_event": pkv._Event}
        for name, cls in mirrors.items():
            self.assertEqual(ctypes.sizeof(cls), int(c[name]), "sizeof(%s)" % name)
            fields = [f for f, _ in cls._fields_]
            self.assertEqual(fields, [k.split(".", 1)[1] for k in c if k.startswith(name + ".")], name)
            for f in fields:
                self.assertEqual(getattr(cls, f).offset, int(c[name + "." + f]), "%s.%s" % (name, f))

    def test_readme_example(self):
        with open(os.path.join(SRC, "README.md")) as f:
            readme = f.read()
        part = readme.split("## From Python", 1)[1]
        code = part.split("```python\n", 1)[1].split("```", 1)[0]
        exec(compile(code, "README.md (From Python)", "exec"), {})

    def test_dropped_cache_is_freed_at_once(self):
        # no reference cycle (e.g. through the log callback) keeps a dropped Cache alive
        gc.disable()
        try:
            c = pkv.Cache(n_blocks=8, n_threads=1, log=lambda level, msg: None)
            r = weakref.ref(c)
            del c
            self.assertIsNone(r(), "the Cache outlived its last reference")
            c = pkv.Cache(n_blocks=8, n_threads=1)
            r = weakref.ref(c)
            del c
            self.assertIsNone(r(), "the Cache outlived its last reference")
        finally:
            gc.enable()

    def test_log_hook(self):
        got = []
        with pkv.Cache(n_blocks=8, n_threads=1, log=lambda level, msg: got.append((level, msg))):
            pass
        self.assertTrue(got, "no log message at create")
        self.assertTrue(all(isinstance(m, str) and m for _, m in got))

    def test_errors_say_why(self):
        # libpkv says why a call refused (pkv.h: on the calling thread, through the log hook);
        # the PkvError carries it, and the caller's log hears it too
        import threading
        got = []
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=8, k_dtype="f32", v_dtype="f32", n_threads=1,
                       log=lambda level, msg: got.append((level, msg))) as c:
            s = c.seq_create()
            slots = c.append(s, range(4))
            kv = np.ones((4, 2, 32), np.float32)
            c.write_kv(0, slots, kv, kv)
            c.commit(s, 4)
            with self.assertRaises(pkv.InvalidArgumentError) as e:
                c.write_kv(0, slots[2:3], kv[:1], kv[:1])
            self.assertEqual(str(e.exception).split(": invalid argument")[0],
                             "pkv_write_kv: slot %d (row 0) is a committed position: read-only" % slots[2])
            self.assertEqual(got[-1], (0, str(e.exception).split(": invalid argument")[0]))
            with self.assertRaises(pkv.InvalidArgumentError) as e:
                c.decode(0, [s], np.ones((1, 3, 32), np.float32))
            self.assertIn("pkv_attn_decode: n_q_heads 3 is not a multiple of n_kv_heads 2", str(e.exception))
            with self.assertRaises(pkv.NotFoundError) as e:
                c.seq_info(s + 1)
            self.assertIn("is unknown: never made, released, or another cache's", str(e.exception))
            # shapes: one row as [H][D] is fine, a set of ids is a list of them
            s1 = c.seq_create()
            c.write_kv(0, c.append(s1, [5]), np.ones((2, 32), np.float32), np.ones((2, 32), np.float32))
            self.assertEqual(c.decode(0, {s1}, np.ones((2, 32), np.float32), n_q_heads=2).shape, (1, 2, 32))
            # each thread's error has its own reason
            errs = {}

            def fail(i):
                for _ in range(200):
                    try:
                        if i:
                            c.commit(s, 99)
                        else:
                            c.append(s + 7, [1])
                    except pkv.PkvError as x:
                        errs.setdefault(i, set()).add(str(x).split(":")[1].strip())
            ts = [threading.Thread(target=fail, args=(i,)) for i in (0, 1)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(errs, {0: {"sequence %#x is unknown" % (s + 7)}, 1: {"n_pos 99 past the sequence's length 4"}})
        # from the log callback (inside a refused call, under the cache's lock) a call on the
        # cache, close() among them, raises BusyError rather than deadlock
        for what in ("stats", "close"):
            inner, cx = [], []

            def in_log(level, msg):
                if level == 0:
                    try:
                        getattr(cx[0], what)()
                    except pkv.BusyError as x:
                        inner.append(x)
            cx.append(pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4, n_threads=1, log=in_log))
            with self.assertRaises(pkv.NotFoundError):
                cx[0].seq_info(12345)
            self.assertEqual(len(inner), 1, what)
            self.assertEqual(cx[0].stats()["n_blocks"], 4)
            cx[0].close()


class TestAttention(Base):
    def test_decode_and_prefill_match_reference(self):
        for dt in ("f32", "f16", "bf16"):
            with self.subTest(dtype=dt), pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=64, k_dtype=dt, v_dtype=dt,
                                                   n_threads=2) as c:
                Hq, D = 8, 64
                lens = [1, 15, 16, 17, 100, 257]
                seqs = [c.seq_create() for _ in lens]
                # appended in turns, so the block tables interleave
                for rnd in range(0, max(lens), 16):
                    for s, n in zip(seqs, lens):
                        if rnd < n:
                            self.fill(c, s, min(16, n - rnd))
                q = self.rng.standard_normal((len(seqs), Hq, D)).astype(np.float32)
                out, lse = c.decode(0, seqs, q, return_lse=True)
                self.assertEqual(out.shape, (len(seqs), Hq, D))
                for i, s in enumerate(seqs):
                    K, V = c.gather(s, 0)  # the pool's own values: the kernels' error alone
                    want, wlse = ref_attn(q[i], K, V, 1 / np.sqrt(D))
                    self.assertClose(out[i], want, 1e-5, "%s decode, %d tokens" % (dt, lens[i]))
                    self.assertClose(lse[i], wlse, 1e-5, "%s decode lse" % dt)
                # a ragged prefill: the last 20 positions of one sequence, 3 of another, 1 of a third
                reqs = [(seqs[5], 237, 20), (seqs[4], 97, 3), (seqs[2], 15, 1)]
                qp = self.rng.standard_normal((24, Hq, D)).astype(np.float32)
                outp = c.prefill(0, reqs, qp)
                row = 0
                for s, start, n in reqs:
                    K, V = c.gather(s, 0)
                    for j in range(n):
                        p = start + j
                        want, _ = ref_attn(qp[row], K[:p + 1], V[:p + 1], 1 / np.sqrt(D))
                        self.assertClose(outp[row], want, 1e-5, "%s prefill, position %d" % (dt, p))
                        row += 1

    def test_bf16_dot(self):
        # bf16_dot=True: where the cache says it takes it, the queries (times scale) are rounded to
        # bf16 and the outputs lie within 2^-8 of max |V| of the reference over those queries
        # (pkv.h; test_attn.c has the bound); elsewhere the same bits as without it
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=64, k_dtype="bf16", v_dtype="bf16", n_threads=2) as c:
            Hq, D = 8, 64
            seqs = [c.seq_create() for _ in range(3)]
            for rnd in range(0, 200, 16):
                for s in seqs:
                    self.fill(c, s, 16)
            q = self.rng.standard_normal((3, Hq, D)).astype(np.float32)
            plain = c.decode(0, seqs, q)
            out = c.decode(0, seqs, q, bf16_dot=True)
            used = c.bf16_dot_used
            self.assertEqual(not np.array_equal(plain, out), used)
            qr = pkv.bf16_value(pkv.bf16_bits(q / np.sqrt(D))) if used else q / np.sqrt(D)
            for i, s in enumerate(seqs):
                K, V = c.gather(s, 0)
                want, _ = ref_attn(qr[i], K, V, 1.0)
                if used:  # twice the bound, in units of max |V|
                    err = float(np.abs(out[i].astype(np.float64) - want).max())
                    self.assertLessEqual(err, 2.0 ** -7 * float(np.abs(V).max()), "bf16_dot decode %d" % i)
                else:
                    self.assertClose(out[i], want, 1e-5, "bf16_dot decode %d" % i)
            # a prefill of 40 positions: 160 query rows a kv head, the transposed kernels (AMX tiles
            # on backend avx512-amx)
            s, start, n = seqs[1], 160, 40
            qp = self.rng.standard_normal((n, Hq, D)).astype(np.float32)
            outp = c.prefill(0, [(s, start, n)], qp, bf16_dot=True)
            qpr = pkv.bf16_value(pkv.bf16_bits(qp / np.sqrt(D))) if used else qp / np.sqrt(D)
            K, V = c.gather(s, 0)
            for j in range(n):
                want, _ = ref_attn(qpr[j], K[:start + j + 1], V[:start + j + 1], 1.0)
                err = float(np.abs(outp[j].astype(np.float64) - want).max())
                bound = 2.0 ** -7 * float(np.abs(V).max()) if used else 1e-5 * max(1.0, float(np.abs(want).max()))
                self.assertLessEqual(err, bound, "bf16_dot prefill, position %d (%s)" % (start + j, c.backend))
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=8, n_threads=1) as c:  # f16: nothing to take
            self.assertFalse(c.bf16_dot_used)

    def test_f16_as_bf16(self):
        # f16_as_bf16=True: where the cache says it takes it (avx512-amx), a prefill of 40 positions
        # (160 query rows a kv head: the tiles) is within 2^-7 of max |V| of the reference over
        # K and the queries times scale rounded to bf16 (pkv.h; test_attn.c has the bounds), and
        # differs from the call without it; a decode (4 rows a kv head) gives the same bits
        self.check_flag_tiles("f16", "f16_as_bf16", round_k=True)

    def test_fp8_bf16_dot(self):
        # bf16_dot=True over fp8 e4m3, q8_0 and q4_0 caches: taken where the backend is avx512-amx
        # (its tiles: codes and integers are bf16 exactly, the queries times scale and the weights
        # rounded to bf16); a decode (4 rows a kv head) gives the same bits, a prefill of 40
        # positions (160 rows a kv head) differs exactly where it is taken and is then within
        # 2^-7 of max |V| of the reference over the pool's values and the rounded queries
        for dt in ("fp8_e4m3", "q8_0", "q4_0"):
            with self.subTest(dtype=dt):
                self.check_flag_tiles(dt, "bf16_dot", round_k=False)

    def check_flag_tiles(self, dt, flag, round_k):
        """A rounding flag (keyword flag) over a cache of dt: the tests above. round_k: the flag
        rounds K's values to bf16 too (f16)."""
        other = "bf16_dot" if flag == "f16_as_bf16" else "f16_as_bf16"
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=64, k_dtype=dt, v_dtype=dt, n_threads=2) as c:
            Hq, D = 8, 64
            s = c.seq_create()
            for _ in range(0, 208, 16):
                self.fill(c, s, 16)
            used = getattr(c, flag + "_used")
            self.assertEqual(used, c.backend == "avx512-amx")
            self.assertFalse(getattr(c, other + "_used"))
            q = self.rng.standard_normal((1, Hq, D)).astype(np.float32)
            self.assertTrue(np.array_equal(c.decode(0, [s], q), c.decode(0, [s], q, **{flag: True})))
            start, n = 160, 40
            qp = self.rng.standard_normal((n, Hq, D)).astype(np.float32)
            plain = c.prefill(0, [(s, start, n)], qp)
            outp = c.prefill(0, [(s, start, n)], qp, **{flag: True})
            self.assertEqual(not np.array_equal(plain, outp), used)
            K, V = c.gather(s, 0)
            r16 = lambda x: pkv.bf16_value(pkv.bf16_bits(x)) if used else x
            qpr, Kr = r16(qp / np.sqrt(D)), r16(K) if round_k else K
            for j in range(n):
                if not used and dt in ("q8_0", "q4_0"):
                    break  # q8_0 and q4_0 score int8 queries without the flag (test_attn.c)
                want, _ = ref_attn(qpr[j], Kr[:start + j + 1], V[:start + j + 1], 1.0)
                err = float(np.abs(outp[j].astype(np.float64) - want).max())
                bound = 2.0 ** -7 * float(np.abs(V).max()) if used else 1e-5 * max(1.0, float(np.abs(want).max()))
                self.assertLessEqual(err, bound, "%s %s prefill, position %d (%s)" % (flag, dt, start + j, c.backend))

    def test_f32_pool_stores_input_exactly(self):
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=8, k_dtype="f32", v_dtype="f32", n_threads=1) as c:
            s = c.seq_create()
            slots = c.append(s, range(20))
            k = self.rng.standard_normal((20, 2, 32)).astype(np.float32)
            v = self.rng.standard_normal((20, 2, 32))  # float64: converted to float32 by the binding
            c.write_kv(0, slots, k, v, dtype="f32")
            K, V = c.gather(s, 0)
            np.testing.assert_array_equal(K, k)
            np.testing.assert_array_equal(V, v.astype(np.float32))

    def test_16bit_inputs(self):
        with pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=8, k_dtype="bf16", v_dtype="f16", n_threads=1) as c:
            s = c.seq_create()
            slots = c.append(s, range(5))
            x = self.rng.standard_normal((5, 1, 32)).astype(np.float32)
            bits = pkv.bf16_bits(x)
            c.write_kv(0, slots, k=bits, dtype="bf16")
            c.write_kv(0, slots, v=x.astype(np.float16))
            c.write_kv(0, slots, v=x.astype(np.float16), dtype="f16")  # the same, named
            K, V = c.gather(s, 0)
            np.testing.assert_array_equal(K, pkv.bf16_value(bits))
            np.testing.assert_array_equal(V, x.astype(np.float16).astype(np.float32))
            with self.assertRaises(pkv.PkvError) as e:
                c.write_kv(0, slots, k=bits)  # uint16 without dtype="bf16"
            self.assertEqual(e.exception.code, pkv.EINVAL)
            # f32 written into the bf16 pool rounds as bf16_bits does
            c.write_kv(0, slots, k=x)
            np.testing.assert_array_equal(c.gather(s, 0)[0], pkv.bf16_value(pkv.bf16_bits(x)))

    def test_bf16_conversions(self):
        x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, np.inf, -np.inf, 3.4e38, 0.0, -0.0,
                      1e-40, np.nan], np.float32)
        x.view(np.uint32)[-1] = 0x7F800001  # a NaN whose mantissa lies in the bits rounded away
        bits = pkv.bf16_bits(x)
        self.assertEqual(bits.dtype, np.uint16)
        # ties to even (1 + 2^-8 down, 1 + 3 * 2^-8 up), past a tie up, overflow to infinity,
        # signed zero, a subnormal, a NaN kept a NaN
        self.assertEqual([int(b) for b in bits], [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F80, 0xFF80, 0x7F80,
                                                  0x0000, 0x8000, 0x0001, 0x7FC0])
        v = pkv.bf16_value(bits)
        self.assertEqual(v.dtype, np.float32)
        self.assertEqual(v[:-1].tolist(), [1.0, 1.0, 1.015625, 1.0078125, -2.5, np.inf, -np.inf, np.inf, 0.0, 0.0,
                                           float(np.float32(2**-133))])
        self.assertTrue(np.isnan(v[-1]))
        self.assertEqual(pkv.bf16_bits(np.ones((2, 3))).shape, (2, 3))  # float64 in, the shape kept
        for bad in (lambda: pkv.bf16_bits(np.ones(3, np.int32)), lambda: pkv.bf16_value(np.ones(3, np.float32))):
            with self.assertRaises(pkv.PkvError):
                bad()

    def two_seqs(self, c):
        """Two sequences of 40 and 23 random tokens in c (2 kv heads of 64), and queries for both
        at 4 heads: (s, t, q)."""
        s, t = c.seq_create(), c.seq_create()
        self.fill(c, s, 40)
        self.fill(c, t, 23)
        return s, t, 2 * self.rng.standard_normal((2, 4, 64)).astype(np.float32)

    def test_sinks(self):
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f16", v_dtype="f16", n_threads=2) as c:
            s, t, q = self.two_seqs(c)
            sinks = np.array([-1.0, 0.5, 2.0, 6.0], np.float32)
            out, lse = c.decode(0, [s, t], q, sinks=sinks, window=30, return_lse=True)
            for i, sq in enumerate((s, t)):
                K, V = c.gather(sq, 0)
                want, wlse = ref_attn(q[i], K.astype(np.float64), V.astype(np.float64), 1 / 8, 0.0, 30, sinks)
                self.assertClose(out[i], want, 1e-5, "decode with sinks, sequence %d" % i)
                self.assertClose(lse[i], wlse, 1e-5, "lse with sinks, sequence %d" % i)
            # a sink is a key of value 0: the result without it merged with (0, lse = sink)
            o0, l0 = c.decode(0, [s, t], q, window=30, return_lse=True)
            m, ml = pkv.merge(o0, l0, np.zeros_like(o0), np.broadcast_to(sinks, l0.shape).copy())
            self.assertClose(out, m.astype(np.float64), 1e-5, "merged with the sink")
            self.assertClose(lse, ml.astype(np.float64), 1e-5, "merged lse")
            # far below every logit: the same bits as none; prefill too
            far = np.full(4, -1e30, np.float32)
            o1, l1 = c.decode(0, [s, t], q, window=30, return_lse=True, sinks=far)
            np.testing.assert_array_equal(o1, o0)
            np.testing.assert_array_equal(l1, l0)
            qp = self.rng.standard_normal((10, 4, 64)).astype(np.float32)
            p0 = c.prefill(0, [(s, 30, 10)], qp)
            np.testing.assert_array_equal(c.prefill(0, [(s, 30, 10)], qp, sinks=far), p0)
            self.assertFalse(np.array_equal(c.prefill(0, [(s, 30, 10)], qp, sinks=sinks), p0))
            for bad in (np.array([0, 0, np.nan, 0], np.float32), np.array([0, np.inf, 0, 0], np.float32),
                        np.zeros(3, np.float32), np.zeros(5, np.float32)):
                self.assertEinval(c.decode, 0, [s], q[:1], sinks=bad)

    def test_alibi(self):
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f16", v_dtype="f16", n_threads=2) as c:
            s, t, q = self.two_seqs(c)
            slopes = np.array([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8], np.float32)  # 4 heads' ALiBi slopes
            out, lse = c.decode(0, [s, t], q, alibi_slopes=slopes, softcap=5.0, return_lse=True)
            for i, sq in enumerate((s, t)):
                K, V = c.gather(sq, 0)
                want, wlse = ref_attn(q[i], K.astype(np.float64), V.astype(np.float64), 1 / 8, 5.0, 0, None, slopes)
                self.assertClose(out[i], want, 1e-5, "decode with ALiBi, sequence %d" % i)
                self.assertClose(lse[i], wlse, 1e-5, "lse with ALiBi, sequence %d" % i)
            # prefill: query j of (s, 30, 10) is at position 30 + j, seeing [0, 30 + j]
            qp = self.rng.standard_normal((10, 4, 64)).astype(np.float32)
            po, pl = c.prefill(0, [(s, 30, 10)], qp, alibi_slopes=slopes, return_lse=True)
            K, V = c.gather(s, 0)
            for j in range(10):  # lse too: a wrong query position moves it, not the softmax
                want, wlse = ref_attn(qp[j], K[:31 + j].astype(np.float64), V[:31 + j].astype(np.float64), 1 / 8,
                                      alibi=slopes)
                self.assertClose(po[j], want, 1e-5, "prefill with ALiBi, query %d" % j)
                self.assertClose(pl[j], wlse, 1e-5, "prefill lse with ALiBi, query %d" % j)
            # zero slopes: the same bits as none
            np.testing.assert_array_equal(c.decode(0, [s, t], q, alibi_slopes=np.zeros(4, np.float32)),
                                          c.decode(0, [s, t], q))
            for bad in (np.full(3, 0.5, np.float32), np.array([0.5, np.nan, 0.5, 0.5], np.float32),
                        np.array([0.5, 1e6, 0.5, 0.5], np.float32)):
                self.assertEinval(c.decode, 0, [s, t], q, alibi_slopes=bad)

    def test_attn_chunk(self):
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f16", v_dtype="f16", n_threads=2) as c:
            s, t, q = self.two_seqs(c)
            slopes = np.array([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8], np.float32)
            # chunks of 16 (Llama 4's local attention): position 39 sees [32, 39], 22 sees [16, 22]
            for al in (None, slopes):
                out, lse = c.decode(0, [s, t], q, attn_chunk=16, alibi_slopes=al, return_lse=True)
                for i, sq in enumerate((s, t)):
                    K, V = c.gather(sq, 0)
                    lo = (K.shape[0] - 1) // 16 * 16
                    want, wlse = ref_attn(q[i], K[lo:].astype(np.float64), V[lo:].astype(np.float64), 1 / 8,
                                          alibi=al)
                    self.assertClose(out[i], want, 1e-5, "decode in chunks, sequence %d" % i)
                    self.assertClose(lse[i], wlse, 1e-5, "lse in chunks, sequence %d" % i)
            # prefill: query j of (s, 25, 15) is at 25 + j, seeing its chunk's keys up to itself
            qp = self.rng.standard_normal((15, 4, 64)).astype(np.float32)
            po, pl = c.prefill(0, [(s, 25, 15)], qp, attn_chunk=16, window=12, return_lse=True)
            K, V = c.gather(s, 0)
            for j in range(15):
                p = 25 + j
                lo = max(p // 16 * 16, p + 1 - 12)  # a key passes both the chunk and the window
                want, wlse = ref_attn(qp[j], K[lo:p + 1].astype(np.float64), V[lo:p + 1].astype(np.float64), 1 / 8)
                self.assertClose(po[j], want, 1e-5, "prefill in chunks, query %d" % j)
                self.assertClose(pl[j], wlse, 1e-5, "prefill lse in chunks, query %d" % j)
            # chunks of 1: each query sees itself alone, out = its V row (query heads 2h, 2h + 1 read kv head h)
            po = c.prefill(0, [(s, 25, 15)], qp, attn_chunk=1)
            self.assertClose(po, np.repeat(V[25:40], 2, axis=1).astype(np.float64), 1e-6, "chunks of 1")
            for bad in (-1, 2 ** 32):
                self.assertEinval(c.decode, 0, [s], q[:1], attn_chunk=bad)

    def test_noncausal(self):
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f16", v_dtype="f16", n_threads=2) as c:
            s, t, _ = self.two_seqs(c)
            # an encoder's self-attention over s (40), cross-attention of 30 queries over t (23)
            q = self.rng.standard_normal((70, 4, 64)).astype(np.float32)
            out, lse = c.prefill(0, [(s, 0, 40), (t, 0, 30)], q, causal=False, softcap=6.0, return_lse=True)
            for row in range(70):
                K, V = c.gather(s if row < 40 else t, 0)  # every query over the whole sequence
                want, wlse = ref_attn(q[row], K.astype(np.float64), V.astype(np.float64), 1 / 8, 6.0)
                self.assertClose(out[row], want, 1e-5, "non-causal, query %d" % row)
                self.assertClose(lse[row], wlse, 1e-5, "non-causal lse, query %d" % row)
            for kw in (dict(window=8), dict(attn_chunk=16), dict(alibi_slopes=np.ones(4, np.float32))):
                self.assertEinval(c.prefill, 0, [(s, 0, 40)], q[:40], causal=False, **kw)
            self.assertEinval(c.prefill, 0, [(s, 1, 39)], q[:39], causal=False)  # q_start past 0

    def test_masks(self):
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f16", v_dtype="f16", n_threads=2) as c:
            s, t, _ = self.two_seqs(c)
            K, V = c.gather(s, 0)
            Kt, Vt = c.gather(t, 0)
            # an extend of 30 queries from 10, causal with a bidirectional span [20, 32) (image
            # tokens), and 23 queries over t packed as two documents (edge 9), one row empty
            pos = np.arange(10, 40)[:, None]
            keys = np.arange(40)[None, :]
            span = (pos >= 20) & (pos < 32) & (keys >= 20) & (keys < 32)
            m0 = (keys <= pos) | span
            pt, kt = np.arange(23)[:, None], np.arange(23)[None, :]
            m1 = (kt <= pt) & ((pt >= 9) == (kt >= 9))
            m1[5] = False
            q = self.rng.standard_normal((53, 4, 64)).astype(np.float32)
            out, lse = c.prefill(0, [(s, 10, 30), (t, 0, 23)], q, masks=[m0, m1], softcap=6.0, return_lse=True)
            for row in range(53):
                m, KK, VV = (m0[row], K, V) if row < 30 else (m1[row - 30], Kt, Vt)
                if not m.any():
                    self.assertTrue(np.all(out[row] == 0) and np.all(lse[row] == -np.inf), "an empty row")
                    continue
                want, wlse = ref_attn(q[row], KK[m].astype(np.float64), VV[m].astype(np.float64), 1 / 8, 6.0)
                self.assertClose(out[row], want, 1e-5, "masked, query %d" % row)
                self.assertClose(lse[row], wlse, 1e-5, "masked lse, query %d" % row)
            # the causal mask gives the causal results; None leaves a request causal
            causal = c.prefill(0, [(s, 10, 30)], q[:30])
            self.assertClose(c.prefill(0, [(s, 10, 30)], q[:30], masks=[keys <= pos]), causal.astype(np.float64),
                             1e-5, "a causal mask")
            np.testing.assert_array_equal(c.prefill(0, [(s, 10, 30)], q[:30], masks=[None]), causal)
            # packed already: the same bits as the bool array
            packed = np.packbits(m0, axis=None, bitorder="little")
            np.testing.assert_array_equal(c.prefill(0, [(s, 10, 30)], q[:30], masks=[packed]),
                                          c.prefill(0, [(s, 10, 30)], q[:30], masks=[m0]))
            self.assertEinval(c.prefill, 0, [(s, 10, 30)], q[:30], masks=[packed[:-1]])
            # non-causal: rows of the whole sequence
            mn = self.rng.random((12, 23)) < 0.5
            mn[:, 0] = True
            outn = c.prefill(0, [(t, 0, 12)], q[:12], masks=[mn], causal=False)
            for row in range(12):
                want, _ = ref_attn(q[row], Kt[mn[row]].astype(np.float64), Vt[mn[row]].astype(np.float64), 1 / 8)
                self.assertClose(outn[row], want, 1e-5, "non-causal mask, query %d" % row)
            # refusals: a window with a mask, a wrong shape or type, a mask too few
            self.assertEinval(c.prefill, 0, [(s, 10, 30)], q[:30], masks=[m0], window=8)
            self.assertEinval(c.prefill, 0, [(s, 10, 30)], q[:30], masks=[m0[:, :39]])
            self.assertEinval(c.prefill, 0, [(s, 10, 30)], q[:30], masks=[m0.astype(np.uint8)])
            self.assertEinval(c.prefill, 0, [(s, 10, 30), (t, 0, 23)], q, masks=[m0])

    def test_tree_keep(self):
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f32", v_dtype="f32", n_threads=2) as c:
            s = c.seq_create()
            self.fill(c, s, 37)
            parents = [-1, 0, 0, 1, 2, -1, 5, 3, 6]
            slots = c.append(s, self.rng.integers(0, 500, len(parents)))  # the draft tree, uncommitted
            c.write_kv(0, slots, self.rng.standard_normal((9, 2, 64)).astype(np.float32),
                       self.rng.standard_normal((9, 2, 64)).astype(np.float32))
            K, V = c.gather(s, 0)
            q = self.rng.standard_normal((9, 4, 64)).astype(np.float32)
            out, lse = c.tree(0, [(s, 37, parents)], q, return_lse=True)
            depth = []
            for i, pa in enumerate(parents):
                depth.append(0 if pa < 0 else depth[pa] + 1)
                keys, j = list(range(37)), i
                while j >= 0:  # the node's path, itself first
                    keys.append(37 + j)
                    j = parents[j]
                want, wlse = ref_attn(q[i], K[keys], V[keys], 1 / 8)
                self.assertClose(out[i], want, 1e-5, "tree node %d" % i)
                self.assertClose(lse[i], wlse, 1e-5, "tree node %d lse" % i)
            chain = list(range(-1, 8))  # a chain: what prefill gives
            self.assertClose(c.tree(0, [(s, 37, chain)], q[:9]), c.prefill(0, [(s, 37, 9)], q).astype(np.float64),
                             1e-5, "chain against prefill")
            for bad in ([-1, 1], [-1, -2], [0]):
                with self.assertRaises(pkv.PkvError) as e:
                    c.tree(0, [(s, 37, bad)], q[:len(bad)])
                self.assertEqual(e.exception.code, pkv.EINVAL)
            with self.assertRaises(pkv.PkvError):
                c.tree(0, [(s, 37, parents)], q, out=q)  # out may not be q
            # keep node 7's path (0, 1, 3, 7): K/V and length follow
            with self.assertRaises(pkv.PkvError):
                c.keep(s, 37, [0, 3, 1])
            self.assertEqual(c.seq_info(s).n_tokens, 46)
            c.keep(s, 37, [0, 1, 3, 7])
            self.assertEqual(c.seq_info(s).n_tokens, 41)
            K2, V2 = c.gather(s, 0)
            np.testing.assert_array_equal(K2[37:], K[[37, 38, 40, 44]])
            np.testing.assert_array_equal(V2[37:], V[[37, 38, 40, 44]])
            np.testing.assert_array_equal(K2[:37], K[:37])
            c.check()

    def test_shift(self):
        def rope(x, pos, n_rot, theta):  # neox pairs (i, i + n_rot / 2), numpy's own, in float64
            h = n_rot // 2
            f = theta ** (-2.0 * np.arange(h) / n_rot)
            a = np.asarray(pos, dtype=np.float64)[:, None, None] * f
            y = x.astype(np.float64).copy()
            y[..., :h] = x[..., :h] * np.cos(a) - x[..., h:n_rot] * np.sin(a)
            y[..., h:n_rot] = x[..., :h] * np.sin(a) + x[..., h:n_rot] * np.cos(a)
            return y

        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f32", v_dtype="f32") as c:
            s = c.seq_create()
            raw = self.rng.standard_normal((30, 2, 64))
            Vr = self.rng.standard_normal((30, 2, 64)).astype(np.float32)
            slots = c.append(s, np.arange(30))
            c.write_kv(0, slots, rope(raw, np.arange(30), 64, 10000.0).astype(np.float32), Vr)
            c.commit(s, 30)
            c.shift(s, 4, 13, pkv.Rope(64, theta=10000.0))  # 4 sinks kept, the 9 oldest after them gone
            self.assertEqual(c.seq_info(s).n_tokens, 21)
            orig = np.r_[0:4, 13:30]
            K, V = c.gather(s, 0)
            self.assertClose(K, rope(raw[orig], np.arange(21), 64, 10000.0), 1e-5, "K turned to its new position")
            np.testing.assert_array_equal(V, Vr[orig])
            K0 = K.copy()
            c.shift(s, 0, 1)  # no rope: moved as stored
            np.testing.assert_array_equal(c.gather(s, 0)[0], K0[1:])
            self.assertEinval(c.shift, s, 10, 5)
            self.assertEinval(c.shift, s, 1, 2, pkv.Rope(63))
            self.assertEinval(c.shift, s, 1, 2, "neox")
            with self.assertRaises(pkv.PkvError):
                pkv.Rope(64, style="rotate")
            with self.assertRaises(pkv.PkvError):
                pkv.Rope(64, inv_freq=[1.0, 2.0])
            r = pkv.Rope(2, inv_freq=[0.5])
            r.n_rot = 64  # changed after construction: checked again at the call
            self.assertEinval(c.shift, s, 1, 2, r)
            r.n_rot, r.style = 2, "rotate"
            self.assertEinval(c.shift, s, 1, 2, r)
            c.shift(s, 1, 2, pkv.Rope(64, inv_freq=np.full(32, 0.5)))
            self.assertEqual(c.seq_info(s).n_tokens, 19)
            c.check()

    def test_softcap_window_merge(self):
        with pkv.Cache(n_kv_heads=2, head_dim=64, n_blocks=32, k_dtype="f32", v_dtype="f32", n_threads=2) as c:
            s = c.seq_create()
            self.fill(c, s, 40)
            K, V = c.gather(s, 0)
            q = 3 * self.rng.standard_normal((1, 4, 64)).astype(np.float32)
            for cap, win in ((5.0, 0), (0.0, 7), (5.0, 7)):
                out, lse = c.decode(0, [s], q, softcap=cap, window=win, scale=0.2, return_lse=True)
                want, wlse = ref_attn(q[0], K, V, 0.2, cap, win)
                self.assertClose(out[0], want, 1e-5, "softcap %g window %d" % (cap, win))
                self.assertClose(lse[0], wlse, 1e-5, "lse, softcap %g window %d" % (cap, win))
            # keys [0, 20) through a truncated fork, [20, 40) through a window of 20: merged, the whole
            f = c.fork(s)
            c.truncate(f, 20)
            qa = self.rng.standard_normal((1, 4, 64)).astype(np.float32)
            out_a, lse_a = c.decode(0, [f], qa, return_lse=True)
            out_b, lse_b = c.decode(0, [s], qa, window=20, return_lse=True)
            whole, wlse = c.decode(0, [s], qa, return_lse=True)
            merged, mlse = pkv.merge(out_a, lse_a, out_b, lse_b)
            self.assertEqual(merged.shape, whole.shape)
            self.assertClose(merged, whole.astype(np.float64), 1e-5, "merged halves")
            self.assertClose(mlse, wlse.astype(np.float64), 1e-5, "merged lse")
            # caller's arrays: out written in place of a new one, q itself as out
            buf, lbuf = np.empty((1, 4, 64), np.float32), np.empty(4, np.float32)
            r = c.decode(0, [s], qa, return_lse=True, out=buf, lse_out=lbuf)
            self.assertIs(r[0], buf)
            np.testing.assert_array_equal(buf, whole)
            np.testing.assert_array_equal(lbuf, wlse[0])
            qq = qa.copy()
            self.assertIs(c.decode(0, [s], qq, out=qq), qq)
            np.testing.assert_array_equal(qq, whole)
            for bad in (np.empty((1, 4, 64), np.float64), np.empty((1, 4, 63), np.float32),
                        np.empty((4, 1, 64), np.float32)[:, :, :32]):
                with self.assertRaises(pkv.PkvError):
                    c.decode(0, [s], qa, out=bad)
            # the truncated fork reads only [0, 20)
            want, _ = ref_attn(qa[0], K[:20], V[:20], 1 / 8)
            self.assertClose(out_a[0], want, 1e-5, "fork truncated to 20")


class TestMLA(Base):
    """Caches whose V lives in K (pkv_config.v_dim: multi-head latent attention): K written
    alone, attention outputs of v_dim values against ref_attn over gather()'s K with V its first
    v_dim values, the refusals, and the layout's view of a pool without a V array."""

    D, DV, HQ = 96, 64, 8
    TOL = {"f32": 1e-5, "f16": 1e-5, "q8_0": 2e-2}  # q8_0: the kernels quantize queries to int8

    def mla(self, dt, **kw):
        args = dict(n_kv_heads=1, head_dim=self.D, v_dim=self.DV, block_tokens=16, n_blocks=64, k_dtype=dt,
                    v_dtype=dt, n_threads=2)
        args.update(kw)
        return pkv.Cache(**args)

    def fill_k(self, c, s, n, by_seq=False):
        """Appends n tokens to s and writes random K (v=None) for layer 0, by slot or by position."""
        start = c.seq_info(s).n_tokens
        slots = c.append(s, self.rng.integers(0, 500, n))
        k = self.rng.standard_normal((n, 1, self.D)).astype(np.float32)
        if by_seq:
            c.write_kv_seq(s, 0, start, k)
        else:
            c.write_kv(0, slots, k)

    def ref(self, q, K, scale):
        return ref_attn(q, K, K[:, :, :self.DV], scale)

    def test_decode_prefill_tree_match_reference(self):
        for dt in ("f32", "f16", "q8_0"):
            with self.subTest(dtype=dt), self.mla(dt) as c:
                tol, Hq, D, Dv = self.TOL[dt], self.HQ, self.D, self.DV
                self.assertEqual(c.config["v_dim"], Dv)
                lens = [1, 15, 16, 17, 100, 257]
                seqs = [c.seq_create() for _ in lens]
                for rnd in range(0, max(lens), 16):  # in turns: interleaved block tables
                    for i, (s, n) in enumerate(zip(seqs, lens)):
                        if rnd < n:
                            self.fill_k(c, s, min(16, n - rnd), by_seq=i % 2 == 1)
                for s in seqs:
                    c.commit(s, c.seq_info(s).n_tokens)
                q = self.rng.standard_normal((len(seqs), Hq, D)).astype(np.float32)
                for scale in (0.0, 1 / np.sqrt(192)):  # the default 1/sqrt(head_dim), and a model's
                    out, lse = c.decode(0, seqs, q, scale=scale, return_lse=True)
                    self.assertEqual(out.shape, (len(seqs), Hq, Dv))
                    for i, s in enumerate(seqs):
                        K, V = c.gather(s, 0)
                        self.assertIsNone(V)
                        self.assertEqual(K.shape, (lens[i], 1, D))
                        want, wlse = self.ref(q[i], K, scale or 1 / np.sqrt(D))
                        self.assertClose(out[i], want, tol, "%s decode, %d tokens" % (dt, lens[i]))
                        self.assertClose(lse[i], wlse, tol, "%s decode lse" % dt)
                # out given: v_dim wide, written in place; flattened after the first axis too
                buf = np.empty((len(seqs), Hq * Dv), np.float32)
                self.assertIs(c.decode(0, seqs, q, out=buf), buf)
                np.testing.assert_array_equal(buf.reshape(out.shape), c.decode(0, seqs, q))
                # a ragged prefill
                reqs = [(seqs[5], 237, 20), (seqs[4], 97, 3), (seqs[2], 15, 1)]
                qp = self.rng.standard_normal((24, Hq, D)).astype(np.float32)
                outp = c.prefill(0, reqs, qp, scale=0.1)
                self.assertEqual(outp.shape, (24, Hq, Dv))
                row = 0
                for s, start, n in reqs:
                    K, _ = c.gather(s, 0)
                    for j in range(n):
                        want, _ = self.ref(qp[row], K[:start + j + 1], 0.1)
                        self.assertClose(outp[row], want, tol, "%s prefill, position %d" % (dt, start + j))
                        row += 1
                # a draft tree after seqs[4]'s 100 committed positions
                s = seqs[4]
                parents = [-1, 0, 0, 1, -1, 4]
                self.fill_k(c, s, len(parents))
                K, _ = c.gather(s, 0)
                qt = self.rng.standard_normal((len(parents), Hq, D)).astype(np.float32)
                outt = c.tree(0, [(s, 100, parents)], qt, scale=0.1)
                self.assertEqual(outt.shape, (len(parents), Hq, Dv))
                for i in range(len(parents)):
                    keys, j = list(range(100)), i
                    while j >= 0:
                        keys.append(100 + j)
                        j = parents[j]
                    want, _ = self.ref(qt[i], K[keys], 0.1)
                    self.assertClose(outt[i], want, tol, "%s tree node %d" % (dt, i))
                c.check()

    def test_refusals(self):
        with self.mla("f32") as c:
            s = c.seq_create()
            slots = c.append(s, range(5))
            k = self.rng.standard_normal((5, 1, self.D)).astype(np.float32)
            c.write_kv(0, slots, k)
            k_st, _ = c.read_stored(s, 0)
            q = self.rng.standard_normal((1, self.HQ, self.D)).astype(np.float32)
            before = c.decode(0, [s], q)
            for call in (lambda: c.write_kv(0, slots, k, k[:, :, :self.DV]),
                         lambda: c.write_kv(0, slots, k, k),
                         lambda: c.write_kv(0, slots, v=k[:, :, :self.DV]),
                         lambda: c.write_kv_seq(s, 0, 0, k, k),
                         lambda: c.write_kv_seq(s, 0, 0, v=k[:, :, :self.DV]),
                         lambda: c.write_stored(s, 0, 0, k_st, k_st),
                         lambda: c.write_stored(s, 0, 0, v=k_st)):
                with self.assertRaises(pkv.InvalidArgumentError) as e:
                    call()
                self.assertIn("V lives in K", str(e.exception))
            np.testing.assert_array_equal(c.gather(s, 0)[0], k)  # nothing written
            # out may not be q, nor overlap it, where v_dim < head_dim; nor be head_dim wide
            qs = q.copy()
            inside = qs.reshape(-1)[:self.HQ * self.DV].reshape(1, self.HQ, self.DV)
            for out in (qs, inside, qs.reshape(-1)[self.HQ * (self.D - self.DV):]):
                with self.assertRaises(pkv.InvalidArgumentError) as e:
                    c.decode(0, [s], qs, out=out)
                self.assertIn("out may not be q", str(e.exception))
                with self.assertRaises(pkv.InvalidArgumentError):
                    c.prefill(0, [(s, 4, 1)], qs, out=out)
            np.testing.assert_array_equal(qs, q)
            for out in (np.empty((1, self.HQ, self.D), np.float32), np.empty((1, self.HQ, self.DV + 1), np.float32)):
                with self.assertRaises(pkv.InvalidArgumentError):
                    c.decode(0, [s], q, out=out)
                with self.assertRaises(pkv.InvalidArgumentError):
                    c.tree(0, [(s, 4, [-1])], q, out=out)
            np.testing.assert_array_equal(c.decode(0, [s], q), before)
        # configurations libpkv refuses, its reasons carried
        for kw, why in ((dict(v_dim=97), "v_dim 97 is over head_dim 96"),
                        (dict(v_dim=64, v_dtype="f16"), "needs v_dtype f16 to be k_dtype f32"),
                        (dict(v_dim=48, k_dtype="q8_0", v_dtype="q8_0"), "needs a multiple of 32"),
                        (dict(v_dim=-1), "v_dim out of range")):
            with self.subTest(kw=kw), self.assertRaises(pkv.InvalidArgumentError) as e:
                pkv.Cache(n_kv_heads=1, head_dim=96, k_dtype=kw.pop("k_dtype", "f32"), n_threads=1,
                          v_dtype=kw.pop("v_dtype", "f32"), **kw)
            self.assertIn(why, str(e.exception))
        # v_dim == head_dim: V is the whole K row, and out may be q (in place) again
        with self.mla("f32", v_dim=self.D) as c:
            s = c.seq_create()
            c.write_kv(0, c.append(s, range(3)), self.rng.standard_normal((3, 1, self.D)).astype(np.float32))
            q = self.rng.standard_normal((1, self.HQ, self.D)).astype(np.float32)
            want = c.decode(0, [s], q)
            self.assertIs(c.decode(0, [s], q, out=q), q)
            np.testing.assert_array_equal(q, want)

    def test_layout_views_stored(self):
        for dt in ("f32", "f16", "q8_0"):
            with self.subTest(dtype=dt), self.mla(dt, n_layers=2, block_tokens=4, n_blocks=8) as a, \
                    self.mla(dt, n_layers=2, block_tokens=4, n_blocks=8) as b:
                lo = a.layout()
                row = pkv.dtype_row_bytes(dt, self.D)
                self.assertEqual((lo.v_dim, lo.head_dim, lo.v_dtype, lo.k_dtype), (self.DV, self.D, dt, dt))
                self.assertEqual((lo.v_base, lo.v_row_bytes, lo.v_block_bytes), (lo.k_base, row, 4 * row))
                self.assertEqual(lo.k_block_bytes, 4 * row)
                self.assertEqual(a.stats()["kv_bytes_per_block"], 2 * 4 * row)  # K rows alone
                sa, sb = a.seq_create(), b.seq_create()
                a.append(sa, range(7))
                b.append(sb, range(7))
                k = self.rng.standard_normal((7, 1, self.D)).astype(np.float32)
                for layer in range(2):
                    a.write_kv_seq(sa, layer, 0, k * (layer + 1))
                gk, gv = a.gather(sa, 1)
                self.assertIsNone(gv)
                # the pool's view: K alone, V None (a token's V is its K row's first v_dim values)
                K, V = a.kv_view(1)
                self.assertIsNone(V)
                table = a.block_table(sa)
                rows = np.stack([K[table[p // 4], :, p % 4] for p in range(7)])
                if dt == "q8_0":
                    self.assertEqual(K.shape, (8, 1, 4, row))
                    np.testing.assert_array_equal(rows, a.read_stored(sa, 1)[0])
                else:
                    self.assertEqual(K.shape, (8, 1, 4, self.D))
                    np.testing.assert_array_equal(rows.astype(np.float32), gk)
                del K, V, rows
                # stored rows: K alone, moved to another MLA cache bit for bit
                for layer in range(2):
                    ks, vs = a.read_stored(sa, layer)
                    self.assertIsNone(vs)
                    self.assertEqual(ks.shape, (7, 1, row))
                    b.write_stored(sb, layer, 0, ks)
                    np.testing.assert_array_equal(b.read_stored(sb, layer)[0], ks)
                    np.testing.assert_array_equal(b.gather(sb, layer)[0], a.gather(sa, layer)[0])
                q = self.rng.standard_normal((1, self.HQ, self.D)).astype(np.float32)
                np.testing.assert_array_equal(b.decode(1, [sb], q), a.decode(1, [sa], q))
                a.check()
                b.check()

    def test_merge_of_mla_outputs(self):
        # two halves of a sequence's keys attended apart (two caches), merged: the whole one's result
        with self.mla("f32") as whole, self.mla("f32") as a, self.mla("f32") as b:
            k = self.rng.standard_normal((40, 1, self.D)).astype(np.float32)
            sw, sa, sb = whole.seq_create(), a.seq_create(), b.seq_create()
            whole.write_kv(0, whole.append(sw, range(40)), k)
            a.write_kv(0, a.append(sa, range(25)), k[:25])
            b.write_kv(0, b.append(sb, range(15)), k[25:])
            q = self.rng.standard_normal((1, self.HQ, self.D)).astype(np.float32)
            oa, la = a.decode(0, [sa], q, return_lse=True)
            ob, lb = b.decode(0, [sb], q, return_lse=True)
            out, lse = pkv.merge(oa, la, ob, lb)
            want, wlse = whole.decode(0, [sw], q, return_lse=True)
            self.assertEqual(out.shape, (1, self.HQ, self.DV))
            self.assertClose(out, want.astype(np.float64), 1e-5, "merged")
            self.assertClose(lse, wlse.astype(np.float64), 1e-5, "merged lse")


class TestThreads(Base):
    def test_threads_share_a_cache(self):
        # four Python threads, each growing and decoding its own sequences of one cache; every
        # decode equals the reference over the sequence's gathered K/V
        import threading
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=256, k_dtype="f32", v_dtype="f32", n_threads=2) as c:
            errors = []

            def work(seed):
                try:
                    rng = np.random.default_rng(seed)
                    seqs = [c.seq_create() for _ in range(3)]
                    for step in range(30):
                        for s in seqs:
                            n = int(rng.integers(1, 6))
                            slots = c.append(s, rng.integers(0, 500, n))
                            kv = rng.standard_normal((2, n, 2, 32), dtype=np.float32)
                            c.write_kv(0, slots, kv[0], kv[1])
                            c.commit(s, c.seq_info(s).n_tokens)
                        q = rng.standard_normal((3, 4, 32), dtype=np.float32)
                        out = c.decode(0, seqs, q)
                        for i, s in enumerate(seqs):
                            K, V = c.gather(s, 0)
                            want, _ = ref_attn(q[i], K, V, 1 / np.sqrt(32))
                            # written so that NaN fails (a comparison with NaN is False)
                            if not np.abs(out[i] - want).max() <= 1e-5 * max(1.0, np.abs(want).max()):
                                errors.append("thread %d step %d: decode differs" % (seed, step))
                    for s in seqs:
                        c.release(s)
                except Exception as e:  # reported below, on the test's thread
                    errors.append("thread %d: %r" % (seed, e))

            ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(errors, [])
            c.check()
            self.assertEqual(c.stats()["n_seqs"], 0)


    def test_close_waits_for_calls_in_flight(self):
        # close() on one thread while another decodes in a loop: the decode in flight finishes,
        # the calls after close raise (the cache is closed), and nothing reads freed memory (the
        # process died here before close waited)
        import threading
        import time
        c = pkv.Cache(n_kv_heads=8, head_dim=128, n_blocks=1024, n_threads=2)
        seqs = [c.seq_create() for _ in range(8)]
        for s in seqs:
            slots = c.append(s, range(1024))
            kv = np.ones((1024, 8, 128), np.float16)
            c.write_kv(0, slots, kv, kv)
        q = np.ones((8, 32, 128), np.float32)
        done, errs = [], []

        def loop():
            try:
                while True:
                    out = c.decode(0, seqs, q)
                    if not np.all(out == 1.0):
                        errs.append("a decode gave %r" % out.ravel()[:4])
                    done.append(1)
            except pkv.PkvError as e:
                errs.append(e)

        t = threading.Thread(target=loop)
        t.start()
        while not done:
            time.sleep(0.01)
        c.close()
        t.join(30)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(errs), 1, errs)
        self.assertIsInstance(errs[0], pkv.InvalidArgumentError)
        self.assertIn("closed", str(errs[0]))
        c.close()  # again: nothing
        with self.assertRaises(pkv.PkvError):
            with c:
                pass

    def test_shared_prefix_decode(self):
        # forks decoded together read their shared blocks once a group (PKV_ATTN_SHARE=16: any
        # whole block, read at creation); each output and lse as each fork decoded alone
        old = os.environ.get("PKV_ATTN_SHARE")
        os.environ["PKV_ATTN_SHARE"] = "16"
        try:
            c = pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=32, n_threads=2, k_dtype="f32", v_dtype="f32")
        finally:
            if old is None:
                del os.environ["PKV_ATTN_SHARE"]
            else:
                os.environ["PKV_ATTN_SHARE"] = old
        with c:
            s = c.seq_create()
            self.fill(c, s, 40)
            seqs = [s] + [c.fork(s) for _ in range(3)]
            for f in seqs[1:]:
                self.fill(c, f, 5)  # each fork's own tail: block 2 copied on write
            q = self.rng.standard_normal((4, 8, 32)).astype(np.float32)
            out, lse = c.decode(0, seqs, q, return_lse=True)
            self.assertEqual(c.stats()["attn_shared_keys"], 3 * 32)  # 2 blocks before every query
            for i, f in enumerate(seqs):
                o1, l1 = c.decode(0, [f], q[i:i + 1], return_lse=True)
                self.assertClose(out[i:i + 1], o1, 1e-5, "output")
                self.assertClose(lse[i:i + 1], l1, 1e-5, "lse")
            self.assertEqual(c.stats()["attn_shared_keys"], 3 * 32)  # alone: nothing shared

    def test_fork_child_closes_inherited_cache(self):
        # multiprocessing's fork: a child that closes (or drops) a cache it inherited, whose
        # worker threads are not in the child (it hung there, in pthread_cond_destroy)
        import time
        c = pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=16, n_threads=2, k_dtype="f32", v_dtype="f32")
        s = c.seq_create()
        self.fill(c, s, 20)
        q = self.rng.standard_normal((1, 4, 32)).astype(np.float32)
        want = c.decode(0, [s], q)
        time.sleep(0.1)  # the worker asleep, as in an idle engine
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if np.array_equal(c.decode(0, [s], q), want) else 2
                c.close()
            finally:
                os._exit(code)
        deadline = time.time() + 20
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got or time.time() > deadline:
                break
            time.sleep(0.05)
        if not got:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            self.fail("the child hung")
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        np.testing.assert_array_equal(c.decode(0, [s], q), want)
        c.close()

class TestModel(Base):
    def test_python_engine_matches_pkv_run(self):
        # examples/python/generate.py (numpy model, pagedkv cache and attention) against `pkv run`
        # (the C model over the same library), greedy, on the real stories260K checkpoint: the
        # same token ids, prompts sharing 17 tokens included (the second reuses them)
        import importlib.util
        model = os.path.join(os.environ.get("PKV_SHARED_DIR", os.path.join(SRC, "..", "shared")), "models",
                             "stories260K.bin")
        exe = os.environ.get("PKV_BIN")
        if not exe:
            self.skipTest("PKV_BIN (the pkv CLI) not set: built without PKV_BUILD_TOOLS")
        if not os.path.isfile(model):
            self.skipTest("no model at " + model + " (the other model tests skip likewise)")
        spec = importlib.util.spec_from_file_location("generate", os.path.join(SRC, "examples", "python",
                                                                               "generate.py"))
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
        m = gen.Llama2c(model)
        shared = list(range(1, 18))
        # (hits inside block 0 too: the second prompt of each set reuses the tokens it shares with
        # the first, [1, 7] reuses its first token)
        for prompts, steps, hit in (([[1]], 48, 0), ([[1, 403, 407], [1, 403, 500]], 40, 2),
                                    ([shared + [210], shared + [300], [1, 7]], 40, 18)):
            ids = ";".join(",".join(map(str, p)) for p in prompts)
            env = dict(os.environ)
            env.pop("LD_PRELOAD", None)  # (an ASan build preloads its runtime into python, not into pkv)
            run = subprocess.run([exe, "run", model, "-t", "0", "-n", str(steps), "--prompt-ids", ids,
                                  "--threads", "1"], check=True, capture_output=True, text=True, env=env).stdout
            want = [[int(t) for t in line.split()] for line in run.strip("\n").split("\n")]
            got, st = gen.generate(m, prompts, steps)
            self.assertEqual(got, want, "prompts %s" % ids)
            self.assertEqual(st["prefix_tokens_hit"], hit)
            self.assertTrue(all(len(g) > 0 for g in got))
        with self.assertRaises(ValueError):
            gen.generate(m, [list(range(1, 10))], 5)


class TestCache(Base):
    def test_drop_front(self):
        """drop_front under a window: the blocks before the front go, decode over what is left
        matches the reference, reads of the front are EINVAL, the table reads -1 there. In a
        cache that indexes prefixes the dropped blocks stay indexed (CACHED): the same prompt is
        matched whole and reads them back."""
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=32, k_dtype="f32", v_dtype="f32", n_threads=1,
                       enable_prefix_cache=False) as c:
            s = c.seq_create()
            self.fill(c, s, 100)
            K, V = c.gather(s, 0)
            active = c.stats()["n_active"]
            c.drop_front(s, 100 - 40)  # a window of 40: blocks 0-2 (positions 0-47) go
            self.assertEqual(c.seq_info(s).n_dropped, 48)
            self.assertEqual(c.seq_info(s).n_tokens, 100)
            self.assertEqual(c.stats()["n_active"], active - 3)
            self.assertEqual(list(c.block_table(s)[:3]), [-1, -1, -1])
            self.assertTrue((c.block_table(s)[3:] >= 0).all())
            q = self.rng.standard_normal((1, 4, 32)).astype(np.float32)
            want, _ = ref_attn(q[0], K, V, 1 / np.sqrt(32), window=40)
            self.assertClose(c.decode(0, [s], q, window=40)[0], want, 1e-5, "decode over a dropped front")
            for call in (lambda: c.decode(0, [s], q), lambda: c.decode(0, [s], q, window=60),
                         lambda: c.gather(s, 0, 40, 10), lambda: c.truncate(s, 47), lambda: c.drop_front(s, 101)):
                with self.assertRaises(pkv.PkvError) as e:
                    call()
                self.assertEqual(e.exception.code, pkv.EINVAL)
            np.testing.assert_array_equal(c.gather(s, 0, 48)[0], K[48:])
            c.release(s)
            self.assertEqual(c.stats()["n_active"], 0)
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=32, k_dtype="f32", v_dtype="f32", n_threads=1) as c:
            s = c.seq_create()
            toks = self.fill(c, s, 40)
            K, V = c.gather(s, 0)
            c.drop_front(s, 32)  # blocks 0 and 1, indexed, held by s alone
            self.assertEqual(c.seq_info(s).n_dropped, 32)
            self.assertEqual((c.stats()["n_cached"], c.stats()["n_indexed"]), (2, 2))
            t = c.seq_create()
            self.assertEqual(c.match_prefix(t, toks), 39)  # 2 blocks, then 7 of s's tail copied
            self.assertEqual(c.stats()["n_cached"], 0)
            Kt, Vt = c.gather(t, 0)
            np.testing.assert_array_equal(Kt, K[:39])
            np.testing.assert_array_equal(Vt, V[:39])

    def test_match_prefix_window_tombstone(self):
        """A dropped front's evicted block leaves a tombstone: match_prefix stops there,
        match_prefix_window goes past it and takes only the blocks its window sees."""
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=8, k_dtype="f32", v_dtype="f32", n_threads=1) as c:
            s = c.seq_create()
            toks = self.fill(c, s, 64)  # blocks 0-3
            K, V = c.gather(s, 0)
            f = c.fork(s)
            c.truncate(f, 32)
            c.drop_front(f, 16)  # f keeps block 1
            c.drop_front(s, 16)  # block 0: nobody's, block 1 in use below it
            w = c.seq_create()
            self.fill(c, w, 64)  # the 4 free blocks
            self.assertEqual(c.stats()["evictions"], 0)
            self.fill(c, w, 16)  # block 0 evicted: a tombstone in its place
            st = c.stats()
            self.assertEqual((st["evictions"], st["n_tombstones"], st["n_indexed"]), (1, 1, 8))
            c.check()
            t = c.seq_create()
            self.assertEqual(c.match_prefix(t, toks), 0)
            self.assertEqual(c.match_prefix_window(t, toks, 20), 63)  # a query at 63 sees from 44
            self.assertEqual(c.seq_info(t).n_dropped, 32)
            self.assertEqual(c.stats()["prefix_tomb_hits"], 1)
            Kt, Vt = c.gather(t, 0, 32)
            np.testing.assert_array_equal(Kt, K[32:63])
            np.testing.assert_array_equal(Vt, V[32:63])
            c.check()
            u = c.seq_create()
            self.assertEinval(c.match_prefix_window, u, toks, 0)

    def test_tier_load_window(self):
        """A dropped front is saved from the front on (the ids before it from the index), and
        tier_load_window restores into an empty cache only what a window of 20 reads."""
        kw = dict(n_kv_heads=2, head_dim=32, n_blocks=8, k_dtype="f32", v_dtype="f32", n_threads=1)
        with pkv.Cache(**kw) as a, pkv.Cache(**kw) as b, pkv.Tier.host(1 << 24) as t:
            s = a.seq_create()
            toks = self.fill(a, s, 64)  # blocks 0-3
            K, V = a.gather(s, 0)
            a.drop_front(s, 45)  # a query at 64 sees from 45: blocks 0-1 go
            self.assertEqual(a.tier_save(t, s), 2)
            prompt = np.append(toks, 7)
            t.prefetch_start(1 << 22)  # the window's blocks staged ahead of the load
            b.tier_prefetch(t, prompt, window=20)
            t.prefetch_wait()
            self.assertEqual(t.stats().prefetched, 2)
            u = b.seq_create()
            self.assertEqual(b.tier_load_window(t, u, prompt, 20), 64)
            self.assertEqual(t.stats().prefetch_hits, 2)
            self.assertEqual(b.seq_info(u).n_dropped, 32)
            st = b.stats()
            self.assertEqual((st["n_tombstones"], st["n_indexed"]), (2, 2))
            Kb, Vb = b.gather(u, 0, 32)
            np.testing.assert_array_equal(Kb, K[32:64])
            np.testing.assert_array_equal(Vb, V[32:64])
            self.assertEqual(t.stats().loaded_tokens, 32)
            b.check()
            x = b.seq_create()
            self.assertEqual(b.match_prefix_window(x, prompt, 20), 64)  # b's pool has it now
            y = b.seq_create()
            self.assertEinval(b.tier_load_window, t, y, prompt, 0)
            self.assertEqual(b.seq_info(y).n_tokens, 0)

    def test_prefix_fork_cow_exports(self):
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=32, k_dtype="f32", v_dtype="f32", n_threads=1) as c:
            a = c.seq_create(b"tenant-1")
            toks = self.fill(c, a, 40)
            # blocks an append would take (16-token blocks, 8 tokens in a's tail)
            self.assertEqual([c.append_blocks(a, n) for n in (0, 8, 9, 100)], [0, 0, 1, 6])
            with self.assertRaises(pkv.PkvError) as e:
                c.append_blocks(a, 32 * 16)  # past max_blocks_per_seq (32)
            self.assertEqual(e.exception.code, pkv.ELIMIT)
            b = c.seq_create(b"tenant-1")
            reused = c.match_prefix(b, toks)
            self.assertGreaterEqual(reused, 32)
            self.assertLess(reused, 40)
            Ka, Va = c.gather(a, 0, 0, reused)
            Kb, Vb = c.gather(b, 0, 0, reused)
            np.testing.assert_array_equal(Ka, Kb)
            np.testing.assert_array_equal(Va, Vb)
            other = c.seq_create(b"tenant-2")  # another namespace reuses nothing
            self.assertEqual(c.match_prefix(other, toks), 0)
            c.release(other)
            st = c.stats()
            self.assertEqual(c.seq_info(b).n_reused, reused)
            self.assertEqual((st["prefix_lookups"], st["prefix_tokens_queried"], st["prefix_tokens_hit"]),
                             (2, 80, reused))
            self.assertEqual((st["prefix_miss_namespace"], st["n_indexed"]), (1, 2))

            child = c.fork(a)
            self.assertEqual(c.seq_info(child).n_shared, 3)
            cow = c.stats()["cow_copies"]
            slots = c.append(child, [7])  # the shared tail block is copied first
            self.assertEqual(c.stats()["cow_copies"], cow + 1)
            k = self.rng.standard_normal((1, 2, 32)).astype(np.float32)
            c.write_kv(0, slots, k, k)
            ta, tc = c.block_table(a), c.block_table(child)
            np.testing.assert_array_equal(ta[:2], tc[:2])
            self.assertNotEqual(ta[2], tc[2])
            Kc, Vc = c.gather(child, 0)
            np.testing.assert_array_equal(Kc[40], k[0])
            np.testing.assert_array_equal(Kc[:40], c.gather(a, 0)[0])
            q = self.rng.standard_normal((1, 4, 32)).astype(np.float32)
            want, _ = ref_attn(q[0], Kc, Vc, 1 / np.sqrt(32))
            self.assertClose(c.decode(0, [child], q)[0], want, 1e-5, "decode of the fork after CoW")
            self.assertEqual(c.stats()["attn_reqs_pool"] + c.stats()["attn_reqs_table"], 1)

            seqs = [a, b, child]
            tables, lens = c.export_dense(seqs, 8)
            # wider than any table can be: refused before the tables are allocated
            mbps = c.config["max_blocks_per_seq"]
            self.assertEqual(c.export_dense(seqs)[0].shape, (3, mbps))
            for wide in (mbps + 1, 2**32 - 1):
                with self.assertRaises(pkv.PkvError) as e:
                    c.export_dense(seqs, wide)
                self.assertEqual(e.exception.code, pkv.EINVAL)
            indptr, indices, last = c.export_csr(seqs)
            self.assertEqual(list(lens), [c.seq_info(s).n_tokens for s in seqs])
            for i, s in enumerate(seqs):
                t = c.block_table(s)
                np.testing.assert_array_equal(tables[i, :len(t)], t)
                self.assertTrue((tables[i, len(t):] == -1).all())
                np.testing.assert_array_equal(indices[indptr[i]:indptr[i + 1]], t)
                self.assertEqual(last[i], lens[i] - (len(t) - 1) * 16)
                np.testing.assert_array_equal(c.slots(s), t[np.arange(lens[i]) // 16] * 16 + np.arange(lens[i]) % 16)
            # export_csr sizes through libpkv's own count (a first call with no room), so a wrong
            # n_blocks from seq_info changes nothing
            real_info = c.seq_info
            c.seq_info = lambda s: real_info(s)._replace(n_blocks=0)
            try:
                again = c.export_csr(seqs)
            finally:
                del c.seq_info
            for x, y in zip(again, (indptr, indices, last)):
                np.testing.assert_array_equal(x, y)
            pin = c.pin(a, 32)
            for s in seqs:
                c.release(s)
            st = c.stats()
            self.assertEqual((st["n_seqs"], st["n_pins"]), (0, 1))
            self.assertEqual(st["n_active"], 2)  # the pin's two full blocks
            c.check()
            c.pin_release(pin)
            c.reset()
            self.assertEqual(c.stats()["n_free"], 32)
            c.check()

    def test_compact_cached(self):
        # prefix cache on: b's committed block is CACHED once b leaves; with cached=True a's block
        # is exchanged with it, and it stays findable at its new id with its K/V
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=8, k_dtype="f16", v_dtype="f16", n_threads=1) as c:
            a, b = c.seq_create(), c.seq_create()
            self.fill(c, a, 16)
            tb = self.fill(c, b, 16)
            self.fill(c, a, 20)
            np.testing.assert_array_equal(c.block_table(a), [0, 2, 3])
            Ka, Va = c.gather(a, 0)
            Kb, Vb = c.gather(b, 0)
            c.release(b)
            st = c.stats()
            self.assertEqual(st["n_cached"], 1)
            self.assertEqual(c.compact(a), 0)  # 1 is CACHED
            self.assertEqual(c.compact(a, cached=True), 2)  # 0 and 1 exchanged: two copies
            np.testing.assert_array_equal(c.block_table(a), [1, 2, 3])
            self.assertEqual(c.stats(), st)
            K1, V1 = c.gather(a, 0)
            np.testing.assert_array_equal(K1, Ka)
            np.testing.assert_array_equal(V1, Va)
            m = c.seq_create()
            self.assertEqual(c.match_prefix(m, list(tb) + [1]), 16)
            np.testing.assert_array_equal(c.block_table(m), [0])
            K2, V2 = c.gather(m, 0)
            np.testing.assert_array_equal(K2, Kb)
            np.testing.assert_array_equal(V2, Vb)
            c.check()

    def test_batch_compact_cached(self):
        # a and d interleave (0 2 and 1 3), b's two committed blocks are CACHED (4 5), 6 7 FREE.
        # cached=False: a (scattered) takes the lowest clean stretch, the FREE 6 7 (two moves), and
        # d its own from 1 (3 moves to the FREE 2): the CACHED blocks stay. cached=True: the lowest
        # clean stretch is the CACHED 4 5, exchanged with a's 0 2, and d's 3 is exchanged with the
        # CACHED block now at 2: six copies, and b's prefix (still CACHED, still matched with its
        # K/V) lies at 0 3. Every K/V kept, nothing evicted.
        want = {False: (3, [6, 7], [1, 2], [4, 5]), True: (6, [4, 5], [1, 2], [0, 3])}
        for cached in (False, True):
            with self.subTest(cached=cached), pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=8, k_dtype="f16",
                                                        v_dtype="f16", n_threads=1) as c:
                a, d, b = c.seq_create(), c.seq_create(), c.seq_create()
                for s in (a, d, a, d):
                    self.fill(c, s, 16)
                tb = list(self.fill(c, b, 32))
                np.testing.assert_array_equal(c.block_table(a), [0, 2])
                np.testing.assert_array_equal(c.block_table(d), [1, 3])
                np.testing.assert_array_equal(c.block_table(b), [4, 5])
                kv = {s: c.gather(s, 0) for s in (a, d, b)}
                c.release(b)
                st = c.stats()
                self.assertEqual(st["n_cached"], 2)
                n_moved, ta, td, tp = want[cached]
                self.assertEqual(c.batch_compact([a, d], cached=cached), n_moved)
                self.assertEqual(c.stats(), st)  # nothing evicted, no count moved
                np.testing.assert_array_equal(c.block_table(a), ta)
                np.testing.assert_array_equal(c.block_table(d), td)
                for s in (a, d):
                    K, V = c.gather(s, 0)
                    np.testing.assert_array_equal(K, kv[s][0])
                    np.testing.assert_array_equal(V, kv[s][1])
                m = c.seq_create()
                self.assertEqual(c.match_prefix(m, tb + [1]), 32)
                np.testing.assert_array_equal(c.block_table(m), tp)
                K, V = c.gather(m, 0)
                np.testing.assert_array_equal(K, kv[b][0])
                np.testing.assert_array_equal(V, kv[b][1])
                c.check()

    def test_compact(self):
        # prefix cache off: committed blocks stay movable; a and b interleave, then b leaves
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=8, k_dtype="f16", v_dtype="f16", n_threads=1,
                       enable_prefix_cache=False) as c:
            a, b = c.seq_create(), c.seq_create()
            self.fill(c, a, 16)
            self.fill(c, b, 16)
            self.fill(c, a, 20)  # blocks 2 and 3 (4 of 16 slots)
            np.testing.assert_array_equal(c.block_table(a), [0, 2, 3])
            K0, V0 = c.gather(a, 0)
            q = self.rng.standard_normal((1, 4, 32)).astype(np.float32)
            out0 = c.decode(0, [a], q)
            self.assertEqual(c.compact(a), 0)  # 1 is b's
            c.release(b)
            st = c.stats()
            self.assertEqual(c.compact(a), 1)  # 0 moves to 1 (one copy; 2, 3 to 1, 2 would be two)
            np.testing.assert_array_equal(c.block_table(a), [1, 2, 3])
            self.assertEqual(c.stats(), st)
            K1, V1 = c.gather(a, 0)
            np.testing.assert_array_equal(K0, K1)
            np.testing.assert_array_equal(V0, V1)
            np.testing.assert_array_equal(c.decode(0, [a], q), out0)
            self.assertEqual(c.compact(a), 0)
            c.check()
            with self.assertRaises(pkv.PkvError) as e:
                c.compact(b, evict=True)  # released: stale
            self.assertEqual(e.exception.code, pkv.ENOENT)
            # a full pool: the batch's blocks are exchanged into one run a sequence
            d = c.seq_create()
            self.fill(c, d, 16 * 5)  # the free queue's order
            np.testing.assert_array_equal(c.block_table(d), [4, 5, 6, 7, 0])
            Kd, Vd = c.gather(d, 0)
            self.assertEqual(c.stats()["n_free"], 0)
            self.assertEqual(c.batch_compact([d, a]), 0)  # a is laid out; no stretch of 5 beside it
            np.testing.assert_array_equal(c.block_table(d), [4, 5, 6, 7, 0])
            self.assertEqual(c.batch_compact([d, a], repack=True), 8)  # four exchanges
            np.testing.assert_array_equal(c.block_table(d), [0, 1, 2, 3, 4])
            np.testing.assert_array_equal(c.block_table(a), [5, 6, 7])
            self.assertEqual(c.batch_compact([d, a], cached=True), 0)  # laid out: kept
            for s, (K, V) in ((a, (K0, V0)), (d, (Kd, Vd))):
                K1, V1 = c.gather(s, 0)
                np.testing.assert_array_equal(K1, K)
                np.testing.assert_array_equal(V1, V)
            c.check()
            with self.assertRaises(pkv.PkvError) as e:
                c.batch_compact([a, a])
            self.assertEqual(e.exception.code, pkv.EINVAL)

    def test_batch_append(self):
        # 6 blocks of 16: a holds 20 positions (2 blocks), b 16 (1): 3 FREE
        with pkv.Cache(n_kv_heads=1, head_dim=32, block_tokens=16, n_blocks=6, n_threads=1) as c:
            self.check_batch_append(c)

    def check_batch_append(self, c):
        a, b, d = c.seq_create(), c.seq_create(), c.seq_create()
        c.append(a, range(20))
        c.append(b, range(16))
        got = c.batch_append([(a, [1, 2]), (b, np.arange(3)), (d, [])])
        self.assertEqual(len(got), 3)
        np.testing.assert_array_equal(got[0], c.slots(a, 20, 2))  # a's tail had room
        np.testing.assert_array_equal(got[1], c.slots(b, 16, 3))
        self.assertEqual(got[2].size, 0)
        self.assertEqual(c.stats()["n_free"], 2)
        # 2 FREE: b + 20 takes 1, d + 40 takes 3: all or none, none
        before = (c.stats(), c.seq_info(b), c.seq_info(d))
        with self.assertRaises(pkv.NoSpaceError) as e:
            c.batch_append([(b, range(20)), (d, range(40))])
        self.assertIn("pkv_batch_append", str(e.exception))
        self.assertEqual(before, (c.stats(), c.seq_info(b), c.seq_info(d)))
        # first come, first served: b's fits, d's does not
        got = c.batch_append([(b, range(20)), (d, range(40))], fit=True)
        self.assertEqual(len(got), 1)
        self.assertEqual((c.seq_info(b).n_tokens, c.seq_info(d).n_tokens), (39, 0))
        self.assertEqual(c.batch_append([], fit=True), [])
        for bad in ([(a, [1]), (a, [2])], [(a,)], [a], [(a, [1.5])]):
            with self.assertRaises(pkv.InvalidArgumentError):
                c.batch_append(bad)
        c.release(d)
        with self.assertRaises(pkv.NotFoundError):
            c.batch_append([(a, [1]), (d, [1])])
        self.assertEqual(c.seq_info(a).n_tokens, 22)  # a refused batch changes nothing
        c.check()

    def test_tier(self):
        # a prompt's blocks saved from one cache into host and file tiers and loaded into another,
        # byte for byte, after a pool match that stopped short; counters; refusals; closing
        import tempfile
        mk = lambda n: pkv.Cache(n_layers=2, n_kv_heads=2, head_dim=32, block_tokens=8, n_blocks=n,
                                 k_dtype="f16", v_dtype="q8_0", n_threads=1)
        prompt = np.arange(200, 245)
        with mk(16) as a, mk(40) as b, tempfile.TemporaryDirectory() as d, \
                pkv.Tier.host(1 << 24) as th, pkv.Tier.file(os.path.join(d, "t"), 1 << 24) as tf:
            sa = a.seq_create(b"ten")
            a.append(sa, prompt)
            for layer in range(2):
                a.write_kv_seq(sa, layer, 0, self.rng.standard_normal((45, 2, 32)).astype(np.float32),
                               self.rng.standard_normal((45, 2, 32)).astype(np.float32))
            a.commit(sa, 45)
            self.assertEqual(a.tier_save(th, sa), 5)
            self.assertEqual(a.tier_save(tf, sa), 5)
            self.assertEqual(a.tier_save(th, sa), 0)
            st = th.stats()
            self.assertEqual((st.entries, st.saved, st.save_present), (5, 5, 5))
            self.assertEqual(len(os.listdir(os.path.join(d, "t"))), 5)
            for t in (th, tf):
                sb = b.seq_create(b"ten")
                self.assertEqual(b.match_prefix(sb, prompt), 0 if t is th else 40)
                got = b.tier_load(t, sb, prompt)
                self.assertEqual(got, 40 if t is th else 0)  # the second: b's pool has it now
                for layer in range(2):
                    for x, y in zip(b.read_stored(sb, layer, 0, 40), a.read_stored(sa, layer, 0, 40)):
                        np.testing.assert_array_equal(x, y)
                b.release(sb)
            # prefetch: the file tier's thread stages the prompt; the load then takes it from memory
            tf.prefetch_start(1 << 24)
            with self.assertRaises(pkv.InvalidArgumentError):
                tf.prefetch_start(1 << 24)
            with mk(40) as c:
                c.tier_prefetch(tf, prompt, salt=b"ten")
                tf.prefetch_wait()
                st = tf.stats()
                self.assertEqual((st.prefetched, st.staged_entries), (5, 5))
                sc = c.seq_create(b"ten")
                self.assertEqual(c.tier_load(tf, sc, prompt), 40)
                self.assertEqual((tf.stats().prefetch_hits, tf.stats().staged_entries), (5, 0))
                for layer in range(2):
                    for x, y in zip(c.read_stored(sc, layer, 0, 40), a.read_stored(sa, layer, 0, 40)):
                        np.testing.assert_array_equal(x, y)
            with self.assertRaises(pkv.InvalidArgumentError):
                b.tier_prefetch(th, prompt)  # the host tier's prefetch was not started
            with self.assertRaises(pkv.InvalidArgumentError):
                a.tier_save_async(th, sa)  # nor its thread
            # write-back: the file tier's thread puts a save's entries; another prompt's here
            sw = a.seq_create(b"ten")
            a.append(sw, prompt + 1000)
            for layer in range(2):
                a.write_kv_seq(sw, layer, 0, self.rng.standard_normal((45, 2, 32)).astype(np.float32),
                               self.rng.standard_normal((45, 2, 32)).astype(np.float32))
            a.commit(sw, 45)
            saved_before = tf.stats().saved
            self.assertEqual(a.tier_save_async(tf, sw), 5)
            a.release(sw)
            tf.flush()
            self.assertEqual(tf.stats().saved, saved_before + 5)
            self.assertEqual(len(os.listdir(os.path.join(d, "t"))), 10)
            other = b.seq_create(b"other")  # another namespace
            self.assertEqual(b.tier_load(tf, other, prompt), 0)
            self.assertEqual(tf.stats().load_misses, 1)
            b.append(other, [5])
            with self.assertRaises(pkv.InvalidArgumentError):
                b.tier_load(tf, other, prompt)  # an uncommitted position
            with self.assertRaises(pkv.InvalidArgumentError):
                b.tier_save("not a tier", other)
            with self.assertRaises(pkv.NotFoundError):
                b.tier_save(th, 12345)
        with self.assertRaises(pkv.InvalidArgumentError):
            th.stats()  # closed
        th.close()  # a second close does nothing
        with self.assertRaises(pkv.InvalidArgumentError):
            pkv.Tier.host(0)
        with self.assertRaises(pkv.IoError):
            pkv.Tier.file("/nonexistent-pkv/a/b", 1 << 20)
        with self.assertRaises(TypeError):
            pkv.Tier()
        try:
            pkv.Tier.redis("127.0.0.1", 1, timeout_ms=100)  # nothing listens there
            self.fail("a tier on a port nobody serves")
        except (pkv.IoError, pkv.NotSupportedError):
            pass

    def test_events(self):
        # a router's view of a cache: the events name the blocks by the hashes prefix_hashes
        # computes from the prompt, with no cache; eviction removes them leaf first; a snapshot
        # gives the same; a reset says cleared; a full ring says overflow
        B = 4
        prompt = np.arange(1000, 1010)
        with pkv.Cache(n_kv_heads=1, head_dim=8, block_tokens=B, n_blocks=4, n_threads=1, event_capacity=16) as c:
            self.assertEqual(c.config["event_capacity"], 16)
            h = pkv.prefix_hashes(prompt, B, salt="t")
            self.assertEqual(h.dtype, np.uint64)
            self.assertEqual(len(h), 2)
            self.assertFalse(np.array_equal(h, pkv.prefix_hashes(prompt, B)))  # another namespace
            s = c.seq_create("t")
            c.append(s, prompt)
            c.commit(s, 10)
            ev = c.take_events(tokens=True)
            self.assertEqual([e.kind for e in ev], ["stored", "stored"])
            self.assertEqual([e.hash for e in ev], [int(x) for x in h])
            self.assertEqual([e.parent_hash for e in ev], [0, int(h[0])])
            self.assertEqual([e.depth for e in ev], [0, 1])
            self.assertEqual([e.seqno for e in ev], [1, 2])
            np.testing.assert_array_equal(ev[1].tokens, prompt[4:8])
            self.assertEqual(c.take_events(), [])
            snap = c.prefix_snapshot()
            self.assertEqual([(e.kind, e.hash, e.seqno, e.tokens) for e in snap],
                             [("stored", int(h[0]), 0, None), ("stored", int(h[1]), 0, None)])
            c.release(s)
            s2 = c.seq_create()
            c.append(s2, np.arange(16))  # all 4 blocks: both cached ones evicted, the leaf first
            ev = c.take_events()
            self.assertEqual([(e.kind, e.hash) for e in ev], [("removed", int(h[1])), ("removed", int(h[0]))])
            self.assertIsNone(ev[0].tokens)
            c.commit(s2, 16)
            self.assertEqual(len(c.take_events(max_events=3)), 3)
            self.assertEqual(len(c.take_events()), 1)
            c.reset()
            self.assertEqual([e.kind for e in c.take_events()], ["cleared"])
            for _ in range(5):  # 20 events for a ring of 16
                s = c.seq_create()
                c.append(s, np.arange(16))
                c.commit(s, 16)
                c.release(s)
                c.reset()
            ev = c.take_events()  # seqno 9 was the last taken; 10-25 filled the ring, 26 found it full
            self.assertEqual((ev[0].kind, ev[0].seqno, ev[0].lost), ("overflow", 26, 17))
            self.assertEqual([e.seqno for e in ev[1:]], list(range(27, 35)))
            self.assertEqual(c.prefix_snapshot(), [])
        with pkv.Cache(n_blocks=8, n_threads=1) as c:  # event_capacity 0: nothing recorded
            with self.assertRaisesRegex(pkv.InvalidArgumentError, "event_capacity 0"):
                c.take_events()
        with self.assertRaises(pkv.InvalidArgumentError):
            pkv.prefix_hashes([1, 2], 0)
        with self.assertRaises(pkv.InvalidArgumentError):
            pkv.prefix_hashes([1, 2], 2, salt=3)
        self.assertEqual(len(pkv.prefix_hashes([], 16)), 0)

    def test_media_tokens(self):
        # an image's positions keyed by its content: the same ids as the C library's (pinned in
        # tests/test_prefix.c), piece by piece the same, and a prompt with another image matches
        # only the text before it
        import hashlib
        ids = pkv.media_tokens("pagedkv", 3)
        self.assertEqual(ids.dtype, np.int32)
        self.assertEqual(ids.tolist(), [-1780325367, -650806929, -969049132])
        self.assertEqual(pkv.media_tokens(b"pagedkv", 1, offset=2**32 - 1).tolist(), [-49490191])
        img_a, img_b = hashlib.sha256(b"pixels of a").digest(), hashlib.sha256(b"pixels of b").digest()
        a = pkv.media_tokens(img_a, 40)
        self.assertTrue((a < 0).all())
        np.testing.assert_array_equal(np.concatenate([pkv.media_tokens(img_a, 15), pkv.media_tokens(img_a, 25, offset=15)]), a)
        with self.assertRaises(TypeError):  # offset is keyword-only: C's (id, offset, n) order can't slip in
            pkv.media_tokens(img_a, 15, 25)
        pixels = np.arange(1000, dtype=np.uint16).reshape(10, 100)
        np.testing.assert_array_equal(pkv.media_tokens(pixels, 3), pkv.media_tokens(pixels.tobytes(), 3))
        np.testing.assert_array_equal(pkv.media_tokens(pixels[:, ::2], 3), pkv.media_tokens(pixels[:, ::2].tobytes(), 3))
        b = pkv.media_tokens(bytearray(img_b), 40)
        self.assertEqual(int((a == b).sum()), 0)
        self.assertEqual(len(pkv.media_tokens(img_a, 0)), 0)
        text0, text1 = np.arange(100, 120), np.arange(200, 212)
        pa, pb = np.concatenate([text0, a, text1]), np.concatenate([text0, b, text1])
        with pkv.Cache(n_kv_heads=1, head_dim=8, block_tokens=16, n_blocks=16, n_threads=1) as c:
            s = c.seq_create()
            c.append(s, pa)
            c.commit(s, len(pa))
            t = c.seq_create()
            self.assertEqual(c.match_prefix(t, pb), 20)  # the text before the image only
            u = c.seq_create()
            self.assertEqual(c.match_prefix(u, pa), len(pa) - 1)  # the same image: all
        for bad, err in ((b"", "no identity"), (3, "bytes, a buffer or str"), (np.array([], np.uint8), "no identity")):
            with self.assertRaisesRegex(pkv.InvalidArgumentError, err):
                pkv.media_tokens(bad, 4)
        with self.assertRaisesRegex(pkv.InvalidArgumentError, "over 2"):
            pkv.media_tokens(img_a, 2, offset=2**32 - 1)
        with self.assertRaisesRegex(pkv.InvalidArgumentError, "bytes, a buffer or str"):
            pkv.media_tokens(None, 2)
        with self.assertRaises(pkv.InvalidArgumentError):
            pkv.media_tokens(img_a, -1)

    def test_tier_closed_under_load(self):
        # a Tier closed while other threads load and save through it: their calls in flight
        # finish, later ones raise InvalidArgumentError ("closed"), nothing crashes
        import threading
        prompt = np.arange(500, 541)
        tier = pkv.Tier.host(1 << 24)
        errors, closed = [], []

        def worker():
            with pkv.Cache(n_layers=1, n_kv_heads=2, head_dim=32, block_tokens=8, n_blocks=16, n_threads=1) as c:
                for i in range(1000000):  # until the tier is closed
                    s = c.seq_create()
                    try:
                        got = c.tier_load(tier, s, prompt)
                        c.append(s, prompt[got:])
                        c.write_kv_seq(s, 0, got, np.ones((41 - got, 2, 32), np.float32),
                                       np.ones((41 - got, 2, 32), np.float32))
                        c.commit(s, 41)
                        c.tier_save(tier, s)
                    except pkv.InvalidArgumentError as e:
                        if "closed" not in str(e):
                            errors.append(e)
                        closed.append(i)
                        c.release(s)
                        return
                    except Exception as e:  # anything else is a failure
                        errors.append(e)
                        return
                    c.release(s)

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        import time
        time.sleep(0.05)
        tier.close()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(len(closed), 2)  # both met the closed tier
        with self.assertRaises(pkv.InvalidArgumentError):
            tier.stats()

    def test_stored_transfer(self):
        # a sequence moved to another cache through its stored rows: bit for bit, every dtype
        for kd, vd in (("f32", "f32"), ("f16", "bf16"), ("q8_0", "q4_0"), ("fp8_e4m3", "f16"), ("q4_0", "q8_0")):
            with self.subTest(k=kd, v=vd), \
                    pkv.Cache(n_layers=2, n_kv_heads=2, head_dim=32, block_tokens=4, n_blocks=8, k_dtype=kd,
                              v_dtype=vd, n_threads=1) as a, \
                    pkv.Cache(n_layers=2, n_kv_heads=2, head_dim=32, block_tokens=4, n_blocks=16, k_dtype=kd,
                              v_dtype=vd, n_threads=1) as b:
                sa, sb, filler = a.seq_create(), b.seq_create(), b.seq_create()
                a.append(sa, range(10))
                for i in range(3):  # sb's blocks between filler's
                    b.append(sb, range(4 * i, min(4 * i + 4, 10)))
                    b.append(filler, range(100, 104))
                for layer in range(2):
                    a.write_kv_seq(sa, layer, 0, self.rng.standard_normal((10, 2, 32)).astype(np.float32),
                                   self.rng.standard_normal((10, 2, 32)).astype(np.float32))
                    k, v = a.read_stored(sa, layer)
                    self.assertEqual(k.shape, (10, 2, pkv.dtype_row_bytes(kd, 32)))
                    self.assertEqual(v.shape, (10, 2, pkv.dtype_row_bytes(vd, 32)))
                    b.write_stored(sb, layer, 0, k=k[:6])
                    b.write_stored(sb, layer, 0, v=v[:6].reshape(-1))  # any shape of whole rows
                    b.write_stored(sb, layer, 6, k[6:], v[6:])
                    kb, vb = b.read_stored(sb, layer)
                    np.testing.assert_array_equal(kb, k)
                    np.testing.assert_array_equal(vb, v)
                    for got, want in zip(b.gather(sb, layer), a.gather(sa, layer)):
                        np.testing.assert_array_equal(got, want)
                    kr, vr = b.read_stored(sb, layer, 3, 2)
                    np.testing.assert_array_equal(kr, k[3:5])
                q = self.rng.standard_normal((1, 2, 32)).astype(np.float32)
                np.testing.assert_allclose(b.decode(1, [sb], q), a.decode(1, [sa], q), rtol=1e-6, atol=1e-6)
                b.commit(sb, 8)
                before = b.read_stored(sb, 0)
                bad_k = k[:1].copy()
                if kd == "f32":
                    bad_k.reshape(-1).view(np.float32)[3] = np.nan
                elif kd == "q8_0":
                    bad_k[0, 1, 7] = 0x80  # code -128
                elif kd == "fp8_e4m3":
                    bad_k[0, 0, 4 + 2] = 0xff  # a NaN code
                else:  # f16 K: its first element infinity; q4_0 K: its first scale
                    bad_k[0, 0, 0:2] = (0x00, 0x7c)
                for bad in (lambda: b.write_stored(sb, 0, 9, k=bad_k),  # a spoiled row
                            lambda: b.write_stored(sb, 0, 7, k[:2]),  # position 7 committed
                            lambda: b.write_stored(sb, 0, 9, k[:2]),  # past the length 10
                            lambda: b.write_stored(sb, 2, 9, k[:1]),  # layer 2 of 2
                            lambda: b.write_stored(sb, 0, 9),  # neither
                            lambda: b.write_stored(sb, 0, 9, k[:1], v[:2]),  # positions differ
                            lambda: b.write_stored(sb, 0, 9, k[:1].reshape(-1)[:-1]),  # not whole rows
                            lambda: b.write_stored(sb, 0, 9, k[:1].astype(np.int8))):  # not uint8
                    with self.assertRaises(pkv.InvalidArgumentError):
                        bad()
                for got, want in zip(b.read_stored(sb, 0), before):
                    np.testing.assert_array_equal(got, want)
                b.check()

    def test_write_kv_seq(self):
        # by position == by slot, for each input form; refusals change nothing; stale slots
        for dt in ("f32", "f16", "bf16"):
            with self.subTest(dtype=dt), pkv.Cache(n_layers=2, n_kv_heads=2, head_dim=32, block_tokens=4,
                                                   n_blocks=12, k_dtype=dt, v_dtype=dt, n_threads=1) as c:
                a, b = c.seq_create(), c.seq_create()
                for i in range(4):  # interleaved: fragmented tables
                    c.append(a, range(3))
                    c.append(b, range(2))
                k = self.rng.standard_normal((12, 2, 32)).astype(np.float32)
                v = self.rng.standard_normal((12, 2, 32)).astype(np.float32)
                c.write_kv_seq(a, 1, 0, k, v)
                c.write_kv(1, c.slots(b, 0, 8), k[:8], v[:8])
                ga, gb = c.gather(a, 1), c.gather(b, 1)
                np.testing.assert_array_equal(ga[0][:8], gb[0])
                np.testing.assert_array_equal(ga[1][:8], gb[1])
                # positions 5..9 of a again, K only, f16 input and flattened; one row as [H][D]
                k2 = self.rng.standard_normal((5, 2, 32)).astype(np.float16)
                c.write_kv_seq(a, 1, 5, k=k2.reshape(5, 64))
                c.write_kv_seq(a, 1, 11, v=np.full((2, 32), 0.5, np.float32))
                ga2 = c.gather(a, 1)
                np.testing.assert_array_equal(ga2[0][:5], ga[0][:5])
                c.write_kv(1, c.slots(b, 0, 5), k=k2)
                np.testing.assert_array_equal(ga2[0][5:10], c.gather(b, 1)[0][:5])
                np.testing.assert_array_equal(ga2[1][:11], ga[1][:11])  # V untouched but row 11
                self.assertTrue((ga2[1][11] == 0.5).all())
                c.write_kv_seq(a, 0, 0, v, k)  # layer 0 defined: the refusals below must leave it
                c.commit(a, 4)
                before = c.gather(a, 0)
                for bad in (lambda: c.write_kv_seq(a, 0, 3, k[:2], v[:2]),  # position 3 committed
                            lambda: c.write_kv_seq(a, 0, 11, k[:2]),  # past the length 12
                            lambda: c.write_kv_seq(a, 2, 4, k[:1]),  # layer 2 of 2
                            lambda: c.write_kv_seq(a, 0, 4),  # neither k nor v
                            lambda: c.write_kv_seq(a, 0, 4, np.ones(63, np.float32)),  # not whole rows
                            lambda: c.write_kv_seq(a, 0, 4, k[:2], v[:3]),  # k and v of different rows
                            lambda: c.write_kv_seq(a, 0, 4, np.ones((2, 32, 2), np.float32)),  # heads last
                            lambda: c.write_kv_seq(a, 0, 4, k[:1], k[:1].astype(np.float16))):
                    with self.assertRaises(pkv.InvalidArgumentError):
                        bad()
                for got, want in zip(c.gather(a, 0), before):
                    np.testing.assert_array_equal(got, want)
                d = c.fork(a)
                with self.assertRaises(pkv.InvalidArgumentError) as e:
                    c.write_kv_seq(d, 0, 6, k[:1])  # a block the fork shares
                self.assertIn("pkv_seq_write_kv: position 6 (row 0) is in block", str(e.exception))
                c.release(d)
                with self.assertRaises(pkv.NotFoundError):
                    c.write_kv_seq(d, 0, 0, k[:1])
                c.check()
        # a truncate hands a's block to b: the old slots now write b's rows, a's positions are refused
        with pkv.Cache(n_kv_heads=1, head_dim=32, block_tokens=4, n_blocks=2, n_threads=1) as c:
            a, b = c.seq_create(), c.seq_create()
            c.append(a, range(6))
            old = c.slots(a, 4, 2)
            c.truncate(a, 4)
            np.testing.assert_array_equal(c.append(b, [7, 8]), old)
            one = np.ones((2, 1, 32), np.float32)
            c.write_kv_seq(b, 0, 0, one, one)
            with self.assertRaises(pkv.InvalidArgumentError):
                c.write_kv_seq(a, 0, 4, 2 * one, 2 * one)
            self.assertTrue((c.gather(b, 0)[0] == 1.0).all())
            c.write_kv(0, old, 2 * one, 2 * one)
            self.assertTrue((c.gather(b, 0)[0] == 2.0).all())

    def test_kv_view(self):
        for dt in ("f32", "f16", "bf16", "q8_0"):
            with self.subTest(dtype=dt):
                c = pkv.Cache(n_layers=2, n_kv_heads=2, head_dim=32, block_tokens=4, n_blocks=6, k_dtype=dt,
                              v_dtype="f32", n_threads=1)
                s = c.seq_create()
                slots = c.append(s, range(7))
                k = self.rng.standard_normal((7, 2, 32)).astype(np.float32)
                c.write_kv(1, slots, k, 2 * k)
                K, V = c.kv_view(1)
                have = None
                table = c.block_table(s)
                gk, gv = c.gather(s, 1)
                rows = lambda a: np.stack([a[table[p // 4], :, p % 4] for p in range(7)])  # noqa: E731
                if dt == "q8_0":
                    self.assertEqual(K.shape, (6, 2, 4, pkv.dtype_row_bytes("q8_0", 32)))
                    self.assertEqual(K.dtype, np.uint8)
                else:
                    self.assertEqual(K.shape, (6, 2, 4, 32))
                    have = rows(K)
                    if dt == "bf16":
                        have = (have.astype(np.uint32) << 16).view(np.float32)
                    np.testing.assert_array_equal(have.astype(np.float32), gk)
                np.testing.assert_array_equal(rows(V), gv)
                with self.assertRaises(ValueError):  # read-only by default
                    V[0, 0, 0, 0] = 1.0
                with self.assertRaises(pkv.PkvError) as e:
                    c.close()
                self.assertEqual(e.exception.code, pkv.EBUSY)
                c.seq_info(s)  # still open
                Kw, W = c.kv_view(1, writeable=True)
                W[table[0], 1, 2, :] = 5.0  # position 2, kv head 1
                self.assertTrue((c.gather(s, 1, 2, 1)[1][0, 1] == 5.0).all())
                del K, V, Kw, W, have
                c.close()
                with self.assertRaises(pkv.PkvError):
                    c.kv_view(0)
        # an exception leaving a with-block while a view is alive is not replaced by EBUSY
        with self.assertRaises(KeyError):
            with pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4, n_threads=1) as c:
                K, _ = c.kv_view(0)
                raise KeyError("the caller's own")
        del K, _, c
        # a view outlives the last reference to its cache, and keeps the pool alive
        import gc
        c = pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4, k_dtype="f32", v_dtype="f32", n_threads=1)
        s = c.seq_create()
        c.write_kv(0, c.append(s, [1]), np.full((1, 1, 32), 3.0, np.float32), np.zeros((1, 1, 32), np.float32))
        b = c.block_table(s)[0]
        K, _ = c.kv_view(0)
        del c, _
        gc.collect()
        np.testing.assert_array_equal(K[b, 0, 0], 3.0)
        del K
        gc.collect()

    def test_statuses_raise(self):
        with pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4, max_seqs=2, max_blocks_per_seq=8,
                       n_threads=1) as c:
            s = c.seq_create()
            c.append(s, range(3))
            c.release(s)
            for call in (lambda: c.seq_info(s), lambda: c.append(s, [1]), lambda: c.release(s)):
                with self.assertRaises(pkv.PkvError) as e:
                    call()
                self.assertEqual(e.exception.code, pkv.ENOENT)
                self.assertEqual(e.exception.name, "ENOENT")
            x, y = c.seq_create(), c.seq_create()
            with self.assertRaises(pkv.PkvError) as e:
                c.seq_create()
            self.assertEqual(e.exception.code, pkv.ELIMIT)
            # a handle of another cache, at a slot that is live here: refused, not another sequence's
            with pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4, max_seqs=2, max_blocks_per_seq=8,
                           n_threads=1) as other:
                o = other.seq_create()
                self.assertEqual(o & 0xffffffff, x & 0xffffffff)
                for call in (lambda: c.seq_info(o), lambda: c.append(o, [1]), lambda: c.release(o)):
                    with self.assertRaises(pkv.NotFoundError):
                        call()
            with self.assertRaises(pkv.NoSpaceError) as e:
                c.append(x, range(5 * 16))  # more than the pool: nothing appended
            self.assertEqual(e.exception.code, pkv.ENOSPC)
            self.assertIsInstance(e.exception, pkv.PkvError)
            self.assertEqual(c.seq_info(x).n_tokens, 0)
            slots = c.append(y, range(4))
            c.write_kv(0, slots, np.ones((4, 1, 32), np.float32), np.ones((4, 1, 32), np.float32))
            q = np.ones((1, 1, 32), np.float32)
            q[0, 0, 5] = np.nan
            with self.assertRaises(pkv.PkvError) as e:  # a query that is not finite: the library refuses it
                c.decode(0, [y], q)
            self.assertEqual(e.exception.code, pkv.EINVAL)
            with self.assertRaises(pkv.PkvError) as e:  # layer out of range
                c.decode(0 + 1, [y], np.ones((1, 1, 32), np.float32))
            self.assertEqual(e.exception.code, pkv.EINVAL)
            bad = np.ones((4, 1, 32), np.float32)
            bad[2, 0, 0] = np.inf
            with self.assertRaises(pkv.PkvError):
                c.write_kv(0, slots, bad, bad)
            np.testing.assert_array_equal(c.gather(y, 0)[0], 1.0)  # nothing written
            c.check()
        # PKV_VALUE_MAX, in a pool that holds it (f32): the limit is taken, the next float refused
        with pkv.Cache(n_kv_heads=1, head_dim=32, n_blocks=4, k_dtype="f32", v_dtype="f32", n_threads=1) as c2:
            s2 = c2.seq_create()
            sl = c2.append(s2, range(2))
            big = np.ones((2, 1, 32), np.float32)
            big[1, 0, 3] = pkv.VALUE_MAX
            c2.write_kv(0, sl, big, big)
            self.assertEqual(c2.gather(s2, 0)[0][1, 0, 3], pkv.VALUE_MAX)
            big[1, 0, 3] = np.nextafter(np.float32(pkv.VALUE_MAX), np.float32(np.inf))
            with self.assertRaises(pkv.PkvError) as e:
                c2.write_kv(0, sl, big, big)
            self.assertEqual(e.exception.code, pkv.EINVAL)
            self.assertEqual(c2.gather(s2, 0)[1][1, 0, 3], pkv.VALUE_MAX)  # nothing written
        with self.assertRaises(pkv.PkvError) as e:
            c.seq_create()  # closed
        self.assertEqual(e.exception.code, pkv.EINVAL)
        with self.assertRaises(pkv.PkvError) as e:
            pkv.Cache(head_dim=0)
        self.assertEqual(e.exception.code, pkv.EINVAL)
        self.assertIn("head_dim 0 not in 1..1024", str(e.exception))  # what libpkv's log said
        got = []
        with self.assertRaises(pkv.PkvError) as e:  # and the caller's log hears it too
            pkv.Cache(k_dtype="q8_0", head_dim=48, log=lambda level, msg: got.append((level, msg)))
        self.assertIn("k_dtype q8_0 needs head_dim a multiple of 32, not 48", str(e.exception))
        self.assertEqual([lv for lv, _ in got], [0])
        with self.assertRaises(TypeError):
            pkv.Cache(n_layer=2)

    def test_binding_checks_sizes(self):
        # sizes the C API cannot see are checked here: each call is refused before libpkv runs
        with pkv.Cache(n_kv_heads=2, head_dim=32, n_blocks=8, n_threads=1) as c:
            s = c.seq_create()
            slots = c.append(s, range(4))
            bad = [
                lambda: c.write_kv(0, slots, np.ones((3, 2, 32), np.float32), np.ones((4, 2, 32), np.float32)),
                lambda: c.write_kv(0, slots, np.ones((4, 2, 32), np.int32)),
                lambda: c.write_kv(0, slots),
                lambda: c.write_kv(0, slots, np.ones((4, 2, 32), np.float32), dtype="f16"),
                lambda: c.write_kv(0, slots, np.ones((4, 2, 32), np.float16), dtype="bf16"),
                lambda: c.write_kv(0, slots, np.ones((4, 2, 32), np.float32), dtype="q8_0"),
                lambda: c.write_kv(0, slots, np.ones((4, 2, 32), np.int16), dtype="f32"),
                lambda: c.write_kv(0, slots, np.ones((4, 2, 32), np.float32), np.ones((4, 2, 32), np.float16)),
                lambda: c.decode(0, [s], np.ones((1, 4, 31), np.float32)),
                lambda: c.decode(0, [s, s], np.ones((1, 4, 32), np.float32)),
                lambda: c.decode(0, [s], np.ones(128, np.float32)),  # flat q without n_q_heads
                lambda: c.decode(0, [], np.ones((0, 4, 32), np.float32)),
                lambda: c.decode(0, np.array([-1]), np.ones((1, 4, 32), np.float32)),
                lambda: c.decode(0, [s, -1], np.ones((2, 4, 32), np.float32)),
                lambda: c.prefill(0, [(s, 0, 3)], np.ones((2, 4, 32), np.float32)),
                lambda: c.prefill(0, [(s, 0)], np.ones((2, 4, 32), np.float32)),
                lambda: c.append(s, [1.5]),
                lambda: c.append(s, [1 << 40]),
                lambda: c.truncate(s, -1),
                lambda: c.commit(s, 2.5),
                lambda: c.seq_info(-3),
                # infinities (int() raises OverflowError) and ints where bytes are meant
                lambda: c.commit(s, float("inf")),
                lambda: c.seq_info(float("inf")),
                lambda: c.decode(float("inf"), [s], np.ones((1, 4, 32), np.float32)),
                lambda: c.seq_create(salt=3),  # bytes(3) would be three zero bytes
                lambda: c.seq_create(salt=0),  # ... and bytes(0) the default namespace
                lambda: c.decode(0, [s], np.ones((1, 4, 32), np.float32), out=_misaligned(4 * 32)),
                # counts past uint32 (a C count would cut them short) and ranges past the
                # sequence (refused before an output of that many rows is allocated)
                lambda: c.append(s, np.broadcast_to(np.int32(1), (2**32 + 5,))),
                lambda: c.match_prefix(c.seq_create(), np.broadcast_to(np.int32(1), (2**32,))),
                lambda: c.gather(s, 0, 0, 0xFFFFFFFF),
                lambda: c.gather(s, 0, 3, 2),
                lambda: c.gather(s, 0, 5),
                lambda: c.slots(s, 0, 0xFFFFFFFF),
                lambda: c.slots(s, 4, 1),
                lambda: pkv.merge(np.ones((2, 8)), np.ones(3), np.ones((2, 8)), np.ones(2)),
                # the right size in the wrong shape: refused, not read in the wrong order
                lambda: c.write_kv(0, slots, np.ones((2, 4, 32), np.float32)),  # heads first
                lambda: c.write_kv(0, slots, np.ones((4, 32, 2), np.float32)),
                lambda: c.write_kv(0, slots, np.ones((8, 32), np.float32)),
                lambda: c.decode(0, [s], np.ones((4, 1, 32), np.float32), n_q_heads=4),
                lambda: c.decode(0, [s], np.ones((1, 4, 32), np.float32), out=np.empty((4, 1, 32), np.float32)),
                lambda: c.decode(0, [s], np.ones((1, 4, 32), np.float32), return_lse=True,
                                 lse_out=np.empty((4, 1), np.float32)),
                lambda: pkv.merge(np.ones((2, 4, 8)), np.ones((2, 4)), np.ones((4, 2, 8)), np.ones((2, 4))),
                lambda: pkv.merge(np.ones((2, 4, 8)), np.ones((4, 2)), np.ones((2, 4, 8)), np.ones((2, 4))),
                # lse_out without return_lse would be left unwritten
                lambda: c.decode(0, [s], np.ones((1, 4, 32), np.float32), lse_out=np.empty((1, 4), np.float32)),
                lambda: c.prefill(0, [(s, 0, 1)], np.ones((1, 4, 32), np.float32), lse_out=np.empty((1, 4), np.float32)),
                lambda: c.decode(0, np.array(s), np.ones((1, 4, 32), np.float32)),  # 0-d: not a list
            ]
            for i, call in enumerate(bad):
                with self.subTest(case=i), self.assertRaises(pkv.PkvError) as e:
                    call()
                self.assertEqual(e.exception.code, pkv.EINVAL)
            self.assertEqual(c.seq_info(s).n_tokens, 4)
            self.assertEqual(c.gather(s, 0, 4)[0].shape, (0, 2, 32))  # empty, at the end
            self.assertEqual(c.slots(s, 1, 3).tolist(), slots[1:].tolist())
            # flattened shapes are fine: K/V [n][H * D], q [n][Hq * D] or [n * Hq * D] with n_q_heads
            c.write_kv(0, slots, np.ones((4, 64), np.float32), np.ones(4 * 64, np.float32))
            self.assertEqual(c.decode(0, [s], np.ones((1, 128), np.float32), n_q_heads=4).shape, (1, 4, 32))
            out = c.decode(0, [s], np.ones(128, np.float32), n_q_heads=4)
            self.assertEqual(out.shape, (1, 4, 32))
            np.testing.assert_allclose(out, 1.0, rtol=0, atol=1e-6)
            # misaligned inputs (contiguous, of the right dtype) are copied to aligned memory
            # before libpkv reads them: the same results as aligned ones
            rng = np.random.default_rng(5)
            k, v, q = (rng.standard_normal(n).astype(np.float32) for n in (4 * 64, 4 * 64, 128))
            t = c.seq_create()
            c.write_kv(0, c.append(t, range(4)), k, v)
            u = c.seq_create()
            sl = _misaligned(4, np.int32)
            sl[:] = c.append(u, range(4))
            ka, va, qa = _misaligned(k.size), _misaligned(v.size), _misaligned(q.size)
            ka[:], va[:], qa[:] = k, v, q
            c.write_kv(0, sl, ka, va)
            seqs = _misaligned(1, np.uint64)
            seqs[:] = [u]
            np.testing.assert_array_equal(c.decode(0, seqs, qa, n_q_heads=4), c.decode(0, [t], q, n_q_heads=4))
        for budget in (float("nan"), None, float("inf")):
            with self.subTest(budget=budget), self.assertRaises(pkv.PkvError) as e:
                pkv.Cache(mem_budget_bytes=budget)
            self.assertEqual(e.exception.code, pkv.EINVAL)


def _misaligned(n, dtype=np.float32):
    """A C-contiguous, writeable array of n elements whose address is one byte off alignment."""
    size = np.dtype(dtype).itemsize
    a = np.zeros(n * size + 1, np.uint8)[1:].view(dtype)
    assert not a.flags.aligned and a.flags.c_contiguous
    return a


if __name__ == "__main__":
    unittest.main()
