#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvdiff::fuzz::index(data));
