#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvgate_protocol::fuzz::request_body(data));
