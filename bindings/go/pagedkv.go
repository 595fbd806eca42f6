// Package pagedkv binds libpkv, a paged KV cache and paged attention for LLM inference, through
// cgo.
//
// Every method is one libpkv call. A status other than PKV_OK is an *Error carrying it; every
// slice's length is checked against the call before libpkv sees it (the C API cannot see
// lengths), so a wrong shape is an EINVAL error, never a read or write past a slice.
//
// A Cache may be used from many goroutines, with locks per sequence (libpkv's threading rule,
// pkv.h): a method that changes a sequence waits only for the calls that name that sequence,
// and reads of a sequence (attention, gather, block tables) run beside one another, so an
// append to one sequence does not wait for attention over others. WriteKV waits for the
// attention calls and gathers in flight (its slots do not say whose rows they are);
// WriteKVShared writes beside them (layer l + 1 beside a decode of layer l), the caller
// answering for the rows. Both wait for calls that move or free rows (Truncate, Keep, Release,
// the compactions) and for Fork, and those wait for them. The Into forms (AppendInto, SlotsInto, GatherInto) fill
// the caller's buffers. Lengths are checked in int on every platform (GOARCH=386 included).
//
// Build: cgo needs pkv.h (found through ../../include) and libpkv.so, e.g.
//
//	CGO_LDFLAGS="-L/path/to/build -Wl,-rpath,/path/to/build" go test
package pagedkv

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: -lpkv
#include <pkv.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// libpkv says why a call refuses through the log hook, on the calling thread, before the call
// returns (pkv.h). The hook keeps it in this thread's buffer; check takes it for the *Error, on
// the same OS thread (a Cache's calls run with the goroutine locked to its thread).
enum { PKVGO_SAID_CAP = 512 };
static __thread char pkvgo_said[PKVGO_SAID_CAP];
static void pkvgo_log(void *ctx, int level, const char *msg) {
	(void)ctx;
	if (level == PKV_LOG_ERROR && msg) snprintf(pkvgo_said, PKVGO_SAID_CAP, "%s", msg);
}
static void pkvgo_set_log(pkv_config *cfg) {
	cfg->log = pkvgo_log;
	cfg->log_ctx = NULL;
}
// Copies this thread's reason into buf (PKVGO_SAID_CAP bytes) and clears it; its length.
static size_t pkvgo_take_said(char *buf) {
	size_t n = strlen(pkvgo_said);
	memcpy(buf, pkvgo_said, n + 1);
	pkvgo_said[0] = 0;
	return n;
}

// pkv_batch_append over flat arrays: cgo may not hand C Go memory that holds Go pointers, so the
// requests (pointers into toks and slots) are built here. toks and slots: the requests' tokens
// and slots one after another, ns[i] of each.
static int pkvgo_batch_append(pkv_cache *c, const pkv_seq *seqs, const uint32_t *ns, const int32_t *toks,
                              int32_t *slots, uint32_t n, uint32_t flags, uint32_t *done) {
	pkv_append_req few[16], *r = n <= 16 ? few : calloc(n, sizeof *r);
	if (!r) return PKV_ENOMEM;
	size_t at = 0;
	for (uint32_t i = 0; i < n; i++) {
		r[i].seq = seqs[i], r[i].tokens = toks + at, r[i].n = ns[i], r[i].slots_out = slots + at;
		at += ns[i];
	}
	const int rc = pkv_batch_append(c, r, n, flags, done);
	if (r != few) free(r);
	return rc;
}

// pkv_seq_shift with its rope built here (use 0: none), for the same reason: inv_freq may be Go memory.
static int pkvgo_shift(pkv_cache *c, pkv_seq s, uint32_t from, uint32_t to, int use, uint32_t dim0, uint32_t n_rot,
                       uint32_t style, float theta, const float *inv_freq) {
	const pkv_rope r = {.dim0 = dim0, .n_rot = n_rot, .style = style, .theta = theta, .inv_freq = inv_freq};
	return pkv_seq_shift(c, s, from, to, use ? &r : NULL);
}

static size_t pkvgo_attn_req_size(void) { return sizeof(pkv_attn_req); }
static size_t pkvgo_attn_req_off(int f) {
	return f == 0 ? offsetof(pkv_attn_req, seq) : f == 1 ? offsetof(pkv_attn_req, q_start) : offsetof(pkv_attn_req, n_q);
}
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"sort"
	"strings"
	"sync"
	"unsafe"
)

// Status codes (pkv.h; values never change once released).
const (
	OK       = 0
	EINVAL   = -1
	ENOMEM   = -2
	ENOSPC   = -3
	ENOENT   = -4
	ELIMIT   = -5
	ECORRUPT = -6
	EIO      = -7
	ENOTSUP  = -8
	EBUSY    = -9
)

// ValueMax is PKV_VALUE_MAX (pkv.h): the largest |element| WriteKV takes, and the largest
// |q| x scale the attention calls take (2^56); past it, EINVAL.
const ValueMax = 1 << 56

var codeNames = map[int]string{EINVAL: "EINVAL", ENOMEM: "ENOMEM", ENOSPC: "ENOSPC", ENOENT: "ENOENT",
	ELIMIT: "ELIMIT", ECORRUPT: "ECORRUPT", EIO: "EIO", ENOTSUP: "ENOTSUP", EBUSY: "EBUSY"}

// Error is a libpkv status other than PKV_OK (or EINVAL from the binding's own checks).
type Error struct {
	Code int    // the status: EINVAL, ENOENT, ...
	Op   string // what was being done
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s (%s)", e.Op, Strerror(e.Code), codeNames[e.Code])
}

// Is reports whether target is an *Error of the same status, whatever its Op, so that
// errors.Is(err, pagedkv.ErrNoSpace) matches every ENOSPC, wrapped or not.
func (e *Error) Is(target error) bool {
	if target == ErrClosed { // only the closed cache's own error, not every EINVAL
		return e == errClosed
	}
	t, ok := target.(*Error)
	return ok && t.Code == e.Code
}

// One error a status, to match with errors.Is (an engine preempts on ErrNoSpace).
var (
	ErrInvalid      error = &Error{Code: EINVAL, Op: "pagedkv"}
	ErrNoMem        error = &Error{Code: ENOMEM, Op: "pagedkv"}
	ErrNoSpace      error = &Error{Code: ENOSPC, Op: "pagedkv"}
	ErrNotFound     error = &Error{Code: ENOENT, Op: "pagedkv"}
	ErrLimit        error = &Error{Code: ELIMIT, Op: "pagedkv"}
	ErrCorrupt      error = &Error{Code: ECORRUPT, Op: "pagedkv"}
	ErrIO           error = &Error{Code: EIO, Op: "pagedkv"}
	ErrNotSupported error = &Error{Code: ENOTSUP, Op: "pagedkv"}
	ErrBusy         error = &Error{Code: EBUSY, Op: "pagedkv"}
	// ErrClosed is what every call on a closed (or nil) Cache returns: an EINVAL, so
	// errors.Is(err, ErrInvalid) matches it too, while errors.Is(err, ErrClosed) matches it alone.
	ErrClosed error = errClosed
)

var errClosed = &Error{Code: EINVAL, Op: "the cache is closed"}

// check is rc as an error: its Op what libpkv said on this OS thread about the call (why it
// refused: the caller holds the goroutine on the thread it made the call on), else op.
func check(rc C.int, op string) error {
	if rc == 0 {
		return nil
	}
	var buf [C.PKVGO_SAID_CAP]C.char
	if n := C.pkvgo_take_said(&buf[0]); n > 0 {
		op = C.GoStringN(&buf[0], C.int(n))
	}
	return &Error{Code: int(rc), Op: op}
}

func invalid(format string, a ...interface{}) error {
	return &Error{Code: EINVAL, Op: fmt.Sprintf(format, a...)}
}

func wantLen(have, want int, what string) error {
	return wantLenOf(have, want, what, "")
}

// wantLenOf is wantLen for the argument arg of call what, the name joined only for an error (a
// join is an allocation a call).
func wantLenOf(have, want int, what, arg string) error {
	if have != want {
		if arg != "" {
			what += ": " + arg
		}
		return invalid("%s: %d elements, %d needed", what, have, want)
	}
	return nil
}

// mulLen is a * b for non-negative lengths, or EINVAL where the product is past int.
func mulLen(a, b int, what string) (int, error) {
	if a != 0 && b > math.MaxInt/a {
		return 0, invalid("%s: %d x %d elements is past int", what, a, b)
	}
	return a * b, nil
}

func u32(n int, what string) (C.uint32_t, error) {
	if n < 0 || uint64(n) > math.MaxUint32 {
		return 0, invalid("%s: %d out of range", what, n)
	}
	return C.uint32_t(n), nil
}

// Strerror is libpkv's description of a status code.
func Strerror(code int) string { return C.GoString(C.pkv_strerror(C.int(code))) }

// Version is the version of the libpkv actually linked ("MAJOR.MINOR.PATCH").
func Version() string { return C.GoString(C.pkv_version()) }

// Dtype is a pool element format.
type Dtype int

const (
	F32 Dtype = iota
	F16
	BF16
	Q8_0
	Q4_0
	FP8E4M3
)

// c is d as a pkv_dtype. A value past the C enum's range becomes one libpkv refuses as
// unknown, not one cut down to a dtype it knows (Dtype(1<<32) read as f32).
func (d Dtype) c() C.pkv_dtype {
	if d < 0 || d > 0xffff {
		return C.pkv_dtype(0xffff)
	}
	return C.pkv_dtype(d)
}

// Name is libpkv's name of the format ("f32", "f16", "bf16", "q8_0", "q4_0", "fp8_e4m3").
func (d Dtype) Name() string { return C.GoString(C.pkv_dtype_name(d.c())) }

// RowBytes is the bytes one token row of headDim elements takes in the pool (0: it cannot).
func (d Dtype) RowBytes(headDim uint32) int {
	return int(C.pkv_dtype_row_bytes(d.c(), C.uint32_t(headDim)))
}

// DtypeFromName parses libpkv's names (and "fp8").
func DtypeFromName(name string) (Dtype, error) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	var d C.pkv_dtype
	if err := check(C.pkv_dtype_from_name(cs, &d), "pkv_dtype_from_name"); err != nil {
		return 0, err
	}
	return Dtype(d), nil
}

// Config is pkv_config without the hooks. DefaultConfig is pkv_config_default().
//
// VDim 0 (the default): V has rows of its own, HeadDim values of VDtype. 1..HeadDim: V lives in
// K (multi-head latent attention, MLA: DeepSeek-V2 / V3): the pool holds K rows only and a
// token's V is the first VDim values of its K row (pkv.h, "MLA"). VDtype must then be KDtype
// (Q8_0 / Q4_0: VDim a multiple of 32); writes and reads of V are EINVAL (pass K alone, v nil),
// and the attention calls' outputs are [..][n_q_heads][VDim], their queries still
// [..][n_q_heads][HeadDim].
type Config struct {
	NLayers, NKVHeads, HeadDim, BlockTokens, NBlocks uint32
	MemBudgetBytes                                   uint64
	KDtype, VDtype                                   Dtype
	MaxSeqs, MaxBlocksPerSeq, NThreads               uint32
	PrefixCache, HugePages                           bool
	EventCapacity                                    uint32 // prefix-index events kept for TakeEvents, at most 2^24; 0: none recorded
	VDim                                             uint32 // 0: V rows of their own; 1..HeadDim: V is K's first VDim values (MLA)
	// SpinUS: how long the cache's attention threads poll for the next call before they sleep, in
	// microseconds, at most 1000000; 50 by default, 0: sleep at once. Raise it past the time between
	// a model's attention calls where the cores are otherwise idle then (pkv.h). Unused with an
	// executor.
	SpinUS uint32
}

func configFromC(c *C.pkv_config) Config {
	return Config{uint32(c.n_layers), uint32(c.n_kv_heads), uint32(c.head_dim), uint32(c.block_tokens),
		uint32(c.n_blocks), uint64(c.mem_budget_bytes), Dtype(c.k_dtype), Dtype(c.v_dtype), uint32(c.max_seqs),
		uint32(c.max_blocks_per_seq), uint32(c.n_threads), c.enable_prefix_cache != 0, c.huge_pages != 0,
		uint32(c.event_capacity), uint32(c.v_dim), uint32(c.spin_us)}
}

// DefaultConfig: 1 layer, 8 kv heads, head_dim 128, 16-token blocks, 1024 blocks, f16 K and V,
// 256 sequences, prefix cache and huge pages on, every CPU, V rows of their own (VDim 0),
// threads polling 50 us after a call (SpinUS).
func DefaultConfig() Config {
	c := C.pkv_config_default()
	return configFromC(&c)
}

func b2i(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// Seq is a sequence (or pin) handle: libpkv's generation-counted id. A released one is stale
// forever (ErrNotFound). Each cache numbers its handles far from the others', so one passed to
// the wrong cache fails with ErrNotFound (a check that catches the mistake, not a guarantee:
// see pkv_seq in pkv.h).
type Seq uint64

// AttnReq is one prefill / extend request: queries for positions [QStart, QStart+NQ) of Seq.
// Its layout is pkv_attn_req's (TestLayout checks it).
type AttnReq struct {
	Seq    Seq
	QStart uint32
	NQ     uint32
}

// TreeMaxNodes is PKV_TREE_MAX_NODES (pkv.h): the most nodes a TreeReq may have; past it, EINVAL.
const TreeMaxNodes = C.PKV_TREE_MAX_NODES

// TreeReq is one request of Tree: a tree of draft tokens (speculative decoding) whose K/V Seq
// holds at positions [QStart, QStart+len(Parent)), node i at QStart+i (pkv_attn_tree_req, its
// n_nodes len(Parent), at most TreeMaxNodes). Parent[i] is node i's parent, in [-1, i) (-1 for a
// root; several roots allowed): each node comes after its parent. Node i's position in the text
// is QStart + depth(i) (a root has depth 0): the position its K was rotated for, and the one a
// window counts from. An empty Parent is an empty request.
type TreeReq struct {
	Seq    Seq
	QStart uint32
	Parent []int32
}

// AttnParams: NQHeads 0 means n_kv_heads, Scale 0 means 1/sqrt(head_dim), Softcap and Window
// 0 mean off. BF16Dot is PKV_ATTN_BF16_DOT: with bf16 K/V, queries and softmax weights rounded
// to bf16 and multiplied by bf16 dot products where the CPU has them; with fp8 e4m3, q8_0 and
// q4_0 K/V the same on avx512-amx's tiles, in units of 16 query rows a kv head and more (Cache.BF16DotUsed).
//
// Sinks, if not nil, are attention-sink logits (gpt-oss; pkv_attn_params.sinks), one per query
// head: exactly n_q_heads of them (n_kv_heads where NQHeads is 0), else EINVAL before libpkv is
// called; each finite, else EINVAL from libpkv. Head h's softmax counts one more key, of logit
// Sinks[h] (neither scaled nor capped) and value 0: out is
// sum_t e^(s_t) v_t / (e^(Sinks[h]) + sum_t e^(s_t)) over the scaled (capped) logits s_t, and lse
// includes the sink's term, so to Merge partial results pass Sinks to one part only.
//
// AlibiSlopes, if not nil, are ALiBi slopes (BLOOM, MPT; pkv_attn_params.alibi_slopes), one per
// query head: exactly n_q_heads of them, else EINVAL before libpkv is called; each finite with
// magnitude at most 65536, else EINVAL from libpkv. Head h's logit of the key at position k for
// the query at position p gains AlibiSlopes[h] * (k - p) after the scale and the soft-cap (in
// Tree a node's position is QStart + its depth).
//
// AttnChunk is chunked local attention (Llama 4's attention_chunk_size;
// pkv_attn_params.attn_chunk): the query at position p sees only the keys of its chunk,
// [p - p % AttnChunk, p] (with a Window too, a key must pass both; in Tree a node's position is
// QStart + its depth). 0 means off.
//
// NonCausal is PKV_ATTN_NONCAUSAL: each query of a Prefill request sees its whole sequence,
// [0, length) (an encoder's self-attention; cross-attention over a sequence holding an encoder's
// K/V): QStart must be 0 and NQ may be any count up to what a sequence may hold; a Window,
// AttnChunk or AlibiSlopes with it (in any call), or Tree, is EINVAL; Decode otherwise computes
// the same either way.
//
// F16AsBF16 is PKV_ATTN_F16_AS_BF16: f16 K and the queries, f16 V and the softmax weights,
// rounded to bf16 in units of 16 query rows a kv head and more where the backend has bf16 tiles
// ("avx512-amx"; Cache.F16AsBF16Used); elsewhere the same bits as without it.
type AttnParams struct {
	NQHeads     uint32
	Scale       float32
	Softcap     float32
	Window      uint32
	BF16Dot     bool
	Sinks       []float32
	AlibiSlopes []float32
	AttnChunk   uint32
	NonCausal   bool
	F16AsBF16   bool
}

// SeqInfo is pkv_seq_info.
type SeqInfo struct {
	NTokens, NCommitted, NBlocks, NShared, NReused uint32
	NDropped                                       uint32 // positions [0, NDropped) let go by DropFront
}

// Stats is pkv_stats.
type Stats struct {
	NBlocks, NFree, NCached, NActive, NSeqs, NPins                                 uint32
	NTokens, NSlotsUsed, KVBytes, KVBytesPerBlock, MetaBytes, FragSlots, CowCopies uint64
	PeakActive                                                                     uint32
	PrefixLookups, PrefixTokensQueried, PrefixTokensHit                            uint64
	PrefixMissNew, PrefixMissEvicted, PrefixMissNamespace, NIndexed, Evictions     uint64
	AttnReqsPool, AttnReqsTable, AttnSharedKeys                                    uint64
	NTombstones, PrefixTombHits                                                    uint64 // see pkv_stats
}

// Cache is a paged KV cache (pkv_cache). Close frees it.
type Cache struct {
	gate  sync.RWMutex // Close and Reset hold it alone; every other call shares it
	kv    sync.RWMutex // WriteKV and WriteKV16 hold it alone; attention and gathers share it
	rows  sync.RWMutex // moves of K/V rows and Fork hold it alone; K/V writes share it
	smu   sync.Mutex   // guards seqs and spare
	seqs  map[Seq]*seqLock
	spare []*seqLock
	c     *C.pkv_cache
	cfg   Config
}

// seqLock is one sequence's lock: held alone by a call that changes the sequence, shared by
// the calls that read it. It is in Cache.seqs while some call holds or waits for it.
type seqLock struct {
	mu    sync.RWMutex
	id    Seq // the sequence (under Cache.smu)
	users int // calls holding or waiting for mu (under Cache.smu)
}

// NewCache creates a cache: the whole pool and every buffer attention needs are allocated here.
func NewCache(cfg Config) (*Cache, error) {
	raw := C.pkv_config_default()
	raw.n_layers, raw.n_kv_heads, raw.head_dim = C.uint32_t(cfg.NLayers), C.uint32_t(cfg.NKVHeads), C.uint32_t(cfg.HeadDim)
	raw.block_tokens, raw.n_blocks = C.uint32_t(cfg.BlockTokens), C.uint32_t(cfg.NBlocks)
	raw.mem_budget_bytes = C.uint64_t(cfg.MemBudgetBytes)
	raw.k_dtype, raw.v_dtype = cfg.KDtype.c(), cfg.VDtype.c()
	raw.max_seqs, raw.max_blocks_per_seq = C.uint32_t(cfg.MaxSeqs), C.uint32_t(cfg.MaxBlocksPerSeq)
	raw.n_threads = C.uint32_t(cfg.NThreads)
	raw.enable_prefix_cache, raw.huge_pages = b2i(cfg.PrefixCache), b2i(cfg.HugePages)
	raw.event_capacity = C.uint32_t(cfg.EventCapacity)
	raw.v_dim = C.uint32_t(cfg.VDim)
	raw.spin_us = C.uint32_t(cfg.SpinUS)
	C.pkvgo_set_log(&raw)
	runtime.LockOSThread() // check reads what libpkv said on this thread
	defer runtime.UnlockOSThread()
	var p *C.pkv_cache
	// the error's Op is what libpkv said, e.g. "pkv_cache_create: head_dim 0 not in 1..1024"
	if err := check(C.pkv_cache_create(&raw, &p), "pkv_cache_create"); err != nil {
		return nil, err
	}
	var eff C.pkv_config
	if err := check(C.pkv_cache_config(p, &eff), "pkv_cache_config"); err != nil {
		C.pkv_cache_destroy(p)
		return nil, err
	}
	cache := &Cache{c: p, cfg: configFromC(&eff), seqs: make(map[Seq]*seqLock)}
	// a safety net, as os.File has: a Cache dropped without Close is freed when the garbage
	// collector finds it unreachable (its pool, metadata and threads), not kept forever
	runtime.SetFinalizer(cache, (*Cache).Close)
	return cache, nil
}

// Close frees the cache once the calls in flight on it have returned; later calls return
// ErrClosed. Closing twice (or a nil Cache) is a no-op. A Cache that is dropped without Close
// is freed by a finalizer when the garbage collector finds it, but memory this large is better
// returned at a known time: call Close.
func (c *Cache) Close() {
	if c == nil {
		return
	}
	c.gate.Lock()
	defer c.gate.Unlock()
	runtime.SetFinalizer(c, nil)
	if c.c != nil {
		C.pkv_cache_destroy(c.c)
		c.c = nil
	}
}

// Locks. libpkv lets calls on different sequences overlap, and calls that only read a sequence
// overlap one another; a call that changes a sequence must not overlap any call that names or
// reads it (pkv.h, "Threads"). The binding keeps that rule with the locks a call takes, always
// in this order, so that no two calls wait on each other in a cycle:
//  1. gate: Close and Reset hold it alone, every other call shares it;
//  2. the locks of the sequences the call names, in increasing id order: held alone by a call
//     that changes its sequence (Append, BatchAppend, Commit, WriteKVSeq, Truncate, Keep, Compact,
//     BatchCompact, Release, MatchPrefix, PinRelease), shared by the calls that read it (attention, Gather,
//     Slots, BlockTable, SeqInfo, AppendBlocks, the exports, and Fork and Pin of their source);
//  3. kv: WriteKV and WriteKV16 hold it alone, since their slots do not say whose rows they
//     are; the calls that read K/V rows (attention, Gather) and WriteKVSeq share it;
//  4. rows: the calls that move or free K/V rows (Truncate, Keep, Release, Compact, BatchCompact)
//     and Fork (after it, the forked tail is shared, and the next append copies it) hold it
//     alone; every K/V write (WriteKV, WriteKVShared) shares it.
// So a change to one sequence waits only for the calls that name that sequence (and, for a row
// move or a fork, for the K/V writes by slot in flight), not for attention over others; WriteKV
// waits for the attention calls and gathers in flight, and while it waits, later ones wait for
// it; WriteKVSeq (by position) names its sequence, so it waits for the calls that name it and
// for a WriteKV in flight (and one waiting: Go's RWMutex lets a waiting Lock go first), not for
// attention over other sequences; it takes no rows lock (its rows are its sequence's alone,
// which only calls naming it move); WriteKVShared waits for no read: its caller answers for the
// rows.

// use is what a call takes of the kv or rows lock.
type use uint8

const (
	useNone   use = iota
	useShared     // the lock shared
	useAlone      // the lock alone
)

func (u use) lock(m *sync.RWMutex) {
	switch u {
	case useShared:
		m.RLock()
	case useAlone:
		m.Lock()
	}
}

func (u use) unlock(m *sync.RWMutex) {
	switch u {
	case useShared:
		m.RUnlock()
	case useAlone:
		m.Unlock()
	}
}

// access is what a call locks besides the sequences it names.
type access struct {
	alone bool // the gate alone (Close, Reset); no sequence is named then
	write bool // the named sequences' locks alone (the call changes them); else shared
	kv    use  // the kv lock
	rows  use  // the rows lock
}

var (
	readSeqs  = access{}
	writeSeqs = access{write: true}
	readKV    = access{kv: useShared}               // attention, Gather
	moveRows  = access{write: true, rows: useAlone} // Truncate, DropFront, Keep, Release, Compact, BatchCompact
)

// guard is what one call holds, let go by exit in the reverse order.
type guard struct {
	c    *Cache
	a    access
	one  *seqLock   // the sequence lock of a call naming one sequence
	many []*seqLock // those of a call naming several, in id order (in sc)
	sc   *scratch
}

// scratch is what a call naming several sequences (attention batches, the exports,
// BatchCompact) sorts their ids and keeps their locks in; pooled, so a decode step allocates
// none.
type scratch struct {
	ids   []Seq
	locks []*seqLock
}

var scratchPool = sync.Pool{New: func() interface{} { return new(scratch) }}

// enter takes what access a and the sequences seqs call for and holds the goroutine on its OS
// thread until g.exit; it fails, holding nothing, on a closed cache.
func (c *Cache) enter(a access, seqs ...Seq) (p *C.pkv_cache, g guard, err error) {
	if c == nil {
		return nil, guard{}, errClosed
	}
	if a.alone {
		c.gate.Lock()
	} else {
		c.gate.RLock()
	}
	if c.c == nil {
		if a.alone {
			c.gate.Unlock()
		} else {
			c.gate.RUnlock()
		}
		return nil, guard{}, errClosed
	}
	g = guard{c: c, a: a}
	switch len(seqs) {
	case 0:
	case 1:
		c.smu.Lock()
		g.one = c.seqLockLocked(seqs[0])
		c.smu.Unlock()
		g.one.lock(a.write)
	default:
		g.sc = scratchPool.Get().(*scratch)
		g.many = c.seqLocksSorted(seqs, g.sc)
		for _, l := range g.many {
			l.lock(a.write)
		}
	}
	a.kv.lock(&c.kv)
	a.rows.lock(&c.rows)
	// the calls under these locks, and check after each, run on one OS thread: check reads
	// what libpkv said on it
	runtime.LockOSThread()
	return c.c, g, nil
}

// exit lets go of what enter took; a no-op for the guard of a failed enter.
func (g *guard) exit() {
	c := g.c
	if c == nil {
		return
	}
	runtime.UnlockOSThread()
	g.a.rows.unlock(&c.rows)
	g.a.kv.unlock(&c.kv)
	if g.one != nil || len(g.many) > 0 {
		if g.one != nil {
			g.one.unlock(g.a.write)
		}
		for i := len(g.many) - 1; i >= 0; i-- {
			g.many[i].unlock(g.a.write)
		}
		c.smu.Lock()
		if g.one != nil {
			c.dropLocked(g.one)
		}
		for _, l := range g.many {
			c.dropLocked(l)
		}
		c.smu.Unlock()
	}
	if g.sc != nil {
		for i := range g.many {
			g.many[i] = nil
		}
		g.sc.locks = g.many[:0]
		scratchPool.Put(g.sc)
	}
	if g.a.alone {
		c.gate.Unlock()
	} else {
		c.gate.RUnlock()
	}
	*g = guard{}
}

func (l *seqLock) lock(write bool) {
	if write {
		l.mu.Lock()
	} else {
		l.mu.RLock()
	}
}

func (l *seqLock) unlock(write bool) {
	if write {
		l.mu.Unlock()
	} else {
		l.mu.RUnlock()
	}
}

// seqLockLocked is s's lock with one more user, made if no call holds it (c.smu held).
func (c *Cache) seqLockLocked(s Seq) *seqLock {
	l := c.seqs[s]
	if l == nil {
		if n := len(c.spare); n > 0 {
			l, c.spare = c.spare[n-1], c.spare[:n-1]
		} else {
			l = new(seqLock)
		}
		l.id = s
		c.seqs[s] = l
	}
	l.users++
	return l
}

// dropLocked takes a user from l, forgetting it when none is left (c.smu held).
func (c *Cache) dropLocked(l *seqLock) {
	if l.users--; l.users > 0 {
		return
	}
	delete(c.seqs, l.id)
	if len(c.spare) < 64 {
		c.spare = append(c.spare, l)
	}
}

// seqLocksSorted is the locks of seqs' distinct ids in increasing id order (one user each), the
// order every call takes them in, in sc.locks.
func (c *Cache) seqLocksSorted(seqs []Seq, sc *scratch) []*seqLock {
	ids := append(sc.ids[:0], seqs...)
	sc.ids = ids
	if len(ids) <= 32 {
		for i := 1; i < len(ids); i++ { // insertion sort: a batch is short
			for j := i; j > 0 && ids[j] < ids[j-1]; j-- {
				ids[j], ids[j-1] = ids[j-1], ids[j]
			}
		}
	} else {
		sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	}
	dst := sc.locks[:0]
	c.smu.Lock()
	for i, s := range ids {
		if i > 0 && s == ids[i-1] {
			continue
		}
		dst = append(dst, c.seqLockLocked(s))
	}
	c.smu.Unlock()
	return dst
}

// Config is the effective configuration (n_blocks, max_blocks_per_seq, n_threads resolved);
// the zero Config for a nil Cache.
func (c *Cache) Config() Config {
	if c == nil {
		return Config{}
	}
	return c.cfg
}

// Backend is the attention kernel family in use ("ref", "avx2", "avx2-vnni", "avx512", "avx512-vnni", ...).
func (c *Cache) Backend() string {
	p, g, err := c.enter(readSeqs)
	if err != nil {
		return ""
	}
	defer g.exit()
	return C.GoString(C.pkv_attn_backend(p))
}

// BF16DotUsed says whether AttnParams.BF16Dot changes this cache's attention
// (pkv_attn_flags_used): bf16 K or V and a backend with bf16 dot products, or fp8 e4m3, q8_0 or
// q4_0 K or V and one with bf16 tiles ("avx512-amx").
func (c *Cache) BF16DotUsed() bool {
	p, g, err := c.enter(readSeqs)
	if err != nil {
		return false
	}
	defer g.exit()
	return C.pkv_attn_flags_used(p)&C.PKV_ATTN_BF16_DOT != 0
}

// F16AsBF16Used says whether AttnParams.F16AsBF16 changes this cache's attention
// (pkv_attn_flags_used): f16 K or V with head_dim (or v_dim) a multiple of 32, the other q8_0 or
// q4_0 only where BF16Dot is set too, and a backend with bf16 tiles.
func (c *Cache) F16AsBF16Used() bool {
	p, g, err := c.enter(readSeqs)
	if err != nil {
		return false
	}
	defer g.exit()
	return C.pkv_attn_flags_used(p)&C.PKV_ATTN_F16_AS_BF16 != 0
}

// kvElems is the elements of n K or V rows, or EINVAL where that is past int (a 32-bit int
// wraps at 2^31: 1024 rows of 4096 kv heads x 1024 would read as 0).
func (c *Cache) kvElems(n int, what string) (int, error) {
	if c == nil {
		return 0, errClosed
	}
	row, err := mulLen(int(c.cfg.NKVHeads), int(c.cfg.HeadDim), what)
	if err != nil {
		return 0, err
	}
	return mulLen(n, row, what)
}

// outDim is the values of an attention output row (a query head's): VDim where V lives in K
// (MLA, Config.VDim), else HeadDim.
func (c *Cache) outDim() uint32 {
	if c.cfg.VDim != 0 {
		return c.cfg.VDim
	}
	return c.cfg.HeadDim
}

// noVInK is EINVAL, before libpkv sees it, where V is given (vOK) to a cache whose V lives in K
// (MLA, Config.VDim): its V is K's rows, written and read as K.
func (c *Cache) noVInK(vOK bool, what string) error {
	if vOK && c.cfg.VDim != 0 {
		return invalid("%s: v given, but V lives in K here (v_dim %d): pass k alone", what, c.cfg.VDim)
	}
	return nil
}

// emptyBuf is what an empty slice that is not nil points C at: never read or written (a count
// of 0 comes with it), 8-byte aligned for every element type here.
var emptyBuf uint64

// slicePtr is the pointer handed to C for s: NULL for a nil slice, the first element's address
// otherwise, and emptyBuf's for an empty slice that is not nil. So an empty slice means "no
// elements" as it does in C, Rust and Python (libpkv refuses a NULL where a buffer is required,
// even for 0 elements), and nil means "none given".
func slicePtr[T any](s []T) unsafe.Pointer {
	if s == nil {
		return nil
	}
	if len(s) == 0 {
		return unsafe.Pointer(&emptyBuf)
	}
	return unsafe.Pointer(&s[0])
}

func i32p(s []int32) *C.int32_t { return (*C.int32_t)(slicePtr(s)) }
func f32p(s []float32) *C.float { return (*C.float)(slicePtr(s)) }
func seqp(s []Seq) *C.pkv_seq   { return (*C.pkv_seq)(slicePtr(s)) }

// Reset releases every sequence and pin and empties the prefix index.
func (c *Cache) Reset() error {
	return c.op("pkv_cache_reset", access{alone: true}, func(p *C.pkv_cache) C.int { return C.pkv_cache_reset(p) })
}

// SeqCreate makes an empty sequence; salt (at most 256 bytes) names its prefix-index namespace.
func (c *Cache) SeqCreate(salt []byte) (Seq, error) {
	var sp unsafe.Pointer
	if len(salt) > 0 {
		sp = C.CBytes(salt)
		defer C.free(sp)
	}
	var s C.pkv_seq
	err := c.op("pkv_seq_create", readSeqs, func(p *C.pkv_cache) C.int { return C.pkv_seq_create(p, sp, C.size_t(len(salt)), &s) })
	return Seq(s), err
}

// Append adds positions with these token ids; returns their slots.
func (c *Cache) Append(s Seq, tokens []int32) ([]int32, error) {
	slots := make([]int32, len(tokens))
	if err := c.AppendInto(s, tokens, slots); err != nil {
		return nil, err
	}
	return slots, nil
}

// AppendInto is Append into the caller's slots (len(slots) == len(tokens)), for a decode loop
// that allocates no buffers a step.
func (c *Cache) AppendInto(s Seq, tokens, slots []int32) error {
	if err := wantLen(len(slots), len(tokens), "Append: slots"); err != nil {
		return err
	}
	n, err := u32(len(tokens), "Append: tokens")
	if err != nil {
		return err
	}
	return c.op("pkv_seq_append", writeSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_append(p, C.pkv_seq(s), i32p(tokens), n, i32p(slots))
	}, s)
}

// BatchAppend is a scheduler step's appends in one call (pkv_batch_append): tokens[i] appended
// to seqs[i], distinct sequences. The budget check and the appends happen under one hold of the
// cache's lock, so no other goroutine's append takes the blocks between them. Without fit,
// every request is appended, in order, or none (ErrNoSpace); with fit, the leading run of them
// that fits (first come, first served), the others left as they were. Returns the slots of the
// requests appended, in order: its length is how many were.
func (c *Cache) BatchAppend(seqs []Seq, tokens [][]int32, fit bool) ([][]int32, error) {
	if err := wantLen(len(tokens), len(seqs), "BatchAppend: tokens (one slice a sequence)"); err != nil {
		return nil, err
	}
	n, err := u32(len(seqs), "BatchAppend: seqs")
	if err != nil {
		return nil, err
	}
	ns := make([]uint32, len(seqs))
	total := 0
	for i, t := range tokens {
		k, err := u32(len(t), "BatchAppend: tokens")
		if err != nil {
			return nil, err
		}
		if total += len(t); total < 0 || uint64(total) > math.MaxUint32 {
			return nil, invalid("BatchAppend: more tokens in all than a call takes")
		}
		ns[i] = uint32(k)
	}
	flat, slots := make([]int32, 0, total), make([]int32, total)
	for _, t := range tokens {
		flat = append(flat, t...)
	}
	flags := C.uint32_t(0)
	if fit {
		flags = C.PKV_APPEND_FIT
	}
	var done C.uint32_t
	err = c.op("pkv_batch_append", writeSeqs, func(p *C.pkv_cache) C.int {
		return C.pkvgo_batch_append(p, seqp(seqs), (*C.uint32_t)(slicePtr(ns)), i32p(flat), i32p(slots), n, flags, &done)
	}, seqs...)
	if err != nil {
		return nil, err
	}
	out := make([][]int32, done)
	at := 0
	for i := range out {
		out[i] = slots[at : at+len(tokens[i]) : at+len(tokens[i])]
		at += len(tokens[i])
	}
	return out, nil
}

// AppendBlocks says how many FREE or CACHED blocks appending n positions to s would take: the
// append succeeds iff that is at most NFree + NCached (pkv_seq_append_blocks; ELIMIT past
// max_blocks_per_seq). Changes nothing: for budgeting a step before appending.
func (c *Cache) AppendBlocks(s Seq, n uint32) (uint32, error) {
	var need C.uint32_t
	err := c.op("pkv_seq_append_blocks", readSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_append_blocks(p, C.pkv_seq(s), C.uint32_t(n), &need)
	}, s)
	return uint32(need), err
}

func (c *Cache) writeKV(layer uint32, slots []int32, k, v unsafe.Pointer, kn, vn int, dt Dtype, kOK, vOK, shared bool) error {
	want, err := c.kvElems(len(slots), "WriteKV")
	if err != nil {
		return err
	}
	if err := c.noVInK(vOK, "WriteKV"); err != nil {
		return err
	}
	if !kOK && !vOK {
		return invalid("WriteKV: neither k nor v given")
	}
	if kOK {
		if err := wantLen(kn, want, "WriteKV: k"); err != nil {
			return err
		}
	}
	if vOK {
		if err := wantLen(vn, want, "WriteKV: v"); err != nil {
			return err
		}
	}
	n, err := u32(len(slots), "WriteKV: slots")
	if err != nil {
		return err
	}
	a := access{kv: useAlone, rows: useShared}
	if shared {
		a = access{rows: useShared}
	}
	return c.op("pkv_write_kv", a, func(p *C.pkv_cache) C.int {
		return C.pkv_write_kv(p, C.uint32_t(layer), i32p(slots), n, k, v, dt.c())
	})
}

// WriteKV writes f32 K and/or V (nil: not written) of one layer at these slots (-1 skips a row):
// each [len(slots)][n_kv_heads][head_dim] (K alone where V lives in K, MLA: a v is EINVAL).
// All-or-nothing. Slots name places in the pool, not a sequence: after a Truncate, Keep, Release
// or compaction of their sequence they may lie in another sequence's blocks, and a write through
// them changes that one. Take them again (Slots) after those calls.
func (c *Cache) WriteKV(layer uint32, slots []int32, k, v []float32) error {
	return c.writeKV(layer, slots, unsafe.Pointer(f32p(k)), unsafe.Pointer(f32p(v)), len(k), len(v), F32,
		k != nil, v != nil, false)
}

// WriteKV16 is WriteKV for f16 or bf16 bit patterns (dt F16 or BF16).
func (c *Cache) WriteKV16(layer uint32, slots []int32, k, v []uint16, dt Dtype) error {
	return c.writeKV16(layer, slots, k, v, dt, false)
}

func (c *Cache) writeKV16(layer uint32, slots []int32, k, v []uint16, dt Dtype, shared bool) error {
	if err := want16(dt, "WriteKV16"); err != nil {
		return err
	}
	return c.writeKV(layer, slots, slicePtr(k), slicePtr(v), len(k), len(v), dt, k != nil, v != nil, shared)
}

// WriteKVShared is WriteKV without waiting for attention and gathers in flight, so that it
// runs beside them: layer l + 1 of a new token written while a Decode reads layer l, as libpkv
// allows (pkv.h, "Threads"). It still waits for the calls that move or free rows (Truncate,
// Keep, Release, the compactions) and for Fork, as WriteKV does. The caller answers for what the
// locks no longer keep apart: no call may read or write these rows (these slots of this layer)
// while it runs. A write racing a read of the same rows is a data race in libpkv's memory
// (values torn or mixed, which the race detector cannot see); the slots must be current (see
// WriteKV).
func (c *Cache) WriteKVShared(layer uint32, slots []int32, k, v []float32) error {
	return c.writeKV(layer, slots, unsafe.Pointer(f32p(k)), unsafe.Pointer(f32p(v)), len(k), len(v), F32,
		k != nil, v != nil, true)
}

// WriteKV16Shared is WriteKVShared for f16 or bf16 bit patterns (dt F16 or BF16).
func (c *Cache) WriteKV16Shared(layer uint32, slots []int32, k, v []uint16, dt Dtype) error {
	return c.writeKV16(layer, slots, k, v, dt, true)
}

// want16 is nil for the 16-bit input dtypes (F16, BF16), else call what's EINVAL.
func want16(dt Dtype, what string) error {
	if dt != F16 && dt != BF16 {
		return invalid("%s: dtype %s, not f16 or bf16", what, dt.Name())
	}
	return nil
}

// WriteKVSeq writes f32 K and/or V (nil: not written) of one layer for positions [start, start +
// n) of s (pkv_seq_write_kv), n the rows of k or v (each [n][n_kv_heads][head_dim]; k alone where
// V lives in K). All-or-nothing, with WriteKV's checks. By position, so no slots are needed and
// none can be stale: the rows written are s's own. It holds s's lock alone, as a change to s
// does, and shares the kv lock with attention: it waits for the calls that name s (attention over
// s included) and for a WriteKV by slot (whose slots might name s's rows), not for attention over
// other sequences.
func (c *Cache) WriteKVSeq(s Seq, layer, start uint32, k, v []float32) error {
	return c.writeKVSeq(s, layer, start, unsafe.Pointer(f32p(k)), unsafe.Pointer(f32p(v)), len(k), len(v), F32,
		k != nil, v != nil)
}

// WriteKVSeq16 is WriteKVSeq for f16 or bf16 bit patterns (dt F16 or BF16).
func (c *Cache) WriteKVSeq16(s Seq, layer, start uint32, k, v []uint16, dt Dtype) error {
	if err := want16(dt, "WriteKVSeq16"); err != nil {
		return err
	}
	return c.writeKVSeq(s, layer, start, slicePtr(k), slicePtr(v), len(k), len(v), dt, k != nil, v != nil)
}

func (c *Cache) writeKVSeq(s Seq, layer, start uint32, k, v unsafe.Pointer, kn, vn int, dt Dtype, kOK, vOK bool) error {
	if !kOK && !vOK {
		return invalid("WriteKVSeq: neither k nor v given")
	}
	row, err := c.kvElems(1, "WriteKVSeq")
	if err != nil {
		return err
	}
	if err := c.noVInK(vOK, "WriteKVSeq"); err != nil {
		return err
	}
	have := kn
	if !kOK {
		have = vn
	}
	if have%row != 0 {
		return invalid("WriteKVSeq: %d elements, not whole rows of %d x %d", have, c.cfg.NKVHeads, c.cfg.HeadDim)
	}
	if kOK && vOK {
		if err := wantLenOf(vn, kn, "WriteKVSeq", "v"); err != nil {
			return err
		}
	}
	n, err := u32(have/row, "WriteKVSeq: rows")
	if err != nil {
		return err
	}
	return c.op("pkv_seq_write_kv", access{write: true, kv: useShared}, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_write_kv(p, C.pkv_seq(s), C.uint32_t(layer), C.uint32_t(start), n, k, v, dt.c())
	}, s)
}

// op runs f holding what access a and the sequences seqs call for (see enter), and returns f's
// status as an error named name.
func (c *Cache) op(name string, a access, f func(p *C.pkv_cache) C.int, seqs ...Seq) error {
	p, g, err := c.enter(a, seqs...)
	if err != nil {
		return err
	}
	defer g.exit()
	return check(f(p), name)
}

// Commit: positions [0, nPos) now hold K/V for every layer.
func (c *Cache) Commit(s Seq, nPos uint32) error {
	return c.op("pkv_seq_commit", writeSeqs, func(p *C.pkv_cache) C.int { return C.pkv_seq_commit(p, C.pkv_seq(s), C.uint32_t(nPos)) }, s)
}

// Truncate keeps positions [0, n).
func (c *Cache) Truncate(s Seq, n uint32) error {
	return c.op("pkv_seq_truncate", moveRows, func(p *C.pkv_cache) C.int { return C.pkv_seq_truncate(p, C.pkv_seq(s), C.uint32_t(n)) }, s)
}

// DropFront lets go of the blocks of s wholly before position pos, which a sliding window or
// chunked local attention no longer reads (pkv_seq_drop_front): positions before
// SeqInfo.NDropped are then refused by every call. Where the cache indexes prefixes, the dropped
// blocks stay indexed until evicted, so the same prompt still matches.
func (c *Cache) DropFront(s Seq, pos uint32) error {
	return c.op("pkv_seq_drop_front", moveRows, func(p *C.pkv_cache) C.int { return C.pkv_seq_drop_front(p, C.pkv_seq(s), C.uint32_t(pos)) }, s)
}

// Keep keeps the positions start+idx[k] of s's uncommitted tail, moved to start+k (their token
// ids and every layer's K and V), and drops the rest of the tail: the length becomes
// start+len(idx) (pkv_seq_keep). After a Tree over nodes at [start, ...), this keeps the
// accepted path (its node indices ascend from root to leaf); then Commit what is kept. idx
// strictly ascending, start plus its last under the length, start at or past the committed
// count, and each position moved into one that WriteKVSeq could write (a block s holds alone,
// outside the prefix index, not committed): else EINVAL and nothing changes. An empty idx
// truncates to start. It moves rows, so it locks as Truncate does; slots taken before are stale
// for the moved positions.
func (c *Cache) Keep(s Seq, start uint32, idx []uint32) error {
	n, err := u32(len(idx), "Keep: idx")
	if err != nil {
		return err
	}
	return c.op("pkv_seq_keep", moveRows, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_keep(p, C.pkv_seq(s), C.uint32_t(start), (*C.uint32_t)(slicePtr(idx)), n)
	}, s)
}

// RopeStyle says how RoPE pairs a K row's values (Rope).
type RopeStyle uint32

const (
	// RopeNeox pairs values Dim0+i and Dim0+i+NRot/2 (rotate_half: Llama and Qwen in Hugging
	// Face's layout, GPT-NeoX, llama.cpp's NEOX mode).
	RopeNeox RopeStyle = 0
	// RopeGptj pairs values Dim0+2i and Dim0+2i+1 (interleaved: GPT-J, llama.cpp's default mode,
	// llama2.c).
	RopeGptj RopeStyle = 1
)

// Rope is RoPE as the engine applied it to the K rows it wrote, for Shift (pkv_rope): pair i
// turned by position x Theta^(-2i/NRot) radians, or InvFreq[i] where InvFreq is given (NRot/2
// values: Llama 3's or YaRN's scaled frequencies).
type Rope struct {
	Dim0, NRot uint32
	Style      RopeStyle
	Theta      float32
	InvFreq    []float32
}

// Shift is the context shift (pkv_seq_shift): it removes positions [from, to) of s; the
// positions after them move down by to-from with their token ids and K/V, each K row turned back
// by as many positions of rope (nil: moved as stored, for K without RoPE). llama.cpp's context
// shift, StreamingLLM's cache. From from on, s then indexes nothing in the prefix cache and a tier
// saves nothing (Truncate to from or below makes it exact again); shared or indexed blocks are
// copied first (ENOSPC, nothing changed, where no block can be had). EINVAL for a rope whose
// InvFreq is not NRot/2 values, and as pkv.h says. It moves rows, so it locks as Truncate does.
func (c *Cache) Shift(s Seq, from, to uint32, rope *Rope) error {
	var use C.int
	var r Rope
	if rope != nil {
		use, r = 1, *rope
		if r.InvFreq != nil && uint64(len(r.InvFreq))*2 != uint64(r.NRot) {
			return invalid("Shift: InvFreq holds %d values, NRot %d takes NRot/2", len(r.InvFreq), r.NRot)
		}
	}
	return c.op("pkv_seq_shift", moveRows, func(p *C.pkv_cache) C.int {
		return C.pkvgo_shift(p, C.pkv_seq(s), C.uint32_t(from), C.uint32_t(to), use, C.uint32_t(r.Dim0),
			C.uint32_t(r.NRot), C.uint32_t(r.Style), C.float(r.Theta), (*C.float)(slicePtr(r.InvFreq)))
	}, s)
}

// Compact moves runs of the sequence's blocks that it alone holds (no fork or pin shares them)
// into FREE blocks (with evict, also CACHED leaf blocks, evicted as an append would; with
// cached, any CACHED block, exchanged so that it stays findable) so that its block table holds
// longer runs of consecutive ids: at each gap, the shorter of the two runs beside it that fits
// moves to meet the other (pkv.h, pkv_seq_compact); returns the number of block copies (two an
// exchange). Slots and block tables taken before are stale for the moved blocks.
func (c *Cache) Compact(s Seq, evict, cached bool) (uint32, error) {
	var moved C.uint32_t
	flags := C.uint32_t(0)
	if evict {
		flags |= C.PKV_COMPACT_EVICT
	}
	if cached {
		flags |= C.PKV_COMPACT_CACHED
	}
	err := c.op("pkv_seq_compact", moveRows, func(p *C.pkv_cache) C.int { return C.pkv_seq_compact(p, C.pkv_seq(s), flags, &moved) }, s)
	return uint32(moved), err
}

// BatchCompact lays the blocks each of seqs holds alone out as one group a sequence in id order,
// over the FREE ids and the ids the batch holds, exchanging blocks where no room is free; a
// sequence laid out already stays (with repack every one is laid out again, from the lowest ids),
// the others move in the order given (pkv.h, pkv_batch_compact), leaving slack FREE ids after
// each where the FREE blocks allow; with cached the CACHED blocks of the prefix index are room
// too (exchanged: they stay findable). Returns the number of block copies. Slots and block
// tables of the batch taken before are stale.
func (c *Cache) BatchCompact(seqs []Seq, slack uint32, repack, cached bool) (uint32, error) {
	n, err := u32(len(seqs), "BatchCompact: seqs")
	if err != nil {
		return 0, err
	}
	var moved C.uint32_t
	flags := C.uint32_t(0)
	if repack {
		flags |= C.PKV_BATCH_REPACK
	}
	if cached {
		flags |= C.PKV_BATCH_CACHED
	}
	err = c.op("pkv_batch_compact", moveRows, func(p *C.pkv_cache) C.int {
		return C.pkv_batch_compact(p, seqp(seqs), n, C.uint32_t(slack), flags, &moved)
	}, seqs...)
	return uint32(moved), err
}

// Release drops the sequence; its id becomes stale (ENOENT).
func (c *Cache) Release(s Seq) error {
	return c.op("pkv_seq_release", moveRows, func(p *C.pkv_cache) C.int { return C.pkv_seq_release(p, C.pkv_seq(s)) }, s)
}

// PinRelease drops a pin.
func (c *Cache) PinRelease(pin Seq) error {
	return c.op("pkv_pin_release", writeSeqs, func(p *C.pkv_cache) C.int { return C.pkv_pin_release(p, C.pkv_seq(pin)) }, pin)
}

// Fork makes a sequence sharing every block of s (no data copied).
func (c *Cache) Fork(s Seq) (Seq, error) {
	var out C.pkv_seq
	err := c.op("pkv_seq_fork", access{rows: useAlone}, func(p *C.pkv_cache) C.int { return C.pkv_seq_fork(p, C.pkv_seq(s), &out) }, s)
	return Seq(out), err
}

// Pin holds the committed full blocks of positions [0, nPos) of s; returns the pin.
func (c *Cache) Pin(s Seq, nPos uint32) (Seq, error) {
	var out C.pkv_seq
	err := c.op("pkv_pin_create", readSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_pin_create(p, C.pkv_seq(s), C.uint32_t(nPos), &out)
	}, s)
	return Seq(out), err
}

// MatchPrefix attaches the longest indexed prefix of tokens to the empty sequence s; returns
// the tokens reused (never all of them). Matching full blocks are shared; the matching leading
// tokens of the next block are copied into a fresh block (best effort: the 64 newest
// candidates; see pkv_seq_match_prefix in pkv.h).
func (c *Cache) MatchPrefix(s Seq, tokens []int32) (uint32, error) {
	n, err := u32(len(tokens), "MatchPrefix: tokens")
	if err != nil {
		return 0, err
	}
	var r C.uint32_t
	err = c.op("pkv_seq_match_prefix", writeSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_match_prefix(p, C.pkv_seq(s), i32p(tokens), n, &r)
	}, s)
	return uint32(r), err
}

// MatchPrefixWindow is MatchPrefix for a cache whose layers attend through a sliding window of
// window positions (or chunks of attn_chunk: pass that): it reuses the prefix whose last
// window's blocks hold K/V, matching through evicted blocks' tombstones before them, and leaves
// the sequence's front dropped before the first key its next query sees (SeqInfo.NDropped; see
// pkv_seq_match_prefix_window in pkv.h). EINVAL for window 0.
func (c *Cache) MatchPrefixWindow(s Seq, tokens []int32, window uint32) (uint32, error) {
	n, err := u32(len(tokens), "MatchPrefixWindow: tokens")
	if err != nil {
		return 0, err
	}
	var r C.uint32_t
	err = c.op("pkv_seq_match_prefix_window", writeSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_match_prefix_window(p, C.pkv_seq(s), i32p(tokens), n, C.uint32_t(window), &r)
	}, s)
	return uint32(r), err
}

// SeqInfo describes a sequence.
func (c *Cache) SeqInfo(s Seq) (SeqInfo, error) {
	var i C.pkv_seq_info
	if err := c.op("pkv_seq_get_info", readSeqs, func(p *C.pkv_cache) C.int { return C.pkv_seq_get_info(p, C.pkv_seq(s), &i) }, s); err != nil {
		return SeqInfo{}, err
	}
	return SeqInfo{uint32(i.n_tokens), uint32(i.n_committed), uint32(i.n_blocks), uint32(i.n_shared), uint32(i.n_reused), uint32(i.n_dropped)}, nil
}

// inSeq is EINVAL unless positions [start, start+n) are in the sequence (the C call's own
// check), made under the caller's lock on s before an output of n rows is allocated: a huge n
// is an error, not an allocation of that size.
func inSeq(p *C.pkv_cache, s Seq, start, n uint32, op string) error {
	var i C.pkv_seq_info
	if err := check(C.pkv_seq_get_info(p, C.pkv_seq(s), &i), "pkv_seq_get_info"); err != nil {
		return err
	}
	if uint64(start)+uint64(n) > uint64(i.n_tokens) {
		return invalid("%s: positions [%d, %d) past the sequence's %d", op, start, uint64(start)+uint64(n), uint32(i.n_tokens))
	}
	return nil
}

// Slots of positions [start, start+n): vLLM's slot_mapping.
func (c *Cache) Slots(s Seq, start, n uint32) ([]int32, error) {
	p, g, err := c.enter(readSeqs, s)
	if err != nil {
		return nil, err
	}
	defer g.exit()
	if err := inSeq(p, s, start, n, "pkv_seq_slots"); err != nil {
		return nil, err
	}
	out := make([]int32, n)
	if err := check(C.pkv_seq_slots(p, C.pkv_seq(s), C.uint32_t(start), C.uint32_t(n), i32p(out)), "pkv_seq_slots"); err != nil {
		return nil, err
	}
	return out, nil
}

// SlotsInto is Slots of positions [start, start+len(out)) into the caller's buffer.
func (c *Cache) SlotsInto(s Seq, start uint32, out []int32) error {
	n, err := u32(len(out), "Slots: out")
	if err != nil {
		return err
	}
	return c.op("pkv_seq_slots", readSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_slots(p, C.pkv_seq(s), C.uint32_t(start), n, i32p(out))
	}, s)
}

// BlockTable is the sequence's block ids.
func (c *Cache) BlockTable(s Seq) ([]int32, error) {
	p, g, err := c.enter(readSeqs, s)
	if err != nil {
		return nil, err
	}
	defer g.exit()
	var i C.pkv_seq_info
	if err := check(C.pkv_seq_get_info(p, C.pkv_seq(s), &i), "pkv_seq_get_info"); err != nil {
		return nil, err
	}
	out := make([]int32, i.n_blocks)
	var got C.uint32_t
	if err := check(C.pkv_seq_block_table(p, C.pkv_seq(s), i32p(out), i.n_blocks, &got), "pkv_seq_block_table"); err != nil {
		return nil, err
	}
	return out[:got], nil
}

// Gather returns K and V of positions [start, start+n) of one layer, f32
// [n][n_kv_heads][head_dim] (dequantized). Where V lives in K (MLA, Config.VDim) V is nil: a
// position's V is the first VDim values of its K row.
func (c *Cache) Gather(s Seq, layer, start, n uint32) ([]float32, []float32, error) {
	p, g, err := c.enter(readKV, s)
	if err != nil {
		return nil, nil, err
	}
	defer g.exit()
	if err := inSeq(p, s, start, n, "pkv_seq_gather"); err != nil {
		return nil, nil, err
	}
	elems, err := c.kvElems(int(n), "Gather")
	if err != nil {
		return nil, nil, err
	}
	k, v := make([]float32, elems), []float32(nil)
	if c.cfg.VDim == 0 {
		v = make([]float32, elems)
	}
	rc := C.pkv_seq_gather(p, C.pkv_seq(s), C.uint32_t(layer), C.uint32_t(start), C.uint32_t(n), f32p(k), f32p(v))
	if err := check(rc, "pkv_seq_gather"); err != nil {
		return nil, nil, err
	}
	return k, v, nil
}

// GatherInto is Gather into the caller's buffers, K, V or both (nil: not gathered), each
// [n][n_kv_heads][head_dim] for n = its length / (n_kv_heads * head_dim) positions from start
// (both the same n). K alone where V lives in K (MLA): a v is EINVAL.
func (c *Cache) GatherInto(s Seq, layer, start uint32, k, v []float32) error {
	row, err := c.kvElems(1, "Gather")
	if err != nil {
		return err
	}
	if err := c.noVInK(v != nil, "Gather"); err != nil {
		return err
	}
	var elems int
	switch {
	case k != nil && v != nil:
		if err := wantLen(len(v), len(k), "Gather: v (as k)"); err != nil {
			return err
		}
		elems = len(k)
	case k != nil:
		elems = len(k)
	case v != nil:
		elems = len(v)
	default:
		return invalid("Gather: neither k nor v given")
	}
	if elems%row != 0 {
		return invalid("Gather: %d elements, not a whole number of rows of %d", elems, row)
	}
	n, err := u32(elems/row, "Gather: positions")
	if err != nil {
		return err
	}
	return c.op("pkv_seq_gather", readKV, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_gather(p, C.pkv_seq(s), C.uint32_t(layer), C.uint32_t(start), n, f32p(k), f32p(v))
	}, s)
}

// storedBytes is the bytes of one position's stored rows, K and V: n_kv_heads rows of the
// pool's row bytes (RowBytes of KDtype and VDtype; V none where V lives in K).
func (c *Cache) storedBytes() (int, int) {
	h := int(c.cfg.NKVHeads)
	if c.cfg.VDim != 0 {
		return h * c.cfg.KDtype.RowBytes(c.cfg.HeadDim), 0
	}
	return h * c.cfg.KDtype.RowBytes(c.cfg.HeadDim), h * c.cfg.VDtype.RowBytes(c.cfg.HeadDim)
}

// ReadStored returns K and V of positions [start, start+n) of one layer exactly as the pool
// stores them (pkv_seq_read_stored): [n][n_kv_heads][row bytes], K in the cache's KDtype and V
// in its VDtype (RowBytes; scales inline for the quantized dtypes). WriteStored takes them
// back, into this cache or another of the same dtypes and head_dim, bit for bit: a sequence
// swapped out and in, or moved to another cache. It reads as Gather does. Where V lives in K
// (MLA, Config.VDim) V is nil: K's rows are all there is (and the other cache must have the
// same VDim).
func (c *Cache) ReadStored(s Seq, layer, start, n uint32) ([]byte, []byte, error) {
	p, g, err := c.enter(readKV, s)
	if err != nil {
		return nil, nil, err
	}
	defer g.exit()
	if err := inSeq(p, s, start, n, "pkv_seq_read_stored"); err != nil {
		return nil, nil, err
	}
	kb, vb := c.storedBytes()
	kn, err := mulLen(int(n), kb, "ReadStored: k")
	if err != nil {
		return nil, nil, err
	}
	vn, err := mulLen(int(n), vb, "ReadStored: v")
	if err != nil {
		return nil, nil, err
	}
	k, v := make([]byte, kn), []byte(nil)
	if c.cfg.VDim == 0 {
		v = make([]byte, vn)
	}
	rc := C.pkv_seq_read_stored(p, C.pkv_seq(s), C.uint32_t(layer), C.uint32_t(start), C.uint32_t(n), slicePtr(k),
		slicePtr(v))
	if err := check(rc, "pkv_seq_read_stored"); err != nil {
		return nil, nil, err
	}
	return k, v, nil
}

// ReadStoredInto is ReadStored into the caller's buffers, K, V or both (nil: not read), each
// holding n positions' rows for n = its length / the bytes of one position's rows (both the
// same n). K alone where V lives in K (MLA): a v is EINVAL.
func (c *Cache) ReadStoredInto(s Seq, layer, start uint32, k, v []byte) error {
	n, err := c.storedPositions(k, v, "ReadStoredInto")
	if err != nil {
		return err
	}
	kp, vp := slicePtr(k), slicePtr(v)
	return c.op("pkv_seq_read_stored", readKV, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_read_stored(p, C.pkv_seq(s), C.uint32_t(layer), C.uint32_t(start), n, kp, vp)
	}, s)
}

// storedPositions is the positions k and v (nil: not given) hold, both the same, as whole
// positions of the stored rows.
func (c *Cache) storedPositions(k, v []byte, what string) (C.uint32_t, error) {
	if c == nil {
		return 0, errClosed
	}
	if k == nil && v == nil {
		return 0, invalid("%s: neither k nor v given", what)
	}
	if err := c.noVInK(v != nil, what); err != nil {
		return 0, err
	}
	kb, vb := c.storedBytes()
	n := -1
	for _, x := range []struct {
		b    []byte
		per  int
		side string
	}{{k, kb, "k"}, {v, vb, "v"}} {
		if x.b == nil {
			continue
		}
		if x.per == 0 || len(x.b)%x.per != 0 {
			return 0, invalid("%s: %s: %d bytes, not whole positions of %d", what, x.side, len(x.b), x.per)
		}
		if m := len(x.b) / x.per; n >= 0 && m != n {
			return 0, invalid("%s: k holds %d positions, v %d", what, n, m)
		} else {
			n = m
		}
	}
	return u32(n, what+": positions")
}

// WriteStored writes rows as ReadStored gives them (nil: not written) to positions
// [start, start+n) of s (pkv_seq_write_stored), n the positions k or v holds (both the same).
// All-or-nothing, with WriteKVSeq's checks and locks; the rows are checked too (a scale or value
// not finite, past PKV_VALUE_MAX, or a code the encoder never writes is an error, nothing
// written). k alone where V lives in K (MLA): a v is EINVAL.
func (c *Cache) WriteStored(s Seq, layer, start uint32, k, v []byte) error {
	nn, err := c.storedPositions(k, v, "WriteStored")
	if err != nil {
		return err
	}
	kp, vp := slicePtr(k), slicePtr(v)
	return c.op("pkv_seq_write_stored", access{write: true, kv: useShared}, func(p *C.pkv_cache) C.int {
		return C.pkv_seq_write_stored(p, C.pkv_seq(s), C.uint32_t(layer), C.uint32_t(start), nn, kp, vp)
	}, s)
}

// ExportDense is vLLM's dense block tables: [len(seqs)][maxBlocks] (unused -1), and seq_lens.
// EINVAL where maxBlocks is over the cache's MaxBlocksPerSeq (no table is longer: the rest would
// be padding), checked before the tables are allocated.
func (c *Cache) ExportDense(seqs []Seq, maxBlocks uint32) ([]int32, []int32, error) {
	if c == nil {
		return nil, nil, errClosed
	}
	n, err := u32(len(seqs), "ExportDense: seqs")
	if err != nil {
		return nil, nil, err
	}
	if maxBlocks > c.cfg.MaxBlocksPerSeq {
		return nil, nil, invalid("ExportDense: maxBlocks %d over the cache's MaxBlocksPerSeq %d", maxBlocks,
			c.cfg.MaxBlocksPerSeq)
	}
	nt, err := mulLen(len(seqs), int(maxBlocks), "ExportDense")
	if err != nil {
		return nil, nil, err
	}
	tables, lens := make([]int32, nt), make([]int32, len(seqs))
	err = c.op("pkv_export_dense", readSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_export_dense(p, seqp(seqs), n, C.uint32_t(maxBlocks), i32p(tables), i32p(lens))
	}, seqs...)
	if err != nil {
		return nil, nil, err
	}
	return tables, lens, nil
}

// ExportCSR is FlashInfer's paged layout: indptr [len(seqs)+1], indices, last_page_len.
func (c *Cache) ExportCSR(seqs []Seq) ([]int32, []int32, []int32, error) {
	n, err := u32(len(seqs), "ExportCSR: seqs")
	if err != nil {
		return nil, nil, nil, err
	}
	p, g, err := c.enter(readSeqs, seqs...)
	if err != nil {
		return nil, nil, nil, err
	}
	defer g.exit() // the sequences' locks keep their tables as they are between the two calls
	indptr, last := make([]int32, len(seqs)+1), make([]int32, len(seqs))
	var need C.uint32_t
	rc := C.pkv_export_csr(p, seqp(seqs), n, i32p(indptr), nil, 0, i32p(last), &need)
	if rc != 0 && rc != EINVAL {
		return nil, nil, nil, check(rc, "pkv_export_csr")
	}
	indices := make([]int32, need)
	rc = C.pkv_export_csr(p, seqp(seqs), n, i32p(indptr), i32p(indices), need, i32p(last), &need)
	if err := check(rc, "pkv_export_csr"); err != nil {
		return nil, nil, nil, err
	}
	return indptr, indices, last, nil
}

// ---- prefix-index events ----

// EventKind is what a prefix-index event says (pkv_event_kind; "prefix-index events" in pkv.h).
type EventKind uint32

const (
	// EventStored: a full committed block was indexed (Commit, TierLoad, ...); a parent's comes
	// before its children's.
	EventStored EventKind = C.PKV_EVENT_STORED
	// EventRemoved: an indexed block was evicted to make room; children go before parents.
	EventRemoved EventKind = C.PKV_EVENT_REMOVED
	// EventCleared: Reset emptied the index (no EventRemoved for its blocks).
	EventCleared EventKind = C.PKV_EVENT_CLEARED
	// EventOverflow: the ring was full; Lost events were dropped, and what the consumer knows
	// of the index is stale: rebuild it from PrefixSnapshot.
	EventOverflow EventKind = C.PKV_EVENT_OVERFLOW
)

// String is the kind's name: "stored", "removed", "cleared", "overflow" (else "EventKind(n)").
func (k EventKind) String() string {
	switch k {
	case EventStored:
		return "stored"
	case EventRemoved:
		return "removed"
	case EventCleared:
		return "cleared"
	case EventOverflow:
		return "overflow"
	}
	return fmt.Sprintf("EventKind(%d)", uint32(k))
}

// Event is a prefix-index event (pkv_event), from TakeEvents or PrefixSnapshot. A block is
// named by its identity hash: what PrefixHashes computes from a prompt, with no cache.
type Event struct {
	Seqno      uint64    // 1, 2, 3, ... over the cache's life (lost events included); 0 in a snapshot
	Kind       EventKind // what happened
	Hash       uint64    // EventStored / EventRemoved: the block's identity hash; else 0
	ParentHash uint64    // EventStored / EventRemoved: its parent's, 0 for a first block
	Depth      uint32    // EventStored / EventRemoved: the block's index in its chain (positions Depth x B ..)
	Block      uint32    // EventStored / EventRemoved: the pool block at the time (compaction may move it)
	Lost       uint64    // EventOverflow: the events dropped; else 0
	Tokens     []int32   // EventStored / EventRemoved, when asked for: the block's token ids; else nil
}

// events is the first n of raw as Events; toks: their blocks' token ids, b an event (nil: not
// taken).
func events(raw []C.pkv_event, n int, toks []int32, b int) []Event {
	out := make([]Event, n)
	for i := range out {
		e := &raw[i]
		k := EventKind(e.kind)
		out[i] = Event{Seqno: uint64(e.seqno), Kind: k, Hash: uint64(e.hash), ParentHash: uint64(e.parent_hash),
			Depth: uint32(e.depth), Block: uint32(e.block), Lost: uint64(e.lost)}
		if toks != nil && (k == EventStored || k == EventRemoved) {
			out[i].Tokens = append([]int32(nil), toks[i*b:(i+1)*b]...)
		}
	}
	return out
}

// TakeEvents takes the oldest recorded prefix-index events, at most max, and forgets them
// (pkv_cache_take_events); none held: an empty slice, at once. With withTokens, each
// EventStored / EventRemoved event carries its block's token ids. EINVAL for a cache created
// with EventCapacity 0. An EventOverflow event says events were dropped: rebuild from
// PrefixSnapshot. It names no sequence, so it waits for none; one consumer, though: two
// goroutines taking at once each get a share.
func (c *Cache) TakeEvents(max int, withTokens bool) ([]Event, error) {
	if c == nil {
		return nil, errClosed
	}
	if max < 0 {
		return nil, invalid("TakeEvents: max %d", max)
	}
	n := max
	if ec := int64(c.cfg.EventCapacity); int64(n) > ec { // the ring never holds more
		n = int(ec)
	}
	b := int(c.cfg.BlockTokens)
	raw, toks, err := eventBufs(n, b, withTokens, "TakeEvents")
	if err != nil {
		return nil, err
	}
	var got C.size_t
	err = c.op("pkv_cache_take_events", readSeqs, func(p *C.pkv_cache) C.int {
		return C.pkv_cache_take_events(p, (*C.pkv_event)(slicePtr(raw)), C.size_t(n), i32p(toks), &got)
	})
	if err != nil {
		return nil, err
	}
	return events(raw, int(got), toks, b), nil
}

// eventBufs makes room for n events and, withTokens, their blocks' b token ids each.
func eventBufs(n, b int, withTokens bool, what string) ([]C.pkv_event, []int32, error) {
	raw := make([]C.pkv_event, n)
	if !withTokens {
		return raw, nil, nil
	}
	nt, err := mulLen(n, b, what+": tokens")
	if err != nil {
		return nil, nil, err
	}
	return raw, make([]int32, nt), nil
}

// PrefixSnapshot is the whole prefix index now, as EventStored events (Seqno 0), every parent
// before its children, and the recorded events forgotten in the same step (pkv_prefix_snapshot):
// a consumer that applies it and then every event it takes afterwards stays exact. Works with
// EventCapacity 0 as well. With withTokens, each event carries its block's token ids.
func (c *Cache) PrefixSnapshot(withTokens bool) ([]Event, error) {
	p, g, err := c.enter(readSeqs)
	if err != nil {
		return nil, err
	}
	defer g.exit()
	b := int(c.cfg.BlockTokens)
	room := func(n uint64) (int, error) {
		if n > uint64(math.MaxInt-64) {
			return 0, invalid("PrefixSnapshot: %d indexed blocks is past int", n)
		}
		return int(n) + 64, nil
	}
	var st C.pkv_stats
	if err := check(C.pkv_cache_get_stats(p, &st), "pkv_cache_get_stats"); err != nil {
		return nil, err
	}
	n, err := room(uint64(st.n_indexed) + uint64(st.n_tombstones)) // room for what other goroutines index meanwhile, usually
	if err != nil {
		return nil, err
	}
	for {
		raw, toks, err := eventBufs(n, b, withTokens, "PrefixSnapshot")
		if err != nil {
			return nil, err
		}
		var got C.size_t
		rc := C.pkv_prefix_snapshot(p, (*C.pkv_event)(slicePtr(raw)), C.size_t(n), i32p(toks), &got)
		if rc == ELIMIT && uint64(got) > uint64(n) {
			// the index grew past that: again, with room (forgetting the refusal it said)
			var buf [C.PKVGO_SAID_CAP]C.char
			C.pkvgo_take_said(&buf[0])
			if n, err = room(uint64(got)); err != nil {
				return nil, err
			}
			continue
		}
		if err := check(rc, "pkv_prefix_snapshot"); err != nil {
			return nil, err
		}
		return events(raw, int(got), toks, b), nil
	}
}

// PrefixHashes is the identity hashes a cache with this blockTokens gives the full blocks of
// tokens under the namespace salt (as SeqCreate's), one a full block (pkv_prefix_hashes): what
// the events of TakeEvents name. It needs no cache: a router computes a prompt's hashes and
// counts how many leading ones each engine's events say it holds. EINVAL for blockTokens
// outside 1..1024 or a salt over 256 bytes.
func PrefixHashes(salt []byte, blockTokens uint32, tokens []int32) ([]uint64, error) {
	if blockTokens == 0 || blockTokens > math.MaxInt32 {
		return nil, invalid("PrefixHashes: block_tokens %d not in 1..1024", blockTokens)
	}
	out := make([]uint64, len(tokens)/int(blockTokens))
	var sp unsafe.Pointer
	if len(salt) > 0 {
		sp = unsafe.Pointer(&salt[0])
	}
	var n C.size_t
	rc := C.pkv_prefix_hashes(sp, C.size_t(len(salt)), C.uint32_t(blockTokens), i32p(tokens), C.size_t(len(tokens)),
		(*C.uint64_t)(slicePtr(out)), C.size_t(len(out)), &n)
	if err := check(rc, "pkv_prefix_hashes: block_tokens not in 1..1024 or a salt over 256 bytes"); err != nil {
		return nil, err
	}
	return out[:n], nil
}

// MediaTokens is token ids (all negative) for n positions of an image, audio clip or other
// media in a prompt, its positions offset .. offset + n - 1, from contentID: a digest of the
// content and of how it was preprocessed (SHA-256 of both) or the bytes themselves
// (pkv_media_tokens). The prefix
// index compares token ids only, so a model's placeholder ids would let a prompt with another
// image match this one: append these in their place (the model still embeds its own) and pass
// them to MatchPrefix and PrefixHashes. EINVAL for an empty contentID, a negative n or
// offset + n over 2^32.
func MediaTokens(contentID []byte, offset uint32, n int) ([]int32, error) {
	if len(contentID) == 0 {
		return nil, invalid("MediaTokens: contentID is empty (content with no identity)")
	}
	if n < 0 || uint64(offset)+uint64(n) > 1<<32 {
		return nil, invalid("MediaTokens: offset %d + n %d is not in 0..2^32", offset, n)
	}
	out := make([]int32, n)
	rc := C.pkv_media_tokens(unsafe.Pointer(&contentID[0]), C.size_t(len(contentID)), C.uint32_t(offset),
		C.uint32_t(n), i32p(out))
	if err := check(rc, "pkv_media_tokens"); err != nil {
		return nil, err
	}
	return out, nil
}

// Stats is pkv_cache_get_stats.
func (c *Cache) Stats() (Stats, error) {
	var s C.pkv_stats
	if err := c.op("pkv_cache_get_stats", readSeqs, func(p *C.pkv_cache) C.int { return C.pkv_cache_get_stats(p, &s) }); err != nil {
		return Stats{}, err
	}
	return Stats{uint32(s.n_blocks), uint32(s.n_free), uint32(s.n_cached), uint32(s.n_active), uint32(s.n_seqs),
		uint32(s.n_pins), uint64(s.n_tokens), uint64(s.n_slots_used), uint64(s.kv_bytes),
		uint64(s.kv_bytes_per_block), uint64(s.meta_bytes), uint64(s.frag_slots), uint64(s.cow_copies),
		uint32(s.peak_active), uint64(s.prefix_lookups), uint64(s.prefix_tokens_queried),
		uint64(s.prefix_tokens_hit), uint64(s.prefix_miss_new), uint64(s.prefix_miss_evicted),
		uint64(s.prefix_miss_namespace), uint64(s.n_indexed), uint64(s.evictions), uint64(s.attn_reqs_pool),
		uint64(s.attn_reqs_table), uint64(s.attn_shared_keys), uint64(s.n_tombstones),
		uint64(s.prefix_tomb_hits)}, nil
}

// Check verifies every invariant; the error (ECORRUPT) names the first one broken.
func (c *Cache) Check() error {
	p, g, err := c.enter(readSeqs)
	if err != nil {
		return err
	}
	defer g.exit()
	var msg [512]C.char
	rc := C.pkv_cache_check(p, &msg[0], C.size_t(len(msg)))
	return check(rc, "pkv_cache_check: "+C.GoString(&msg[0]))
}

// attnCall runs one attention call of `items` sequences or requests and `rows` queries: the
// params, q's (HeadDim a head), out's (outDim a head), lse's, sinks' and ALiBi slopes' lengths checked, then
// call holding the sequences' locks shared. cgo forbids a Go pointer inside the params struct
// handed to C, so a wanted lse is written to C memory and copied into lse once the call
// succeeded, and sinks and ALiBi slopes are copied into C memory before it (where out and lse
// cannot overlap them).
func (c *Cache) attnCall(what, cname string, seqs []Seq, items, rows int, q, out []float32, ap AttnParams, lse []float32,
	call func(p *C.pkv_cache, n C.uint32_t, raw *C.pkv_attn_params) C.int) error {
	if c == nil {
		return errClosed
	}
	if ap.NQHeads > math.MaxInt32 {
		return invalid("%s: NQHeads %d", what, ap.NQHeads)
	}
	hq := int(ap.NQHeads)
	if hq == 0 {
		hq = int(c.cfg.NKVHeads)
	}
	rowsHq, err := mulLen(rows, hq, what)
	if err != nil {
		return err
	}
	n, err := mulLen(rowsHq, int(c.cfg.HeadDim), what)
	if err != nil {
		return err
	}
	if err := wantLenOf(len(q), n, what, "q"); err != nil {
		return err
	}
	nOut, err := mulLen(rowsHq, int(c.outDim()), what)
	if err != nil {
		return err
	}
	if err := wantLenOf(len(out), nOut, what, "out"); err != nil {
		return err
	}
	if uint64(items) > math.MaxUint32 {
		_, err := u32(items, what+": items")
		return err
	}
	ni := C.uint32_t(items)
	raw := C.pkv_attn_params_default()
	raw.n_q_heads, raw.scale, raw.softcap, raw.window = C.uint32_t(ap.NQHeads), C.float(ap.Scale), C.float(ap.Softcap), C.uint32_t(ap.Window)
	raw.attn_chunk = C.uint32_t(ap.AttnChunk)
	if ap.BF16Dot {
		raw.flags = C.PKV_ATTN_BF16_DOT
	}
	if ap.NonCausal {
		raw.flags |= C.PKV_ATTN_NONCAUSAL
	}
	if ap.F16AsBF16 {
		raw.flags |= C.PKV_ATTN_F16_AS_BF16
	}
	if ap.Sinks != nil {
		if err := wantLenOf(len(ap.Sinks), hq, what, "sinks"); err != nil {
			return err
		}
		buf := (*C.float)(C.malloc(C.size_t(hq) * C.sizeof_float)) // hq >= 1
		if buf == nil {
			return &Error{Code: ENOMEM, Op: what + ": sinks"}
		}
		defer C.free(unsafe.Pointer(buf))
		copy(unsafe.Slice((*float32)(unsafe.Pointer(buf)), hq), ap.Sinks)
		raw.sinks = buf
	}
	if ap.AlibiSlopes != nil {
		if err := wantLenOf(len(ap.AlibiSlopes), hq, what, "alibi slopes"); err != nil {
			return err
		}
		buf := (*C.float)(C.malloc(C.size_t(hq) * C.sizeof_float))
		if buf == nil {
			return &Error{Code: ENOMEM, Op: what + ": alibi slopes"}
		}
		defer C.free(unsafe.Pointer(buf))
		copy(unsafe.Slice((*float32)(unsafe.Pointer(buf)), hq), ap.AlibiSlopes)
		raw.alibi_slopes = buf
	}
	if lse != nil {
		if err := wantLenOf(len(lse), rowsHq, what, "lse"); err != nil {
			return err
		}
		if len(lse) > 0 {
			buf := (*C.float)(C.malloc(C.size_t(len(lse)) * C.sizeof_float))
			if buf == nil {
				return &Error{Code: ENOMEM, Op: what + ": lse"}
			}
			defer C.free(unsafe.Pointer(buf))
			raw.lse = buf
		}
	}
	p, g, err := c.enter(readKV, seqs...)
	if err != nil {
		return err
	}
	defer g.exit()
	rc := call(p, ni, &raw)
	if rc == 0 && raw.lse != nil {
		copy(lse, unsafe.Slice((*float32)(unsafe.Pointer(raw.lse)), len(lse)))
	}
	return check(rc, cname)
}

// Decode is pkv_attn_decode: one query per sequence at its last position. q and out:
// [len(seqs)][n_q_heads][head_dim] (out [len(seqs)][n_q_heads][VDim] where V lives in K, MLA:
// Config.VDim; out may then not be q, EINVAL from libpkv); lse, if not nil,
// [len(seqs)][n_q_heads]; ap.Sinks, if not nil, [n_q_heads].
func (c *Cache) Decode(layer uint32, seqs []Seq, q, out []float32, ap AttnParams, lse []float32) error {
	return c.attnCall("Decode", "pkv_attn_decode", seqs, len(seqs), len(seqs), q, out, ap, lse,
		func(p *C.pkv_cache, n C.uint32_t, raw *C.pkv_attn_params) C.int {
			return C.pkv_attn_decode(p, C.uint32_t(layer), seqp(seqs), n, f32p(q), f32p(out), raw)
		})
}

// Prefill is pkv_attn_prefill over a ragged batch, causal. q and out: the requests' queries
// concatenated, [sum NQ][n_q_heads][head_dim] (out [..][VDim] where V lives in K, as for
// Decode); lse, if not nil, [sum NQ][n_q_heads]; ap.Sinks, if not nil, [n_q_heads].
func (c *Cache) Prefill(layer uint32, reqs []AttnReq, q, out []float32, ap AttnParams, lse []float32) error {
	var total64 uint64
	for _, r := range reqs {
		total64 += uint64(r.NQ)
	}
	if total64 > math.MaxInt32 { // more rows than a call takes, and past a 32-bit int
		return invalid("Prefill: %d queries in all", total64)
	}
	total := int(total64)
	var rp *C.pkv_attn_req
	if len(reqs) > 0 {
		rp = (*C.pkv_attn_req)(unsafe.Pointer(&reqs[0])) // same layout (TestLayout)
	}
	var buf [16]Seq // the requests' sequences, for their locks
	seqs := buf[:0]
	for _, r := range reqs {
		seqs = append(seqs, r.Seq)
	}
	return c.attnCall("Prefill", "pkv_attn_prefill", seqs, len(reqs), total, q, out, ap, lse,
		func(p *C.pkv_cache, n C.uint32_t, raw *C.pkv_attn_params) C.int {
			return C.pkv_attn_prefill(p, C.uint32_t(layer), rp, n, f32p(q), f32p(out), raw)
		})
}

// PackMask packs a row-major [n_q][kv_len] mask of bools as PrefillMasked reads it: bool i is
// bit i % 8 of byte i / 8 (numpy's packbits(bitorder="little")).
func PackMask(bits []bool) []byte {
	out := make([]byte, (len(bits)+7)/8)
	for i, b := range bits {
		if b {
			out[i/8] |= 1 << (i % 8)
		}
	}
	return out
}

// PrefillMasked is pkv_attn_prefill_masked: Prefill with a custom mask per request. masks[i]
// nil leaves request i to Prefill's rule; otherwise its query j sees key t exactly where bit
// j*kvLen + t of masks[i] is set (PackMask), kvLen = QStart + NQ, or the sequence's length with
// ap.NonCausal. Causality is the mask's to say: keys ahead of a query may be seen (bidirectional
// image or prefix tokens), a packed sequence's documents kept apart. A query that sees no key
// gets 0 (lse -inf, or the sink's). A mask shorter than its NQ x kvLen bits, or a count of masks
// other than the requests', is EINVAL here (with ap.NonCausal also a sequence whose length
// changed before the call took its locks); a window or AttnChunk with a mask is libpkv's EINVAL.
// The masks are copied for the call.
func (c *Cache) PrefillMasked(layer uint32, reqs []AttnReq, masks [][]byte, q, out []float32, ap AttnParams,
	lse []float32) error {
	if c == nil {
		return errClosed
	}
	if len(masks) != len(reqs) {
		return invalid("PrefillMasked: %d masks for %d requests", len(masks), len(reqs))
	}
	var total64, bytes uint64
	need := make([]uint64, len(reqs)) // each mask's bytes; kv: its row's bits
	kv := make([]uint64, len(reqs))
	for i, r := range reqs {
		total64 += uint64(r.NQ)
		if masks[i] == nil {
			continue
		}
		kv[i] = uint64(r.QStart) + uint64(r.NQ)
		if ap.NonCausal {
			info, err := c.SeqInfo(r.Seq)
			if err != nil {
				return err
			}
			kv[i] = uint64(info.NTokens)
		}
		need[i] = (uint64(r.NQ)*kv[i] + 7) / 8
		if uint64(len(masks[i])) < need[i] {
			return invalid("PrefillMasked: mask %d has %d bytes, %d needed (%d x %d bits)", i, len(masks[i]), need[i],
				r.NQ, kv[i])
		}
		bytes += need[i]
	}
	if total64 > math.MaxInt32 || bytes > math.MaxInt32 {
		return invalid("PrefillMasked: %d queries, %d bytes of masks", total64, bytes)
	}
	// the masks and their pointers in C memory (cgo: C may not hold Go pointers)
	ptrs := (*unsafe.Pointer)(C.malloc(C.size_t(len(reqs)+1) * C.size_t(unsafe.Sizeof(unsafe.Pointer(nil)))))
	if ptrs == nil {
		return &Error{Code: ENOMEM, Op: "PrefillMasked: masks"}
	}
	defer C.free(unsafe.Pointer(ptrs))
	data := (*byte)(C.malloc(C.size_t(bytes + 1)))
	if data == nil {
		return &Error{Code: ENOMEM, Op: "PrefillMasked: masks"}
	}
	defer C.free(unsafe.Pointer(data))
	pv, dv := unsafe.Slice(ptrs, len(reqs)+1), unsafe.Slice(data, bytes+1)
	at := uint64(0)
	for i := range reqs {
		pv[i] = nil
		if masks[i] != nil {
			copy(dv[at:at+need[i]], masks[i])
			pv[i] = unsafe.Pointer(&dv[at])
			at += need[i]
		}
	}
	var rp *C.pkv_attn_req
	if len(reqs) > 0 {
		rp = (*C.pkv_attn_req)(unsafe.Pointer(&reqs[0])) // same layout (TestLayout)
	}
	seqs := make([]Seq, 0, len(reqs))
	for _, r := range reqs {
		seqs = append(seqs, r.Seq)
	}
	return c.attnCall("PrefillMasked", "pkv_attn_prefill_masked", seqs, len(reqs), int(total64), q, out, ap, lse,
		func(p *C.pkv_cache, n C.uint32_t, raw *C.pkv_attn_params) C.int {
			for i, r := range reqs { // under the sequences' locks: the lengths the masks were sized for
				var info C.pkv_seq_info
				if masks[i] != nil && ap.NonCausal &&
					(C.pkv_seq_get_info(p, C.pkv_seq(r.Seq), &info) != 0 || uint64(info.n_tokens) != kv[i]) {
					return C.PKV_EINVAL
				}
			}
			return C.pkv_attn_prefill_masked(p, C.uint32_t(layer), rp, n, (**C.uint8_t)(unsafe.Pointer(ptrs)),
				f32p(q), f32p(out), raw)
		})
}

// Tree is pkv_attn_tree, tree attention for speculative decoding (SpecInfer / Medusa / EAGLE
// verification): node i of a request sees the positions before its QStart (the prefix) and the
// nodes on its path to its root, itself included, not its siblings or other branches. With a
// window, a key is seen where the node's position (QStart + depth) minus the key's (its position
// in the prefix, or QStart + depth for a node) is under the window. q and out: the requests'
// nodes' queries concatenated, [sum len(Parent)][n_q_heads][head_dim] (out [..][VDim] where V
// lives in K, as for Decode), and out may not be q (unlike Decode and Prefill: EINVAL from
// libpkv); lse, if not nil, [sum len(Parent)][n_q_heads]; ap.Sinks, if not nil, [n_q_heads]; ap
// means what it means for Prefill, per node. A chain (Parent[i] = i - 1) gives what Prefill gives
// over the same positions, up to float rounding. A parent outside [-1, i), more than TreeMaxNodes
// nodes, nodes past the sequence's length, and every refusal of Prefill are EINVAL, nothing
// written. Accepting a path afterwards: Truncate to drop the tree, or Keep. It locks as Prefill
// does. cgo forbids Go pointers in Go memory handed to C, so the requests and their parents are
// copied into one C buffer for the call.
func (c *Cache) Tree(layer uint32, reqs []TreeReq, q, out []float32, ap AttnParams, lse []float32) error {
	var total64 uint64
	for _, r := range reqs {
		total64 += uint64(len(r.Parent))
	}
	if total64 > math.MaxInt32 { // more rows than a call takes, and past a 32-bit int
		return invalid("Tree: %d nodes in all", total64)
	}
	total := int(total64)
	if uint64(len(reqs)) > math.MaxUint32 {
		_, err := u32(len(reqs), "Tree: items")
		return err
	}
	var rp *C.pkv_attn_tree_req
	if len(reqs) > 0 {
		// the requests, then the parents: total <= 2^31 - 1 and len(reqs) <= 2^32 - 1, so the
		// size fits 64 bits; past a 32-bit size_t it is refused
		size64 := uint64(len(reqs))*uint64(C.sizeof_pkv_attn_tree_req) + uint64(total)*uint64(C.sizeof_int32_t)
		if size64 > uint64(^C.size_t(0)) || size64 > math.MaxInt {
			return invalid("Tree: %d requests of %d nodes in all", len(reqs), total)
		}
		buf := C.malloc(C.size_t(size64))
		if buf == nil {
			return &Error{Code: ENOMEM, Op: "Tree: requests"}
		}
		defer C.free(buf)
		rs := unsafe.Slice((*C.pkv_attn_tree_req)(buf), len(reqs))
		ps := unsafe.Slice((*int32)(unsafe.Add(buf, uintptr(len(reqs))*uintptr(C.sizeof_pkv_attn_tree_req))), total)
		at := 0
		for i, r := range reqs {
			rs[i].seq, rs[i].q_start, rs[i].n_nodes = C.pkv_seq(r.Seq), C.uint32_t(r.QStart), C.uint32_t(len(r.Parent))
			rs[i].parent = nil
			if len(r.Parent) > 0 {
				rs[i].parent = (*C.int32_t)(unsafe.Pointer(&ps[at]))
			}
			at += copy(ps[at:], r.Parent)
		}
		rp = &rs[0]
	}
	var buf [16]Seq // the requests' sequences, for their locks
	seqs := buf[:0]
	for _, r := range reqs {
		seqs = append(seqs, r.Seq)
	}
	return c.attnCall("Tree", "pkv_attn_tree", seqs, len(reqs), total, q, out, ap, lse,
		func(p *C.pkv_cache, n C.uint32_t, raw *C.pkv_attn_params) C.int {
			return C.pkv_attn_tree(p, C.uint32_t(layer), rp, n, f32p(q), f32p(out), raw)
		})
}

// Merge is pkv_attn_merge: two partial results of the same rows over disjoint key sets, merged
// by their log-sum-exps. outA, outB, out: [rows][headDim]; lseA, lseB, lse (may be nil): [rows].
// For outputs of a cache whose V lives in K (MLA), headDim is its VDim.
func Merge(headDim uint32, outA, lseA, outB, lseB, out, lse []float32) error {
	if headDim == 0 || headDim > math.MaxInt32 {
		return invalid("Merge: head_dim %d", headDim)
	}
	rows := len(lseA)
	elems, err := mulLen(rows, int(headDim), "Merge")
	if err != nil {
		return err
	}
	for _, x := range []struct {
		s    []float32
		n    int
		what string
	}{{outA, elems, "Merge: outA"}, {outB, elems, "Merge: outB"}, {lseB, rows, "Merge: lseB"},
		{out, elems, "Merge: out"}} {
		if err := wantLen(len(x.s), x.n, x.what); err != nil {
			return err
		}
	}
	if lse != nil {
		if err := wantLen(len(lse), rows, "Merge: lse"); err != nil {
			return err
		}
	}
	nr, err := u32(rows, "Merge: rows")
	if err != nil {
		return err
	}
	return check(C.pkv_attn_merge(nr, C.uint32_t(headDim), f32p(outA), f32p(lseA), f32p(outB), f32p(lseB), f32p(out),
		f32p(lse)), "pkv_attn_merge")
}

// attnReqLayout reports C's sizeof(pkv_attn_req) and its fields' offsets, for TestLayout.
func attnReqLayout() (size uintptr, offs [3]uintptr) {
	for i := range offs {
		offs[i] = uintptr(C.pkvgo_attn_req_off(C.int(i)))
	}
	return uintptr(C.pkvgo_attn_req_size()), offs
}

// ---- storage tiers ----

// Tier is a storage tier (pkv_tier): whole prefix blocks kept out of the pool, in host memory,
// files or Redis, for TierLoad to copy back instead of recomputing them ("storage tiers" in
// pkv.h). One tier may serve several caches and goroutines. Close frees it (a file tier's files
// stay); calls on a closed (or nil) Tier return ErrClosed.
type Tier struct {
	mu sync.RWMutex // Close holds it alone; every other call shares it
	t  *C.pkv_tier
}

// TierStats are a tier's counters: the store's own (Entries, Bytes, Capacity, Evictions; 0 for
// Redis), what saves and loads did, and the prefetch's (PrefetchStart): entries fetched into
// staging (Prefetched), blocks loads took from it (PrefetchHits), staged entries dropped unused
// for room (PrefetchDropped), and what staging holds now (StagedEntries, StagedBytes).
type TierStats struct {
	Entries, Bytes, Capacity, Evictions                      uint64
	Saved, SavePresent, SaveNoRoom                           uint64
	LoadedBlocks, LoadedTokens, LoadMisses, Rejected, Errors uint64
	Prefetched, PrefetchHits, PrefetchDropped                uint64
	StagedEntries, StagedBytes                               uint64
}

func newTier(op string, f func(out **C.pkv_tier) C.int) (*Tier, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var p *C.pkv_tier
	if err := check(f(&p), op); err != nil {
		return nil, err
	}
	t := &Tier{t: p}
	runtime.SetFinalizer(t, (*Tier).Close)
	return t, nil
}

// NewHostTier is a tier in host memory: at most capacity bytes (> 0) of entries, the least
// recently used dropped.
func NewHostTier(capacity uint64) (*Tier, error) {
	return newTier("pkv_tier_host_create", func(out **C.pkv_tier) C.int {
		return C.pkv_tier_host_create(C.uint64_t(capacity), nil, out)
	})
}

// NewFileTier is a tier of files in dir (made if missing; entries already there are taken
// over), at most capacity bytes of them, the least recently used dropped. ErrIO where dir
// cannot be used.
func NewFileTier(dir string, capacity uint64) (*Tier, error) {
	if strings.IndexByte(dir, 0) >= 0 {
		return nil, invalid("NewFileTier: dir contains a NUL byte")
	}
	d := C.CString(dir)
	defer C.free(unsafe.Pointer(d))
	return newTier("pkv_tier_file_create", func(out **C.pkv_tier) C.int {
		return C.pkv_tier_file_create(d, C.uint64_t(capacity), nil, out)
	})
}

// NewRedisTier is a tier on the Redis server at host:port, keys under keyPrefix ("" for the
// default, "pkv:"); the server's maxmemory and maxmemory-policy decide what stays. ErrNotSupported
// where libpkv was built without hiredis, ErrIO where the server does not answer. timeoutMs 0:
// 1000.
func NewRedisTier(host string, port int, keyPrefix string, timeoutMs uint32) (*Tier, error) {
	if strings.IndexByte(host, 0) >= 0 || strings.IndexByte(keyPrefix, 0) >= 0 {
		return nil, invalid("NewRedisTier: host and keyPrefix must not contain NUL bytes")
	}
	if port <= 0 || port > 65535 {
		return nil, invalid("NewRedisTier: port %d not in 1..65535", port)
	}
	h := C.CString(host)
	defer C.free(unsafe.Pointer(h))
	var kp *C.char
	if keyPrefix != "" {
		kp = C.CString(keyPrefix)
		defer C.free(unsafe.Pointer(kp))
	}
	return newTier("pkv_tier_redis_create", func(out **C.pkv_tier) C.int {
		return C.pkv_tier_redis_create(h, C.int(port), kp, C.uint32_t(timeoutMs), nil, out)
	})
}

// Close frees the tier once the calls in flight on it have returned. Closing twice (or a nil
// Tier) is a no-op.
func (t *Tier) Close() {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	runtime.SetFinalizer(t, nil)
	if t.t != nil {
		C.pkv_tier_destroy(t.t)
		t.t = nil
	}
}

// use runs f on the open tier, which Close waits for.
func (t *Tier) use(f func(p *C.pkv_tier) error) error {
	if t == nil {
		return errClosed
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.t == nil {
		return errClosed
	}
	return f(t.t)
}

// Stats returns the tier's counters (pkv_tier_get_stats).
func (t *Tier) Stats() (TierStats, error) {
	var st C.pkv_tier_stats
	err := t.use(func(p *C.pkv_tier) error { return check(C.pkv_tier_get_stats(p, &st), "pkv_tier_get_stats") })
	return TierStats{uint64(st.entries), uint64(st.bytes), uint64(st.capacity), uint64(st.evictions),
		uint64(st.saved), uint64(st.save_present), uint64(st.save_no_room), uint64(st.loaded_blocks),
		uint64(st.loaded_tokens), uint64(st.load_misses), uint64(st.rejected), uint64(st.errors),
		uint64(st.prefetched), uint64(st.prefetch_hits), uint64(st.prefetch_dropped),
		uint64(st.staged_entries), uint64(st.staged_bytes)}, err
}

// PrefetchStart starts the tier's prefetch thread (libpkv's own; pkv_tier_prefetch_start), with
// stagingBytes (> 0) of host memory to stage entries in, the oldest dropped past it: Prefetch
// then fetches a prompt's entries from the store ahead of the TierLoad that copies them. Once a
// tier: ErrInvalid after that (and for stagingBytes 0); ErrNoMem where no thread can be started.
// Close stops the thread.
func (t *Tier) PrefetchStart(stagingBytes uint64) error {
	return t.use(func(p *C.pkv_tier) error {
		return check(C.pkv_tier_prefetch_start(p, C.uint64_t(stagingBytes)), "pkv_tier_prefetch_start: stagingBytes 0, or started already")
	})
}

// Prefetch queues the entries of the full blocks of tokens (those a later TierLoad of this
// prompt asks for) under the namespace salt (at most 256 bytes, as SeqCreate's) for caches of
// c's shape, and returns (pkv_tier_prefetch): the prefetch thread fetches them in order into
// staging, up to the first the store lacks. It reads only c's shape, and c may be closed before
// the fetch is done. ErrInvalid before PrefetchStart; ErrBusy while 64 prefetches are queued;
// ErrClosed for a closed (or nil) tier or cache.
func (t *Tier) Prefetch(c *Cache, salt []byte, tokens []int32) error {
	return t.prefetch(c, salt, tokens, 0)
}

// PrefetchWindow is Prefetch for a TierLoadWindow of the prompt into an empty sequence
// (pkv_tier_prefetch_window): the thread fetches the blocks the window of the whole prompt
// reads, in order, up to the first the store lacks. ErrInvalid for window 0 too.
func (t *Tier) PrefetchWindow(c *Cache, salt []byte, tokens []int32, window uint32) error {
	if window == 0 {
		return invalid("PrefetchWindow: window 0")
	}
	return t.prefetch(c, salt, tokens, window)
}

func (t *Tier) prefetch(c *Cache, salt []byte, tokens []int32, window uint32) error {
	if len(salt) > 256 {
		return invalid("Prefetch: salt of %d bytes, at most 256", len(salt))
	}
	n, err := u32(len(tokens), "Prefetch: tokens")
	if err != nil {
		return err
	}
	var sp unsafe.Pointer
	if len(salt) > 0 {
		sp = unsafe.Pointer(&salt[0])
	}
	return t.use(func(tp *C.pkv_tier) error {
		// the gate shared, no sequence named: it reads only c's shape
		p, g, err := c.enter(readSeqs)
		if err != nil {
			return err
		}
		defer g.exit()
		var rc C.int
		if window == 0 {
			rc = C.pkv_tier_prefetch(tp, p, sp, C.size_t(len(salt)), i32p(tokens), n)
		} else {
			rc = C.pkv_tier_prefetch_window(tp, p, sp, C.size_t(len(salt)), i32p(tokens), n, C.uint32_t(window))
		}
		op := "pkv_tier_prefetch"
		if window != 0 {
			op = "pkv_tier_prefetch_window"
		}
		switch rc {
		case EINVAL:
			op += ": PrefetchStart not called"
		case EBUSY:
			op += ": 64 prefetches queued"
		}
		return check(rc, op)
	})
}

// PrefetchWait waits until every queued prefetch is done: staged, or stopped at an entry the
// store lacks (pkv_tier_prefetch_wait). ErrInvalid before PrefetchStart. Close waits for it.
func (t *Tier) PrefetchWait() error {
	return t.use(func(p *C.pkv_tier) error {
		return check(C.pkv_tier_prefetch_wait(p), "pkv_tier_prefetch_wait: PrefetchStart not called")
	})
}

// Flush waits until the writes queued by TierSaveAsync before the call are in the store, not
// those other goroutines queue after it (pkv_tier_flush).
// ErrIO when a put failed since the last flush (counted in the stats' Errors; that block is not
// stored); ErrInvalid before PrefetchStart.
func (t *Tier) Flush() error {
	return t.use(func(p *C.pkv_tier) error {
		rc := C.pkv_tier_flush(p)
		op := "pkv_tier_flush"
		switch rc {
		case EINVAL:
			op += ": PrefetchStart not called"
		case EIO:
			op += ": a queued put failed"
		}
		return check(rc, op)
	})
}

// TierSave stores the full committed blocks of s that t lacks (pkv_tier_save); returns how many
// it stored. A store refusing an entry for want of room is not an error; one failing otherwise
// (Redis unreachable: ErrIO) fails the call, and the entries it stored are deleted again. It
// reads s as Gather does.
func (c *Cache) TierSave(t *Tier, s Seq) (uint32, error) {
	var n C.uint32_t
	err := t.use(func(tp *C.pkv_tier) error {
		return c.op("pkv_tier_save", readKV, func(p *C.pkv_cache) C.int { return C.pkv_tier_save(tp, p, C.pkv_seq(s), &n) }, s)
	})
	return uint32(n), err
}

// TierSaveAsync is TierSave with the store's puts left to t's thread (PrefetchStart first, else
// ErrInvalid) (pkv_tier_save_async): the entries of the full committed blocks are made now, into
// host memory within the tier's staging bytes, and queued, all of them or, on a failure, none;
// it returns how many. s may be released as soon as it returns. Where staging has no room for
// them, it saves now, as TierSave, and returns 0. The thread puts them before any queued
// prefetch, skipping those the store has, and counts them in Stats; Flush waits for them, and
// Close puts them first. It reads s as Gather does.
func (c *Cache) TierSaveAsync(t *Tier, s Seq) (uint32, error) {
	var n C.uint32_t
	err := t.use(func(tp *C.pkv_tier) error {
		return c.op("pkv_tier_save_async", readKV, func(p *C.pkv_cache) C.int {
			return C.pkv_tier_save_async(tp, p, C.pkv_seq(s), &n)
		}, s)
	})
	return uint32(n), err
}

// TierLoad, for a sequence whose positions are all committed and are the prompt's first tokens
// (as MatchPrefix leaves it, or empty), appends, writes and commits the prompt's next blocks
// from t, up to the first it lacks, never the prompt's last token (pkv_tier_load); returns the
// positions added. A miss, a refused entry or a full pool ends the load. It changes s as
// MatchPrefix does, and moves rows as Truncate does (a refused entry's positions are cut).
func (c *Cache) TierLoad(t *Tier, s Seq, tokens []int32) (uint32, error) {
	return c.tierLoad(t, s, tokens, false, 0)
}

// TierLoadWindow is TierLoad for layers that attend through a sliding window of window
// positions (chunks of local attention: pass AttnChunk), the tier's side of MatchPrefixWindow
// (pkv_tier_load_window). Into an empty sequence it loads only what the window of the longest
// prefix the tier can restore reads, and drops the front before it (SeqInfo.NDropped); the
// positions returned count the front's. Into a sequence that holds positions it is TierLoad.
// ErrInvalid for window 0.
func (c *Cache) TierLoadWindow(t *Tier, s Seq, tokens []int32, window uint32) (uint32, error) {
	return c.tierLoad(t, s, tokens, true, window)
}

func (c *Cache) tierLoad(t *Tier, s Seq, tokens []int32, windowed bool, window uint32) (uint32, error) {
	op := "pkv_tier_load"
	if windowed {
		op = "pkv_tier_load_window"
	}
	n, err := u32(len(tokens), op+": tokens")
	if err != nil {
		return 0, err
	}
	var r C.uint32_t
	err = t.use(func(tp *C.pkv_tier) error {
		return c.op(op, access{write: true, kv: useShared, rows: useAlone}, func(p *C.pkv_cache) C.int {
			if windowed {
				return C.pkv_tier_load_window(tp, p, C.pkv_seq(s), i32p(tokens), n, C.uint32_t(window), &r)
			}
			return C.pkv_tier_load(tp, p, C.pkv_seq(s), i32p(tokens), n, &r)
		}, s)
	})
	return uint32(r), err
}
