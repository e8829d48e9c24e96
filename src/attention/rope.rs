//! Rotary position embeddings (RoPE) on query and key rows, and the write of the rotated
//! keys into the paged cache in the same call, as FlashInfer's
//! `append_paged_kv_cache` with RoPE and vLLM's fused `rotary_embedding` +
//! `reshape_and_cache` do.
//!
//! Two conventions pair the dimensions of a head differently:
//!
//! | [`RopeStyle`] | pairs rotated together | used by |
//! |---|---|---|
//! | [`RopeStyle::Interleaved`] | `(2i, 2i + 1)` | GPT-J, GGUF llama weights (llama.cpp's `ROPE_TYPE_NORM`) |
//! | [`RopeStyle::NeoxHalves`] | `(i, i + rotary_dim / 2)` | GPT-NeoX, Hugging Face Llama/Qwen (`rotate_half`) |
//!
//! For position `p` and pair `i` of `rotary_dim / 2`, the angle is
//! `p * theta^(-2i / rotary_dim)` and the pair `(x, y)` becomes
//! `(x cos - y sin, x sin + y cos)`. Dimensions past `rotary_dim` (partial rotary) are
//! left as they are. Angles, cosines and sines are computed in `f64` and rounded once,
//! so long positions lose nothing to an `f32` angle.

use super::cpu::reshape_and_cache;
use crate::error::{Error, Result};
use crate::executor::storage::{HostStorage, Storage};
use crate::layout::Slot;

/// Which dimensions of a head rotate together (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)`.
    Interleaved,
    /// Halves: `(i, i + rotary_dim / 2)`.
    NeoxHalves,
}

/// A rotary embedding for one head dimension.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    head_dim: usize,
    rotary_dim: usize,
    style: RopeStyle,
    /// `theta^(-2i / rotary_dim)` for each pair.
    inv_freq: Vec<f64>,
}

impl Rope {
    /// A rotary embedding over the first `rotary_dim` dimensions of heads of `head_dim`,
    /// with base `theta`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `rotary_dim` is 0, odd or larger than `head_dim`,
    /// or `theta` is not a finite number above 1.
    pub fn new(head_dim: usize, rotary_dim: usize, theta: f64, style: RopeStyle) -> Result<Self> {
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(Error::config(
                "rotary_dim",
                format!("{rotary_dim} must be even, positive and at most head_dim {head_dim}"),
            ));
        }
        if !(theta.is_finite() && theta > 1.0) {
            return Err(Error::config("theta", format!("{theta} must be above 1")));
        }
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| theta.powf(-((2 * i) as f64) / rotary_dim as f64))
            .collect();
        Ok(Rope {
            head_dim,
            rotary_dim,
            style,
            inv_freq,
        })
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rotated dimensions per head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// Pairing convention.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// Index pairs `(a, b)` of pair `i` within a head.
    #[inline]
    fn pair(&self, i: usize) -> (usize, usize) {
        match self.style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::NeoxHalves => (i, i + self.rotary_dim / 2),
        }
    }

    /// Rotates `x`, `[tokens, heads, head_dim]` with `positions[t]` the position of token
    /// `t`, in place.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `x` is not `positions.len() * heads * head_dim`
    /// long; nothing is rotated then.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], heads: usize) -> Result<()> {
        let row = heads * self.head_dim;
        if x.len() != positions.len() * row {
            return Err(Error::ShapeMismatch {
                what: "rotary input (tokens * heads * head_dim)",
                expected: positions.len() * row,
                got: x.len(),
            });
        }
        let mut cs = vec![(0f32, 0f32); self.inv_freq.len()];
        for (xt, &p) in x.chunks_mut(row.max(1)).zip(positions) {
            for (c, f) in cs.iter_mut().zip(&self.inv_freq) {
                let (s, co) = (p as f64 * f).sin_cos();
                *c = (co as f32, s as f32);
            }
            for h in xt.chunks_mut(self.head_dim) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = self.pair(i);
                    let (x0, x1) = (h[a], h[b]);
                    h[a] = x0 * c - x1 * s;
                    h[b] = x0 * s + x1 * c;
                }
            }
        }
        Ok(())
    }
}

/// Rotates the queries `q` (`[tokens, q_heads, head_dim]`) and keys `k`
/// (`[tokens, kv_heads, head_dim]`) of new tokens at `positions` in place, then writes
/// the rotated keys and the values `v` into the cache of `layer` at `slots`, as
/// [`reshape_and_cache`] does: the one call an engine makes per layer before attention.
///
/// Everything is checked before anything changes: on error neither `q`, `k` nor the
/// cache was touched. On the CPU this is one call but two passes (rotate the rows in
/// place, then encode them into the cache); what it fuses is the engine's API: the
/// positions and slots of a step are given once, and no un-rotated key can reach the
/// cache.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the lengths disagree with `positions`, the rope's head
/// dim or the storage's shape; the errors of [`reshape_and_cache`] (bad layer, slot
/// outside the arena, bad scale).
#[allow(clippy::too_many_arguments)]
pub fn rope_and_cache(
    storage: &mut HostStorage,
    layer: usize,
    rope: &Rope,
    positions: &[usize],
    slots: &[Slot],
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    k_scale: f32,
    v_scale: f32,
) -> Result<()> {
    let s = *storage.layout().shape();
    if s.head_dim != rope.head_dim {
        return Err(Error::ShapeMismatch {
            what: "rope head_dim (the cache's head_dim)",
            expected: s.head_dim,
            got: rope.head_dim,
        });
    }
    if slots.len() != positions.len() {
        return Err(Error::ShapeMismatch {
            what: "slots (one per position)",
            expected: positions.len(),
            got: slots.len(),
        });
    }
    let tokens = positions.len();
    for (what, want, got) in [
        (
            "q elements (tokens * q_heads * head_dim)",
            tokens * s.num_q_heads * s.head_dim,
            q.len(),
        ),
        (
            "K elements (tokens * kv_heads * head_dim)",
            tokens * s.num_kv_heads * s.head_dim,
            k.len(),
        ),
        (
            "V elements (tokens * kv_heads * head_dim)",
            tokens * s.num_kv_heads * s.head_dim,
            v.len(),
        ),
    ] {
        if want != got {
            return Err(Error::ShapeMismatch {
                what,
                expected: want,
                got,
            });
        }
    }
    if layer >= s.num_layers {
        return Err(Error::ShapeMismatch {
            what: "layer index",
            expected: s.num_layers,
            got: layer,
        });
    }
    crate::layout::convert::check_scale("k_scale", k_scale)?;
    crate::layout::convert::check_scale("v_scale", v_scale)?;
    let bs = storage.layout().block_size() as u64;
    let num_blocks = storage.num_blocks() as u64;
    if let Some(bad) = slots.iter().find(|sl| sl.0 / bs >= num_blocks) {
        return Err(Error::BlockOutOfRange {
            block: crate::ids::BlockId(u32::try_from(bad.0 / bs).unwrap_or(u32::MAX)),
            num_blocks: num_blocks as usize,
        });
    }
    // Lengths, layer, scales and slots are checked: none of the three steps below fails.
    rope.apply(k, positions, s.num_kv_heads)?;
    rope.apply(q, positions, s.num_q_heads)?;
    reshape_and_cache(storage, layer, slots, k, v, k_scale, v_scale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlockId;
    use crate::layout::shape::{DType, ModelShape};
    use crate::layout::KvLayout;

    /// The textbook formula in f64, written from the definitions.
    fn rope_f64(x: &[f64], pos: usize, d: usize, rot: usize, theta: f64, neox: bool) -> Vec<f64> {
        let mut out = x.to_vec();
        for i in 0..rot / 2 {
            let ang = pos as f64 / theta.powf(2.0 * i as f64 / rot as f64);
            let (a, b) = if neox {
                (i, i + rot / 2)
            } else {
                (2 * i, 2 * i + 1)
            };
            out[a] = x[a] * ang.cos() - x[b] * ang.sin();
            out[b] = x[a] * ang.sin() + x[b] * ang.cos();
        }
        assert_eq!(out.len(), d);
        out
    }

    #[test]
    fn matches_the_formula_for_both_styles_and_partial_rotary() {
        let mut rng = crate::attention::model::SplitMix64::new(5);
        for (style, neox) in [
            (RopeStyle::Interleaved, false),
            (RopeStyle::NeoxHalves, true),
        ] {
            for (d, rot) in [(64, 64), (64, 32), (8, 2)] {
                let rope = Rope::new(d, rot, 100_000.0, style).unwrap();
                let heads = 3;
                let positions = [0usize, 1, 7, 4095, 100_000];
                let x: Vec<f32> = (0..positions.len() * heads * d)
                    .map(|_| rng.uniform(2.0))
                    .collect();
                let mut y = x.clone();
                rope.apply(&mut y, &positions, heads).unwrap();
                for (t, &p) in positions.iter().enumerate() {
                    for h in 0..heads {
                        let o = (t * heads + h) * d;
                        let xin: Vec<f64> = x[o..o + d].iter().map(|&v| v.into()).collect();
                        let want = rope_f64(&xin, p, d, rot, 100_000.0, neox);
                        for j in 0..d {
                            let err = (f64::from(y[o + j]) - want[j]).abs();
                            assert!(err < 2e-6, "{style:?} d{d} r{rot} p{p} j{j}: {err}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn scores_depend_on_relative_position_only() {
        let rope = Rope::new(16, 16, 10_000.0, RopeStyle::NeoxHalves).unwrap();
        let mut rng = crate::attention::model::SplitMix64::new(9);
        let q0: Vec<f32> = (0..16).map(|_| rng.uniform(1.0)).collect();
        let k0: Vec<f32> = (0..16).map(|_| rng.uniform(1.0)).collect();
        let score = |pq: usize, pk: usize| {
            let (mut q, mut k) = (q0.clone(), k0.clone());
            rope.apply(&mut q, &[pq], 1).unwrap();
            rope.apply(&mut k, &[pk], 1).unwrap();
            q.iter().zip(&k).map(|(a, b)| f64::from(a * b)).sum::<f64>()
        };
        assert!((score(10, 3) - score(1007, 1000)).abs() < 1e-4);
    }

    #[test]
    fn fused_call_equals_rope_then_cache_and_checks_first() {
        let shape = ModelShape {
            num_layers: 2,
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            kv_dtype: DType::F32,
        };
        let layout = KvLayout::new(shape, 4).unwrap();
        let rope = Rope::new(8, 8, 10_000.0, RopeStyle::Interleaved).unwrap();
        let mut rng = crate::attention::model::SplitMix64::new(1);
        let positions = [5usize, 6, 7];
        let slots: Vec<Slot> = positions
            .iter()
            .map(|&p| layout.slot(BlockId(3), p % 4))
            .collect();
        let mut q: Vec<f32> = (0..3 * 32).map(|_| rng.uniform(1.0)).collect();
        let mut k: Vec<f32> = (0..3 * 16).map(|_| rng.uniform(1.0)).collect();
        let v: Vec<f32> = (0..3 * 16).map(|_| rng.uniform(1.0)).collect();
        let (q0, k0) = (q.clone(), k.clone());

        let mut a = HostStorage::new(layout, 8).unwrap();
        rope_and_cache(
            &mut a, 1, &rope, &positions, &slots, &mut q, &mut k, &v, 1.0, 1.0,
        )
        .unwrap();
        let mut b = HostStorage::new(layout, 8).unwrap();
        let (mut q1, mut k1) = (q0.clone(), k0.clone());
        rope.apply(&mut q1, &positions, 4).unwrap();
        rope.apply(&mut k1, &positions, 2).unwrap();
        reshape_and_cache(&mut b, 1, &slots, &k1, &v, 1.0, 1.0).unwrap();
        assert_eq!((q, k), (q1, k1));
        assert_eq!(a.region(1), b.region(1));

        // A slot outside the arena: nothing rotated, nothing written.
        let mut c = HostStorage::new(layout, 8).unwrap();
        let (mut q2, mut k2) = (q0.clone(), k0.clone());
        let mut bad = slots.clone();
        bad[2] = layout.slot(BlockId(8), 0);
        let e = rope_and_cache(
            &mut c, 1, &rope, &positions, &bad, &mut q2, &mut k2, &v, 1.0, 1.0,
        );
        assert!(matches!(e, Err(Error::BlockOutOfRange { .. })));
        assert_eq!((q2, k2), (q0, k0));
        assert!(c.region(1).iter().all(|&x| x == 0));
    }
}
