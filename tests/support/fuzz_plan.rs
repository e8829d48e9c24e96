//! The capacity planner and the attention entry points under arbitrary numbers: a
//! config.json whose sizes reach `u64::MAX`, any budget, context and concurrency, and
//! contiguous-cache shapes whose byte counts overflow. Shared by the fuzz target
//! `planner` and `tests/cache/fuzz_corpus.rs`.
//!
//! What must hold: nothing panics (the test profile checks overflow, so wrapping
//! arithmetic panics), every refusal is a typed error, and a plan that says "fits"
//! is right when recomputed in `u128`.

use pagedkv::attention::cpu::{contiguous_decode, ContiguousKv};
use pagedkv::attention::AttentionParams;
use pagedkv::plan::{ModelSpec, PlanInput};
use pagedkv::DType;

/// Reads little-endian numbers from the input, zeros once it runs out.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |acc, i| acc | u64::from(self.u8()) << (8 * i))
    }

    /// A size: small most of the time, anything up to `u64::MAX` otherwise.
    fn size(&mut self) -> u64 {
        match self.u8() % 4 {
            0 => u64::from(self.u8()),
            1 => u64::from(self.u8()) << 8 | u64::from(self.u8()),
            2 => 1 << (self.u8() % 64),
            _ => self.u64(),
        }
    }
}

/// Runs one input; panics only on a broken guarantee.
pub fn run(data: &[u8]) {
    let mut r = Reader(data);
    plan(&mut r);
    contiguous(&mut r);
}

fn plan(r: &mut Reader<'_>) {
    let experts = r.u8() % 3;
    // Mostly a plausible attention shape (the reader bounds those fields) with the
    // sizes it does not bound (hidden, FFN, vocabulary, experts) anywhere up to 2^64;
    // sometimes raw numbers everywhere.
    let raw = r.u8().is_multiple_of(8);
    let kv = 1u64 << (r.u8() % 6);
    let heads = kv << (r.u8() % 4);
    let head_dim = 1u64 << (1 + r.u8() % 8);
    let (hidden, layers) = if raw {
        (r.size(), r.size())
    } else {
        let hidden = match r.u8() % 3 {
            0 => heads * head_dim,
            _ => r.size(),
        };
        (hidden, 1 + u64::from(r.u8()))
    };
    let max_pos = if raw { r.size() } else { 1 << 40 };
    let mut json = format!(
        "{{\"model_type\": \"{}\", \"hidden_size\": {hidden}, \"intermediate_size\": {}, \
         \"vocab_size\": {}, \"num_hidden_layers\": {layers}, \"num_attention_heads\": {heads}, \
         \"num_key_value_heads\": {kv}, \"head_dim\": {head_dim}, \
         \"max_position_embeddings\": {max_pos}",
        if experts == 0 { "llama" } else { "mixtral" },
        r.size(),
        r.size(),
    );
    if experts > 0 {
        json.push_str(&format!(
            ", \"num_local_experts\": {}, \"num_experts_per_tok\": {}",
            r.size(),
            r.size()
        ));
    }
    json.push('}');
    let Ok(spec) = ModelSpec::from_json_str(&json) else {
        return;
    };
    let mut input = PlanInput::new(spec, r.size());
    input.context_tokens = r.size() as usize;
    input.concurrency = r.size() as usize;
    input.block_size = 1 << (r.u8() % 12);
    input.tensor_parallel = 1 << (r.u8() % 4);
    input.kv_dtype = DType::ALL[usize::from(r.u8()) % DType::ALL.len()];
    if r.u8().is_multiple_of(2) {
        input.reserve_bytes = Some(r.size());
    }
    input.assume_dense = r.u8().is_multiple_of(2);
    let Ok(plan) = input.plan() else {
        return;
    };
    if plan.verdict.fits() {
        // Recomputed wide: the blocks the requests need fit the blocks there are, and
        // the weights and the KV budget fit the usable memory.
        let needed = u128::from(plan.blocks_per_request) * plan.concurrency as u128;
        assert!(
            needed <= u128::from(plan.num_blocks),
            "fits, but {needed} blocks needed of {}",
            plan.num_blocks
        );
        assert!(
            u128::from(plan.weight_bytes) + u128::from(plan.reserve_bytes)
                <= u128::from(plan.usable_bytes),
            "fits, but weights and reserve exceed the usable memory"
        );
        assert!(
            u128::from(plan.num_blocks) * u128::from(plan.block_bytes)
                <= u128::from(plan.kv_budget_bytes),
            "fits, but the blocks exceed the KV budget"
        );
        assert!(plan.blocks_per_request > 0 || plan.context_tokens == 0);
    }
}

fn contiguous(r: &mut Reader<'_>) {
    let buf = vec![0u8; usize::from(r.u8()) * 8];
    let kv = ContiguousKv {
        k: &buf,
        v: &buf,
        dtype: DType::ALL[usize::from(r.u8()) % DType::ALL.len()],
        batch: r.size() as usize,
        max_tokens: r.size() as usize,
        num_kv_heads: r.size() as usize,
        head_dim: r.size() as usize,
    };
    let num_q_heads = r.size() as usize;
    let q = vec![0.5f32; usize::from(r.u8()) * 4];
    let lens: Vec<u32> = (0..r.u8() % 4).map(|_| r.size() as u32).collect();
    let mut out = vec![0f32; usize::from(r.u8()) * 4];
    let params = AttentionParams::new(kv.head_dim);
    // Any outcome but a panic is fine; a result must come with a consistent shape.
    if contiguous_decode(&kv, num_q_heads, &q, &lens, &params, None, &mut out, None).is_ok() {
        assert!(
            kv.bytes().is_ok(),
            "decode ran over a shape whose size overflows"
        );
    }
}
