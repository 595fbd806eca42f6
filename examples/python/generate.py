"""generate.py: a Python inference engine over pagedkv, in one page of numpy.

Runs a llama2.c checkpoint (e.g. ../shared/models/stories260K.bin) greedily for several prompts
at once: each prompt in turn is matched against the prefix cache (so prompts that share a
prefix compute it once), its remaining tokens prefilled and committed, then every sequence
decodes one token a step in one batched pkv_attn_decode call per layer. The model's matmuls, RoPE, norms
and MLP are numpy; the K/V cache and attention are libpkv's. Prints each sequence's generated
token ids on one line, as `pkv run -t 0` does for the same prompts (test_python checks that
the two agree).

usage: PYTHONPATH=python python3 examples/python/generate.py MODEL [-n STEPS] [--prompt-ids IDS]
       IDS: comma-separated token ids, several prompts separated by ';' [1]
"""

import argparse
import sys

import numpy as np

import pagedkv


class Llama2c:
    """llama2.c (v0) checkpoint: a 7-int header, then float32 weights in its fixed order."""

    def __init__(self, path):
        with open(path, "rb") as f:
            hdr = np.frombuffer(f.read(28), dtype=np.int32)
            w = np.frombuffer(f.read(), dtype=np.float32)
        dim, hidden, L, nh, nkv, vocab, self.seq_len = (int(x) for x in hdr)
        shared, vocab = vocab > 0, abs(vocab)
        self.dim, self.L, self.nh, self.nkv, self.vocab = dim, L, nh, nkv, vocab
        hs = self.hs = dim // nh
        kv = nkv * hs
        at = 0

        def take(*shape):
            nonlocal at
            n = int(np.prod(shape))
            a = w[at:at + n].reshape(shape)
            at += n
            return a

        self.emb = take(vocab, dim)
        self.rms_att = take(L, dim)
        self.wq, self.wk, self.wv = take(L, dim, dim), take(L, kv, dim), take(L, kv, dim)
        self.wo = take(L, dim, dim)
        self.rms_ffn = take(L, dim)
        self.w1, self.w2, self.w3 = take(L, hidden, dim), take(L, dim, hidden), take(L, hidden, dim)
        self.rms_final = take(dim)
        take(self.seq_len, hs)  # freq_cis_real and _imag (llama2.c: unused)
        self.wcls = self.emb if shared else take(vocab, dim)
        if at != w.size:
            raise ValueError("%s: %d floats, the header needs %d" % (path, w.size, at))

    @staticmethod
    def rmsnorm(x, w):
        return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(1e-5)))

    def rope(self, x, pos):
        """llama2.c's RoPE on x [T][heads * hs]: pairs (2i, 2i+1) of each head rotated."""
        j = np.arange(0, self.hs, 2, dtype=np.float32)
        ang = pos[:, None].astype(np.float32) * (np.float32(1.0) / np.float32(10000.0) ** (j / np.float32(self.hs)))
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x = x.reshape(len(pos), -1, self.hs // 2, 2)
        x0, x1 = x[..., 0], x[..., 1]
        return np.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(len(pos), -1)

    def forward(self, tokens, pos, attend):
        """The final hidden states [T][dim] of tokens [T] at positions pos [T];
        attend(layer, q [T][nh][hs], k, v [T][nkv][hs]) writes K/V and returns attention [T][dim]."""
        x = self.emb[tokens]
        for l in range(self.L):
            xb = self.rmsnorm(x, self.rms_att[l])
            q = self.rope(xb @ self.wq[l].T, pos).reshape(-1, self.nh, self.hs)
            k = self.rope(xb @ self.wk[l].T, pos).reshape(-1, self.nkv, self.hs)
            v = (xb @ self.wv[l].T).reshape(-1, self.nkv, self.hs)
            x = x + attend(l, q, k, v).reshape(-1, self.dim) @ self.wo[l].T
            xb = self.rmsnorm(x, self.rms_ffn[l])
            h1, h3 = xb @ self.w1[l].T, xb @ self.w3[l].T
            x = x + (h1 / (1 + np.exp(-h1)) * h3) @ self.w2[l].T
        return x


def generate(model, prompts, steps, block_tokens=16):
    """Greedy generation for every prompt up to `steps` positions (prompt included); stops a
    sequence at BOS (1). Returns the generated ids per prompt, and the cache's stats."""
    if any(not p or len(p) > steps for p in prompts):
        raise ValueError("every prompt needs 1 to %d tokens (steps)" % steps)
    n_blocks = len(prompts) * (-(-steps // block_tokens) + 1)
    with pagedkv.Cache(n_layers=model.L, n_kv_heads=model.nkv, head_dim=model.hs, block_tokens=block_tokens,
                       n_blocks=n_blocks, k_dtype="f32", v_dtype="f32", n_threads=1) as c:
        seqs, nxt = [], []
        for p in prompts:  # one after the other, so a later prompt reuses an earlier one's blocks
            s = c.seq_create()
            reused = c.match_prefix(s, p)
            slots = c.append(s, p[reused:])
            req = [(s, reused, len(p) - reused)]

            def prefill(l, q, k, v):
                c.write_kv(l, slots, k, v)
                return c.prefill(l, req, q)

            x = model.forward(np.array(p[reused:]), np.arange(reused, len(p)), prefill)
            c.commit(s, len(p))
            seqs.append(s)
            nxt.append(int(np.argmax(model.rmsnorm(x[-1], model.rms_final) @ model.wcls.T)))
        out = [[] for _ in prompts]
        live = [i for i in range(len(prompts)) if len(prompts[i]) <= steps]
        while live:
            live = [i for i in live if nxt[i] != 1]
            for i in live:
                out[i].append(int(nxt[i]))
            live = [i for i in live if len(prompts[i]) + len(out[i]) <= steps]
            if not live:
                break
            batch = [seqs[i] for i in live]
            step_slots = np.concatenate([c.append(s, [nxt[i]]) for s, i in zip(batch, live)])

            def decode(l, q, k, v):
                c.write_kv(l, step_slots, k, v)
                return c.decode(l, batch, q)

            p = np.array([c.seq_info(s).n_tokens - 1 for s in batch])
            x = model.forward(np.array([nxt[i] for i in live]), p, decode)
            for s in batch:
                c.commit(s, c.seq_info(s).n_tokens)
            logits = model.rmsnorm(x, model.rms_final) @ model.wcls.T
            for i, t in zip(live, np.argmax(logits, -1)):
                nxt[i] = int(t)
        c.check()
        return out, c.stats()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=32, help="positions per sequence, prompt included [32]")
    ap.add_argument("--prompt-ids", default="1", help="comma-separated ids, prompts separated by ';' [1]")
    a = ap.parse_args()
    prompts = [[int(t) for t in p.split(",")] for p in a.prompt_ids.split(";")]
    if any(not p or len(p) > a.n for p in prompts):
        print("generate.py: every prompt needs 1 to %d tokens (-n)" % a.n, file=sys.stderr)
        return 1
    out, st = generate(Llama2c(a.model), prompts, a.n)
    for ids in out:
        print(" ".join(map(str, ids)))
    print("generate.py: %d sequences, %d tokens generated; %d of %d prompt tokens reused from the prefix cache"
          % (len(out), sum(map(len, out)), st["prefix_tokens_hit"], st["prefix_tokens_queried"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
