//! The crate's one error type.
//!
//! Every variant carries the numbers a caller needs to act on it. A call that returns
//! an error has left every structure it touched as it was before the call.

use crate::ids::{BlockId, SeqHandle, SeqId};

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in pagedkv.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The device tier has fewer free (or evictable) blocks than the call needs.
    #[error("out of blocks: needed {needed}, free {free}")]
    OutOfBlocks {
        /// Blocks the call needed.
        needed: usize,
        /// Blocks that were free or evictable.
        free: usize,
    },
    /// The host (or disk) tier has no room for a swap-out.
    #[error("{tier} tier full: needed {needed} blocks, free {free}")]
    TierFull {
        /// Which tier ("host" or "disk").
        tier: &'static str,
        /// Blocks the call needed.
        needed: usize,
        /// Blocks that were free.
        free: usize,
    },
    /// No sequence with this id is known.
    #[error("unknown sequence {0}")]
    UnknownSequence(SeqId),
    /// A [`crate::SeqHandle`] whose sequence has left the device (freed or swapped
    /// out) since the handle was made.
    #[error("{0} is stale: its sequence was freed or swapped out")]
    StaleHandle(SeqHandle),
    /// The manager holds as many sequences as its handles can name.
    #[error("more than {limit} sequences")]
    TooManySequences {
        /// Sequences a manager can hold.
        limit: usize,
    },
    /// A sequence is listed twice in one batch call.
    #[error("sequence {0} is listed twice in one batch")]
    DuplicateInBatch(SeqId),
    /// A sequence with this id already exists.
    #[error("sequence {0} already exists")]
    DuplicateSequence(SeqId),
    /// The sequence is not in the state the call needs (swapped out, say).
    #[error("sequence {seq} is {state}; the call needs it {needed}")]
    SequenceState {
        /// The sequence.
        seq: SeqId,
        /// The state it is in.
        state: &'static str,
        /// The state the call needs.
        needed: &'static str,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid config: {field}: {reason}")]
    InvalidConfig {
        /// The field or parameter at fault.
        field: &'static str,
        /// Why it was rejected, with the value.
        reason: String,
    },
    /// A model `config.json` could not be read into a shape.
    #[error("model config: {0}")]
    ModelConfig(String),
    /// A model `config.json` names a layer type the planner does not know for its
    /// `model_type`: its cache (KV, recurrent state, nothing) cannot be sized, so the
    /// config is refused rather than guessed.
    #[error("model config: layer {layer} of model_type {model_type} is {layer_type:?}, a layer type the planner does not know; refusing to guess its cache")]
    UnknownLayerType {
        /// The config's `model_type` (`"absent"` when it has none).
        model_type: String,
        /// Index of the first layer of that type.
        layer: usize,
        /// The type as the config spells it.
        layer_type: String,
    },
    /// A block id is outside the arena.
    #[error("block {block} is outside the arena of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The offending id.
        block: BlockId,
        /// Blocks in the arena.
        num_blocks: usize,
    },
    /// A swap plan names a host-tier block past the storage's host tier: the manager's
    /// host tier is larger than the storage's (a hand-written `TierConfig` whose
    /// `num_host_blocks` disagrees; `TierConfig::for_storage` takes it from the
    /// storage). Plain names, not links: this module sits below the manager.
    #[error(
        "host block {block} is outside the storage's host tier of {host_blocks} blocks \
         (the manager's TierConfig::num_host_blocks must not exceed the storage's \
         num_host_blocks; TierConfig::for_storage sets it)"
    )]
    HostBlockOutOfRange {
        /// The offending host-tier id.
        block: BlockId,
        /// Blocks in the storage's host tier.
        host_blocks: usize,
    },
    /// A block was freed while already free, or its refcount would underflow.
    #[error("double free or refcount underflow on block {0}")]
    DoubleFree(BlockId),
    /// A block table does not fit the request (too short for the context, a freed block...).
    #[error("corrupt block table: {0}")]
    CorruptBlockTable(String),
    /// Tensor shapes or lengths given by the caller do not match.
    #[error("shape mismatch: {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// What was being checked.
        what: &'static str,
        /// Expected length or size.
        expected: usize,
        /// What the caller passed.
        got: usize,
    },
    /// A call named token positions past the end of a sequence (truncating to a longer
    /// length, asking for slots that were never allocated).
    #[error("positions up to {end} asked of {seq}, which holds {len}")]
    PastEnd {
        /// The sequence.
        seq: SeqId,
        /// The end position the call asked for.
        end: usize,
        /// The sequence's length (allocated slots).
        len: usize,
    },
    /// Token ids were given for positions after a gap of positions whose ids are not
    /// known.
    #[error("{seq}: token ids from position {first}, but ids are known only up to {known}")]
    TokenIdsGap {
        /// The sequence.
        seq: SeqId,
        /// The first position of the ids given.
        first: usize,
        /// Ids are known for positions below this.
        known: usize,
    },
    /// A commit named more tokens than the sequence's reservation holds.
    #[error("{seq}: commit of {committed} tokens, but only {reserved} are reserved")]
    CommitPastReservation {
        /// The sequence.
        seq: SeqId,
        /// Tokens the call committed.
        committed: usize,
        /// Tokens reserved by the last `reserve`.
        reserved: usize,
    },
    /// A request is larger than anything this cache could ever hold.
    #[error("request of {tokens} tokens exceeds the limit of {limit}")]
    TooLong {
        /// Tokens requested.
        tokens: usize,
        /// The most the cache can hold for one sequence.
        limit: usize,
    },
    /// A CUDA driver, NVRTC or kernel-launch failure.
    #[error("cuda: {0}")]
    Cuda(String),
    /// The crate was built without the `cuda` feature, or no GPU/driver was found.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// An I/O failure (disk tier).
    #[error("io: {0}")]
    Io(String),
    /// A transport between processes (NIXL) failed: `op` names the call, `detail`
    /// says what it reported. Also a missing transport library, found before any call.
    #[error("transport: {op} failed: {detail}")]
    Transport {
        /// The operation that failed.
        op: &'static str,
        /// What the transport reported.
        detail: String,
    },
    /// A transfer between processes did not complete before its deadline (a peer that
    /// died or hangs); the request was released before this returned.
    #[error("transport: {op} did not complete within {timeout_ms} ms")]
    TransportTimeout {
        /// The operation that timed out.
        op: &'static str,
        /// The deadline, in milliseconds.
        timeout_ms: u64,
    },
    /// Data read back failed its checksum.
    #[error("checksum mismatch on {what}: expected {expected:#018x}, got {got:#018x}")]
    Checksum {
        /// What was checked.
        what: String,
        /// Stored checksum.
        expected: u64,
        /// Checksum of the bytes read.
        got: u64,
    },
    /// A disk-tier directory holds files this build does not read: a wrong magic,
    /// format version or header checksum, or a data file shorter than its journal
    /// says. (A header written for another KV layout is [`Error::ShapeMismatch`].)
    #[error("disk tier format: {what}: expected {expected:#x}, got {got:#x}")]
    DiskFormat {
        /// The field at fault.
        what: &'static str,
        /// The value this build expects.
        expected: u64,
        /// The value found on disk.
        got: u64,
    },
    /// The arena cannot shrink to `requested` blocks: every live and cached block must
    /// stay, and together they need more.
    #[error("cannot shrink the arena to {requested} blocks: {live} live and {cached} cached blocks must stay")]
    ShrinkBelowResident {
        /// Blocks asked for.
        requested: usize,
        /// Blocks referenced by tables.
        live: usize,
        /// Unreferenced blocks kept for the prefix cache.
        cached: usize,
    },
    /// The arena cannot grow to `requested` blocks: the configured maximum is `max`.
    #[error("cannot grow the arena to {requested} blocks: the maximum is {max}")]
    ArenaLimit {
        /// Blocks asked for.
        requested: usize,
        /// `CacheConfig::max_num_blocks`, or the `u32` id space.
        max: usize,
    },
    /// A prefix-cache key (cache salt or extra key) is longer than the configured limit.
    #[error("{what} of {len} bytes exceeds the limit of {limit}")]
    PrefixKeyTooLong {
        /// Which key ("cache salt" or "extra key").
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// `PrefixConfig::max_key_bytes`.
        limit: usize,
    },
    /// A prefix to pin is not (wholly) in the prefix cache.
    #[error("prefix not cached: {cached_tokens} of {requested_tokens} tokens are")]
    PrefixNotCached {
        /// Tokens the call asked to pin.
        requested_tokens: usize,
        /// Leading tokens found in the cache.
        cached_tokens: usize,
    },
    /// Pinning would exceed `PrefixConfig::max_pinned_blocks`.
    #[error("pin limit: {requested} more blocks with {pinned} pinned exceeds {limit}")]
    PinLimit {
        /// Blocks the pin would add.
        requested: usize,
        /// Blocks pinned now.
        pinned: usize,
        /// The limit.
        limit: usize,
    },
    /// No pin with this id is held (never taken, or already released).
    #[error("unknown {0}")]
    UnknownPin(crate::ids::PinId),
    /// A block that a load from the disk level of the prefix cache reads is not in
    /// the disk store (evicted or dropped since the admission): a miss, the load
    /// aborted.
    #[error("disk-level entry {hash:#x} is not in the disk store")]
    DiskEntryMissing {
        /// The block's hash (`BlockHash::0`).
        hash: u64,
    },
    /// A submission to a `TransferEngine` that would take its bytes in flight past
    /// the budget set with `TransferEngine::set_in_flight_budget`: nothing was queued;
    /// submit again once completions have been polled.
    #[error("transfer of {needed} bytes refused: {in_flight} bytes in flight, budget {budget}")]
    TransferBudget {
        /// Bytes the submission would move.
        needed: u64,
        /// Bytes submitted and not yet polled as completed.
        in_flight: u64,
        /// The budget.
        budget: u64,
    },
    /// The operation is not supported by this backend or configuration.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A call of the one-group API made on a hybrid cache (several KV-cache groups)
    /// that this call does not serve yet; the `_grouped` calls and the lifecycle calls
    /// serve every cache (see `KvCache::hybrid`).
    #[error("{operation} is not available on a cache of {groups} KV-cache groups yet")]
    NotOnHybrid {
        /// The call refused.
        operation: &'static str,
        /// The cache's groups.
        groups: usize,
    },
    /// A truncation below the computed tokens of a sequence whose cache has a
    /// recurrent-state group: the state holds the whole computed context and cannot
    /// be rolled back (an engine that speculates keeps the state of each draft
    /// itself and truncates only past the computed tokens).
    #[error(
        "{seq}: truncating to {new_len} tokens would roll back a recurrent state that \
         holds {computed} computed tokens"
    )]
    StateRollback {
        /// The sequence.
        seq: SeqId,
        /// Its computed tokens (the state's position).
        computed: usize,
        /// The length asked for.
        new_len: usize,
    },
    /// Tensor parallelism: the KV heads do not split evenly over the shards.
    #[error("{num_kv_heads} KV heads do not split evenly over {num_shards} shards")]
    UnevenHeadSplit {
        /// KV heads of the model.
        num_kv_heads: usize,
        /// Shards (GPUs) asked for.
        num_shards: usize,
    },
    /// A KV export buffer is not in a format this build reads (magic, version, a
    /// header field inconsistent with the others).
    #[error("KV export format: {what}: expected {expected:#x}, got {got:#x}")]
    ExportFormat {
        /// The field at fault.
        what: &'static str,
        /// The value this build expects.
        expected: u64,
        /// The value in the buffer.
        got: u64,
    },
    /// A KV export buffer is shorter than its header says.
    #[error("KV export truncated: {needed} bytes needed, {got} given")]
    ExportTruncated {
        /// Bytes the buffer must hold.
        needed: usize,
        /// Bytes it holds.
        got: usize,
    },
    /// A KV export comes from a model whose KV shape differs from the receiver's.
    #[error("KV export from another shape: {what}: sender {sender}, receiver {receiver}")]
    ExportShape {
        /// The shape field that differs (`num_layers`, `num_kv_heads`, `head_dim`...).
        what: &'static str,
        /// The sender's value.
        sender: usize,
        /// The receiver's value.
        receiver: usize,
    },
    /// A KV export holds another element type than the receiver's cache.
    #[error("KV export dtype: sender {sender}, receiver {receiver}")]
    ExportDType {
        /// The sender's KV dtype (`DType::name`).
        sender: &'static str,
        /// The receiver's KV dtype (`DType::name`).
        receiver: &'static str,
    },
    /// A number is outside the range its parameter allows (a memory size of zero, a
    /// utilisation fraction above 1...).
    #[error("{field} = {value} is out of range: {allowed}")]
    OutOfRange {
        /// The parameter at fault.
        field: &'static str,
        /// The value given.
        value: f64,
        /// The allowed range, in words (`"in (0, 1]"`).
        allowed: &'static str,
    },
    /// A planned context is longer than the model's position embeddings allow.
    #[error("context of {context_tokens} tokens exceeds the model's max_position_embeddings of {max_position_embeddings}")]
    ContextTooLong {
        /// The context asked for, in tokens.
        context_tokens: usize,
        /// The model's `max_position_embeddings`.
        max_position_embeddings: usize,
    },
    /// A tensor-parallel degree does not split a model dimension evenly.
    #[error("tensor-parallel degree {tp} does not divide {what} ({count})")]
    UnevenTensorParallel {
        /// The dimension (`"num_kv_heads"`, ...).
        what: &'static str,
        /// Its size.
        count: usize,
        /// The tensor-parallel degree.
        tp: usize,
    },
    /// No swap transfer with this ticket is in flight (completed, aborted or never
    /// issued by this manager).
    #[error("no swap transfer in flight with ticket {0}")]
    UnknownTicket(crate::ids::SwapTicket),
    /// An external reservation of the memory broker found too few bytes before its
    /// deadline (what it had found went back to the free budget).
    #[error(
        "reservation of {requested} bytes timed out after {waited_ms} ms with {found} bytes found"
    )]
    ReservationTimeout {
        /// Bytes asked for.
        requested: usize,
        /// Bytes found by the deadline (given back).
        found: usize,
        /// Milliseconds waited.
        waited_ms: u64,
    },
}

impl Error {
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            field,
            reason: reason.into(),
        }
    }
}
