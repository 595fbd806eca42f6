"""pagedkv: Python bindings of libpkv (ctypes + numpy).

A paged KV cache and paged attention for inference engines written in Python. This module is
a thin layer over the C library: every call is one libpkv call (the GIL is released while it
runs), the arrays are numpy arrays, and a libpkv status other than PKV_OK raises PkvError with
that status. The binding checks every buffer's dtype and size before handing it to the library
(the C API trusts its callers on sizes), so a wrong shape is a PkvError (EINVAL), never a read
past an array.

    import numpy as np, pagedkv
    with pagedkv.Cache(n_layers=1, n_kv_heads=2, head_dim=64, n_blocks=64) as c:
        s = c.seq_create()
        slots = c.append(s, np.arange(100, 120))
        c.write_kv(0, slots, k, v)            # k, v: [20][2][64] float32 or float16
        c.commit(s, 20)
        out = c.decode(0, [s], q)              # q: [1][8][64] float32 (8 query heads, GQA)

Sequence handles are Python ints (the C pkv_seq). A released one is stale forever
(NotFoundError); each cache numbers its handles far from the others', so one passed to the
wrong cache raises NotFoundError too (a check, not a guarantee: see pkv_seq in pkv.h). The library is found through the
environment variable PKV_LIBRARY (a path to libpkv.so), else next to this file, two levels up
(cmake --install puts this file in <libdir>/pkv/python) or in ../build, else by
ctypes.util.find_library("pkv"). help(pagedkv.Cache) lists the whole API.
"""

import ctypes
import ctypes.util
import functools
import os
import threading
import weakref
from collections import namedtuple

import numpy as np

__all__ = [
    "Cache", "Tier", "TierStats", "Event", "Rope", "prefix_hashes", "media_tokens", "merge", "version", "strerror", "dtype_row_bytes", "DTYPES", "bf16_bits", "bf16_value",
    "PkvError", "InvalidArgumentError", "OutOfMemoryError", "NoSpaceError", "NotFoundError", "LimitError",
    "CorruptError", "IoError", "NotSupportedError", "BusyError",
    "OK", "EINVAL", "ENOMEM", "ENOSPC", "ENOENT", "ELIMIT", "ECORRUPT", "EIO", "ENOTSUP", "EBUSY",
    "ATTN_BF16_DOT", "ATTN_NONCAUSAL", "ATTN_F16_AS_BF16", "VALUE_MAX",
]

# ---- status codes (pkv.h: values never change once released) -----------------------------
OK, EINVAL, ENOMEM, ENOSPC, ENOENT, ELIMIT, ECORRUPT, EIO, ENOTSUP, EBUSY = 0, -1, -2, -3, -4, -5, -6, -7, -8, -9
# pkv_attn_params.flags (pkv.h): what decode's and prefill's bf16_dot=True passes
ATTN_BF16_DOT = 1
# pkv_attn_params.flags (pkv.h): what prefill's causal=False passes
ATTN_NONCAUSAL = 2
# pkv_attn_params.flags (pkv.h): what decode's, prefill's and tree's f16_as_bf16=True passes
ATTN_F16_AS_BF16 = 4


def _flags(bf16_dot, f16_as_bf16):
    """pkv_attn_params.flags of the attention calls' bf16_dot and f16_as_bf16 arguments."""
    return (ATTN_BF16_DOT if bf16_dot else 0) | (ATTN_F16_AS_BF16 if f16_as_bf16 else 0)


# PKV_VALUE_MAX (pkv.h): the largest |element| write_kv takes, and the largest |q| x scale the
# attention calls take (2^56); past it, EINVAL
VALUE_MAX = float(2 ** 56)
_CODE_NAMES = {OK: "OK", EINVAL: "EINVAL", ENOMEM: "ENOMEM", ENOSPC: "ENOSPC", ENOENT: "ENOENT",
               ELIMIT: "ELIMIT", ECORRUPT: "ECORRUPT", EIO: "EIO", ENOTSUP: "ENOTSUP", EBUSY: "EBUSY"}

# pool element formats by name (pkv_dtype values), as libpkv names them: filled by _load()
DTYPES = {}
_DTYPE_NAMES = {}


class PkvError(Exception):
    """A libpkv call returned a status other than PKV_OK (or the binding refused its arguments
    with EINVAL before calling). `code` is the status (pagedkv.EINVAL, ...), `name` its name.
    Each status raises a subclass of its own (`NoSpaceError` for ENOSPC, ...: _ERROR_CLASSES),
    so `except pagedkv.NoSpaceError` catches that status alone; PkvError(code, what) builds one."""

    def __new__(cls, code, what):
        if cls is PkvError:
            cls = _ERROR_CLASSES.get(code, PkvError)
        return super().__new__(cls, code, what)

    def __init__(self, code, what):
        self.code = code
        self.what = what
        self.name = _CODE_NAMES.get(code, str(code))
        super().__init__("%s: %s (%s)" % (what, strerror(code) if _lib else self.name, self.name))

    def __reduce__(self):  # pickles (a multiprocessing pool's worker raising it) as (code, what)
        return (type(self), (self.code, self.what))


# one subclass of PkvError a status, named as the Rust binding's ErrorKind (pkv.h's meanings)
class InvalidArgumentError(PkvError):
    """EINVAL: a bad argument (a shape, slot, layer or position out of range, a value past
    VALUE_MAX)."""


class OutOfMemoryError(PkvError):
    """ENOMEM: a host allocation failed."""


class NoSpaceError(PkvError):
    """ENOSPC: no block available, even after evicting every cached block (an engine preempts
    a sequence here)."""


class NotFoundError(PkvError):
    """ENOENT: an unknown or stale sequence."""


class LimitError(PkvError):
    """ELIMIT: max_seqs or max_blocks_per_seq would be exceeded."""


class CorruptError(PkvError):
    """ECORRUPT: the checker found a broken invariant."""


class IoError(PkvError):
    """EIO: an I/O error (reserved for storage tiers: no call of this version returns it)."""


class NotSupportedError(PkvError):
    """ENOTSUP: a valid request this build or configuration does not support."""


class BusyError(PkvError):
    """EBUSY: the object is in use (a block shared with another sequence, ...)."""


_ERROR_CLASSES = {EINVAL: InvalidArgumentError, ENOMEM: OutOfMemoryError, ENOSPC: NoSpaceError,
                  ENOENT: NotFoundError, ELIMIT: LimitError, ECORRUPT: CorruptError, EIO: IoError,
                  ENOTSUP: NotSupportedError, EBUSY: BusyError}


# ---- the library ------------------------------------------------------------------------------
def _find_library():
    env = os.environ.get("PKV_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    # beside this file; two levels up (where cmake --install puts it: <libdir>/pkv/python); a
    # checkout's build/
    for cand in (os.path.join(here, "libpkv.so"), os.path.join(here, "..", "..", "libpkv.so.0"),
                 os.path.join(here, "..", "build", "libpkv.so")):
        if os.path.exists(cand):
            return cand
    found = ctypes.util.find_library("pkv")
    if found:
        return found
    raise OSError("pagedkv: libpkv not found: set PKV_LIBRARY to the path of libpkv.so")


_lib = None
_u32, _u64, _i32, _f32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_float
_vp, _cp, _int, _sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t
_P = ctypes.POINTER


class _Allocator(ctypes.Structure):
    _fields_ = [("alloc", _vp), ("free", _vp), ("ctx", _vp)]


class _Executor(ctypes.Structure):
    _fields_ = [("parallel_for", _vp), ("ctx", _vp), ("n_workers", _u32)]


_LOG_FN = ctypes.CFUNCTYPE(None, _vp, _int, _cp)


class _Config(ctypes.Structure):
    _fields_ = [("n_layers", _u32), ("n_kv_heads", _u32), ("head_dim", _u32), ("block_tokens", _u32),
                ("n_blocks", _u32), ("mem_budget_bytes", _u64), ("k_dtype", _int), ("v_dtype", _int),
                ("max_seqs", _u32), ("max_blocks_per_seq", _u32), ("n_threads", _u32),
                ("enable_prefix_cache", _int), ("huge_pages", _int), ("allocator", _Allocator),
                ("log", _LOG_FN), ("log_ctx", _vp), ("executor", _Executor), ("event_capacity", _u32),
                ("v_dim", _u32), ("spin_us", _u32)]


class _Event(ctypes.Structure):
    _fields_ = [("seqno", _u64), ("hash", _u64), ("parent_hash", _u64), ("lost", _u64), ("kind", _u32),
                ("depth", _u32), ("block", _u32), ("reserved", _u32)]


_EVENT_KINDS = {1: "stored", 2: "removed", 3: "cleared", 4: "overflow"}

Event = namedtuple("Event", "seqno kind hash parent_hash depth block lost tokens")
Event.__doc__ = """A prefix-index event (pkv_event): kind is "stored", "removed", "cleared" or "overflow";
hash and parent_hash are identity hashes (prefix_hashes computes a prompt's), 0 where none;
depth is the block's index in its chain; block its pool block then; lost (overflow) the events
dropped; tokens the block's token ids (int32 array) for stored / removed when asked for, else
None."""


class _Layout(ctypes.Structure):
    _fields_ = [("k_base", _vp), ("v_base", _vp), ("layer_stride_bytes", _sz), ("k_row_bytes", _sz),
                ("v_row_bytes", _sz), ("k_block_bytes", _sz), ("v_block_bytes", _sz), ("n_blocks", _u32),
                ("block_tokens", _u32), ("n_kv_heads", _u32), ("head_dim", _u32), ("n_layers", _u32),
                ("k_dtype", _int), ("v_dtype", _int), ("v_dim", _u32)]


class _SeqInfo(ctypes.Structure):
    _fields_ = [("n_tokens", _u32), ("n_committed", _u32), ("n_blocks", _u32), ("n_shared", _u32),
                ("n_reused", _u32), ("n_dropped", _u32)]


class _Stats(ctypes.Structure):
    _fields_ = [("n_blocks", _u32), ("n_free", _u32), ("n_cached", _u32), ("n_active", _u32),
                ("n_seqs", _u32), ("n_pins", _u32), ("n_tokens", _u64), ("n_slots_used", _u64),
                ("kv_bytes", _u64), ("kv_bytes_per_block", _u64), ("meta_bytes", _u64), ("frag_slots", _u64),
                ("cow_copies", _u64), ("peak_active", _u32), ("prefix_lookups", _u64),
                ("prefix_tokens_queried", _u64), ("prefix_tokens_hit", _u64), ("prefix_miss_new", _u64),
                ("prefix_miss_evicted", _u64), ("prefix_miss_namespace", _u64), ("n_indexed", _u64),
                ("evictions", _u64), ("attn_reqs_pool", _u64), ("attn_reqs_table", _u64),
                ("attn_shared_keys", _u64), ("n_tombstones", _u64), ("prefix_tomb_hits", _u64)]


class _TierStats(ctypes.Structure):
    _fields_ = [(f, _u64) for f in ("entries", "bytes", "capacity", "evictions", "saved", "save_present",
                                    "save_no_room", "loaded_blocks", "loaded_tokens", "load_misses", "rejected",
                                    "errors", "prefetched", "prefetch_hits", "prefetch_dropped", "staged_entries",
                                    "staged_bytes")]


class _AttnParams(ctypes.Structure):
    _fields_ = [("n_q_heads", _u32), ("scale", _f32), ("softcap", _f32), ("window", _u32), ("lse", _vp),
                ("flags", _u32), ("sinks", _vp), ("alibi_slopes", _vp), ("attn_chunk", _u32)]


class _AttnReq(ctypes.Structure):
    _fields_ = [("seq", _u64), ("q_start", _u32), ("n_q", _u32)]


class _TreeReq(ctypes.Structure):
    _fields_ = [("seq", _u64), ("q_start", _u32), ("n_nodes", _u32), ("parent", _vp)]


TREE_MAX_NODES = 1024  # PKV_TREE_MAX_NODES


class _AppendReq(ctypes.Structure):
    _fields_ = [("seq", _u64), ("tokens", _vp), ("n", _u32), ("slots_out", _vp)]


class _Rope(ctypes.Structure):
    _fields_ = [("dim0", _u32), ("n_rot", _u32), ("style", _u32), ("theta", ctypes.c_float), ("inv_freq", _vp)]


class Rope:
    """RoPE as the engine applied it to the K rows it wrote, for Cache.shift (pkv_rope): pair i
    of a K row turned by position x theta^(-2i / n_rot) radians, or inv_freq[i] where given
    (n_rot / 2 values: Llama 3's or YaRN's scaled frequencies). style "neox" pairs values dim0 + i
    and dim0 + i + n_rot / 2 (rotate_half: Llama and Qwen in Hugging Face's layout), "gptj" pairs
    dim0 + 2i and dim0 + 2i + 1 (interleaved: GPT-J, llama.cpp's default mode, llama2.c)."""

    _STYLES = {"neox": 0, "gptj": 1}

    def __init__(self, n_rot, theta=10000.0, style="neox", dim0=0, inv_freq=None):
        if style not in self._STYLES:
            raise _invalid("Rope: style must be 'neox' or 'gptj', not %r" % (style,))
        self.n_rot, self.theta, self.style, self.dim0 = n_rot, float(theta), style, dim0
        self.inv_freq = None
        if inv_freq is not None:
            f = np.ascontiguousarray(np.asarray(inv_freq, dtype=np.float32).reshape(-1))
            if f.size * 2 != n_rot:
                raise _invalid("Rope: inv_freq holds %d values, n_rot / 2 is %s" % (f.size, n_rot / 2))
            self.inv_freq = f

    def _struct(self):
        """The pkv_rope, its fields checked again (they may have been set since __init__)."""
        if self.style not in self._STYLES:
            raise _invalid("Rope: style must be 'neox' or 'gptj', not %r" % (self.style,))
        n_rot = _u32_of(self.n_rot, "Rope.n_rot")
        f = self.inv_freq
        if f is not None:
            f = np.ascontiguousarray(np.asarray(f, dtype=np.float32).reshape(-1))
            if f.size * 2 != n_rot:
                raise _invalid("Rope: inv_freq holds %d values, n_rot / 2 is %s" % (f.size, n_rot / 2))
            self.inv_freq = f  # (kept: the struct points into it for the call)
        return _Rope(_u32_of(self.dim0, "Rope.dim0"), n_rot, self._STYLES[self.style], float(self.theta),
                     _ptr(f) if f is not None else None)


def _load():
    global _lib
    lib = ctypes.CDLL(_find_library())
    sigs = {
        "pkv_strerror": (_cp, [_int]),
        "pkv_version": (_cp, []),
        "pkv_dtype_row_bytes": (_sz, [_int, _u32]),
        "pkv_dtype_name": (_cp, [_int]),
        "pkv_dtype_from_name": (_int, [_cp, _P(_int)]),
        "pkv_config_default": (_Config, []),
        "pkv_cache_create": (_int, [_P(_Config), _P(_vp)]),
        "pkv_cache_destroy": (None, [_vp]),
        "pkv_cache_reset": (_int, [_vp]),
        "pkv_cache_config": (_int, [_vp, _P(_Config)]),
        "pkv_cache_layout": (_int, [_vp, _P(_Layout)]),
        "pkv_seq_create": (_int, [_vp, _vp, _sz, _P(_u64)]),
        "pkv_seq_append": (_int, [_vp, _u64, _vp, _u32, _vp]),
        "pkv_seq_append_blocks": (_int, [_vp, _u64, _u32, _P(_u32)]),
        "pkv_batch_append": (_int, [_vp, _vp, _u32, _u32, _P(_u32)]),
        "pkv_write_kv": (_int, [_vp, _u32, _vp, _u32, _vp, _vp, _int]),
        "pkv_seq_write_kv": (_int, [_vp, _u64, _u32, _u32, _u32, _vp, _vp, _int]),
        "pkv_seq_commit": (_int, [_vp, _u64, _u32]),
        "pkv_seq_fork": (_int, [_vp, _u64, _P(_u64)]),
        "pkv_seq_truncate": (_int, [_vp, _u64, _u32]),
        "pkv_seq_drop_front": (_int, [_vp, _u64, _u32]),
        "pkv_seq_keep": (_int, [_vp, _u64, _u32, _vp, _u32]),
        "pkv_seq_shift": (_int, [_vp, _u64, _u32, _u32, _vp]),
        "pkv_attn_tree": (_int, [_vp, _u32, _vp, _u32, _vp, _vp, _P(_AttnParams)]),
    "pkv_seq_compact": (_int, [_vp, _u64, _u32, ctypes.POINTER(_u32)]),
    "pkv_batch_compact": (_int, [_vp, _vp, _u32, _u32, _u32, ctypes.POINTER(_u32)]),
        "pkv_seq_release": (_int, [_vp, _u64]),
        "pkv_seq_get_info": (_int, [_vp, _u64, _P(_SeqInfo)]),
        "pkv_seq_slots": (_int, [_vp, _u64, _u32, _u32, _vp]),
        "pkv_seq_block_table": (_int, [_vp, _u64, _vp, _u32, _P(_u32)]),
        "pkv_seq_gather": (_int, [_vp, _u64, _u32, _u32, _u32, _vp, _vp]),
        "pkv_seq_read_stored": (_int, [_vp, _u64, _u32, _u32, _u32, _vp, _vp]),
        "pkv_seq_write_stored": (_int, [_vp, _u64, _u32, _u32, _u32, _vp, _vp]),
        "pkv_export_dense": (_int, [_vp, _vp, _u32, _u32, _vp, _vp]),
        "pkv_export_csr": (_int, [_vp, _vp, _u32, _vp, _vp, _u32, _vp, _P(_u32)]),
        "pkv_seq_match_prefix": (_int, [_vp, _u64, _vp, _u32, _P(_u32)]),
        "pkv_seq_match_prefix_window": (_int, [_vp, _u64, _vp, _u32, _u32, _P(_u32)]),
        "pkv_pin_create": (_int, [_vp, _u64, _u32, _P(_u64)]),
        "pkv_pin_release": (_int, [_vp, _u64]),
        "pkv_cache_get_stats": (_int, [_vp, _P(_Stats)]),
        "pkv_cache_check": (_int, [_vp, ctypes.c_char_p, _sz]),
        "pkv_attn_params_default": (_AttnParams, []),
        "pkv_attn_decode": (_int, [_vp, _u32, _vp, _u32, _vp, _vp, _P(_AttnParams)]),
        "pkv_attn_prefill": (_int, [_vp, _u32, _vp, _u32, _vp, _vp, _P(_AttnParams)]),
        "pkv_attn_prefill_masked": (_int, [_vp, _u32, _vp, _u32, _vp, _vp, _vp, _P(_AttnParams)]),
        "pkv_attn_merge": (_int, [_u32, _u32, _vp, _vp, _vp, _vp, _vp, _vp]),
        "pkv_attn_backend": (_cp, [_vp]),
        "pkv_tier_host_create": (_int, [_u64, _vp, _P(_vp)]),
        "pkv_tier_file_create": (_int, [_cp, _u64, _vp, _P(_vp)]),
        "pkv_tier_redis_create": (_int, [_cp, _int, _cp, _u32, _vp, _P(_vp)]),
        "pkv_tier_destroy": (None, [_vp]),
        "pkv_tier_get_stats": (_int, [_vp, _P(_TierStats)]),
        "pkv_tier_save": (_int, [_vp, _vp, _u64, _P(_u32)]),
        "pkv_tier_load": (_int, [_vp, _vp, _u64, _vp, _u32, _P(_u32)]),
        "pkv_tier_load_window": (_int, [_vp, _vp, _u64, _vp, _u32, _u32, _P(_u32)]),
        "pkv_tier_prefetch_start": (_int, [_vp, _u64]),
        "pkv_tier_prefetch": (_int, [_vp, _vp, _vp, _sz, _vp, _u32]),
        "pkv_tier_prefetch_window": (_int, [_vp, _vp, _vp, _sz, _vp, _u32, _u32]),
        "pkv_tier_prefetch_wait": (_int, [_vp]),
        "pkv_tier_save_async": (_int, [_vp, _vp, _u64, _P(_u32)]),
        "pkv_tier_flush": (_int, [_vp]),
        "pkv_attn_flags_used": (_u32, [_vp]),
        "pkv_cache_take_events": (_int, [_vp, _P(_Event), _sz, _vp, _P(_sz)]),
        "pkv_prefix_snapshot": (_int, [_vp, _P(_Event), _sz, _vp, _P(_sz)]),
        "pkv_prefix_hashes": (_int, [_vp, _sz, _u32, _vp, _sz, _vp, _sz, _P(_sz)]),
        "pkv_media_tokens": (_int, [_vp, _sz, _u32, _u32, _vp]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    code = 0
    while lib.pkv_dtype_name(code):  # NULL past the last one
        DTYPES[lib.pkv_dtype_name(code).decode()] = code
        code += 1
    _DTYPE_NAMES.update({v: k for k, v in DTYPES.items()})
    _lib = lib


_load()


def _check(rc, what):
    if rc != OK:
        raise PkvError(rc, what)


def _invalid(what):
    return PkvError(EINVAL, what)


def version():
    """The version string of the libpkv actually loaded ("MAJOR.MINOR.PATCH")."""
    return _lib.pkv_version().decode()


def strerror(code):
    """libpkv's description of a status code (an unknown one for a value no status has)."""
    code = int(code)
    if not -(1 << 31) <= code < 1 << 31:  # a C int: cut short, 2**40 would read as 0 (success)
        code = -(1 << 31)
    return _lib.pkv_strerror(code).decode()


def _salt_bytes(salt):
    """A namespace salt as bytes (str is UTF-8); anything else raises."""
    if isinstance(salt, str):
        return salt.encode()
    if not isinstance(salt, (bytes, bytearray, memoryview)):
        # bytes(3) would be three zero bytes: a tenant id passed as an int must not silently
        # land in another namespace
        raise _invalid("salt must be bytes or str, got %s" % type(salt).__name__)
    return bytes(salt)


def prefix_hashes(tokens, block_tokens, salt=b""):
    """The identity hashes (uint64 array) a cache with this block_tokens gives the full blocks of
    tokens under the namespace salt (pkv_prefix_hashes): what the events of Cache.take_events
    name. Needs no cache: a router compares them with each engine's events."""
    t = _i32_array(tokens, "prefix_hashes: tokens")
    salt = _salt_bytes(salt)
    bt = _u32_of(block_tokens, "block_tokens")
    out = np.empty(t.size // bt if bt else 0, dtype=np.uint64)
    n = _sz()
    _check(_lib.pkv_prefix_hashes(salt if salt else None, len(salt), bt, _ptr(t), t.size, _ptr(out), out.size,
                                  ctypes.byref(n)), "pkv_prefix_hashes")
    return out[:n.value]


def media_tokens(content_id, n, *, offset=0):
    """Token ids (int32 array, all negative) for n positions of an image, audio clip or other
    media in a prompt, positions offset .. offset + n - 1 of it, from content_id: a digest of
    the content and of how it was preprocessed (e.g. hashlib.sha256(...).digest()), or the
    bytes themselves (bytes, bytearray, anything with the buffer protocol such as a numpy
    array, whose bytes are taken; a str as UTF-8) (pkv_media_tokens). The prefix index compares
    token ids only, so a model's placeholder ids would let a prompt with another image match
    this one: append these in their place (the model still embeds its own) and pass them to
    match_prefix and prefix_hashes."""
    if isinstance(content_id, str):
        cid = content_id.encode()
    else:
        try:  # bytes(3) would be three zero bytes: every image the same; an int has no buffer
            cid = memoryview(content_id).tobytes()
        except TypeError:
            raise _invalid("media_tokens: content_id must be bytes, a buffer or str, got %s"
                           % type(content_id).__name__) from None
    if not cid:
        raise _invalid("media_tokens: content_id is empty (content with no identity)")
    n = _u32_of(n, "n")
    offset = _u32_of(offset, "offset")
    if offset + n > 1 << 32:
        raise _invalid("media_tokens: offset + n is over 2^32")
    out = np.empty(n, dtype=np.int32)
    _check(_lib.pkv_media_tokens(cid, len(cid), offset, n, _ptr(out) if n else None), "pkv_media_tokens")
    return out


def _events(buf, n, toks, block_tokens):
    out = []
    for i in range(n):
        e = buf[i]
        t = None
        if toks is not None and e.kind in (1, 2):
            t = toks[i * block_tokens:(i + 1) * block_tokens].copy()
        out.append(Event(e.seqno, _EVENT_KINDS.get(e.kind, e.kind), e.hash, e.parent_hash, e.depth, e.block, e.lost, t))
    return out


def _dtype_code(d, what):
    """A dtype name (pkv_dtype_from_name's: those of DTYPES, and "fp8") -> its pkv_dtype value."""
    out = _int()
    if not isinstance(d, str) or "\0" in d or _lib.pkv_dtype_from_name(d.encode(), ctypes.byref(out)) != OK:
        raise _invalid("%s: unknown dtype %r (one of %s)" % (what, d, ", ".join(DTYPES)))
    return out.value


def dtype_row_bytes(dtype, head_dim):
    """Bytes one token row of head_dim elements takes in the pool (0 if the dtype cannot hold it)."""
    return int(_lib.pkv_dtype_row_bytes(_dtype_code(dtype, "dtype_row_bytes"), _u32_of(head_dim, "head_dim")))


def bf16_bits(x):
    """Floating values -> their bf16 bit patterns (uint16, the same shape), rounded to nearest,
    ties to even, as libpkv rounds f32 into a bf16 pool: what write_kv(..., dtype="bf16") takes.
    Past the largest bf16 a value rounds to infinity; a NaN stays a (quiet) NaN."""
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise _invalid("bf16_bits: a floating array is needed, got %s" % a.dtype)
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():  # rounding a NaN's low mantissa bits away could make it an infinity
        bits[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return bits


def bf16_value(bits):
    """bf16 bit patterns (uint16) -> their float32 values (exact), the same shape."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise _invalid("bf16_value: a uint16 array of bf16 bit patterns is needed, got %s" % b.dtype)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _uint_of(x, what, bits):
    """x as an int in [0, 2^bits), else PkvError(EINVAL) (a float must be integral)."""
    try:
        v = int(x)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise _invalid("%s must be an integer" % what) from None
    if v != x or not 0 <= v < 1 << bits:
        raise _invalid("%s out of range: %r" % (what, x))
    return v


def _u32_of(x, what):
    return _uint_of(x, what, 32)


def _seq_of(s, what="sequence"):
    return _uint_of(s, what + " id", 64)


def _f32_array(x, what, size=None):
    """x as a C-contiguous float32 array (floating input converted), of `size` elements if given."""
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise _invalid("%s: a floating array is needed, got %s" % (what, a.dtype))
    a = np.require(a, dtype=np.float32, requirements="CA")
    if size is not None and a.size != size:
        raise _invalid("%s: %d elements, %d needed" % (what, a.size, size))
    return a


def _i32_array(x, what):
    a = np.asarray(x)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise _invalid("%s: an integer array is needed, got %s" % (what, a.dtype))
    if a.size > 0xFFFFFFFF:  # a C count is uint32: more would be cut short, not refused
        raise _invalid("%s: %d values, more than one call takes (2^32 - 1)" % (what, a.size))
    if a.size and (a.min() < -(1 << 31) or a.max() >= 1 << 31):
        raise _invalid("%s: values out of int32 range" % what)
    return np.require(a.reshape(-1), dtype=np.int32, requirements="CA")


def _ptr(a):
    return None if a is None else a.ctypes.data_as(_vp)


def _shape_check(a, dims, what):
    """EINVAL unless a is shaped as dims = (n, h, d), flattened after the first axis or whole
    ((n, h * d), (n * h * d,)), or for one row (h, d). An array of another shape, a transposed
    one among them, is refused rather than read in the wrong order."""
    n, h, d = dims
    if a.shape not in ((n, h, d), (n, h * d), (n * h * d,)) and not (n == 1 and a.shape == (h, d)):
        raise _invalid("%s: shape %s, [%d][%d][%d] needed (or flattened: (%d, %d) or (%d,))"
                       % (what, a.shape, n, h, d, n, h * d, n * h * d))


SeqInfo = namedtuple("SeqInfo", [f for f, _ in _SeqInfo._fields_])
TierStats = namedtuple("TierStats", [f for f, _ in _TierStats._fields_])
Layout = namedtuple("Layout", [f for f, _ in _Layout._fields_])


def merge(out_a, lse_a, out_b, lse_b):
    """Merges two partial attention results of the same queries over disjoint key sets
    (pkv_attn_merge): out_a, out_b [..., head_dim] (an MLA cache's outputs: [..., v_dim]),
    lse_a, lse_b the matching [...] natural-log sum-exps. Returns (out, lse) over the union,
    out shaped as out_a."""
    oa = _f32_array(out_a, "merge: out_a")
    if oa.ndim < 1 or oa.shape[-1] == 0:
        raise _invalid("merge: out_a needs a last axis of head_dim > 0")
    D = oa.shape[-1]
    rows = oa.size // D
    ob = _f32_array(out_b, "merge: out_b", oa.size)
    la = _f32_array(lse_a, "merge: lse_a", rows)
    lb = _f32_array(lse_b, "merge: lse_b", rows)
    if ob.shape != oa.shape:
        raise _invalid("merge: out_b shaped %s, out_a %s" % (ob.shape, oa.shape))
    for x, name in ((la, "lse_a"), (lb, "lse_b")):
        if x.shape not in (oa.shape[:-1], (rows,)):
            raise _invalid("merge: %s shaped %s, %s needed (out_a's without head_dim)" % (name, x.shape, oa.shape[:-1]))
    out = np.empty_like(oa)
    lse = np.empty(rows, dtype=np.float32)
    _check(_lib.pkv_attn_merge(_u32_of(rows, "rows"), D, _ptr(oa), _ptr(la), _ptr(ob), _ptr(lb), _ptr(out),
                               _ptr(lse)), "pkv_attn_merge")
    return out, lse.reshape(oa.shape[:-1])


def _in_call(f):
    """Runs a Cache method as one call in flight: refused on a closed cache, and close() waits
    until it has returned (so no call reads freed memory)."""
    @functools.wraps(f)
    def call(self, *args, **kw):
        self._enter()
        try:
            return f(self, *args, **kw)
        finally:
            self._leave()
    return call


class Cache:
    """A paged KV cache (pkv_cache): the pool, sequences, prefix index and attention.

    Keyword arguments are pkv_config's fields; those left out keep pkv_config_default()'s
    values: n_layers, n_kv_heads, head_dim, block_tokens, n_blocks, mem_budget_bytes,
    k_dtype and v_dtype (names: "f32", "f16", "bf16", "q8_0", "q4_0", "fp8_e4m3"), max_seqs,
    max_blocks_per_seq, n_threads, enable_prefix_cache, huge_pages, event_capacity, v_dim, spin_us
    and log (a callable log(level, message), called on the thread that makes the libpkv call).
    spin_us (default 50, at most 1000000) is how long the cache's attention threads poll for the
    next call before they sleep: raise it past the time between a model's attention calls when
    the cores are otherwise idle then (pkv.h).
    v_dim (0, the default: V has rows of its own) in 1..head_dim makes an MLA cache (multi-head
    latent attention, DeepSeek-V2 / V3: pkv.h's "MLA"): V lives in K, a token's V being the
    first v_dim values of its K row (v_dtype must equal k_dtype; q8_0 / q4_0 need v_dim a
    multiple of 32). Such a cache takes K alone (a v given to write_kv, write_kv_seq or
    write_stored raises InvalidArgumentError), gather, read_stored and kv_view return None for V,
    and attention returns outputs of v_dim values a head ([n][n_q_heads][v_dim]). The pool and every
    buffer attention needs are allocated here; close() (or the with-statement) frees them. A
    config libpkv refuses raises PkvError carrying its reason (e.g. "pkv_cache_create: head_dim 0
    not in 1..1024: invalid argument (EINVAL)").
    Several Python threads may use one cache at once (libpkv runs without the GIL), under the
    library's rule (pkv.h): calls that only read a sequence (attention, gather, info, forks of it)
    may overlap on it, a call that changes a sequence overlaps no other call on it. close()
    waits for the calls in flight on other threads to return, and the calls made after it raise
    PkvError (EINVAL). A Cache cannot be copied or pickled (it owns C memory: a copy would free
    it twice). Sequence handles are ints; one passed to another cache raises NotFoundError.
    """

    _INT_FIELDS = ("n_layers", "n_kv_heads", "head_dim", "block_tokens", "n_blocks", "max_seqs",
                   "max_blocks_per_seq", "n_threads", "event_capacity", "v_dim", "spin_us")

    def __init__(self, **kw):
        self._c = None
        self._cv = threading.Condition(threading.Lock())  # guards _c, _busy and _closing
        self._busy = 0  # calls in flight (_in_call)
        self._closing = False
        self._views = weakref.WeakValueDictionary()  # id -> a view's buffer, while alive
        cfg = _lib.pkv_config_default()
        user_log = None
        for k in list(kw):
            v = kw.pop(k)
            if k in self._INT_FIELDS:
                setattr(cfg, k, _u32_of(v, k))
            elif k == "mem_budget_bytes":
                cfg.mem_budget_bytes = _uint_of(v, k, 64)
            elif k in ("k_dtype", "v_dtype"):
                setattr(cfg, k, _dtype_code(v, k))
            elif k in ("enable_prefix_cache", "huge_pages"):
                setattr(cfg, k, 1 if v else 0)
            elif k == "log":
                if v is not None and not callable(v):
                    raise _invalid("log must be callable")
                user_log = v
            else:
                raise TypeError("Cache() got an unexpected keyword argument %r" % k)
        # the hook passes messages on to log, and keeps why a call refused (libpkv says it at
        # PKV_LOG_ERROR on the calling thread before the call returns: pkv.h) for the PkvError
        # that call raises. The callback lives as long as the cache. It must not refer to self: a
        # cycle through the callback would keep a dropped Cache alive until the cyclic garbage
        # collector runs.
        said = self._said = threading.local()

        def on_log(ctx, level, msg):
            text = msg.decode(errors="replace")
            if level == 0:  # PKV_LOG_ERROR
                said.msg = text
            if user_log is not None:
                said.in_log = True  # inside a libpkv call on this cache: close() must not wait for it
                try:
                    user_log(level, text)
                finally:
                    said.in_log = False
        self._log_cb = _LOG_FN(on_log)
        cfg.log = self._log_cb
        h = _vp()
        rc = _lib.pkv_cache_create(ctypes.byref(cfg), ctypes.byref(h))
        if rc != OK:
            raise PkvError(rc, self._why("pkv_cache_create"))
        self._c = h
        eff = _Config()
        self._check(_lib.pkv_cache_config(self._c, ctypes.byref(eff)), "pkv_cache_config")
        self._H, self._D, self._L = eff.n_kv_heads, eff.head_dim, eff.n_layers
        self._v_in_k = eff.v_dim != 0  # MLA: no V rows, V is K's first v_dim values
        self._Dv = eff.v_dim or eff.head_dim  # values an attention output row holds a head
        self._max_blocks = eff.max_blocks_per_seq

    # -- lifetime --
    def close(self):
        """Frees the cache (pkv_cache_destroy), once the calls other threads have in flight on it
        have returned. Later calls raise PkvError (EINVAL); a second close does nothing. While a
        view of the pool (kv_view) is alive, raises PkvError (EBUSY) and frees nothing: the
        cache is then freed when the last view and reference are gone. From the log callback
        (inside a call on this cache, which close would wait for) it raises EBUSY."""
        with self._cv:
            if not self._c:
                return
            if getattr(self._said, "in_log", False):
                raise PkvError(EBUSY, "close: called from the log callback, inside a call on this cache")
            if len(self._views):
                raise PkvError(EBUSY, "close: %d views of the pool are still alive" % len(self._views))
            self._closing = True  # calls made from now on are refused
            try:
                while self._busy:
                    self._cv.wait()
                if len(self._views):  # (a call in flight may have made one)
                    raise PkvError(EBUSY, "close: %d views of the pool are still alive" % len(self._views))
                self._destroy()
            finally:
                self._closing = False

    def _destroy(self):
        c = getattr(self, "_c", None)  # (absent if __init__ did not get that far)
        if c and _lib is not None:  # (None at interpreter exit)
            _lib.pkv_cache_destroy(c)
            self._c = None

    def _why(self, what):
        """What libpkv said on this thread about the call that just refused, else what."""
        said = self._said
        msg = getattr(said, "msg", None)
        said.msg = None
        return msg or what

    def _check(self, rc, what):
        if rc != OK:
            raise PkvError(rc, self._why(what))

    def _enter(self):
        if getattr(self._said, "in_log", False):  # libpkv holds the cache's lock around the hook
            raise PkvError(EBUSY, "a call on the cache from its log callback (inside a call on it)")
        with self._cv:
            if not self._c or self._closing:
                raise _invalid("the cache is closed")
            self._busy += 1

    def _leave(self):
        with self._cv:
            self._busy -= 1
            if self._closing and not self._busy:
                self._cv.notify_all()

    def __copy__(self):
        raise TypeError("a pagedkv.Cache cannot be copied: it owns its pool (C memory)")

    def __deepcopy__(self, memo):
        raise TypeError("a pagedkv.Cache cannot be copied: it owns its pool (C memory)")

    def __reduce__(self):
        raise TypeError("a pagedkv.Cache cannot be pickled: it owns its pool (C memory)")

    def __enter__(self):
        if not self._c:
            raise _invalid("the cache is closed")
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and len(self._views):
            return  # an exception is on its way: do not replace it by EBUSY; freed with the views
        self.close()

    def __del__(self):
        self._destroy()  # no view is alive here: each holds a reference to the cache

    def _h(self):
        if not self._c:
            raise _invalid("the cache is closed")
        return self._c

    # -- configuration --
    @property
    @_in_call
    def config(self):
        """The effective configuration (n_blocks, max_blocks_per_seq, n_threads resolved) as a dict;
        v_dim is 0 where V has rows of its own, else the MLA cache's v_dim."""
        c = _Config()
        self._check(_lib.pkv_cache_config(self._h(), ctypes.byref(c)), "pkv_cache_config")
        d = {k: getattr(c, k) for k in self._INT_FIELDS + ("mem_budget_bytes",)}
        d.update(k_dtype=_DTYPE_NAMES[c.k_dtype], v_dtype=_DTYPE_NAMES[c.v_dtype],
                 enable_prefix_cache=bool(c.enable_prefix_cache), huge_pages=bool(c.huge_pages))
        return d

    @property
    @_in_call
    def backend(self):
        """The attention kernel family in use ("ref", "avx2", "avx2-vnni", "avx512", "avx512-vnni", "avx512-amx",
        "neon", ...)."""
        return _lib.pkv_attn_backend(self._h()).decode()

    @property
    @_in_call
    def bf16_dot_used(self):
        """Whether bf16_dot=True changes this cache's attention (pkv_attn_flags_used): bf16 K or V
        and a backend with bf16 dot products, or fp8 e4m3, q8_0 or q4_0 K or V and one with bf16 tiles
        ("avx512-amx")."""
        return bool(_lib.pkv_attn_flags_used(self._h()) & ATTN_BF16_DOT)

    @property
    @_in_call
    def f16_as_bf16_used(self):
        """Whether f16_as_bf16=True changes this cache's attention (pkv_attn_flags_used): f16 K
        or V with head_dim (or v_dim) a multiple of 32, the other q8_0 or q4_0 only where bf16_dot=True
        is passed too, and a backend with bf16 tiles ("avx512-amx")."""
        return bool(_lib.pkv_attn_flags_used(self._h()) & ATTN_F16_AS_BF16)

    @_in_call
    def layout(self):
        """Where the pool lives (pkv_cache_layout), for engines with kernels of their own:
        k_base and v_base are addresses (ints), valid until close(). v_dim is the values a V row
        holds: head_dim, or on an MLA cache its v_dim, and then v_base, v_row_bytes and
        v_block_bytes are K's (V is the first v_dim values of each K row) and v_dtype k_dtype."""
        return self._layout()

    def _layout(self):  # (inside a call already: not counted again)
        lo = _Layout()
        self._check(_lib.pkv_cache_layout(self._h(), ctypes.byref(lo)), "pkv_cache_layout")
        vals = [getattr(lo, f) for f, _ in _Layout._fields_]
        vals[0], vals[1] = vals[0] or 0, vals[1] or 0
        d = Layout(*vals)
        return d._replace(k_dtype=_DTYPE_NAMES[d.k_dtype], v_dtype=_DTYPE_NAMES[d.v_dtype])

    @_in_call
    def kv_view(self, layer, writeable=False):
        """Zero-copy numpy views (K, V) of one layer's arrays in the pool, for engines with
        kernels of their own: [n_blocks][n_kv_heads][block_tokens][head_dim] of float32 or
        float16 (uint16 bit patterns for bf16), or [n_blocks][n_kv_heads][block_tokens][row
        bytes] uint8 for the quantized dtypes (scales inline, pagedkv.dtype_row_bytes). Read-only
        unless writeable=True; what is written through a view bypasses pkv_write_kv's checks
        (pkv.h: such rows are the caller's business). A view keeps the cache alive, and close()
        refuses (EBUSY) while one is. On an MLA cache (v_dim) there is no V array: V is None
        (a token's V is the first v_dim values of its K row: K[..., :v_dim] for f32, f16 and bf16)."""
        lo = self._layout()
        layer = _u32_of(layer, "layer")
        if layer >= lo.n_layers:
            raise _invalid("kv_view: layer %d of %d" % (layer, lo.n_layers))
        views = []
        arrays = [(lo.k_base, lo.k_dtype, lo.k_row_bytes, lo.k_block_bytes)]
        if not self._v_in_k:
            arrays.append((lo.v_base, lo.v_dtype, lo.v_row_bytes, lo.v_block_bytes))
        for base, dt, row, blk in arrays:
            buf = (ctypes.c_uint8 * (lo.n_blocks * blk)).from_address(base + layer * lo.layer_stride_bytes)
            buf._cache = self  # the cache outlives every view
            self._views[id(buf)] = buf
            a = np.frombuffer(buf, dtype=np.uint8)
            shape = (lo.n_blocks, lo.n_kv_heads, lo.block_tokens)
            elem = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}.get(dt)
            a = a.view(elem).reshape(shape + (lo.head_dim,)) if elem else a.reshape(shape + (row,))
            a.flags.writeable = bool(writeable)
            views.append(a)
        if self._v_in_k:
            views.append(None)
        return tuple(views)

    @_in_call
    def reset(self):
        """Releases every sequence and pin and empties the prefix index."""
        self._check(_lib.pkv_cache_reset(self._h()), "pkv_cache_reset")

    # -- sequences --
    @_in_call
    def seq_create(self, salt=b""):
        """A new empty sequence; salt (bytes, at most 256) names its prefix-index namespace."""
        salt = _salt_bytes(salt)
        out = _u64()
        self._check(_lib.pkv_seq_create(self._h(), salt if salt else None, len(salt), ctypes.byref(out)),
               "pkv_seq_create")
        return out.value

    @_in_call
    def append(self, seq, tokens):
        """Appends positions with these token ids; returns their slots (int32 array)."""
        t = _i32_array(tokens, "append: tokens")
        slots = np.empty(t.size, dtype=np.int32)
        self._check(_lib.pkv_seq_append(self._h(), _seq_of(seq), _ptr(t), t.size, _ptr(slots)), "pkv_seq_append")
        return slots

    @_in_call
    def append_blocks(self, seq, n):
        """How many FREE or CACHED blocks appending n positions to seq would take: the append
        succeeds iff that is at most stats()["n_free"] + stats()["n_cached"] (pkv_seq_append_blocks;
        ELIMIT past max_blocks_per_seq). Changes nothing: for budgeting a step before appending."""
        out = _u32()
        self._check(_lib.pkv_seq_append_blocks(self._h(), _seq_of(seq), _u32_of(n, "n"), ctypes.byref(out)),
               "pkv_seq_append_blocks")
        return out.value

    @_in_call
    def batch_append(self, reqs, fit=False):
        """A scheduler step's appends in one call (pkv_batch_append): reqs is a sequence of
        (seq, tokens) pairs naming distinct sequences. The budget check and the appends happen
        under one hold of the cache's lock, so no other thread's append takes the blocks between
        them. Without fit, every request is appended, in order, or none (NoSpaceError); with
        fit=True, the leading run of them that fits (first come, first served), the others left
        as they were. Returns the slots (int32 arrays) of the requests appended, in order: its
        length is how many were."""
        reqs = list(reqs)
        n = len(reqs)
        arr = (_AppendReq * max(n, 1))()
        keep = []  # the arrays C reads and writes, alive until it returns
        for i, r in enumerate(reqs):
            try:
                seq, tokens = r
            except (TypeError, ValueError):
                raise _invalid("batch_append: reqs[%d] is not a (seq, tokens) pair" % i) from None
            t = _i32_array(tokens, "batch_append: reqs[%d] tokens" % i)
            slots = np.empty(t.size, dtype=np.int32)
            keep.append((t, slots))
            arr[i].seq, arr[i].tokens, arr[i].n, arr[i].slots_out = _seq_of(seq), _ptr(t), t.size, _ptr(slots)
        done = _u32()
        self._check(_lib.pkv_batch_append(self._h(), ctypes.byref(arr), _u32_of(n, "batch_append: requests"),
                                          1 if fit else 0, ctypes.byref(done)), "pkv_batch_append")
        return [keep[i][1] for i in range(done.value)]

    def _kv_in(self, x, n, what, dtype):
        """x as the C-contiguous input array of pkv_write_kv and its pkv_dtype: dtype None infers
        f16 from float16 and f32 from other floating arrays (converted); "f32" takes any floating
        array (converted), "f16" a float16 one, "bf16" a uint16 one of bf16 bit patterns."""
        if x is None:
            return None, None
        a = np.asarray(x)
        kind = dtype if dtype is not None else ("f16" if a.dtype == np.float16 else "f32")
        need = {"f32": "a floating", "f16": "a float16", "bf16": "a uint16 (bf16 bit patterns)"}.get(kind)
        if need is None:
            raise _invalid("%s: input dtype is f32, f16 or bf16, not %r" % (what, dtype))
        ok = {"f32": a.dtype.kind == "f", "f16": a.dtype == np.float16, "bf16": a.dtype == np.uint16}[kind]
        if not ok:
            raise _invalid("%s: %s array is needed%s, got %s" % (
                what, need, "" if dtype else " (or give dtype='bf16' for uint16 bf16 bit patterns)", a.dtype))
        a = np.require(a, dtype=np.float32 if kind == "f32" else a.dtype, requirements="CA")
        want = n * self._H * self._D
        if a.size != want:
            raise _invalid("%s: %d elements, %d needed ([%d][%d][%d])" % (what, a.size, want, n, self._H, self._D))
        _shape_check(a, (n, self._H, self._D), what)
        return a, DTYPES[kind]

    @_in_call
    def write_kv(self, layer, slots, k=None, v=None, dtype=None):
        """Writes K and/or V of one layer at these slots (pkv_write_kv): k, v [n][n_kv_heads][head_dim]
        (or that flattened to [n][n_kv_heads * head_dim] or [n * n_kv_heads * head_dim]) float32 or float16 (other floating types are converted to float32), or uint16 bf16 bit
        patterns with dtype="bf16". Slot -1 skips a row. All-or-nothing. Slots name places in
        the pool, not a sequence: after a truncate, release or compaction of their sequence they
        may lie in another sequence's blocks, and a write through them changes that one. Take
        them again (slots()) after those calls. On an MLA cache (v_dim) v must be None: K alone
        is written, its first v_dim values being V."""
        self._no_v(v, "write_kv")
        s = _i32_array(slots, "write_kv: slots")
        ka, va, code = self._kv_pair(k, v, s.size, "write_kv", dtype)
        self._check(_lib.pkv_write_kv(self._h(), _u32_of(layer, "layer"), _ptr(s), s.size, _ptr(ka), _ptr(va),
                                 code), "pkv_write_kv")

    def _no_v(self, v, what):
        """EINVAL for a v given to an MLA cache (V lives in K: write k alone), before any shape
        check would misname the problem."""
        if v is not None and self._v_in_k:
            raise _invalid("%s: v given, but V lives in K here (v_dim %d): write k alone" % (what, self._Dv))

    def _kv_pair(self, k, v, n, what, dtype):
        """k and v (either None, not both) as _kv_in gives them, of one dtype: (ka, va, its code)."""
        ka, kc = self._kv_in(k, n, what + ": k", dtype)
        va, vc = self._kv_in(v, n, what + ": v", dtype)
        if ka is None and va is None:
            raise _invalid("%s: neither k nor v given" % what)
        if ka is not None and va is not None and kc != vc:
            raise _invalid("%s: k and v must have the same dtype" % what)
        return ka, va, kc if ka is not None else vc

    @_in_call
    def write_kv_seq(self, seq, layer, start, k=None, v=None, dtype=None):
        """Writes K and/or V of one layer for positions [start, start + n) of seq
        (pkv_seq_write_kv), n the rows of k or v, which take the shapes and dtypes of write_kv.
        All-or-nothing, with write_kv's checks. By position, so no slots are needed and none
        can be stale: the rows written are seq's own."""
        self._no_v(v, "write_kv_seq")
        x = k if k is not None else v
        row = self._H * self._D
        size = 0 if x is None else np.asarray(x).size
        if size % row:
            raise _invalid("write_kv_seq: %d elements, not a whole number of rows of [%d][%d]"
                           % (size, self._H, self._D))
        n = size // row
        ka, va, code = self._kv_pair(k, v, n, "write_kv_seq", dtype)
        self._check(_lib.pkv_seq_write_kv(self._h(), _seq_of(seq), _u32_of(layer, "layer"), _u32_of(start, "start"),
                                          _u32_of(n, "write_kv_seq: rows"), _ptr(ka), _ptr(va), code),
                    "pkv_seq_write_kv")

    @_in_call
    def commit(self, seq, n_pos):
        """Positions [0, n_pos) now hold K/V for every layer; full blocks enter the prefix index."""
        self._check(_lib.pkv_seq_commit(self._h(), _seq_of(seq), _u32_of(n_pos, "n_pos")), "pkv_seq_commit")

    @_in_call
    def fork(self, seq):
        """A new sequence sharing every block of seq (no data copied); returns its id."""
        out = _u64()
        self._check(_lib.pkv_seq_fork(self._h(), _seq_of(seq), ctypes.byref(out)), "pkv_seq_fork")
        return out.value

    @_in_call
    def truncate(self, seq, n):
        """Keeps positions [0, n)."""
        self._check(_lib.pkv_seq_truncate(self._h(), _seq_of(seq), _u32_of(n, "n")), "pkv_seq_truncate")

    @_in_call
    def drop_front(self, seq, pos):
        """Lets go of the blocks wholly before position pos, which a sliding window or chunked
        local attention no longer reads (pkv_seq_drop_front). Positions before
        seq_info(seq).n_dropped are then refused everywhere. Where the cache indexes prefixes,
        the dropped blocks stay indexed until evicted, so the same prompt still matches."""
        self._check(_lib.pkv_seq_drop_front(self._h(), _seq_of(seq), _u32_of(pos, "pos")), "pkv_seq_drop_front")

    @_in_call
    def keep(self, seq, start, idx):
        """Keeps positions start + idx[k] (idx strictly ascending) of seq's uncommitted tail, moved
        to start + k with their token ids and K/V, and drops the rest of the tail (pkv_seq_keep):
        the accepted path of a draft tree verified by tree()."""
        a = np.ascontiguousarray(np.asarray(idx, dtype=np.int64).reshape(-1))
        if a.size and (a.min() < 0 or a.max() >= 2**32):
            raise _invalid("keep: idx values must be in [0, 2^32)")
        a = a.astype(np.uint32)
        _u32_of(a.size, "keep: idx count")
        self._check(_lib.pkv_seq_keep(self._h(), _seq_of(seq), _u32_of(start, "start"), _ptr(a) if a.size else None,
                                      a.size), "pkv_seq_keep")

    @_in_call
    def shift(self, seq, start, end, rope=None):
        """Context shift (pkv_seq_shift): removes positions [start, end) of seq; the positions
        after them move down by end - start with their token ids and K/V, each K row turned back by
        as many positions of rope (a Rope; None: moved as stored, for K without RoPE). llama.cpp's
        context shift, StreamingLLM's cache. From start on, seq then indexes nothing in the prefix
        cache and a tier saves nothing (truncate(seq, start) or below makes it exact again); shared
        or indexed blocks are copied first (NoSpaceError where no block can be had)."""
        if rope is not None and not isinstance(rope, Rope):
            raise _invalid("shift: rope must be a pagedkv.Rope or None")
        r = rope._struct() if rope is not None else None
        self._check(_lib.pkv_seq_shift(self._h(), _seq_of(seq), _u32_of(start, "start"), _u32_of(end, "end"),
                                       ctypes.byref(r) if r is not None else None), "pkv_seq_shift")

    @_in_call
    def compact(self, seq, evict=False, cached=False):
        """Moves runs of seq's blocks that it alone holds (no fork or pin shares them) into FREE
        blocks (with evict=True also CACHED leaf blocks, evicted as an append would; with
        cached=True any CACHED block, exchanged so that it stays findable) so that its block
        table holds longer runs of consecutive ids: at each gap, the shorter of the two runs
        beside it that fits moves to meet the other (pkv.h, pkv_seq_compact). Returns the number
        of block copies (two an exchange). Slots and block tables taken before are stale for the
        moved blocks."""
        out = _u32()
        self._check(_lib.pkv_seq_compact(self._h(), _seq_of(seq), (1 if evict else 0) | (2 if cached else 0),
                                    ctypes.byref(out)), "pkv_seq_compact")
        return out.value

    @_in_call
    def batch_compact(self, seqs, slack=0, repack=False, cached=False):
        """Lays the blocks each of seqs holds alone out as one group a sequence in id order, over
        the FREE ids and the ids the batch holds, exchanging blocks where no room is free; a
        sequence laid out already stays (with repack=True every one is laid out again, from the
        lowest ids), the others move in the order given (pkv.h, pkv_batch_compact), leaving
        slack FREE ids after each where the FREE blocks allow. With cached=True the CACHED blocks
        of the prefix index are room too (exchanged: they stay findable). Returns the number of
        block copies. Slots and block tables of the batch taken before are stale."""
        a = self._seqs(seqs, "batch_compact")
        out = _u32()
        self._check(_lib.pkv_batch_compact(self._h(), _ptr(a), a.size, _u32_of(slack, "slack"),
                                      (1 if repack else 0) | (2 if cached else 0),
                                      ctypes.byref(out)), "pkv_batch_compact")
        return out.value

    @_in_call
    def release(self, seq):
        """Drops the sequence; its id becomes stale (ENOENT)."""
        self._check(_lib.pkv_seq_release(self._h(), _seq_of(seq)), "pkv_seq_release")

    @_in_call
    def seq_info(self, seq):
        """SeqInfo(n_tokens, n_committed, n_blocks, n_shared, n_reused, n_dropped)."""
        return self._info(seq)

    def _info(self, seq):  # (inside a call already: not counted again)
        i = _SeqInfo()
        self._check(_lib.pkv_seq_get_info(self._h(), _seq_of(seq), ctypes.byref(i)), "pkv_seq_get_info")
        return SeqInfo(*(getattr(i, f) for f, _ in _SeqInfo._fields_))

    def _range(self, seq, start, n, what):
        """start, n checked against the sequence's length before an output of n rows is made (so a
        huge n is EINVAL, as the C call would say, not an allocation of that size)."""
        start = _u32_of(start, "%s: start" % what)
        length = self._info(seq).n_tokens
        n = max(length - start, 0) if n is None else _u32_of(n, "%s: n" % what)
        if start + n > length:
            raise _invalid("%s: positions [%d, %d) past the sequence's %d" % (what, start, start + n, length))
        return start, n

    @_in_call
    def slots(self, seq, start=0, n=None):
        """Slots of positions [start, start + n) (default: to the end): vLLM's slot_mapping."""
        start, n = self._range(seq, start, n, "slots")
        out = np.empty(n, dtype=np.int32)
        self._check(_lib.pkv_seq_slots(self._h(), _seq_of(seq), start, n, _ptr(out)), "pkv_seq_slots")
        return out

    @_in_call
    def block_table(self, seq):
        """The sequence's block ids (int32 array)."""
        n = self._info(seq).n_blocks
        out = np.empty(n, dtype=np.int32)
        got = _u32()
        self._check(_lib.pkv_seq_block_table(self._h(), _seq_of(seq), _ptr(out), n, ctypes.byref(got)),
               "pkv_seq_block_table")
        return out[:got.value]

    @_in_call
    def gather(self, seq, layer, start=0, n=None):
        """K and V of positions [start, start + n) of one layer as float32 [n][n_kv_heads][head_dim]
        arrays (dequantized). On an MLA cache (v_dim) V is None: it is k[..., :v_dim]."""
        start, n = self._range(seq, start, n, "gather")
        k = np.empty((n, self._H, self._D), dtype=np.float32)
        v = None if self._v_in_k else np.empty_like(k)
        self._check(_lib.pkv_seq_gather(self._h(), _seq_of(seq), _u32_of(layer, "layer"), start, n, _ptr(k), _ptr(v)),
               "pkv_seq_gather")
        return k, v

    @_in_call
    def read_stored(self, seq, layer, start=0, n=None):
        """K and V of positions [start, start + n) of one layer exactly as the pool stores them
        (pkv_seq_read_stored): uint8 arrays [n][n_kv_heads][row bytes], k in the cache's k_dtype
        and v in its v_dtype (pagedkv.dtype_row_bytes; scales inline for the quantized dtypes).
        write_stored takes them back, into this cache or another of the same dtypes and
        head_dim, bit for bit: a sequence swapped out and in, or moved to another cache. On an
        MLA cache (v_dim) v is None (the K rows hold V)."""
        start, n = self._range(seq, start, n, "read_stored")
        lo = self._layout()
        k = np.empty((n, self._H, lo.k_row_bytes), dtype=np.uint8)
        v = None if self._v_in_k else np.empty((n, self._H, lo.v_row_bytes), dtype=np.uint8)
        self._check(_lib.pkv_seq_read_stored(self._h(), _seq_of(seq), _u32_of(layer, "layer"), start, n, _ptr(k),
                                             _ptr(v)), "pkv_seq_read_stored")
        return k, v

    @_in_call
    def write_stored(self, seq, layer, start, k=None, v=None):
        """Writes rows as read_stored gives them (pkv_seq_write_stored) to positions [start,
        start + n) of seq: k and/or v uint8 arrays of n x n_kv_heads rows of the pool's row bytes
        (any shape of that many bytes). All-or-nothing, with write_kv_seq's checks, and the rows
        are checked (a scale or value not finite, past PKV_VALUE_MAX, or a code the encoder never
        writes raises, nothing written). On an MLA cache (v_dim) v must be None."""
        self._no_v(v, "write_stored")
        lo = self._layout()
        arrs, ns = [], []
        for x, row, side in ((k, lo.k_row_bytes, "k"), (v, lo.v_row_bytes, "v")):
            if x is None:
                arrs.append(None)
                continue
            a = np.asarray(x)
            if a.dtype != np.uint8:
                raise _invalid("write_stored: %s: a uint8 array of stored rows is needed, got %s" % (side, a.dtype))
            a = np.require(a, requirements="CA")
            if a.size % (self._H * row):
                raise _invalid("write_stored: %s: %d bytes, not a whole number of positions of [%d][%d]"
                               % (side, a.size, self._H, row))
            arrs.append(a)
            ns.append(a.size // (self._H * row))
        if not ns:
            raise _invalid("write_stored: neither k nor v given")
        if len(ns) == 2 and ns[0] != ns[1]:
            raise _invalid("write_stored: k holds %d positions, v %d" % (ns[0], ns[1]))
        self._check(_lib.pkv_seq_write_stored(self._h(), _seq_of(seq), _u32_of(layer, "layer"),
                                              _u32_of(start, "start"), _u32_of(ns[0], "write_stored: rows"),
                                              _ptr(arrs[0]), _ptr(arrs[1])), "pkv_seq_write_stored")

    def _seqs(self, seqs, what):
        """Sequence ids as a C-contiguous uint64 array (an integer array is checked as a whole)."""
        a = np.asarray(seqs)
        if a.ndim == 0 and a.dtype.kind != "O":  # one id (an int, a 0-d array): not a list
            raise _invalid("%s: a list (or 1-D array) of sequence ids is needed, got one value" % what)
        if a.dtype.kind in "iu" and a.ndim == 1:
            if a.size and a.dtype.kind == "i" and a.min() < 0:
                raise _invalid("%s: a negative sequence id" % what)
            a = np.require(a, dtype=np.uint64, requirements="CA")
        else:
            a = np.require([_seq_of(s) for s in seqs], dtype=np.uint64, requirements="CA")
        if a.size == 0:
            raise _invalid("%s: no sequences" % what)
        _u32_of(a.size, "%s: sequence count" % what)
        return a

    @_in_call
    def export_dense(self, seqs, max_blocks=None):
        """vLLM's dense block tables: (block_tables [n_seqs][max_blocks] int32, unused -1;
        seq_lens [n_seqs] int32). max_blocks defaults to the cache's max_blocks_per_seq; one over
        it is PkvError(EINVAL) (no table is longer: the rest would be padding), raised before the
        tables are allocated."""
        a = self._seqs(seqs, "export_dense")
        mb = self._max_blocks if max_blocks is None else _u32_of(max_blocks, "max_blocks")
        if mb > self._max_blocks:
            raise _invalid("export_dense: max_blocks %d over the cache's max_blocks_per_seq %d"
                           % (mb, self._max_blocks))
        tables = np.empty((a.size, mb), dtype=np.int32)
        lens = np.empty(a.size, dtype=np.int32)
        self._check(_lib.pkv_export_dense(self._h(), _ptr(a), a.size, mb, _ptr(tables), _ptr(lens)), "pkv_export_dense")
        return tables, lens

    @_in_call
    def export_csr(self, seqs):
        """FlashInfer's paged layout: (indptr [n_seqs + 1], indices, last_page_len [n_seqs]), int32."""
        a = self._seqs(seqs, "export_csr")
        indptr = np.empty(a.size + 1, dtype=np.int32)
        last = np.empty(a.size, dtype=np.int32)
        need = _u32()
        cap = 0  # the first call sizes (EINVAL and the count); again if a table grew meanwhile
        for _ in range(4):
            indices = np.empty(max(cap, 1), dtype=np.int32)
            rc = _lib.pkv_export_csr(self._h(), _ptr(a), a.size, _ptr(indptr), _ptr(indices), cap, _ptr(last),
                                     ctypes.byref(need))
            if rc != EINVAL or need.value <= cap:
                break
            cap = need.value
        self._check(rc, "pkv_export_csr")
        return indptr, indices[:int(indptr[-1])], last

    # -- prefix cache --
    @_in_call
    def tier_save(self, tier, seq):
        """Stores the full committed blocks of seq that tier lacks (pkv_tier_save); returns how
        many it stored. A store that refuses an entry for want of room is not an error; one that
        fails otherwise (Redis unreachable: IoError) fails the call, and the entries it stored are
        deleted again."""
        if not isinstance(tier, Tier):
            raise _invalid("tier_save: a pagedkv.Tier is needed, got %s" % type(tier).__name__)
        out = _u32()
        with tier._use():
            self._check(_lib.pkv_tier_save(tier._t, self._h(), _seq_of(seq), ctypes.byref(out)), "pkv_tier_save")
        return out.value

    @_in_call
    def tier_load(self, tier, seq, tokens):
        """For a sequence whose positions are all committed and are the prompt's first tokens (as
        match_prefix leaves it, or empty): appends, writes and commits the prompt's next blocks
        from tier, up to the first it lacks, never the prompt's last token (pkv_tier_load);
        returns the positions added. A miss, a refused entry or a full pool ends the load."""
        return self._tier_load("tier_load", tier, seq, tokens, None)

    def _tier_load(self, what, tier, seq, tokens, window):
        """pkv_tier_load (window None) or pkv_tier_load_window for tier_load and tier_load_window."""
        if not isinstance(tier, Tier):
            raise _invalid("%s: a pagedkv.Tier is needed, got %s" % (what, type(tier).__name__))
        t = _i32_array(tokens, what + ": tokens")
        out = _u32()
        with tier._use():
            if window is None:
                rc = _lib.pkv_tier_load(tier._t, self._h(), _seq_of(seq), _ptr(t), t.size, ctypes.byref(out))
            else:
                rc = _lib.pkv_tier_load_window(tier._t, self._h(), _seq_of(seq), _ptr(t), t.size, window,
                                               ctypes.byref(out))
            self._check(rc, "pkv_" + what)
        return out.value

    @_in_call
    def tier_load_window(self, tier, seq, tokens, window):
        """tier_load for layers that attend through a sliding window of `window` positions (or
        chunks of local attention: pass attn_chunk), the tier's side of match_prefix_window
        (pkv_tier_load_window). Into an empty sequence it loads only what the window of the
        longest prefix the tier can restore reads, and drops the front before it (seq_info's
        n_dropped); the positions returned count the front's. Into a sequence that holds
        positions it is tier_load. EINVAL for window 0."""
        return self._tier_load("tier_load_window", tier, seq, tokens, window)

    @_in_call
    def tier_save_async(self, tier, seq):
        """As tier_save, but the store's puts are left to tier's thread (Tier.prefetch_start
        first): the entries are made now (seq may be released on return) and queued; returns how
        many (0: no room in staging, so they were saved now). Tier.flush waits for them."""
        if not isinstance(tier, Tier):
            raise _invalid("tier_save_async: a pagedkv.Tier is needed, got %s" % type(tier).__name__)
        out = _u32()
        with tier._use():
            self._check(_lib.pkv_tier_save_async(tier._t, self._h(), _seq_of(seq), ctypes.byref(out)),
                        "pkv_tier_save_async")
        return out.value

    @_in_call
    def tier_prefetch(self, tier, tokens, salt=b"", window=0):
        """Queues the prompt's full blocks (namespace salt, this cache's shape) for tier's prefetch
        thread to stage in host memory ahead of tier_load (pkv_tier_prefetch; Tier.prefetch_start
        first); returns at once. With window: only those the window of the whole prompt reads,
        ahead of tier_load_window (pkv_tier_prefetch_window). BusyError when 64 prefetches are
        queued."""
        if not isinstance(tier, Tier):
            raise _invalid("tier_prefetch: a pagedkv.Tier is needed, got %s" % type(tier).__name__)
        t = _i32_array(tokens, "tier_prefetch: tokens")
        salt = _salt_bytes(salt)
        sp = salt if salt else None
        with tier._use():
            if window:
                _check(_lib.pkv_tier_prefetch_window(tier._t, self._h(), sp, len(salt), _ptr(t), t.size, window),
                       "pkv_tier_prefetch_window")
            else:
                _check(_lib.pkv_tier_prefetch(tier._t, self._h(), sp, len(salt), _ptr(t), t.size),
                       "pkv_tier_prefetch")

    @_in_call
    def match_prefix(self, seq, tokens):
        """For an empty sequence and its prompt: attaches the longest indexed prefix; returns the
        number of tokens reused (never the whole prompt). Matching full blocks are shared; the
        matching leading tokens of the next block are copied into a fresh block (best effort:
        the 64 newest candidates; see pkv_seq_match_prefix in pkv.h)."""
        t = _i32_array(tokens, "match_prefix: tokens")
        out = _u32()
        self._check(_lib.pkv_seq_match_prefix(self._h(), _seq_of(seq), _ptr(t), t.size, ctypes.byref(out)),
               "pkv_seq_match_prefix")
        return out.value

    @_in_call
    def match_prefix_window(self, seq, tokens, window):
        """match_prefix for a cache whose layers attend through a sliding window of `window`
        positions (or chunks of attn_chunk: pass that): reuses the prefix whose last window's
        blocks hold K/V, matching through evicted blocks' tombstones before them, and leaves the
        sequence's front dropped before the first key its next query sees (seq_info(seq).n_dropped;
        pkv_seq_match_prefix_window). Returns the tokens reused."""
        t = _i32_array(tokens, "match_prefix_window: tokens")
        out = _u32()
        self._check(_lib.pkv_seq_match_prefix_window(self._h(), _seq_of(seq), _ptr(t), t.size,
                                                     _u32_of(window, "window"), ctypes.byref(out)),
                    "pkv_seq_match_prefix_window")
        return out.value

    @_in_call
    def pin(self, seq, n_pos):
        """Pins the committed full blocks of positions [0, n_pos) of seq; returns the pin's handle."""
        out = _u64()
        self._check(_lib.pkv_pin_create(self._h(), _seq_of(seq), _u32_of(n_pos, "n_pos"), ctypes.byref(out)),
               "pkv_pin_create")
        return out.value

    @_in_call
    def pin_release(self, pin):
        self._check(_lib.pkv_pin_release(self._h(), _seq_of(pin, "pin")), "pkv_pin_release")

    # -- prefix-index events --
    @_in_call
    def take_events(self, max_events=1024, tokens=False):
        """Takes the oldest recorded prefix-index events, at most max_events, as a list of Event
        (pkv_cache_take_events; the cache needs event_capacity > 0). An "overflow" event means the
        ring was full and events were dropped: rebuild from prefix_snapshot()."""
        c = _Config()
        self._check(_lib.pkv_cache_config(self._h(), ctypes.byref(c)), "pkv_cache_config")
        cap = min(_uint_of(max_events, "max_events", 32), c.event_capacity)  # the ring holds no more
        bt = c.block_tokens
        buf = (_Event * max(cap, 1))()
        toks = np.empty(cap * bt, dtype=np.int32) if tokens else None
        n = _sz()
        self._check(_lib.pkv_cache_take_events(self._h(), buf, cap, _ptr(toks), ctypes.byref(n)),
                    "pkv_cache_take_events")
        return _events(buf, n.value, toks, bt)

    @_in_call
    def prefix_snapshot(self, tokens=False):
        """The whole prefix index as "stored" events (seqno 0), parents first; the recorded events
        are forgotten in the same step (pkv_prefix_snapshot)."""
        bt = self._block_tokens()
        st = _Stats()
        self._check(_lib.pkv_cache_get_stats(self._h(), ctypes.byref(st)), "pkv_cache_get_stats")
        cap = st.n_indexed + st.n_tombstones + 64  # room for what other threads index meanwhile, usually
        while True:
            buf = (_Event * max(cap, 1))()
            toks = np.empty(cap * bt, dtype=np.int32) if tokens else None
            n = _sz()
            rc = _lib.pkv_prefix_snapshot(self._h(), buf, cap, _ptr(toks), ctypes.byref(n))
            if rc == ELIMIT and n.value > cap:  # the index grew past that: again, with room
                self._why("")  # forget the refusal it said
                cap = n.value + 64
                continue
            self._check(rc, "pkv_prefix_snapshot")
            return _events(buf, n.value, toks, bt)

    def _block_tokens(self):
        c = _Config()
        self._check(_lib.pkv_cache_config(self._h(), ctypes.byref(c)), "pkv_cache_config")
        return c.block_tokens

    # -- statistics and checker --
    @_in_call
    def stats(self):
        """pkv_cache_get_stats as a dict."""
        s = _Stats()
        self._check(_lib.pkv_cache_get_stats(self._h(), ctypes.byref(s)), "pkv_cache_get_stats")
        return {f: getattr(s, f) for f, _ in _Stats._fields_}

    @_in_call
    def check(self):
        """Verifies every invariant; raises PkvError (ECORRUPT, with the checker's message) if one is broken."""
        buf = ctypes.create_string_buffer(512)
        rc = _lib.pkv_cache_check(self._h(), buf, len(buf))
        self._check(rc, "pkv_cache_check: " + buf.value.decode(errors="replace"))

    # -- attention --
    def _params(self, n_q_heads, scale, softcap, window, lse, flags, sinks, alibi_slopes, attn_chunk, what):
        """The pkv_attn_params, and the sinks and ALiBi slope arrays it points to (the caller
        keeps them alive)."""
        p = _lib.pkv_attn_params_default()
        p.n_q_heads = _u32_of(n_q_heads, "n_q_heads")
        p.scale, p.softcap = float(scale), float(softcap)
        p.window = _u32_of(window, "window")
        p.attn_chunk = _u32_of(attn_chunk, "attn_chunk")
        p.lse = _ptr(lse)
        p.flags = flags
        keep = []
        for name, arr in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):  # one float a query head
            if arr is not None:
                a = _f32_array(arr, "%s: %s" % (what, name))
                if a.size != p.n_q_heads:
                    raise _invalid("%s: %s has %d elements, n_q_heads %d needed" % (what, name, a.size, p.n_q_heads))
                setattr(p, name, _ptr(a))
                keep.append(a)
        return p, keep

    def _attn_io(self, q, n_queries, n_q_heads, out, lse_out, return_lse, params, what):
        """An attention call's queries, outputs (new or the caller's), lse and parameters
        (scale, softcap, window, flags, sinks, alibi_slopes, attn_chunk): (q, out, lse, pkv_attn_params,
        the arrays the params point to, which the caller keeps alive through the call)."""
        qa, hq = self._q(q, n_queries, n_q_heads, what)
        if out is not None and self._Dv != self._D and isinstance(out, np.ndarray) and np.may_share_memory(out, qa):
            raise _invalid("%s: out overlaps q; out may not be q where v_dim (%d) is not head_dim (%d)"
                           % (what, self._Dv, self._D))
        out = self._out(out, (n_queries, hq, self._Dv), "%s: out" % what)
        if lse_out is not None and not return_lse:
            raise _invalid("%s: lse_out given without return_lse=True" % what)
        lse = self._out(lse_out, (n_queries, hq), "%s: lse_out" % what) if return_lse else None
        scale, softcap, window, flags, sinks, alibi_slopes, attn_chunk = params
        p, sk = self._params(hq, scale, softcap, window, lse, flags, sinks, alibi_slopes, attn_chunk, what)
        return qa, out, lse, p, sk

    def _q(self, q, n_queries, n_q_heads, what):
        a = _f32_array(q, what)
        if n_q_heads is None:
            if a.ndim != 3:
                raise _invalid("%s: q is [n][n_q_heads][head_dim]; give n_q_heads for a flat q" % what)
            n_q_heads = a.shape[1]
        n_q_heads = _u32_of(n_q_heads, "n_q_heads")
        if n_q_heads == 0:
            raise _invalid("%s: n_q_heads is 0" % what)
        if a.size != n_queries * n_q_heads * self._D:
            raise _invalid("%s: q has %d elements, %d needed ([%d][%d][%d])"
                           % (what, a.size, n_queries * n_q_heads * self._D, n_queries, n_q_heads, self._D))
        _shape_check(a, (n_queries, n_q_heads, self._D), "%s: q" % what)
        return a, n_q_heads

    def _out(self, out, shape, what):
        """A caller's output array (float32, C-contiguous, shaped as shape or flattened after its
        first axis or whole), or a new one."""
        if out is None:
            return np.empty(shape, dtype=np.float32)
        size = int(np.prod(shape))
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous \
                or not out.flags.aligned or not out.flags.writeable or out.size != size:
            raise _invalid("%s: a writeable, aligned, C-contiguous float32 array of %d elements is needed"
                           % (what, size))
        if out.shape not in (tuple(shape), (shape[0], size // max(shape[0], 1)), (size,)):
            raise _invalid("%s: shape %s, %s needed (or flattened)" % (what, out.shape, tuple(shape)))
        return out

    @_in_call
    def decode(self, layer, seqs, q, n_q_heads=None, scale=0.0, softcap=0.0, window=0, return_lse=False,
               out=None, lse_out=None, bf16_dot=False, sinks=None, alibi_slopes=None, attn_chunk=0,
               f16_as_bf16=False):
        """Decode attention (pkv_attn_decode): one query per sequence at its last position.
        q: [n_seqs][n_q_heads][head_dim] (float32; n_q_heads from its shape unless given).
        Returns out shaped [n_seqs][n_q_heads][head_dim] ([..][v_dim] on an MLA cache), and lse
        [n_seqs][n_q_heads] with return_lse. scale 0 means 1/sqrt(head_dim) (MLA: give the
        model's). softcap and window 0 mean off. out (and lse_out) may be given, float32
        C-contiguous arrays of those sizes, to be written in place of new ones (out may be q
        itself when q is such an array, except on an MLA cache whose v_dim is not head_dim).
        bf16_dot: allow bf16 arithmetic with bf16 K/V (PKV_ATTN_BF16_DOT: queries and softmax
        weights rounded to bf16 where the CPU has bf16 dot products; with fp8 e4m3, q8_0 and q4_0
        K/V the same on avx512-amx's tiles, in units of 16 query rows a kv head and more; bf16_dot_used says
        whether it does here). f16_as_bf16: allow f16 K/V to be computed as bf16 (PKV_ATTN_F16_AS_BF16:
        f16 K and the queries, f16 V and the softmax weights, rounded to bf16 where the backend
        has bf16 tiles, in units of 16 query rows a kv head and more; f16_as_bf16_used says
        whether it does here). sinks: n_q_heads finite attention-sink logits (gpt-oss; pkv_attn_params.sinks), each head's
        softmax counting one more key of that logit and value 0; lse then includes it.
        alibi_slopes: n_q_heads ALiBi slopes (BLOOM, MPT; pkv_attn_params.alibi_slopes), each
        finite with magnitude at most 65536: head h's logit of the key at position k for the
        query at p gains alibi_slopes[h] * (k - p), after the soft-cap. attn_chunk: chunked
        local attention (Llama 4's attention_chunk_size; pkv_attn_params.attn_chunk): the query
        at p sees only [p - p % attn_chunk, p]; 0 means off."""
        a = self._seqs(seqs, "decode")
        qa, out, lse, p, _sk = self._attn_io(q, a.size, n_q_heads, out, lse_out, return_lse,
                                             (scale, softcap, window, _flags(bf16_dot, f16_as_bf16), sinks, alibi_slopes, attn_chunk),
                                             "decode")
        self._check(_lib.pkv_attn_decode(self._h(), _u32_of(layer, "layer"), _ptr(a), a.size, _ptr(qa), _ptr(out),
                                    ctypes.byref(p)), "pkv_attn_decode")
        return (out, lse) if return_lse else out

    @_in_call
    def prefill(self, layer, reqs, q, n_q_heads=None, scale=0.0, softcap=0.0, window=0, return_lse=False,
                out=None, lse_out=None, bf16_dot=False, sinks=None, alibi_slopes=None, attn_chunk=0, causal=True,
                masks=None, f16_as_bf16=False):
        """Prefill / extend attention over a ragged batch (pkv_attn_prefill), causal unless causal=False.
        reqs: (seq, q_start, n_q) triples; q: the requests' queries concatenated,
        [sum n_q][n_q_heads][head_dim]. Returns out (and lse) like decode, one row per query
        ([sum n_q][n_q_heads][v_dim] on an MLA cache); out, lse_out, bf16_dot, f16_as_bf16, sinks,
        alibi_slopes and attn_chunk as in decode. causal=False (PKV_ATTN_NONCAUSAL): each query
        sees its whole sequence, [0, length): an encoder's self-attention, or cross-attention
        over a sequence holding an encoder's K/V; q_start must then be 0 and n_q may be any
        count (window, attn_chunk and alibi_slopes are refused with it).
        masks: custom masks (pkv_attn_prefill_masked), one per request: None leaves the request
        to the rule above; else a boolean array [n_q][kv_len], kv_len = q_start + n_q (with
        causal=False the sequence's length), whose [j][t] says whether query j sees key t:
        causality is the mask's to say (keys ahead of a query may be seen: bidirectional image
        or prefix tokens; documents packed in one sequence kept apart). A mask may also be given
        packed already: a 1-D uint8 array of exactly ceil(n_q * kv_len / 8) bytes, as
        numpy.packbits(m, axis=None, bitorder="little") (and FlashInfer's packbits) makes it. A
        query that sees no key gets 0 (lse -inf, or the sink's). window and attn_chunk are refused
        with a mask."""
        rs = list(reqs)
        if not rs:
            raise _invalid("prefill: no requests")
        _u32_of(len(rs), "prefill: request count")
        arr = (_AttnReq * len(rs))()
        total = 0
        for i, r in enumerate(rs):
            try:
                seq, q_start, n_q = r
            except (TypeError, ValueError):
                raise _invalid("prefill: a request is a (seq, q_start, n_q) triple") from None
            arr[i].seq, arr[i].q_start, arr[i].n_q = _seq_of(seq), _u32_of(q_start, "q_start"), _u32_of(n_q, "n_q")
            total += arr[i].n_q
        qa, out, lse, p, _sk = self._attn_io(q, total, n_q_heads, out, lse_out, return_lse,
                                             (scale, softcap, window, _flags(bf16_dot, f16_as_bf16), sinks, alibi_slopes, attn_chunk),
                                             "prefill")
        if not causal:
            p.flags |= ATTN_NONCAUSAL
        if masks is None:
            self._check(_lib.pkv_attn_prefill(self._h(), _u32_of(layer, "layer"), ctypes.cast(arr, _vp), len(rs),
                                              _ptr(qa), _ptr(out), ctypes.byref(p)), "pkv_attn_prefill")
            return (out, lse) if return_lse else out
        packed = self._masks(masks, arr, causal)
        ptrs = (_vp * len(rs))(*[None if m is None else m.ctypes.data for m in packed])
        self._check(_lib.pkv_attn_prefill_masked(self._h(), _u32_of(layer, "layer"), ctypes.cast(arr, _vp), len(rs),
                                                 ctypes.cast(ptrs, _vp), _ptr(qa), _ptr(out), ctypes.byref(p)),
                    "pkv_attn_prefill_masked")
        return (out, lse) if return_lse else out

    def _masks(self, masks, arr, causal):
        """prefill's masks, each checked against its request's [n_q][kv_len] and packed as the C
        call reads them (numpy.packbits, little bit order), or None."""
        ms = list(masks)
        if len(ms) != len(arr):
            raise _invalid("prefill: %d masks for %d requests" % (len(ms), len(arr)))
        packed = []
        for i, m in enumerate(ms):
            if m is None:
                packed.append(None)
                continue
            r = arr[i]
            kv_len = r.q_start + r.n_q if causal else self._info(r.seq).n_tokens
            a = np.asarray(m)
            if a.dtype == np.uint8 and a.ndim == 1:  # packed already (packbits, little bit order)
                need = (r.n_q * kv_len + 7) // 8
                if a.size != need:
                    raise _invalid("prefill: packed mask %d has %d bytes, %d needed (%d x %d bits)"
                                   % (i, a.size, need, r.n_q, kv_len))
                packed.append(np.ascontiguousarray(a))
                continue
            if a.dtype != np.bool_:
                raise _invalid("prefill: mask %d is %s, a boolean array (or packed uint8 bytes) is needed"
                               % (i, a.dtype))
            if a.shape != (r.n_q, kv_len):
                raise _invalid("prefill: mask %d is shaped %s, (%d, %d) needed ([n_q][kv_len])"
                               % (i, a.shape, r.n_q, kv_len))
            packed.append(np.packbits(a, axis=None, bitorder="little"))
        return packed

    @_in_call
    def tree(self, layer, reqs, q, n_q_heads=None, scale=0.0, softcap=0.0, window=0, return_lse=False,
             out=None, lse_out=None, bf16_dot=False, sinks=None, alibi_slopes=None, attn_chunk=0,
             f16_as_bf16=False):
        """Tree attention (pkv_attn_tree) for speculative decoding: reqs are (seq, q_start,
        parents) triples, node i of a request at position q_start + i with parent parents[i]
        (in [-1, i), -1 for a root); node i sees the positions before q_start and its path to
        its root, itself included. q: the requests' nodes' queries concatenated, [sum
        nodes][n_q_heads][head_dim]. Returns out (and lse) like prefill ([..][v_dim] on an MLA
        cache); out may not be q. The other arguments as in decode (ALiBi's distance for node i
        counts from its position in the text, q_start + its depth, as the window's and the
        chunk's do)."""
        rs = list(reqs)
        if not rs:
            raise _invalid("tree: no requests")
        _u32_of(len(rs), "tree: request count")
        arr = (_TreeReq * len(rs))()
        keep = []
        total = 0
        for i, r in enumerate(rs):
            try:
                seq, q_start, parents = r
            except (TypeError, ValueError):
                raise _invalid("tree: a request is a (seq, q_start, parents) triple") from None
            pa = np.ascontiguousarray(np.asarray(parents, dtype=np.int64).reshape(-1))
            if pa.size and (pa.min() < -1 or pa.max() >= 2**31):
                raise _invalid("tree: request %d: a parent outside [-1, 2^31)" % i)
            pa = pa.astype(np.int32)
            keep.append(pa)
            arr[i].seq, arr[i].q_start = _seq_of(seq), _u32_of(q_start, "q_start")
            arr[i].n_nodes, arr[i].parent = _u32_of(pa.size, "tree: nodes"), _ptr(pa) if pa.size else None
            total += pa.size
        qa, out, lse, p, _sk = self._attn_io(q, total, n_q_heads, out, lse_out, return_lse,
                                             (scale, softcap, window, _flags(bf16_dot, f16_as_bf16), sinks, alibi_slopes, attn_chunk),
                                             "tree")
        self._check(_lib.pkv_attn_tree(self._h(), _u32_of(layer, "layer"), ctypes.cast(arr, _vp), len(rs), _ptr(qa),
                                       _ptr(out), ctypes.byref(p)), "pkv_attn_tree")
        return (out, lse) if return_lse else out


class Tier:
    """A storage tier (pkv_tier): whole prefix blocks kept out of the pool, in host memory, in
    files or in Redis, for Cache.tier_load to copy back instead of recomputing them (see
    "storage tiers" in pkv.h). Made by Tier.host(capacity_bytes), Tier.file(dir,
    capacity_bytes) or Tier.redis(host, port, key_prefix=None, timeout_ms=0); close() (or the
    with-statement) frees it, after the calls in flight on other threads have returned. One
    tier may serve several caches and threads.

        with pagedkv.Tier.host(1 << 30) as t:
            reused = c.match_prefix(s, prompt)
            reused += c.tier_load(t, s, prompt)
            ...                                   # compute and commit the rest
            c.tier_save(t, s)
    """

    def __init__(self, _handle=None):
        if not isinstance(_handle, _vp) or not _handle:
            raise TypeError("use Tier.host(), Tier.file() or Tier.redis()")
        self._t = _handle
        self._cv = threading.Condition(threading.Lock())
        self._busy = 0

    @classmethod
    def _made(cls, what, fn, *args):
        h = _vp()
        _check(fn(*args, None, ctypes.byref(h)), what)
        return cls(h)

    @classmethod
    def host(cls, capacity_bytes):
        """Host memory: at most capacity_bytes (> 0) of entries, the least recently used dropped."""
        return cls._made("pkv_tier_host_create", _lib.pkv_tier_host_create, _uint_of(capacity_bytes, "capacity_bytes", 64))

    @classmethod
    def file(cls, dir, capacity_bytes):
        """Files in dir (made if missing; entries already there are taken over), at most
        capacity_bytes of them, the least recently used dropped. IoError where dir cannot be used."""
        d = os.fsencode(dir)
        if b"\0" in d:
            raise _invalid("Tier.file: dir contains a NUL byte")
        return cls._made("pkv_tier_file_create", _lib.pkv_tier_file_create, d, _uint_of(capacity_bytes, "capacity_bytes", 64))

    @classmethod
    def redis(cls, host, port, key_prefix=None, timeout_ms=0):
        """Redis at host:port, keys under key_prefix (None: "pkv:"); the server's maxmemory and
        maxmemory-policy decide what stays. NotSupportedError where libpkv was built without
        hiredis, IoError where the server does not answer."""
        h = host.encode() if isinstance(host, str) else host
        p = None if key_prefix is None else (key_prefix.encode() if isinstance(key_prefix, str) else key_prefix)
        if not isinstance(h, bytes) or b"\0" in h or (p is not None and (not isinstance(p, bytes) or b"\0" in p)):
            raise _invalid("Tier.redis: host and key_prefix must be strings without NUL bytes")
        port = _uint_of(port, "port", 31)
        return cls._made("pkv_tier_redis_create", _lib.pkv_tier_redis_create, h, port, p, _u32_of(timeout_ms, "timeout_ms"))

    class _Use:
        def __init__(self, tier):
            self.tier = tier

        def __enter__(self):
            t = self.tier
            with t._cv:
                if not t._t:
                    raise _invalid("the tier is closed")
                t._busy += 1

        def __exit__(self, *exc):
            t = self.tier
            with t._cv:
                t._busy -= 1
                if not t._busy:
                    t._cv.notify_all()

    def _use(self):
        return Tier._Use(self)

    def stats(self):
        """Its counters (pkv_tier_get_stats) as a TierStats: the store's entries, bytes, capacity
        and evictions (0 for Redis), and saved, save_present, save_no_room, loaded_blocks,
        loaded_tokens, load_misses, rejected, errors, and the prefetch's prefetched, prefetch_hits,
        prefetch_dropped, staged_entries and staged_bytes."""
        st = _TierStats()
        with self._use():
            _check(_lib.pkv_tier_get_stats(self._t, ctypes.byref(st)), "pkv_tier_get_stats")
        return TierStats(*(getattr(st, f) for f, _ in _TierStats._fields_))

    def prefetch_start(self, staging_bytes):
        """Starts the tier's prefetch thread with staging_bytes of host memory for staged entries
        (pkv_tier_prefetch_start; once). Then Cache.tier_prefetch queues a prompt."""
        with self._use():
            _check(_lib.pkv_tier_prefetch_start(self._t, _uint_of(staging_bytes, "staging_bytes", 64)),
                   "pkv_tier_prefetch_start")

    def flush(self):
        """Waits until the writes queued by Cache.tier_save_async before the call are in the store
        (not those other threads queue after it); IoError when a put failed since the last flush
        (pkv_tier_flush; the GIL is released meanwhile)."""
        with self._use():
            _check(_lib.pkv_tier_flush(self._t), "pkv_tier_flush")

    def prefetch_wait(self):
        """Waits until every queued prefetch is done (the GIL is released meanwhile)."""
        with self._use():
            _check(_lib.pkv_tier_prefetch_wait(self._t), "pkv_tier_prefetch_wait")

    def close(self):
        """Frees the tier once the calls in flight on it have returned (a file tier's files
        stay); a second close does nothing."""
        with self._cv:
            while self._busy:
                self._cv.wait()
            h, self._t = self._t, None
        if h and _lib is not None:
            _lib.pkv_tier_destroy(h)

    def __enter__(self):
        if not self._t:
            raise _invalid("the tier is closed")
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        h = getattr(self, "_t", None)
        if h and _lib is not None:
            _lib.pkv_tier_destroy(h)
            self._t = None

    def __reduce__(self):
        raise TypeError("a pagedkv.Tier cannot be pickled: it owns C memory")
