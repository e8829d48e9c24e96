//! A sequence moved page to page between two processes' arenas over NIXL (feature
//! `nixl`), with the export header as the control message.
//!
//! The prefill side [offers](offer_sequence) a sequence: the export header (layout,
//! dtype, token count, token ids, one XXH64 per block) and its block table, a few
//! hundred bytes that any side channel carries. The decode side
//! [pulls](pull_sequence) it: it checks the offer, allocates the sequence's blocks in
//! its own arena, READs the peer's pages straight into them with
//! [`NixlAgent::read_blocks`], checks every block's hash on the bytes it received, and
//! only then marks the tokens computed and, when the offer carries token ids, registers
//! the sequence's full blocks in its prefix cache. Afterwards it tells the prefill side
//! (side channel) that the blocks may be freed.
//!
//! ```text
//!  prefill                                      decode
//!  NixlAgent::local_metadata ---- side channel ---> NixlAgent::add_peer
//!  offer_sequence ------------- side channel ---> pull_sequence
//!                                                   admit + reserve (blocks allocated)
//!          arena pages  <====== NIXL READ =======   read_blocks
//!                                                   block hashes checked, commit,
//!                                                   full blocks registered (token ids)
//!  free the sequence   <------- side channel ----   "done"
//! ```
//!
//! # Decisions
//!
//! - **The receiver READs** (rather than the sender WRITEs and notifies): the decode side
//!   owns the blocks being filled, so it alone decides when they are complete, failed or
//!   timed out and frees them; a WRITE would need one more round trip (the receiver's
//!   block ids to the sender) and a notification the receiver must wait for with a
//!   deadline of its own. A dead prefill process surfaces as a failed or timed-out READ
//!   on the side that has something to clean up. vLLM's NIXL connector pulls the same way.
//! - **Pages move as they are**, so both arenas must have the same layout, block size
//!   included (the byte format's re-paging does not apply): a different layout is
//!   refused before anything is allocated.
//! - **The checksums are the export's**: the header's per-block XXH64 over the payload
//!   order, recomputed on the receiver from the bytes that landed in its arena (one
//!   block's rows at a time, through [`Storage::read_tokens`]). A page changed on the
//!   sender after its header was made fails here, and the sequence is freed.
//! - **Pulled blocks enter the prefix cache only once their bytes are checked**: after
//!   the commit, the offer's token ids go to [`KvCache::add_token_ids`] (the manager's
//!   path for ids that arrive after the slots, which registers full computed blocks in
//!   the default namespace), so a later request with the same prefix on the receiver
//!   hits. `ExportView::import_into_cache` instead admits with the ids
//!   ([`KvCache::admit_tokens`]), which registers the prompt's blocks at admission,
//!   before their bytes exist; that suits a local write that cannot half-fail, but here
//!   a failed or timed-out READ would leave registered blocks holding garbage (that
//!   import evicts the whole cache to undo it). Registering after the check, a failed
//!   pull registers nothing. Not done: the pull always transfers every block, even the
//!   prefix the receiver already caches, and the blocks go to the default namespace
//!   (an offer carries no cache salt, extra key or block keys).
//! - **The sender reads its K/V once** to hash it: [`offer_sequence`] runs
//!   [`export_sequence`] into a scratch buffer and sends only its header; the payload
//!   part of the scratch is the by-product of that pass.

use std::time::Duration;

use super::{check_storage, off, xxh64, HEADER_FIXED_BYTES};
use super::{export_sequence, lens, read_u64, row_bytes, ExportHeader, ImportedSequence};
use crate::error::{Error, Result};
use crate::executor::nixl::{NixlAgent, TransferStats};
use crate::executor::storage::{HostStorage, Storage};
use crate::ids::{BlockId, SeqId};
use crate::layout::plans::CopyPlan;
use crate::layout::KvLayout;
use crate::manager::KvCache;

/// The control message of one sequence, as [`offer_sequence`] wrote it and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceOffer {
    header: ExportHeader,
    block_hashes: Vec<u64>,
    token_ids: Option<Vec<u32>>,
    table: Vec<BlockId>,
}

impl SequenceOffer {
    /// Parses and checks an offer: the export header (its checksum, then the token ids
    /// and block hashes against theirs), then the sender's block table against its
    /// XXH64.
    ///
    /// # Errors
    /// As [`ExportHeader::parse`]; [`Error::ExportTruncated`] when `buf` is shorter
    /// than the header says; [`Error::Checksum`] for the tables or the block table.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        let header = ExportHeader::parse(buf)?;
        let header_len = header.header_len();
        let nb = header.num_blocks();
        let needed = header_len + 4 * nb + 8;
        if buf.len() < needed {
            return Err(Error::ExportTruncated {
                needed,
                got: buf.len(),
            });
        }
        let tables = &buf[HEADER_FIXED_BYTES..header_len];
        let (stored, got) = (read_u64(&buf[off::TABLES_CHECKSUM..]), xxh64(tables));
        if stored != got {
            return Err(Error::Checksum {
                what: "NIXL offer token ids and block hashes".into(),
                expected: stored,
                got,
            });
        }
        let ids_len = header.lens.0;
        let table_bytes = &buf[header_len..header_len + 4 * nb];
        let (stored, got) = (read_u64(&buf[header_len + 4 * nb..]), xxh64(table_bytes));
        if stored != got {
            return Err(Error::Checksum {
                what: "NIXL offer block table".into(),
                expected: stored,
                got,
            });
        }
        let u32s = |b: &[u8]| -> Vec<u32> {
            b.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let token_ids = header
            .has_token_ids()
            .then(|| u32s(&buf[HEADER_FIXED_BYTES..HEADER_FIXED_BYTES + 4 * header.num_tokens()]));
        let block_hashes = buf[HEADER_FIXED_BYTES + ids_len..header_len]
            .chunks_exact(8)
            .map(read_u64)
            .collect();
        let table = u32s(table_bytes).into_iter().map(BlockId).collect();
        Ok(SequenceOffer {
            header,
            block_hashes,
            token_ids,
            table,
        })
    }

    /// The export header (layout, dtype, token count).
    pub fn header(&self) -> &ExportHeader {
        &self.header
    }

    /// The sender's blocks, one per block of tokens.
    pub fn table(&self) -> &[BlockId] {
        &self.table
    }

    /// The token ids, when the offer carries them.
    pub fn token_ids(&self) -> Option<&[u32]> {
        self.token_ids.as_deref()
    }

    /// Fails unless a cache of `receiver` can take the pages as they are: as
    /// [`ExportHeader::check_compatible`], and the same block size and strides.
    ///
    /// # Errors
    /// [`Error::ExportShape`], [`Error::ExportDType`].
    pub fn check_layout(&self, receiver: &KvLayout) -> Result<()> {
        let sender = self.header.layout();
        self.header.check_compatible(receiver)?;
        if sender.block_size() != receiver.block_size() {
            return Err(Error::ExportShape {
                what: "block_size (NIXL moves whole pages)",
                sender: sender.block_size(),
                receiver: receiver.block_size(),
            });
        }
        if sender != receiver {
            return Err(Error::ExportShape {
                what: "bytes per block and layer (arena strides)",
                sender: sender.block_bytes_per_layer(),
                receiver: receiver.block_bytes_per_layer(),
            });
        }
        Ok(())
    }
}

/// Writes the offer of sequence `seq` (every computed token): the export header
/// followed by the sender's block table and its XXH64. `scratch` is grown to a whole
/// export (the K/V is read once to hash it; see the module docs). The sequence's blocks
/// must stay unchanged until the receiver is done with them.
///
/// # Errors
/// As [`export_sequence`]. Nothing changes on the manager.
pub fn offer_sequence<S: Storage + ?Sized>(
    manager: &KvCache,
    storage: &S,
    seq: SeqId,
    token_ids: Option<&[u32]>,
    scratch: &mut Vec<u8>,
) -> Result<Vec<u8>> {
    let (table, computed) = manager.readable_blocks(seq)?;
    let layout = *storage.layout();
    let l = lens(&layout, computed, token_ids.is_some())
        .ok_or_else(|| super::too_long(&layout, computed))?;
    scratch.resize(l.total, 0);
    export_sequence(manager, storage, seq, token_ids, scratch)?;
    let nb = layout.blocks_for_tokens(computed);
    let mut out = Vec::with_capacity(l.header + 4 * nb + 8);
    out.extend_from_slice(&scratch[..l.header]);
    for b in &table[..nb] {
        out.extend_from_slice(&b.0.to_le_bytes());
    }
    let sum = xxh64(&out[l.header..]);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

/// What [`pull_sequence`] brought in.
#[derive(Debug, Clone, PartialEq)]
pub struct PulledSequence {
    /// The new sequence on the receiver (its tokens computed).
    pub imported: ImportedSequence,
    /// Full blocks of the sequence this pull registered in the receiver's prefix cache
    /// (0 when the offer carried no token ids; blocks whose content the cache already
    /// held are not counted).
    pub registered_blocks: usize,
    /// The NIXL transfer.
    pub transfer: TransferStats,
}

/// Pulls the sequence an [offer](offer_sequence) describes from `peer` into a new
/// sequence `seq` of `manager`, whose arena `storage` is registered with `agent`; see
/// the module docs for the steps. `timeout` bounds the transfer.
///
/// # Errors
/// Before anything is allocated: as [`SequenceOffer::parse`] and
/// [`SequenceOffer::check_layout`]; [`Error::InvalidConfig`] when `storage` does not
/// have the manager's layout; [`Error::DuplicateSequence`], [`Error::TooLong`],
/// [`Error::OutOfBlocks`] from the admission. After: [`Error::Transport`] or
/// [`Error::TransportTimeout`] from the transfer, [`Error::Checksum`] naming the first
/// block whose received bytes fail their hash. In every case `seq` is not in the
/// manager when this returns (freed if it was admitted), no block was registered in its
/// prefix cache, and the blocks' bytes are unspecified, as any free block's.
///
/// On success, when the offer carries token ids, the sequence's full blocks are in the
/// receiver's prefix cache (default namespace; see the module docs): a later
/// [`KvCache::admit_tokens`] of a prompt that starts with those ids shares them.
pub fn pull_sequence(
    agent: &NixlAgent,
    peer: &str,
    manager: &mut KvCache,
    storage: &mut HostStorage,
    seq: SeqId,
    offer: &[u8],
    timeout: Duration,
) -> Result<PulledSequence> {
    let offer = SequenceOffer::parse(offer)?;
    offer.check_layout(manager.layout())?;
    check_storage(manager, storage)?;
    let n = offer.header.num_tokens();
    // Checked before the sequence exists, so a full arena allocates nothing.
    let (needed, free) = (
        manager.layout().blocks_for_tokens(n),
        manager.num_available_blocks(),
    );
    if needed > free {
        return Err(Error::OutOfBlocks { needed, free });
    }
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    manager.admit(seq, 0, &mut slots)?;
    let filled = fill(
        agent,
        peer,
        manager,
        storage,
        seq,
        &offer,
        timeout,
        &mut slots,
        &mut copies,
    );
    match filled {
        Ok((transfer, registered_blocks)) => Ok(PulledSequence {
            imported: ImportedSequence {
                seq,
                num_tokens: n,
                table: manager.block_table(seq)?.to_vec(),
                token_ids: offer.token_ids,
            },
            transfer,
            registered_blocks,
        }),
        Err(e) => {
            // The sequence was admitted by this call and shares no block: freeing it
            // cannot fail, and if it did, the first error is still the one to report.
            let _ = manager.free(seq);
            Err(e)
        }
    }
}

/// Allocates, transfers, checks, commits and registers the full blocks (when the
/// offer has token ids); returns the transfer and the blocks registered. The caller
/// frees `seq` on error.
#[allow(clippy::too_many_arguments)]
fn fill(
    agent: &NixlAgent,
    peer: &str,
    manager: &mut KvCache,
    storage: &mut HostStorage,
    seq: SeqId,
    offer: &SequenceOffer,
    timeout: Duration,
    slots: &mut Vec<crate::layout::Slot>,
    copies: &mut CopyPlan,
) -> Result<(TransferStats, usize)> {
    let n = offer.header.num_tokens();
    manager.reserve(seq, n, 0, slots, copies)?;
    let table = manager.block_table(seq)?.to_vec();
    let pairs: Vec<(BlockId, BlockId)> = offer
        .table
        .iter()
        .copied()
        .zip(table.iter().copied())
        .collect();
    let transfer = agent.read_blocks(peer, storage, &pairs, timeout)?;
    check_block_hashes(storage, &table, n, &offer.block_hashes)?;
    manager.commit(seq, n)?;
    // Only now, with every block's bytes checked and the tokens computed: a pull that
    // failed above registered nothing. This cannot fail for a sequence admitted and
    // committed just now (its ids start at 0 and are the offer's `n`), and if it did,
    // it changes nothing and the caller frees the sequence.
    let registered = match &offer.token_ids {
        Some(ids) => manager.add_token_ids(seq, 0, ids)?,
        None => 0,
    };
    Ok((transfer, registered))
}

/// Recomputes the export's per-block hashes from the bytes in `storage` (one block's
/// rows at a time, in payload order) and fails on the first that differs.
fn check_block_hashes<S: Storage + ?Sized>(
    storage: &S,
    table: &[BlockId],
    num_tokens: usize,
    hashes: &[u64],
) -> Result<()> {
    let layout = *storage.layout();
    let bs = layout.block_size();
    let row = row_bytes(&layout);
    let v_rows = layout.kind().vectors_per_head() - 1;
    let (mut k, mut v) = (vec![0u8; bs * row], vec![0u8; v_rows * bs * row]);
    for (b, &expected) in hashes.iter().enumerate() {
        let t = (num_tokens - b * bs).min(bs);
        let (k, v) = (&mut k[..t * row], &mut v[..v_rows * t * row]);
        let mut h = xxhash_rust::xxh64::Xxh64::new(0);
        for layer in 0..layout.num_layers() {
            storage.read_tokens(layer, &table[b..=b], t, k, v)?;
            h.update(k);
            h.update(v);
        }
        let got = h.digest();
        if got != expected {
            return Err(Error::Checksum {
                what: format!("KV pulled over NIXL, block {b}"),
                expected,
                got,
            });
        }
    }
    Ok(())
}
