//! `kvgate bench flow`: flow control off, on, and on with priority to the engine, side by side in
//! one run, on one simulated fleet (docs/flow-control.md). The gateway's busy bound
//! (`routing.max_inflight_per_worker`) makes `workers × max_inflight` slots; every phase runs
//! once per mode, each against a fresh gateway: `[flow_control]` off (today's FIFO queue), on,
//! and on with `forward_priority = ["vllm"]` + `bypass_busy_priority = 10` (the sims run
//! `--scheduling-policy priority`; requests without `priority` are first come, first served):
//!
//! 1. `idle`: an interactive class alone, closed loop at 20% of the slots: its TTFT floor.
//! 2. `flood`: the same interactive load while a batch class floods at 3× the slots: interactive
//!    TTFT p99 (and its ratio to idle), the share meeting the TTFT objective, batch throughput.
//! 3. `shedding`: the interactive load, batch on half the rest of the slots (closed loop) and a
//!    sheddable class arriving at half the slots' request rate (open loop): sheddable requests
//!    admitted and shed, higher-class requests shed (flow control: 0), interactive requests over
//!    their objective.
//! 4. `shares`: three batch tenants with weights 2:1:1, each saturating (closed loop at the
//!    slots) for `--shares-s` (default 60 s): the served tokens' shares.
//!
//! Requests carry their class (`x-kvgate-priority`) and tenant (`x-kvgate-tenant`) as headers;
//! prompts are random (no cache reuse), outputs exact (`ignore_eos`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::client::{Api, Target};
use crate::compare::children::{free_port, ChildGuard};
use crate::compare::{kvgate_exe, Fleet, FleetArgs};
use crate::runner::{run, Arrival, RunConfig, RunResult};
use crate::stats::{new_histogram, percentiles, record};
use crate::workload::{Request, Workload, TOKEN_HI, TOKEN_LO};

#[derive(Args, Debug)]
pub struct FlowArgs {
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Model name the sims serve.
    #[arg(long, default_value = "kvgate-sim")]
    pub model: String,
    /// The gateway's busy bound per worker (`routing.max_inflight_per_worker`): the slots.
    #[arg(long, default_value_t = 4)]
    pub max_inflight: u32,
    /// Seconds each phase sends for (requests in flight then finish); the shares phase has its own.
    #[arg(long, default_value_t = 20)]
    pub phase_s: u64,
    /// Seconds the three tenants saturate the fleet in the shares phase.
    #[arg(long, default_value_t = 60)]
    pub shares_s: u64,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub output_len: u32,
    /// The interactive class's TTFT objective (attainment is reported against it).
    #[arg(long, default_value_t = 200)]
    pub objective_ms: u64,
    /// Where the gateways' configs and logs go.
    #[arg(long, default_value = "bench-flow")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// One mode's figures.
#[derive(Debug, Default, Clone)]
struct Figures {
    idle_p99_ms: f64,
    flood_p99_ms: f64,
    /// Under the flood, the interactive requests split by whether they arrived while another
    /// interactive request awaited its first token (the class's own prefill in the way): the
    /// share that did, and the TTFT p99 of each part.
    flood_overlap_share: f64,
    flood_overlap_p99_ms: f64,
    flood_alone_p99_ms: f64,
    flood_attainment: f64,
    interactive_errors: u64,
    batch_errors: u64,
    batch_out_tok_s: f64,
    interactive_out_tok_s: f64,
    saturated_out_tok_s: f64,
    shares: [f64; 3],
    /// Shedding phase: sheddable requests admitted and shed (429), higher-class (interactive and
    /// batch) requests shed, and the share of interactive requests over their objective.
    shed_admitted: u64,
    shed_shed: u64,
    higher_shed: u64,
    higher_failed: u64,
    shed_interactive_over: f64,
}

fn workload(n: usize, prompt: usize, out: u32, seed: u64) -> Workload {
    let mut rng = fastrand::Rng::with_seed(seed);
    Workload {
        name: "flow".into(),
        requests: (0..n)
            .map(|_| Request {
                at: None,
                prompt: (0..prompt).map(|_| rng.u32(TOKEN_LO..TOKEN_HI)).collect(),
                max_tokens: out,
                turn: None,
                sim_cached_tokens: None,
            })
            .collect(),
    }
}

/// The gateway's config for one mode.
/// How a mode's gateway runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `[flow_control]` off: one FIFO queue.
    Off,
    /// Flow control in the gateway's queue.
    On,
    /// And the class priority forwarded to the sims (`--scheduling-policy priority`), the
    /// interactive class past the busy bound.
    Engine,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Off => "serve-flow-off",
            Mode::On => "serve-flow-on",
            Mode::Engine => "serve-flow-engine",
        }
    }
}

fn gateway_toml(a: &FlowArgs, listen: &str, urls: &[String], mode: Mode) -> String {
    let flow = mode != Mode::Off;
    let mut t = format!(
        "# Generated by kvgate bench flow.\n[server]\nlisten = \"{listen}\"\nrequest_log = false\n\
         [routing]\npolicy = \"least_loaded\"\nmax_inflight_per_worker = {}\n\
         [admission]\nqueue_size = 100000\nqueue_timeout_ms = 600000\n",
        a.max_inflight
    );
    if flow {
        t.push_str(&format!(
            "[flow_control]\nenabled = true\nexpected_output_tokens = {}\n\
             [flow_control.tenants]\na = 2.0\nb = 1.0\nc = 1.0\n\
             [[flow_control.classes]]\nname = \"interactive\"\npriority = 10\nttft_ms = {}\n\
             [[flow_control.classes]]\nname = \"batch\"\npriority = 0\n\
             [[flow_control.classes]]\nname = \"sheddable\"\npriority = -1\n",
            a.output_len, a.objective_ms
        ));
    }
    if mode == Mode::Engine {
        // Inside [flow_control] (appended before the class tables would be a TOML error: the
        // keys go right after the section's scalars, so re-open nothing and use dotted keys).
        t = t.replace(
            "[flow_control]\nenabled = true\n",
            "[flow_control]\nenabled = true\nforward_priority = [\"vllm\"]\nbypass_busy_priority = 10\n",
        );
    }
    for (i, u) in urls.iter().enumerate() {
        t.push_str(&format!(
            "[[workers]]\nurl = \"{u}\"\nname = \"sim-{i}\"\nkind = \"vllm\"\nmodels = [\"{}\"]\n",
            a.model
        ));
    }
    t
}

async fn closed(
    target: &Target,
    wl: &Workload,
    concurrency: usize,
    secs: u64,
) -> anyhow::Result<RunResult> {
    run(
        target,
        wl,
        &RunConfig {
            arrival: Arrival::Closed { concurrency },
            max_requests: None,
            duration: Some(Duration::from_secs(secs)),
            progress: false,
        },
    )
    .await
}

fn p99_ttft_ms(r: &RunResult) -> f64 {
    let mut h = new_histogram();
    for o in r.outcomes.iter().filter(|o| o.ok()) {
        if let Some(t) = o.ttft {
            record(&mut h, t);
        }
    }
    percentiles(&h).p99
}

/// The successful requests of `r` split by whether each was sent while another of `r`'s requests
/// was still waiting for its first token: `(overlapped, alone)` TTFT p99s in ms and the
/// overlapped share of the requests with a TTFT.
fn overlap_split(r: &RunResult) -> (f64, f64, f64) {
    let done: Vec<(Duration, Duration)> = r
        .outcomes
        .iter()
        .filter(|o| o.ok())
        .filter_map(|o| Some((o.sent_at, o.ttft?)))
        .collect();
    let (mut over, mut alone) = (new_histogram(), new_histogram());
    let mut n_over = 0usize;
    for (i, &(sent, ttft)) in done.iter().enumerate() {
        let overlapped = done
            .iter()
            .enumerate()
            .any(|(j, &(s, t))| j != i && s <= sent && sent < s + t);
        if overlapped {
            n_over += 1;
            record(&mut over, ttft);
        } else {
            record(&mut alone, ttft);
        }
    }
    let p99 = |h: &hdrhistogram::Histogram<u64>| {
        if h.is_empty() {
            0.0
        } else {
            percentiles(h).p99
        }
    };
    (
        p99(&over),
        p99(&alone),
        n_over as f64 / done.len().max(1) as f64,
    )
}

fn errors(r: &RunResult) -> u64 {
    r.outcomes.iter().filter(|o| !o.ok()).count() as u64
}

fn out_tok_s(r: &RunResult, over: Duration) -> f64 {
    let t: u64 = r
        .outcomes
        .iter()
        .filter(|o| o.ok())
        .map(|o| o.output_tokens)
        .sum();
    t as f64 / over.as_secs_f64().max(1e-9)
}

async fn mode(a: &FlowArgs, fleet: &Fleet, mode: Mode) -> anyhow::Result<Figures> {
    let exe = kvgate_exe(&a.fleet)?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let name = mode.name();
    std::fs::create_dir_all(&a.out)?;
    let cfg = a.out.join(format!("{name}.toml"));
    std::fs::write(&cfg, gateway_toml(a, &listen, &fleet.urls, mode))?;
    let args = vec![
        "serve".to_string(),
        "--config".into(),
        cfg.to_string_lossy().into_owned(),
    ];
    let mut gw = ChildGuard::spawn(&exe, &args, name, &a.out)?;
    let url = format!("http://{listen}");
    gw.wait_http_ok(&format!("{url}/ready"), Duration::from_secs(60))
        .await?;
    let result = async {
        let base = Target::new(&url, &a.model, Api::Completions, Duration::from_secs(600))?;
        let interactive = base.with_headers(&[("x-kvgate-priority", "10")])?;
        let batch = base.with_headers(&[("x-kvgate-priority", "0")])?;
        let slots = fleet.urls.len() * a.max_inflight as usize;
        let ci = ((slots as f64 * 0.2).round() as usize).max(1);
        let n = 8000;
        let (p, o) = (a.prompt_tokens, a.output_len);
        let mut f = Figures::default();

        let idle = closed(&interactive, &workload(n, p, o, a.seed), ci, a.phase_s).await?;
        f.idle_p99_ms = p99_ttft_ms(&idle);

        let (wi, wb) = (
            workload(n, p, o, a.seed + 1),
            workload(n * 3, p, o, a.seed + 2),
        );
        let (inter, flood) = tokio::join!(
            closed(&interactive, &wi, ci, a.phase_s),
            closed(&batch, &wb, 3 * slots, a.phase_s),
        );
        let (inter, flood) = (inter?, flood?);
        let objective = Duration::from_millis(a.objective_ms);
        let ok: Vec<_> = inter.outcomes.iter().filter(|o| o.ok()).collect();
        f.flood_p99_ms = p99_ttft_ms(&inter);
        (
            f.flood_overlap_p99_ms,
            f.flood_alone_p99_ms,
            f.flood_overlap_share,
        ) = overlap_split(&inter);
        f.flood_attainment = ok
            .iter()
            .filter(|o| o.ttft.is_some_and(|t| t <= objective))
            .count() as f64
            / inter.outcomes.len().max(1) as f64;
        f.interactive_errors = errors(&inter);
        f.batch_errors = errors(&flood);
        let window = Duration::from_secs(a.phase_s);
        f.batch_out_tok_s = out_tok_s(&flood, window);
        f.interactive_out_tok_s = out_tok_s(&inter, window);

        // Shedding: batch takes half the slots the interactive class leaves; sheddable requests
        // arrive at half the slots' request rate (from the idle phase's per-slot rate): the
        // fleet is saturated part of the time, so some sheddable requests find room.
        let sheddable = base.with_headers(&[("x-kvgate-priority", "-1")])?;
        let per_slot = idle.outcomes.len() as f64 / window.as_secs_f64() / ci as f64;
        let rate = (0.5 * slots as f64 * per_slot).max(0.5);
        let (wi, wb, ws) = (
            workload(n, p, o, a.seed + 6),
            workload(n, p, o, a.seed + 7),
            workload(n, p, o, a.seed + 8),
        );
        let open_loop = RunConfig {
            arrival: Arrival::Poisson {
                rate,
                seed: a.seed + 9,
            },
            max_requests: None,
            duration: Some(window),
            progress: false,
        };
        let (inter, fill, shed) = tokio::join!(
            closed(&interactive, &wi, ci, a.phase_s),
            closed(
                &batch,
                &wb,
                (slots.saturating_sub(ci) / 2).max(1),
                a.phase_s
            ),
            run(&sheddable, &ws, &open_loop),
        );
        let (inter, fill, shed) = (inter?, fill?, shed?);
        let is_shed = |o: &&crate::stats::Outcome| o.error.as_deref() == Some("http_429");
        f.shed_admitted = shed.outcomes.iter().filter(|o| o.ok()).count() as u64;
        f.shed_shed = shed.outcomes.iter().filter(is_shed).count() as u64;
        let higher = || inter.outcomes.iter().chain(fill.outcomes.iter());
        f.higher_shed = higher().filter(is_shed).count() as u64;
        f.higher_failed = higher().filter(|o| !o.ok()).count() as u64;
        f.shed_interactive_over = inter
            .outcomes
            .iter()
            .filter(|o| o.ttft.is_none_or(|t| t > objective))
            .count() as f64
            / inter.outcomes.len().max(1) as f64;

        let tenant =
            |t: &str| batch.with_headers(&[("x-kvgate-priority", "0"), ("x-kvgate-tenant", t)]);
        let (ta, tb, tc) = (tenant("a")?, tenant("b")?, tenant("c")?);
        let (wa, wb, wc) = (
            workload(n, p, o, a.seed + 3),
            workload(n, p, o, a.seed + 4),
            workload(n, p, o, a.seed + 5),
        );
        let (ra, rb, rc) = tokio::join!(
            closed(&ta, &wa, slots, a.shares_s),
            closed(&tb, &wb, slots, a.shares_s),
            closed(&tc, &wc, slots, a.shares_s),
        );
        let runs = [ra?, rb?, rc?];
        let window = Duration::from_secs(a.shares_s);
        // Tokens served while all three were saturating: requests sent in the window.
        let served: Vec<f64> = runs
            .iter()
            .map(|r| {
                r.outcomes
                    .iter()
                    .filter(|o| o.ok() && o.sent_at < window)
                    .map(|o| (o.prompt_tokens + o.output_tokens) as f64)
                    .sum()
            })
            .collect();
        let total: f64 = served.iter().sum::<f64>().max(1.0);
        f.shares = [served[0] / total, served[1] / total, served[2] / total];
        f.saturated_out_tok_s = runs.iter().map(|r| out_tok_s(r, window)).sum();
        anyhow::Ok(f)
    }
    .await;
    gw.stop().await;
    result
}

/// What the engines cannot do faster, from the sims' own timing model (docs/sim.md): the
/// interactive request's prefill step, and the steps it may find running when it arrives. With
/// priority scheduling and nothing queued ahead in the gateway, its first token comes at best
/// after the step in progress ends and its own prefill step runs: a decode step when it goes to a
/// worker with no prefill pending, a batch request's prefill step otherwise.
#[derive(Debug, Clone, Copy)]
struct Floor {
    prefill_ms: f64,
    decode_ms: f64,
}

impl Floor {
    fn new(a: &FlowArgs) -> Floor {
        let m = kvgate_sim::TimingModel::default();
        let speedup = a.fleet.speedup.max(1e-9);
        // KV in use with a worker's batch slots full (and one interactive request): the decode
        // step's cost grows with it.
        let tokens = (a.max_inflight as usize + 1) * (a.prompt_tokens + a.output_len as usize);
        let usage =
            (tokens as f64 / (a.fleet.num_gpu_blocks * a.fleet.block_size).max(1) as f64).min(1.0);
        Floor {
            prefill_ms: m.step_ms(a.prompt_tokens, a.max_inflight as usize, usage) / speedup,
            decode_ms: m.step_ms(0, a.max_inflight as usize, usage) / speedup,
        }
    }
}

/// The report: one row per figure, flow control off and on side by side.
fn table(a: &FlowArgs, slots: usize, off: &Figures, on: &Figures, engine: &Figures) -> String {
    let floor = Floor::new(a);
    let mut t = format!(
        "kvgate bench flow: {} workers × max_inflight {} = {slots} slots; interactive at {} \
         (20%) of the slots, batch flood at {}, three saturating tenants at {slots} each; \
         {} s per phase ({} s for the shares), {}+{} tokens per request\n\n| figure | flow control off (FIFO) | flow control on | on + priority to the engine |\n|---|---|---|---|\n",
        a.fleet.workers,
        a.max_inflight,
        ((slots as f64 * 0.2).round() as usize).max(1),
        3 * slots,
        a.phase_s,
        a.shares_s,
        a.prompt_tokens,
        a.output_len
    );
    let row = |t: &mut String, name: &str, f: &dyn Fn(&Figures) -> String| {
        t.push_str(&format!(
            "| {name} | {} | {} | {} |\n",
            f(off),
            f(on),
            f(engine)
        ));
    };
    row(&mut t, "interactive TTFT p99 idle (ms)", &|f| {
        format!("{:.0}", f.idle_p99_ms)
    });
    row(
        &mut t,
        "interactive TTFT p99 under 3x batch flood (ms)",
        &|f| format!("{:.0}", f.flood_p99_ms),
    );
    row(&mut t, "  ratio flood / idle", &|f| {
        format!("{:.2}", f.flood_p99_ms / f.idle_p99_ms.max(1e-9))
    });
    row(
        &mut t,
        "  arriving while another interactive request awaited its first token",
        &|f| format!("{:.1}%", f.flood_overlap_share * 100.0),
    );
    row(&mut t, "  p99 of those / of the others (ms)", &|f| {
        format!(
            "{:.0} / {:.0}",
            f.flood_overlap_p99_ms, f.flood_alone_p99_ms
        )
    });
    row(&mut t, "  ratio of the others' p99 to idle", &|f| {
        format!("{:.2}", f.flood_alone_p99_ms / f.idle_p99_ms.max(1e-9))
    });
    row(
        &mut t,
        &format!(
            "interactive meeting {} ms TTFT under the flood",
            a.objective_ms
        ),
        &|f| format!("{:.1}%", f.flood_attainment * 100.0),
    );
    row(&mut t, "batch output tok/s under the flood", &|f| {
        format!("{:.0}", f.batch_out_tok_s)
    });
    row(
        &mut t,
        "  batch / (saturated − interactive) capacity",
        &|f| {
            format!(
                "{:.2}",
                f.batch_out_tok_s / (f.saturated_out_tok_s - f.interactive_out_tok_s).max(1e-9)
            )
        },
    );
    row(&mut t, "failed requests (interactive, batch)", &|f| {
        format!("{}, {}", f.interactive_errors, f.batch_errors)
    });
    row(&mut t, "shedding: sheddable admitted / shed (429)", &|f| {
        format!("{} / {}", f.shed_admitted, f.shed_shed)
    });
    row(
        &mut t,
        "  higher-class (interactive, batch) shed / failed",
        &|f| format!("{} / {}", f.higher_shed, f.higher_failed),
    );
    row(
        &mut t,
        &format!(
            "  interactive over its {} ms objective meanwhile",
            a.objective_ms
        ),
        &|f| format!("{:.1}%", f.shed_interactive_over * 100.0),
    );
    row(
        &mut t,
        "  engine floor: idle p99 + one decode step (ms)",
        &|f| format!("{:.0}", f.idle_p99_ms + floor.decode_ms),
    );
    row(
        &mut t,
        "  floor ratio / measured ratio (target 1.3)",
        &|f| {
            format!(
                "{:.2} / {:.2}",
                (f.idle_p99_ms + floor.decode_ms) / f.idle_p99_ms.max(1e-9),
                f.flood_p99_ms / f.idle_p99_ms.max(1e-9)
            )
        },
    );
    row(&mut t, "tenant token shares a:b:c (weights 2:1:1)", &|f| {
        format!(
            "{:.1}% / {:.1}% / {:.1}%",
            f.shares[0] * 100.0,
            f.shares[1] * 100.0,
            f.shares[2] * 100.0
        )
    });
    t.push_str(&format!(
        "\nEngine floor (the sims' timing model): a prefill step (interactive or batch: same \
         prompt) {:.1} ms; the step an interactive request may find running when it arrives: a \
         decode step {:.1} ms, or a batch prefill step (on a worker where one is pending). Floor \
         row: the idle p99 plus one decode step.\n",
        floor.prefill_ms, floor.decode_ms
    ));
    t
}

pub async fn run_flow(mut a: FlowArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.max_inflight > 0, "--max-inflight must be > 0");
    anyhow::ensure!(a.phase_s > 0, "--phase-s must be > 0");
    anyhow::ensure!(a.shares_s > 0, "--shares-s must be > 0");
    // Requests without `priority` (the first two modes) are scheduled first come, first served.
    a.fleet
        .sim_args
        .extend(["--scheduling-policy".to_string(), "priority".to_string()]);
    let fleet = Fleet::start(&a.fleet, &a.model, false, &a.out).await?;
    let res = async {
        let off = mode(&a, &fleet, Mode::Off).await?;
        let on = mode(&a, &fleet, Mode::On).await?;
        let engine = mode(&a, &fleet, Mode::Engine).await?;
        anyhow::Ok((off, on, engine))
    }
    .await;
    let slots = fleet.urls.len() * a.max_inflight as usize;
    fleet.stop().await;
    let (off, on, engine) = res?;
    let report = table(&a, slots, &off, &on, &engine);
    print!("{report}");
    std::fs::write(a.out.join("flow.md"), &report)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(sent_ms: u64, ttft_ms: Option<u64>, ok: bool) -> crate::stats::Outcome {
        crate::stats::Outcome {
            sent_at: Duration::from_millis(sent_ms),
            ttft: ttft_ms.map(Duration::from_millis),
            itl: Vec::new(),
            e2e: Duration::from_millis(ttft_ms.unwrap_or(0) + 100),
            prompt_tokens: 1,
            output_tokens: 1,
            cached_tokens: None,
            error: (!ok).then(|| "http_500".to_string()),
        }
    }

    /// A request counts as overlapped when it was sent while another awaited its first token
    /// (sent at or after the other's send, before the other's first token); failed requests and
    /// requests without a first token are left out of both parts.
    #[test]
    fn the_overlap_split_finds_requests_sent_during_anothers_prefill() {
        let r = RunResult {
            outcomes: vec![
                outcome(0, Some(30), true),    // alone
                outcome(10, Some(50), true),   // during the first's wait (0..30)
                outcome(100, Some(20), true),  // alone
                outcome(120, Some(25), true),  // at the other's first token: alone
                outcome(130, Some(40), false), // failed: out
                outcome(200, None, true),      // no first token: out
                outcome(205, Some(10), true),  // alone (the one before has no TTFT)
            ],
            duration: Duration::from_secs(1),
        };
        let (over, alone, share) = overlap_split(&r);
        assert!((share - 1.0 / 5.0).abs() < 1e-9, "{share}");
        assert!((49.0..=51.0).contains(&over), "{over}");
        assert!((29.0..=31.0).contains(&alone), "{alone}");
        let empty = RunResult {
            outcomes: Vec::new(),
            duration: Duration::ZERO,
        };
        assert_eq!(overlap_split(&empty), (0.0, 0.0, 0.0));
    }

    #[test]
    fn the_generated_configs_parse_as_the_gateway_reads_them() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: FlowArgs,
        }
        let a = Cli::parse_from(["x", "--workers", "2"]).a;
        let urls = vec![
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".into(),
        ];
        for mode in [Mode::Off, Mode::On, Mode::Engine] {
            let t = gateway_toml(&a, "127.0.0.1:0", &urls, mode);
            let cfg = kvgate_gateway::Config::from_toml(&t).unwrap();
            assert_eq!(cfg.flow_control.enabled, mode != Mode::Off);
            assert_eq!(
                cfg.flow_control.bypass_busy_priority.is_some(),
                mode == Mode::Engine
            );
            assert_eq!(cfg.workers.len(), 2);
            assert_eq!(cfg.routing.max_inflight_per_worker, 4);
        }
        let w = workload(10, 8, 3, 1);
        assert_eq!(w.requests.len(), 10);
        assert!(w
            .requests
            .iter()
            .all(|r| r.prompt.len() == 8 && r.max_tokens == 3));
    }
}
