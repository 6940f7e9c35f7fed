//! Manual timing of the gateway's tokenize step, old (`tokenizers` pipeline) and new (native
//! encoder) paths in one process, with the real SmolLM2 tokenizer.json:
//! `cargo test -p kvgate-tokenize --release --test timing -- --ignored --nocapture`.
//! Performance targets are not asserted here (shared CI cores); this prints ratios.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_protocol::openai::RequestView;
use kvgate_tokenize::{
    ChatTemplate, HfTokenizer, ModelTokenizer, TokenizeError, Tokenizer, TokenizerSpec,
};

/// The `tokenizers` path of the same file: what `HfTokenizer` did before the native encoder.
struct Old(Arc<HfTokenizer>);

impl Tokenizer for Old {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.0.encode_tokenizers(text, false).unwrap_or_default()
    }
    fn decode(&self, ids: &[u32]) -> String {
        self.0.decode(ids)
    }
    fn name(&self) -> &str {
        "hf-tokenizers"
    }
    fn try_encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.0.encode_tokenizers(text, false)
    }
}

/// The 64 request bodies of /work/shared/tools/peers/chat.lua (~1.3 KB each).
fn chat_bodies() -> Vec<String> {
    let sys = "You are a helpful assistant. Answer concisely and accurately. ".repeat(13);
    (1..=64)
        .map(|i| {
            let user = format!("Question {i}: ").to_owned()
                + &format!("tell me about topic {i}. ").repeat(8);
            format!(
                r#"{{"model":"mock-model","max_tokens":16,"messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"{user}"}}]}}"#
            )
        })
        .collect()
}

fn prose(target_bytes: usize) -> String {
    let base = "The router keeps a radix index of the KV blocks each worker holds; when a request \
arrives it tokenizes the prompt, hashes it in blocks of 16 tokens and scores every worker by \
overlap against load. Numbers like 1,024 and 3.14159 appear, as do names (Dynamo, vLLM, SGLang). ";
    let mut s = String::new();
    let mut i = 0u32;
    while s.len() < target_bytes {
        s.push_str(base);
        s.push_str(&format!("Turn {i}. "));
        i += 1;
    }
    s
}

/// Mean time per call of `f` over `iters` calls, best of 3 rounds (after one warm-up round).
fn time(iters: u32, mut f: impl FnMut(u32)) -> Duration {
    (0..4)
        .map(|_| {
            let t0 = Instant::now();
            for i in 0..iters {
                f(i);
            }
            t0.elapsed() / iters
        })
        .skip(1)
        .min()
        .unwrap()
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[test]
#[ignore]
fn tokenize_step_old_vs_native() {
    let p = PathBuf::from(
        std::env::var("KVGATE_REAL_TOKENIZER").unwrap_or("/work/real/tokenizer.json".into()),
    );
    if !p.exists() {
        println!("skipped: no real tokenizer.json at {}", p.display());
        return;
    }
    let hf = Arc::new(HfTokenizer::from_file(&p).unwrap());
    assert!(
        hf.uses_native_encoder(),
        "{:?}",
        hf.native_unsupported_reason()
    );
    let jinja_cfg =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-bpe/tokenizer_config.json");
    let new_chatml = ModelTokenizer::new(hf.clone(), ChatTemplate::chatml());
    let old_chatml = ModelTokenizer::new(Arc::new(Old(hf.clone())), ChatTemplate::chatml());
    let new_jinja = ModelTokenizer::new(
        hf.clone(),
        ChatTemplate::from_tokenizer_config(&jinja_cfg).unwrap(),
    );
    let old_jinja = ModelTokenizer::new(
        Arc::new(Old(hf.clone())),
        ChatTemplate::from_tokenizer_config(&jinja_cfg).unwrap(),
    );
    // The gateway's own loader picks the same backend.
    let spec = TokenizerSpec::Hf {
        tokenizer_json: p.clone(),
        tokenizer_config: None,
    }
    .load()
    .unwrap();
    let bodies = chat_bodies();
    let views: Vec<RequestView<'_>> = bodies
        .iter()
        .map(|b| RequestView::parse(b.as_bytes()).unwrap())
        .collect();
    let texts: Vec<String> = views
        .iter()
        .map(|v| new_chatml.render_chat(v).unwrap())
        .collect();
    let n_tokens = new_chatml.encode_prompt(&views[0]).unwrap().total_len();
    for v in &views {
        assert_eq!(
            new_chatml.encode_prompt(v).unwrap(),
            old_chatml.encode_prompt(v).unwrap()
        );
        assert_eq!(
            spec.encode_prompt(v).unwrap(),
            new_chatml.encode_prompt(v).unwrap()
        );
        assert_eq!(
            new_jinja.encode_prompt(v).unwrap(),
            old_jinja.encode_prompt(v).unwrap()
        );
    }
    let k = |i: u32| (i % 64) as usize;
    let iters = 2000;
    let parse = time(iters, |i| {
        black_box(RequestView::parse(black_box(bodies[k(i)].as_bytes())).unwrap());
    });
    let render_chatml = time(iters, |i| {
        black_box(new_chatml.render_chat(&views[k(i)]).unwrap());
    });
    let render_jinja = time(iters, |i| {
        black_box(new_jinja.render_chat(&views[k(i)]).unwrap());
    });
    let enc_old = time(iters / 4, |i| {
        black_box(hf.encode_tokenizers(&texts[k(i)], false).unwrap());
    });
    let enc_new = time(iters, |i| {
        black_box(hf.try_encode(&texts[k(i)]).unwrap());
    });
    let whole_old = time(iters / 4, |i| {
        black_box(old_chatml.encode_prompt(&views[k(i)]).unwrap());
    });
    let whole_new = time(iters, |i| {
        black_box(new_chatml.encode_prompt(&views[k(i)]).unwrap());
    });
    let whole_jinja_new = time(iters, |i| {
        black_box(new_jinja.encode_prompt(&views[k(i)]).unwrap());
    });
    let approx = kvgate_tokenize::ApproxTokenizer::default();
    let enc_approx = time(iters, |i| {
        black_box(approx.encode(black_box(&texts[k(i)])));
    });
    // Every body new: only the system prompt's segment is in the segment cache.
    let unique: Vec<String> = (0..4 * iters)
        .map(|i| texts[k(i)].replace("Question", &format!("Question {i}")))
        .collect();
    let mut next = unique.iter();
    let enc_unique = time(iters, |_| {
        black_box(hf.try_encode(next.next().unwrap()).unwrap());
    });
    println!(
        "(a) 1.3 KB chat ({} bytes body, {} bytes rendered, {n_tokens} tokens), 64 rotating bodies:",
        bodies[0].len(),
        texts[0].len()
    );
    println!("    parse RequestView           {:8.2} µs", us(parse));
    println!(
        "    render ChatML (native)      {:8.2} µs",
        us(render_chatml)
    );
    println!(
        "    render Jinja (fixture tmpl) {:8.2} µs",
        us(render_jinja)
    );
    println!(
        "    encode: tokenizers {:8.2} µs, native {:8.2} µs  -> {:.1}x",
        us(enc_old),
        us(enc_new),
        us(enc_old) / us(enc_new)
    );
    println!(
        "    encode: approx {:8.2} µs; native with new user text each time {:8.2} µs",
        us(enc_approx),
        us(enc_unique)
    );
    println!(
        "    encode_prompt (ChatML): old {:8.2} µs, new {:8.2} µs -> {:.1}x; Jinja new {:8.2} µs",
        us(whole_old),
        us(whole_new),
        us(whole_old) / us(whole_new),
        us(whole_jinja_new)
    );

    let text = prose(32 * 1024);
    let n = hf.try_encode(&text).unwrap().len();
    assert_eq!(
        hf.try_encode(&text).unwrap(),
        hf.encode_reference(&text, false).unwrap()
    );
    let reference = time(5, |_| {
        black_box(hf.encode_reference(black_box(&text), false).unwrap());
    });
    let old = time(5, |_| {
        black_box(hf.encode_tokenizers(black_box(&text), false).unwrap());
    });
    // A new text each call (a distinct first line), so the segment cache cannot answer: the
    // words are known (word cache), the segment is not.
    let fresh: Vec<String> = (0..80).map(|i| format!("{i}\n{text}")).collect();
    let mut next = fresh.iter();
    let new = time(20, |_| {
        black_box(hf.try_encode(next.next().unwrap()).unwrap());
    });
    let hit = time(20, |_| {
        black_box(hf.try_encode(black_box(&text)).unwrap());
    });
    // Mostly cold caches: every word gets a distinct letter suffix (digits would be split off).
    let letters = |mut n: u32| {
        let mut s = String::new();
        while n > 0 {
            s.push(char::from(b'a' + (n % 26) as u8));
            n /= 26;
        }
        s
    };
    let cold_texts: Vec<String> = (0..5)
        .map(|r| {
            text.split(' ')
                .enumerate()
                .map(|(i, w)| format!("{w}{}", letters(i as u32 * 7919 + r * 104_729 + 1)))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let cold_old = cold_texts
        .iter()
        .map(|t| {
            let t0 = Instant::now();
            black_box(hf.encode_tokenizers(t, false).unwrap());
            t0.elapsed()
        })
        .min()
        .unwrap();
    let cold_new = cold_texts
        .iter()
        .map(|t| {
            let t0 = Instant::now();
            black_box(hf.try_encode(t).unwrap());
            t0.elapsed()
        })
        .min()
        .unwrap();
    println!("(b) prose, {} bytes, {n} tokens:", text.len());
    println!(
        "    stock regex {:8.0} µs, tokenizers+fast split {:8.0} µs, native {:8.0} µs -> {:.1}x vs tokenizers path, {:.1}x vs stock",
        us(reference),
        us(old),
        us(new),
        us(old) / us(new),
        us(reference) / us(new)
    );
    println!(
        "    the same text again (segment cache hit) {:8.1} µs",
        us(hit)
    );
    println!(
        "    mostly-unseen words ({} bytes): tokenizers {:8.0} µs, native {:8.0} µs -> {:.1}x",
        cold_texts[0].len(),
        us(cold_old),
        us(cold_new),
        us(cold_old) / us(cold_new)
    );
}
