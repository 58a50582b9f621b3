//! The queue's tail on the openb mix (issue #44): 24 clients in a closed loop on 8 GPUs, the
//! mix of `Workload::openb` (holds with a 0.6 s median, capped at 12 s), each seed run
//! under each policy and information the queue can plan on, and the packing reference.
//! Every wait is counted to its grant, those still open at the end as far as they got.
//! docs/queue.md says how to read it.
//!
//! ```sh
//! cargo bench -p gpud-sim --bench tail
//! GPUD_SIM_SEEDS=1-20 cargo bench -p gpud-sim --bench tail
//! ```
//!
//! `GPUD_SIM_SEEDS`: the seeds, `1-3` (default) or `1,5,9`; `GPUD_SIM_SECONDS`: the
//! measured virtual time (default 120, after a warm-up of 12 s); `GPUD_SIM_CLIENTS`: the
//! clients (default 24); `GPUD_SIM_MULTI_WEIGHTS`: how likely 2, 4 and 8 GPUs are among
//! the multi-GPU requests (default `0.23,0.21,0.62`; `0.23,0.21,0` leaves out whole-node
//! requests).
//!
//! The goal, per seed: the longest wait at most 1.5 × the longest hold drawn in the run, no
//! wait that times out, and at least 92% of the node allocated (time-averaged).

// A benchmark: a run that fails should stop it loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Shares and ratios are printed as floats.
#![allow(clippy::cast_precision_loss)]

use std::time::{Duration, Instant};

use gpud::config::{QueuePolicy, WaitConfig};
use gpud_sim::{self as sim, Class, Params, Report, Workload, env_or};

/// `1-3` or `1,5,9`.
fn seeds(text: &str) -> Vec<u64> {
    let number = |s: &str| -> u64 {
        s.trim()
            .parse()
            .unwrap_or_else(|_| panic!("GPUD_SIM_SEEDS: {s:?} is not a seed"))
    };
    text.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (number(a)..=number(b)).collect::<Vec<_>>(),
            None => vec![number(part)],
        })
        .collect()
}

/// One way of running the queue: its order, and what it knows of when holds end.
struct Arm {
    name: &'static str,
    policy: QueuePolicy,
    /// Clients say their hold (`expect_seconds`): exact ends.
    expect: bool,
    /// `[wait] past_holds`: leases planned on their owner's past holds.
    past_holds: bool,
}

const ARMS: [Arm; 6] = [
    Arm {
        name: "fifo, exact ends",
        policy: QueuePolicy::Fifo,
        expect: true,
        past_holds: false,
    },
    Arm {
        name: "fifo, leases",
        policy: QueuePolicy::Fifo,
        expect: false,
        past_holds: false,
    },
    Arm {
        name: "planned, exact ends (expect)",
        policy: QueuePolicy::Planned,
        expect: true,
        past_holds: false,
    },
    Arm {
        name: "planned, past holds",
        policy: QueuePolicy::Planned,
        expect: false,
        past_holds: true,
    },
    Arm {
        name: "planned, leases",
        policy: QueuePolicy::Planned,
        expect: false,
        past_holds: false,
    },
    Arm {
        name: "packing (reference)",
        policy: QueuePolicy::PackingBound,
        expect: false,
        past_holds: false,
    },
];

/// Whether a run meets the goal.
fn meets(r: &Report) -> bool {
    r.tail_ratio() <= 1.5 && r.timed_out() == 0 && r.allocated >= 0.92
}

fn main() {
    let seeds = seeds(&env_or("GPUD_SIM_SEEDS", "1-3".to_owned()));
    let seconds: u64 = env_or("GPUD_SIM_SECONDS", 120);
    let clients: usize = env_or("GPUD_SIM_CLIENTS", 24);
    let weights: Vec<f64> = env_or("GPUD_SIM_MULTI_WEIGHTS", "0.23,0.21,0.62".to_owned())
        .split(',')
        .map(|w| {
            w.trim()
                .parse()
                .expect("GPUD_SIM_MULTI_WEIGHTS: numbers, comma-separated")
        })
        .collect();
    println!(
        "openb mix (Workload::openb), {clients} clients, 8 × 80 GiB; 2, 4, 8 GPUs weighted \
         {weights:?}; warm-up 12 s, measured {seconds} s; seeds {seeds:?}"
    );
    println!(
        "{:<30} {:>4} {:>9} {:>11} {:>12} {:>12} {:>7} {:>9} {:>6}   longest wait: fractional / whole / multi-GPU",
        "policy",
        "seed",
        "allocated",
        "empty GPUs",
        "longest wait",
        "longest hold",
        "ratio",
        "timed out",
        "goal"
    );
    let started = Instant::now();
    for arm in &ARMS {
        let mut met = 0;
        let mut ratios = Vec::new();
        let mut shares = Vec::new();
        let mut timeouts = 0;
        for &seed in &seeds {
            let params = Params {
                workload: Workload {
                    expect: arm.expect,
                    multi_weights: weights.clone(),
                    ..Workload::openb()
                },
                clients,
                users: 0,
                wait: WaitConfig {
                    policy: arm.policy,
                    past_holds: arm.past_holds,
                    ..WaitConfig::default()
                },
                warmup: Duration::from_secs(12),
                duration: Duration::from_secs(seconds),
                seed,
            };
            let r = sim::run(&params).unwrap_or_else(|e| panic!("{}, seed {seed}: {e}", arm.name));
            met += usize::from(meets(&r));
            ratios.push(r.tail_ratio());
            shares.push(r.allocated);
            timeouts += r.timed_out();
            let class = |c| r.class(c).map_or(0.0, |c| c.longest() as f64 / 1000.0);
            println!(
                "{:<30} {:>4} {:>8.1}% {:>10.1}% {:>11.1}s {:>11.1}s {:>7.2} {:>9} {:>6}   {:.1} / {:.1} / {:.1} s",
                arm.name,
                seed,
                r.allocated * 100.0,
                r.idle[0] * 100.0,
                r.longest_wait() as f64 / 1000.0,
                r.longest_hold as f64 / 1000.0,
                r.tail_ratio(),
                r.timed_out(),
                if meets(&r) { "met" } else { "-" },
                class(Class::Fractional),
                class(Class::Whole),
                class(Class::Multi),
            );
        }
        ratios.sort_by(f64::total_cmp);
        shares.sort_by(f64::total_cmp);
        println!(
            "{:<30} goal met on {met} of {} seeds; median ratio {:.2}, median allocated {:.1}%, \
             {timeouts} timed out in all",
            arm.name,
            seeds.len(),
            ratios[ratios.len() / 2],
            shares[shares.len() / 2] * 100.0,
        );
    }
    println!(
        "\nall runs: {:.1} s real time",
        started.elapsed().as_secs_f64()
    );
}
