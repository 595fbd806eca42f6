// The Go bindings against libpkv and a float64 reference computed here: decode and ragged
// prefill against contiguous attention, soft-cap, window and the LSE merge, attention sinks
// against that merge, prefix reuse, fork and copy-on-write, the exports, statuses as errors, the
// binding's own length checks, goroutines sharing a cache, nil and closed caches, the finalizer,
// the Into forms, K/V writes of one layer beside decodes of another, the prefix-index events
// against the hashes PrefixHashes computes, tree attention against the reference over each
// node's keys, with Keep of an accepted path, and a cache whose V lives in K (MLA, VDim): its
// attention against the reference over K's rows, its outputs' sizes and its refusals of V. Run by
// ctest (test_go) with CGO_LDFLAGS naming the build.
package pagedkv

import (
	"errors"
	"fmt"
	"math"
	"os"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

type rng uint64

func (r *rng) next() float32 { // xorshift64*, values in [-2, 2)
	*r ^= *r >> 12
	*r ^= *r << 25
	*r ^= *r >> 27
	x := (uint64(*r) * 0x2545F4914F6CDD1D) >> 40
	return float32(x)/float32(1<<24)*4 - 2
}

func (r *rng) vec(n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = r.next()
	}
	return v
}

// reference: one query's attention over K, V [T][h][d] seeing positions [T-window, T) (0: all);
// q [hq][d], query head i reads kv head i / (hq / h). Returns out [hq][d] and lse [hq].
func reference(q, k, v []float32, hq, h, d int, scale, capv float64, window int) ([]float64, []float64) {
	t := len(k) / (h * d)
	lo := 0
	if window > 0 && t > window {
		lo = t - window
	}
	out, lse := make([]float64, hq*d), make([]float64, hq)
	for qh := 0; qh < hq; qh++ {
		kh := qh / (hq / h)
		s := make([]float64, t-lo)
		m := math.Inf(-1)
		for p := lo; p < t; p++ {
			x := 0.0
			for i := 0; i < d; i++ {
				x += float64(q[qh*d+i]) * float64(k[(p*h+kh)*d+i])
			}
			x *= scale
			if capv > 0 {
				x = capv * math.Tanh(x/capv)
			}
			s[p-lo] = x
			m = math.Max(m, x)
		}
		sum := 0.0
		for j := range s {
			s[j] = math.Exp(s[j] - m)
			sum += s[j]
		}
		for p := lo; p < t; p++ {
			for i := 0; i < d; i++ {
				out[qh*d+i] += s[p-lo] * float64(v[(p*h+kh)*d+i]) / sum
			}
		}
		lse[qh] = m + math.Log(sum)
	}
	return out, lse
}

// toF64 widens x, for assertClose against values the library computed.
func toF64(x []float32) []float64 {
	y := make([]float64, len(x))
	for i := range x {
		y[i] = float64(x[i])
	}
	return y
}

func assertClose(t *testing.T, got []float32, want []float64, rel float64, what string) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, %d wanted", what, len(got), len(want))
	}
	scale, maxErr := 1.0, 0.0
	for i := range want {
		scale = math.Max(scale, math.Abs(want[i]))
		maxErr = math.Max(maxErr, math.Abs(float64(got[i])-want[i]))
	}
	if !(maxErr <= rel*scale) { // so that NaN (which math.Max carries) fails
		t.Fatalf("%s: max abs error %g over %g", what, maxErr, rel*scale)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func code(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

func newCache(t *testing.T, h, d, nBlocks uint32, dt Dtype) *Cache {
	t.Helper()
	c := newCacheUnclosed(t, h, d, nBlocks, dt)
	t.Cleanup(c.Close)
	return c
}

// newCacheUnclosed is newCache for the lock tests, which close it themselves: where a call is
// stuck on a lock, a cleanup's Close would wait for it and the test would hang instead of failing.
func newCacheUnclosed(t *testing.T, h, d, nBlocks uint32, dt Dtype) *Cache {
	t.Helper()
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.KDtype, cfg.VDtype, cfg.NThreads = h, d, nBlocks, dt, dt, 2
	c, err := NewCache(cfg)
	must(t, err)
	return c
}

// fill appends n tokens to s, writes random f32 K/V for layer 0 and commits.
func fill(t *testing.T, c *Cache, s Seq, n int, r *rng) {
	t.Helper()
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = int32((i*7 + 100) % 500)
	}
	slots, err := c.Append(s, toks)
	must(t, err)
	cfg := c.Config()
	l := n * int(cfg.NKVHeads*cfg.HeadDim)
	must(t, c.WriteKV(0, slots, r.vec(l), r.vec(l)))
	info, err := c.SeqInfo(s)
	must(t, err)
	must(t, c.Commit(s, info.NTokens))
}

func TestLayout(t *testing.T) {
	size, offs := attnReqLayout()
	var r AttnReq
	goOffs := [3]uintptr{unsafe.Offsetof(r.Seq), unsafe.Offsetof(r.QStart), unsafe.Offsetof(r.NQ)}
	if unsafe.Sizeof(r) != size || goOffs != offs {
		t.Fatalf("AttnReq: size %d offsets %v, pkv_attn_req: size %d offsets %v", unsafe.Sizeof(r), goOffs, size, offs)
	}
	if unsafe.Sizeof(Seq(0)) != 8 {
		t.Fatal("Seq is not 64-bit")
	}
}

func TestBasics(t *testing.T) {
	hdr, err := os.ReadFile("../../include/pkv.h")
	must(t, err)
	if !strings.Contains(string(hdr), fmt.Sprintf("#define PKV_VERSION_STRING \"%s\"", Version())) {
		t.Fatalf("version %q is not pkv.h's", Version())
	}
	d := DefaultConfig()
	if d.NLayers != 1 || d.NKVHeads != 8 || d.HeadDim != 128 || d.BlockTokens != 16 || d.NBlocks != 1024 ||
		d.KDtype != F16 || d.MaxSeqs != 256 || !d.PrefixCache || d.SpinUS != 50 {
		t.Fatalf("defaults %+v", d)
	}
	if dt, err := DtypeFromName("fp8"); err != nil || dt != FP8E4M3 {
		t.Fatal("fp8 alias", dt, err)
	}
	if _, err := DtypeFromName("f64"); code(err) != EINVAL {
		t.Fatal("f64:", err)
	}
	if Q8_0.Name() != "q8_0" || Q8_0.RowBytes(128) != 4*34 {
		t.Fatal("q8_0 name or row bytes")
	}
	want := Config{NLayers: 3, NKVHeads: 2, HeadDim: 64, BlockTokens: 8, NBlocks: 40, KDtype: BF16, VDtype: Q8_0,
		MaxSeqs: 7, MaxBlocksPerSeq: 9, NThreads: 2, EventCapacity: 5, SpinUS: 700}
	c, err := NewCache(want)
	must(t, err)
	defer c.Close()
	if c.Config() != want {
		t.Fatalf("config %+v, want %+v", c.Config(), want)
	}
	if c.Backend() == "" {
		t.Fatal("no backend")
	}
	bad := DefaultConfig()
	bad.HeadDim = 0
	if _, err := NewCache(bad); code(err) != EINVAL || !strings.HasPrefix(err.Error(), "pkv_cache_create: ") {
		t.Fatal("head_dim 0:", err)
	} else if !strings.Contains(err.Error(), "head_dim 0 not in 1..1024") { // what libpkv's log said
		t.Fatal("head_dim 0 not named:", err)
	}
	c.Close()
	if _, err := c.SeqCreate(nil); code(err) != EINVAL {
		t.Fatal("closed:", err)
	}
	c.Close() // twice: a no-op
}

// BF16Dot: where the cache takes it (BF16DotUsed), the output is the reference's over the queries
// times scale rounded to bf16, within 2^-7 of max |V| (pkv.h: 2^-8); elsewhere the same bits.
func TestBF16Dot(t *testing.T) {
	r := rng(0xbf16)
	const h, d, hq = 2, 64, 8
	c := newCache(t, h, d, 64, BF16)
	defer c.Close()
	seqs := make([]Seq, 3)
	for i := range seqs {
		s, err := c.SeqCreate(nil)
		must(t, err)
		seqs[i] = s
	}
	for k := 0; k < 12; k++ {
		for _, s := range seqs {
			fill(t, c, s, 16, &r)
		}
	}
	q := r.vec(len(seqs) * hq * d)
	plain, out := make([]float32, len(q)), make([]float32, len(q))
	must(t, c.Decode(0, seqs, q, plain, AttnParams{NQHeads: hq}, nil))
	must(t, c.Decode(0, seqs, q, out, AttnParams{NQHeads: hq, BF16Dot: true}, nil))
	used := c.BF16DotUsed()
	differs := false
	for i := range out {
		differs = differs || out[i] != plain[i]
	}
	if differs != used {
		t.Fatalf("results differ %v, BF16DotUsed %v", differs, used)
	}
	scale := float32(1 / math.Sqrt(d))
	qr := make([]float32, len(q))
	for i, x := range q {
		qr[i] = x * scale
		if used {
			u := math.Float32bits(qr[i])
			qr[i] = math.Float32frombits((u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000)
		}
	}
	for i, s := range seqs {
		k, v, err := c.Gather(s, 0, 0, 192)
		must(t, err)
		w, _ := reference(qr[i*hq*d:(i+1)*hq*d], k, v, hq, h, d, 1, 0, 0)
		vmax, e := 0.0, 0.0
		for _, x := range v {
			vmax = math.Max(vmax, math.Abs(float64(x)))
		}
		for j, g := range out[i*hq*d : (i+1)*hq*d] {
			e = math.Max(e, math.Abs(float64(g)-w[j]))
		}
		tol := 1e-5 * math.Max(vmax, 1)
		if used {
			tol = vmax / 128
		}
		if !(e <= tol) { // NaN fails
			t.Fatalf("BF16Dot decode %d: error %g over %g", i, e, tol)
		}
	}
	c16 := newCache(t, h, d, 8, F16)
	defer c16.Close()
	if c16.BF16DotUsed() {
		t.Fatal("an f16 cache takes BF16Dot")
	}
}

// F16AsBF16: where the cache takes it (F16AsBF16Used: backend avx512-amx), a prefill of 40
// positions (160 query rows a kv head: the tiles) is the reference's over K and the queries times
// scale rounded to bf16, within 2^-7 of max |V|, and differs from the call without it; a decode
// (8 rows a kv head) gives the same bits.
func TestF16AsBF16(t *testing.T) {
	r := rng(0xf16b)
	const h, d, hq = 2, 64, 8
	c := newCache(t, h, d, 64, F16)
	defer c.Close()
	s, err := c.SeqCreate(nil)
	must(t, err)
	for k := 0; k < 13; k++ {
		fill(t, c, s, 16, &r)
	}
	used := c.F16AsBF16Used()
	if used != (c.Backend() == "avx512-amx") {
		t.Fatalf("F16AsBF16Used %v on backend %s", used, c.Backend())
	}
	same := func(a, b []float32) bool {
		for i := range a {
			if a[i] != b[i] {
				return false
			}
		}
		return true
	}
	q := r.vec(hq * d)
	plain, out := make([]float32, len(q)), make([]float32, len(q))
	must(t, c.Decode(0, []Seq{s}, q, plain, AttnParams{NQHeads: hq}, nil))
	must(t, c.Decode(0, []Seq{s}, q, out, AttnParams{NQHeads: hq, F16AsBF16: true}, nil))
	if !same(plain, out) {
		t.Fatal("F16AsBF16 changed a decode")
	}
	const start, n = 160, 40
	reqs := []AttnReq{{Seq: s, QStart: start, NQ: n}}
	qp := r.vec(n * hq * d)
	plain, out = make([]float32, len(qp)), make([]float32, len(qp))
	must(t, c.Prefill(0, reqs, qp, plain, AttnParams{NQHeads: hq}, nil))
	must(t, c.Prefill(0, reqs, qp, out, AttnParams{NQHeads: hq, F16AsBF16: true}, nil))
	if same(plain, out) == used {
		t.Fatalf("prefill: results the same %v, F16AsBF16Used %v", !used, used)
	}
	round := func(x float32) float32 {
		if !used {
			return x
		}
		u := math.Float32bits(x)
		return math.Float32frombits((u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000)
	}
	scale := float32(1 / math.Sqrt(d))
	qr := make([]float32, len(qp))
	for i, x := range qp {
		qr[i] = round(x * scale)
	}
	for j := 0; j < n; j++ {
		k, v, err := c.Gather(s, 0, 0, uint32(start+j+1))
		must(t, err)
		for i := range k {
			k[i] = round(k[i])
		}
		w, _ := reference(qr[j*hq*d:(j+1)*hq*d], k, v, hq, h, d, 1, 0, 0)
		vmax, e := 0.0, 0.0
		for _, x := range v {
			vmax = math.Max(vmax, math.Abs(float64(x)))
		}
		for i, g := range out[j*hq*d : (j+1)*hq*d] {
			e = math.Max(e, math.Abs(float64(g)-w[i]))
		}
		tol := 1e-5 * math.Max(vmax, 1)
		if used {
			tol = vmax / 128
		}
		if !(e <= tol) { // NaN fails
			t.Fatalf("F16AsBF16 prefill %d: error %g over %g", j, e, tol)
		}
	}
}

func TestDecodeAndPrefill(t *testing.T) {
	r := rng(0x9e3779b97f4a7c15)
	const h, d, hq = 2, 64, 8
	for _, dt := range []Dtype{F32, F16, BF16} {
		c := newCache(t, h, d, 64, dt)
		lens := []int{1, 15, 16, 17, 100, 257}
		seqs := make([]Seq, len(lens))
		for i := range seqs {
			s, err := c.SeqCreate(nil)
			must(t, err)
			seqs[i] = s
		}
		for start := 0; start < 257; start += 16 { // in turns: the tables interleave
			for i, n := range lens {
				if start < n {
					fill(t, c, seqs[i], min(16, n-start), &r)
				}
			}
		}
		q := r.vec(len(seqs) * hq * d)
		out, lse := make([]float32, len(q)), make([]float32, len(seqs)*hq)
		p := AttnParams{NQHeads: hq}
		must(t, c.Decode(0, seqs, q, out, p, lse))
		for i, s := range seqs {
			k, v, err := c.Gather(s, 0, 0, uint32(lens[i]))
			must(t, err)
			w, wl := reference(q[i*hq*d:(i+1)*hq*d], k, v, hq, h, d, 1/math.Sqrt(d), 0, 0)
			assertClose(t, out[i*hq*d:(i+1)*hq*d], w, 1e-5, fmt.Sprintf("%s decode, %d tokens", dt.Name(), lens[i]))
			assertClose(t, lse[i*hq:(i+1)*hq], wl, 1e-5, "decode lse")
		}
		reqs := []AttnReq{{seqs[5], 237, 20}, {seqs[4], 97, 3}, {seqs[2], 15, 1}}
		qp := r.vec(24 * hq * d)
		op := make([]float32, len(qp))
		must(t, c.Prefill(0, reqs, qp, op, p, nil))
		row := 0
		for _, rq := range reqs {
			for j := uint32(0); j < rq.NQ; j++ {
				pos := rq.QStart + j
				k, v, err := c.Gather(rq.Seq, 0, 0, pos+1)
				must(t, err)
				w, _ := reference(qp[row*hq*d:(row+1)*hq*d], k, v, hq, h, d, 1/math.Sqrt(d), 0, 0)
				assertClose(t, op[row*hq*d:(row+1)*hq*d], w, 1e-5, fmt.Sprintf("%s prefill, position %d", dt.Name(), pos))
				row++
			}
		}
	}
}

// mlaReference is the reference of one query on a cache whose V lives in K (MLA): reference over
// K as both K and V (one kv head), each query head's first dv values. out [hq][dv], lse [hq].
func mlaReference(q, k []float32, hq, d, dv int, scale float64) ([]float64, []float64) {
	w, lse := reference(q, k, k, hq, 1, d, scale, 0, 0)
	out := make([]float64, 0, hq*dv)
	for h := 0; h < hq; h++ {
		out = append(out, w[h*d:h*d+dv]...)
	}
	return out, lse
}

// TestMLA: a cache whose V lives in K (MLA: one kv head of 96, VDim 64), f32 and q8_0: K written
// alone; Decode, Prefill and a chain of Tree attention against the reference over the gathered K
// (V = its first 64 values), q HeadDim wide and out VDim wide (the only out length taken); the
// config; V writes and reads refused, K's stored rows moved alone.
func TestMLA(t *testing.T) {
	r := rng(0x3d1a)
	const d, dv, hq = 96, 64, 8
	// q8_0 K scores int8 queries (pkv.h): a coarser tolerance
	for _, tc := range []struct {
		dt  Dtype
		tol float64
	}{{F32, 1e-5}, {Q8_0, 2e-2}} {
		dt, tol := tc.dt, tc.tol
		cfg := DefaultConfig()
		cfg.NKVHeads, cfg.HeadDim, cfg.VDim, cfg.NBlocks, cfg.KDtype, cfg.VDtype, cfg.NThreads = 1, d, dv, 64, dt, dt, 2
		c, err := NewCache(cfg)
		must(t, err)
		defer c.Close()
		if got := c.Config(); got.VDim != dv || got.HeadDim != d {
			t.Fatalf("config %+v", got)
		}
		lens := []int{1, 17, 100}
		seqs := make([]Seq, len(lens))
		for i, n := range lens {
			s, err := c.SeqCreate(nil)
			must(t, err)
			toks := make([]int32, n)
			for j := range toks {
				toks[j] = int32(3*j + i)
			}
			slots, err := c.Append(s, toks)
			must(t, err)
			k := r.vec(n * d)
			if i == 0 {
				must(t, c.WriteKVSeq(s, 0, 0, k, nil))
			} else {
				must(t, c.WriteKV(0, slots, k, nil))
			}
			must(t, c.Commit(s, uint32(n)))
			seqs[i] = s
		}
		p := AttnParams{NQHeads: hq}
		q := r.vec(len(seqs) * hq * d)
		out, lse := make([]float32, len(seqs)*hq*dv), make([]float32, len(seqs)*hq)
		must(t, c.Decode(0, seqs, q, out, p, lse))
		for i, s := range seqs {
			k, v, err := c.Gather(s, 0, 0, uint32(lens[i]))
			must(t, err)
			if v != nil {
				t.Fatalf("Gather gave %d V values where V lives in K", len(v))
			}
			w, wl := mlaReference(q[i*hq*d:(i+1)*hq*d], k, hq, d, dv, 1/math.Sqrt(d))
			what := fmt.Sprintf("%s MLA decode, %d tokens", dt.Name(), lens[i])
			assertClose(t, out[i*hq*dv:(i+1)*hq*dv], w, tol, what)
			assertClose(t, lse[i*hq:(i+1)*hq], wl, tol, what+" lse")
		}
		// Prefill with a scale of the model's (not 1/sqrt(head_dim)), and a chain of tree nodes
		ps := AttnParams{NQHeads: hq, Scale: float32(1 / math.Sqrt(48))}
		reqs := []AttnReq{{seqs[2], 90, 10}, {seqs[1], 0, 17}}
		qp := r.vec(27 * hq * d)
		op := make([]float32, 27*hq*dv)
		must(t, c.Prefill(0, reqs, qp, op, ps, nil))
		chain := make([]int32, 12)
		for i := range chain {
			chain[i] = int32(i - 1)
		}
		tr := []TreeReq{{seqs[2], 88, chain}}
		qt := r.vec(12 * hq * d)
		ot := make([]float32, 12*hq*dv)
		must(t, c.Tree(0, tr, qt, ot, ps, nil))
		type row struct {
			call   string
			q, out []float32
			s      Seq
			pos    uint32
		}
		var rows []row
		for _, rq := range reqs {
			for j := uint32(0); j < rq.NQ; j++ {
				i := len(rows)
				rows = append(rows, row{"prefill", qp[i*hq*d : (i+1)*hq*d], op[i*hq*dv : (i+1)*hq*dv], rq.Seq, rq.QStart + j})
			}
		}
		for j := 0; j < 12; j++ {
			rows = append(rows, row{"tree", qt[j*hq*d : (j+1)*hq*d], ot[j*hq*dv : (j+1)*hq*dv], seqs[2], 88 + uint32(j)})
		}
		for _, x := range rows {
			k, _, err := c.Gather(x.s, 0, 0, x.pos+1)
			must(t, err)
			w, _ := mlaReference(x.q, k, hq, d, dv, float64(ps.Scale))
			assertClose(t, x.out, w, tol, fmt.Sprintf("%s MLA %s, position %d", dt.Name(), x.call, x.pos))
		}
		// outputs VDim wide, queries HeadDim wide: a HeadDim-wide out is refused, as is a q of VDim
		for i, err := range []error{
			c.Decode(0, seqs, q, make([]float32, len(seqs)*hq*d), p, nil),
			c.Decode(0, seqs, q[:len(seqs)*hq*dv], out, p, nil),
			c.Prefill(0, reqs, qp, make([]float32, 27*hq*d), ps, nil),
			c.Tree(0, tr, qt, make([]float32, 12*hq*d), ps, nil),
		} {
			if code(err) != EINVAL {
				t.Fatalf("%s size case %d: %v", dt.Name(), i, err)
			}
		}
		// V written or read: refused, nothing written
		s := seqs[1]
		before, _, err := c.Gather(s, 0, 0, 17)
		must(t, err)
		slots, err := c.Slots(s, 0, 17)
		must(t, err)
		k := r.vec(17 * d)
		ks, vs, err := c.ReadStored(s, 0, 0, 17)
		must(t, err)
		if len(ks) != 17*dt.RowBytes(d) || vs != nil {
			t.Fatalf("%s ReadStored: %d and %d bytes", dt.Name(), len(ks), len(vs))
		}
		s2, err := c.SeqCreate([]byte("x"))
		must(t, err)
		_, err = c.Append(s2, make([]int32, 17))
		must(t, err)
		kbuf := make([]float32, 17*d)
		for i, err := range []error{
			c.WriteKV(0, slots, k, k),
			c.WriteKV(0, slots, nil, k),
			c.WriteKVShared(0, slots, k, k),
			c.WriteKVSeq(s2, 0, 0, k, k),
			c.GatherInto(s, 0, 0, kbuf, make([]float32, 17*d)),
			c.ReadStoredInto(s, 0, 0, nil, make([]byte, len(ks))),
			c.WriteStored(s2, 0, 0, ks, ks),
		} {
			if code(err) != EINVAL || !strings.Contains(err.Error(), "V lives in K") {
				t.Fatalf("%s V case %d: %v", dt.Name(), i, err)
			}
		}
		after, _, err := c.Gather(s, 0, 0, 17)
		must(t, err)
		if !reflect.DeepEqual(after, before) {
			t.Fatalf("%s: a refused V write changed K", dt.Name())
		}
		// K alone: gathered into a buffer, and its stored rows moved bit for bit
		must(t, c.GatherInto(s, 0, 0, kbuf, nil))
		if !reflect.DeepEqual(kbuf, before) {
			t.Fatalf("%s: GatherInto of K differs", dt.Name())
		}
		must(t, c.WriteStored(s2, 0, 0, ks, nil))
		ks2, vs2, err := c.ReadStored(s2, 0, 0, 17)
		must(t, err)
		if !reflect.DeepEqual(ks2, ks) || vs2 != nil {
			t.Fatalf("%s: stored K rows differ after the move", dt.Name())
		}
		must(t, c.Check())
	}
	// VDim past HeadDim, and a VDtype other than KDtype: refused
	for i, vd := range [][2]uint32{{97, uint32(F32)}, {64, uint32(F16)}} {
		cfg := DefaultConfig()
		cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.KDtype = 1, d, 64, F32
		cfg.VDim, cfg.VDtype = vd[0], Dtype(vd[1])
		if _, err := NewCache(cfg); code(err) != EINVAL {
			t.Fatalf("bad config %d: %v", i, err)
		}
	}
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}

// TestDropFront: under a window of 24 the first 16 positions' block goes, decode over the rest
// matches the reference, a read of the front and a decode without the window are EINVAL. In a
// cache that indexes prefixes the dropped blocks stay indexed (CACHED): the same prompt is matched
// whole and reads them back.
// A dropped front's evicted block leaves a tombstone: MatchPrefix stops there, MatchPrefixWindow
// goes past it and takes only the blocks its window sees.
func TestMatchPrefixWindowTombstone(t *testing.T) {
	r := rng(12)
	c := newCache(t, 2, 32, 8, F32)
	put := func(s Seq, toks []int32) {
		slots, err := c.Append(s, toks)
		must(t, err)
		l := len(toks) * 2 * 32
		must(t, c.WriteKV(0, slots, r.vec(l), r.vec(l)))
		info, err := c.SeqInfo(s)
		must(t, err)
		must(t, c.Commit(s, info.NTokens))
	}
	toks, other := make([]int32, 64), make([]int32, 80)
	for i := range toks {
		toks[i] = int32((i*7 + 3) % 500)
	}
	for i := range other {
		other[i] = int32((i*11 + 5) % 500)
	}
	s, err := c.SeqCreate(nil)
	must(t, err)
	put(s, toks) // blocks 0-3
	k, v, err := c.Gather(s, 0, 0, 64)
	must(t, err)
	f, err := c.Fork(s)
	must(t, err)
	must(t, c.Truncate(f, 32))
	must(t, c.DropFront(f, 16)) // f keeps block 1
	must(t, c.DropFront(s, 16)) // block 0: nobody's, block 1 in use below it
	w, err := c.SeqCreate(nil)
	must(t, err)
	put(w, other[:64]) // the 4 free blocks
	put(w, other[64:]) // block 0 evicted: a tombstone in its place
	st, err := c.Stats()
	must(t, err)
	if st.Evictions != 1 || st.NTombstones != 1 || st.NIndexed != 8 {
		t.Fatalf("evictions %d, tombstones %d, indexed %d; want 1, 1, 8", st.Evictions, st.NTombstones, st.NIndexed)
	}
	must(t, c.Check())
	u, err := c.SeqCreate(nil)
	must(t, err)
	if n, err := c.MatchPrefix(u, toks); err != nil || n != 0 {
		t.Fatalf("MatchPrefix through a tombstone: %d, %v", n, err)
	}
	if n, err := c.MatchPrefixWindow(u, toks, 20); err != nil || n != 63 { // a query at 63 sees from 44
		t.Fatalf("MatchPrefixWindow: %d, %v", n, err)
	}
	info, err := c.SeqInfo(u)
	must(t, err)
	st, err = c.Stats()
	must(t, err)
	if info.NDropped != 32 || st.PrefixTombHits != 1 {
		t.Fatalf("front %d, tomb hits %d; want 32, 1", info.NDropped, st.PrefixTombHits)
	}
	ku, vu, err := c.Gather(u, 0, 32, 31)
	must(t, err)
	const row = 2 * 32
	if !sameBits(ku, k[32*row:63*row]) || !sameBits(vu, v[32*row:63*row]) {
		t.Fatal("K/V of the windowed match differs")
	}
	must(t, c.Check())
	x, err := c.SeqCreate(nil)
	must(t, err)
	if _, err := c.MatchPrefixWindow(x, toks, 0); code(err) != EINVAL {
		t.Fatalf("window 0: %v", err)
	}
}

// A dropped front is saved from the front on (the ids before it from the index), and
// TierLoadWindow restores into an empty cache only what a window of 20 reads.
func TestTierLoadWindow(t *testing.T) {
	r := rng(13)
	a := newCache(t, 2, 32, 8, F32)
	b := newCache(t, 2, 32, 8, F32)
	tier, err := NewHostTier(1 << 24)
	must(t, err)
	defer tier.Close()
	toks := make([]int32, 65)
	for i := range toks {
		toks[i] = int32((i*7 + 3) % 500)
	}
	s, err := a.SeqCreate(nil)
	must(t, err)
	slots, err := a.Append(s, toks[:64])
	must(t, err)
	k, v := r.vec(64*2*32), r.vec(64*2*32)
	must(t, a.WriteKV(0, slots, k, v))
	must(t, a.Commit(s, 64))
	must(t, a.DropFront(s, 45)) // a query at 64 sees from 45: blocks 0-1 go
	if n, err := a.TierSave(tier, s); err != nil || n != 2 {
		t.Fatalf("TierSave: %d, %v", n, err)
	}
	must(t, tier.PrefetchStart(1<<22)) // the window's blocks staged ahead of the load
	if err := tier.PrefetchWindow(b, nil, toks, 0); code(err) != EINVAL {
		t.Fatalf("PrefetchWindow, window 0: %v", err)
	}
	must(t, tier.PrefetchWindow(b, nil, toks, 20))
	must(t, tier.PrefetchWait())
	u, err := b.SeqCreate(nil)
	must(t, err)
	if n, err := b.TierLoadWindow(tier, u, toks, 20); err != nil || n != 64 {
		t.Fatalf("TierLoadWindow: %d, %v", n, err)
	}
	if ts, err := tier.Stats(); err != nil || ts.Prefetched != 2 || ts.PrefetchHits != 2 {
		t.Fatalf("prefetched %d, prefetch hits %d (%v); want 2, 2", ts.Prefetched, ts.PrefetchHits, err)
	}
	info, err := b.SeqInfo(u)
	must(t, err)
	st, err := b.Stats()
	must(t, err)
	if info.NDropped != 32 || st.NTombstones != 2 || st.NIndexed != 2 {
		t.Fatalf("front %d, tombstones %d, indexed %d; want 32, 2, 2", info.NDropped, st.NTombstones, st.NIndexed)
	}
	kb, vb, err := b.Gather(u, 0, 32, 32)
	must(t, err)
	const row = 2 * 32
	if !sameBits(kb, k[32*row:64*row]) || !sameBits(vb, v[32*row:64*row]) {
		t.Fatal("K/V of the windowed load differs")
	}
	ts, err := tier.Stats()
	must(t, err)
	if ts.LoadedTokens != 32 {
		t.Fatalf("loaded tokens %d; want 32", ts.LoadedTokens)
	}
	must(t, b.Check())
	x, err := b.SeqCreate(nil)
	must(t, err)
	if n, err := b.MatchPrefixWindow(x, toks, 20); err != nil || n != 64 { // b's pool has it now
		t.Fatalf("MatchPrefixWindow: %d, %v", n, err)
	}
	y, err := b.SeqCreate(nil)
	must(t, err)
	if _, err := b.TierLoadWindow(tier, y, toks, 0); code(err) != EINVAL {
		t.Fatalf("window 0: %v", err)
	}
}

func TestDropFront(t *testing.T) {
	r := rng(11)
	const h, d, hq = 2, 64, 4
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.KDtype, cfg.VDtype, cfg.NThreads = h, d, 32, F32, F32, 2
	cfg.PrefixCache = false
	c, err := NewCache(cfg)
	must(t, err)
	t.Cleanup(c.Close)
	s, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, s, 40, &r)
	k, v, err := c.Gather(s, 0, 0, 40)
	must(t, err)
	st0, err := c.Stats()
	must(t, err)
	must(t, c.DropFront(s, 40-24))
	info, err := c.SeqInfo(s)
	must(t, err)
	st1, err := c.Stats()
	must(t, err)
	tab, err := c.BlockTable(s)
	must(t, err)
	if info.NDropped != 16 || st1.NActive != st0.NActive-1 || tab[0] != -1 {
		t.Fatalf("after DropFront: n_dropped %d, active %d -> %d, table %v", info.NDropped, st0.NActive, st1.NActive, tab)
	}
	q := r.vec(hq * d)
	out := make([]float32, hq*d)
	must(t, c.Decode(0, []Seq{s}, q, out, AttnParams{NQHeads: hq, Window: 24}, nil))
	w, _ := reference(q, k, v, hq, h, d, 1/math.Sqrt(d), 0, 24)
	assertClose(t, out, w, 1e-5, "decode over a dropped front")
	if err := c.Decode(0, []Seq{s}, q, out, AttnParams{NQHeads: hq}, nil); code(err) != EINVAL {
		t.Fatalf("decode that sees the dropped front: %v", err)
	}
	if _, _, err := c.Gather(s, 0, 15, 1); code(err) != EINVAL {
		t.Fatalf("gather of a dropped position: %v", err)
	}
	cp := newCache(t, h, d, 32, F32)
	sp, err := cp.SeqCreate(nil)
	must(t, err)
	fill(t, cp, sp, 40, &r)
	kp, vp, err := cp.Gather(sp, 0, 0, 40)
	must(t, err)
	must(t, cp.DropFront(sp, 32)) // blocks 0 and 1, indexed, held by sp alone
	st, err := cp.Stats()
	must(t, err)
	if st.NCached != 2 || st.NIndexed != 2 {
		t.Fatalf("after DropFront with prefix caching: %d cached, %d indexed", st.NCached, st.NIndexed)
	}
	toks := make([]int32, 40)
	for i := range toks {
		toks[i] = int32((i*7 + 100) % 500) // fill's
	}
	tp, err := cp.SeqCreate(nil)
	must(t, err)
	n, err := cp.MatchPrefix(tp, toks)
	must(t, err)
	if n != 39 { // 2 blocks, then 7 of sp's tail copied
		t.Fatalf("match over the dropped blocks reused %d", n)
	}
	kt, vt, err := cp.Gather(tp, 0, 0, 39)
	must(t, err)
	for i := range kt {
		if kt[i] != kp[i] || vt[i] != vp[i] {
			t.Fatalf("K/V matched over the dropped blocks differ at %d", i)
		}
	}
}

// fortyTokens: an f32 cache of 2 kv heads of 64, one sequence of 40 random tokens in it, and
// their K and V as gathered.
func fortyTokens(t *testing.T, r *rng) (*Cache, Seq, []float32, []float32) {
	c := newCache(t, 2, 64, 32, F32)
	s, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, s, 40, r)
	k, v, err := c.Gather(s, 0, 0, 40)
	must(t, err)
	return c, s, k, v
}

func TestSoftcapWindowMerge(t *testing.T) {
	r := rng(7)
	const h, d, hq = 2, 64, 4
	c, s, k, v := fortyTokens(t, &r)
	q := r.vec(hq * d)
	for i := range q {
		q[i] *= 3
	}
	for _, cw := range []struct {
		capv float32
		win  uint32
	}{{5, 0}, {0, 7}, {5, 7}} {
		out, lse := make([]float32, hq*d), make([]float32, hq)
		must(t, c.Decode(0, []Seq{s}, q, out, AttnParams{NQHeads: hq, Scale: 0.2, Softcap: cw.capv, Window: cw.win}, lse))
		w, wl := reference(q, k, v, hq, h, d, 0.2, float64(cw.capv), int(cw.win))
		assertClose(t, out, w, 1e-5, fmt.Sprintf("softcap %g window %d", cw.capv, cw.win))
		assertClose(t, lse, wl, 1e-5, "lse")
	}
	// chunks of 16 (Llama 4's local attention): the query at 39 sees [32, 39], as a window of 8
	oc, lc := make([]float32, hq*d), make([]float32, hq)
	must(t, c.Decode(0, []Seq{s}, q, oc, AttnParams{NQHeads: hq, Scale: 0.2, AttnChunk: 16}, lc))
	wc, wlc := reference(q, k, v, hq, h, d, 0.2, 0, 8)
	assertClose(t, oc, wc, 1e-5, "chunks of 16")
	assertClose(t, lc, wlc, 1e-5, "chunks of 16: lse")
	// non-causal: 3 queries of one request each over all 40 positions, as a decode's query sees
	qn := r.vec(3 * hq * d)
	on, ln := make([]float32, 3*hq*d), make([]float32, 3*hq)
	pn := AttnParams{NQHeads: hq, Scale: 0.2, NonCausal: true}
	must(t, c.Prefill(0, []AttnReq{{Seq: s, QStart: 0, NQ: 3}}, qn, on, pn, ln))
	for i := 0; i < 3; i++ {
		wn, wln := reference(qn[i*hq*d:(i+1)*hq*d], k, v, hq, h, d, 0.2, 0, 0)
		assertClose(t, on[i*hq*d:(i+1)*hq*d], wn, 1e-5, "non-causal")
		assertClose(t, ln[i*hq:(i+1)*hq], wln, 1e-5, "non-causal: lse")
	}
	pn.Window = 8
	if err := c.Prefill(0, []AttnReq{{Seq: s, QStart: 0, NQ: 3}}, qn, on, pn, nil); code(err) != EINVAL {
		t.Fatalf("non-causal with a window: %v", err)
	}
	// keys [0, 20) through a truncated fork, [20, 40) through a window of 20: merged, the whole
	f, err := c.Fork(s)
	must(t, err)
	must(t, c.Truncate(f, 20))
	p := AttnParams{NQHeads: hq}
	oa, la, ob, lb, ow, lw := make([]float32, hq*d), make([]float32, hq), make([]float32, hq*d), make([]float32, hq),
		make([]float32, hq*d), make([]float32, hq)
	must(t, c.Decode(0, []Seq{f}, q, oa, p, la))
	must(t, c.Decode(0, []Seq{s}, q, ob, AttnParams{NQHeads: hq, Window: 20}, lb))
	must(t, c.Decode(0, []Seq{s}, q, ow, p, lw))
	om, lm := make([]float32, hq*d), make([]float32, hq)
	must(t, Merge(d, oa, la, ob, lb, om, lm))
	assertClose(t, om, toF64(ow), 1e-5, "merged halves")
	assertClose(t, lm, toF64(lw), 1e-5, "merged lse")
	w, _ := reference(q, k[:20*h*d], v[:20*h*d], hq, h, d, 1.0/8, 0, 0)
	assertClose(t, oa, w, 1e-5, "the fork truncated to 20")
}

// sameBits says whether a and b hold the same float32 bit patterns.
func sameBits(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// Attention sinks: sinks of -1e30 give the same bits as none (Decode and Prefill); finite ones
// give the result without them merged with a part of out 0 and lse Sinks[h] (pkv.h), out and
// lse; a sink that is not finite and Sinks of another length than n_q_heads are EINVAL.
func TestSinks(t *testing.T) {
	r := rng(0x5111c5)
	const h, d, hq = 2, 64, 8
	c := newCache(t, h, d, 64, F32)
	lens := []int{1, 17, 40}
	seqs := make([]Seq, len(lens))
	for i, n := range lens {
		s, err := c.SeqCreate(nil)
		must(t, err)
		seqs[i] = s
		fill(t, c, s, n, &r)
	}
	q := r.vec(len(seqs) * hq * d)
	for i := range q {
		q[i] *= 2
	}
	reqs := []AttnReq{{seqs[2], 30, 10}, {seqs[0], 0, 1}, {seqs[1], 5, 4}}
	qp := r.vec(15 * hq * d)
	far, finite := make([]float32, hq), make([]float32, hq)
	for i := range far {
		far[i] = -1e30
		finite[i] = 1 + r.next() // [-1, 3)
	}
	for _, cw := range []struct {
		capv float32
		win  uint32
	}{{0, 0}, {0, 6}, {4, 0}} {
		p := AttnParams{NQHeads: hq, Softcap: cw.capv, Window: cw.win}
		for _, prefill := range []bool{false, true} {
			call := "decode"
			if prefill {
				call = "prefill"
			}
			what := fmt.Sprintf("%s softcap %g window %d", call, cw.capv, cw.win)
			attn := func(sinks []float32) ([]float32, []float32) {
				qq, rows := q, len(seqs)
				if prefill {
					qq, rows = qp, 15
				}
				out, lse := make([]float32, rows*hq*d), make([]float32, rows*hq)
				ps := p
				ps.Sinks = sinks
				if prefill {
					must(t, c.Prefill(0, reqs, qq, out, ps, lse))
				} else {
					must(t, c.Decode(0, seqs, qq, out, ps, lse))
				}
				return out, lse
			}
			o0, l0 := attn(nil)
			of, lf := attn(far)
			if !sameBits(of, o0) || !sameBits(lf, l0) {
				t.Fatalf("%s: sinks -1e30 are not the bits of none", what)
			}
			osk, ls := attn(finite)
			rows := len(l0)
			zeros, lseSink := make([]float32, rows*d), make([]float32, rows)
			for i := range lseSink {
				lseSink[i] = finite[i%hq]
			}
			om, lm := make([]float32, rows*d), make([]float32, rows)
			must(t, Merge(d, o0, l0, zeros, lseSink, om, lm))
			assertClose(t, osk, toF64(om), 1e-5, what+": out with sinks")
			assertClose(t, ls, toF64(lm), 1e-5, what+": lse with sinks")
			if sameBits(osk, o0) {
				t.Fatalf("%s: sinks changed nothing", what)
			}
			for i := range ls { // the sink's term only adds to the sum
				if !(ls[i] >= l0[i]) {
					t.Fatalf("%s: row %d: lse %g under %g", what, i, ls[i], l0[i])
				}
			}
		}
	}
	// NQHeads 0 is n_kv_heads: h sinks
	o0, l0, o1, l1 := make([]float32, h*d), make([]float32, h), make([]float32, h*d), make([]float32, h)
	must(t, c.Decode(0, seqs[2:], q[:h*d], o0, AttnParams{}, l0))
	must(t, c.Decode(0, seqs[2:], q[:h*d], o1, AttnParams{Sinks: []float32{-1e30, -1e30}}, l1))
	if !sameBits(o1, o0) || !sameBits(l1, l0) {
		t.Fatal("NQHeads 0, h sinks: not the bits of none")
	}
	if err := c.Decode(0, seqs[2:], q[:h*d], o1, AttnParams{Sinks: finite}, nil); code(err) != EINVAL {
		t.Fatal("NQHeads 0 with n_q_heads sinks:", err)
	}
	// refusals: the wrong length (the binding's check, before libpkv reads past the slice), and a
	// sink that is not finite (libpkv's)
	out, outp := make([]float32, len(q)), make([]float32, len(qp))
	for _, n := range []int{0, hq - 1, hq + 1} {
		p := AttnParams{NQHeads: hq, Sinks: make([]float32, n)}
		err := c.Decode(0, seqs, q, out, p, nil)
		if want := fmt.Sprintf("Decode: sinks: %d elements, %d needed", n, hq); code(err) != EINVAL ||
			!strings.HasPrefix(err.Error(), want) {
			t.Fatalf("%d sinks: %v", n, err)
		}
		if err := c.Prefill(0, reqs, qp, outp, p, nil); code(err) != EINVAL || !strings.HasPrefix(err.Error(), "Prefill: sinks: ") {
			t.Fatalf("%d sinks, prefill: %v", n, err)
		}
	}
	for _, x := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		bad := append([]float32(nil), finite...)
		bad[3] = float32(x)
		p := AttnParams{NQHeads: hq, Sinks: bad}
		if err := c.Decode(0, seqs, q, out, p, nil); code(err) != EINVAL || !strings.Contains(err.Error(), "sinks[3]") {
			t.Fatalf("sink %g: %v", x, err)
		}
		if err := c.Prefill(0, reqs, qp, outp, p, nil); code(err) != EINVAL {
			t.Fatalf("sink %g, prefill: %v", x, err)
		}
	}
}

// ALiBi: decode with slopes against a reference that adds slope x (k - p) after the soft-cap;
// zero slopes give the same bits as none (no soft-cap); a slope that is NaN or past 65536 and
// AlibiSlopes of another length than n_q_heads are EINVAL.
func TestAlibi(t *testing.T) {
	r := rng(0xa11b1)
	const h, d, hq = 2, 64, 8
	c := newCache(t, h, d, 64, F32)
	lens := []int{9, 40}
	seqs := make([]Seq, len(lens))
	for i, n := range lens {
		s, err := c.SeqCreate(nil)
		must(t, err)
		seqs[i] = s
		fill(t, c, s, n, &r)
	}
	q := r.vec(len(seqs) * hq * d)
	slopes := make([]float32, hq)
	for i := range slopes {
		slopes[i] = float32(math.Pow(2, -8*float64(i+1)/hq))
	}
	const scale, capv = 0.2, 4.0
	p := AttnParams{NQHeads: hq, Scale: scale, Softcap: capv, AlibiSlopes: slopes}
	out, lse := make([]float32, len(q)), make([]float32, len(seqs)*hq)
	must(t, c.Decode(0, seqs, q, out, p, lse))
	for i, s := range seqs {
		n := lens[i]
		k, v, err := c.Gather(s, 0, 0, uint32(n))
		must(t, err)
		wo, wl := make([]float64, hq*d), make([]float64, hq)
		for qh := 0; qh < hq; qh++ {
			kh := qh / (hq / h)
			x := make([]float64, n)
			m := math.Inf(-1)
			for pos := 0; pos < n; pos++ {
				dot := 0.0
				for j := 0; j < d; j++ {
					dot += float64(q[(i*hq+qh)*d+j]) * float64(k[(pos*h+kh)*d+j])
				}
				x[pos] = capv*math.Tanh(dot*float64(float32(scale))/capv) + float64(slopes[qh])*float64(pos-(n-1))
				m = math.Max(m, x[pos])
			}
			sum := 0.0
			for pos := range x {
				x[pos] = math.Exp(x[pos] - m)
				sum += x[pos]
			}
			for pos := range x {
				for j := 0; j < d; j++ {
					wo[qh*d+j] += x[pos] / sum * float64(v[(pos*h+kh)*d+j])
				}
			}
			wl[qh] = m + math.Log(sum)
		}
		assertClose(t, out[i*hq*d:(i+1)*hq*d], wo, 1e-5, fmt.Sprintf("ALiBi sequence %d", i))
		assertClose(t, lse[i*hq:(i+1)*hq], wl, 1e-5, fmt.Sprintf("ALiBi lse sequence %d", i))
	}
	o0, o1 := make([]float32, len(q)), make([]float32, len(q))
	must(t, c.Decode(0, seqs, q, o0, AttnParams{NQHeads: hq, Scale: scale}, nil))
	must(t, c.Decode(0, seqs, q, o1, AttnParams{NQHeads: hq, Scale: scale, AlibiSlopes: make([]float32, hq)}, nil))
	for i := range o0 {
		if math.Float32bits(o0[i]) != math.Float32bits(o1[i]) {
			t.Fatalf("zero slopes: element %d %g, without %g", i, o1[i], o0[i])
		}
	}
	nan := append([]float32(nil), slopes...)
	nan[2] = float32(math.NaN())
	big := append([]float32(nil), slopes...)
	big[5] = 1e6
	for _, bad := range [][]float32{slopes[1:], nan, big} {
		if err := c.Decode(0, seqs, q, out, AttnParams{NQHeads: hq, AlibiSlopes: bad}, nil); code(err) != EINVAL {
			t.Fatalf("slopes %v: %v", bad, err)
		}
	}
}

func TestCompactCached(t *testing.T) {
	r := rng(6)
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.KDtype, cfg.VDtype, cfg.NThreads = 2, 32, 8, F16, F16, 1
	c, err := NewCache(cfg)
	must(t, err)
	t.Cleanup(c.Close)
	a, err := c.SeqCreate(nil)
	must(t, err)
	b, err := c.SeqCreate([]byte("b")) // another salt: its block is not a duplicate of a's first
	must(t, err)
	fill(t, c, a, 16, &r)
	fill(t, c, b, 16, &r)
	fill(t, c, a, 20, &r) // blocks 2 and 3
	k0, v0, err := c.Gather(a, 0, 0, 36)
	must(t, err)
	must(t, c.Release(b))
	st, err := c.Stats()
	must(t, err)
	if st.NCached != 1 {
		t.Fatalf("n_cached %d", st.NCached)
	}
	if n, err := c.Compact(a, false, false); err != nil || n != 0 { // 1 is CACHED
		t.Fatalf("compact without cached: %d, %v", n, err)
	}
	if n, err := c.Compact(a, false, true); err != nil || n != 2 { // 0 and 1 exchanged: two copies
		t.Fatalf("compact with cached: %d, %v", n, err)
	}
	tab, err := c.BlockTable(a)
	must(t, err)
	st2, err := c.Stats()
	must(t, err)
	if fmt.Sprint(tab) != "[1 2 3]" || st2.NCached != 1 || st2.NFree != st.NFree || st2.Evictions != st.Evictions {
		t.Fatalf("after compact with cached: table %v, stats %+v", tab, st2)
	}
	k1, v1, err := c.Gather(a, 0, 0, 36)
	must(t, err)
	if fmt.Sprint(k0, v0) != fmt.Sprint(k1, v1) {
		t.Fatal("K/V changed by compact")
	}
	must(t, c.Check())
}

func TestCompact(t *testing.T) {
	r := rng(5)
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.KDtype, cfg.VDtype, cfg.NThreads = 2, 32, 8, F16, F16, 1
	cfg.PrefixCache = false
	c, err := NewCache(cfg)
	must(t, err)
	t.Cleanup(c.Close)
	a, err := c.SeqCreate(nil)
	must(t, err)
	b, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, a, 16, &r)
	fill(t, c, b, 16, &r)
	fill(t, c, a, 20, &r) // blocks 2 and 3
	table := func() string {
		tab, err := c.BlockTable(a)
		must(t, err)
		return fmt.Sprint(tab)
	}
	if got := table(); got != "[0 2 3]" {
		t.Fatalf("table %s", got)
	}
	k0, v0, err := c.Gather(a, 0, 0, 36)
	must(t, err)
	q := r.vec(4 * 32)
	out0, out1 := make([]float32, len(q)), make([]float32, len(q))
	must(t, c.Decode(0, []Seq{a}, q, out0, AttnParams{NQHeads: 4}, nil))
	if n, err := c.Compact(a, false, false); err != nil || n != 0 { // block 1 is b's
		t.Fatalf("compact with 1 held: %d, %v", n, err)
	}
	must(t, c.Release(b))
	st, err := c.Stats()
	must(t, err)
	if n, err := c.Compact(a, false, false); err != nil || n != 1 { // 0 moves to 1: one copy, where 2, 3 to 1, 2 is two
		t.Fatalf("compact: %d, %v", n, err)
	}
	if got := table(); got != "[1 2 3]" {
		t.Fatalf("table after compact %s", got)
	}
	st2, err := c.Stats()
	must(t, err)
	if st != st2 {
		t.Fatalf("stats changed: %+v -> %+v", st, st2)
	}
	k1, v1, err := c.Gather(a, 0, 0, 36)
	must(t, err)
	must(t, c.Decode(0, []Seq{a}, q, out1, AttnParams{NQHeads: 4}, nil))
	if fmt.Sprint(k0, v0, out0) != fmt.Sprint(k1, v1, out1) {
		t.Fatal("K/V or decode changed by compact")
	}
	must(t, c.Check())
	if _, err := c.Compact(b, true, false); code(err) != ENOENT {
		t.Fatalf("compact of a released sequence: %v", err)
	}
	// a full pool: the batch's blocks are exchanged into one run a sequence
	d, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, d, 80, &r)
	tabOf := func(s Seq) string {
		tab, err := c.BlockTable(s)
		must(t, err)
		return fmt.Sprint(tab)
	}
	if got := tabOf(d); got != "[4 5 6 7 0]" {
		t.Fatalf("table of d %s", got)
	}
	kd, vd, err := c.Gather(d, 0, 0, 80)
	must(t, err)
	if n, err := c.BatchCompact([]Seq{d, a}, 0, false, false); err != nil || n != 0 || tabOf(d) != "[4 5 6 7 0]" {
		t.Fatalf("batch compact with a laid out: %d, %v, %s", n, err, tabOf(d)) // no stretch of 5 beside a
	}
	if n, err := c.BatchCompact([]Seq{d, a}, 0, true, false); err != nil || n != 8 { // four exchanges
		t.Fatalf("batch compact: %d, %v", n, err)
	}
	if tabOf(d) != "[0 1 2 3 4]" || tabOf(a) != "[5 6 7]" {
		t.Fatalf("tables after batch compact: %s %s", tabOf(d), tabOf(a))
	}
	if n, err := c.BatchCompact([]Seq{d, a}, 0, false, true); err != nil || n != 0 { // laid out: kept
		t.Fatalf("batch compact with cached: %d, %v", n, err)
	}
	kd1, vd1, err := c.Gather(d, 0, 0, 80)
	must(t, err)
	k2, v2, err := c.Gather(a, 0, 0, 36)
	must(t, err)
	if fmt.Sprint(kd, vd, k0, v0) != fmt.Sprint(kd1, vd1, k2, v2) {
		t.Fatal("K/V changed by batch compact")
	}
	must(t, c.Check())
	if _, err := c.BatchCompact([]Seq{a, a}, 0, false, false); code(err) != EINVAL {
		t.Fatalf("a sequence named twice: %v", err)
	}
}

// BatchCompact's cached flag: a and d interleave (blocks 0 2 and 1 3), b's two committed blocks
// are CACHED (4 5), 6 7 FREE. Without it a takes the FREE 6 7 and d closes up to 1 2 (3 moves);
// with it a takes the CACHED 4 5 by exchange and d exchanges 3 with the CACHED block now at 2 (6
// copies), b's prefix then lying at 0 3, still matched, with its K/V.
func TestBatchCompactCached(t *testing.T) {
	for _, cached := range []bool{false, true} {
		r := rng(12)
		c := newCache(t, 2, 32, 8, F16)
		a, err := c.SeqCreate([]byte("a"))
		must(t, err)
		d, err := c.SeqCreate([]byte("d"))
		must(t, err)
		b, err := c.SeqCreate([]byte("b"))
		must(t, err)
		for _, s := range []Seq{a, d, a, d} {
			fill(t, c, s, 16, &r)
		}
		fill(t, c, b, 32, &r)
		kb, vb, err := c.Gather(b, 0, 0, 32)
		must(t, err)
		ka, va, err := c.Gather(a, 0, 0, 32)
		must(t, err)
		must(t, c.Release(b))
		st, err := c.Stats()
		must(t, err)
		n, err := c.BatchCompact([]Seq{a, d}, 0, false, cached)
		must(t, err)
		st2, err := c.Stats()
		must(t, err)
		if st != st2 {
			t.Fatalf("cached %v: stats %+v -> %+v", cached, st, st2)
		}
		tabOf := func(s Seq) string {
			tab, err := c.BlockTable(s)
			must(t, err)
			return fmt.Sprint(tab)
		}
		want := map[bool][3]string{false: {"[6 7]", "[1 2]", "[4 5]"}, true: {"[4 5]", "[1 2]", "[0 3]"}}[cached]
		wantN := map[bool]uint32{false: 3, true: 6}[cached]
		m, err := c.SeqCreate([]byte("b"))
		must(t, err)
		toks := make([]int32, 33)
		for i := 0; i < 32; i++ {
			toks[i] = int32((i*7 + 100) % 500)
		}
		toks[32] = 1
		hit, err := c.MatchPrefix(m, toks)
		must(t, err)
		if n != wantN || tabOf(a) != want[0] || tabOf(d) != want[1] || hit != 32 || tabOf(m) != want[2] {
			t.Fatalf("cached %v: %d copies, a %s, d %s, prefix %d at %s", cached, n, tabOf(a), tabOf(d), hit, tabOf(m))
		}
		ka1, va1, err := c.Gather(a, 0, 0, 32)
		must(t, err)
		kb1, vb1, err := c.Gather(m, 0, 0, 32)
		must(t, err)
		if fmt.Sprint(ka, va, kb, vb) != fmt.Sprint(ka1, va1, kb1, vb1) {
			t.Fatalf("cached %v: K/V changed", cached)
		}
		must(t, c.Check())
		c.Close()
	}
}

func TestPrefixForkExports(t *testing.T) {
	r := rng(11)
	c := newCache(t, 2, 32, 32, F32)
	a, err := c.SeqCreate([]byte("tenant-1"))
	must(t, err)
	fill(t, c, a, 40, &r)
	// blocks an append would take (16-token blocks, 8 tokens in a's tail)
	for _, nw := range [][2]uint32{{0, 0}, {8, 0}, {9, 1}, {100, 6}} {
		if got, err := c.AppendBlocks(a, nw[0]); err != nil || got != nw[1] {
			t.Fatal("AppendBlocks", nw[0], got, err)
		}
	}
	if _, err := c.AppendBlocks(a, 32*16); code(err) != ELIMIT {
		t.Fatal("AppendBlocks past max_blocks_per_seq:", err)
	}
	toks := make([]int32, 40)
	for i := range toks {
		toks[i] = int32((i*7 + 100) % 500)
	}
	b, err := c.SeqCreate([]byte("tenant-1"))
	must(t, err)
	reused, err := c.MatchPrefix(b, toks)
	must(t, err)
	if reused < 32 || reused >= 40 {
		t.Fatal("reused", reused)
	}
	ka, _, err := c.Gather(a, 0, 0, reused)
	must(t, err)
	kb, _, err := c.Gather(b, 0, 0, reused)
	must(t, err)
	if fmt.Sprint(ka) != fmt.Sprint(kb) {
		t.Fatal("the reused K differs")
	}
	other, err := c.SeqCreate([]byte("tenant-2"))
	must(t, err)
	if n, err := c.MatchPrefix(other, toks); err != nil || n != 0 {
		t.Fatal("another namespace reused", n, err)
	}
	must(t, c.Release(other))
	st, err := c.Stats()
	must(t, err)
	if st.PrefixLookups != 2 || st.PrefixTokensHit != uint64(reused) || st.PrefixMissNamespace != 1 || st.NIndexed != 2 {
		t.Fatalf("stats %+v", st)
	}
	child, err := c.Fork(a)
	must(t, err)
	slots, err := c.Append(child, []int32{7}) // the shared tail block is copied first
	must(t, err)
	st2, err := c.Stats()
	must(t, err)
	if st2.CowCopies != st.CowCopies+1 {
		t.Fatal("no copy-on-write")
	}
	k := r.vec(2 * 32)
	must(t, c.WriteKV(0, slots, k, k))
	kc, vc, err := c.Gather(child, 0, 0, 41)
	must(t, err)
	q := r.vec(4 * 32)
	out := make([]float32, 4*32)
	must(t, c.Decode(0, []Seq{child}, q, out, AttnParams{NQHeads: 4}, nil))
	w, _ := reference(q, kc, vc, 4, 2, 32, 1/math.Sqrt(32), 0, 0)
	assertClose(t, out, w, 1e-5, "decode of the fork after CoW")

	seqs := []Seq{a, b, child}
	tables, lens, err := c.ExportDense(seqs, 8)
	must(t, err)
	// wider than any table can be: refused before the tables are allocated
	mbps := c.Config().MaxBlocksPerSeq
	if tb, _, err := c.ExportDense(seqs, mbps); err != nil || len(tb) != 3*int(mbps) {
		t.Fatal("ExportDense at MaxBlocksPerSeq", err)
	}
	for _, wide := range []uint32{mbps + 1, math.MaxUint32} {
		if _, _, err := c.ExportDense(seqs, wide); code(err) != EINVAL {
			t.Fatal("ExportDense wider than MaxBlocksPerSeq:", wide, err)
		}
	}
	indptr, indices, last, err := c.ExportCSR(seqs)
	must(t, err)
	for i, s := range seqs {
		tb, err := c.BlockTable(s)
		must(t, err)
		info, err := c.SeqInfo(s)
		must(t, err)
		n := int32(info.NTokens)
		if lens[i] != n || last[i] != n-int32(len(tb)-1)*16 {
			t.Fatal("lengths", i)
		}
		for j := 0; j < 8; j++ {
			want := int32(-1)
			if j < len(tb) {
				want = tb[j]
			}
			if tables[i*8+j] != want {
				t.Fatal("dense table", i, j)
			}
		}
		if fmt.Sprint(indices[indptr[i]:indptr[i+1]]) != fmt.Sprint(tb) {
			t.Fatal("csr table", i)
		}
		sl, err := c.Slots(s, 0, uint32(n))
		must(t, err)
		for p := 0; p < int(n); p++ {
			if sl[p] != tb[p/16]*16+int32(p%16) {
				t.Fatal("slot", i, p)
			}
		}
	}
	pin, err := c.Pin(a, 32)
	must(t, err)
	for _, s := range seqs {
		must(t, c.Release(s))
	}
	st, err = c.Stats()
	must(t, err)
	if st.NSeqs != 0 || st.NPins != 1 || st.NActive != 2 {
		t.Fatalf("after release %+v", st)
	}
	must(t, c.Check())
	must(t, c.PinRelease(pin))
	must(t, c.Reset())
	st, err = c.Stats()
	must(t, err)
	if st.NFree != 32 {
		t.Fatal("reset left blocks")
	}
	must(t, c.Check())
}

func TestStatusesAndLengthChecks(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.MaxSeqs, cfg.MaxBlocksPerSeq, cfg.NThreads = 1, 32, 4, 2, 8, 1
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	s, err := c.SeqCreate(nil)
	must(t, err)
	_, err = c.Append(s, []int32{1, 2, 3})
	must(t, err)
	must(t, c.Release(s))
	if _, err := c.SeqInfo(s); code(err) != ENOENT {
		t.Fatal("stale:", err)
	}
	x, err := c.SeqCreate(nil)
	must(t, err)
	y, err := c.SeqCreate(nil)
	must(t, err)
	if _, err := c.SeqCreate(nil); code(err) != ELIMIT {
		t.Fatal("max_seqs:", err)
	}
	// a handle of another cache, at a slot that is live here: refused, not another sequence's
	other, err := NewCache(cfg)
	must(t, err)
	o, err := other.SeqCreate(nil)
	must(t, err)
	if o&0xffffffff != x&0xffffffff {
		t.Fatal("other cache's first slot:", o, x)
	}
	if _, err := c.SeqInfo(o); !errors.Is(err, ErrNotFound) {
		t.Fatal("foreign handle, SeqInfo:", err)
	}
	if _, err := c.Append(o, []int32{1}); !errors.Is(err, ErrNotFound) {
		t.Fatal("foreign handle, Append:", err)
	}
	if err := c.Release(o); !errors.Is(err, ErrNotFound) {
		t.Fatal("foreign handle, Release:", err)
	}
	other.Close()
	if _, err := c.Append(x, make([]int32, 80)); code(err) != ENOSPC {
		t.Fatal("pool:", err)
	} else if !errors.Is(err, ErrNoSpace) || !errors.Is(fmt.Errorf("step 3: %w", err), ErrNoSpace) ||
		errors.Is(err, ErrNotFound) || errors.Is(err, errors.New("ENOSPC")) {
		t.Fatal("errors.Is on ENOSPC:", err)
	}
	// every status has its sentinel, and only that one matches it
	sentinels := map[int]error{EINVAL: ErrInvalid, ENOMEM: ErrNoMem, ENOSPC: ErrNoSpace, ENOENT: ErrNotFound,
		ELIMIT: ErrLimit, ECORRUPT: ErrCorrupt, EIO: ErrIO, ENOTSUP: ErrNotSupported, EBUSY: ErrBusy}
	for c1, s1 := range sentinels {
		for c2, s2 := range sentinels {
			if errors.Is(&Error{Code: c1, Op: "x"}, s2) != (c1 == c2) || errors.Is(s1, s2) != (c1 == c2) {
				t.Fatalf("errors.Is(%d, sentinel of %d) wrong", c1, c2)
			}
		}
	}
	slots, err := c.Append(y, []int32{1, 2, 3, 4})
	must(t, err)
	ones := make([]float32, 4*32)
	for i := range ones {
		ones[i] = 1
	}
	must(t, c.WriteKV(0, slots, ones, ones))
	q, out, p := make([]float32, 32), make([]float32, 32), AttnParams{}
	q[5] = float32(math.NaN())
	if err := c.Decode(0, []Seq{y}, q, out, p, nil); code(err) != EINVAL {
		t.Fatal("NaN query:", err)
	}
	q[5] = 1
	lse := []float32{42}
	if err := c.Decode(1, []Seq{y}, q, out, p, lse); code(err) != EINVAL || lse[0] != 42 {
		t.Fatal("layer out of range:", err, lse) // and a failed call leaves lse as it was
	}
	short := make([]float32, 31)
	h16 := make([]uint16, 4*32)
	for i, err := range []error{
		c.Decode(0, []Seq{y}, short, out, p, nil),
		c.Decode(0, []Seq{y}, q, out[:31], p, nil),
		c.Decode(0, []Seq{y, y}, q, out, p, nil),
		c.Decode(0, []Seq{y}, q, out, p, make([]float32, 2)),
		c.Prefill(0, []AttnReq{{y, 0, 2}}, q, out, p, nil),
		Merge(32, q, []float32{0}, short, []float32{0}, out, nil),
		Merge(0, q, []float32{0}, q, []float32{0}, out, nil),
		c.WriteKV(0, slots, short, nil),
		c.WriteKV(0, slots, nil, nil),
		c.WriteKV16(0, slots[:3], h16, nil, BF16),
		c.WriteKV16(0, slots, h16, nil, Q8_0),
	} {
		if code(err) != EINVAL {
			t.Fatalf("case %d: %v", i, err)
		}
	}
	k, _, err := c.Gather(y, 0, 0, 4)
	must(t, err)
	for _, x := range k {
		if x != 1 {
			t.Fatal("a refused write changed K")
		}
	}
	// ranges past the sequence: refused before an output of n rows is allocated
	for _, r := range [][2]uint32{{0, math.MaxUint32}, {math.MaxUint32, 1}, {3, 2}, {5, 0}} {
		if _, _, err := c.Gather(y, 0, r[0], r[1]); code(err) != EINVAL {
			t.Fatal("gather", r, err)
		}
		if _, err := c.Slots(y, r[0], r[1]); code(err) != EINVAL {
			t.Fatal("slots", r, err)
		}
	}
	if _, _, err := c.Gather(x, 0, 0, math.MaxUint32); code(err) != EINVAL {
		t.Fatal("gather of an empty sequence:", err)
	}
	if _, _, err := c.Gather(s, 0, 0, 1); code(err) != ENOENT {
		t.Fatal("gather of a released sequence:", err)
	}
	if k, _, err := c.Gather(y, 0, 4, 0); err != nil || len(k) != 0 {
		t.Fatal("empty gather at the end:", len(k), err)
	}
	if got, err := c.Slots(y, 1, 3); err != nil || len(got) != 3 || got[0] != slots[1] || got[2] != slots[3] {
		t.Fatal("slots 1..4:", got, err)
	}
	// empty slices (not nil) are zero elements, as in C with a buffer: an empty batch is no error
	for i, err := range []error{
		c.WriteKV(0, []int32{}, []float32{}, nil),
		c.WriteKV(0, []int32{}, []float32{}, []float32{}),
		c.WriteKV16(0, []int32{}, nil, []uint16{}, F16),
		c.Decode(0, []Seq{}, []float32{}, []float32{}, p, nil),
	} {
		if err != nil {
			t.Fatalf("empty case %d: %v", i, err)
		}
	}
	if got, err := c.Append(y, []int32{}); err != nil || len(got) != 0 {
		t.Fatal("empty append:", got, err)
	}
	if err := c.WriteKV(2, []int32{}, []float32{}, nil); code(err) != EINVAL {
		t.Fatal("empty write to a layer out of range:", err) // still checked, as C does
	}
	must(t, c.Check())
}

func TestGoroutines(t *testing.T) {
	// four goroutines, each growing and decoding sequences of its own in one cache
	c := newCache(t, 2, 32, 256, F32)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			r := rng(1000 + g)
			seqs := make([]Seq, 3)
			for i := range seqs {
				s, err := c.SeqCreate(nil)
				if err != nil {
					errs <- err
					return
				}
				seqs[i] = s
			}
			for step := 0; step < 20; step++ {
				for _, s := range seqs {
					slots, err := c.Append(s, []int32{int32(step), 1, 2})
					if err == nil {
						err = c.WriteKV(0, slots, r.vec(3*64), r.vec(3*64))
					}
					if err == nil {
						err = c.Commit(s, uint32(3*(step+1)))
					}
					if err != nil {
						errs <- err
						return
					}
				}
				q := r.vec(3 * 4 * 32)
				out := make([]float32, len(q))
				if err := c.Decode(0, seqs, q, out, AttnParams{NQHeads: 4}, nil); err != nil {
					errs <- err
					return
				}
				for i, s := range seqs {
					k, v, err := c.Gather(s, 0, 0, uint32(3*(step+1)))
					if err != nil {
						errs <- err
						return
					}
					w, _ := reference(q[i*128:(i+1)*128], k, v, 4, 2, 32, 1/math.Sqrt(32), 0, 0)
					for j := range w {
						if !(math.Abs(float64(out[i*128+j])-w[j]) <= 1e-5*math.Max(1, math.Abs(w[j]))*4) { // NaN fails
							errs <- fmt.Errorf("goroutine %d step %d: decode differs", g, step)
							return
						}
					}
				}
			}
			for _, s := range seqs {
				if err := c.Release(s); err != nil {
					errs <- err
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	must(t, c.Check())
}

func TestValueMax(t *testing.T) {
	// in a pool that holds it (f32): PKV_VALUE_MAX is taken, the next float refused
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.NThreads, cfg.KDtype, cfg.VDtype = 1, 32, 4, 1, F32, F32
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	s, err := c.SeqCreate(nil)
	must(t, err)
	slots, err := c.Append(s, []int32{1, 2})
	must(t, err)
	big := make([]float32, 2*32)
	for i := range big {
		big[i] = 1
	}
	big[40] = ValueMax
	must(t, c.WriteKV(0, slots, big, big))
	big[40] = math.Nextafter32(ValueMax, float32(math.Inf(1)))
	if err := c.WriteKV(0, slots, big, nil); code(err) != EINVAL {
		t.Fatal("past ValueMax:", err)
	}
	if k, _, err := c.Gather(s, 0, 0, 2); err != nil || k[40] != ValueMax {
		t.Fatal("ValueMax not kept:", err)
	}
}

func TestClosedNilAndDtypes(t *testing.T) {
	// a nil Cache and a closed one return ErrClosed (an EINVAL), and only they match it
	var nilc *Cache
	if _, err := nilc.Stats(); !errors.Is(err, ErrClosed) || !errors.Is(err, ErrInvalid) {
		t.Fatal("nil cache:", err)
	}
	nilc.Close() // a no-op
	if nilc.Config() != (Config{}) || nilc.Backend() != "" || nilc.BF16DotUsed() {
		t.Fatal("nil cache's config or backend")
	}
	f32, i32, u16, b8 := make([]float32, 64), []int32{0}, make([]uint16, 64), make([]byte, 64)
	for i, err := range []error{
		nilc.Reset(), nilc.AppendInto(1, i32, i32), nilc.WriteKV(0, i32, f32, f32), nilc.WriteKV16(0, i32, u16, u16, F16),
		nilc.WriteKVShared(0, i32, f32, f32), nilc.WriteKV16Shared(0, i32, u16, u16, BF16), nilc.Commit(1, 1),
		nilc.Truncate(1, 0), nilc.Release(1), nilc.PinRelease(1), nilc.SlotsInto(1, 0, i32),
		nilc.GatherInto(1, 0, 0, f32, nil), nilc.Check(), nilc.WriteStored(1, 0, 0, b8, nil),
		nilc.ReadStoredInto(1, 0, 0, b8, nil),
		nilc.Decode(0, []Seq{1}, f32, f32, AttnParams{}, nil), nilc.Prefill(0, []AttnReq{{1, 0, 1}}, f32, f32, AttnParams{}, nil),
	} {
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("nil cache, call %d: %v", i, err)
		}
	}
	for i, f := range []func() error{
		func() error { _, err := nilc.SeqCreate(nil); return err },
		func() error { _, err := nilc.Append(1, i32); return err },
		func() error { _, err := nilc.AppendBlocks(1, 1); return err },
		func() error { _, err := nilc.Compact(1, false, false); return err },
		func() error { _, err := nilc.BatchCompact([]Seq{1}, 0, false, false); return err },
		func() error { _, err := nilc.Fork(1); return err },
		func() error { _, err := nilc.Pin(1, 1); return err },
		func() error { _, err := nilc.MatchPrefix(1, i32); return err },
		func() error { h, _ := NewHostTier(1 << 20); defer h.Close(); _, err := nilc.TierSave(h, 1); return err },
		func() error {
			h, _ := NewHostTier(1 << 20)
			defer h.Close()
			_, err := nilc.TierLoad(h, 1, i32)
			return err
		},
		func() error { _, err := nilc.SeqInfo(1); return err },
		func() error { _, err := nilc.Slots(1, 0, 1); return err },
		func() error { _, err := nilc.BlockTable(1); return err },
		func() error { _, _, err := nilc.Gather(1, 0, 0, 1); return err },
		func() error { _, _, err := nilc.ReadStored(1, 0, 0, 1); return err },
		func() error { _, _, err := nilc.ExportDense([]Seq{1}, 1); return err },
		func() error { _, _, _, err := nilc.ExportCSR([]Seq{1}); return err },
	} {
		if err := f(); !errors.Is(err, ErrClosed) {
			t.Fatalf("nil cache, call %d: %v", i, err)
		}
	}
	c := newCache(t, 1, 32, 4, F32)
	s, err := c.SeqCreate(nil)
	must(t, err)
	if err := c.Commit(s, 5); code(err) != EINVAL || errors.Is(err, ErrClosed) {
		t.Fatal("a plain EINVAL matched ErrClosed:", err)
	}
	c.Close()
	if _, err := c.Append(s, []int32{1}); !errors.Is(err, ErrClosed) || code(err) != EINVAL {
		t.Fatal("closed cache:", err)
	}
	// a Dtype past the C enum is unknown to libpkv, not cut down to one it knows (1<<32 was f32)
	bigs := []Dtype{Dtype(-1), Dtype(0x10000), Dtype(math.MaxInt32)}
	if shift := 32; math.MaxInt > math.MaxInt32 { // a 64-bit int
		bigs = append(bigs, Dtype(1)<<shift, Dtype(1)<<shift+1)
	}
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks = 1, 32, 4
	for _, big := range bigs {
		if big.Name() == F32.Name() || big.Name() == F16.Name() || big.RowBytes(32) != 0 {
			t.Fatalf("Dtype(%d) read as %s", int(big), big.Name())
		}
		cfg.KDtype = big
		if _, err := NewCache(cfg); code(err) != EINVAL {
			t.Fatalf("KDtype %d: %v", int(big), err)
		}
	}
	cfg.KDtype = F16
	c2, err := NewCache(cfg)
	must(t, err)
	defer c2.Close()
	sl, err := c2.Append(s, nil) // s is c's handle: refused here
	if !errors.Is(err, ErrNotFound) || sl != nil {
		t.Fatal("another cache's handle:", err)
	}
	s2, err := c2.SeqCreate(nil)
	must(t, err)
	slots, err := c2.Append(s2, []int32{1})
	must(t, err)
	for _, big := range bigs {
		if err := c2.WriteKV16(0, slots, make([]uint16, 32), nil, big); code(err) != EINVAL {
			t.Fatalf("WriteKV16 with Dtype(%d): %v", int(big), err)
		}
	}
}

func TestFinalizerFreesDroppedCaches(t *testing.T) {
	// caches dropped without Close are freed by the finalizer: their worker threads end
	threads := func() int {
		b, err := os.ReadFile("/proc/self/status")
		if err != nil {
			t.Skip("no /proc/self/status")
		}
		var n int
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "Threads:") {
				fmt.Sscan(strings.TrimPrefix(line, "Threads:"), &n)
			}
		}
		return n
	}
	runtime.GC()
	before := threads()
	caches := make([]*Cache, 20) // reachable until counted: a GC meanwhile must not free them
	for i := range caches {
		cfg := DefaultConfig()
		cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.NThreads = 1, 32, 4, 3
		c, err := NewCache(cfg)
		must(t, err)
		caches[i] = c
	}
	if n := threads(); n < before+40 {
		t.Fatalf("threads %d before, %d with 20 caches of 2 workers", before, n)
	}
	runtime.KeepAlive(caches)
	caches = nil
	for i := 0; i < 250 && threads() > before+4; i++ { // (finalizers run one after another)
		runtime.GC()
		time.Sleep(20 * time.Millisecond)
	}
	if n := threads(); n > before+4 {
		t.Fatalf("threads %d before, %d after the caches were dropped", before, n)
	}
}

func TestIntoFormsAndSharedWrites(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NLayers, cfg.NKVHeads, cfg.HeadDim, cfg.NBlocks, cfg.KDtype, cfg.VDtype, cfg.NThreads = 2, 2, 32, 64, F32, F32, 2
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	s, err := c.SeqCreate(nil)
	must(t, err)
	toks := make([]int32, 40)
	for i := range toks {
		toks[i] = int32(i)
	}
	slots := make([]int32, 40)
	if err := c.AppendInto(s, toks, slots[:39]); code(err) != EINVAL {
		t.Fatal("AppendInto, short slots:", err)
	}
	must(t, c.AppendInto(s, toks, slots))
	want, err := c.Slots(s, 0, 40)
	must(t, err)
	part := make([]int32, 10)
	must(t, c.SlotsInto(s, 30, part))
	for i := range want {
		if want[i] != slots[i] || (i >= 30 && part[i-30] != slots[i]) {
			t.Fatal("AppendInto / SlotsInto against Slots at", i)
		}
	}
	if err := c.SlotsInto(s, 31, part); code(err) != EINVAL {
		t.Fatal("SlotsInto past the length:", err)
	}
	const row = 2 * 32
	r := rng(77)
	kv := [4][]float32{r.vec(40 * row), r.vec(40 * row), r.vec(40 * row), r.vec(40 * row)} // K, V of layers 0, 1
	must(t, c.WriteKV(0, slots, kv[0], kv[1]))
	// layer 1 written (WriteKVShared) while two goroutines decode layer 0
	q := r.vec(4 * 32)
	ap := AttnParams{NQHeads: 4}
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out := make([]float32, len(q))
			w, _ := reference(q, kv[0], kv[1], 4, 2, 32, 1/math.Sqrt(32), 0, 0)
			for i := 0; i < 50; i++ {
				if err := c.Decode(0, []Seq{s}, q, out, ap, nil); err != nil {
					errs <- err
					return
				}
				for j := range w {
					if !(math.Abs(float64(out[j])-w[j]) <= 1e-5*math.Max(1, math.Abs(w[j]))*4) {
						errs <- fmt.Errorf("layer 0 beside layer 1's writes: decode differs")
						return
					}
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for round := 0; round < 50; round++ {
			at := (round * 7) % 40
			for _, ab := range [][2]int{{at, 40}, {0, at}} {
				a, b := ab[0], ab[1]
				if err := c.WriteKVShared(1, slots[a:b], kv[2][a*row:b*row], kv[3][a*row:b*row]); err != nil {
					errs <- err
					return
				}
			}
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	must(t, c.Commit(s, 40))
	out := make([]float32, len(q))
	must(t, c.Decode(1, []Seq{s}, q, out, ap, nil))
	w, _ := reference(q, kv[2], kv[3], 4, 2, 32, 1/math.Sqrt(32), 0, 0)
	assertClose(t, out, w, 1e-5, "layer 1 after the shared writes")
	k, v := make([]float32, 5*row), make([]float32, 5*row)
	must(t, c.GatherInto(s, 1, 35, k, v))
	for i := range k {
		if k[i] != kv[2][35*row+i] || v[i] != kv[3][35*row+i] {
			t.Fatal("GatherInto differs at", i)
		}
	}
	must(t, c.GatherInto(s, 0, 35, nil, v))
	for i := range v {
		if v[i] != kv[1][35*row+i] {
			t.Fatal("GatherInto, V alone, differs at", i)
		}
	}
	for _, bad := range []error{
		c.GatherInto(s, 1, 36, k, nil),        // past the length
		c.GatherInto(s, 1, 0, k[:row+1], nil), // not whole rows
		c.GatherInto(s, 1, 0, k, v[:row]),     // k and v of different lengths
		c.GatherInto(s, 1, 0, nil, nil),
	} {
		if code(bad) != EINVAL {
			t.Fatal("GatherInto:", bad)
		}
	}
	must(t, c.Check())
}

func TestLengthsPastInt32(t *testing.T) {
	// 1024 rows of 4096 kv heads x 1024 are 2^32 elements: a 32-bit int wrapped that to 0, and
	// an empty k passed the check into libpkv (a crash on 386); now EINVAL on every int size
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.BlockTokens, cfg.NBlocks, cfg.KDtype, cfg.VDtype, cfg.NThreads = 4096, 1024, 1, 1, F32, F32, 1
	cfg.HugePages = false
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	s, err := c.SeqCreate(nil)
	must(t, err)
	sl, err := c.Append(s, []int32{1})
	must(t, err)
	slots := make([]int32, 1024)
	for i := range slots {
		slots[i] = -1
	}
	slots[0] = sl[0]
	if err := c.WriteKV(0, slots, []float32{}, nil); code(err) != EINVAL {
		t.Fatal("WriteKV of 2^32 elements from an empty k:", err)
	}
	if err := c.WriteKVShared(0, slots[:1023], []float32{}, nil); code(err) != EINVAL {
		t.Fatal("WriteKVShared, 1023 rows, an empty k:", err)
	}
	if err := Merge(math.MaxUint32, nil, []float32{0, 0}, nil, nil, nil, nil); code(err) != EINVAL {
		t.Fatal("Merge, head_dim 2^32 - 1:", err)
	}
	if err := c.Prefill(0, []AttnReq{{s, 0, math.MaxUint32}, {s, 0, math.MaxUint32}}, nil, nil, AttnParams{}, nil); code(err) != EINVAL {
		t.Fatal("Prefill of 2^33 queries:", err)
	}
}

func TestErrorsSayWhy(t *testing.T) {
	// libpkv says why a call refused (pkv.h); the *Error carries it, each goroutine its own
	if _, err := NewCache(Config{}); err == nil || !strings.Contains(err.Error(), "pkv_cache_create: ") {
		t.Fatal("a zeroed config:", err)
	}
	c := newCache(t, 1, 32, 4, F32)
	s, err := c.SeqCreate(nil)
	must(t, err)
	_, err = c.Append(s, []int32{1, 2, 3})
	must(t, err)
	if err := c.Commit(s, 99); err == nil || !strings.HasPrefix(err.Error(), "pkv_seq_commit: n_pos 99 past the sequence's length 3: ") {
		t.Fatal("commit past the length:", err)
	}
	if err := c.Decode(0, []Seq{s}, make([]float32, 3*32), make([]float32, 3*32), AttnParams{NQHeads: 3}, nil); err != nil {
		t.Fatal("n_q_heads 3 over 1 kv head:", err) // (a multiple of 1: fine)
	}
	// a binding-side refusal does not take an earlier libpkv reason
	_, err = c.Append(s+9, []int32{1})
	if !strings.Contains(err.Error(), fmt.Sprintf("sequence %#x is unknown", uint64(s+9))) {
		t.Fatal("unknown sequence:", err)
	}
	if _, _, err := c.ExportDense([]Seq{s}, 1<<20); err == nil || strings.Contains(err.Error(), "unknown") {
		t.Fatal("binding-side refusal:", err)
	}
	var wg sync.WaitGroup
	msgs := make([]map[string]bool, 4)
	for g := range msgs {
		wg.Add(1)
		msgs[g] = map[string]bool{}
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				var err error
				if g%2 == 0 {
					err = c.Commit(s, uint32(10+g))
				} else {
					_, err = c.SeqInfo(s + Seq(g))
				}
				msgs[g][strings.SplitN(err.Error(), ": ", 3)[1]] = true
			}
		}(g)
	}
	wg.Wait()
	for g, m := range msgs {
		want := fmt.Sprintf("n_pos %d past the sequence's length 3", 10+g)
		if g%2 == 1 {
			want = fmt.Sprintf("sequence %#x is unknown", uint64(s+Seq(g)))
		}
		if len(m) != 1 || !m[want] {
			t.Fatalf("goroutine %d saw %v, want only %q", g, m, want)
		}
	}
}

// waitsFor runs f on a goroutine and returns a channel closed when f has returned.
func waitsFor(f func()) chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	return done
}

// call is a named call for the lock tests; its error is reported with t.Errorf (from its own
// goroutine: not t.Fatal).
type call struct {
	name string
	f    func() error
}

func (k call) start(t *testing.T) chan struct{} {
	return waitsFor(func() {
		if err := k.f(); err != nil {
			t.Errorf("%s: %v", k.name, err)
		}
	})
}

// goOn: each call returns while what the test holds stays held.
func goOn(t *testing.T, held string, calls ...call) {
	t.Helper()
	for _, k := range calls {
		select {
		case <-k.start(t):
		case <-time.After(20 * time.Second):
			t.Fatalf("%s waited for %s", k.name, held)
		}
	}
}

// waitOn: each call is still waiting 100 ms after it started, and returns once release() has
// let go of what the test holds.
func waitOn(t *testing.T, held string, release func(), calls ...call) {
	t.Helper()
	done := make([]chan struct{}, len(calls))
	for i, k := range calls {
		done[i] = k.start(t)
	}
	time.Sleep(100 * time.Millisecond)
	for i, k := range calls {
		select {
		case <-done[i]:
			release()
			t.Fatalf("%s did not wait for %s", k.name, held)
		default:
		}
	}
	release()
	for i, k := range calls {
		select {
		case <-done[i]:
		case <-time.After(20 * time.Second):
			t.Fatalf("%s still waits after %s ended", k.name, held)
		}
	}
}

func TestSequenceLocks(t *testing.T) {
	// what waits for what while the test holds what a call in flight would hold
	c := newCacheUnclosed(t, 2, 32, 64, F32) // closed below
	r := rng(5)
	a, err := c.SeqCreate(nil)
	must(t, err)
	b, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, a, 20, &r)
	fill(t, c, b, 20, &r)
	_, err = c.Append(b, []int32{1, 2})
	must(t, err)
	bSlots := func() []int32 { // b's uncommitted positions 20, 21, taken again after any move
		s, err := c.Slots(b, 20, 2)
		must(t, err)
		return s
	}
	row := r.vec(2 * 2 * 32)
	q := r.vec(3 * 4 * 32)
	decode := func(seqs ...Seq) call {
		return call{fmt.Sprint("Decode", seqs), func() error {
			return c.Decode(0, seqs, q[:len(seqs)*128], make([]float32, len(seqs)*128), AttnParams{NQHeads: 4}, nil)
		}}
	}

	// 1. a read of a (attention over a): changes to b and reads of a go on; changes to a, and
	// WriteKV (by slot: whoever's rows), wait
	_, held, err := c.enter(readKV, a)
	must(t, err)
	sl := bSlots()
	goOn(t, "a read of a",
		call{"Append(b)", func() error { _, err := c.Append(b, []int32{3}); return err }},
		call{"Commit(b)", func() error { return c.Commit(b, 20) }},
		call{"WriteKVShared(b)", func() error { return c.WriteKVShared(0, sl, row, row) }},
		call{"SeqInfo(a)", func() error { _, err := c.SeqInfo(a); return err }},
		call{"Gather(a)", func() error { _, _, err := c.Gather(a, 0, 0, 20); return err }},
		decode(a, a, b),
		call{"Fork(a)", func() error { f, err := c.Fork(a); c.Release(f); return err }},
		call{"Stats", func() error { _, err := c.Stats(); return err }},
		call{"Check", c.Check},
		call{"SeqCreate", func() error { s, err := c.SeqCreate(nil); c.Release(s); return err }},
		call{"BatchCompact(b)", func() error { _, err := c.BatchCompact([]Seq{b}, 0, false, false); return err }},
		call{"ExportDense(b, a, b)", func() error { _, _, err := c.ExportDense([]Seq{b, a, b}, 8); return err }},
	)
	sl = bSlots()
	waitOn(t, "a read of a", held.exit,
		call{"Append(a)", func() error { _, err := c.Append(a, []int32{9}); return err }},
		call{"Truncate(a)", func() error { return c.Truncate(a, 20) }},
		call{"BatchAppend(b, a)", func() error {
			_, err := c.BatchAppend([]Seq{b, a}, [][]int32{{5}, {6}}, false)
			return err
		}},
		call{"WriteKV(b)", func() error { return c.WriteKV(0, sl, row, row) }},
	)

	// 2. a WriteKV in flight: appends and shared writes go on; reads of K/V rows, moves of them
	// and forks wait
	_, held, err = c.enter(access{kv: useAlone, rows: useShared})
	must(t, err)
	sl = bSlots()
	goOn(t, "a WriteKV",
		call{"Append(b)", func() error { _, err := c.Append(b, []int32{4}); return err }},
		call{"WriteKVShared(b)", func() error { return c.WriteKVShared(0, sl, row, row) }},
		call{"SeqInfo(a)", func() error { _, err := c.SeqInfo(a); return err }},
	)
	waitOn(t, "a WriteKV", held.exit,
		decode(b),
		call{"Gather(b)", func() error { _, _, err := c.Gather(b, 0, 0, 20); return err }},
		call{"Truncate(b)", func() error { return c.Truncate(b, 23) }},
		call{"Fork(b)", func() error { f, err := c.Fork(b); c.Release(f); return err }},
	)

	// 3. a WriteKVShared in flight: attention and appends go on; moves of rows and forks wait
	e, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, e, 5, &r)
	_, held, err = c.enter(access{rows: useShared})
	must(t, err)
	goOn(t, "a WriteKVShared",
		decode(a, b),
		call{"Append(b)", func() error { _, err := c.Append(b, []int32{5}); return err }},
	)
	waitOn(t, "a WriteKVShared", held.exit,
		call{"Truncate(b)", func() error { return c.Truncate(b, 22) }},
		call{"Compact(a)", func() error { _, err := c.Compact(a, false, false); return err }},
		call{"Fork(a)", func() error { f, err := c.Fork(a); c.Release(f); return err }},
		call{"Release(e)", func() error { return c.Release(e) }},
	)
	c.smu.Lock()
	if len(c.seqs) != 0 {
		t.Errorf("%d sequence locks kept with no call in flight", len(c.seqs))
	}
	c.smu.Unlock()

	// 4. WriteKVSeq names its sequence f: it goes on beside a read of another sequence and a
	// WriteKVShared, and waits for a read of f and for a WriteKV (whose slots may be f's rows);
	// one in flight makes the calls that name f and WriteKV wait, not attention over others
	f, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, f, 8, &r)
	_, err = c.Append(f, []int32{1, 2})
	must(t, err)
	writeF := call{"WriteKVSeq(f)", func() error { return c.WriteKVSeq(f, 0, 8, row, row) }}
	type hold struct {
		what string
		a    access
		seq  []Seq
	}
	for _, h := range []hold{{"a read of a", readKV, []Seq{a}}, {"a WriteKVShared", access{rows: useShared}, nil}} {
		_, held, err = c.enter(h.a, h.seq...)
		must(t, err)
		goOn(t, h.what, writeF)
		held.exit()
	}
	for _, h := range []hold{{"a read of f", readKV, []Seq{f}}, {"a WriteKV", access{kv: useAlone, rows: useShared}, nil}} {
		_, held, err = c.enter(h.a, h.seq...)
		must(t, err)
		waitOn(t, h.what, held.exit, writeF)
	}
	_, held, err = c.enter(access{write: true, kv: useShared}, f) // what WriteKVSeq(f) holds
	must(t, err)
	goOn(t, "a WriteKVSeq(f)",
		decode(a, b),
		call{"Gather(a)", func() error { _, _, err := c.Gather(a, 0, 0, 20); return err }},
		call{"WriteKVSeq(b)", func() error { return c.WriteKVSeq(b, 0, 20, row, nil) }},
		call{"Truncate(b)", func() error { return c.Truncate(b, 22) }},
	)
	sl = bSlots()
	waitOn(t, "a WriteKVSeq(f)", held.exit,
		decode(a, f),
		call{"Gather(f)", func() error { _, _, err := c.Gather(f, 0, 0, 10); return err }},
		call{"Fork(f)", func() error { g, err := c.Fork(f); c.Release(g); return err }},
		call{"WriteKV(b)", func() error { return c.WriteKV(0, sl, row, row) }},
	)

	// 5. Close waits for the calls in flight; calls after it are ErrClosed
	_, held, err = c.enter(readSeqs, b)
	must(t, err)
	closed := waitsFor(c.Close)
	time.Sleep(100 * time.Millisecond)
	select {
	case <-closed:
		t.Fatal("Close did not wait for a call in flight")
	default:
	}
	held.exit()
	<-closed
	if _, err := c.Append(b, []int32{1}); !errors.Is(err, ErrClosed) {
		t.Fatal("Append after Close:", err)
	}
}

func TestSequenceLocksStress(t *testing.T) {
	// goroutines changing and reading overlapping sets of sequences in random orders, batches
	// with repeats included: every call returns (no two wait on each other in a cycle), the
	// invariants hold, and no lock is kept once all have returned
	c := newCacheUnclosed(t, 2, 32, 512, F32) // closed at the end
	const nSeqs = 12
	seqs := make([]Seq, nSeqs)
	for i := range seqs {
		var err error
		seqs[i], err = c.SeqCreate(nil)
		must(t, err)
		_, err = c.Append(seqs[i], []int32{1}) // never empty: decode needs a position
		must(t, err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			r := rng(100 + g)
			pick := func() Seq { return seqs[int(r.next()*1e6+3e6)%nSeqs] } // next() is in [-2, 2)
			q := r.vec(4 * 4 * 32)
			out := make([]float32, len(q))
			kvRows := r.vec(2 * 2 * 32)
			for step := 0; step < 3000; step++ {
				batch := []Seq{pick(), pick(), pick(), pick()}
				var err error
				switch step % 9 {
				case 0:
					if s := pick(); s != seqs[g%nSeqs] { // distinct: pkv_batch_append names each once
						_, err = c.BatchAppend([]Seq{seqs[g%nSeqs], s}, [][]int32{{1}, {int32(step), 2}}, step%2 == 0)
					}
				case 1:
					// K/V written by slot while other goroutines may truncate, compact or
					// release... the sequence: its slots may be stale by then (EINVAL, or rows
					// of another sequence: values are not checked here)
					// Every other step by position instead: the two positions last appended, unless
					// another goroutine changed the sequence in between (EINVAL, or other rows of it)
					s := pick()
					var slots []int32
					if slots, err = c.Append(s, []int32{int32(step), 2}); err == nil {
						if step%2 == 0 {
							err = c.WriteKV(0, slots, kvRows, kvRows)
						} else {
							var info SeqInfo
							if info, err = c.SeqInfo(s); err == nil {
								err = c.WriteKVSeq(s, 0, info.NTokens-2, kvRows, kvRows)
								if err == nil && step%4 == 3 { // and the rows as stored, out and back in
									var ks, vs []byte
									if ks, vs, err = c.ReadStored(s, 0, info.NTokens-2, 2); err == nil {
										err = c.WriteStored(s, 0, info.NTokens-2, ks, vs)
									}
								}
							}
						}
						if code(err) == EINVAL {
							err = nil
						}
					}
				case 7:
					_, err = c.Compact(pick(), step%2 == 0, false)
				case 8:
					if step%2 == 0 {
						_, _, err = c.Gather(pick(), 0, 0, 1) // every sequence keeps position 0
					} else {
						_, _, err = c.ReadStored(pick(), 0, 0, 1)
					}
				case 2:
					err = c.Decode(0, batch, q, out, AttnParams{NQHeads: 4}, nil)
				case 3:
					s := pick()
					var info SeqInfo
					if info, err = c.SeqInfo(s); err == nil && info.NTokens > 40 {
						err = c.Truncate(s, 8)
					}
				case 4:
					// distinct ids: pkv_batch_compact takes each sequence once
					_, err = c.BatchCompact([]Seq{seqs[g%nSeqs], seqs[(g+5)%nSeqs]}, 1, step%2 == 0, false)
				case 5:
					_, _, err = c.ExportDense(batch, 64)
				case 6:
					var f Seq
					if f, err = c.Fork(pick()); err == nil {
						err = c.Release(f)
					}
				}
				if err != nil && code(err) != ENOSPC {
					errs <- fmt.Errorf("goroutine %d step %d: %w", g, step, err)
					return
				}
			}
		}(g)
	}
	finished := waitsFor(wg.Wait)
	select {
	case <-finished:
	case <-time.After(60 * time.Second):
		buf := make([]byte, 1<<20)
		t.Fatalf("calls still waiting after 60 s:\n%s", buf[:runtime.Stack(buf, true)])
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	must(t, c.Check())
	c.smu.Lock()
	if len(c.seqs) != 0 {
		t.Errorf("%d sequence locks kept with no call in flight", len(c.seqs))
	}
	c.smu.Unlock()
	c.Close()
}

func TestWriteKVSeq(t *testing.T) {
	// by position == by slot on fragmented tables; f16 input; refusals change nothing
	cfg := DefaultConfig()
	cfg.NLayers, cfg.NKVHeads, cfg.HeadDim, cfg.BlockTokens, cfg.NBlocks, cfg.NThreads = 2, 2, 32, 4, 12, 1
	cfg.KDtype, cfg.VDtype = F16, F16
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	a, err := c.SeqCreate(nil)
	must(t, err)
	b, err := c.SeqCreate(nil)
	must(t, err)
	for i := 0; i < 4; i++ {
		_, err = c.Append(a, []int32{1, 2, 3})
		must(t, err)
		_, err = c.Append(b, []int32{1, 2})
		must(t, err)
	}
	r := rng(9)
	const row = 2 * 32
	k, v := r.vec(12*row), r.vec(12*row)
	must(t, c.WriteKVSeq(a, 1, 0, k, v))
	sb, err := c.Slots(b, 0, 8)
	must(t, err)
	must(t, c.WriteKV(1, sb, k[:8*row], v[:8*row]))
	ka, va, err := c.Gather(a, 1, 0, 12)
	must(t, err)
	kb, vb, err := c.Gather(b, 1, 0, 8)
	must(t, err)
	if !reflect.DeepEqual(ka[:8*row], kb) || !reflect.DeepEqual(va[:8*row], vb) {
		t.Fatal("by position and by slot wrote different rows")
	}
	ones := make([]uint16, 3*row)
	for i := range ones {
		ones[i] = 0x3c00 // 1.0
	}
	must(t, c.WriteKVSeq16(a, 1, 9, nil, ones, F16)) // V only, positions 9..11
	k2, v2, err := c.Gather(a, 1, 0, 12)
	must(t, err)
	if !reflect.DeepEqual(k2, ka) || !reflect.DeepEqual(v2[:9*row], va[:9*row]) {
		t.Fatal("a V-only write changed other rows")
	}
	for i, x := range v2[9*row:] {
		if x != 1 {
			t.Fatalf("V element %d of positions 9..11 is %v, want 1", i, x)
		}
	}
	must(t, c.WriteKVSeq(a, 0, 0, v, k)) // layer 0 defined: the refusals below must leave it
	must(t, c.Commit(a, 4))
	before, _, err := c.Gather(a, 0, 0, 12)
	must(t, err)
	one, two := k[:row], k[:2*row]
	for i, f := range []func() error{
		func() error { return c.WriteKVSeq(a, 0, 3, two, nil) },  // position 3 committed
		func() error { return c.WriteKVSeq(a, 0, 11, two, nil) }, // past the length
		func() error { return c.WriteKVSeq(a, 2, 4, one, nil) },  // layer 2 of 2
		func() error { return c.WriteKVSeq(a, 0, 4, nil, nil) },
		func() error { return c.WriteKVSeq(a, 0, 4, one[1:], nil) }, // not whole rows
		func() error { return c.WriteKVSeq(a, 0, 4, one, two) },
		func() error { return c.WriteKVSeq16(a, 0, 4, ones[:row], nil, Q8_0) },
	} {
		if err := f(); code(err) != EINVAL {
			t.Fatalf("case %d: %v, want EINVAL", i, err)
		}
	}
	after, _, err := c.Gather(a, 0, 0, 12)
	must(t, err)
	if !reflect.DeepEqual(before, after) {
		t.Fatal("a refused write changed K")
	}
	d, err := c.Fork(a)
	must(t, err)
	if err := c.WriteKVSeq(d, 0, 6, one, nil); code(err) != EINVAL ||
		!strings.Contains(err.Error(), "pkv_seq_write_kv: position 6 (row 0) is in block") {
		t.Fatal("a write into a block the fork shares:", err)
	}
	must(t, c.Release(d))
	if err := c.WriteKVSeq(d, 0, 0, one, nil); code(err) != ENOENT {
		t.Fatal("a released sequence:", err)
	}
	must(t, c.Check())
}

func TestBatchAppend(t *testing.T) {
	// 6 blocks of 16: a holds 20 positions (2 blocks), b 16 (1): 3 FREE
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.BlockTokens, cfg.NBlocks, cfg.NThreads = 1, 32, 16, 6, 1
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	toks := make([]int32, 40)
	for i := range toks {
		toks[i] = int32(i)
	}
	a, _ := c.SeqCreate(nil)
	b, _ := c.SeqCreate(nil)
	d, _ := c.SeqCreate(nil)
	_, err = c.Append(a, toks[:20])
	must(t, err)
	_, err = c.Append(b, toks[:16])
	must(t, err)
	got, err := c.BatchAppend([]Seq{a, b, d}, [][]int32{toks[:2], toks[:3], nil}, false)
	must(t, err)
	wantA, _ := c.Slots(a, 20, 2)
	wantB, _ := c.Slots(b, 16, 3)
	if len(got) != 3 || fmt.Sprint(got[0]) != fmt.Sprint(wantA) || fmt.Sprint(got[1]) != fmt.Sprint(wantB) || len(got[2]) != 0 {
		t.Fatalf("BatchAppend slots %v, want %v %v []", got, wantA, wantB)
	}
	// 2 FREE: b + 20 takes 1, d + 40 takes 3: all or none, none
	st, _ := c.Stats()
	if st.NFree != 2 {
		t.Fatal("FREE blocks:", st.NFree)
	}
	if _, err := c.BatchAppend([]Seq{b, d}, [][]int32{toks[:20], toks}, false); !errors.Is(err, ErrNoSpace) ||
		!strings.Contains(err.Error(), "pkv_batch_append") {
		t.Fatal("all or none:", err)
	}
	if st2, _ := c.Stats(); st2 != st {
		t.Fatal("a refused BatchAppend changed the stats")
	}
	// first come, first served: b's fits, d's does not
	got, err = c.BatchAppend([]Seq{b, d}, [][]int32{toks[:20], toks}, true)
	must(t, err)
	ib, _ := c.SeqInfo(b)
	id, _ := c.SeqInfo(d)
	if len(got) != 1 || len(got[0]) != 20 || ib.NTokens != 39 || id.NTokens != 0 {
		t.Fatal("fit:", len(got), ib.NTokens, id.NTokens)
	}
	if got, err := c.BatchAppend(nil, nil, true); err != nil || len(got) != 0 {
		t.Fatal("empty batch:", got, err)
	}
	for _, bad := range []error{
		func() error { _, err := c.BatchAppend([]Seq{a, a}, [][]int32{toks[:1], toks[:1]}, false); return err }(),
		func() error { _, err := c.BatchAppend([]Seq{a}, [][]int32{toks[:1], toks[:1]}, false); return err }(),
	} {
		if code(bad) != EINVAL {
			t.Fatal("BatchAppend, bad input:", bad)
		}
	}
	if ia, _ := c.SeqInfo(a); ia.NTokens != 22 {
		t.Fatal("a refused BatchAppend changed a:", ia.NTokens)
	}
	must(t, c.Check())
}

func TestStoredRows(t *testing.T) {
	// a sequence moved to another cache through its stored rows: bit for bit, mixed dtypes
	for _, dt := range [][2]Dtype{{F32, BF16}, {Q8_0, F16}, {FP8E4M3, Q4_0}} {
		mk := func(nBlocks uint32) *Cache {
			cfg := DefaultConfig()
			cfg.NLayers, cfg.NKVHeads, cfg.HeadDim, cfg.BlockTokens, cfg.NBlocks, cfg.NThreads = 2, 2, 32, 4, nBlocks, 1
			cfg.KDtype, cfg.VDtype = dt[0], dt[1]
			c, err := NewCache(cfg)
			must(t, err)
			return c
		}
		a, b := mk(8), mk(16)
		sa, err := a.SeqCreate(nil)
		must(t, err)
		sb, err := b.SeqCreate(nil)
		must(t, err)
		filler, err := b.SeqCreate(nil)
		must(t, err)
		toks := []int32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}
		_, err = a.Append(sa, toks)
		must(t, err)
		for i := 0; i < 3; i++ {
			end := 4*i + 4
			if end > 10 {
				end = 10
			}
			_, err = b.Append(sb, toks[4*i:end])
			must(t, err)
			_, err = b.Append(filler, toks[:4])
			must(t, err)
		}
		r := rng(33)
		const row = 2 * 32
		kb, vb := 2*dt[0].RowBytes(32), 2*dt[1].RowBytes(32)
		var ks, vs []byte
		for layer := uint32(0); layer < 2; layer++ {
			must(t, a.WriteKVSeq(sa, layer, 0, r.vec(10*row), r.vec(10*row)))
			ks, vs, err = a.ReadStored(sa, layer, 0, 10)
			must(t, err)
			if len(ks) != 10*kb || len(vs) != 10*vb {
				t.Fatalf("%v: %d and %d bytes", dt, len(ks), len(vs))
			}
			must(t, b.WriteStored(sb, layer, 0, ks[:6*kb], nil))
			must(t, b.WriteStored(sb, layer, 0, nil, vs[:6*vb]))
			must(t, b.WriteStored(sb, layer, 6, ks[6*kb:], vs[6*vb:]))
			k2, v2, err := b.ReadStored(sb, layer, 0, 10)
			must(t, err)
			if !reflect.DeepEqual(k2, ks) || !reflect.DeepEqual(v2, vs) {
				t.Fatalf("%v layer %d: stored rows differ after the move", dt, layer)
			}
			vpart := make([]byte, 3*vb) // into the caller's buffer: V alone, 3 positions
			must(t, b.ReadStoredInto(sb, layer, 4, nil, vpart))
			if !reflect.DeepEqual(vpart, vs[4*vb:7*vb]) {
				t.Fatalf("%v layer %d: ReadStoredInto differs", dt, layer)
			}
			if err := b.ReadStoredInto(sb, layer, 0, nil, make([]byte, vb+1)); !errors.Is(err, ErrInvalid) {
				t.Fatalf("ReadStoredInto of a partial position: %v", err)
			}
			ga, gva, err := a.Gather(sa, layer, 0, 10)
			must(t, err)
			gb, gvb, err := b.Gather(sb, layer, 0, 10)
			must(t, err)
			if !reflect.DeepEqual(ga, gb) || !reflect.DeepEqual(gva, gvb) {
				t.Fatalf("%v layer %d: gathers differ", dt, layer)
			}
		}
		must(t, b.Commit(sb, 8))
		bk, bv, err := b.ReadStored(sb, 0, 0, 10)
		must(t, err)
		spoiled := append([]byte(nil), ks[:kb]...)
		switch dt[0] {
		case F32:
			copy(spoiled[12:16], []byte{0, 0, 0xc0, 0x7f}) // NaN (little-endian)
		case Q8_0:
			spoiled[2+5] = 0x80 // code -128
		default:
			spoiled[4+3] = 0xff // fp8: a NaN code
		}
		for i, err := range []error{
			b.WriteStored(sb, 0, 9, spoiled, nil),
			b.WriteStored(sb, 0, 7, ks[:2*kb], nil), // position 7 committed
			b.WriteStored(sb, 0, 9, ks[:2*kb], nil), // past the length
			b.WriteStored(sb, 2, 9, ks[:kb], nil),   // layer 2 of 2
			b.WriteStored(sb, 0, 9, nil, nil),
			b.WriteStored(sb, 0, 9, ks[:kb-1], nil), // not whole positions
			b.WriteStored(sb, 0, 9, ks[:kb], vs[:2*vb]),
		} {
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("%v case %d: %v, want ErrInvalid", dt, i, err)
			}
		}
		ak, av, err := b.ReadStored(sb, 0, 0, 10)
		must(t, err)
		if !reflect.DeepEqual(ak, bk) || !reflect.DeepEqual(av, bv) {
			t.Fatalf("%v: a refused write changed the rows", dt)
		}
		must(t, b.Check())
		a.Close()
		b.Close()
	}
}

// sameStored fails t unless positions [0, n) of a's sequence sa and b's sb hold the same stored
// rows, both layers of the tier tests' caches.
func sameStored(t *testing.T, a *Cache, sa Seq, b *Cache, sb Seq, n uint32) {
	t.Helper()
	for layer := uint32(0); layer < 2; layer++ {
		k1, v1, err := a.ReadStored(sa, layer, 0, n)
		must(t, err)
		k2, v2, err := b.ReadStored(sb, layer, 0, n)
		must(t, err)
		if !reflect.DeepEqual(k1, k2) || !reflect.DeepEqual(v1, v2) {
			t.Fatalf("layer %d: the loaded rows differ", layer)
		}
	}
}

// tierCache makes the tier tests' caches: 2 layers, 2 kv heads x 32, blocks of 8, f16 K and
// q8_0 V, prefix caching on.
func tierCache(t *testing.T) func(nBlocks uint32) *Cache {
	return func(nBlocks uint32) *Cache {
		cfg := DefaultConfig()
		cfg.NLayers, cfg.NKVHeads, cfg.HeadDim, cfg.BlockTokens, cfg.NBlocks, cfg.NThreads = 2, 2, 32, 8, nBlocks, 1
		cfg.KDtype, cfg.VDtype, cfg.PrefixCache = F16, Q8_0, true
		c, err := NewCache(cfg)
		must(t, err)
		return c
	}
}

// tierSource is a cache of 16 blocks holding a 45-token prompt (first .. first+44) in namespace
// salt, its K/V random from seed, committed: the cache, the sequence and the prompt.
func tierSource(t *testing.T, salt string, first int32, seed uint64) (*Cache, Seq, []int32) {
	a := tierCache(t)(16)
	prompt := make([]int32, 45)
	for i := range prompt {
		prompt[i] = first + int32(i)
	}
	sa, err := a.SeqCreate([]byte(salt))
	must(t, err)
	_, err = a.Append(sa, prompt)
	must(t, err)
	r := rng(seed)
	for layer := uint32(0); layer < 2; layer++ {
		must(t, a.WriteKVSeq(sa, layer, 0, r.vec(45*64), r.vec(45*64)))
	}
	must(t, a.Commit(sa, 45))
	return a, sa, prompt
}

func TestTiers(t *testing.T) {
	// a prompt's blocks saved from one cache into host and file tiers and loaded into another,
	// byte for byte; another namespace misses; refusals; a closed tier
	mk := tierCache(t)
	a, sa, prompt := tierSource(t, "ten", 400, 5)
	defer a.Close()
	host, err := NewHostTier(1 << 24)
	must(t, err)
	dir := t.TempDir()
	file, err := NewFileTier(dir+"/t", 1<<24)
	must(t, err)
	for _, tier := range []*Tier{host, file} {
		n, err := a.TierSave(tier, sa)
		must(t, err)
		if n != 5 {
			t.Fatalf("saved %d blocks, want 5", n)
		}
		if n, _ = a.TierSave(tier, sa); n != 0 {
			t.Fatalf("saved %d blocks again", n)
		}
		st, err := tier.Stats()
		must(t, err)
		if st.Entries != 5 || st.Saved != 5 || st.SavePresent != 5 {
			t.Fatalf("stats %+v", st)
		}
		c := mk(40)
		sc, err := c.SeqCreate([]byte("ten"))
		must(t, err)
		got, err := c.TierLoad(tier, sc, prompt)
		must(t, err)
		if got != 40 {
			t.Fatalf("loaded %d positions, want 40", got)
		}
		sameStored(t, a, sa, c, sc, 40)
		other, err := c.SeqCreate([]byte("other"))
		must(t, err)
		if got, err = c.TierLoad(tier, other, prompt); err != nil || got != 0 {
			t.Fatalf("another namespace: %d, %v", got, err)
		}
		_, err = c.Append(other, prompt[:2])
		must(t, err)
		if _, err = c.TierLoad(tier, other, prompt); !errors.Is(err, ErrInvalid) {
			t.Fatalf("uncommitted positions: %v", err)
		}
		c.Close()
	}
	if _, err := a.TierSave(host, Seq(12345)); !errors.Is(err, ErrNotFound) {
		t.Fatalf("an unknown sequence: %v", err)
	}
	if _, err := NewHostTier(0); !errors.Is(err, ErrInvalid) {
		t.Fatalf("capacity 0: %v", err)
	}
	if _, err := NewFileTier("/nonexistent-pkv/a/b", 1<<20); !errors.Is(err, ErrIO) {
		t.Fatalf("a directory that cannot be made: %v", err)
	}
	if _, err := NewRedisTier("127.0.0.1", 1, "", 100); !errors.Is(err, ErrIO) && !errors.Is(err, ErrNotSupported) {
		t.Fatalf("a Redis port nobody serves: %v", err)
	}
	if _, err := NewRedisTier("127.0.0.1", 0, "", 100); !errors.Is(err, ErrInvalid) {
		t.Fatalf("port 0: %v", err)
	}
	host.Close()
	host.Close()
	file.Close()
	if _, err := a.TierSave(host, sa); !errors.Is(err, ErrClosed) {
		t.Fatalf("a closed tier: %v", err)
	}
	if _, err := host.Stats(); !errors.Is(err, ErrClosed) {
		t.Fatalf("stats of a closed tier: %v", err)
	}
	var none *Tier
	if _, err := a.TierLoad(none, sa, prompt); !errors.Is(err, ErrClosed) {
		t.Fatalf("a nil tier: %v", err)
	}
}

func TestTierPrefetch(t *testing.T) {
	// tests/test_tier.c test_prefetch, its first part, on a file tier: a prompt saved from one
	// cache is prefetched for another, staged, and loaded from staging byte for byte; refusals;
	// a closed tier or cache
	mk := tierCache(t)
	a, sa, prompt := tierSource(t, "ns", 500, 29)
	defer a.Close()
	tier, err := NewFileTier(t.TempDir()+"/t", 1<<24)
	must(t, err)
	defer tier.Close()
	if n, err := a.TierSave(tier, sa); err != nil || n != 5 {
		t.Fatalf("saved %d blocks (%v), want 5", n, err)
	}
	b := mk(60)
	defer b.Close()
	ns := []byte("ns")
	// not started: refused
	if err := tier.Prefetch(b, ns, prompt); !errors.Is(err, ErrInvalid) || errors.Is(err, ErrClosed) {
		t.Fatalf("prefetch before start: %v", err)
	}
	if err := tier.PrefetchWait(); !errors.Is(err, ErrInvalid) {
		t.Fatalf("wait before start: %v", err)
	}
	if err := tier.PrefetchStart(0); !errors.Is(err, ErrInvalid) {
		t.Fatalf("staging 0: %v", err)
	}
	must(t, tier.PrefetchStart(1<<24))
	if err := tier.PrefetchStart(1 << 24); !errors.Is(err, ErrInvalid) {
		t.Fatalf("started twice: %v", err)
	}
	if err := tier.Prefetch(b, make([]byte, 257), prompt); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a salt of 257 bytes: %v", err)
	}
	must(t, tier.Prefetch(b, ns, prompt[:7])) // no full block: nothing to do
	must(t, tier.Prefetch(b, ns, nil))
	// staged: every full block
	must(t, tier.Prefetch(b, ns, prompt))
	must(t, tier.PrefetchWait())
	st, err := tier.Stats()
	must(t, err)
	if st.Prefetched != 5 || st.StagedEntries != 5 || st.PrefetchHits != 0 || st.StagedBytes == 0 || st.StagedBytes%5 != 0 {
		t.Fatalf("staged: %+v", st)
	}
	must(t, tier.Prefetch(b, ns, prompt)) // staged already: kept, not fetched again
	must(t, tier.PrefetchWait())
	if st2, err := tier.Stats(); err != nil || st2 != st {
		t.Fatalf("prefetched again: %+v, %v", st2, err)
	}
	held := st.StagedBytes
	// the load takes them from staging
	sb, err := b.SeqCreate(ns)
	must(t, err)
	got, err := b.TierLoad(tier, sb, prompt)
	must(t, err)
	if got != 40 {
		t.Fatalf("loaded %d positions, want 40", got)
	}
	st, err = tier.Stats()
	must(t, err)
	// none staged; their buffers kept for the next fetches, within the staging bytes
	if st.PrefetchHits != 5 || st.LoadedBlocks != 5 || st.LoadMisses != 0 || st.StagedEntries != 0 || st.StagedBytes != held {
		t.Fatalf("loaded: %+v", st)
	}
	sameStored(t, a, sa, b, sb, 40)
	// another namespace: the first block is missing, nothing staged
	must(t, tier.Prefetch(b, []byte("other"), prompt))
	must(t, tier.PrefetchWait())
	if st, err = tier.Stats(); err != nil || st.Prefetched != 5 || st.StagedEntries != 0 {
		t.Fatalf("another namespace: %+v, %v", st, err)
	}
	// queued for a cache closed before they run; then a closed cache, a closed or nil tier
	c := mk(60)
	must(t, tier.Prefetch(c, ns, prompt))
	c.Close()
	must(t, tier.PrefetchWait())
	if st, err = tier.Stats(); err != nil || st.StagedEntries != 5 {
		t.Fatalf("staged for a closed cache: %+v, %v", st, err)
	}
	if err := tier.Prefetch(c, ns, prompt); !errors.Is(err, ErrClosed) {
		t.Fatalf("a closed cache: %v", err)
	}
	must(t, b.Check())
	tier.Close()
	if err := tier.Prefetch(b, ns, prompt); !errors.Is(err, ErrClosed) {
		t.Fatalf("a closed tier: %v", err)
	}
	if err := tier.PrefetchWait(); !errors.Is(err, ErrClosed) {
		t.Fatalf("wait on a closed tier: %v", err)
	}
	var none *Tier
	if err := none.PrefetchStart(1); !errors.Is(err, ErrClosed) {
		t.Fatalf("a nil tier: %v", err)
	}
}

func TestTierWriteBack(t *testing.T) {
	// tests/test_tier.c test_write_back, on a file tier: a save's puts left to the tier's thread,
	// the sequence released before they run; Flush waits for them; refusals; a closed tier or
	// cache
	mk := tierCache(t)
	a, sa, prompt := tierSource(t, "wb", 700, 31)
	defer a.Close()
	dir := t.TempDir() + "/t"
	tier, err := NewFileTier(dir, 1<<24)
	must(t, err)
	defer tier.Close()
	files := func() int {
		es, err := os.ReadDir(dir)
		must(t, err)
		return len(es)
	}
	// not started: refused
	host, err := NewHostTier(1 << 24)
	must(t, err)
	defer host.Close()
	if _, err := a.TierSaveAsync(host, sa); !errors.Is(err, ErrInvalid) || errors.Is(err, ErrClosed) {
		t.Fatalf("save before start: %v", err)
	}
	if err := host.Flush(); !errors.Is(err, ErrInvalid) || errors.Is(err, ErrClosed) {
		t.Fatalf("flush before start: %v", err)
	}
	must(t, tier.PrefetchStart(1<<24))
	if _, err := a.TierSaveAsync(tier, Seq(12345)); !errors.Is(err, ErrNotFound) {
		t.Fatalf("an unknown sequence: %v", err)
	}
	// queued: the sequence may go before the puts run
	s2, err := a.Fork(sa)
	must(t, err)
	if n, err := a.TierSaveAsync(tier, s2); err != nil || n != 5 {
		t.Fatalf("queued %d blocks (%v), want 5", n, err)
	}
	must(t, a.Release(s2))
	must(t, tier.Flush())
	st, err := tier.Stats()
	must(t, err)
	if st.Saved != 5 || st.SavePresent != 0 || st.Errors != 0 {
		t.Fatalf("flushed: %+v", st)
	}
	if n := files(); n != 5 {
		t.Fatalf("%d files, want 5", n)
	}
	// they load as a synchronous save's do
	b := mk(60)
	defer b.Close()
	sb, err := b.SeqCreate([]byte("wb"))
	must(t, err)
	if got, err := b.TierLoad(tier, sb, prompt); err != nil || got != 40 {
		t.Fatalf("loaded %d positions (%v), want 40", got, err)
	}
	sameStored(t, a, sa, b, sb, 40)
	// again: the thread finds them there
	if n, err := a.TierSaveAsync(tier, sa); err != nil || n != 5 {
		t.Fatalf("queued again %d blocks (%v), want 5", n, err)
	}
	must(t, tier.Flush())
	if st, err = tier.Stats(); err != nil || st.Saved != 5 || st.SavePresent != 5 {
		t.Fatalf("saved again: %+v, %v", st, err)
	}
	must(t, tier.Flush()) // nothing queued
	// puts that fail (the directory gone): the flush says so, once
	c, sc, _ := tierSource(t, "wb2", 700, 37)
	gone := t.TempDir() + "/t"
	t2, err := NewFileTier(gone, 1<<24)
	must(t, err)
	must(t, t2.PrefetchStart(1<<24))
	must(t, os.RemoveAll(gone))
	if n, err := c.TierSaveAsync(t2, sc); err != nil || n != 5 {
		t.Fatalf("queued %d blocks (%v), want 5", n, err)
	}
	if err := t2.Flush(); !errors.Is(err, ErrIO) {
		t.Fatalf("failed puts: %v", err)
	}
	must(t, t2.Flush())
	if st, err = t2.Stats(); err != nil || st.Saved != 0 || st.Errors != 5 {
		t.Fatalf("failed puts: %+v, %v", st, err)
	}
	t2.Close()
	// queued at Close: put first
	if n, err := c.TierSaveAsync(tier, sc); err != nil || n != 5 {
		t.Fatalf("queued %d blocks (%v), want 5", n, err)
	}
	tier.Close()
	if n := files(); n != 10 {
		t.Fatalf("%d files after Close, want 10", n)
	}
	// a closed cache, a closed or nil tier
	c.Close()
	if _, err := c.TierSaveAsync(host, sc); !errors.Is(err, ErrClosed) {
		t.Fatalf("a closed cache: %v", err)
	}
	if _, err := a.TierSaveAsync(tier, sa); !errors.Is(err, ErrClosed) {
		t.Fatalf("a closed tier: %v", err)
	}
	if err := tier.Flush(); !errors.Is(err, ErrClosed) {
		t.Fatalf("flush on a closed tier: %v", err)
	}
	var none *Tier
	if err := none.Flush(); !errors.Is(err, ErrClosed) {
		t.Fatalf("a nil tier: %v", err)
	}
	must(t, a.Check())
}

func TestMediaTokens(t *testing.T) {
	// an image's positions keyed by its content: the C library's ids (pinned in
	// tests/test_prefix.c), piece by piece the same, and a prompt with another image matches
	// only the text before it
	ids, err := MediaTokens([]byte("pagedkv"), 0, 3)
	must(t, err)
	last, err := MediaTokens([]byte("pagedkv"), math.MaxUint32, 1)
	must(t, err)
	if !reflect.DeepEqual(append(ids, last...), []int32{-1780325367, -650806929, -969049132, -49490191}) {
		t.Fatalf("ids %v %v", ids, last)
	}
	a, err := MediaTokens([]byte("digest of image a"), 0, 40)
	must(t, err)
	b, err := MediaTokens([]byte("digest of image b"), 0, 40)
	must(t, err)
	p1, err := MediaTokens([]byte("digest of image a"), 0, 15)
	must(t, err)
	p2, err := MediaTokens([]byte("digest of image a"), 15, 25)
	must(t, err)
	if !reflect.DeepEqual(append(p1, p2...), a) {
		t.Fatalf("piece by piece %v, whole %v", append(p1, p2...), a)
	}
	if none, err := MediaTokens([]byte("x"), math.MaxUint32, 0); err != nil || len(none) != 0 {
		t.Fatalf("no ids: %v, %v", none, err)
	}
	for i := range a {
		if a[i] >= 0 || a[i] == b[i] {
			t.Fatalf("position %d: %d and %d", i, a[i], b[i])
		}
	}
	prompt := func(img []int32) []int32 {
		p := make([]int32, 0, 72)
		for x := int32(100); x < 120; x++ {
			p = append(p, x)
		}
		p = append(p, img...)
		for x := int32(200); x < 212; x++ {
			p = append(p, x)
		}
		return p
	}
	pa, pb := prompt(a), prompt(b)
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.BlockTokens, cfg.NBlocks, cfg.NThreads = 1, 8, 16, 16, 1
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	s, err := c.SeqCreate(nil)
	must(t, err)
	_, err = c.Append(s, pa)
	must(t, err)
	must(t, c.Commit(s, uint32(len(pa))))
	for _, tc := range []struct {
		prompt []int32
		want   uint32
	}{{pb, 20}, {pa, uint32(len(pa) - 1)}} { // the text before the image only; the same image: all
		u, err := c.SeqCreate(nil)
		must(t, err)
		got, err := c.MatchPrefix(u, tc.prompt)
		must(t, err)
		if got != tc.want {
			t.Fatalf("matched %d, want %d", got, tc.want)
		}
	}
	must(t, c.Check())
	for _, bad := range []struct {
		id     []byte
		offset uint32
		n      int
	}{{nil, 0, 4}, {[]byte("x"), math.MaxUint32, 2}, {[]byte("x"), 0, -1}} {
		if _, err := MediaTokens(bad.id, bad.offset, bad.n); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%v: %v", bad, err)
		}
	}
}

func TestEvents(t *testing.T) {
	// a router's view of a cache: the events name the blocks by the hashes PrefixHashes
	// computes from the prompt, with no cache; eviction removes them leaf first; a snapshot
	// gives the same; a reset says cleared; a full ring says overflow
	const b = 4
	seq := func(lo, hi int32) []int32 {
		s := make([]int32, 0, hi-lo)
		for x := lo; x < hi; x++ {
			s = append(s, x)
		}
		return s
	}
	prompt := seq(1000, 1010)
	cfg := DefaultConfig()
	cfg.NKVHeads, cfg.HeadDim, cfg.BlockTokens, cfg.NBlocks, cfg.NThreads, cfg.EventCapacity = 1, 8, b, 4, 1, 16
	c, err := NewCache(cfg)
	must(t, err)
	defer c.Close()
	if c.Config().EventCapacity != 16 {
		t.Fatalf("EventCapacity %d", c.Config().EventCapacity)
	}
	h, err := PrefixHashes([]byte("t"), b, prompt)
	must(t, err)
	if len(h) != 2 {
		t.Fatalf("%d hashes, want 2", len(h))
	}
	if h0, err := PrefixHashes(nil, b, prompt); err != nil || reflect.DeepEqual(h0, h) {
		t.Fatalf("another namespace: %v, %v", h0, err)
	}
	s, err := c.SeqCreate([]byte("t"))
	must(t, err)
	_, err = c.Append(s, prompt)
	must(t, err)
	must(t, c.Commit(s, 10))
	ev, err := c.TakeEvents(1024, true)
	must(t, err)
	table, err := c.BlockTable(s)
	must(t, err)
	want := []Event{
		{Seqno: 1, Kind: EventStored, Hash: h[0], ParentHash: 0, Depth: 0, Block: uint32(table[0]), Tokens: prompt[0:4]},
		{Seqno: 2, Kind: EventStored, Hash: h[1], ParentHash: h[0], Depth: 1, Block: uint32(table[1]), Tokens: prompt[4:8]},
	}
	if !reflect.DeepEqual(ev, want) {
		t.Fatalf("events %+v, want %+v", ev, want)
	}
	if ev, err = c.TakeEvents(1024, false); err != nil || len(ev) != 0 {
		t.Fatalf("none left: %+v, %v", ev, err)
	}
	snap, err := c.PrefixSnapshot(false)
	must(t, err)
	for i := range want {
		want[i].Seqno, want[i].Tokens = 0, nil
	}
	if !reflect.DeepEqual(snap, want) {
		t.Fatalf("snapshot %+v, want %+v", snap, want)
	}
	snap, err = c.PrefixSnapshot(true)
	must(t, err)
	if len(snap) != 2 || !reflect.DeepEqual(snap[1].Tokens, prompt[4:8]) {
		t.Fatalf("snapshot with tokens %+v", snap)
	}
	must(t, c.Release(s))
	s2, err := c.SeqCreate(nil)
	must(t, err)
	_, err = c.Append(s2, seq(0, 16)) // all 4 blocks: both cached ones evicted, the leaf first
	must(t, err)
	ev, err = c.TakeEvents(1024, false)
	must(t, err)
	if len(ev) != 2 || ev[0].Kind != EventRemoved || ev[0].Hash != h[1] || ev[1].Kind != EventRemoved ||
		ev[1].Hash != h[0] || ev[0].Tokens != nil {
		t.Fatalf("evictions: %+v", ev)
	}
	must(t, c.Commit(s2, 16))
	if ev, err = c.TakeEvents(3, false); err != nil || len(ev) != 3 {
		t.Fatalf("3 of 4: %+v, %v", ev, err)
	}
	if ev, err = c.TakeEvents(1024, false); err != nil || len(ev) != 1 {
		t.Fatalf("the 4th: %+v, %v", ev, err)
	}
	if ev, err = c.TakeEvents(0, false); err != nil || len(ev) != 0 {
		t.Fatalf("max 0: %+v, %v", ev, err)
	}
	must(t, c.Reset())
	ev, err = c.TakeEvents(1024, true)
	must(t, err)
	if !reflect.DeepEqual(ev, []Event{{Seqno: 9, Kind: EventCleared}}) || ev[0].Kind.String() != "cleared" {
		t.Fatalf("reset: %+v", ev)
	}
	for i := 0; i < 5; i++ { // 20 events for a ring of 16
		s, err := c.SeqCreate(nil)
		must(t, err)
		_, err = c.Append(s, seq(0, 16))
		must(t, err)
		must(t, c.Commit(s, 16))
		must(t, c.Release(s))
		must(t, c.Reset())
	}
	// seqno 9 was the last taken; 10-25 filled the ring, 26 found it full
	ev, err = c.TakeEvents(math.MaxInt, false)
	must(t, err)
	if len(ev) != 9 || ev[0].Kind != EventOverflow || ev[0].Seqno != 26 || ev[0].Lost != 17 {
		t.Fatalf("overflow: %+v", ev)
	}
	for i, e := range ev[1:] {
		if e.Seqno != uint64(27+i) {
			t.Fatalf("after the overflow: %+v", ev)
		}
	}
	if snap, err = c.PrefixSnapshot(true); err != nil || len(snap) != 0 {
		t.Fatalf("an empty index: %+v, %v", snap, err)
	}
	must(t, c.Check())
	if _, err := c.TakeEvents(-1, false); !errors.Is(err, ErrInvalid) {
		t.Fatalf("max -1: %v", err)
	}

	// EventCapacity 0: nothing recorded; a snapshot works all the same
	cfg = DefaultConfig()
	cfg.NBlocks, cfg.NThreads = 8, 1
	c0, err := NewCache(cfg)
	must(t, err)
	defer c0.Close()
	if _, err := c0.TakeEvents(1024, false); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "event_capacity 0") {
		t.Fatalf("EventCapacity 0: %v", err)
	}
	s, err = c0.SeqCreate(nil)
	must(t, err)
	_, err = c0.Append(s, seq(0, 40))
	must(t, err)
	must(t, c0.Commit(s, 40))
	snap, err = c0.PrefixSnapshot(false)
	must(t, err)
	h, err = PrefixHashes(nil, 16, seq(0, 40))
	must(t, err)
	if len(snap) != 2 || snap[0].Hash != h[0] || snap[1].Hash != h[1] || snap[1].ParentHash != h[0] {
		t.Fatalf("snapshot %+v, hashes %v", snap, h)
	}

	// PrefixHashes' refusals
	for _, bt := range []uint32{0, 1025, math.MaxUint32} {
		if _, err := PrefixHashes(nil, bt, []int32{1, 2}); !errors.Is(err, ErrInvalid) {
			t.Fatalf("block_tokens %d: %v", bt, err)
		}
	}
	long := make([]byte, 257)
	if _, err := PrefixHashes(long, 2, []int32{1, 2}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a salt of 257 bytes: %v", err)
	}
	if h, err := PrefixHashes(long[:256], 2, []int32{1, 2, 3}); err != nil || len(h) != 1 {
		t.Fatalf("a salt of 256 bytes: %v, %v", h, err)
	}
	if h, err := PrefixHashes(nil, 16, nil); err != nil || len(h) != 0 {
		t.Fatalf("no tokens: %v, %v", h, err)
	}

	// a closed or nil cache
	c.Close()
	if _, err := c.TakeEvents(1, false); !errors.Is(err, ErrClosed) {
		t.Fatalf("closed: %v", err)
	}
	if _, err := c.PrefixSnapshot(false); !errors.Is(err, ErrClosed) {
		t.Fatalf("closed: %v", err)
	}
	var nilc *Cache
	if _, err := nilc.TakeEvents(1, false); !errors.Is(err, ErrClosed) {
		t.Fatalf("nil: %v", err)
	}
	if _, err := nilc.PrefixSnapshot(false); !errors.Is(err, ErrClosed) {
		t.Fatalf("nil: %v", err)
	}
}

// treeReference is the float64 reference of node i of a tree whose nodes are at positions
// [qStart, ..) of K, V ([T][h][d], gathered): its keys are the prefix [0, qStart) and its path,
// root first, in text order (the path's nodes at qStart + depth), so reference's window counts
// back from the node's own position qStart + depth(i), as pkv_attn_tree's does.
func treeReference(q, k, v []float32, hq, h, d, qStart int, parent []int32, i int, scale, capv float64, window int) ([]float64, []float64) {
	var path []int
	for j := int32(i); j >= 0; j = parent[j] {
		path = append([]int{qStart + int(j)}, path...)
	}
	row := h * d
	var ks, vs []float32
	for p := 0; p < qStart+len(path); p++ {
		at := p
		if p >= qStart {
			at = path[p-qStart]
		}
		ks = append(ks, k[at*row:(at+1)*row]...)
		vs = append(vs, v[at*row:(at+1)*row]...)
	}
	return reference(q, ks, vs, hq, h, d, scale, capv, window)
}

// TestTreeAndKeep: Tree (pkv_attn_tree) against the float64 reference over each node's keys (a
// prefix of 37 tokens and a tree of 9 nodes with branches and two roots, beside a request of
// another sequence and an empty one; GQA; window, soft-cap, scale, sinks, lse); a chain against
// Prefill; the refusals (out as q among them), which write nothing; Keep (pkv_seq_keep) of the
// accepted path: the length start + 3 and the K/V of start + idx[k] at start + k, a refused Keep
// changing nothing; and the locks: Keep waits for a read of its sequence, as Truncate does, and
// Tree for a change of its sequences, not of others.
func TestTreeAndKeep(t *testing.T) {
	r := rng(0x7ee5eed)
	const h, d, hq = 2, 32, 4
	const row = hq * d
	const P, P2 = 37, 20 // the prefixes, committed
	c := newCache(t, h, d, 64, F32)
	s, err := c.SeqCreate(nil)
	must(t, err)
	s2, err := c.SeqCreate(nil)
	must(t, err)
	fill(t, c, s, P, &r)
	fill(t, c, s2, P2, &r)
	// the trees: s's 9 nodes at 37 .. 45, roots 0 and 4, branches at 0 (1, 2) and 2 (5, ...);
	// s2's 3 at 20 .. 22
	parent := []int32{-1, 0, 0, 1, -1, 2, 4, 3, 5}
	parent2 := []int32{-1, 0, 0}
	for _, x := range []struct {
		s Seq
		n int
	}{{s, len(parent)}, {s2, len(parent2)}} {
		info, err := c.SeqInfo(x.s)
		must(t, err)
		toks := make([]int32, x.n)
		for i := range toks {
			toks[i] = int32(900 + i)
		}
		_, err = c.Append(x.s, toks)
		must(t, err)
		must(t, c.WriteKVSeq(x.s, 0, info.NTokens, r.vec(x.n*h*d), r.vec(x.n*h*d)))
	}
	n := len(parent)
	length := P + n
	k, v, err := c.Gather(s, 0, 0, uint32(length))
	must(t, err)
	k2, v2, err := c.Gather(s2, 0, 0, uint32(P2+len(parent2)))
	must(t, err)
	reqs := []TreeReq{{s, P, parent}, {s2, 5, nil}, {s2, P2, parent2}}
	rows := len(parent) + len(parent2)
	q := r.vec(rows * row)
	sinks := make([]float32, hq)
	for i := range sinks {
		sinks[i] = 1 + r.next()
	}
	for _, x := range []struct {
		scale, capv float32
		window      uint32
		sinks       bool
	}{{0, 0, 0, false}, {0, 0, 3, false}, {0.3, 6, 0, false}, {0, 0, 38, true}, {0, 0, 0, true}} {
		what := fmt.Sprintf("Tree scale %g softcap %g window %d sinks %v", x.scale, x.capv, x.window, x.sinks)
		p := AttnParams{NQHeads: hq, Scale: x.scale, Softcap: x.capv, Window: x.window}
		if x.sinks {
			p.Sinks = sinks
		}
		out, lse := make([]float32, rows*row), make([]float32, rows*hq)
		must(t, c.Tree(0, reqs, q, out, p, lse))
		sc := 1 / math.Sqrt(d)
		if x.scale > 0 {
			sc = float64(x.scale)
		}
		at := 0
		for _, tr := range []struct {
			par    []int32
			q0     int
			kk, vv []float32
		}{{parent, P, k, v}, {parent2, P2, k2, v2}} {
			for i := range tr.par {
				w, wl := treeReference(q[at*row:(at+1)*row], tr.kk, tr.vv, hq, h, d, tr.q0, tr.par, i, sc,
					float64(x.capv), int(x.window))
				if x.sinks {
					// one more key of logit sinks[h] and value 0: out scaled by e^lse / (e^lse +
					// e^sink), lse the log of that sum
					for hh := range wl {
						sk := float64(sinks[hh])
						m := math.Max(wl[hh], sk)
						l2 := m + math.Log(math.Exp(wl[hh]-m)+math.Exp(sk-m))
						for j := hh * d; j < (hh+1)*d; j++ {
							w[j] *= math.Exp(wl[hh] - l2)
						}
						wl[hh] = l2
					}
				}
				node := fmt.Sprintf("%s: node %d at %d", what, i, tr.q0+i)
				assertClose(t, out[at*row:(at+1)*row], w, 1e-5, node)
				assertClose(t, lse[at*hq:(at+1)*hq], wl, 1e-5, node+" lse")
				at++
			}
		}
	}

	// a chain is what Prefill gives over the same positions
	chain := make([]int32, n)
	for i := range chain {
		chain[i] = int32(i) - 1
	}
	p := AttnParams{NQHeads: hq}
	qn := q[:n*row]
	ot, lt, op, lp := make([]float32, n*row), make([]float32, n*hq), make([]float32, n*row), make([]float32, n*hq)
	must(t, c.Tree(0, []TreeReq{{s, P, chain}}, qn, ot, p, lt))
	must(t, c.Prefill(0, []AttnReq{{s, P, uint32(n)}}, qn, op, p, lp))
	f64s := func(x []float32) []float64 {
		y := make([]float64, len(x))
		for i := range x {
			y[i] = float64(x[i])
		}
		return y
	}
	assertClose(t, ot, f64s(op), 1e-5, "chain against Prefill")
	assertClose(t, lt, f64s(lp), 1e-5, "chain against Prefill: lse")

	// refusals: EINVAL (ENOENT for a stale sequence), out and lse untouched
	out, lse := make([]float32, n*row), make([]float32, n*hq)
	for i := range out {
		out[i] = 7
	}
	for i := range lse {
		lse[i] = 7
	}
	untouched := func(what string) {
		t.Helper()
		for _, x := range append(append([]float32(nil), out...), lse...) {
			if x != 7 {
				t.Fatalf("%s: a refusal wrote out or lse", what)
			}
		}
	}
	for _, b := range []struct {
		i   int
		bad int32
	}{{3, 3}, {3, 5}, {3, -2}, {8, 8}, {0, 0}} {
		par := append([]int32(nil), parent...)
		par[b.i] = b.bad
		err := c.Tree(0, []TreeReq{{s, P, par}}, qn, out, p, lse)
		if code(err) != EINVAL || !strings.HasPrefix(err.Error(), "pkv_attn_tree: ") ||
			!strings.Contains(err.Error(), fmt.Sprintf("node %d's parent %d is not in", b.i, b.bad)) {
			t.Fatalf("parent[%d] = %d: %v", b.i, b.bad, err)
		}
		untouched(fmt.Sprintf("parent[%d] = %d", b.i, b.bad))
	}
	// nodes at 38 .. 46: past the length
	if err := c.Tree(0, []TreeReq{{s, P + 1, parent}}, qn, out, p, lse); code(err) != EINVAL ||
		!strings.Contains(err.Error(), "past the sequence's length 46") {
		t.Fatal("nodes past the length:", err)
	}
	untouched("nodes past the length")
	// out may not be q (unlike Decode and Prefill): libpkv refuses, q untouched
	qc := append([]float32(nil), qn...)
	if err := c.Tree(0, []TreeReq{{s, P, parent}}, qc, qc, p, nil); code(err) != EINVAL {
		t.Fatal("out as q:", err)
	}
	if !sameBits(qc, qn) {
		t.Fatal("out as q: a refusal wrote q")
	}
	// more than TreeMaxNodes nodes (all roots)
	many := make([]int32, TreeMaxNodes+1)
	for i := range many {
		many[i] = -1
	}
	qm, om := make([]float32, len(many)*row), make([]float32, len(many)*row)
	if err := c.Tree(0, []TreeReq{{s, 0, many}}, qm, om, p, nil); code(err) != EINVAL ||
		!strings.Contains(err.Error(), "PKV_TREE_MAX_NODES") {
		t.Fatal("more than TreeMaxNodes nodes:", err)
	}
	// the binding's own length checks: q, out, lse, sinks for the nodes' count
	one := []TreeReq{{s, P, parent}}
	for _, b := range []struct {
		what string
		err  error
	}{
		{"Tree: q: ", c.Tree(0, one, qn[1:], out, p, nil)},
		{"Tree: out: ", c.Tree(0, one, qn, out[1:], p, nil)},
		{"Tree: lse: ", c.Tree(0, one, qn, out, p, lse[1:])},
		{"Tree: sinks: ", c.Tree(0, one, qn, out, AttnParams{NQHeads: hq, Sinks: sinks[1:]}, nil)},
	} {
		if code(b.err) != EINVAL || !strings.HasPrefix(b.err.Error(), b.what) {
			t.Fatalf("%s: %v", b.what, b.err)
		}
	}
	untouched("the length checks")
	// a stale sequence; no requests
	gone, err := c.SeqCreate(nil)
	must(t, err)
	must(t, c.Release(gone))
	if err := c.Tree(0, []TreeReq{{gone, 0, nil}}, []float32{}, []float32{}, p, nil); code(err) != ENOENT {
		t.Fatal("a stale sequence:", err)
	}
	must(t, c.Tree(0, nil, nil, nil, p, nil))

	// Keep: refusals first, each changing nothing
	same := func(what string) {
		t.Helper()
		info, err := c.SeqInfo(s)
		must(t, err)
		if info.NTokens != uint32(length) || info.NCommitted != P {
			t.Fatalf("%s: length %d committed %d", what, info.NTokens, info.NCommitted)
		}
		k1, v1, err := c.Gather(s, 0, 0, uint32(length))
		must(t, err)
		if !sameBits(k1, k) || !sameBits(v1, v) {
			t.Fatalf("%s: a refused Keep changed K/V", what)
		}
	}
	for _, b := range []struct {
		what  string
		start uint32
		idx   []uint32
	}{
		{"not strictly ascending", P, []uint32{0, 2, 2}},
		{"descending", P, []uint32{2, 0, 5}},
		{"past the length", P, []uint32{0, 2, 9}},
		{"a committed position", P - 1, []uint32{0, 2, 5}},
	} {
		if err := c.Keep(s, b.start, b.idx); code(err) != EINVAL || !strings.HasPrefix(err.Error(), "pkv_seq_keep: ") {
			t.Fatalf("Keep %s: %v", b.what, err)
		}
		same("Keep " + b.what)
	}
	if err := c.Keep(gone, P, []uint32{0}); code(err) != ENOENT {
		t.Fatal("Keep of a stale sequence:", err)
	}
	same("Keep of a stale sequence")
	// the accepted path 0 -> 2 -> 5
	idx := []uint32{0, 2, 5}
	must(t, c.Keep(s, P, idx))
	info, err := c.SeqInfo(s)
	must(t, err)
	if info.NTokens != P+uint32(len(idx)) || info.NCommitted != P {
		t.Fatalf("after Keep: length %d committed %d", info.NTokens, info.NCommitted)
	}
	k1, v1, err := c.Gather(s, 0, 0, info.NTokens)
	must(t, err)
	const kv = h * d
	if !sameBits(k1[:P*kv], k[:P*kv]) || !sameBits(v1[:P*kv], v[:P*kv]) {
		t.Fatal("Keep changed the prefix")
	}
	for j, i := range idx {
		at, from := (P+j)*kv, (P+int(i))*kv
		if !sameBits(k1[at:at+kv], k[from:from+kv]) || !sameBits(v1[at:at+kv], v[from:from+kv]) {
			t.Fatalf("position %d: not what position %d held", P+j, P+int(i))
		}
	}
	// the sequence reads as one written with the path: decode at its last position
	qd, od := r.vec(row), make([]float32, row)
	must(t, c.Decode(0, []Seq{s}, qd, od, p, nil))
	w, _ := reference(qd, k1, v1, hq, h, d, 1/math.Sqrt(d), 0, 0)
	assertClose(t, od, w, 1e-5, "decode after Keep")

	// the locks: Keep holds s alone and the rows lock, as Truncate does; Tree reads its sequences
	kept := uint32(P + len(idx))
	treeOf := func(x Seq, q0 uint32, m int) call {
		return call{fmt.Sprintf("Tree(%v)", x), func() error {
			ch := make([]int32, m)
			for i := range ch {
				ch[i] = int32(i) - 1
			}
			return c.Tree(0, []TreeReq{{x, q0, ch}}, q[:m*row], make([]float32, m*row), p, nil)
		}}
	}
	keepS := call{"Keep(s)", func() error { return c.Keep(s, kept, nil) }} // n 0: truncates to start, the length
	_, held, err := c.enter(readKV, s)                                     // a read of s (attention over s)
	must(t, err)
	goOn(t, "a read of s", treeOf(s, P, len(idx)), treeOf(s2, P2, len(parent2)))
	waitOn(t, "a read of s", held.exit, keepS)
	_, held, err = c.enter(moveRows, s) // what Keep(s) holds
	must(t, err)
	goOn(t, "a Keep(s)", treeOf(s2, P2, len(parent2)))
	waitOn(t, "a Keep(s)", held.exit, treeOf(s, P, len(idx)))
	_, held, err = c.enter(access{rows: useShared}) // a WriteKVShared in flight
	must(t, err)
	goOn(t, "a WriteKVShared", treeOf(s, P, len(idx)))
	waitOn(t, "a WriteKVShared", held.exit, keepS)
	// an empty idx truncates to start
	must(t, c.Keep(s, P+1, []uint32{}))
	info, err = c.SeqInfo(s)
	must(t, err)
	if info.NTokens != P+1 {
		t.Fatalf("Keep(s, start, []): length %d, want %d", info.NTokens, P+1)
	}
	must(t, c.Check())
}

// Forks of a 560-token prompt decoded together read their 35 shared blocks once for all three
// (Stats.AttnSharedKeys: 2 x 560 positions, past the default 512); each output and lse is the
// one decoded alone, which shares nothing.
func TestSharedPrefixDecode(t *testing.T) {
	r := rng(7)
	const h, d, hq = 2, 64, 8
	c := newCache(t, h, d, 64, F32)
	s, err := c.SeqCreate(nil)
	must(t, err)
	for n := 0; n < 560; n += 16 {
		fill(t, c, s, 16, &r)
	}
	seqs := []Seq{s}
	for i := 0; i < 2; i++ {
		f, err := c.Fork(s)
		must(t, err)
		seqs = append(seqs, f)
	}
	for _, x := range seqs {
		fill(t, c, x, 1, &r)
	}
	q := r.vec(3 * hq * d)
	out, lse := make([]float32, len(q)), make([]float32, 3*hq)
	p := AttnParams{NQHeads: hq}
	must(t, c.Decode(0, seqs, q, out, p, lse))
	st, err := c.Stats()
	must(t, err)
	if st.AttnSharedKeys != 2*560 {
		t.Fatal("AttnSharedKeys", st.AttnSharedKeys, "want", 2*560)
	}
	for i, x := range seqs {
		o1, l1 := make([]float32, hq*d), make([]float32, hq)
		must(t, c.Decode(0, []Seq{x}, q[i*hq*d:(i+1)*hq*d], o1, p, l1))
		assertClose(t, out[i*hq*d:(i+1)*hq*d], toF64(o1), 1e-5, "shared-prefix decode")
		assertClose(t, lse[i*hq:(i+1)*hq], toF64(l1), 1e-5, "shared-prefix lse")
	}
	st2, err := c.Stats()
	must(t, err)
	if st2.AttnSharedKeys != st.AttnSharedKeys {
		t.Fatal("a decode of one sequence counted shared positions")
	}
}

// PrefillMasked: an extend of 30 queries from 10 over 40 positions, causal with a bidirectional
// span [20, 32), one row empty, beside a request left causal, each query against the reference
// over the keys its row sets; non-causal rows of the sequence's length; PackMask's bit order; a
// short mask, a count of masks other than the requests' and a window with a mask are EINVAL, out
// untouched.
func TestPrefillMasked(t *testing.T) {
	r := rng(11)
	const h, d, hq = 2, 64, 4
	c, s, k, v := fortyTokens(t, &r)
	if got := PackMask([]bool{true, false, false, true, false, false, false, false, true}); len(got) != 2 ||
		got[0] != 9 || got[1] != 1 {
		t.Fatalf("PackMask: %v", got)
	}
	pick := func(x []float32, seen []int) []float32 {
		var o []float32
		for _, p := range seen {
			o = append(o, x[p*h*d:(p+1)*h*d]...)
		}
		return o
	}
	const q0, nq, kv = 10, 30, 40
	want := make([]bool, nq*kv)
	for j := 0; j < nq; j++ {
		p := q0 + j
		for key := 0; key < kv; key++ {
			span := p >= 20 && p < 32 && key >= 20 && key < 32
			want[j*kv+key] = j != 7 && (key <= p || span)
		}
	}
	mask := PackMask(want)
	reqs := []AttnReq{{Seq: s, QStart: q0, NQ: nq}, {Seq: s, QStart: 30, NQ: 5}}
	q := r.vec((nq + 5) * hq * d)
	out := make([]float32, (nq+5)*hq*d)
	ap := AttnParams{NQHeads: hq}
	must(t, c.PrefillMasked(0, reqs, [][]byte{mask, nil}, q, out, ap, nil))
	for j := 0; j < nq+5; j++ {
		var seen []int
		for key := 0; key < kv; key++ {
			if (j < nq && want[j*kv+key]) || (j >= nq && key <= 30+j-nq) {
				seen = append(seen, key)
			}
		}
		oj := out[j*hq*d : (j+1)*hq*d]
		if len(seen) == 0 {
			for _, x := range oj {
				if x != 0 {
					t.Fatalf("query %d sees nothing: out %g", j, x)
				}
			}
			continue
		}
		w, _ := reference(q[j*hq*d:(j+1)*hq*d], pick(k, seen), pick(v, seen), hq, h, d, 1/math.Sqrt(d), 0, 0)
		assertClose(t, oj, w, 1e-5, fmt.Sprintf("masked query %d", j))
	}
	// non-causal: 12 queries, rows of 40 bits
	nm := make([]bool, 12*40)
	for i := range nm {
		nm[i] = i%40 == 0 || r.vec(1)[0] > 0
	}
	on := make([]float32, 12*hq*d)
	must(t, c.PrefillMasked(0, []AttnReq{{Seq: s, QStart: 0, NQ: 12}}, [][]byte{PackMask(nm)}, q[:12*hq*d], on,
		AttnParams{NQHeads: hq, NonCausal: true}, nil))
	for j := 0; j < 12; j++ {
		var seen []int
		for key := 0; key < 40; key++ {
			if nm[j*40+key] {
				seen = append(seen, key)
			}
		}
		w, _ := reference(q[j*hq*d:(j+1)*hq*d], pick(k, seen), pick(v, seen), hq, h, d, 1/math.Sqrt(d), 0, 0)
		assertClose(t, on[j*hq*d:(j+1)*hq*d], w, 1e-5, fmt.Sprintf("non-causal masked query %d", j))
	}
	keep := append([]float32(nil), out...)
	for i, bad := range []func() error{
		func() error { return c.PrefillMasked(0, reqs, [][]byte{mask[:len(mask)-1], nil}, q, out, ap, nil) },
		func() error { return c.PrefillMasked(0, reqs, [][]byte{mask}, q, out, ap, nil) },
		func() error {
			return c.PrefillMasked(0, reqs, [][]byte{mask, nil}, q, out, AttnParams{NQHeads: hq, Window: 8}, nil)
		},
	} {
		if err := bad(); code(err) != EINVAL {
			t.Fatalf("refusal %d: %v", i, err)
		}
	}
	for i := range out {
		if math.Float32bits(out[i]) != math.Float32bits(keep[i]) {
			t.Fatalf("a refusal wrote out[%d]", i)
		}
	}
}

// TestShift: the context shift (pkv_seq_shift). K written as RoPE(raw, position) by the test's
// own RoPE (float64); 9 positions removed after 4 kept: each K row reads RoPE(raw, its new
// position), V moved bit for bit; without a rope rows move as stored; refusals.
func TestShift(t *testing.T) {
	const h, d = 2, 32
	rr := rng(0x5e1f7)
	r := &rr
	rope := func(x []float32, pos int) []float64 { // neox pairs (i, i + d/2) of each kv head's row
		y := toF64(x)
		for hh := 0; hh < h; hh++ {
			for i := 0; i < d/2; i++ {
				a := float64(pos) * math.Pow(10000, -2*float64(i)/d)
				u, w := float64(x[hh*d+i]), float64(x[hh*d+i+d/2])
				y[hh*d+i] = u*math.Cos(a) - w*math.Sin(a)
				y[hh*d+i+d/2] = u*math.Sin(a) + w*math.Cos(a)
			}
		}
		return y
	}
	c := newCache(t, h, d, 64, F32)
	s, err := c.SeqCreate(nil)
	must(t, err)
	toks := make([]int32, 30)
	for i := range toks {
		toks[i] = int32(i)
	}
	_, err = c.Append(s, toks)
	must(t, err)
	raw := make([][]float32, 30)
	v := r.vec(30 * h * d)
	for p := 0; p < 30; p++ {
		raw[p] = r.vec(h * d)
		k := make([]float32, h*d)
		for i, x := range rope(raw[p], p) {
			k[i] = float32(x)
		}
		must(t, c.WriteKVSeq(s, 0, uint32(p), k, v[p*h*d:(p+1)*h*d]))
	}
	must(t, c.Commit(s, 30))
	must(t, c.Shift(s, 4, 13, &Rope{NRot: d, Style: RopeNeox, Theta: 10000}))
	k2, v2, err := c.Gather(s, 0, 0, 21)
	must(t, err)
	for p := 0; p < 21; p++ {
		o := p
		if p >= 4 {
			o = p + 9
		}
		assertClose(t, k2[p*h*d:(p+1)*h*d], rope(raw[o], p), 1e-5, fmt.Sprintf("K at %d", p))
		for i := 0; i < h*d; i++ {
			if v2[p*h*d+i] != v[o*h*d+i] {
				t.Fatalf("V at %d value %d: %g, want %g", p, i, v2[p*h*d+i], v[o*h*d+i])
			}
		}
	}
	must(t, c.Shift(s, 0, 1, nil)) // moved as stored
	k3, _, err := c.Gather(s, 0, 0, 20)
	must(t, err)
	for i := range k3 {
		if k3[i] != k2[h*d+i] {
			t.Fatalf("K moved as stored, value %d: %g, want %g", i, k3[i], k2[h*d+i])
		}
	}
	if code(c.Shift(s, 10, 5, nil)) != EINVAL || code(c.Shift(s, 1, 2, &Rope{NRot: d, Theta: 1, InvFreq: make([]float32, 3)})) != EINVAL ||
		code(c.Shift(s, 1, 2, &Rope{NRot: 31, Theta: 10000})) != EINVAL {
		t.Fatal("a refusal was taken")
	}
	info, err := c.SeqInfo(s)
	must(t, err)
	if info.NTokens != 20 {
		t.Fatalf("%d positions after the refusals, want 20", info.NTokens)
	}
	must(t, c.Check())
}
