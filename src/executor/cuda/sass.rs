//! A static speed model of a decode kernel, read off its SASS (the text
//! `cuobjdump -sass` prints for a cubin). Pure functions over that text: no GPU, no
//! CUDA library, and tested on a committed excerpt.
//!
//! # The model
//!
//! A decode kernel is memory-bound only if the multiprocessors can issue its
//! instructions as fast as HBM delivers the bytes they consume. So:
//!
//! 1. **Main loop.** [`main_loop`] finds the KV-token loop: among the backward branches
//!    of the function, the loop bodies (branch target to branch) that hold both a
//!    vector global load (`LDG`/`LDGSTS` of 8 or 16 bytes, as K and V are read) and an
//!    exponential (`MUFU.EX2`, the softmax), the largest. The q-loading loop has loads
//!    but no exponential; the epilogue's warp merge has exponentials but no global
//!    loads; the work list's fused split merge has both, but its loads are 4-byte f32
//!    partials.
//! 2. **Per iteration.** [`LoopProfile`] counts the body's instructions by
//!    [`InstrClass`] (once each: code that a branch may skip counts as issued, so the
//!    count is an upper bound), and the KV bytes one warp loads per iteration: 32 lanes
//!    times the widths of the vector loads (8 or 16 bytes; the 4-byte loads are block
//!    ids). `NOP`s are not counted (padding). Local-memory accesses (`LDL`/`STL`) in
//!    the body are spills.
//! 3. **Issue ceiling.** Each SM has 4 warp schedulers, each issuing at most one warp
//!    instruction per cycle. The H200 (SXM) has [`H200_SMS`] SMs; the clock is
//!    [`H200_CLOCK_HZ`], the H100/H200 SXM boost clock (a lead from the datasheet, not
//!    measured here: at a lower sustained clock the ceiling scales down with it). So the
//!    GPU issues at most `132 x 4 x 1.98e9 = 1.045e12` warp instructions per second,
//!    and a loop that moves `B` bytes per `I` warp instructions reads at most
//!    `1.045e12 x B / I` bytes per second. When fewer than 4 warps are resident per SM
//!    ([`Occupancy`]), only that many schedulers have work and the rate scales down.
//! 4. **Slow pipes.** Two pipes take longer than one issue slot per warp instruction,
//!    so a loop heavy in them is bound by the pipe, not by issue: the special-function
//!    unit (`MUFU`) and the conversions (`F2F`, `F2FP`, `I2F`, ...) run 16 lanes per
//!    cycle per SM (the CUDA programming guide's throughput table for cc 9.0), that is
//!    [`XU_CYCLES_PER_WARP_INSTR`] cycles of a scheduler per warp instruction, counted
//!    here as one shared pipe; a tensor-core `HMMA` m16n8k16 (2,048 multiply-adds) is
//!    counted at [`MMA_CYCLES_PER_HMMA`] cycles, the A100's dense rate (the H200 is not
//!    slower per SM and clock). A scheduler then needs
//!    `max(instructions, 8 x (MUFU + conversions), 8 x HMMA)` cycles per iteration.
//! 5. **Ceiling.** `min(issue ceiling, pipe ceiling, HBM)`, with HBM at
//!    [`H200_HBM_BYTES_PER_S`] (4.3 TB/s, the copy bandwidth the project compares
//!    against; the datasheet says 4.8).
//!
//! `cp.async` copies (`LDGSTS`) count as KV bytes like `LDG`s (8 or 16 bytes a lane);
//! `LDSM` (`ldmatrix`) and `LDS` count as shared-memory instructions.
//!
//! What it leaves out: latency (bytes in flight per SM), other pipes' limits (`SHFL`,
//! shared-memory bandwidth and bank conflicts), whether the conversions and `MUFU`
//! really share one pipe, and the prologue and epilogue (long contexts amortise them).
//! It is a ceiling, not a prediction: a kernel below it is certainly slower than
//! 4.3 TB/s on the H200; one at it may still be latency-bound.
//!
//! 6. **Predicted range** ([`predicted_range`]), a prediction to check on the first
//!    GPU, not a bound: Little's law over the KV bytes each SM keeps in flight (its
//!    resident CTAs times what one CTA has requested at a time: the `cp.async` pipeline
//!    of the tensor-core path, else one iteration's loads of every warp), divided by a
//!    loaded HBM latency of [`H200_LOADED_LATENCY_S`] (both ends), capped by the
//!    ceiling, less the share [`MERGE_AND_TAIL_FRACTION`] (both ends) of the fused
//!    merge, the epilogue and the last partial wave: the low end pairs the long
//!    latency with the large share, the high end the short with the small.

use std::collections::BTreeMap;

/// The loaded HBM latency [`predicted_range`] assumes, in seconds: (short, long).
/// A lead (Hopper microbenchmarks put an idle DRAM access near 0.5 µs; under a full
/// read load it grows), not measured here.
pub const H200_LOADED_LATENCY_S: (f64, f64) = (0.6e-6, 1.0e-6);
/// Share of a decode launch's time [`predicted_range`] gives to the fused merge, the
/// epilogue and the last partial wave of CTAs: (small, large). The small end is issue
/// 35's reading of the merge alone (about 3 %); the large one a guess with the tail.
pub const MERGE_AND_TAIL_FRACTION: (f64, f64) = (0.03, 0.10);

/// Streaming multiprocessors of an H200 SXM.
pub const H200_SMS: u32 = 132;
/// Warp schedulers per SM (Hopper), each issuing up to one warp instruction per cycle.
pub const SCHEDULERS_PER_SM: u32 = 4;
/// The SM clock the model assumes: the H100/H200 SXM boost clock (datasheet figure).
pub const H200_CLOCK_HZ: f64 = 1.98e9;
/// HBM bandwidth the model caps at: 4.3 TB/s (the crate's copy-bandwidth yardstick).
pub const H200_HBM_BYTES_PER_S: f64 = 4.3e12;
/// Scheduler cycles one warp instruction occupies on the special-function and
/// conversion pipe (16 lanes per cycle per SM, 4 per scheduler).
pub const XU_CYCLES_PER_WARP_INSTR: u32 = 8;
/// Scheduler cycles one `HMMA` m16n8k16 occupies on the tensor pipe (256 multiply-adds
/// per cycle per SM quarter, the A100's dense f16 rate).
pub const MMA_CYCLES_PER_HMMA: u32 = 8;
/// 32-bit registers per SM (sm_90).
pub const REGISTERS_PER_SM: u32 = 65_536;
/// Most resident warps per SM (sm_90).
pub const MAX_WARPS_PER_SM: u32 = 64;
/// Most resident CTAs per SM (sm_90).
pub const MAX_CTAS_PER_SM: u32 = 32;
/// Shared memory per SM usable by CTAs, bytes (sm_90: 228 KiB).
pub const SHARED_BYTES_PER_SM: u32 = 228 * 1024;
/// Shared memory the system reserves per resident CTA, bytes (sm_8x/sm_90).
pub const SHARED_RESERVED_PER_CTA: u32 = 1024;
/// Registers are allocated per warp in units of this many (sm_90).
pub const REGISTER_ALLOC_UNIT: u32 = 256;

/// One SASS instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SassInstr {
    /// Byte offset in the function.
    pub addr: u32,
    /// The guard (`@P0`, `@!P2`), if any.
    pub predicate: Option<String>,
    /// Opcode with its modifiers (`LDG.E.128.CONSTANT`).
    pub opcode: String,
    /// Everything after the opcode, up to the `;`.
    pub operands: String,
}

impl SassInstr {
    /// The opcode without modifiers (`LDG`).
    pub fn base(&self) -> &str {
        self.opcode.split('.').next().unwrap_or("")
    }

    /// Where a branch goes, for `BRA` (its last operand, a hex address).
    pub fn branch_target(&self) -> Option<u32> {
        if self.base() != "BRA" {
            return None;
        }
        let last = self.operands.split([' ', ',']).rfind(|s| !s.is_empty())?;
        u32::from_str_radix(last.strip_prefix("0x")?, 16).ok()
    }

    /// Bytes one lane moves from global memory, for a global load; 4 when the opcode
    /// names no width.
    pub fn global_load_bytes(&self) -> Option<u32> {
        if !matches!(self.base(), "LDG" | "LDGSTS") {
            return None;
        }
        let width = self.opcode.split('.').find_map(|m| match m {
            "64" => Some(8),
            "128" => Some(16),
            "U8" | "S8" => Some(1),
            "U16" | "S16" => Some(2),
            _ => None,
        });
        Some(width.unwrap_or(4))
    }
}

/// The functions (`Function : NAME`) of a `cuobjdump -sass` listing, in order, with
/// their instructions. Encoding-only lines and headers are skipped.
pub fn parse_sass(text: &str) -> Vec<(String, Vec<SassInstr>)> {
    let mut out: Vec<(String, Vec<SassInstr>)> = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("Function : ") {
            out.push((name.trim().to_string(), Vec::new()));
            continue;
        }
        let Some(f) = out.last_mut() else { continue };
        if let Some(i) = parse_instr(t) {
            f.1.push(i);
        }
    }
    out
}

/// The instructions of function `name`, if the listing has it.
pub fn function<'a>(
    functions: &'a [(String, Vec<SassInstr>)],
    name: &str,
) -> Option<&'a [SassInstr]> {
    functions
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
}

/// `/*0550*/  @P2 BRA 0x1e0 ;  /* 0x... */` -> an instruction; anything else -> None.
fn parse_instr(t: &str) -> Option<SassInstr> {
    let rest = t.strip_prefix("/*")?;
    let (addr, rest) = rest.split_once("*/")?;
    let addr = u32::from_str_radix(addr.trim(), 16).ok()?;
    let (body, _) = rest.split_once(';')?;
    let mut words = body.split_whitespace().peekable();
    let predicate = match words.peek() {
        Some(w) if w.starts_with('@') => words.next().map(str::to_string),
        _ => None,
    };
    let opcode = words.next()?.to_string();
    let operands = words.collect::<Vec<_>>().join(" ");
    Some(SassInstr {
        addr,
        predicate,
        opcode,
        operands,
    })
}

/// What an instruction spends its issue slot on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum InstrClass {
    /// `FFMA`.
    Ffma,
    /// `FMUL`.
    Fmul,
    /// Other fp32: `FADD`, `FMNMX`, `FSETP`, `FSEL`, `FSWZADD`.
    FpOther,
    /// Packed half/bf16 arithmetic: `HFMA2`, `HMUL2`, `HADD2`, `HMNMX2`, `HSETP2`.
    Half2,
    /// Tensor cores: `HMMA`, `IMMA`, `HGMMA`, `QGMMA`.
    Mma,
    /// Special functions: `MUFU` (exp2, rcp, ...).
    Mufu,
    /// Conversions: `F2F`, `F2FP`, `I2F`, `F2I`, `I2FP`, `F2IP`.
    Convert,
    /// Warp shuffles: `SHFL`.
    Shfl,
    /// Global loads: `LDG`, `LDGSTS`.
    GlobalLoad,
    /// Global stores and atomics: `STG`, `RED`, `ATOMG`.
    GlobalStore,
    /// Shared memory: `LDS`, `STS`, `LDSM`, `ATOMS`.
    Shared,
    /// Local memory (spills): `LDL`, `STL`.
    Local,
    /// Integer and address arithmetic, moves, predicates.
    Integer,
    /// Branches, barriers, and other control.
    Control,
    /// Anything else.
    Other,
}

impl InstrClass {
    /// Every class, in display order.
    pub const ALL: [InstrClass; 15] = [
        InstrClass::Ffma,
        InstrClass::Fmul,
        InstrClass::FpOther,
        InstrClass::Half2,
        InstrClass::Mma,
        InstrClass::Mufu,
        InstrClass::Convert,
        InstrClass::Shfl,
        InstrClass::GlobalLoad,
        InstrClass::GlobalStore,
        InstrClass::Shared,
        InstrClass::Local,
        InstrClass::Integer,
        InstrClass::Control,
        InstrClass::Other,
    ];

    /// Short column name.
    pub fn short(self) -> &'static str {
        match self {
            InstrClass::Ffma => "ffma",
            InstrClass::Fmul => "fmul",
            InstrClass::FpOther => "fp",
            InstrClass::Half2 => "h2",
            InstrClass::Mma => "mma",
            InstrClass::Mufu => "mufu",
            InstrClass::Convert => "cvt",
            InstrClass::Shfl => "shfl",
            InstrClass::GlobalLoad => "ldg",
            InstrClass::GlobalStore => "stg",
            InstrClass::Shared => "smem",
            InstrClass::Local => "local",
            InstrClass::Integer => "int",
            InstrClass::Control => "ctrl",
            InstrClass::Other => "other",
        }
    }
}

/// The class of an opcode (with or without modifiers).
pub fn classify(opcode: &str) -> InstrClass {
    let base = opcode.split('.').next().unwrap_or("");
    match base {
        "FFMA" | "FFMA32I" => InstrClass::Ffma,
        "FMUL" | "FMUL32I" => InstrClass::Fmul,
        "FADD" | "FADD32I" | "FMNMX" | "FSETP" | "FSEL" | "FSET" | "FSWZADD" | "FCHK" => {
            InstrClass::FpOther
        }
        "HFMA2" | "HMUL2" | "HADD2" | "HMNMX2" | "HSETP2" | "HSET2" => InstrClass::Half2,
        "HMMA" | "IMMA" | "HGMMA" | "QGMMA" | "IGMMA" | "BMMA" | "DMMA" => InstrClass::Mma,
        "MUFU" => InstrClass::Mufu,
        "F2F" | "F2FP" | "I2F" | "F2I" | "I2FP" | "F2IP" | "FRND" => InstrClass::Convert,
        "SHFL" => InstrClass::Shfl,
        "LDG" | "LDGSTS" | "LDGDEPBAR" => InstrClass::GlobalLoad,
        "STG" | "RED" | "ATOMG" | "ATOM" => InstrClass::GlobalStore,
        "LDS" | "STS" | "LDSM" | "ATOMS" | "STSM" => InstrClass::Shared,
        "LDL" | "STL" => InstrClass::Local,
        "IMAD" | "IADD3" | "IADD" | "VIADD" | "LEA" | "LOP3" | "LOP" | "SHF" | "SHL" | "SHR"
        | "ISETP" | "IMNMX" | "VIMNMX" | "MOV" | "UMOV" | "SEL" | "PRMT" | "PLOP3" | "P2R"
        | "R2P" | "CS2R" | "S2R" | "S2UR" | "ULDC" | "LDC" | "ULEA" | "UIADD3" | "UIMAD"
        | "USHF" | "ULOP3" | "UISETP" | "USEL" | "UPRMT" | "IABS" | "POPC" | "FLO" | "BREV"
        | "IMUL" | "I2I" | "R2UR" | "VOTE" | "VOTEU" | "MATCH" | "UFLO" | "UPOPC" | "BMSK" => {
            InstrClass::Integer
        }
        "BRA" | "BRX" | "JMP" | "BSSY" | "BSYNC" | "BAR" | "WARPSYNC" | "EXIT" | "RET" | "CALL"
        | "DEPBAR" | "BPT" | "YIELD" | "MEMBAR" | "ERRBAR" | "CCTL" | "NANOSLEEP" | "SYNCS"
        | "ELECT" | "ACQBULK" | "BMOV" | "WARPGROUP" => InstrClass::Control,
        _ => InstrClass::Other,
    }
}

/// A loop: the instructions from a backward branch's target to the branch itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopBody {
    /// Address of the first instruction (the branch target).
    pub start: u32,
    /// Address of the backward branch.
    pub end: u32,
    /// The body, the branch included.
    pub instrs: Vec<SassInstr>,
}

/// Every loop of `instrs`: one per backward branch.
pub fn loops(instrs: &[SassInstr]) -> Vec<LoopBody> {
    instrs
        .iter()
        .filter_map(|b| {
            let target = b.branch_target()?;
            (target <= b.addr).then(|| LoopBody {
                start: target,
                end: b.addr,
                instrs: instrs
                    .iter()
                    .filter(|i| i.addr >= target && i.addr <= b.addr)
                    .cloned()
                    .collect(),
            })
        })
        .collect()
}

/// The KV-token loop of a decode kernel: the largest loop whose body holds a vector
/// global load (8 or 16 bytes) and a `MUFU.EX2` (see the module docs).
pub fn main_loop(instrs: &[SassInstr]) -> Option<LoopBody> {
    loops(instrs)
        .into_iter()
        .filter(|l| {
            l.instrs
                .iter()
                .any(|i| i.global_load_bytes().is_some_and(|b| b >= 8))
                && l.instrs.iter().any(|i| i.opcode.starts_with("MUFU.EX2"))
        })
        .max_by_key(|l| l.instrs.len())
}

/// What one iteration of a loop issues and loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopProfile {
    /// Warp instructions per iteration by class (`NOP`s left out).
    pub counts: BTreeMap<InstrClass, u32>,
    /// Warp instructions per iteration, all classes.
    pub instructions: u32,
    /// KV bytes one warp loads per iteration: 32 x the widths of its 8- and 16-byte
    /// global loads.
    pub kv_bytes_per_warp: u32,
    /// Local-memory instructions (`LDL`/`STL`) in the body: spills in the main loop.
    pub spill_instructions: u32,
}

impl LoopProfile {
    /// Profiles `body`.
    pub fn of(body: &LoopBody) -> LoopProfile {
        let mut counts = BTreeMap::new();
        let (mut instructions, mut kv, mut spills) = (0, 0, 0);
        for i in &body.instrs {
            if i.base() == "NOP" {
                continue;
            }
            let c = classify(&i.opcode);
            *counts.entry(c).or_insert(0) += 1;
            instructions += 1;
            if let Some(b) = i.global_load_bytes().filter(|&b| b >= 8) {
                kv += 32 * b;
            }
            if c == InstrClass::Local {
                spills += 1;
            }
        }
        LoopProfile {
            counts,
            instructions,
            kv_bytes_per_warp: kv,
            spill_instructions: spills,
        }
    }

    /// Instructions of one class.
    pub fn count(&self, class: InstrClass) -> u32 {
        self.counts.get(&class).copied().unwrap_or(0)
    }

    /// Warp instructions per KV byte.
    pub fn instructions_per_byte(&self) -> f64 {
        self.instructions as f64 / self.kv_bytes_per_warp.max(1) as f64
    }

    /// Cycles of one scheduler per iteration on the slowest pipe the model counts:
    /// issue (one per instruction), the special-function and conversion pipe, the
    /// tensor pipe (see the module docs).
    pub fn pipe_cycles(&self) -> u32 {
        let xu = XU_CYCLES_PER_WARP_INSTR
            * (self.count(InstrClass::Mufu) + self.count(InstrClass::Convert));
        let mma = MMA_CYCLES_PER_HMMA * self.count(InstrClass::Mma);
        self.instructions.max(xu).max(mma)
    }
}

/// How many CTAs of a kernel fit on one SM, and what limits them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    /// Resident CTAs per SM.
    pub ctas_per_sm: u32,
    /// Resident warps per SM.
    pub warps_per_sm: u32,
    /// What stops one more CTA: "registers", "shared memory", "warps" or "CTAs".
    pub limited_by: &'static str,
}

impl Occupancy {
    /// Fraction of [`MAX_WARPS_PER_SM`].
    pub fn fraction(&self) -> f64 {
        self.warps_per_sm as f64 / MAX_WARPS_PER_SM as f64
    }
}

/// Occupancy of a CTA of `threads` threads using `registers` per thread and
/// `shared_bytes` of shared memory, on an sm_90 SM.
pub fn occupancy(registers: u32, shared_bytes: u32, threads: u32) -> Occupancy {
    let warps = threads.div_ceil(32).max(1);
    let regs_per_warp = (registers.max(1) * 32).next_multiple_of(REGISTER_ALLOC_UNIT);
    let by_regs = (REGISTERS_PER_SM / regs_per_warp) / warps;
    let by_smem = SHARED_BYTES_PER_SM / (shared_bytes + SHARED_RESERVED_PER_CTA);
    let by_warps = MAX_WARPS_PER_SM / warps;
    let limits = [
        (by_regs, "registers"),
        (by_smem, "shared memory"),
        (by_warps, "warps"),
        (MAX_CTAS_PER_SM, "CTAs"),
    ];
    let (ctas, limited_by) = limits
        .into_iter()
        .min_by_key(|&(n, _)| n)
        .unwrap_or((0, "registers"));
    Occupancy {
        ctas_per_sm: ctas,
        warps_per_sm: ctas * warps,
        limited_by,
    }
}

/// The modeled ceiling of a loop at an occupancy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedModel {
    /// Bytes per second the SMs can consume at full issue rate.
    pub issue_bytes_per_s: f64,
    /// Bytes per second the slowest counted pipe allows ([`LoopProfile::pipe_cycles`]);
    /// at most `issue_bytes_per_s`.
    pub pipe_bytes_per_s: f64,
    /// `min(pipe_bytes_per_s, HBM)`.
    pub ceiling_bytes_per_s: f64,
}

impl SpeedModel {
    /// The ceiling as a fraction of [`H200_HBM_BYTES_PER_S`].
    pub fn fraction_of_hbm(&self) -> f64 {
        self.ceiling_bytes_per_s / H200_HBM_BYTES_PER_S
    }
}

/// The predicted bandwidth range `(low, high)` in bytes per second of a loop with
/// `model`'s ceiling when each resident CTA keeps `in_flight_bytes_per_cta` KV bytes
/// requested at a time (module docs, step 6).
pub fn predicted_range(
    model: &SpeedModel,
    occ: &Occupancy,
    in_flight_bytes_per_cta: f64,
) -> (f64, f64) {
    let in_flight = H200_SMS as f64 * occ.ctas_per_sm as f64 * in_flight_bytes_per_cta;
    let at = |latency: f64, share: f64| {
        (in_flight / latency).min(model.ceiling_bytes_per_s) * (1.0 - share)
    };
    (
        at(H200_LOADED_LATENCY_S.1, MERGE_AND_TAIL_FRACTION.1),
        at(H200_LOADED_LATENCY_S.0, MERGE_AND_TAIL_FRACTION.0),
    )
}

/// The model of the module docs for an H200.
pub fn speed_model(profile: &LoopProfile, occ: &Occupancy) -> SpeedModel {
    let schedulers = occ.warps_per_sm.min(SCHEDULERS_PER_SM) as f64;
    let issue_rate = H200_SMS as f64 * schedulers * H200_CLOCK_HZ;
    let rate = |cycles: u32| {
        if cycles == 0 {
            0.0
        } else {
            issue_rate * profile.kv_bytes_per_warp as f64 / cycles as f64
        }
    };
    let issue = rate(profile.instructions);
    let pipe = rate(profile.pipe_cycles());
    SpeedModel {
        issue_bytes_per_s: issue,
        pipe_bytes_per_s: pipe,
        ceiling_bytes_per_s: pipe.min(H200_HBM_BYTES_PER_S),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trimmed `cuobjdump -sass` listing of the decode kernel (bf16, d128, GQA 8,
    /// sm_90, before the work-list launch): the header, the q-loading loop (loads, no exp), the
    /// KV-token loop cut down to a sample of its body (loads and exps), and an
    /// epilogue loop (a shared-memory atomic, no exp). Encodings as cuobjdump prints
    /// them. Two lines are made by hand to exercise the parser: an `STL` (a spill)
    /// and a `NOP` just before the KV loop's backward branch.
    const EXCERPT: &str = include_str!("testdata/decode_excerpt.sass");

    fn decode() -> Vec<SassInstr> {
        let f = parse_sass(EXCERPT);
        function(&f, "paged_attention_decode").unwrap().to_vec()
    }

    #[test]
    fn listing_is_split_into_functions_and_instructions() {
        let f = parse_sass(EXCERPT);
        let names: Vec<&str> = f.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["paged_attention_merge", "paged_attention_decode"]);
        let d = decode();
        let first = &d[0];
        assert_eq!(first.addr, 0);
        assert_eq!(first.opcode, "LDC");
        assert_eq!(first.operands, "R1, c[0x0][0x28]");
        let bra = d.iter().find(|i| i.addr == 0x5d0).unwrap();
        assert_eq!(bra.predicate.as_deref(), Some("@P0"));
        assert_eq!(bra.branch_target(), Some(0x470));
        let ldg = d.iter().find(|i| i.opcode == "LDG.E.128.CONSTANT").unwrap();
        assert_eq!(ldg.global_load_bytes(), Some(16));
        assert_eq!(ldg.base(), "LDG");
    }

    #[test]
    fn opcodes_are_classified() {
        assert_eq!(classify("FFMA"), InstrClass::Ffma);
        assert_eq!(classify("FMUL.FTZ"), InstrClass::Fmul);
        assert_eq!(classify("FSETP.GEU.AND"), InstrClass::FpOther);
        assert_eq!(classify("HFMA2.MMA"), InstrClass::Half2);
        assert_eq!(classify("HMMA.16816.F32.BF16"), InstrClass::Mma);
        assert_eq!(classify("MUFU.EX2"), InstrClass::Mufu);
        assert_eq!(classify("SHFL.BFLY"), InstrClass::Shfl);
        assert_eq!(classify("LDGSTS.E.BYPASS.128"), InstrClass::GlobalLoad);
        assert_eq!(classify("LDS.128"), InstrClass::Shared);
        assert_eq!(classify("STL.64"), InstrClass::Local);
        assert_eq!(classify("IMAD.WIDE.U32"), InstrClass::Integer);
        assert_eq!(classify("BAR.SYNC.DEFER_BLOCKING"), InstrClass::Control);
        assert_eq!(classify("WHATEVER"), InstrClass::Other);
    }

    #[test]
    fn the_kv_loop_is_found_and_profiled() {
        let d = decode();
        // Three backward branches: q loading, KV tokens, epilogue.
        assert_eq!(loops(&d).len(), 3);
        let main = main_loop(&d).unwrap();
        assert_eq!((main.start, main.end), (0x1de0, 0x3d70));
        let p = LoopProfile::of(&main);
        // Counted by hand from the excerpt.
        assert_eq!(p.count(InstrClass::GlobalLoad), 3);
        assert_eq!(p.kv_bytes_per_warp, 2 * 32 * 16);
        assert_eq!(p.count(InstrClass::Mufu), 2);
        assert_eq!(p.count(InstrClass::Ffma), 3);
        assert_eq!(p.count(InstrClass::Fmul), 2);
        assert_eq!(p.count(InstrClass::Shfl), 2);
        assert_eq!(p.count(InstrClass::Local), 1);
        assert_eq!(p.spill_instructions, 1);
        assert_eq!(p.instructions, main.instrs.len() as u32 - 1, "one NOP");
        let sum: u32 = InstrClass::ALL.iter().map(|&c| p.count(c)).sum();
        assert_eq!(sum, p.instructions);
    }

    #[test]
    fn occupancy_follows_the_sm90_limits() {
        // 128 threads, 168 registers: 168 x 32 = 5376 per warp, 12 warps by registers,
        // 3 CTAs.
        let o = occupancy(168, 9 * 1024, 128);
        assert_eq!(
            (o.ctas_per_sm, o.warps_per_sm, o.limited_by),
            (3, 12, "registers")
        );
        // Few registers, lots of shared memory.
        let o = occupancy(32, 100 * 1024, 128);
        assert_eq!((o.ctas_per_sm, o.limited_by), (2, "shared memory"));
        // Tiny CTAs: the CTA limit.
        let o = occupancy(16, 0, 32);
        assert_eq!((o.ctas_per_sm, o.limited_by), (32, "CTAs"));
        // 256 threads at 24 registers: the warp limit (registers would allow 10 CTAs).
        let o = occupancy(24, 0, 256);
        assert_eq!((o.warps_per_sm, o.limited_by), (64, "warps"));
        assert_eq!(o.fraction(), 1.0);
    }

    #[test]
    fn the_model_is_issue_rate_times_bytes_per_instruction_capped_by_hbm() {
        let mut p = LoopProfile {
            counts: BTreeMap::new(),
            instructions: 521,
            kv_bytes_per_warp: 1024,
            spill_instructions: 0,
        };
        let occ = occupancy(128, 9 * 1024, 128);
        let m = speed_model(&p, &occ);
        let want = 132.0 * 4.0 * 1.98e9 * 1024.0 / 521.0;
        assert!((m.issue_bytes_per_s - want).abs() < 1.0);
        assert!((m.fraction_of_hbm() - want / 4.3e12).abs() < 1e-12);
        // Cheap loops hit the HBM cap.
        p.instructions = 100;
        assert_eq!(speed_model(&p, &occ).ceiling_bytes_per_s, 4.3e12);
        // One warp per SM: one scheduler.
        let one = Occupancy {
            ctas_per_sm: 1,
            warps_per_sm: 1,
            limited_by: "registers",
        };
        let m1 = speed_model(&p, &one);
        assert!((m1.issue_bytes_per_s - 132.0 * 1.98e9 * 1024.0 / 100.0).abs() < 1.0);
    }

    #[test]
    fn the_predicted_range_is_littles_law_under_the_ceiling_less_the_merge() {
        let p = LoopProfile {
            counts: BTreeMap::new(),
            instructions: 100,
            kv_bytes_per_warp: 1024,
            spill_instructions: 0,
        };
        let occ = occupancy(128, 9 * 1024, 128);
        let m = speed_model(&p, &occ);
        let (keep_lo, keep_hi) = (
            1.0 - MERGE_AND_TAIL_FRACTION.1,
            1.0 - MERGE_AND_TAIL_FRACTION.0,
        );
        // 2 KiB in flight per CTA: latency-bound, below the ceiling at both ends.
        let (lo, hi) = predicted_range(&m, &occ, 2048.0);
        let flight = 132.0 * occ.ctas_per_sm as f64 * 2048.0;
        assert!((lo / (flight / 1.0e-6 * keep_lo) - 1.0).abs() < 1e-12);
        assert!((hi / (flight / 0.6e-6 * keep_hi) - 1.0).abs() < 1e-12);
        assert!(lo < hi && hi < m.ceiling_bytes_per_s);
        // Plenty in flight: both ends at the ceiling, less the merge and tail.
        let (lo, hi) = predicted_range(&m, &occ, 1e9);
        assert_eq!((lo, hi), (4.3e12 * keep_lo, 4.3e12 * keep_hi));
    }

    #[test]
    fn slow_pipes_bind_before_issue_when_they_are_busier() {
        // 100 instructions, of which 20 are MUFU/conversions: 160 cycles on that pipe.
        let mut counts = BTreeMap::new();
        counts.insert(InstrClass::Mufu, 5);
        counts.insert(InstrClass::Convert, 15);
        counts.insert(InstrClass::Integer, 80);
        let mut p = LoopProfile {
            counts,
            instructions: 100,
            kv_bytes_per_warp: 1024,
            spill_instructions: 0,
        };
        assert_eq!(p.pipe_cycles(), 160);
        let occ = occupancy(128, 0, 128);
        let m = speed_model(&p, &occ);
        let issue_rate = 132.0 * 4.0 * 1.98e9;
        assert!((m.issue_bytes_per_s - issue_rate * 1024.0 / 100.0).abs() < 1.0);
        assert!((m.pipe_bytes_per_s - issue_rate * 1024.0 / 160.0).abs() < 1.0);
        // 16 HMMA: 128 tensor cycles, above the 100 issue cycles but below 160.
        p.counts.insert(InstrClass::Mma, 16);
        assert_eq!(p.pipe_cycles(), 160);
        p.counts.insert(InstrClass::Mma, 30);
        assert_eq!(p.pipe_cycles(), 240);
        // A loop light on both is issue-bound.
        p.counts.clear();
        assert_eq!(p.pipe_cycles(), 100);
    }
}
