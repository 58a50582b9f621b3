//! The queue simulator: gpud's real [`Ledger`] (its wait queue, backfill, placement, leases
//! and give-up times) driven in virtual time by simulated clients, so that queue policies
//! are compared in seconds instead of hours. docs/queue.md says how to run it and read it.
//!
//! A crate of its own, outside the daemon: it drives the ledger through its public API
//! alone (`reserve`, `release`, `expire_due`, `next_deadline`, `take_served` and the
//! units' loads), as the broker thread calls it: one committed transaction of an in-memory
//! [`Store`] per step. It also uses `placement` (whether a waiter would fit the machine as
//! it is, ignoring the queue), `config` and `model`, and `rand` for a seeded generator: the
//! same parameters and seed give the same [`Report`].
//!
//! Each client asks, waits (or is placed at once), holds what it got for the hold its
//! request drew, releases, and asks again at once; a request that gives up is asked anew
//! at once too. The steps are the clients' asks and releases, in a priority queue of
//! virtual times, and the ledger's own deadlines ([`Ledger::next_deadline`]: leases that
//! end, waits that give up), each run through [`Ledger::expire_due`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::time::Duration;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use tokio::sync::oneshot;

use gpud::broker::{
    Admitted, BrokerError, BrokerSettings, Caller, GroupLookup, Ledger, MAX_TTL_SECONDS,
    ReserveRequest,
};
use gpud::config::{Config, WaitConfig};
use gpud::model::{Gpu, GpuInventory, Link, MemoryAsk, Millis, PcieLevel, Reservation, Topology};
use gpud::placement::{self, PlacementRequest, PlacementState};
use gpud::store::{Store, StoreError};

pub mod openb;

const GIB: u64 = 1 << 30;

/// The kinds of request, reported apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Part of one GPU's memory, shared with others.
    Fractional,
    /// One whole GPU (exclusive).
    Whole,
    /// Several whole GPUs at once.
    Multi,
}

impl Class {
    /// Every class, in the order reports list them.
    pub const ALL: [Class; 3] = [Class::Fractional, Class::Whole, Class::Multi];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Class::Fractional => "fractional",
            Class::Whole => "whole GPU",
            Class::Multi => "multi-GPU",
        }
    }
}

/// One request of a simulated client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    /// Its class, for the report.
    pub class: Class,
    /// GPUs wanted.
    pub gpus: u32,
    /// Memory per GPU, or exclusive.
    pub memory: MemoryAsk,
    /// How long the client holds what it gets, from the moment it gets it.
    pub hold: Millis,
    /// Its lease (`ttl_seconds`); `None`: no lease, held until its client releases it (a
    /// process, as far as the queue can tell).
    pub lease: Option<u64>,
    /// How long it says it expects to hold what it gets (`expect_seconds`, here to the
    /// millisecond); `None`: it does not say.
    pub expect: Option<Millis>,
    /// How long it waits for capacity before it gives up (`wait_seconds`).
    pub wait: Duration,
}

/// Where the simulated clients' requests come from.
pub trait Source {
    /// When `client` first asks (default: at once).
    fn start(&mut self, _client: usize) -> Millis {
        0
    }

    /// The request `client` makes at `now`.
    fn ask(&mut self, client: usize, now: Millis) -> Ask;
}

/// The synthetic mix and the node it runs on. Each request draws its class, then its size,
/// hold and lease, independently of every other.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// GPUs of the node.
    pub gpus: u32,
    /// Memory of each GPU.
    pub gpu_memory: u64,
    /// Share of requests for one whole GPU.
    pub whole_share: f64,
    /// Share of requests for several whole GPUs; the rest are fractional.
    pub multi_share: f64,
    /// How many GPUs a multi-GPU request asks for, each as likely unless `multi_weights`
    /// says otherwise.
    pub multi_gpus: Vec<u32>,
    /// How likely each of `multi_gpus` is, relatively; empty: each as likely.
    pub multi_weights: Vec<f64>,
    /// A fractional request asks for this share of a GPU's memory at least...
    pub fraction_min: f64,
    /// ...and at most (uniformly in between), unless `fractions` says otherwise.
    pub fraction_max: f64,
    /// The shares of a GPU fractional requests ask for, each with its relative weight;
    /// empty: uniform between `fraction_min` and `fraction_max`.
    pub fractions: Vec<(f64, f64)>,
    /// Median hold time.
    pub median_hold: Duration,
    /// Hold times are log-normal: `median × e^(sigma × Z)`, `Z` standard normal, unless
    /// `hold_percentiles` says otherwise.
    pub hold_sigma: f64,
    /// Hold times at evenly spaced probabilities from 0 to 1 (any unit, at least three,
    /// ascending), scaled so that the middle one is `median_hold`; a hold is drawn between
    /// two neighbours, linearly. Empty: log-normal.
    pub hold_percentiles: Vec<f64>,
    /// No hold is longer than this (`None`: no cap).
    pub hold_cap: Option<Duration>,
    /// A request's lease is this many times its hold (rounded up to whole seconds).
    pub lease_factor: f64,
    /// Share of requests without a lease (held until released).
    pub leaseless_share: f64,
    /// Whether each request says how long it will be held (`expect_seconds`: its hold,
    /// exactly), so that the queue plans on exact ends.
    pub expect: bool,
    /// How long each request waits before it gives up.
    pub wait: Duration,
}

impl Default for Workload {
    /// The mix of issue #21: 8 × 80 GiB; 55% whole GPUs, 44% fractional from a quarter to
    /// nine tenths of a GPU, 1% of 2 or 4 GPUs; holds log-normal with a median of 10 minutes
    /// and σ = 1 (the longest of a few thousand about 30 times the median); leases of twice
    /// the hold; waits of 100 median holds.
    fn default() -> Workload {
        Workload {
            gpus: 8,
            gpu_memory: 80 * GIB,
            whole_share: 0.55,
            multi_share: 0.01,
            multi_gpus: vec![2, 4],
            multi_weights: Vec::new(),
            fraction_min: 0.25,
            fraction_max: 0.9,
            fractions: Vec::new(),
            median_hold: Duration::from_secs(600),
            hold_sigma: 1.0,
            hold_percentiles: Vec::new(),
            hold_cap: None,
            lease_factor: 2.0,
            leaseless_share: 0.0,
            expect: false,
            wait: Duration::from_secs(60_000),
        }
    }
}

impl Workload {
    /// The mix of issue #44, Alibaba's `openb` trace as it was replayed against gpud on the
    /// `dgx-a100` fixture (8 × 80 GiB): 55.4% whole GPUs, 43.6% fractions, 2, 4 and 8 GPUs
    /// at 0.23%, 0.21% and 0.62%. The fractions are the trace's own ([`openb::FRACTIONS`]),
    /// and so are the holds' percentiles ([`openb::HOLD_PERCENTILES`]), compressed to a
    /// median of 0.6 s and capped at 12 s (about 6% of holds reach the cap); leases of
    /// twice the hold; waits of 60 s (100 median holds).
    pub fn openb() -> Workload {
        Workload {
            whole_share: 0.554,
            multi_share: 0.0106,
            multi_gpus: vec![2, 4, 8],
            multi_weights: vec![0.23, 0.21, 0.62],
            fractions: openb::FRACTIONS
                .iter()
                .map(|&(milli, pods)| (f64::from(milli) / 1000.0, f64::from(pods)))
                .collect(),
            median_hold: Duration::from_millis(600),
            hold_percentiles: openb::HOLD_PERCENTILES
                .iter()
                .map(|&s| f64::from(s))
                .collect(),
            hold_cap: Some(Duration::from_secs(12)),
            wait: Duration::from_secs(60),
            ..Workload::default()
        }
    }

    /// The smallest share of a GPU a fractional request asks for.
    fn smallest_fraction(&self) -> f64 {
        self.fractions
            .iter()
            .map(|&(f, _)| f)
            .reduce(f64::min)
            .unwrap_or(self.fraction_min)
    }
}

impl Workload {
    /// Why these parameters cannot be drawn from, if they cannot.
    pub fn check(&self) -> Result<(), SimError> {
        let share = |x: f64| (0.0..=1.0).contains(&x);
        let problem = if self.gpus == 0 || self.gpu_memory == 0 {
            Some("the node needs GPUs with memory")
        } else if !share(self.whole_share)
            || !share(self.multi_share)
            || !share(self.leaseless_share)
            || self.whole_share + self.multi_share > 1.0
        {
            Some("shares are between 0 and 1, and whole + multi at most 1")
        } else if self.multi_share > 0.0 && self.multi_gpus.is_empty() {
            Some("multi-GPU requests need a size (multi_gpus)")
        } else if !self.multi_weights.is_empty()
            && (self.multi_weights.len() != self.multi_gpus.len()
                || self.multi_weights.iter().any(|w| w.is_nan() || *w < 0.0)
                || self.multi_weights.iter().sum::<f64>() <= 0.0)
        {
            Some("multi_weights: one weight of at least 0 per size, not all 0")
        } else if self.hold_cap.is_some_and(|c| c.is_zero()) {
            Some("a hold cap is above 0")
        } else if self.fraction_min.is_nan()
            || self.fraction_max.is_nan()
            || self.fraction_min <= 0.0
            || self.fraction_min > self.fraction_max
            || self.fraction_max > 1.0
        {
            Some("fractions are 0 < min ≤ max ≤ 1")
        } else if self
            .fractions
            .iter()
            .any(|&(f, w)| !(f > 0.0 && f <= 1.0) || w.is_nan() || w < 0.0)
            || (!self.fractions.is_empty()
                && self.fractions.iter().map(|f| f.1).sum::<f64>() <= 0.0)
        {
            Some("fractions: shares 0 < f ≤ 1, weights of at least 0, not all 0")
        } else if self.median_hold.is_zero() || self.hold_sigma.is_nan() || self.hold_sigma < 0.0 {
            Some("holds need a median above 0 and σ ≥ 0")
        } else if !self.hold_percentiles.is_empty()
            && (self.hold_percentiles.len() < 3
                || self
                    .hold_percentiles
                    .iter()
                    .any(|h| !(*h > 0.0 && h.is_finite()))
                || self.hold_percentiles.windows(2).any(|w| w[0] > w[1]))
        {
            Some("hold_percentiles: at least three, above 0, ascending")
        } else if self.lease_factor.is_nan() || self.lease_factor <= 0.0 {
            Some("the lease factor is above 0")
        } else {
            None
        };
        problem.map_or(Ok(()), |p| Err(SimError::Invalid(p.to_owned())))
    }
}

/// Draws requests from a [`Workload`], seeded.
#[derive(Debug, Clone)]
pub struct Generator {
    workload: Workload,
    rng: Xoshiro256PlusPlus,
}

impl Generator {
    /// A generator of `workload`'s requests; the same seed draws the same requests.
    pub fn new(workload: Workload, seed: u64) -> Generator {
        Generator {
            workload,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
        }
    }

    /// The next request.
    pub fn draw(&mut self) -> Ask {
        let w = &self.workload;
        let u: f64 = self.rng.random();
        let (class, gpus, memory) = if u < w.multi_share {
            let i = if w.multi_weights.is_empty() {
                self.rng.random_range(0..w.multi_gpus.len().max(1))
            } else {
                pick(&mut self.rng, w.multi_weights.iter().copied())
            };
            let gpus = w.multi_gpus.get(i).copied().unwrap_or(2);
            (Class::Multi, gpus, MemoryAsk::Exclusive)
        } else if u < w.multi_share + w.whole_share {
            (Class::Whole, 1, MemoryAsk::Exclusive)
        } else {
            let f = if w.fractions.is_empty() {
                w.fraction_min + (w.fraction_max - w.fraction_min) * self.rng.random::<f64>()
            } else {
                w.fractions[pick(&mut self.rng, w.fractions.iter().map(|f| f.1))].0
            };
            // Whole MiB, as people ask.
            let bytes = (to_u64(f * as_f64(w.gpu_memory)) >> 20).max(1) << 20;
            (Class::Fractional, 1, MemoryAsk::Bytes(bytes))
        };
        let median = as_f64(millis(w.median_hold));
        let relative = if w.hold_percentiles.is_empty() {
            (w.hold_sigma * standard_normal(&mut self.rng)).exp()
        } else {
            let p = &w.hold_percentiles;
            let at = self.rng.random::<f64>() * as_f64(p.len() as u64 - 1);
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let i = (at.floor() as usize).min(p.len() - 2);
            let between = p[i] + (p[i + 1] - p[i]) * (at - as_f64(i as u64));
            between / p[p.len() / 2]
        };
        let cap = w.hold_cap.map_or(Millis::MAX, millis);
        let hold = to_u64(median * relative).clamp(1, cap.max(1));
        let lease = if self.rng.random::<f64>() < w.leaseless_share {
            None
        } else {
            let seconds = (w.lease_factor * as_f64(hold) / 1000.0).ceil();
            Some(to_u64(seconds).clamp(1, MAX_TTL_SECONDS))
        };
        Ask {
            class,
            gpus,
            memory,
            hold,
            lease,
            expect: w.expect.then_some(hold),
            wait: w.wait,
        }
    }
}

impl Source for Generator {
    fn ask(&mut self, _client: usize, _now: Millis) -> Ask {
        self.draw()
    }
}

/// An index drawn in proportion to `weights` (at least one above 0).
fn pick(rng: &mut Xoshiro256PlusPlus, weights: impl Iterator<Item = f64> + Clone) -> usize {
    let mut x = rng.random::<f64>() * weights.clone().sum::<f64>();
    let mut last = 0;
    for (i, w) in weights.enumerate() {
        x -= w;
        if x < 0.0 {
            return i;
        }
        last = i;
    }
    last
}

/// One draw of a standard normal variable (Box–Muller; `rand_distr` is not a dependency).
fn standard_normal(rng: &mut Xoshiro256PlusPlus) -> f64 {
    // 1 - [0, 1) is (0, 1]: the logarithm stays finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `x` as an integer, rounded: 0 below 0 (and for NaN), saturating above.
// The simulator's times and sizes are far below 2^53, and the cast saturates anyway.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn to_u64(x: f64) -> u64 {
    if x.is_nan() || x <= 0.0 {
        0
    } else {
        x.round() as u64
    }
}

/// `x` as a float (exact below 2^53, which the simulator's times and sizes are).
#[allow(clippy::cast_precision_loss)]
fn as_f64(x: u64) -> f64 {
    x as f64
}

/// The settings of one run.
#[derive(Debug, Clone)]
pub struct Params {
    /// What the clients ask for.
    pub workload: Workload,
    /// Clients, each always holding or waiting (or asking).
    pub clients: usize,
    /// Distinct users among them (client `k` is uid `1000 + k % users`); 0: one each, so that
    /// per-user limits play no part.
    pub users: usize,
    /// The queue's settings, the policy among them (`max_wait_seconds` is raised to the
    /// workload's wait when below).
    pub wait: WaitConfig,
    /// Virtual time simulated before the measures start.
    pub warmup: Duration,
    /// Virtual time measured, after the warm-up.
    pub duration: Duration,
    /// The generator's seed.
    pub seed: u64,
}

impl Params {
    /// The default workload with `clients` clients under `wait`: a warm-up of 20 median
    /// holds, then 200 measured.
    pub fn new(clients: usize, wait: WaitConfig) -> Params {
        let workload = Workload::default();
        Params {
            warmup: workload.median_hold * 20,
            duration: workload.median_hold * 200,
            workload,
            clients,
            users: 0,
            wait,
            seed: 1,
        }
    }
}

/// What one class of requests met, for the requests made in the measured time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassReport {
    /// The class.
    pub class: Class,
    /// Requests made.
    pub requests: u64,
    /// Their waits, shortest first: 0 when placed at once, the wait until served, the full
    /// wait when it gave up, and for those still waiting at the end how long they had.
    pub waits: Vec<Millis>,
    /// Requests that gave up.
    pub timed_out: u64,
    /// Of those, how many would have fit the machine at some moment of their wait (after a
    /// step, ignoring the queue): the capacity was there, the queue held it back.
    pub timed_out_with_room: u64,
    /// Requests still waiting at the end.
    pub waiting_at_end: u64,
    /// Requests refused outright (an error other than a time-out).
    pub refused: u64,
}

impl ClassReport {
    /// No requests of `class` yet.
    pub fn new(class: Class) -> ClassReport {
        ClassReport {
            class,
            requests: 0,
            waits: Vec::new(),
            timed_out: 0,
            timed_out_with_room: 0,
            waiting_at_end: 0,
            refused: 0,
        }
    }

    /// The `permille`/1000 quantile of the waits (nearest rank); 0 without any.
    pub fn quantile(&self, permille: usize) -> Millis {
        let n = self.waits.len();
        if n == 0 {
            return 0;
        }
        let rank = (n * permille.min(1000)).div_ceil(1000).max(1);
        self.waits.get(rank - 1).copied().unwrap_or(0)
    }

    /// The median wait.
    pub fn median(&self) -> Millis {
        self.quantile(500)
    }

    /// The 99th percentile wait.
    pub fn p99(&self) -> Millis {
        self.quantile(990)
    }

    /// The longest wait.
    pub fn longest(&self) -> Millis {
        self.waits.last().copied().unwrap_or(0)
    }
}

/// What one run measured, after the warm-up.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Time-averaged share of the node's GPU memory reserved (a GPU held exclusively counts
    /// whole).
    pub allocated: f64,
    /// Time-averaged number of reservations held at once: with the clients and the mean
    /// hold, what sets the mean wait once the queue never empties (Little's law).
    pub held: f64,
    /// Time-averaged shares of the node's GPU memory left idle: on GPUs that hold nothing,
    /// in gaps on shared GPUs smaller than the smallest request of the mix (no order of
    /// serving could fill them), and in larger gaps. With `allocated`, they add up to 1.
    pub idle: [f64; 3],
    /// Per class, in [`Class::ALL`]'s order.
    pub classes: Vec<ClassReport>,
    /// The workload's median hold, the unit waits are also given in.
    pub median_hold: Millis,
    /// Leases that ran out before their client released them.
    pub expired: u64,
    /// Committed transactions, the warm-up included.
    pub steps: u64,
    /// The longest hold drawn in the run, the warm-up included.
    pub longest_hold: Millis,
}

impl Report {
    /// The report of `class`.
    pub fn class(&self, class: Class) -> Option<&ClassReport> {
        self.classes.iter().find(|c| c.class == class)
    }

    /// The longest wait of any class (those still open at the end included).
    pub fn longest_wait(&self) -> Millis {
        self.classes
            .iter()
            .map(ClassReport::longest)
            .max()
            .unwrap_or(0)
    }

    /// The requests that gave up, of any class.
    pub fn timed_out(&self) -> u64 {
        self.classes.iter().map(|c| c.timed_out).sum()
    }

    /// The longest wait over the longest hold drawn (0 without a hold).
    pub fn tail_ratio(&self) -> f64 {
        if self.longest_hold == 0 {
            return 0.0;
        }
        as_f64(self.longest_wait()) / as_f64(self.longest_hold)
    }
}

/// Milliseconds in `d`, saturating.
fn millis(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Why a run could not be completed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The parameters make no sense.
    #[error("invalid simulation parameters: {0}")]
    Invalid(String),
    /// The in-memory database failed.
    #[error("simulated store: {0}")]
    Store(#[from] StoreError),
    /// The ledger failed where the simulator expects no error (a bug).
    #[error("ledger: {0}")]
    Ledger(#[from] BrokerError),
    /// Virtual time stopped advancing: a deadline the ledger keeps reporting as due.
    #[error("virtual time is stuck at {0} ms")]
    Stuck(Millis),
}

/// The benchmarks' settings: environment variable `name` parsed, or `default` when it is
/// not set; a value that does not parse stops the run.
#[allow(clippy::panic)]
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
        Err(_) => default,
    }
}

/// The node's inventory: `gpus` GPUs of `memory` bytes, every pair joined by NVLink (an
/// NVSwitch machine), so that topology plays no part in who waits.
pub fn node(gpus: u32, memory: u64) -> GpuInventory {
    GpuInventory {
        driver_version: None,
        cuda_driver_version: None,
        gpus: (0..gpus)
            .map(|index| Gpu {
                index,
                uuid: format!("GPU-sim-{index}"),
                name: "simulated".to_owned(),
                pci_bus_id: String::new(),
                minor_number: Some(index),
                memory_total_bytes: memory,
                numa_node: Some(index * 2 / gpus.max(1)),
                architecture: None,
                cuda_compute_capability: None,
                pcie_root: None,
                cpu_affinity: Vec::new(),
                mig_instances: Vec::new(),
                mig_enabled: false,
                isolation: gpud_schema::GpuIsolation::default(),
                healthy: true,
            })
            .collect(),
        topology: Topology::uniform(
            usize::try_from(gpus).unwrap_or(0),
            Link {
                pcie: PcieLevel::System,
                nvlinks: 18,
            },
        ),
    }
}

/// Runs `params` with its workload's [`Generator`].
pub fn run(params: &Params) -> Result<Report, SimError> {
    params.workload.check()?;
    let mut generator = Generator::new(params.workload.clone(), params.seed);
    simulate(params, &mut generator)
}

/// The fewest bytes of one GPU a request of `w` asks for.
fn smallest_request(w: &Workload) -> u64 {
    // A share of a GPU's memory, in whole MiB as the generator draws it.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let mib = ((w.gpu_memory >> 20) as f64 * w.smallest_fraction()).floor() as u64;
    mib << 20
}

/// Runs `params` with requests from `source` (`params.workload` gives the node and the
/// median hold).
pub fn simulate(params: &Params, source: &mut dyn Source) -> Result<Report, SimError> {
    let (sim, store) = Sim::new(params)?;
    sim.run(store, source)
}

/// What a client does now.
enum State {
    /// Between a release (or a time-out) and its next ask.
    Idle,
    /// Holds reservation `id`.
    Holding { id: String },
    /// Waits for its request.
    Waiting(Waiting),
}

struct Waiting {
    id: String,
    ask: Ask,
    since: Millis,
    rx: oneshot::Receiver<Result<Reservation, BrokerError>>,
    /// It would have fit, ignoring the queue, after some step of its wait.
    room: bool,
    /// Made in the measured time.
    counted: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Ask,
    Release,
}

/// A client's step: `(when, order of scheduling, client, what)`.
type Step = Reverse<(Millis, u64, usize, Kind)>;

/// A run's state but its database (which each step's transaction borrows).
struct Sim {
    ledger: Ledger,
    topology: Topology,
    callers: Vec<Caller>,
    states: Vec<State>,
    steps: BinaryHeap<Step>,
    scheduled: u64,
    /// Waiting clients by the id their request chose.
    waiting_ids: HashMap<String, usize>,
    next_id: u64,
    now: Millis,
    start: Millis,
    end: Millis,
    total_memory: u64,
    /// Reserved bytes × milliseconds, in the measured time.
    integral: u128,
    /// Reservations × milliseconds, in the measured time.
    held_integral: u128,
    /// Idle bytes × milliseconds, as [`Report::idle`] splits them.
    idle_integral: [u128; 3],
    /// The smallest request of the mix, in bytes of one GPU.
    smallest: u64,
    classes: BTreeMap<Class, ClassReport>,
    expired: u64,
    committed: u64,
    retry_after: Millis,
    longest_hold: Millis,
}

impl Sim {
    fn new(params: &Params) -> Result<(Sim, Store), SimError> {
        let w = &params.workload;
        let inventory = node(w.gpus, w.gpu_memory);
        let mut wait = params.wait.clone();
        wait.max_wait_seconds = wait.max_wait_seconds.max(w.wait.as_secs());
        let settings = BrokerSettings {
            admin_gids: Vec::new(),
            config: Config {
                wait,
                ..Config::default()
            },
            groups: GroupLookup::from_fn(|_| Vec::new()),
        };
        let mut store = Store::open_in_memory()?;
        let mut ledger = Ledger::new(&inventory, settings);
        let mut txn = store.transaction()?;
        ledger.load(&mut txn, 0)?;
        txn.commit()?;
        let users = if params.users == 0 {
            params.clients
        } else {
            params.users
        };
        let callers = (0..params.clients)
            .map(|k| {
                let uid = 1000 + u32::try_from(k % users.max(1)).unwrap_or(u32::MAX - 1000);
                Caller {
                    uid,
                    gid: uid,
                    pid: None,
                }
            })
            .collect();
        let start = millis(params.warmup);
        let sim = Sim {
            ledger,
            topology: inventory.topology.clone(),
            callers,
            states: (0..params.clients).map(|_| State::Idle).collect(),
            steps: BinaryHeap::new(),
            scheduled: 0,
            waiting_ids: HashMap::new(),
            next_id: 0,
            now: 0,
            start,
            end: start.saturating_add(millis(params.duration)),
            total_memory: inventory.gpus.iter().map(|g| g.memory_total_bytes).sum(),
            integral: 0,
            held_integral: 0,
            idle_integral: [0; 3],
            smallest: smallest_request(w),
            classes: Class::ALL
                .into_iter()
                .map(|c| (c, ClassReport::new(c)))
                .collect(),
            expired: 0,
            committed: 0,
            retry_after: millis(w.median_hold).max(1),
            longest_hold: 0,
        };
        Ok((sim, store))
    }

    fn schedule(&mut self, at: Millis, client: usize, kind: Kind) {
        self.scheduled += 1;
        self.steps.push(Reverse((at, self.scheduled, client, kind)));
    }

    fn class(&mut self, class: Class) -> &mut ClassReport {
        self.classes
            .entry(class)
            .or_insert_with(|| ClassReport::new(class))
    }

    fn run(mut self, mut store: Store, source: &mut dyn Source) -> Result<Report, SimError> {
        for client in 0..self.states.len() {
            let at = source.start(client);
            self.schedule(at, client, Kind::Ask);
        }
        // Steps at one instant, to tell a deadline that never clears from a busy instant.
        let mut same_instant = 0_usize;
        let stuck_after = 1000 + 10 * self.states.len();
        loop {
            let next_step = self.steps.peek().map(|Reverse((at, ..))| *at);
            let deadline = self.ledger.next_deadline();
            let Some(t) = [next_step, deadline].into_iter().flatten().min() else {
                break;
            };
            if t >= self.end {
                break;
            }
            let t = t.max(self.now);
            same_instant = if t == self.now { same_instant + 1 } else { 0 };
            if same_instant > stuck_after {
                return Err(SimError::Stuck(t));
            }
            self.advance(t);
            let mut txn = store.transaction()?;
            // A lease that ends, or a wait that gives up, at the instant of a client's step
            // goes first.
            if deadline.is_some_and(|d| next_step.is_none_or(|s| d <= s)) {
                self.ledger.expire_due(&mut txn, t)?;
            } else if let Some(Reverse((_, _, client, kind))) = self.steps.pop() {
                match kind {
                    Kind::Release => self.release(&mut txn, client, t)?,
                    Kind::Ask => self.ask(&mut txn, source, client, t)?,
                }
            }
            txn.commit()?;
            self.committed += 1;
            self.after_commit(t);
        }
        let end = self.end;
        self.advance(end);
        Ok(self.report())
    }

    /// Counts the reserved memory from `self.now` to `t`, within the measured time.
    fn advance(&mut self, t: Millis) {
        let (from, to) = (self.now.max(self.start), t.min(self.end));
        if to > from {
            let reserved: u64 = self
                .ledger
                .units()
                .iter()
                .zip(self.ledger.loads())
                .map(|(unit, load)| {
                    if load.exclusive {
                        unit.memory_total_bytes
                    } else {
                        load.reserved_bytes.min(unit.memory_total_bytes)
                    }
                })
                .sum();
            self.integral += u128::from(reserved) * u128::from(to - from);
            let held = u64::try_from(self.ledger.active_count()).unwrap_or(u64::MAX);
            self.held_integral += u128::from(held) * u128::from(to - from);
            for (unit, load) in self.ledger.units().iter().zip(self.ledger.loads()) {
                if load.exclusive {
                    continue;
                }
                let idle = unit.memory_total_bytes.saturating_sub(load.reserved_bytes);
                let kind = if load.reservations == 0 {
                    0
                } else if idle < self.smallest {
                    1
                } else {
                    2
                };
                self.idle_integral[kind] += u128::from(idle) * u128::from(to - from);
            }
        }
        self.now = self.now.max(t);
    }

    fn release(
        &mut self,
        txn: &mut gpud::store::Txn<'_>,
        client: usize,
        t: Millis,
    ) -> Result<(), SimError> {
        let state = std::mem::replace(&mut self.states[client], State::Idle);
        if let State::Holding { id } = state {
            match self.ledger.release(txn, &self.callers[client], &id, t) {
                Ok(_) => {}
                // Its lease ran out first.
                Err(BrokerError::NotActive { .. }) => self.expired += 1,
                Err(e) => return Err(e.into()),
            }
        }
        self.schedule(t, client, Kind::Ask);
        Ok(())
    }

    fn ask(
        &mut self,
        txn: &mut gpud::store::Txn<'_>,
        source: &mut dyn Source,
        client: usize,
        t: Millis,
    ) -> Result<(), SimError> {
        let ask = source.ask(client, t);
        self.longest_hold = self.longest_hold.max(ask.hold);
        self.next_id += 1;
        let id = format!("sim-{client}-{}", self.next_id);
        let request = ReserveRequest {
            gpus: ask.gpus,
            wait: Some(ask.wait),
            ttl_seconds: ask.lease,
            expect: ask.expect.map(Duration::from_millis),
            // A chosen id is how a request without a lease is accepted (it is held until
            // released, as by a process), and how a served waiter is told apart.
            id: Some(id.clone()),
            ..ReserveRequest::lease(ask.memory, 0)
        };
        let counted = t >= self.start;
        if counted {
            self.class(ask.class).requests += 1;
        }
        match self
            .ledger
            .reserve(txn, self.callers[client], request, None, t)
        {
            Ok(Admitted::Reserved(r) | Admitted::Existing(r)) => {
                if counted {
                    self.class(ask.class).waits.push(0);
                }
                self.states[client] = State::Holding { id: r.id };
                self.schedule(t.saturating_add(ask.hold), client, Kind::Release);
            }
            Ok(Admitted::Queued { rx, .. }) => {
                self.waiting_ids.insert(id.clone(), client);
                self.states[client] = State::Waiting(Waiting {
                    id,
                    ask,
                    since: t,
                    rx,
                    room: false,
                    counted,
                });
            }
            Err(BrokerError::Storage(e)) => return Err(BrokerError::Storage(e).into()),
            // Refused (it can never fit, a per-user limit): the client asks again later.
            Err(_) => {
                if counted {
                    self.class(ask.class).refused += 1;
                }
                self.schedule(t.saturating_add(self.retry_after), client, Kind::Ask);
            }
        }
        Ok(())
    }

    /// Notes the waiters served by the step just committed, and those that gave up, and
    /// which of the rest would fit the machine as it is now.
    fn after_commit(&mut self, t: Millis) {
        for id in self.ledger.take_served() {
            // Nothing to tell: the client is simulated.
            let Some(client) = self.waiting_ids.remove(&id) else {
                continue;
            };
            let state = std::mem::replace(&mut self.states[client], State::Holding { id });
            if let State::Waiting(w) = state {
                if w.counted {
                    self.class(w.ask.class).waits.push(t - w.since);
                }
                self.schedule(t.saturating_add(w.ask.hold), client, Kind::Release);
            }
        }
        for client in 0..self.states.len() {
            let State::Waiting(w) = &mut self.states[client] else {
                continue;
            };
            let outcome = match w.rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => continue,
                Ok(Err(BrokerError::WaitTimeout { .. })) => true,
                // Refused while waiting, or answered by nobody.
                Ok(_) | Err(oneshot::error::TryRecvError::Closed) => false,
            };
            let State::Waiting(w) = std::mem::replace(&mut self.states[client], State::Idle) else {
                continue;
            };
            self.waiting_ids.remove(&w.id);
            if w.counted {
                let report = self.class(w.ask.class);
                if outcome {
                    report.timed_out += 1;
                    report.timed_out_with_room += u64::from(w.room);
                    report.waits.push(t - w.since);
                } else {
                    report.refused += 1;
                }
            }
            self.schedule(t, client, Kind::Ask);
        }
        let state = PlacementState {
            units: self.ledger.units(),
            loads: self.ledger.loads(),
            topology: &self.topology,
        };
        for s in &mut self.states {
            if let State::Waiting(w) = s
                && !w.room
            {
                let request = PlacementRequest {
                    gpus: w.ask.gpus,
                    memory: w.ask.memory,
                    policy: self.ledger.default_policy(),
                    compute: placement::ComputeAsk::Implied,
                };
                w.room = placement::place(&request, &state).is_ok();
            }
        }
    }

    fn report(mut self) -> Report {
        let end = self.end;
        let waiting: Vec<(Class, Millis)> = self
            .states
            .iter()
            .filter_map(|s| match s {
                State::Waiting(w) if w.counted => Some((w.ask.class, end - w.since)),
                _ => None,
            })
            .collect();
        for (class, waited) in waiting {
            let report = self.class(class);
            report.waiting_at_end += 1;
            report.waits.push(waited);
        }
        let span = u128::from(end - self.start);
        let capacity = u128::from(self.total_memory) * span;
        // A ratio of two integers that fit f64 closely enough for a percentage.
        #[allow(clippy::cast_precision_loss)]
        let (allocated, held, idle) = if capacity == 0 {
            (0.0, 0.0, [0.0; 3])
        } else {
            (
                self.integral as f64 / capacity as f64,
                self.held_integral as f64 / span as f64,
                self.idle_integral.map(|i| i as f64 / capacity as f64),
            )
        };
        let classes = self
            .classes
            .into_values()
            .map(|mut c| {
                c.waits.sort_unstable();
                c
            })
            .collect();
        Report {
            allocated,
            held,
            idle,
            classes,
            median_hold: self.retry_after,
            expired: self.expired,
            steps: self.committed,
            longest_hold: self.longest_hold,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use gpud::config::QueuePolicy;

    const SECOND: Millis = 1000;

    /// Each client asks for the same thing every time, from its own start.
    struct Script(Vec<(Millis, Ask)>);

    impl Source for Script {
        fn start(&mut self, client: usize) -> Millis {
            self.0[client].0
        }

        fn ask(&mut self, client: usize, _now: Millis) -> Ask {
            self.0[client].1.clone()
        }
    }

    fn ask(class: Class, memory: MemoryAsk, hold_s: u64, wait_s: u64) -> Ask {
        Ask {
            class,
            gpus: 1,
            memory,
            hold: hold_s * SECOND,
            lease: Some(2 * hold_s),
            expect: None,
            wait: Duration::from_secs(wait_s),
        }
    }

    /// One 80 GiB GPU, no warm-up, `secs` measured.
    fn one_gpu(clients: usize, policy: QueuePolicy, secs: u64) -> Params {
        Params {
            workload: Workload {
                gpus: 1,
                ..Workload::default()
            },
            clients,
            users: 0,
            wait: WaitConfig {
                policy,
                ..WaitConfig::default()
            },
            warmup: Duration::ZERO,
            duration: Duration::from_secs(secs),
            seed: 1,
        }
    }

    fn waits_s(c: &ClassReport) -> Vec<Millis> {
        c.waits.iter().map(|w| w / SECOND).collect()
    }

    /// The share of `draws` that `f` holds for.
    fn share_of(draws: &[Ask], f: &dyn Fn(&Ask) -> bool) -> f64 {
        as_f64(draws.iter().filter(|a| f(a)).count() as u64) / as_f64(draws.len() as u64)
    }

    /// Asserts that `got` is `want` within `tolerance`.
    fn near(got: f64, want: f64, tolerance: f64) {
        assert!(
            (got - want).abs() <= tolerance,
            "{got} is not {want} ± {tolerance}"
        );
    }

    #[test]
    fn the_generator_draws_the_shares_and_sizes_it_is_given() {
        let workload = Workload {
            leaseless_share: 0.2,
            ..Workload::default()
        };
        let mut g = Generator::new(workload.clone(), 7);
        let n = 100_000;
        let draws: Vec<Ask> = (0..n).map(|_| g.draw()).collect();
        let share = |f: &dyn Fn(&Ask) -> bool| share_of(&draws, f);
        near(share(&|a| a.class == Class::Whole), 0.55, 0.01);
        near(share(&|a| a.class == Class::Multi), 0.01, 0.002);
        near(share(&|a| a.class == Class::Fractional), 0.44, 0.01);
        near(share(&|a| a.lease.is_none()), 0.2, 0.01);
        let gpu = workload.gpu_memory;
        let mut fractions = Vec::new();
        for a in &draws {
            match (a.class, a.memory) {
                (Class::Whole, MemoryAsk::Exclusive) => assert_eq!(a.gpus, 1),
                (Class::Multi, MemoryAsk::Exclusive) => assert!([2, 4].contains(&a.gpus)),
                (Class::Fractional, MemoryAsk::Bytes(b)) => {
                    assert_eq!(a.gpus, 1);
                    assert!(b >= gpu / 4 - (1 << 20) && b <= gpu * 9 / 10, "{b}");
                    fractions.push(as_f64(b) / as_f64(gpu));
                }
                other => panic!("{other:?}"),
            }
            // A lease is twice the hold, in whole seconds rounded up.
            if let Some(ttl) = a.lease {
                assert_eq!(ttl, (2 * a.hold).div_ceil(1000).max(1), "{a:?}");
            }
        }
        let fours = share(&|a| a.gpus == 4);
        near(fours, 0.005, 0.0015);
        // Uniform from 0.25 to 0.9: mean 0.575, and as many below 0.575 as above.
        let mean = fractions.iter().sum::<f64>() / as_f64(fractions.len() as u64);
        near(mean, 0.575, 0.005);
        let below = fractions.iter().filter(|f| **f < 0.4125).count();
        near(
            as_f64(below as u64) / as_f64(fractions.len() as u64),
            0.25,
            0.01,
        );
        // Log-normal holds: the median is the median; e^σ times it is the 84th percentile.
        let mut holds: Vec<Millis> = draws.iter().map(|a| a.hold).collect();
        holds.sort_unstable();
        let at = |q: f64| as_f64(holds[usize::try_from(to_u64(q * as_f64(n))).unwrap()]);
        near(at(0.5) / 600_000.0, 1.0, 0.02);
        near(at(0.8413) / 600_000.0, std::f64::consts::E, 0.06);
        near(at(0.1587) / 600_000.0, 1.0 / std::f64::consts::E, 0.01);
    }

    #[test]
    fn the_openb_mix_draws_its_shares_and_caps_its_holds() {
        let mut g = Generator::new(Workload::openb(), 7);
        let n = 200_000;
        let draws: Vec<Ask> = (0..n).map(|_| g.draw()).collect();
        let share = |f: &dyn Fn(&Ask) -> bool| share_of(&draws, f);
        near(share(&|a| a.class == Class::Whole), 0.554, 0.005);
        near(share(&|a| a.gpus == 2), 0.0023, 0.0005);
        near(share(&|a| a.gpus == 4), 0.0021, 0.0005);
        near(share(&|a| a.gpus == 8), 0.0062, 0.0008);
        assert!(draws.iter().all(|a| a.hold <= 12_000 && a.expect.is_none()));
        let mut holds: Vec<Millis> = draws.iter().map(|a| a.hold).collect();
        holds.sort_unstable();
        let at = |q: f64| as_f64(holds[usize::try_from(to_u64(q * as_f64(n))).unwrap()]);
        near(at(0.5), 600.0, 15.0);
        // The trace's shape, scaled by 0.6 s ÷ 655 s: its 25th and 75th percentiles
        // (183 s, 2 303 s), and the 6.1% of its pods that ran past 20 medians, capped.
        near(at(0.25), 168.0, 6.0);
        near(at(0.75), 2110.0, 60.0);
        near(share(&|a| a.hold == 12_000), 0.061, 0.005);
        // The trace's fractions: 35% of them ask for 0.81 of a GPU, 24% for 0.47.
        let fraction = |f: f64| {
            let bytes = (to_u64(f * as_f64(80 * GIB)) >> 20) << 20;
            move |a: &Ask| a.memory == MemoryAsk::Bytes(bytes)
        };
        let fractional = share(&|a| a.class == Class::Fractional);
        near(share(&fraction(0.81)) / fractional, 1078.0 / 3078.0, 0.01);
        near(share(&fraction(0.47)) / fractional, 750.0 / 3078.0, 0.01);
        let told = Generator::new(
            Workload {
                expect: true,
                ..Workload::openb()
            },
            7,
        )
        .draw();
        assert_eq!(told.expect, Some(told.hold));
    }

    #[test]
    fn two_clients_on_one_gpu_take_turns_as_computed_by_hand() {
        // Client 0 holds 40 GiB (half the GPU) for 10 s; client 1 the whole GPU for 30 s.
        //   0 s: 0 placed; 1 waits (the GPU is not empty).
        //  10 s: 0 releases, 1 is served (waited 10 s); 0 asks again and waits.
        //  40 s: 1 releases, 0 is served (waited 30 s); 1 asks again and waits.
        //  50 s: 0 releases, 1 is served (10 s) ... a period of 40 s from 10 s.
        // Allocated: half for 0-10 s, then per period 30 s whole and 10 s half, and the
        // last 30 s (370-400 s) whole: (5 + 9 × 35 + 30) / 400 = 87.5%.
        for policy in [QueuePolicy::Guard, QueuePolicy::Planned] {
            let script = Script(vec![
                (
                    0,
                    ask(Class::Fractional, MemoryAsk::Bytes(40 * GIB), 10, 1000),
                ),
                (0, ask(Class::Whole, MemoryAsk::Exclusive, 30, 1000)),
            ]);
            let report = simulate(&one_gpu(2, policy, 400), &mut { script }).unwrap();
            assert!(
                (report.allocated - 0.875).abs() < 1e-9,
                "{}",
                report.allocated
            );
            // One reservation at every moment.
            assert!((report.held - 1.0).abs() < 1e-9, "{}", report.held);
            // The rest is the half GPU beside client 0's 40 GiB: a gap a request of the mix
            // (a quarter of a GPU or more) could fill; the GPU is never empty.
            let [empty, small, large] = report.idle;
            assert_eq!((empty, small), (0.0, 0.0));
            assert!((large - 0.125).abs() < 1e-9, "{large}");
            let fractional = report.class(Class::Fractional).unwrap();
            // Asks at 0 s (placed), then 10, 50, ..., 330 s (served after 30 s), and at
            // 370 s, still waiting at 400 s (30 s so far).
            assert_eq!(fractional.requests, 11);
            assert_eq!(
                waits_s(fractional),
                [0, 30, 30, 30, 30, 30, 30, 30, 30, 30, 30]
            );
            assert_eq!(fractional.waiting_at_end, 1);
            assert_eq!(
                (fractional.median(), fractional.longest()),
                (30_000, 30_000)
            );
            // Asks at 0, 40, ..., 360 s, each served 10 s later.
            let whole = report.class(Class::Whole).unwrap();
            assert_eq!(whole.requests, 10);
            assert_eq!(waits_s(whole), [10; 10]);
            assert_eq!((whole.timed_out, whole.waiting_at_end), (0, 0));
            assert_eq!(report.class(Class::Multi).unwrap().requests, 0);
            assert_eq!(report.expired, 0);
        }
    }

    #[test]
    fn waits_that_give_up_are_counted_and_asked_again() {
        // Client 0 holds the GPU for 100 s; client 1 wants it too but waits only 20 s: it
        // gives up at 20, 40, 60, 80 and 100 s (before 0's release at the same instant),
        // then is placed at once. 0 asks again at 100 s and is still waiting at 130 s.
        let script = Script(vec![
            (0, ask(Class::Whole, MemoryAsk::Exclusive, 100, 1000)),
            (0, ask(Class::Whole, MemoryAsk::Exclusive, 100, 20)),
        ]);
        let report = simulate(&one_gpu(2, QueuePolicy::Guard, 130), &mut { script }).unwrap();
        let whole = report.class(Class::Whole).unwrap();
        assert_eq!(whole.requests, 8);
        assert_eq!(waits_s(whole), [0, 0, 20, 20, 20, 20, 20, 30]);
        assert_eq!(
            (
                whole.timed_out,
                whole.timed_out_with_room,
                whole.waiting_at_end
            ),
            (5, 0, 1)
        );
        assert_eq!(whole.median(), 20_000);
        assert!((report.allocated - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_wait_the_queue_held_back_while_it_would_have_fit_is_told_apart() {
        // Guard, starved at once: client 0 holds 40 GiB for 100 s; client 1 waits for the
        // whole GPU; client 2 asks at 1 s for 20 GiB, which fits, but the GPU is held for
        // client 1. It gives up at 11 s with room it was not given.
        let wait = WaitConfig {
            policy: QueuePolicy::Guard,
            starvation_after: Duration::ZERO,
            ..WaitConfig::default()
        };
        let script = Script(vec![
            (
                0,
                ask(Class::Fractional, MemoryAsk::Bytes(40 * GIB), 100, 1000),
            ),
            (0, ask(Class::Whole, MemoryAsk::Exclusive, 100, 1000)),
            (
                SECOND,
                ask(Class::Fractional, MemoryAsk::Bytes(20 * GIB), 100, 10),
            ),
        ]);
        let params = Params {
            wait,
            ..one_gpu(3, QueuePolicy::Guard, 15)
        };
        let report = simulate(&params, &mut { script }).unwrap();
        let fractional = report.class(Class::Fractional).unwrap();
        assert_eq!(fractional.requests, 3);
        assert_eq!(
            (fractional.timed_out, fractional.timed_out_with_room),
            (1, 1)
        );
        assert_eq!(waits_s(fractional), [0, 4, 10]);
        let whole = report.class(Class::Whole).unwrap();
        assert_eq!((whole.requests, whole.waiting_at_end), (1, 1));
        assert!((report.allocated - 0.5).abs() < 1e-9);
    }

    #[test]
    fn the_same_seed_gives_the_same_report() {
        let params = |seed| Params {
            warmup: Duration::from_secs(600 * 5),
            duration: Duration::from_secs(600 * 30),
            seed,
            ..Params::new(
                24,
                WaitConfig {
                    policy: QueuePolicy::Guard,
                    ..WaitConfig::default()
                },
            )
        };
        let first = run(&params(3)).unwrap();
        assert_eq!(first, run(&params(3)).unwrap());
        assert_ne!(first, run(&params(4)).unwrap());
        assert!(first.allocated > 0.3 && first.allocated <= 1.0, "{first:?}");
        assert!(first.classes.iter().map(|c| c.requests).sum::<u64>() > 50);
    }

    #[test]
    fn nonsense_parameters_are_refused() {
        let bad = [
            Workload {
                whole_share: 0.8,
                multi_share: 0.3,
                ..Workload::default()
            },
            Workload {
                fractions: vec![(1.5, 1.0)],
                ..Workload::default()
            },
            Workload {
                fractions: vec![(0.5, 0.0)],
                ..Workload::default()
            },
            Workload {
                hold_percentiles: vec![1.0, 2.0],
                ..Workload::default()
            },
            Workload {
                hold_percentiles: vec![1.0, 3.0, 2.0],
                ..Workload::default()
            },
        ];
        for workload in bad {
            let why = format!("{workload:?}");
            let params = Params {
                workload,
                ..Params::new(8, WaitConfig::default())
            };
            assert!(matches!(run(&params), Err(SimError::Invalid(_))), "{why}");
        }
        assert!(Workload::openb().check().is_ok());
    }
}
