//! Reading GGUF files (llama.cpp's model format): the metadata, the tensor directory,
//! and the model's KV-cache shape as a [`ModelConfig`].
//!
//! The crate is not a model library: this reader stops at *where* each tensor's bytes
//! are and how many there are ([`GgufFile::tensor_data`]). Dequantising them is the
//! engine's business (the `generate` example does it for Q4_0, Q4_1, Q8_0, F16 and F32).
//!
//! The parser is fallible and bounded: every length and count is checked against the
//! bytes that remain before anything is allocated, the number of metadata values and the
//! nesting are limited ([`MAX_METADATA_VALUES`], [`MAX_ARRAY_DEPTH`]), and tensor ranges
//! are checked against the file. Hostile bytes give [`Error::ModelConfig`], never a panic
//! or an outsized allocation (`tests/planner/gguf.rs` feeds it truncations, flipped bytes, huge
//! counts and deep nesting).
//!
//! ```no_run
//! use pagedkv::plan::gguf::GgufFile;
//! use pagedkv::DType;
//!
//! let bytes = std::fs::read("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
//! let file = GgufFile::parse(&bytes)?;
//! let model = file.model_info(DType::F16)?;
//! assert_eq!(model.config.shape.num_kv_heads, 3);
//! # Ok::<(), pagedkv::Error>(())
//! ```

use super::config::{ModelArch, ModelConfig, KNOWN_MODEL_TYPES};
use crate::error::{Error, Result};
use crate::layout::shape::{DType, ModelShape};

/// The file magic, `GGUF` in ASCII.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Metadata entries the parser accepts, at most.
pub const MAX_METADATA_ENTRIES: u64 = 1 << 20;
/// Tensors the parser accepts, at most.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Nesting of metadata arrays the parser accepts (an array of arrays is depth 2).
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Metadata values (array elements included) the parser accepts in one file, at most:
/// bounds the memory a hostile file can make it take to about 32 bytes per value plus the
/// file's own string bytes (vocabularies of 256k tokens with merges, scores and types
/// take about a million).
pub const MAX_METADATA_VALUES: usize = 1 << 22;
/// Dimensions of one tensor, at most (ggml's `GGML_MAX_DIMS`).
pub const MAX_TENSOR_DIMS: usize = 4;
/// Default alignment of the tensor data section (`general.alignment` overrides it).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// UTF-8 string (invalid UTF-8 is replaced, not rejected: vocabularies contain
    /// byte tokens).
    String(String),
    /// Array of values of one type.
    Array(Vec<GgufValue>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(x) => Some(x.into()),
            GgufValue::U16(x) => Some(x.into()),
            GgufValue::U32(x) => Some(x.into()),
            GgufValue::U64(x) => Some(x),
            GgufValue::I8(x) => u64::try_from(x).ok(),
            GgufValue::I16(x) => u64::try_from(x).ok(),
            GgufValue::I32(x) => u64::try_from(x).ok(),
            GgufValue::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(x) => Some(x.into()),
            GgufValue::F64(x) => Some(x),
            GgufValue::I8(x) => Some(x.into()),
            GgufValue::I16(x) => Some(x.into()),
            GgufValue::I32(x) => Some(x.into()),
            GgufValue::I64(x) => Some(x as f64),
            _ => self.as_u64().map(|x| x as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// A ggml tensor type, by its numeric id in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    /// 32-bit float.
    pub const F32: GgmlType = GgmlType(0);
    /// IEEE half.
    pub const F16: GgmlType = GgmlType(1);
    /// 4-bit, blocks of 32 with an f16 scale.
    pub const Q4_0: GgmlType = GgmlType(2);
    /// 4-bit, blocks of 32 with an f16 scale and minimum.
    pub const Q4_1: GgmlType = GgmlType(3);
    /// 8-bit, blocks of 32 with an f16 scale.
    pub const Q8_0: GgmlType = GgmlType(8);
    /// bfloat16.
    pub const BF16: GgmlType = GgmlType(30);

    /// `(elements per block, bytes per block)` of the types whose sizes this reader
    /// knows (ggml's `type_traits`), `None` for others.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        Some(match self.0 {
            0 => (1, 4),      // F32
            1 => (1, 2),      // F16
            2 => (32, 18),    // Q4_0
            3 => (32, 20),    // Q4_1
            6 => (32, 22),    // Q5_0
            7 => (32, 24),    // Q5_1
            8 => (32, 34),    // Q8_0
            9 => (32, 36),    // Q8_1
            10 => (256, 84),  // Q2_K
            11 => (256, 110), // Q3_K
            12 => (256, 144), // Q4_K
            13 => (256, 176), // Q5_K
            14 => (256, 210), // Q6_K
            15 => (256, 292), // Q8_K
            24 => (1, 1),     // I8
            25 => (1, 2),     // I16
            26 => (1, 4),     // I32
            27 => (1, 8),     // I64
            28 => (1, 8),     // F64
            30 => (1, 2),     // BF16
            _ => return None,
        })
    }

    /// Short name of the common types (`"Q4_1"`), else `"type N"`.
    pub fn name(self) -> String {
        match self.0 {
            0 => "F32".into(),
            1 => "F16".into(),
            2 => "Q4_0".into(),
            3 => "Q4_1".into(),
            6 => "Q5_0".into(),
            7 => "Q5_1".into(),
            8 => "Q8_0".into(),
            10..=15 => format!("Q{}_K", [2, 3, 4, 5, 6, 8][(self.0 - 10) as usize]),
            30 => "BF16".into(),
            n => format!("type {n}"),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost first (ggml order: `dims[0]` is the contiguous one).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements (checked: the parser rejects overflowing products).
    pub fn num_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of the data, when the type's layout is known and rows are whole blocks.
    pub fn num_bytes(&self) -> Option<u64> {
        let (per_block, bytes) = self.ggml_type.block_layout()?;
        let n = self.num_elements();
        if self.dims.first().is_some_and(|d| d % per_block != 0) {
            return None;
        }
        (n / per_block).checked_mul(bytes)
    }
}

/// A parsed GGUF header: metadata and tensor directory, with the position of the data.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, GgufValue)>,
    /// Tensor directory in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Offset of the data section from the start of the file.
    pub data_offset: u64,
}

/// What a GGUF file says about a model: the [`ModelConfig`] the rest of the crate uses,
/// plus what an engine needs to run attention over the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufModelInfo {
    /// `general.architecture` (`llama`, `qwen2`, ...).
    pub architecture: String,
    /// Shape and sizes, with the KV dtype asked for.
    pub config: ModelConfig,
    /// Rotary base (`{arch}.rope.freq_base`, default 10,000).
    pub rope_theta: f64,
    /// Rotated dimensions per head (`{arch}.rope.dimension_count`, default head dim).
    pub rope_dim: usize,
    /// RMS-norm epsilon (`{arch}.attention.layer_norm_rms_epsilon`, default 1e-5).
    pub rms_norm_eps: f64,
}

fn bad(msg: impl std::fmt::Display) -> Error {
    Error::ModelConfig(format!("gguf: {msg}"))
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Metadata values still allowed ([`MAX_METADATA_VALUES`]).
    values_left: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(bad(format!(
                "truncated at byte {} reading {what}: {n} bytes needed, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_item_bytes` each: rejected when the rest of the
    /// file cannot hold that many.
    fn count(&mut self, what: &str, min_item_bytes: usize, limit: u64) -> Result<usize> {
        let n = self.u64(what)?;
        if n > limit {
            return Err(bad(format!("{what} {n} exceeds the limit of {limit}")));
        }
        let n = usize::try_from(n).map_err(|_| bad(format!("{what} {n} overflows")))?;
        if n.saturating_mul(min_item_bytes.max(1)) > self.remaining() {
            return Err(bad(format!(
                "{what} {n} cannot fit in the {} bytes left",
                self.remaining()
            )));
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1, u64::MAX)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue> {
        self.values_left = self
            .values_left
            .checked_sub(1)
            .ok_or_else(|| bad(format!("more than {MAX_METADATA_VALUES} metadata values")))?;
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>("u8")?[0]),
            1 => GgufValue::I8(self.array::<1>("i8")?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array("u16")?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array("i16")?)),
            4 => GgufValue::U32(self.u32("u32")?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array("i32")?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array("f32")?)),
            7 => match self.array::<1>("bool")?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(bad(format!("bool byte {b} at {}", self.pos - 1))),
            },
            8 => GgufValue::String(self.string("string length")?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(bad(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}")));
                }
                let elem = self.u32("array element type")?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8, // a string or array is at least its u64 length
                    t => return Err(bad(format!("unknown array element type {t}"))),
                };
                let n = self.count("array length", min, u64::MAX)?;
                if n > self.values_left {
                    return Err(bad(format!(
                        "array of {n} values past the limit of {MAX_METADATA_VALUES} metadata values"
                    )));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64("u64")?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array("i64")?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array("f64")?)),
            t => return Err(bad(format!("unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Parses the header of a GGUF file (`bytes` may be the whole file or any prefix
    /// that holds the metadata and the tensor directory).
    ///
    /// # Errors
    /// [`Error::ModelConfig`] for a wrong magic, an unsupported version, truncation, an
    /// unknown value type, a count past the limits above or past the bytes given, a
    /// tensor with no or too many dimensions or an overflowing element count, a
    /// misaligned tensor offset, or an alignment that is not a power of two.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader {
            bytes,
            pos: 0,
            values_left: MAX_METADATA_VALUES,
        };
        let magic: [u8; 4] = r.array("magic")?;
        if magic != GGUF_MAGIC {
            return Err(bad(format!("magic {magic:02x?} is not GGUF")));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(bad(format!(
                "version {version} (this reader knows 2 and 3)"
            )));
        }
        // Smallest tensor entry: name length (8) + dims count (4) + one dim (8) + type (4)
        // + offset (8); smallest metadata entry: key length (8) + type (4) + one byte.
        let num_tensors = r.count("tensor count", 32, MAX_TENSORS)?;
        let num_kv = r.count("metadata count", 13, MAX_METADATA_ENTRIES)?;
        let mut metadata = Vec::with_capacity(num_kv);
        for _ in 0..num_kv {
            let key = r.string("key length")?;
            let ty = r.u32("value type")?;
            let value = r.value(ty, 0)?;
            metadata.push((key, value));
        }
        let mut tensors = Vec::with_capacity(num_tensors);
        for _ in 0..num_tensors {
            let name = r.string("tensor name length")?;
            let nd = r.u32("dimension count")? as usize;
            if nd == 0 || nd > MAX_TENSOR_DIMS {
                return Err(bad(format!("tensor {name:?} has {nd} dimensions")));
            }
            let mut dims = Vec::with_capacity(nd);
            let mut elems: u64 = 1;
            for _ in 0..nd {
                let d = r.u64("dimension")?;
                elems = elems
                    .checked_mul(d)
                    .filter(|&e| e <= 1 << 48)
                    .ok_or_else(|| bad(format!("tensor {name:?}: element count overflows")))?;
                dims.push(d);
            }
            let ggml_type = GgmlType(r.u32("tensor type")?);
            let offset = r.u64("tensor offset")?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let mut file = GgufFile {
            version,
            metadata,
            tensors,
            data_offset: 0,
        };
        let align = match file.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two() && *a <= 1 << 20)
                .ok_or_else(|| bad(format!("general.alignment {v:?}")))?,
        };
        if let Some(t) = file.tensors.iter().find(|t| t.offset % align != 0) {
            return Err(bad(format!(
                "tensor {:?} at offset {} is not aligned to {align}",
                t.name, t.offset
            )));
        }
        file.data_offset = (r.pos as u64).div_ceil(align) * align;
        Ok(file)
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata
            .iter()
            .find_map(|(k, v)| (k == key).then_some(v))
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of tensor `name` inside `file` (the whole file that was parsed).
    ///
    /// # Errors
    /// [`Error::ModelConfig`] for an unknown tensor, a type whose size this reader does
    /// not know, or a range past the end of `file`.
    pub fn tensor_data<'a>(
        &self,
        file: &'a [u8],
        name: &str,
    ) -> Result<(&'a [u8], &GgufTensorInfo)> {
        let t = self
            .tensor(name)
            .ok_or_else(|| bad(format!("no tensor {name:?}")))?;
        let len = t.num_bytes().ok_or_else(|| {
            bad(format!(
                "tensor {name:?}: size of {} with dims {:?} is unknown",
                t.ggml_type.name(),
                t.dims
            ))
        })?;
        let start = self
            .data_offset
            .checked_add(t.offset)
            .ok_or_else(|| bad(format!("tensor {name:?}: offset overflows")))?;
        let end = start
            .checked_add(len)
            .ok_or_else(|| bad(format!("tensor {name:?}: end overflows")))?;
        if end > file.len() as u64 {
            return Err(bad(format!(
                "tensor {name:?} ends at byte {end}, past the file's {}",
                file.len()
            )));
        }
        Ok((&file[start as usize..end as usize], t))
    }

    fn arch_uint(&self, arch: &str, key: &str) -> Result<Option<usize>> {
        let full = format!("{arch}.{key}");
        match self.get(&full) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad(format!("{full} must be a non-negative integer, got {v:?}"))),
        }
    }

    fn arch_float(&self, arch: &str, key: &str, default: f64) -> Result<f64> {
        let full = format!("{arch}.{key}");
        match self.get(&full) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| bad(format!("{full} must be a positive number, got {v:?}"))),
        }
    }

    /// The model's configuration, with the KV cache in `kv_dtype` (GGUF says how the
    /// weights are stored, not what dtype an engine keeps its cache in).
    ///
    /// Needs `general.architecture`, `{arch}.block_count`, `{arch}.attention.head_count`
    /// and `{arch}.embedding_length`; takes `head_count_kv` (default: MHA),
    /// `attention.key_length` (default `embedding_length / head_count`),
    /// `feed_forward_length`, `context_length`, `vocab_size` (default: the tokenizer's
    /// token count); embeddings are tied when there is no `output.weight` tensor.
    ///
    /// # Errors
    /// [`Error::ModelConfig`] for a missing, mistyped or nonsensical field (a per-layer
    /// array of KV head counts is not supported yet).
    pub fn model_info(&self, kv_dtype: DType) -> Result<GgufModelInfo> {
        let arch = self
            .get("general.architecture")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| bad("general.architecture is missing or not a string"))?
            .to_string();
        let need = |key: &str| -> Result<usize> {
            self.arch_uint(&arch, key)?
                .ok_or_else(|| bad(format!("missing {arch}.{key}")))
        };
        let num_layers = need("block_count")?;
        let num_q_heads = need("attention.head_count")?;
        let hidden_size = need("embedding_length")?;
        if num_q_heads == 0 {
            return Err(bad(format!("{arch}.attention.head_count is 0")));
        }
        let num_kv_heads = self
            .arch_uint(&arch, "attention.head_count_kv")?
            .unwrap_or(num_q_heads);
        let head_dim = match self.arch_uint(&arch, "attention.key_length")? {
            Some(d) => d,
            None if hidden_size % num_q_heads == 0 => hidden_size / num_q_heads,
            None => {
                return Err(bad(format!(
                    "embedding_length {hidden_size} is not divisible by head_count {num_q_heads}"
                )))
            }
        };
        let shape = ModelShape {
            num_layers,
            num_q_heads,
            num_kv_heads,
            head_dim,
            kv_dtype,
        };
        shape.validate().map_err(|e| bad(e.to_string()))?;
        let vocab_size = match self.arch_uint(&arch, "vocab_size")? {
            Some(v) => v,
            None => self
                .get("tokenizer.ggml.tokens")
                .and_then(GgufValue::as_array)
                .map_or(0, <[GgufValue]>::len),
        };
        let rope_dim = self
            .arch_uint(&arch, "rope.dimension_count")?
            .unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(bad(format!(
                "rope.dimension_count {rope_dim} with head dim {head_dim}"
            )));
        }
        let name = self
            .get("general.name")
            .and_then(GgufValue::as_str)
            .unwrap_or(&arch)
            .to_string();
        Ok(GgufModelInfo {
            config: ModelConfig {
                name,
                shape,
                hidden_size,
                intermediate_size: self.arch_uint(&arch, "feed_forward_length")?.unwrap_or(0),
                vocab_size,
                max_position_embeddings: self.arch_uint(&arch, "context_length")?.unwrap_or(0),
                tie_word_embeddings: self.tensor("output.weight").is_none(),
                // A GGUF's general.architecture names the dense family; its
                // quantization is per tensor and is not read into the planner here.
                arch: ModelArch {
                    model_type: Some(arch.clone()),
                    known: KNOWN_MODEL_TYPES.contains(&arch.as_str()),
                    // Llama-family blocks: a norm before attention and one before the MLP;
                    // Qwen2 puts biases on q, k and v.
                    norms_per_layer: 2,
                    attention_bias: arch == "qwen2",
                    ..ModelArch::default()
                },
            },
            rope_theta: self.arch_float(&arch, "rope.freq_base", 10_000.0)?,
            rope_dim,
            rms_norm_eps: self.arch_float(&arch, "attention.layer_norm_rms_epsilon", 1e-5)?,
            architecture: arch,
        })
    }

    /// Reads and parses a GGUF file, returning the parsed header and the file's bytes.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, otherwise as [`Self::parse`].
    pub fn read(path: impl AsRef<std::path::Path>) -> Result<(Self, Vec<u8>)> {
        let path = path.as_ref();
        let bytes =
            std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        Ok((Self::parse(&bytes)?, bytes))
    }
}

impl ModelConfig {
    /// The configuration of the model in a GGUF file, its KV cache in `kv_dtype`
    /// (see [`GgufFile::model_info`]).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; [`Error::ModelConfig`] as
    /// [`GgufFile::parse`] and [`GgufFile::model_info`].
    pub fn from_gguf_file(path: impl AsRef<std::path::Path>, kv_dtype: DType) -> Result<Self> {
        let (file, _) = GgufFile::read(path)?;
        Ok(file.model_info(kv_dtype)?.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small writer for tests.
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, x: &str| {
            b.extend((x.len() as u64).to_le_bytes());
            b.extend(x.as_bytes());
        };
        b.extend(GGUF_MAGIC);
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes()); // tensors
        b.extend(5u64.to_le_bytes()); // metadata
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        s(&mut b, "llama");
        for (k, v) in [
            ("llama.block_count", 2u32),
            ("llama.attention.head_count", 4),
            ("llama.embedding_length", 32),
        ] {
            s(&mut b, k);
            b.extend(4u32.to_le_bytes());
            b.extend(v.to_le_bytes());
        }
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "b");
        s(&mut b, "token_embd.weight");
        b.extend(2u32.to_le_bytes());
        b.extend(32u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(0u8, 32 * 2 * 4));
        b
    }

    #[test]
    fn reads_a_small_file() {
        let bytes = tiny_gguf();
        let f = GgufFile::parse(&bytes).unwrap();
        let m = f.model_info(DType::F16).unwrap();
        assert_eq!(m.architecture, "llama");
        assert_eq!(
            (
                m.config.shape.num_layers,
                m.config.shape.num_q_heads,
                m.config.shape.num_kv_heads,
                m.config.shape.head_dim
            ),
            (2, 4, 4, 8)
        );
        assert_eq!(m.config.vocab_size, 2);
        assert!(m.config.tie_word_embeddings);
        let (data, t) = f.tensor_data(&bytes, "token_embd.weight").unwrap();
        assert_eq!((data.len(), t.num_elements()), (256, 64));
        assert!(f
            .tensor_data(&bytes[..bytes.len() - 1], "token_embd.weight")
            .is_err());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = tiny_gguf();
        let header = GgufFile::parse(&bytes).unwrap().data_offset as usize;
        for n in 0..header - 31 {
            assert!(GgufFile::parse(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
    }
}
