//! A receiver reading an export from a stream parses the header from its first bytes:
//! a wrong magic or version is named as such as soon as those fields are in, before the
//! fixed header is complete (`ExportHeader::parse`'s documented order). cargo-mutants
//! found this untested: checking the version only from byte 32 on passed every test.

use pagedkv::export::{
    export_sequence, exported_len, ExportHeader, EXPORT_VERSION, HEADER_FIXED_BYTES,
};
use pagedkv::{DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId};

fn good_export() -> Vec<u8> {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    let layout = KvLayout::new(shape, 4).unwrap();
    let mut kv = KvCache::builder(layout).num_blocks(4).build().unwrap();
    let st = HostStorage::new(layout, 4).unwrap();
    kv.admit(SeqId(1), 6, &mut Vec::new()).unwrap();
    let mut buf = vec![0u8; exported_len(&layout, 6, false).unwrap()];
    export_sequence(&kv, &st, SeqId(1), None, &mut buf).unwrap();
    buf
}

#[test]
fn a_short_header_names_a_wrong_magic_or_version_before_truncation() {
    let good = good_export();
    let mut newer = good.clone();
    newer[8..12].copy_from_slice(&(EXPORT_VERSION + 1).to_le_bytes());
    let mut other = good.clone();
    other[..8].copy_from_slice(b"GGUF\x03\0\0\0");
    for len in 0..HEADER_FIXED_BYTES {
        let what = |buf: &[u8]| match ExportHeader::parse(&buf[..len]) {
            Err(Error::ExportFormat { what, .. }) => what,
            Err(Error::ExportTruncated { needed, got }) => {
                assert_eq!((needed, got), (HEADER_FIXED_BYTES, len));
                "truncated"
            }
            other => panic!("{len} bytes: {other:?}"),
        };
        assert_eq!(what(&good), "truncated", "{len} bytes of a good export");
        let version = if len >= 12 { "version" } else { "truncated" };
        assert_eq!(what(&newer), version, "{len} bytes of a newer version");
        let magic = if len >= 8 { "magic" } else { "truncated" };
        assert_eq!(what(&other), magic, "{len} bytes of another format");
    }
}
