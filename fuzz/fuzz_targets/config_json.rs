//! The `config.json` reader never panics, and what it accepts is a valid shape.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(c) = pagedkv::ModelConfig::from_json_str(text) {
            assert!(c.shape.validate().is_ok());
        }
    }
});
