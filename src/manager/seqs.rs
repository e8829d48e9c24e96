//! The manager's sequences: a slab addressed by [`SeqHandle`]s with a generation, and
//! the `SeqId -> slot` map kept at the API edge.
//!
//! The per-token path (a batch append by handle) reaches a sequence by index: no
//! hashing, and the sequence never moves while it is resident. Calls that name a
//! sequence by [`SeqId`] hash once, at the edge, then work on the slot. A slot's
//! generation changes when its sequence leaves (free, swap-out), so a handle kept past
//! that is refused rather than pointed at whoever reuses the slot.

use super::{SeqMap, Sequence};
use crate::error::{Error, Result};
use crate::ids::{SeqHandle, SeqId};

/// Aligned to a cache line: the sequence's decode fields are its first line (see
/// `Sequence`), the rest of it, the generation and the batch stamp the second (two
/// lines in all: a batch call's passes over its sequences read 128 bytes of each).
#[derive(Clone)]
#[repr(C, align(64))]
struct Slot {
    seq: Option<Sequence>,
    generation: u32,
    id: SeqId,
    /// Marks the batch call that last named this slot (duplicate detection).
    stamp: u64,
}

/// See the module docs. The map-like methods mirror `HashMap`'s so that callers
/// reading by id need not know the storage.
#[derive(Clone, Default)]
pub(crate) struct Seqs {
    slots: Vec<Slot>,
    vacant: Vec<u32>,
    index: SeqMap<u32>,
    stamp: u64,
}

// The batch stamps are scratch of the call that set them, not state: a refused batch
// call that marked its entries shows nothing changed.
impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("seq", &self.seq)
            .field("generation", &self.generation)
            .field("id", &self.id)
            .finish()
    }
}

impl std::fmt::Debug for Seqs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seqs")
            .field("slots", &self.slots)
            .field("vacant", &self.vacant)
            .field("index", &self.index)
            .finish()
    }
}

impl Seqs {
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn contains_key(&self, id: &SeqId) -> bool {
        self.index.contains_key(id)
    }

    /// The handle of resident sequence `id`.
    #[inline]
    pub(crate) fn handle(&self, id: &SeqId) -> Option<SeqHandle> {
        let &index = self.index.get(id)?;
        Some(SeqHandle {
            index,
            generation: self.slots[index as usize].generation,
        })
    }

    pub(crate) fn get(&self, id: &SeqId) -> Option<&Sequence> {
        let &i = self.index.get(id)?;
        self.slots[i as usize].seq.as_ref()
    }

    pub(crate) fn get_mut(&mut self, id: &SeqId) -> Option<&mut Sequence> {
        let &i = self.index.get(id)?;
        self.slots[i as usize].seq.as_mut()
    }

    /// The sequence `h` names, with its id, while it is the one the handle was made for.
    #[inline]
    pub(crate) fn at(&self, h: SeqHandle) -> Option<(SeqId, &Sequence)> {
        let slot = self.slots.get(h.index as usize)?;
        if slot.generation != h.generation {
            return None;
        }
        slot.seq.as_ref().map(|s| (slot.id, s))
    }

    /// As [`Self::at`], mutably.
    #[inline]
    pub(crate) fn at_mut(&mut self, h: SeqHandle) -> Option<&mut Sequence> {
        let slot = self.slots.get_mut(h.index as usize)?;
        if slot.generation != h.generation {
            return None;
        }
        slot.seq.as_mut()
    }

    /// Starts a batch call: later [`Self::mark`]s of this call see each other.
    pub(crate) fn begin_batch(&mut self) {
        self.stamp += 1;
    }

    /// Marks slot `h` for the current batch; `false` when it already was (the handle
    /// is listed twice). `h` must be valid.
    pub(crate) fn mark(&mut self, h: SeqHandle) -> bool {
        match self.slots.get_mut(h.index as usize) {
            Some(slot) if slot.stamp != self.stamp => {
                slot.stamp = self.stamp;
                true
            }
            _ => false,
        }
    }

    /// [`Self::at_mut`] and [`Self::mark`] in one look-up: the sequence `h` names, its
    /// id, and whether the current batch call had not named it before (it is marked
    /// now either way).
    #[inline]
    pub(crate) fn at_mut_marking(&mut self, h: SeqHandle) -> Option<(SeqId, &mut Sequence, bool)> {
        let stamp = self.stamp;
        let slot = self.slots.get_mut(h.index as usize)?;
        if slot.generation != h.generation {
            return None;
        }
        let first = slot.stamp != stamp;
        slot.stamp = stamp;
        slot.seq.as_mut().map(|s| (slot.id, s, first))
    }

    /// Makes sure `n` sequences can be inserted without growing past the handle
    /// space (`u32` slot indices): calls that add sequences check this before they
    /// change anything. Adds vacant slots, which nobody observes.
    ///
    /// # Errors
    /// [`Error::TooManySequences`].
    pub(crate) fn reserve_room(&mut self, n: usize) -> Result<()> {
        while self.vacant.len() < n {
            let i = u32::try_from(self.slots.len())
                .ok()
                .filter(|&i| i < u32::MAX)
                .ok_or(Error::TooManySequences {
                    limit: u32::MAX as usize,
                })?;
            self.slots.push(Slot {
                id: SeqId::default(),
                generation: 0,
                stamp: 0,
                seq: None,
            });
            self.vacant.push(i);
        }
        Ok(())
    }

    /// Adds `id`; a sequence already under `id` is replaced in place (same handle).
    ///
    /// # Errors
    /// [`Error::TooManySequences`] (never after [`Self::reserve_room`]).
    pub(crate) fn insert(&mut self, id: SeqId, seq: Sequence) -> Result<SeqHandle> {
        if let Some(h) = self.handle(&id) {
            self.slots[h.index as usize].seq = Some(seq);
            return Ok(h);
        }
        self.reserve_room(1)?;
        let index = self.vacant.pop().ok_or(Error::TooManySequences {
            limit: u32::MAX as usize,
        })?;
        let slot = &mut self.slots[index as usize];
        slot.id = id;
        slot.seq = Some(seq);
        let generation = slot.generation;
        self.index.insert(id, index);
        Ok(SeqHandle { index, generation })
    }

    /// Removes `id`; its handle goes stale.
    pub(crate) fn remove(&mut self, id: &SeqId) -> Option<Sequence> {
        let i = self.index.remove(id)?;
        let slot = &mut self.slots[i as usize];
        slot.generation = slot.generation.wrapping_add(1);
        self.vacant.push(i);
        slot.seq.take()
    }

    /// Takes the sequence out of its slot for an operation that must not see it in
    /// the tables it scans (a release that recounts a block's holders); the slot
    /// keeps its id and handle and holds an empty sequence until [`Self::put`].
    pub(crate) fn take(&mut self, h: SeqHandle) -> Option<Sequence> {
        self.at_mut(h).map(std::mem::take)
    }

    /// Puts back what [`Self::take`] took.
    pub(crate) fn put(&mut self, h: SeqHandle, seq: Sequence) {
        if let Some(s) = self.at_mut(h) {
            *s = seq;
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&SeqId, &Sequence)> + '_ {
        self.slots
            .iter()
            .filter_map(|slot| slot.seq.as_ref().map(|s| (&slot.id, s)))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &SeqId> + '_ {
        self.iter().map(|(id, _)| id)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Sequence> + '_ {
        self.slots.iter().filter_map(|slot| slot.seq.as_ref())
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut Sequence> + '_ {
        self.slots.iter_mut().filter_map(|slot| slot.seq.as_mut())
    }

    /// The slab against its index: every id leads to an occupied slot under that id and
    /// every occupied slot is indexed.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let occupied = self.slots.iter().filter(|s| s.seq.is_some()).count();
        if occupied != self.index.len() || occupied + self.vacant.len() != self.slots.len() {
            return Err(format!(
                "{occupied} occupied slots, {} indexed, {} vacant of {}",
                self.index.len(),
                self.vacant.len(),
                self.slots.len()
            ));
        }
        for (id, &i) in &self.index {
            match self.slots.get(i as usize) {
                Some(slot) if slot.id == *id && slot.seq.is_some() => {}
                _ => return Err(format!("{id} is indexed to slot {i}, which is not its own")),
            }
        }
        Ok(())
    }
}

impl<'a> IntoIterator for &'a Seqs {
    type Item = (&'a SeqId, &'a Sequence);
    type IntoIter = Box<dyn Iterator<Item = (&'a SeqId, &'a Sequence)> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_two_cache_lines() {
        assert_eq!(std::mem::size_of::<Slot>(), 128);
    }
}
