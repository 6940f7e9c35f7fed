#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvgate_http::fuzz::response_head(data));
