//! `gpuctl slurm prolog|task-prolog|epilog|health`: gpud as the GPU allocator of a Slurm
//! node, through Slurm's own hooks.
//!
//! Slurm runs a hook by path, without arguments, so each is also gpuctl under another name:
//! a link `gpud-slurm-prolog` to gpuctl is `gpuctl slurm prolog` (see [`hook_named`]).
//!
//! - `prolog` (root, before the job's first step on the node): reserves what the job's GRES
//!   asks for on behalf of the job's user, with an id derived from the cluster and the job
//!   ([`reservation_id`]) and a lease of the job's time limit plus a grace. When nothing
//!   fits within a short wait it requeues a batch job and leaves an interactive one to the
//!   task prolog to refuse; it never fails for "full", which would drain the node.
//! - `task-prolog` (the user, before every task): prints the reservation's environment as
//!   `export` lines, and refuses the task of a job that asked for GPUs and holds none.
//! - `epilog` (root, when the job ends): releases. It never fails.
//! - `health` (`HealthCheckProgram`, root): releases what belongs to jobs no longer on the
//!   node, and renews the leases of those still there.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use tokio::runtime::Runtime;

use gpud_schema::{MemorySpec, Reservation, ReservationRequest, ReservationState, codes};

use crate::cli::SlurmHook;
use crate::client::Client;
use crate::error::{CliError, ExitCode};

/// The label that carries the job id.
pub const JOB_LABEL: &str = gpud_schema::origin::SLURM_JOB;
/// The label that carries the cluster name.
pub const CLUSTER_LABEL: &str = gpud_schema::origin::SLURM_CLUSTER;

/// The hook a program name stands for: gpuctl started as `gpud-slurm-prolog` (a link that
/// slurm.conf's `Prolog=` names) is `gpuctl slurm prolog`.
pub fn hook_named(program: &OsStr) -> Option<&'static str> {
    let name = Path::new(program).file_name()?.to_str()?;
    let hook = name.strip_prefix("gpud-slurm-")?;
    ["prolog", "task-prolog", "epilog", "health"]
        .into_iter()
        .find(|h| *h == hook)
}

/// `gpud-slurm.toml`: how the hooks ask gpud. Every key may be left out.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmConfig {
    /// gpud's socket.
    pub socket: PathBuf,
    /// The count-only GRES that carries GPU memory, in bytes (`--gres=gpumem:30G`).
    pub memory_gres: String,
    /// The count-only GRES that carries whole GPUs, placed by gpud (`--gres=wholegpu:2`).
    pub whole_gres: String,
    /// How long the prolog waits for room before it requeues or cancels the job.
    #[serde(deserialize_with = "duration")]
    pub wait: Duration,
    /// Added to the job's time limit for the reservation's lease.
    #[serde(deserialize_with = "duration")]
    pub grace: Duration,
    /// The lease of a job without a time limit (renewed by `health` while it runs).
    #[serde(deserialize_with = "duration")]
    pub unlimited_lease: Duration,
    /// How long a requeued job waits before Slurm starts it again.
    #[serde(deserialize_with = "duration")]
    pub requeue_delay: Duration,
    /// Where scontrol, squeue and scancel are (hooks run without `PATH`).
    pub slurm_bin: PathBuf,
    /// The slurm.conf of the slurmd that runs the hook, when it is not the default one:
    /// Slurm's programs are pointed at it.
    #[serde(skip)]
    pub slurm_conf: Option<PathBuf>,
}

impl Default for SlurmConfig {
    fn default() -> SlurmConfig {
        SlurmConfig {
            socket: gpud_schema::DEFAULT_SOCKET.into(),
            memory_gres: "gpumem".to_owned(),
            whole_gres: "wholegpu".to_owned(),
            wait: Duration::from_secs(10),
            grace: Duration::from_secs(300),
            unlimited_lease: Duration::from_secs(24 * 3600),
            requeue_delay: Duration::from_secs(15),
            slurm_bin: "/usr/bin".into(),
            slurm_conf: None,
        }
    }
}

fn duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(serde::de::Error::custom)
}

impl SlurmConfig {
    /// The configuration file: `$GPUD_SLURM_CONFIG`, else `gpud-slurm.toml` beside the
    /// slurm.conf that slurmd passes its hooks as `SLURM_CONF`, else
    /// `/etc/slurm/gpud-slurm.toml`. A missing file is the defaults.
    pub fn path(env: &dyn Fn(&str) -> Option<String>) -> PathBuf {
        if let Some(path) = env("GPUD_SLURM_CONFIG").filter(|p| !p.is_empty()) {
            return path.into();
        }
        let dir = env("SLURM_CONF")
            .and_then(|c| Path::new(&c).parent().map(Path::to_path_buf))
            .unwrap_or_else(|| "/etc/slurm".into());
        dir.join("gpud-slurm.toml")
    }

    /// Reads the configuration at `path` (the defaults when there is none).
    pub fn load(path: &Path) -> Result<SlurmConfig, CliError> {
        match std::fs::read_to_string(path) {
            Ok(text) => toml::from_str(&text).map_err(|e| {
                CliError::Usage(format!("{}: {}", path.display(), e.message().trim_end()))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(SlurmConfig::default()),
            Err(e) => Err(CliError::Usage(format!(
                "cannot read {}: {e}",
                path.display()
            ))),
        }
    }

    fn program(&self, name: &str) -> PathBuf {
        self.slurm_bin.join(name)
    }
}

/// What the hooks learn of the job from their environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnv {
    /// `SLURM_JOB_ID`.
    pub id: u64,
    /// `SLURM_JOB_UID` (the prolog's; tasks run as the user).
    pub uid: Option<u32>,
    /// `SLURM_CLUSTER_NAME`.
    pub cluster: Option<String>,
    /// `SLURM_JOB_COMMENT`: `gpus=N` spreads the memory over N GPUs.
    pub comment: String,
    /// `SLURM_JOB_GPUS`: GPUs Slurm's own `gpu` GRES chose, by index.
    pub slurm_gpus: Vec<String>,
    /// `SLURM_JOB_RESTART_COUNT`: how often the job was requeued (each start reserves anew).
    pub restarts: u32,
}

impl JobEnv {
    /// Reads the job from `env`.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<JobEnv, CliError> {
        let id = env("SLURM_JOB_ID")
            .and_then(|id| id.parse().ok())
            .ok_or_else(|| {
                CliError::Usage(
                    "SLURM_JOB_ID is not set: gpuctl slurm hooks are run by slurmd (Prolog=, \
                     TaskProlog=, Epilog= in slurm.conf)"
                        .to_owned(),
                )
            })?;
        Ok(JobEnv {
            id,
            uid: env("SLURM_JOB_UID").and_then(|u| u.parse().ok()),
            cluster: env("SLURM_CLUSTER_NAME").filter(|c| !c.is_empty()),
            comment: env("SLURM_JOB_COMMENT").unwrap_or_default(),
            slurm_gpus: env("SLURM_JOB_GPUS")
                .map(|g| {
                    g.split(',')
                        .map(str::trim)
                        .filter(|g| !g.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            restarts: env("SLURM_JOB_RESTART_COUNT")
                .or_else(|| env("SLURM_RESTART_COUNT"))
                .and_then(|r| r.parse().ok())
                .unwrap_or(0),
        })
    }

    /// The id of this start's reservation.
    pub fn reservation_id(&self) -> String {
        reservation_id(self.cluster.as_deref(), self.id, self.restarts)
    }

    /// The labels every reservation of the job carries (and the hooks find it by).
    pub fn labels(&self) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([(JOB_LABEL.to_owned(), self.id.to_string())]);
        if let Some(c) = &self.cluster {
            labels.insert(CLUSTER_LABEL.to_owned(), c.clone());
        }
        labels
    }

    /// The label selector of the job's reservations (`label=…&label=…`).
    fn selector(&self) -> Vec<(String, String)> {
        self.labels().into_iter().collect()
    }
}

/// `slurm-<cluster>-<job>` (`slurm-<job>` without a cluster name), and `.<restarts>` after
/// it for a requeued job's later starts (a reservation's id is never used twice), in the
/// characters gpud takes for an id.
pub fn reservation_id(cluster: Option<&str>, job: u64, restarts: u32) -> String {
    let start = if restarts == 0 {
        String::new()
    } else {
        format!(".{restarts}")
    };
    let base = match cluster {
        Some(c) => {
            let c: String = c
                .chars()
                .map(|ch| {
                    if ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.') {
                        ch
                    } else {
                        '_'
                    }
                })
                .collect();
            format!("slurm-{c}-{job}")
        }
        None => format!("slurm-{job}"),
    };
    base + &start
}

/// What `scontrol show job -d` says that the environment does not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobInfo {
    /// `JOB_GRES`: each GRES with its count on this node (bytes, for a memory GRES).
    pub gres: BTreeMap<String, u64>,
    /// `TimeLimit`; `None` when `UNLIMITED`.
    pub time_limit: Option<Duration>,
    /// `BatchFlag=1`: an `sbatch` job (which can be requeued).
    pub batch: bool,
    /// `Restarts`: how often it was requeued.
    pub restarts: u32,
}

/// Parses `scontrol show job -d` text.
pub fn parse_show_job(text: &str) -> JobInfo {
    let mut info = JobInfo::default();
    for token in text.split_whitespace() {
        let Some((key, value)) = token.split_once('=') else {
            continue;
        };
        match key {
            "JOB_GRES" => info.gres = parse_gres(value),
            "TimeLimit" => info.time_limit = parse_time_limit(value),
            "BatchFlag" => info.batch = value == "1",
            "Restarts" => info.restarts = value.parse().unwrap_or(0),
            _ => {}
        }
    }
    info
}

/// `gpumem:32212254720,gpu:a100:2(IDX:0-1)` → {gpumem: 32212254720, gpu: 2}.
fn parse_gres(value: &str) -> BTreeMap<String, u64> {
    let mut gres = BTreeMap::new();
    if value == "(null)" {
        return gres;
    }
    // Commas also separate the IDX list inside parentheses: drop those first.
    let mut plain = String::new();
    let mut depth = 0_u32;
    for c in value.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            c if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    for item in plain.split(',').filter(|i| !i.is_empty()) {
        let mut parts = item.split(':');
        let Some(name) = parts.next() else { continue };
        let count = parts.next_back().and_then(slurm_count);
        if let Some(count) = count {
            *gres.entry(name.to_owned()).or_insert(0) += count;
        }
    }
    gres
}

/// A GRES count as Slurm prints it: `32212254720`, or with a binary suffix (`30G`).
fn slurm_count(text: &str) -> Option<u64> {
    let (digits, shift) = match text.char_indices().last()? {
        (i, 'K' | 'k') => (&text[..i], 10),
        (i, 'M' | 'm') => (&text[..i], 20),
        (i, 'G' | 'g') => (&text[..i], 30),
        (i, 'T' | 't') => (&text[..i], 40),
        (i, 'P' | 'p') => (&text[..i], 50),
        _ => (text, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// `UNLIMITED`, `D-HH:MM:SS`, `HH:MM:SS`, `MM:SS`.
fn parse_time_limit(value: &str) -> Option<Duration> {
    let (days, clock) = match value.split_once('-') {
        Some((d, rest)) => (d.parse::<u64>().ok()?, rest),
        None => (0, value),
    };
    let parts: Vec<u64> = clock
        .split(':')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let seconds = match parts.as_slice() {
        [h, m, s] => h * 3600 + m * 60 + s,
        [m, s] => m * 60 + s,
        [m] => m * 60,
        _ => return None,
    };
    Some(Duration::from_secs(days * 86_400 + seconds))
}

/// What a job asks gpud for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// No GPU at all.
    Nothing,
    /// Memory, spread over `gpus` GPUs.
    Memory {
        /// How many GPUs.
        gpus: u32,
        /// Bytes on each.
        per_gpu: u64,
    },
    /// Whole GPUs placed by gpud.
    Whole {
        /// How many.
        gpus: u32,
    },
    /// Exactly the GPUs Slurm's own `gpu` GRES chose, whole.
    Named(Vec<String>),
}

/// The ask of a job: Slurm's own GPUs when it chose some, else the whole-GPU GRES, else
/// the memory GRES spread over the comment's `gpus=N` (default 1).
pub fn ask(env: &JobEnv, info: &JobInfo, config: &SlurmConfig) -> Result<Ask, String> {
    if !env.slurm_gpus.is_empty() {
        return Ok(Ask::Named(env.slurm_gpus.clone()));
    }
    let memory = info.gres.get(&config.memory_gres).copied().unwrap_or(0);
    let whole = info.gres.get(&config.whole_gres).copied().unwrap_or(0);
    let gpus = comment_gpus(&env.comment)?;
    match (memory, whole) {
        (0, 0) => Ok(Ask::Nothing),
        (0, n) => Ok(Ask::Whole {
            gpus: u32::try_from(n).map_err(|_| format!("{n} whole GPUs is too many"))?,
        }),
        (bytes, 0) => Ok(Ask::Memory {
            gpus: gpus.unwrap_or(1),
            per_gpu: bytes.div_ceil(u64::from(gpus.unwrap_or(1))),
        }),
        _ => Err(format!(
            "the job asks for both {} and {}; ask for GPU memory or for whole GPUs",
            config.memory_gres, config.whole_gres
        )),
    }
}

/// `gpus=N` among the comment's words (spaces or commas between them).
fn comment_gpus(comment: &str) -> Result<Option<u32>, String> {
    for word in comment.split([' ', ',', ';']) {
        if let Some(n) = word.strip_prefix("gpus=") {
            return match n.parse::<u32>() {
                Ok(n) if n > 0 => Ok(Some(n)),
                _ => Err(format!(
                    "--comment gpus={n}: give the number of GPUs to spread the memory over (1, 2, ...)"
                )),
            };
        }
    }
    Ok(None)
}

/// The reservation request for `ask`.
pub fn request(
    env: &JobEnv,
    info: &JobInfo,
    ask: &Ask,
    config: &SlurmConfig,
) -> Option<ReservationRequest> {
    let lease = info.time_limit.unwrap_or(config.unlimited_lease) + config.grace;
    let labels = env.labels();
    let mut request = ReservationRequest {
        id: Some(env.reservation_id()),
        owner_uid: env.uid,
        ttl_seconds: Some(lease.as_secs().max(1)),
        wait_seconds: Some(config.wait.as_secs()).filter(|w| *w > 0),
        labels,
        ..ReservationRequest::default()
    };
    match ask {
        Ask::Nothing => return None,
        Ask::Memory { gpus, per_gpu } => {
            request.gpus = Some(*gpus);
            request.memory = Some(MemorySpec::Bytes(*per_gpu));
        }
        Ask::Whole { gpus } => {
            request.gpus = Some(*gpus);
            request.exclusive = true;
        }
        Ask::Named(devices) => {
            request.devices.clone_from(devices);
            request.exclusive = true;
        }
    }
    Some(request)
}

/// What the prolog does when gpud refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not now: a batch job goes back to the queue; an interactive one is cancelled.
    NotNow,
    /// Never as asked: the job is cancelled.
    Never,
    /// gpud or the node is broken: the prolog fails and Slurm drains the node.
    Broken,
}

/// How the prolog treats gpud's answer `code`.
pub fn refusal(code: Option<&str>) -> Refusal {
    match code {
        Some(codes::NO_CAPACITY | codes::WAIT_TIMEOUT | codes::QUOTA_EXCEEDED) => Refusal::NotNow,
        Some(
            codes::UNSATISFIABLE
            | codes::ISOLATION_UNAVAILABLE
            | codes::INVALID_REQUEST
            | codes::FORBIDDEN
            | codes::CONFLICT,
        ) => Refusal::Never,
        _ => Refusal::Broken,
    }
}

/// Runs a hook; hooks log to stderr, which slurmd keeps in its log.
pub fn run(hook: SlurmHook, socket: Option<&Path>, rt: &Runtime) -> Result<ExitCode, CliError> {
    // slurmd passes `SLURM_CONF` to the prologs and epilogs but not to the health check:
    // there, the slurmd that runs it says which slurm.conf it reads.
    let slurm_conf = std::env::var("SLURM_CONF").ok().or_else(|| {
        let parent = std::os::unix::process::parent_id();
        slurmd_conf(
            &std::fs::read(format!("/proc/{parent}/cmdline")).ok()?,
            &std::fs::read(format!("/proc/{parent}/environ")).unwrap_or_default(),
        )
    });
    let env = |name: &str| match name {
        "SLURM_CONF" => slurm_conf.clone(),
        _ => std::env::var(name).ok(),
    };
    let mut config = SlurmConfig::load(&SlurmConfig::path(&env))?;
    config.slurm_conf = slurm_conf.as_deref().map(PathBuf::from);
    if let Some(socket) = socket {
        config.socket = socket.to_owned();
    }
    match hook {
        SlurmHook::Prolog => prolog(&config, &env, rt),
        SlurmHook::TaskProlog => task_prolog(&config, &env, rt),
        SlurmHook::Epilog => Ok(epilog(&config, &env, rt)),
        SlurmHook::Health => Ok(health(&config, &env, rt)),
    }
}

/// The slurm.conf a slurmd reads, from its command line (`-f PATH`) or its environment
/// (`SLURM_CONF`); `None` for the default, or when the process is no slurmd.
pub fn slurmd_conf(cmdline: &[u8], environ: &[u8]) -> Option<String> {
    let words: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    let program = words.first().map(|w| Path::new(w).file_name());
    if program != Some(Some(OsStr::new("slurmd"))) {
        return None;
    }
    let mut rest = words.iter().skip(1);
    while let Some(word) = rest.next() {
        if word == "-f" {
            return rest.next().cloned();
        }
        if let Some(path) = word.strip_prefix("-f") {
            return Some(path.to_owned());
        }
    }
    environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"SLURM_CONF="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

fn prolog(
    config: &SlurmConfig,
    env: &dyn Fn(&str) -> Option<String>,
    rt: &Runtime,
) -> Result<ExitCode, CliError> {
    let job = JobEnv::from_env(env)?;
    let info = parse_show_job(&scontrol(
        config,
        &["show", "job", "-d", &job.id.to_string()],
    )?);
    let ask = match ask(&job, &info, config) {
        Ok(ask) => ask,
        Err(why) => {
            refuse(config, &job, &info, Refusal::Never, &why);
            return Ok(ExitCode::SUCCESS);
        }
    };
    let Some(request) = request(&job, &info, &ask, config) else {
        return Ok(ExitCode::SUCCESS);
    };
    match rt.block_on(Client::new(&config.socket).reserve(&request)) {
        Ok(r) => {
            eprintln!("gpud: job {}: reserved {}", job.id, describe(&r));
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => match refusal(e.code()) {
            Refusal::Broken => Err(e),
            how => {
                refuse(config, &job, &info, how, &e.to_string());
                Ok(ExitCode::SUCCESS)
            }
        },
    }
}

/// `GPU 0, GPU 1: 15 GiB each (slurm-c-42)`.
fn describe(r: &Reservation) -> String {
    let gpus: Vec<String> = r.gpus.iter().map(|g| format!("GPU {}", g.index)).collect();
    let size = if r.exclusive {
        "whole".to_owned()
    } else {
        r.gpus
            .first()
            .map(|g| gpud_schema::format_bytes(g.memory_bytes))
            .unwrap_or_default()
    };
    format!("{} ({size}) as {}", gpus.join(", "), r.id)
}

/// Requeues or cancels the job, with the reason where its user sees it: the job's
/// `AdminComment` (`scontrol show job`). An interactive job is left to the task prolog,
/// which refuses its tasks and repeats the reason on their output, the user's terminal
/// (a job the prolog cancels ends with no word on srun's side).
fn refuse(config: &SlurmConfig, job: &JobEnv, info: &JobInfo, how: Refusal, why: &str) {
    let id = job.id.to_string();
    let what = match (how, info.batch) {
        (Refusal::NotNow, true) => format!(
            "requeued: no GPU room on this node now ({why}); it starts again in {} or later",
            gpud_schema::format_duration(config.requeue_delay)
        ),
        (Refusal::NotNow, false) => format!(
            "not started: no GPU room on this node now ({why}); try again later, or submit \
             it with sbatch, which waits"
        ),
        (_, true) => format!("cancelled: {why}"),
        (_, false) => format!("not started: {why}"),
    };
    eprintln!("gpud: job {id}: {what}");
    let comment = format!("AdminComment=gpud: {what}");
    let _ = scontrol(config, &["update", &format!("JobId={id}"), &comment]);
    let done = match (how, info.batch) {
        (Refusal::NotNow, true) => {
            let start = format!("StartTime=now+{}", config.requeue_delay.as_secs().max(1));
            scontrol(config, &["requeue", &id])
                .and_then(|_| scontrol(config, &["update", &format!("JobId={id}"), &start]))
        }
        (_, true) => run_program(config, "scancel", &[&id]),
        (_, false) => Ok(String::new()),
    };
    if let Err(e) = done {
        eprintln!("gpud: job {id}: {e}");
    }
}

fn task_prolog(
    config: &SlurmConfig,
    env: &dyn Fn(&str) -> Option<String>,
    rt: &Runtime,
) -> Result<ExitCode, CliError> {
    let job = JobEnv::from_env(env)?;
    let client = Client::new(&config.socket);
    // The job's reservation, by its labels: the task does not know how often the job was
    // requeued. Only one of the user's own counts (nobody else can make one for them).
    let me = nix::unistd::getuid().as_raw();
    let found = rt
        .block_on(client.list_labelled(&job.selector()))
        .map(|list| {
            list.reservations
                .into_iter()
                .find(|r| r.owner_uid == me && r.state == ReservationState::Active)
        });
    if let Ok(Some(r)) = &found {
        crate::print(&task_exports(r, &config.socket))?;
        return Ok(ExitCode::SUCCESS);
    }
    // No reservation: fine for a job that asked for no GPU. One that did (a requeued job
    // that Slurm 22.05 relaunched without its prolog, or one the prolog refused) must not
    // run on GPUs nobody reserved for it.
    let text = scontrol(config, &["show", "job", "-d", &job.id.to_string()])?;
    let info = parse_show_job(&text);
    if matches!(ask(&job, &info, config), Ok(Ask::Nothing)) {
        return Ok(ExitCode::SUCCESS);
    }
    let why = match found {
        Ok(_) => "gpud holds no reservation for it".to_owned(),
        Err(e) => e.to_string(),
    };
    let admin = admin_comment(&text)
        .map(|c| format!("; {c}"))
        .unwrap_or_default();
    crate::print(&format!(
        "print gpud: job {} holds no GPUs on this node: {why}{admin}; not starting the task\n",
        job.id
    ))?;
    Ok(ExitCode::FAILURE)
}

/// `AdminComment=…` (to the end of its line) from `scontrol show job`.
fn admin_comment(text: &str) -> Option<&str> {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix("AdminComment="))
        .map(str::trim)
        .filter(|c| !c.is_empty() && *c != "(null)")
}

/// The task prolog's output: an `export NAME=value` line per variable. Slurm takes the
/// value literally, without quotes, up to the end of the line.
pub fn task_exports(r: &Reservation, socket: &Path) -> String {
    let socket = socket.display().to_string();
    let mut vars: BTreeMap<&str, &str> = r
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    vars.insert("GPUD_RESERVATION_ID", &r.id);
    vars.insert("GPUD_SOCKET", &socket);
    vars.into_iter()
        .filter(|(_, value)| !value.contains('\n'))
        .map(|(name, value)| format!("export {name}={value}\n"))
        .collect()
}

fn epilog(config: &SlurmConfig, env: &dyn Fn(&str) -> Option<String>, rt: &Runtime) -> ExitCode {
    // An epilog that fails drains the node: whatever happens, say it and succeed.
    let job = match JobEnv::from_env(env) {
        Ok(job) => job,
        Err(e) => {
            eprintln!("gpud: epilog: {e}");
            return ExitCode::SUCCESS;
        }
    };
    match rt.block_on(Client::new(&config.socket).release_labelled(&job.selector())) {
        Ok(list) => {
            for r in list.reservations {
                eprintln!("gpud: job {}: released {}", job.id, r.id);
            }
        }
        Err(e) => eprintln!(
            "gpud: job {}: could not release its reservation: {e}; `gpuctl slurm health` will",
            job.id
        ),
    }
    ExitCode::SUCCESS
}

fn health(config: &SlurmConfig, env: &dyn Fn(&str) -> Option<String>, rt: &Runtime) -> ExitCode {
    if let Err(e) = reconcile(config, env, rt) {
        eprintln!("gpud: health: {e}");
    }
    ExitCode::SUCCESS
}

/// Releases the reservations of jobs no longer on this node and renews the others'.
fn reconcile(
    config: &SlurmConfig,
    env: &dyn Fn(&str) -> Option<String>,
    rt: &Runtime,
) -> Result<(), CliError> {
    let client = Client::new(&config.socket);
    // What was reserved before the job list is read is what the list can speak for: a job
    // that starts meanwhile has a newer reservation.
    #[allow(clippy::disallowed_methods)] // the one wall-clock read of this command
    let listed_at = SystemTime::now();
    let node = env("SLURMD_NODENAME")
        .or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
            Some(host.trim().split('.').next()?.to_owned())
        })
        .unwrap_or_default();
    let squeue = run_program(
        config,
        "squeue",
        &[
            "--noheader",
            "--nodelist",
            &node,
            "--states",
            "CONFIGURING,RUNNING,COMPLETING,SUSPENDED,STOPPED",
            "--format",
            "%A",
        ],
    )?;
    let running: BTreeSet<&str> = squeue.split_whitespace().collect();
    let cluster = env("SLURM_CLUSTER_NAME");
    let list = match &cluster {
        Some(c) => rt.block_on(client.list_labelled(&[(CLUSTER_LABEL.to_owned(), c.clone())]))?,
        None => rt.block_on(client.list("active", None))?,
    };
    for r in list.reservations {
        let Some(job) = r.labels.get(JOB_LABEL) else {
            continue;
        };
        if running.contains(job.as_str()) {
            if r.ttl_seconds.is_some()
                && let Err(e) = rt.block_on(client.renew(&r.id, None))
            {
                eprintln!("gpud: health: could not renew {}: {e}", r.id);
            }
            continue;
        }
        let created = humantime::parse_rfc3339(&r.created_at).unwrap_or(listed_at);
        if created < listed_at {
            match rt.block_on(client.release(&r.id)) {
                Ok(_) => eprintln!("gpud: health: released {} (job {job} is gone)", r.id),
                Err(e) => eprintln!("gpud: health: could not release {}: {e}", r.id),
            }
        }
    }
    Ok(())
}

fn scontrol(config: &SlurmConfig, args: &[&str]) -> Result<String, CliError> {
    run_program(config, "scontrol", args)
}

/// Runs Slurm's program `name` and returns its stdout, or why it failed as one line.
fn run_program(config: &SlurmConfig, name: &str, args: &[&str]) -> Result<String, CliError> {
    let program = config.program(name);
    let mut command = Command::new(&program);
    if let Some(conf) = &config.slurm_conf {
        command.env("SLURM_CONF", conf);
    }
    let out = command.args(args).output().map_err(|e| {
        CliError::Slurm(format!(
            "cannot run {}: {e} (slurm_bin in gpud-slurm.toml says where Slurm's programs are)",
            program.display()
        ))
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(CliError::Slurm(format!(
            "{} {} failed ({}): {}",
            program.display(),
            args.join(" "),
            out.status,
            err.trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests;
