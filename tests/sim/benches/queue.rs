//! The wait queue under load: the queue simulator (`gpud_sim`, gpud's real ledger in
//! virtual time) runs the default mix of issue #21 at 8, 24 and 96 clients, under both
//! queue policies and the packing reference (the largest waiter that fits first, whatever
//! its age: how full an order of serving alone keeps the node) in the same run, and prints
//! one table per client count. docs/queue.md says how to read it.
//!
//! ```sh
//! cargo bench -p gpud-sim --bench queue
//! GPUD_SIM_HOLDS=1000 GPUD_SIM_SEED=7 GPUD_SIM_CLIENTS=24 cargo bench -p gpud-sim --bench queue
//! ```
//!
//! `GPUD_SIM_HOLDS`: measured virtual time, in median holds (default 500, after a warm-up of
//! a tenth of it); `GPUD_SIM_SEED`: the generator's seed (default 1); `GPUD_SIM_CLIENTS`:
//! client counts, comma-separated (default 8,24,96); `GPUD_SIM_STARVATION_AFTER`: the
//! queue's `starvation_after` in seconds (default gpud's, 60); `GPUD_SIM_MULTI_SHARE`,
//! `GPUD_SIM_LEASE_FACTOR`, `GPUD_SIM_LEASELESS_SHARE`: the mix's share of multi-GPU
//! requests (0.01), lease as a multiple of the hold (2), share without a lease (0).

// A benchmark: a run that fails should stop it loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Shares and multiples of the median hold are printed as floats.
#![allow(clippy::cast_precision_loss)]

use std::time::{Duration, Instant};

use gpud::config::{QueuePolicy, WaitConfig};
use gpud_sim::{self as sim, Class, ClassReport, Params, Report, env_or};

fn main() {
    let holds: u32 = env_or("GPUD_SIM_HOLDS", 500);
    let seed: u64 = env_or("GPUD_SIM_SEED", 1);
    let clients: Vec<usize> = env_or("GPUD_SIM_CLIENTS", "8,24,96".to_owned())
        .split(',')
        .map(|c| {
            c.trim()
                .parse()
                .expect("GPUD_SIM_CLIENTS: numbers, comma-separated")
        })
        .collect();
    let defaults = WaitConfig::default();
    let starvation_after = Duration::from_secs(env_or(
        "GPUD_SIM_STARVATION_AFTER",
        defaults.starvation_after.as_secs(),
    ));
    // `packing` is no policy to run: the reference for how full any order of serving keeps
    // the node, fairness aside (docs/queue.md).
    let policies = [
        ("planned", QueuePolicy::Planned),
        ("guard", QueuePolicy::Guard),
        ("packing", QueuePolicy::PackingBound),
    ];

    let mut base = Params::new(0, WaitConfig::default());
    let w = &mut base.workload;
    w.multi_share = env_or("GPUD_SIM_MULTI_SHARE", w.multi_share);
    w.lease_factor = env_or("GPUD_SIM_LEASE_FACTOR", w.lease_factor);
    w.leaseless_share = env_or("GPUD_SIM_LEASELESS_SHARE", w.leaseless_share);
    let median = base.workload.median_hold;
    let params = |clients: usize, policy: QueuePolicy| Params {
        clients,
        wait: WaitConfig {
            policy,
            starvation_after,
            ..defaults.clone()
        },
        warmup: median * (holds / 10).max(1),
        duration: median * holds,
        seed,
        ..base.clone()
    };
    println!("{}", parameters(&params(0, QueuePolicy::Planned), holds));

    let started = Instant::now();
    for n in clients {
        let runs: Vec<(&str, Report, Duration)> = policies
            .iter()
            .map(|(name, policy)| {
                let t = Instant::now();
                let report = sim::run(&params(n, *policy))
                    .unwrap_or_else(|e| panic!("{n} clients, {name}: {e}"));
                (*name, report, t.elapsed())
            })
            .collect();
        print_table(n, &runs);
    }
    println!(
        "\nall runs: {:.1} s real time",
        started.elapsed().as_secs_f64()
    );
}

/// The parameters line.
fn parameters(p: &Params, holds: u32) -> String {
    let w = &p.workload;
    let pct = |x: f64| format!("{:.0}%", x * 100.0);
    let multi: Vec<String> = w.multi_gpus.iter().map(u32::to_string).collect();
    format!(
        "parameters: {} × {} GiB GPUs; requests {} whole GPU, {} multi-GPU ({} GPUs), {} \
         fractional ({:.2}–{:.2} of a GPU); holds log-normal, median {}, σ {}; lease {} × \
         hold, {} without; wait {} ({:.0} median holds); starvation_after {}, assumed_hold \
         {}; one uid per client; warm-up {} holds, measured {} holds; seed {}",
        w.gpus,
        w.gpu_memory >> 30,
        pct(w.whole_share),
        pct(w.multi_share),
        multi.join(" or "),
        pct(1.0 - w.whole_share - w.multi_share),
        w.fraction_min,
        w.fraction_max,
        human(w.median_hold),
        w.hold_sigma,
        w.lease_factor,
        pct(w.leaseless_share),
        human(w.wait),
        w.wait.as_secs_f64() / w.median_hold.as_secs_f64(),
        human(p.wait.starvation_after),
        human(p.wait.assumed_hold),
        (holds / 10).max(1),
        holds,
        p.seed,
    )
}

/// A duration as people read it: `45s`, `12.5m`, `3.2h`.
fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.0}s")
    } else if s < 3600.0 {
        format!("{:.1}m", s / 60.0)
    } else {
        format!("{:.1}h", s / 3600.0)
    }
}

/// A wait: its length, and in median holds.
fn wait(ms: u64, median_hold: u64) -> String {
    format!(
        "{} ({:.2}×)",
        human(Duration::from_millis(ms)),
        ms as f64 / median_hold.max(1) as f64
    )
}

fn print_table(clients: usize, runs: &[(&str, Report, Duration)]) {
    println!("\n== {clients} waiting clients ==");
    for (name, report, took) in runs {
        println!(
            "{name:>8}: allocated {:5.1}%, {:.1} reservations held (time-averaged); idle: {:.1}% on empty GPUs, {:.1}% in gaps smaller than any request, {:.1}% in larger gaps | {} steps in {:.2} s real time | {} leases ran out",
            report.allocated * 100.0,
            report.held,
            report.idle[0] * 100.0,
            report.idle[1] * 100.0,
            report.idle[2] * 100.0,
            report.steps,
            took.as_secs_f64(),
            report.expired,
        );
    }
    println!(
        "{:<11} {:<8} {:>8} {:>15} {:>15} {:>15} {:>9} {:>9} {:>7} {:>7}",
        "class",
        "policy",
        "requests",
        "median wait",
        "p99 wait",
        "longest wait",
        "timed out",
        "with room",
        "at end",
        "refused"
    );
    for class in Class::ALL {
        for (name, report, _) in runs {
            let empty;
            let c: &ClassReport = match report.class(class) {
                Some(c) => c,
                None => {
                    empty = ClassReport::new(class);
                    &empty
                }
            };
            let m = report.median_hold;
            println!(
                "{:<11} {:<8} {:>8} {:>15} {:>15} {:>15} {:>9} {:>9} {:>7} {:>7}",
                class.name(),
                name,
                c.requests,
                wait(c.median(), m),
                wait(c.p99(), m),
                wait(c.longest(), m),
                c.timed_out,
                c.timed_out_with_room,
                c.waiting_at_end,
                c.refused,
            );
        }
    }
}
