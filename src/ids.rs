//! The ids every layer names: the bottom of the crate, importing nothing from it.
//!
//! Each is a `#[repr(transparent)]` newtype so that a block index, a sequence id and
//! a ticket can never be confused across an API.

/// Defines one id newtype with its `Display` prefix.
macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($int:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(pub $int);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_type!(
    /// A physical block: an index into the arena.
    BlockId(u32),
    "#"
);

impl BlockId {
    /// The table entry of a block a sliding-window sequence gave back: its tokens fell
    /// out of the window, so no kernel reads it (`u32::MAX`, outside every arena). Only
    /// a table's leading entries are ever `RELEASED`; validation accepts them only
    /// before the first token a query reads.
    pub const RELEASED: BlockId = BlockId(u32::MAX);

    /// The id as an index.
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

id_type!(
    /// A sequence (request, or one branch of a fork), named by the engine.
    SeqId(u64),
    "seq "
);

id_type!(
    /// Names one pin taken by `KvCache::pin_prefix`.
    PinId(u64),
    "pin "
);

id_type!(
    /// Names one swap transfer from its plan to `KvCache::complete_swap`.
    SwapTicket(u64),
    "ticket "
);

id_type!(
    /// A slot of the disk tier: one whole block (every layer, K and V).
    DiskSlot(u32),
    "slot "
);

/// A resident sequence's place in a `KvCache`, for the calls that run once per
/// sequence per step (`append_batch`): reaching the sequence through it costs an index
/// and a generation compare, no hashing. Obtained from `KvCache::handle`; valid
/// from admission (or swap-in) until the sequence is freed (or swapped out). A handle
/// kept past that is refused (`Error::StaleHandle`), never pointed at another sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqHandle {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl std::fmt::Display for SeqHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "handle {}.{}", self.index, self.generation)
    }
}
