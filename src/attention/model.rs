//! [`TinyModel`]: a seeded random-weight attention stack that drives the serve simulation
//! through real K/V writes and real paged attention.
//!
//! Each layer: RMS-normalise the hidden state, project to q/k/v with small matrices, write
//! K/V into the cache through the slot mapping ([`reshape_and_cache`]), run paged
//! attention (ALiBi, so position matters) over the whole context, project back and add
//! to the residual. Tokens come from the embedding table, and the next token is the
//! argmax of the tied unembedding.
//!
//! The attention runs with a fixed `split_tokens`, and every matrix product works row by
//! row, so a request's outputs do not depend on the batch it was scheduled in, on
//! whether its prompt was prefilled in one chunk or several, on the number of threads,
//! or on the allocator (paged or contiguous reservation) that placed its blocks: the
//! same requests give the same bits under any schedule on one machine.

use rayon::prelude::*;

use super::cpu::{paged_decode_split, paged_prefill, reshape_and_cache};
use super::{alibi_slopes, check_paged, AttentionParams};
use crate::error::{Error, Result};
use crate::executor::storage::{HostStorage, Storage};
use crate::ids::BlockId;
use crate::layout::shape::ModelShape;
use crate::layout::Slot;
use crate::tables::PaddedTables;

/// Where a [`TinyModel`] keeps its K/V and runs its attention: the cache write of one
/// layer's new tokens and paged attention over the tables. [`HostStorage`] runs them on
/// the CPU ([`reshape_and_cache`], [`paged_prefill`] and [`paged_decode_split`] with
/// the fixed [`MODEL_SPLIT_TOKENS`]); the serve example's `--backend cuda` runs the CUDA
/// kernels behind the same calls. The model's matrix products stay on the CPU.
pub trait ModelAttention: Storage {
    /// Writes `k` and `v` (`[tokens, kv_heads, head_dim]`, `f32`) of one layer into
    /// `slots`, converting to the cache dtype (fp8 with the scales of `params`).
    ///
    /// # Errors
    /// Shape and slot errors before any write; backend failures.
    fn write_kv(
        &mut self,
        layer: usize,
        slots: &[Slot],
        k: &[f32],
        v: &[f32],
        params: &AttentionParams,
    ) -> Result<()>;

    /// Prefill attention of one layer: the queries of `query_start_loc` (the last
    /// positions of each context) over the cached prefix and themselves, causal, into
    /// `out` (`[tokens, q_heads, head_dim]`).
    ///
    /// # Errors
    /// As [`paged_prefill`].
    fn prefill(
        &mut self,
        layer: usize,
        q: &[f32],
        query_start_loc: &[usize],
        tables: &PaddedTables,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> Result<()>;

    /// Decode attention of one layer: one query per sequence at its last position.
    ///
    /// # Errors
    /// As [`paged_decode_split`].
    fn decode(
        &mut self,
        layer: usize,
        q: &[f32],
        tables: &PaddedTables,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> Result<()>;
}

impl ModelAttention for HostStorage {
    fn write_kv(
        &mut self,
        layer: usize,
        slots: &[Slot],
        k: &[f32],
        v: &[f32],
        params: &AttentionParams,
    ) -> Result<()> {
        reshape_and_cache(self, layer, slots, k, v, params.k_scale, params.v_scale)
    }

    fn prefill(
        &mut self,
        layer: usize,
        q: &[f32],
        query_start_loc: &[usize],
        tables: &PaddedTables,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> Result<()> {
        paged_prefill(
            self,
            layer,
            q,
            query_start_loc,
            tables,
            params,
            Some(MODEL_SPLIT_TOKENS),
            out,
            None,
        )
    }

    fn decode(
        &mut self,
        layer: usize,
        q: &[f32],
        tables: &PaddedTables,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> Result<()> {
        paged_decode_split(
            self,
            layer,
            q,
            tables,
            params,
            MODEL_SPLIT_TOKENS,
            out,
            None,
        )
    }
}

/// Hidden size of [`TinyModel::new`].
pub const DEFAULT_HIDDEN: usize = 128;
/// Vocabulary of [`TinyModel::new`].
pub const DEFAULT_VOCAB: usize = 512;
/// KV split of the model's attention (fixed, so results never depend on the batch).
pub const MODEL_SPLIT_TOKENS: usize = 512;

/// SplitMix64: a tiny, good-enough seeded generator (no `rand` dependency).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `[-a, a)`.
    pub fn uniform(&mut self, a: f32) -> f32 {
        (self.next_f32() * 2.0 - 1.0) * a
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

#[derive(Debug, Clone)]
struct Layer {
    /// `[hidden, q_heads * head_dim]`.
    wq: Vec<f32>,
    /// `[hidden, kv_heads * head_dim]`.
    wk: Vec<f32>,
    /// `[hidden, kv_heads * head_dim]`.
    wv: Vec<f32>,
    /// `[q_heads * head_dim, hidden]`.
    wo: Vec<f32>,
}

/// A small random attention stack over a paged cache.
#[derive(Debug, Clone)]
pub struct TinyModel {
    shape: ModelShape,
    hidden: usize,
    vocab: usize,
    layers: Vec<Layer>,
    /// `[vocab, hidden]`.
    embed: Vec<f32>,
    /// `[hidden, vocab]`: the tied unembedding (`embed` transposed).
    unembed: Vec<f32>,
    params: AttentionParams,
    seed: u64,
}

fn random_matrix(rng: &mut SplitMix64, rows: usize, cols: usize) -> Vec<f32> {
    // Variance 1 / rows keeps activations O(1).
    let a = (3.0 / rows as f32).sqrt();
    (0..rows * cols).map(|_| rng.uniform(a)).collect()
}

/// `y = x . w` for `x` `[rows, k]`, `w` `[k, n]`, rows in blocks of four (each `w` row
/// read once per block). Every output element is summed in the same order (`k`
/// ascending, no fused multiply-add), so results do not depend on the batch, the
/// blocking, the thread count, or whether the AVX2 copy runs.
fn matmul(x: &[f32], w: &[f32], k: usize, n: usize, y: &mut [f32]) {
    const B: usize = 4;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    let block = |(yb, xb): (&mut [f32], &[f32])| {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected at run time.
            unsafe { matmul_block_avx2(yb, xb, w, k, n) };
            return;
        }
        matmul_block(yb, xb, w, k, n);
    };
    let rows = x.len() / k.max(1);
    if rows * k * n >= 1 << 18 {
        y.par_chunks_mut(B * n)
            .zip(x.par_chunks(B * k))
            .for_each(block);
    } else {
        y.chunks_mut(B * n).zip(x.chunks(B * k)).for_each(block);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn matmul_block_avx2(y: &mut [f32], x: &[f32], w: &[f32], k: usize, n: usize) {
    matmul_block(y, x, w, k, n)
}

#[inline(always)]
fn matmul_block(y: &mut [f32], x: &[f32], w: &[f32], k: usize, n: usize) {
    y.fill(0.0);
    if y.len() == 4 * n {
        let (y0, r) = y.split_at_mut(n);
        let (y1, r) = r.split_at_mut(n);
        let (y2, y3) = r.split_at_mut(n);
        for kk in 0..k {
            let wr = &w[kk * n..(kk + 1) * n];
            let (a0, a1, a2, a3) = (x[kk], x[k + kk], x[2 * k + kk], x[3 * k + kk]);
            for j in 0..n {
                let b = wr[j];
                y0[j] += a0 * b;
                y1[j] += a1 * b;
                y2[j] += a2 * b;
                y3[j] += a3 * b;
            }
        }
    } else {
        for (yr, xr) in y.chunks_mut(n).zip(x.chunks(k)) {
            for (kk, &a) in xr.iter().enumerate() {
                let wr = &w[kk * n..(kk + 1) * n];
                for (o, &b) in yr.iter_mut().zip(wr) {
                    *o += a * b;
                }
            }
        }
    }
}

fn rms_norm(x: &[f32], h: usize, out: &mut [f32]) {
    for (o, r) in out.chunks_mut(h).zip(x.chunks(h)) {
        let ms = r.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for (a, &b) in o.iter_mut().zip(r) {
            *a = b * inv;
        }
    }
}

impl TinyModel {
    /// A model of `shape` (used as given: scale a real shape down first, see
    /// [`Self::scaled_shape`]) with [`DEFAULT_HIDDEN`] and [`DEFAULT_VOCAB`], weights drawn
    /// from `seed`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid shape.
    pub fn new(shape: ModelShape, seed: u64) -> Result<Self> {
        Self::with_dims(shape, DEFAULT_HIDDEN, DEFAULT_VOCAB, seed)
    }

    /// A model with an explicit hidden size and vocabulary.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid shape, or a hidden size or vocabulary of 0.
    pub fn with_dims(shape: ModelShape, hidden: usize, vocab: usize, seed: u64) -> Result<Self> {
        shape.validate()?;
        if hidden == 0 {
            return Err(Error::config("hidden", "must be positive"));
        }
        if vocab == 0 || vocab > u32::MAX as usize {
            return Err(Error::config("vocab", format!("{vocab} is out of range")));
        }
        let mut rng = SplitMix64::new(seed);
        let (qd, kvd) = (
            shape.num_q_heads * shape.head_dim,
            shape.num_kv_heads * shape.head_dim,
        );
        let layers = (0..shape.num_layers)
            .map(|_| Layer {
                wq: random_matrix(&mut rng, hidden, qd),
                wk: random_matrix(&mut rng, hidden, kvd),
                wv: random_matrix(&mut rng, hidden, kvd),
                wo: random_matrix(&mut rng, qd, hidden),
            })
            .collect();
        let embed: Vec<f32> = (0..vocab * hidden).map(|_| rng.uniform(1.0)).collect();
        let mut unembed = vec![0f32; vocab * hidden];
        for (v, row) in embed.chunks(hidden).enumerate() {
            for (i, &e) in row.iter().enumerate() {
                unembed[i * vocab + v] = e;
            }
        }
        let mut params = AttentionParams::new(shape.head_dim);
        params.alibi_slopes = Some(alibi_slopes(shape.num_q_heads));
        Ok(TinyModel {
            shape,
            hidden,
            vocab,
            layers,
            embed,
            unembed,
            params,
            seed,
        })
    }

    /// A scaled-down copy of a real shape for simulation: at most 2 layers, head dim 64,
    /// at most 8 query heads, the same GQA ratio where it fits (at least one KV head),
    /// the same dtype.
    pub fn scaled_shape(shape: &ModelShape) -> ModelShape {
        let q = shape.num_q_heads.clamp(1, 8);
        let group = shape.group_size().clamp(1, q);
        let q = q / group * group;
        ModelShape {
            num_layers: shape.num_layers.clamp(1, 2),
            num_q_heads: q,
            num_kv_heads: q / group,
            head_dim: 64,
            kv_dtype: shape.kv_dtype,
        }
    }

    /// The model's shape.
    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// Hidden size.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The attention parameters every layer uses (ALiBi, scale `1/sqrt(head_dim)`).
    pub fn params(&self) -> &AttentionParams {
        &self.params
    }

    /// A deterministic prompt of `len` tokens for request `request` (depends on the
    /// model's seed too).
    pub fn prompt_tokens(&self, request: u64, len: usize) -> Vec<u32> {
        let mut rng = SplitMix64::new(self.seed ^ request.wrapping_mul(0xd134_2543_de82_ef95));
        (0..len)
            .map(|_| rng.below(self.vocab as u64) as u32)
            .collect()
    }

    /// Writes the embeddings of `tokens` into `out` (`[tokens, hidden]`).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a wrong `out` length or a token outside the vocabulary.
    pub fn embed(&self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        let h = self.hidden;
        if out.len() != tokens.len() * h {
            return Err(Error::ShapeMismatch {
                what: "embedding output (tokens * hidden)",
                expected: tokens.len() * h,
                got: out.len(),
            });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::ShapeMismatch {
                what: "token id below the vocabulary size",
                expected: self.vocab,
                got: t as usize,
            });
        }
        for (o, &t) in out.chunks_mut(h).zip(tokens) {
            o.copy_from_slice(&self.embed[t as usize * h..(t as usize + 1) * h]);
        }
        Ok(())
    }

    /// The greedy next token of each hidden row (`[tokens, hidden]`): argmax over the
    /// vocabulary of the tied unembedding of the normalised state (lowest id on ties).
    pub fn next_tokens(&self, hidden: &[f32]) -> Vec<u32> {
        let h = self.hidden;
        let mut normed = vec![0f32; hidden.len()];
        rms_norm(hidden, h, &mut normed);
        let rows = hidden.len() / h;
        let mut logits = vec![0f32; rows * self.vocab];
        matmul(&normed, &self.unembed, h, self.vocab, &mut logits);
        logits
            .chunks(self.vocab)
            .map(|l| {
                let mut best = (0u32, f32::NEG_INFINITY);
                for (v, &s) in l.iter().enumerate() {
                    if s > best.1 {
                        best = (v as u32, s);
                    }
                }
                best.0
            })
            .collect()
    }

    /// [`Self::prefill`] from token ids: embeds `tokens` (`query_start_loc` cuts them into
    /// sequences) and writes the final hidden states (`[tokens, hidden]`) to `hidden_out`.
    ///
    /// # Errors
    /// As [`Self::embed`] and [`Self::prefill`].
    pub fn prefill_tokens<A: ModelAttention + ?Sized>(
        &self,
        storage: &mut A,
        tables: &PaddedTables,
        query_start_loc: &[usize],
        tokens: &[u32],
        hidden_out: &mut [f32],
    ) -> Result<()> {
        let mut x = vec![0f32; tokens.len() * self.hidden];
        self.embed(tokens, &mut x)?;
        self.prefill(storage, tables, query_start_loc, &x, hidden_out)
    }

    /// One decode step from token ids (one per sequence of `tables`): embeds them, runs
    /// [`Self::decode_step`], and returns the next token of each sequence; the final
    /// hidden states go to `hidden_out` (`[batch, hidden]`).
    ///
    /// # Errors
    /// As [`Self::embed`] and [`Self::decode_step`].
    pub fn decode_tokens<A: ModelAttention + ?Sized>(
        &self,
        storage: &mut A,
        tables: &PaddedTables,
        tokens: &[u32],
        hidden_out: &mut [f32],
    ) -> Result<Vec<u32>> {
        let mut x = vec![0f32; tokens.len() * self.hidden];
        self.embed(tokens, &mut x)?;
        self.decode_step(storage, tables, &x, hidden_out)?;
        Ok(self.next_tokens(hidden_out))
    }

    fn check_storage<A: ModelAttention + ?Sized>(&self, storage: &A) -> Result<()> {
        let s = storage.layout().shape();
        let m = &self.shape;
        if (s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim)
            != (m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim)
        {
            return Err(Error::config(
                "storage",
                format!("cache shape {s:?} does not match the model's {m:?}"),
            ));
        }
        Ok(())
    }

    /// Runs the new tokens of a batch through every layer: sequence `i` brings the tokens
    /// `query_start_loc[i]..query_start_loc[i + 1]` of `hidden_in` (`[tokens, hidden]`),
    /// which are the last tokens of its context in `tables` (their slots follow from the
    /// table). Writes their K/V into `storage` and the final hidden states into
    /// `hidden_out`. The engine must have run any copy-on-write plan first.
    ///
    /// # Errors
    /// Before anything is written: [`Error::InvalidConfig`] when the storage does not fit
    /// the model, and the errors of [`paged_prefill`].
    pub fn prefill<A: ModelAttention + ?Sized>(
        &self,
        storage: &mut A,
        tables: &PaddedTables,
        query_start_loc: &[usize],
        hidden_in: &[f32],
        hidden_out: &mut [f32],
    ) -> Result<()> {
        self.forward(
            storage,
            tables,
            query_start_loc,
            false,
            hidden_in,
            hidden_out,
        )
    }

    /// One decode step: one new token per sequence (its hidden state `[batch, hidden]` in
    /// `hidden_in`, its position `context_len - 1`). Writes its K/V into `storage` and the
    /// final hidden states into `hidden_out`. Same result, bit for bit, as
    /// [`Self::prefill`] of that token.
    ///
    /// # Errors
    /// As [`Self::prefill`]; [`Error::InvalidConfig`] for a sequence with no context.
    pub fn decode_step<A: ModelAttention + ?Sized>(
        &self,
        storage: &mut A,
        tables: &PaddedTables,
        hidden_in: &[f32],
        hidden_out: &mut [f32],
    ) -> Result<()> {
        if let Some(i) = tables.context_lens.iter().position(|&c| c == 0) {
            return Err(Error::config(
                "context_lens",
                format!("sequence {i} of the decode batch has no token to decode"),
            ));
        }
        let qsl: Vec<usize> = (0..=tables.batch).collect();
        self.forward(storage, tables, &qsl, true, hidden_in, hidden_out)
    }

    fn forward<A: ModelAttention + ?Sized>(
        &self,
        storage: &mut A,
        tables: &PaddedTables,
        query_start_loc: &[usize],
        decode: bool,
        hidden_in: &[f32],
        hidden_out: &mut [f32],
    ) -> Result<()> {
        self.check_storage(storage)?;
        let layout = *storage.layout();
        check_paged(
            &layout,
            storage.num_blocks(),
            0,
            tables,
            &self.params,
            Some(query_start_loc),
        )?;
        let (h, d) = (self.hidden, self.shape.head_dim);
        let (qd, kvd) = (self.shape.num_q_heads * d, self.shape.num_kv_heads * d);
        let tokens = super::check_prefill_q(
            &layout,
            tables,
            query_start_loc,
            query_start_loc.last().map_or(0, |t| t * qd),
        )?;
        for (what, got) in [
            ("hidden_in (tokens * hidden)", hidden_in.len()),
            ("hidden_out (tokens * hidden)", hidden_out.len()),
        ] {
            if got != tokens * h {
                return Err(Error::ShapeMismatch {
                    what,
                    expected: tokens * h,
                    got,
                });
            }
        }
        // Slots of the new tokens: the last positions of each context.
        let bs = layout.block_size();
        let mut slots = Vec::with_capacity(tokens);
        for i in 0..tables.batch {
            let ctx = tables.context_lens[i] as usize;
            let n = query_start_loc[i + 1] - query_start_loc[i];
            let row = tables.row(i);
            slots.extend((ctx - n..ctx).map(|p| layout.slot(BlockId(row[p / bs]), p % bs)));
        }
        debug_assert!(slots
            .iter()
            .all(|s: &Slot| (s.0 / bs as u64) < storage.num_blocks() as u64));

        let mut x = hidden_in.to_vec();
        let mut xn = vec![0f32; tokens * h];
        let mut q = vec![0f32; tokens * qd];
        let mut k = vec![0f32; tokens * kvd];
        let mut v = vec![0f32; tokens * kvd];
        let mut attn = vec![0f32; tokens * qd];
        let mut proj = vec![0f32; tokens * h];
        for (layer, w) in self.layers.iter().enumerate() {
            rms_norm(&x, h, &mut xn);
            matmul(&xn, &w.wq, h, qd, &mut q);
            matmul(&xn, &w.wk, h, kvd, &mut k);
            matmul(&xn, &w.wv, h, kvd, &mut v);
            storage.write_kv(layer, &slots, &k, &v, &self.params)?;
            if decode {
                storage.decode(layer, &q, tables, &self.params, &mut attn)?;
            } else {
                storage.prefill(layer, &q, query_start_loc, tables, &self.params, &mut attn)?;
            }
            matmul(&attn, &w.wo, qd, h, &mut proj);
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += b;
            }
        }
        hidden_out.copy_from_slice(&x);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_seeded_and_uniform() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        assert_eq!(a.next_u64(), b.next_u64());
        let xs: Vec<f32> = (0..10_000).map(|_| a.next_f32()).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        assert!((mean - 0.5).abs() < 0.02);
        // The reference value of SplitMix64 with seed 0.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn matmul_rows_do_not_depend_on_the_batch() {
        let (k, n) = (37, 21);
        let mut rng = SplitMix64::new(3);
        let w: Vec<f32> = (0..k * n).map(|_| rng.uniform(1.0)).collect();
        let x: Vec<f32> = (0..9 * k).map(|_| rng.uniform(1.0)).collect();
        let mut all = vec![0f32; 9 * n];
        matmul(&x, &w, k, n, &mut all);
        for r in 0..9 {
            let mut one = vec![0f32; n];
            matmul(&x[r * k..(r + 1) * k], &w, k, n, &mut one);
            matmul_block(&mut one, &x[r * k..(r + 1) * k], &w, k, n);
            assert_eq!(one, all[r * n..(r + 1) * n]);
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|i| f64::from(x[r * k + i]) * f64::from(w[i * n + j]))
                    .sum();
                assert!((f64::from(one[j]) - want).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn scaled_shapes_keep_the_group_ratio() {
        let s = ModelShape {
            num_layers: 32,
            num_q_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            kv_dtype: crate::layout::shape::DType::BF16,
        };
        let t = TinyModel::scaled_shape(&s);
        assert_eq!(
            (t.num_layers, t.num_q_heads, t.num_kv_heads, t.head_dim),
            (2, 8, 2, 64)
        );
        let s = ModelShape {
            num_q_heads: 28,
            num_kv_heads: 4,
            ..s
        };
        let t = TinyModel::scaled_shape(&s);
        assert_eq!((t.num_q_heads, t.num_kv_heads), (7, 1));
        t.validate().unwrap();
    }
}
