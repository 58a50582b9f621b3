//! The command line: clap definitions and the parsers for sizes, durations and labels.
//!
//! Depends on clap and the schema crate's size parser only. Every value is checked here, so
//! a typo is a usage error (exit 2) before anything is sent to gpud.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use gpud_schema::{DEFAULT_SOCKET, MemoryAmount, PolicyName, parse_memory};

/// Exit codes, as `--help`, the man page and docs/gpuctl.md list them.
pub const EXIT_CODES_HELP: &str = "\
Exit status:
  0    success (with `reserve ... -- COMMAND`: the command's own exit status)
  1    any other error (not found, not active, gpud failed)
  2    usage error (bad flag or value, or gpud rejected the request as invalid)
  3    gpud unreachable (socket missing, refused, or connection lost)
  4    no capacity now (try again later, or --wait)
  5    --wait timed out
  6    forbidden or over quota
  7    never as asked (can never fit here, [isolation] require cannot be met, or the id
       is taken): retrying the same request is futile
  126  (reserve -- COMMAND) COMMAND is not executable
  127  (reserve -- COMMAND) COMMAND was not found
  130  interrupted by Ctrl-C before the reservation was made; nothing is held
       (143 for SIGTERM, 129 for SIGHUP)";

/// `reserve --status-every`'s default.
pub const STATUS_EVERY: &str = "30s";

/// The exit codes of a command that only reads (ls, show, gpus, ps, waiters, events).
const READ_EXIT_CODES: &str = "\
Exit status:
  0    success
  1    any other error (not found, gpud failed)
  2    usage error (bad flag or value)
  3    gpud unreachable (socket missing, refused, or connection lost)";

/// The exit codes of release and renew.
const CHANGE_EXIT_CODES: &str = "\
Exit status:
  0    success
  1    any other error (not found, not active any more, gpud failed)
  2    usage error (bad flag or value, or an id prefix that names several reservations)
  3    gpud unreachable (socket missing, refused, or connection lost)
  6    forbidden: not yours (only its owner, root or an admin group may)";

const RESERVE_AFTER_HELP: &str = "\
Sizes are per GPU and binary, like nvidia-smi's: 512MiB, 4GiB, 1.5G; G, GB and GiB all mean
2^30 bytes. A percentage (25%) is that share of each chosen GPU's memory.
Durations: 30s, 5m, 1h30m, or plain seconds.

Who holds the reservation:
  with -- COMMAND   COMMAND itself (gpuctl execs it in its own process): released when it
                    exits, however it exits
  without COMMAND   the calling shell (gpuctl's parent), or --holder-pid PID, or
                    --holder-cgroup CGROUP (released when it is empty); with --ttl alone,
                    nobody: a lease released unless renewed (gpuctl renew)

Hard isolation: with -- COMMAND, gpud first moves gpuctl into a cgroup of its own (a systemd
scope gpud-ID.scope, or a child of gpud's cgroup), so COMMAND starts there; where the NVIDIA
driver is R615 or later, that cgroup's GPU memory is limited to the reservation, and an
allocation beyond it fails with out-of-memory. `gpuctl show ID` says driver-enforced or
advisory, and why.

Examples:
  gpuctl reserve --mem 6GiB -- python serve.py
  eval \"$(gpuctl reserve --mem 4GiB)\"
  gpuctl reserve --gpus 2 --exclusive --wait 10m --label job=train -- ./train.sh
  gpuctl reserve --mem 25% --ttl 2h -o json

Exit status:
  0    success, or with -- COMMAND the command's own exit status
  2    usage error          3  gpud unreachable      4  no capacity
  5    --wait timed out     6  forbidden / quota     1  other errors
  126  COMMAND not executable    127  COMMAND not found    130  interrupted";

const CDI_HOOK_AFTER_HELP: &str = "\
Container runtimes run this, not people. With [cdi] enabled in gpud.toml, gpud writes a CDI
spec for each reservation: the device gpud.io/reservation=ID carries the reservation's
environment and this command as its createContainer hook. `docker run --device
gpud.io/reservation=ID` (podman, containerd and CRI-O alike, and pods through gpud's kubelet
plugin) then runs it once the container and its cgroup exist, before the container's first
instruction, with the container's OCI state (JSON) on stdin. It asks gpud to put
reservation ID's memory limits on the container's own cgroup, which gpud finds from the
state's pid read in the hook's PID namespace (`1` under runc).

Exit status:
  0    gpud attached the container (one line on stderr if its limits are only advisory:
       an old driver, MIG, no cgroup v2)
  non-zero, with one line on stderr: anything else, and the runtime does not start the
       container. gpud refuses (isolation_unavailable) a container whose own cgroup it
       cannot find or limit where the driver could enforce the limits, and under
       [isolation] require any container it cannot limit";

/// gpuctl: reserve GPU memory or whole GPUs from gpud, the node's GPU broker.
#[derive(Debug, Parser)]
#[command(
    name = "gpuctl",
    version,
    about = "Reserve GPU memory or whole GPUs from gpud, the node's GPU broker",
    long_about = "Reserve GPU memory or whole GPUs from gpud, the node's GPU broker, and see \
                  who holds what. Talks HTTP to gpud over its Unix socket. Tables for people, \
                  -o json for scripts.",
    after_help = EXIT_CODES_HELP,
    propagate_version = true,
    disable_help_subcommand = true
)]
pub struct Cli {
    /// gpud's Unix socket.
    #[arg(
        long,
        global = true,
        env = "GPUD_SOCKET",
        help_heading = "Global options",
        value_hint = clap::ValueHint::FilePath,
        default_value = DEFAULT_SOCKET,
        value_name = "PATH",
        value_parser = socket_path
    )]
    pub socket: PathBuf,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
// `defer`: a subcommand's arguments are defined only when clap builds that subcommand, i.e.
// for the one on the command line (and for all of them when the help, man pages or
// completions are generated), not on every start: gpuctl starts for every workload. The
// argument types below therefore carry `//` comments, not doc comments: clap would make a
// type's doc comment its subcommand's description, in place of the variant's.
#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum Command {
    /// Reserve GPU memory or whole GPUs, then run a command with them or print the environment.
    #[command(after_help = RESERVE_AFTER_HELP)]
    Reserve(ReserveArgs),
    /// Release a reservation now.
    #[command(after_help = CHANGE_EXIT_CODES)]
    Release(IdArgs),
    /// Extend a TTL lease.
    #[command(after_help = CHANGE_EXIT_CODES)]
    Renew(RenewArgs),
    /// List reservations.
    #[command(visible_alias = "list", after_help = READ_EXIT_CODES)]
    Ls(ListArgs),
    /// Show one reservation: GPUs, holder, lease and environment.
    #[command(after_help = READ_EXIT_CODES)]
    Show(IdArgs),
    /// Per GPU (and MIG instance): memory reserved, used and total, reservations, health.
    #[command(after_help = READ_EXIT_CODES)]
    Gpus(TableArgs),
    /// Processes on the GPUs: memory, user, command, and the reservation each counts against
    /// (or unreserved), as gpud's usage check last saw them.
    #[command(after_help = READ_EXIT_CODES)]
    Ps(TableArgs),
    /// Requests waiting for capacity (`reserve --wait`), in the order gpud tries them: who
    /// asked, for what, since when.
    #[command(after_help = READ_EXIT_CODES)]
    Waiters(TableArgs),
    /// Audit events: processes nobody reserved for, on the wrong GPU, or over their limit;
    /// GPUs lost and recovered.
    #[command(after_help = READ_EXIT_CODES)]
    Events(EventsArgs),
    /// The CDI hook of a reservation's device: puts its memory limits on a new container's
    /// cgroup.
    #[command(name = gpud_schema::cdi_hook::SUBCOMMAND, after_help = CDI_HOOK_AFTER_HELP)]
    CdiHook(CdiHookArgs),
    /// Slurm's node hooks: gpud as the GPU allocator of a Slurm node (see docs/slurm.md).
    /// slurm.conf names links to gpuctl (gpud-slurm-prolog, ...).
    #[command(after_help = SLURM_AFTER_HELP)]
    Slurm {
        /// Which hook.
        #[command(subcommand)]
        hook: SlurmHook,
    },
    /// Print a shell completion script to stdout.
    #[command(
        after_help = "Examples:\n  gpuctl completions bash > /etc/bash_completion.d/gpuctl\n  \
                            gpuctl completions zsh > \"${fpath[1]}/_gpuctl\"\n  \
                            gpuctl completions fish > ~/.config/fish/completions/gpuctl.fish"
    )]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff) to stdout: `gpuctl man | man -l -`.
    Man {
        /// A subcommand's own page (gpuctl-reserve(1) and so on) instead of gpuctl(1).
        subcommand: Option<String>,
    },
    /// Write every man page and completion script under DIR, at the path a package installs
    /// it to (DIR/usr/share/man/man1/gpuctl.1, ...). For packagers, hence hidden.
    #[command(hide = true)]
    PackageFiles {
        /// The root to write under (target/assets for the Debian package).
        #[arg(value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
        dir: PathBuf,
    },
}

// `gpuctl reserve`.
#[derive(Debug, PartialEq, Args)]
#[command(group(clap::ArgGroup::new("size").required(true).args(["mem", "exclusive"])))]
pub struct ReserveArgs {
    /// Number of GPUs (default 1, or as many as --devices names).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub gpus: Option<u32>,

    /// Only these GPUs, by index or UUID (comma-separated, as gpuctl gpus lists them).
    #[arg(long, value_name = "GPUS", value_delimiter = ',')]
    pub devices: Vec<String>,

    /// Memory per GPU: 512MiB, 4GiB, 4G (G means GiB: GPU memory is binary), or 25% of each GPU.
    // allow_hyphen_values: `--mem -1GiB` gets the size's error, not clap's tip to write
    // `-- -1`, which here would run `-1` as the command.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, allow_hyphen_values = true)]
    pub mem: Option<MemoryAmount>,

    /// Whole GPUs, shared with nobody.
    #[arg(long)]
    pub exclusive: bool,

    /// Compute: at most this percentage of each GPU's SMs, 1 to 100 (25 or 25%). gpud never
    /// promises more than 100% of a GPU; its MPS server enforces the cap on GPUs in mps
    /// mode. Not with --exclusive, nor on a MIG instance.
    // allow_hyphen_values: `--compute -5` gets the percentage's error, not clap's tip.
    #[arg(long, value_name = "PCT", value_parser = parse_compute, conflicts_with = "exclusive", allow_hyphen_values = true)]
    pub compute: Option<u32>,

    /// Queue until capacity frees up, at most DURATION (without one: as long as gpud allows,
    /// its `[wait] max_wait_seconds`, 24h by default).
    #[arg(
        long,
        value_name = "DURATION",
        num_args = 0..=1,
        require_equals = false,
        value_parser = parse_duration
    )]
    pub wait: Option<Option<Duration>>,

    /// Without a terminal (a container's log), how often a waiting gpuctl says on stderr
    /// where it stands and why it waits (also when the wait starts and ends).
    #[arg(long, value_name = "DURATION", default_value = STATUS_EVERY, value_parser = parse_duration)]
    pub status_every: Duration,

    /// Lease length: released unless renewed (`gpuctl renew`) within DURATION.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ttl: Option<Duration>,

    /// How long you expect to hold it: the queue plans on it when it drains GPUs for a
    /// request waiting for several (instead of the lease's end). Never enforced; at most
    /// --ttl.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub expect: Option<Duration>,

    /// Process that holds the reservation (default: the calling shell). Not with -- COMMAND.
    #[arg(long, value_name = "PID", conflicts_with = "command", value_parser = clap::value_parser!(u32).range(1..))]
    pub holder_pid: Option<u32>,

    /// A cgroup v2 that holds the reservation instead of a process: released when the
    /// cgroup is empty. Yours or one below it (root and admins: any); the memory limits go
    /// on it. As /proc/PID/cgroup writes it (/system.slice/job.scope) or its full path.
    #[arg(long, value_name = "CGROUP", conflicts_with_all = ["command", "holder_pid"])]
    pub holder_cgroup: Option<String>,

    /// A label (repeatable): job, team, pod or container names.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,

    /// Placement policy: binpack (best fit, keeps whole GPUs free) or spread (most free memory).
    #[arg(long, value_enum)]
    pub policy: Option<Policy>,

    /// Output without a command: shell `export` lines (env) or the reservation (json; a
    /// failure too, as {"error": {...}} on stdout).
    #[arg(short, long, value_enum, default_value_t = ReserveOutput::Env, conflicts_with = "command")]
    pub output: ReserveOutput,

    /// The command to run with the reservation (after `--`); it becomes the holder.
    #[arg(last = true, value_name = "COMMAND", value_hint = clap::ValueHint::CommandWithArguments)]
    pub command: Vec<String>,
}

/// Placement policy, as the flag spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    /// Best fit, keeping whole GPUs free for bigger requests.
    Binpack,
    /// Most free memory first.
    Spread,
}

impl From<Policy> for PolicyName {
    fn from(p: Policy) -> PolicyName {
        match p {
            Policy::Binpack => PolicyName::Binpack,
            Policy::Spread => PolicyName::Spread,
        }
    }
}

/// `reserve -o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReserveOutput {
    /// `export KEY='value'` lines for `eval`.
    Env,
    /// The reservation as JSON.
    Json,
}

/// `-o` of the listing commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    #[default]
    Table,
    /// JSON, exactly the wire types of gpud's API.
    Json,
}

// A command that takes a reservation id.
#[derive(Debug, Args)]
pub struct IdArgs {
    /// Reservation id (as `gpuctl ls` shows it, or $GPUD_RESERVATION_ID).
    #[arg(value_name = "ID", value_parser = parse_id)]
    pub id: String,
    /// Output format (json: failures too, as {"error": {...}} on stdout).
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

// `gpuctl cdi-hook`.
#[derive(Debug, Args)]
pub struct CdiHookArgs {
    /// The reservation whose CDI device the container was given.
    #[arg(long, value_name = "ID", value_parser = parse_id)]
    pub reservation: String,
}

// `gpuctl renew`.
#[derive(Debug, Args)]
pub struct RenewArgs {
    /// Reservation id.
    #[arg(value_name = "ID", value_parser = parse_id)]
    pub id: String,
    /// New lease length from now (default: the lease's own TTL).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ttl: Option<Duration>,
    /// Output format (json: failures too, as {"error": {...}} on stdout).
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

// `gpuctl ls`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Which reservations.
    #[arg(long, value_enum, default_value_t = StateFilter::Active)]
    pub state: StateFilter,
    /// Only those of this user (a name, as the OWNER column shows it, or a uid).
    #[arg(long, value_name = "USER", value_parser = parse_user)]
    pub owner: Option<u32>,
    /// Output format (json: failures too, as {"error": {...}} on stdout).
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

// `gpuctl events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Only events of the last DURATION (`10m`, `2h`) or since a time (`2026-11-21T05:00:00Z`).
    #[arg(long, value_name = "WHEN")]
    pub since: Option<String>,
    /// Only this kind.
    #[arg(long, value_enum)]
    pub kind: Option<EventKindArg>,
    /// Only events about this reservation.
    #[arg(long, value_name = "ID")]
    pub reservation: Option<String>,
    /// Keep printing new events as they happen (Ctrl-C to stop); with `-o json`, one object a line.
    #[arg(short, long)]
    pub follow: bool,
    /// Output format (json: failures too, as {"error": {...}} on stdout).
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

/// `events --kind`.
/// Named as the API, the README and `gpuctl events` print them (`wrong_gpu`); the dashed
/// spellings work too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum EventKindArg {
    /// A GPU process no reservation accounts for.
    Unreserved,
    /// A reservation's process on a GPU it does not hold.
    #[value(alias = "wrong-gpu")]
    WrongGpu,
    /// A reservation using more than it reserved.
    #[value(alias = "over-limit")]
    OverLimit,
    /// A GPU lost or failing.
    #[value(alias = "gpu-unhealthy")]
    GpuUnhealthy,
    /// A memory limit the driver refused, or could not reset.
    Isolation,
    /// A process using a reservation outside the cgroup the driver limits for it, under
    /// `[isolation] require`, or past its MPS server.
    Unlimited,
}

impl EventKindArg {
    /// The API's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKindArg::Unreserved => "unreserved",
            EventKindArg::WrongGpu => "wrong_gpu",
            EventKindArg::OverLimit => "over_limit",
            EventKindArg::GpuUnhealthy => "gpu_unhealthy",
            EventKindArg::Isolation => "isolation",
            EventKindArg::Unlimited => "unlimited",
        }
    }
}

/// `ls --state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateFilter {
    /// Holding GPU memory now.
    Active,
    /// Released by a person or because the holder exited.
    Released,
    /// Lease ran out.
    Expired,
    /// Everything gpud remembers.
    All,
}

impl StateFilter {
    /// The query value.
    pub fn as_str(self) -> &'static str {
        match self {
            StateFilter::Active => "active",
            StateFilter::Released => "released",
            StateFilter::Expired => "expired",
            StateFilter::All => "all",
        }
    }
}

impl Cli {
    /// The socket, when one other than the default was given (`--socket`, `GPUD_SOCKET`):
    /// it wins over the Slurm hooks' configuration.
    pub fn socket_given(&self) -> Option<&std::path::Path> {
        (self.socket != std::path::Path::new(DEFAULT_SOCKET)).then_some(self.socket.as_path())
    }
}

// The hooks of `gpuctl slurm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Subcommand)]
pub enum SlurmHook {
    /// Prolog (root): reserve what the job's GRES asks for, for the job's user; when nothing
    /// fits, requeue a batch job (an interactive one is refused by the task prolog), and
    /// never fail for that.
    Prolog,
    /// TaskProlog (the user): print the reservation's environment; refuse a task whose job
    /// asked for GPUs and holds none.
    TaskProlog,
    /// Epilog (root): release the job's reservation. Never fails.
    Epilog,
    /// HealthCheckProgram (root): release what jobs gone from the node still hold, renew
    /// the leases of those running.
    Health,
}

const SLURM_AFTER_HELP: &str = "\
slurm.conf runs programs without arguments: link gpuctl as gpud-slurm-prolog,
gpud-slurm-task-prolog, gpud-slurm-epilog and gpud-slurm-health (the package installs the
links in /usr/lib/gpud) and name those. Settings: gpud-slurm.toml beside slurm.conf, or
$GPUD_SLURM_CONFIG.";

/// What a failed command prints on stdout besides its line on stderr, for whatever reads
/// its stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// Nothing.
    Nothing,
    /// The error as JSON (`-o json`).
    Json,
    /// `false`, for `eval "$(gpuctl reserve …)"`: the eval fails as the reservation did
    /// (an empty string would eval to success, and a script would carry on without its GPU).
    /// Only when stdout is not a terminal: a person reading it needs no `false`.
    Eval,
}

impl Command {
    /// What the command prints on stdout when it fails ([`OnFailure`]).
    pub fn on_failure(&self) -> OnFailure {
        match self {
            Command::Reserve(r) if r.command.is_empty() && r.output == ReserveOutput::Env => {
                OnFailure::Eval
            }
            _ if self.prints_json() => OnFailure::Json,
            _ => OnFailure::Nothing,
        }
    }

    /// Whether the command prints JSON (`-o json`), failures included.
    pub fn prints_json(&self) -> bool {
        let output = match self {
            Command::Reserve(r) => return r.output == ReserveOutput::Json,
            Command::Release(a) | Command::Show(a) => a.output,
            Command::Renew(a) => a.output,
            Command::Ls(a) => a.output,
            Command::Events(a) => a.output,
            Command::Gpus(a) | Command::Waiters(a) | Command::Ps(a) => a.output,
            Command::CdiHook(_)
            | Command::Slurm { .. }
            | Command::Completions { .. }
            | Command::Man { .. }
            | Command::PackageFiles { .. } => return false,
        };
        output == Output::Json
    }
}

// Commands with only an output format.
#[derive(Debug, Args)]
pub struct TableArgs {
    /// Output format (json: failures too, as {"error": {...}} on stdout).
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

/// `--mem`: the schema crate's parser, so gpuctl and gpud read sizes the same way.
/// `--socket` / `GPUD_SOCKET`; empty (`GPUD_SOCKET=` in a script) means the default.
fn socket_path(s: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(if s.is_empty() { DEFAULT_SOCKET } else { s }))
}

/// A user name or a numeric uid, as a uid.
fn parse_user(s: &str) -> Result<u32, String> {
    if let Ok(uid) = s.parse::<u32>() {
        return Ok(uid);
    }
    crate::users::Accounts::read()
        .uid_of(s)
        .ok_or_else(|| format!("no user {s:?} on this machine; give a user name or a uid"))
}

/// A size for `--mem`, always with its unit: a number without one is refused with the
/// spellings it could mean, whatever its size (`--mem 16` is a forgotten `GiB`, and so may
/// `--mem 4096` or `--mem 1048576` be). Bytes are `B`: `--mem 1048576B`. The API's plain
/// numbers are bytes; a person's are not sure to be.
pub fn parse_size(s: &str) -> Result<MemoryAmount, String> {
    let amount = parse_memory(s).map_err(|e| e.to_string())?;
    let plain = s.trim();
    if plain.bytes().all(|c| c.is_ascii_digit()) {
        return Err(format!(
            "{plain} has no unit; give one: {plain}GiB, {plain}MiB, or {plain}B for bytes"
        ));
    }
    Ok(amount)
}

/// `--compute`: a whole percentage of each GPU's SMs from 1 to 100, with or without `%`.
pub fn parse_compute(s: &str) -> Result<u32, String> {
    let plain = s.trim();
    let digits = plain.strip_suffix('%').unwrap_or(plain).trim_end();
    let whole = || {
        format!(
            "{plain:?} is not a whole percentage; give 1 to 100 of each GPU's SMs, e.g. 25 or 25%"
        )
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(whole());
    }
    match digits.parse::<u64>() {
        Ok(p @ 1..=100) => u32::try_from(p).map_err(|_| whole()),
        Ok(0) => Err(
            "0% of each GPU's SMs is no compute; give 1 to 100, or leave --compute out".to_owned(),
        ),
        Ok(p) => Err(format!("{p}% is more than a GPU has; give 1 to 100")),
        Err(_) => Err(format!("{plain} is more than a GPU has; give 1 to 100")),
    }
}

/// `30s`, `5m`, `1h30m`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration {s:?} ({e}); write e.g. 30s, 5m, 1h30m or 90"))
}

/// Whole seconds for the API, rounded up so `500ms` does not become "no wait at all".
pub fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// `KEY=VALUE`.
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!(
            "invalid label {s:?}; write KEY=VALUE, e.g. job=train"
        )),
    }
}

/// Reservation ids are letters, digits, `-`, `_` and `.`: checked here so that an id can
/// never change which URL is requested.
fn parse_id(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s != "."
        && s != "..";
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a reservation id (letters, digits, '-', '_' and '.'); see `gpuctl ls`"
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_subcommand_lists_only_its_own_exit_codes() {
        let help = |name: &str| {
            let mut cmd = Cli::command();
            let sub = cmd.find_subcommand_mut(name).unwrap();
            sub.render_long_help().to_string()
        };
        let reserve = help("reserve");
        assert!(
            reserve.contains("--wait timed out") && reserve.contains("127"),
            "{reserve}"
        );
        for read in ["ls", "show", "gpus", "ps", "waiters", "events"] {
            let text = help(read);
            assert!(text.contains("3    gpud unreachable"), "{read}: {text}");
            assert!(
                !text.contains("--wait timed out") && !text.contains("127"),
                "{read}: {text}"
            );
        }
        for change in ["release", "renew"] {
            let text = help(change);
            assert!(text.contains("6    forbidden"), "{change}: {text}");
            assert!(!text.contains("--wait timed out"), "{change}: {text}");
        }
    }

    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    fn reserve(args: &[&str]) -> Result<ReserveArgs, clap::Error> {
        let cli = Cli::try_parse_from(["gpuctl", "reserve"].iter().chain(args))?;
        match cli.command {
            Command::Reserve(r) => Ok(r),
            other => Err(clap::Error::raw(
                clap::error::ErrorKind::InvalidSubcommand,
                format!("{other:?}"),
            )),
        }
    }

    #[test]
    fn an_empty_socket_means_the_default() {
        let cli = Cli::try_parse_from(["gpuctl", "--socket", "", "gpus"]).unwrap();
        assert_eq!(cli.socket, PathBuf::from(DEFAULT_SOCKET));
        let cli = Cli::try_parse_from(["gpuctl", "--socket", "/tmp/g.sock", "gpus"]).unwrap();
        assert_eq!(cli.socket, PathBuf::from("/tmp/g.sock"));
    }

    #[test]
    fn owners_are_names_or_uids() {
        assert_eq!(parse_user("root"), Ok(0));
        assert_eq!(parse_user("1000"), Ok(1000));
        let e = parse_user("no-such-user-here").unwrap_err();
        assert!(e.contains("give a user name or a uid"), "{e}");
    }

    #[test]
    fn a_number_without_a_unit_is_refused_whatever_its_size() {
        for plain in ["16", "4096", "1048576", "17179869184"] {
            let e = reserve(&["--mem", plain]).unwrap_err().to_string();
            assert!(
                e.contains(&format!(
                    "{plain} has no unit; give one: {plain}GiB, {plain}MiB, or {plain}B for bytes"
                )),
                "{e}"
            );
        }
        let e = reserve(&["--mem", "1.5"]).unwrap_err().to_string();
        assert!(e.contains("must be whole"), "{e}");
        let e = reserve(&["--mem", "-1GiB"]).unwrap_err().to_string();
        assert!(e.contains(r#"invalid memory size "-1GiB""#), "{e}");
        let r = reserve(&["--mem", "17179869184B"]).unwrap();
        assert_eq!(r.mem, Some(MemoryAmount::Bytes(16 << 30)));
        let r = reserve(&["--mem", "512KiB"]).unwrap();
        assert_eq!(r.mem, Some(MemoryAmount::Bytes(512 << 10)));
    }

    #[test]
    fn event_kinds_are_spelled_as_gpud_prints_them_or_with_dashes() {
        for (arg, api) in [
            ("wrong_gpu", "wrong_gpu"),
            ("wrong-gpu", "wrong_gpu"),
            ("over_limit", "over_limit"),
            ("gpu-unhealthy", "gpu_unhealthy"),
            ("unreserved", "unreserved"),
            ("isolation", "isolation"),
            ("unlimited", "unlimited"),
        ] {
            let cli = Cli::try_parse_from(["gpuctl", "events", "--kind", arg]).unwrap();
            let Command::Events(e) = cli.command else {
                panic!("{arg}: not events");
            };
            assert_eq!(e.kind.map(EventKindArg::as_str), Some(api), "{arg}");
        }
        let e = Cli::try_parse_from(["gpuctl", "events", "--kind", "wrong"]).unwrap_err();
        assert!(e.to_string().contains("wrong_gpu"), "{e}");
    }

    #[test]
    fn reserve_flags() {
        let r = reserve(&["--mem", "4G", "--", "python", "-c", "x"]).unwrap();
        assert_eq!(r.mem, Some(MemoryAmount::Bytes(4 << 30)));
        assert_eq!(r.command, ["python", "-c", "x"]);
        assert_eq!(r.wait, None);
        let r = reserve(&["--mem", "25%", "--wait", "--ttl", "90"]).unwrap();
        assert_eq!(r.mem, Some(MemoryAmount::BasisPoints(2500)));
        assert_eq!(r.wait, Some(None));
        assert_eq!(r.ttl, Some(Duration::from_secs(90)));
        let r = reserve(&[
            "--exclusive",
            "--gpus",
            "2",
            "--wait",
            "5m",
            "--label",
            "a=b=c",
        ])
        .unwrap();
        assert_eq!(r.wait, Some(Some(Duration::from_secs(300))));
        assert_eq!(r.labels, [("a".to_owned(), "b=c".to_owned())]);
        let r = reserve(&["--mem", "1G", "--wait", "--", "true"]).unwrap();
        assert_eq!(r.wait, Some(None));
        assert_eq!(r.command, ["true"]);
    }

    #[test]
    fn reserve_usage_errors() {
        for args in [
            &[][..],
            &["--mem", "4 parsecs"],
            &["--mem", "1G", "--exclusive"],
            &["--mem", "1G", "--gpus", "0"],
            &["--mem", "1G", "--label", "novalue"],
            &["--mem", "1G", "--ttl", "soon"],
            &["--mem", "1G", "--holder-pid", "5", "--", "true"],
            &["--mem", "1G", "-o", "json", "--", "true"],
            &["--mem", "1G", "true"],
            &["--mem", "1G", "--policy", "random"],
        ] {
            assert!(reserve(args).is_err(), "{args:?}");
        }
    }

    #[test]
    fn the_cdi_hook_parses_as_gpud_writes_it() {
        // The hook's args in the spec gpud writes (gpud::cdi::spec).
        let cli = Cli::try_parse_from(gpud_schema::cdi_hook::args(
            "/run/gpud/gpud.sock",
            "19a2b3c4d5e00001",
        ))
        .unwrap();
        assert_eq!(cli.socket, PathBuf::from("/run/gpud/gpud.sock"));
        let Command::CdiHook(args) = cli.command else {
            panic!("not cdi-hook");
        };
        assert_eq!(args.reservation, "19a2b3c4d5e00001");
        assert!(Cli::try_parse_from(["gpuctl", "cdi-hook"]).is_err());
        assert!(Cli::try_parse_from(["gpuctl", "cdi-hook", "--reservation", "../x"]).is_err());
    }

    #[test]
    fn ids_cannot_change_the_url() {
        assert!(parse_id("3f2a-9c0d_1e.2b").is_ok());
        for bad in ["", ".", "..", "a/b", "a?b", "a b", "a%2F"] {
            assert!(parse_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(whole_seconds(Duration::from_millis(500)), 1);
        assert_eq!(whole_seconds(Duration::from_secs(3)), 3);
        assert!(parse_duration("-1s").is_err());
    }
}
