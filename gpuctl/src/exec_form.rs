//! The exec form's command line read without clap: `gpuctl reserve FLAGS -- COMMAND`.
//!
//! gpuctl starts in front of every workload (`gpuctl reserve --mem 6GiB -- python
//! serve.py`), and building clap's definition of the `reserve` command and matching against
//! it is a good part of what gpuctl adds to that start (docs/performance.md, "gpuctl's
//! cost"). This reads the usual shapes of that line itself: `reserve`, then only the flags
//! below (`--flag VALUE` or `--flag=VALUE`), each value read by the parser clap uses
//! (`--policy` by its `ValueEnum`), then `--` and a command. Anything else, a value that does not parse included, returns `None`
//! and goes to clap, which gives the usual message: so this path never decides an error,
//! and what it accepts, clap accepts the same way (a test checks both readings agree).
//!
//! Read here: `--mem`, `--exclusive`, `--compute`, `--gpus`, `--devices`, `--label`,
//! `--policy`, `--ttl`, `--socket`. Left to clap: `--wait` and the flags that only go with it or that
//! conflict with a command, `--help`, and `--socket` before `reserve`.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;
use gpud_schema::DEFAULT_SOCKET;

use crate::cli::{
    Policy, ReserveArgs, ReserveOutput, parse_compute, parse_duration, parse_label, parse_size,
};

/// The socket and the arguments of `gpuctl reserve FLAGS -- COMMAND`, when `args` (the
/// whole command line, program name first) is one this reads; `None` for anything else.
/// `env_socket` is `GPUD_SOCKET`'s value, if set.
pub fn parse(args: &[OsString], env_socket: Option<&OsStr>) -> Option<(PathBuf, ReserveArgs)> {
    let mut words = args.get(1..)?.iter().map(|a| a.to_str());
    if words.next()? != Some("reserve") {
        return None;
    }
    let mut reserve = ReserveArgs {
        gpus: None,
        devices: Vec::new(),
        mem: None,
        exclusive: false,
        compute: None,
        wait: None,
        // Unused without `--wait`: clap's default (cli::STATUS_EVERY, "30s"), so that both
        // readings are equal, without reading it (humantime) at every start.
        status_every: Duration::from_secs(30),
        ttl: None,
        expect: None,
        holder_pid: None,
        holder_cgroup: None,
        labels: Vec::new(),
        policy: None,
        output: ReserveOutput::Env,
        command: Vec::new(),
    };
    let mut socket: Option<PathBuf> = None;
    loop {
        let word = words.next()??;
        if word == "--" {
            break;
        }
        let (flag, inline) = match word.split_once('=') {
            Some((flag, value)) => (flag, Some(value)),
            None => (word, None),
        };
        if flag == "--exclusive" {
            if inline.is_some() || std::mem::replace(&mut reserve.exclusive, true) {
                return None;
            }
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => words.next()??,
        };
        // An empty value, or one clap would take for a flag: clap says what is wrong.
        if value.is_empty() || value.starts_with('-') {
            return None;
        }
        match flag {
            "--mem" => set_once(&mut reserve.mem, parse_size(value).ok()?)?,
            "--compute" => set_once(&mut reserve.compute, parse_compute(value).ok()?)?,
            "--gpus" => set_once(&mut reserve.gpus, count(value)?)?,
            "--devices" => reserve.devices.extend(value.split(',').map(str::to_owned)),
            "--label" => reserve.labels.push(parse_label(value).ok()?),
            "--policy" => set_once(&mut reserve.policy, Policy::from_str(value, false).ok()?)?,
            "--ttl" => set_once(&mut reserve.ttl, parse_duration(value).ok()?)?,
            "--socket" => set_once(&mut socket, PathBuf::from(value))?,
            _ => return None,
        }
    }
    // `--mem` or `--exclusive`, exactly one (clap's group "size"); `--compute` not with
    // `--exclusive`.
    if reserve.mem.is_some() == reserve.exclusive
        || (reserve.exclusive && reserve.compute.is_some())
    {
        return None;
    }
    for word in words {
        reserve.command.push(word?.to_owned());
    }
    if reserve.command.is_empty() {
        return None;
    }
    let socket = match socket {
        Some(path) => path,
        // As clap reads it (`cli.rs`): `--socket`, else `GPUD_SOCKET` unless empty.
        None => match env_socket {
            Some(path) if !path.is_empty() => PathBuf::from(path.to_str()?),
            _ => PathBuf::from(DEFAULT_SOCKET),
        },
    };
    Some((socket, reserve))
}

/// Sets a flag's value; `None` when it was given before (clap refuses that).
fn set_once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    match slot.replace(value) {
        None => Some(()),
        Some(_) => None,
    }
}

/// `--gpus`: a count from 1, digits only.
fn count(value: &str) -> Option<u32> {
    if !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok().filter(|&n| n >= 1)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::cli::{Cli, Command};

    fn words(line: &str) -> Vec<OsString> {
        std::iter::once("gpuctl")
            .chain(line.split(' '))
            .map(OsString::from)
            .collect()
    }

    /// What clap makes of `args` when it is a `reserve` command line, `GPUD_SOCKET` unset
    /// (the environment is for [`the_socket_is_the_flag_then_gpud_socket_then_the_default`]).
    fn clap_reading(args: &[OsString]) -> Option<(PathBuf, ReserveArgs)> {
        let matches = <Cli as clap::CommandFactory>::command()
            .mut_arg("socket", |a| a.env(None))
            .try_get_matches_from(args)
            .ok()?;
        let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).ok()?;
        match cli.command {
            Command::Reserve(reserve) => Some((cli.socket, reserve)),
            _ => None,
        }
    }

    #[test]
    fn reads_the_usual_exec_lines_as_clap_does() {
        for line in [
            "reserve --mem 6GiB -- python serve.py",
            "reserve --mem 1GiB -- true",
            "reserve --mem=25% --gpus 2 -- ./train.sh --epochs 3",
            "reserve --exclusive --gpus 2 --label job=train --label team=ml -- ./train.sh",
            "reserve --mem 4G --policy spread --devices 0,GPU-1 --ttl 2h -- sleep 1",
            "reserve --socket /tmp/g.sock --mem 512MiB --label=a=b=c -- env -- x",
            "reserve --mem 1.5G --devices 0 --devices 1 -- -dash-command",
            "reserve --mem 8GiB --compute 25 -- python serve.py",
            "reserve --compute=50% --mem=25% --gpus 2 -- ./train.sh",
        ] {
            let args = words(line);
            let fast = parse(&args, None);
            assert!(fast.is_some(), "{line} goes to clap");
            assert_eq!(fast, clap_reading(&args), "{line}");
        }
    }

    #[test]
    fn the_socket_is_the_flag_then_gpud_socket_then_the_default() {
        let socket = |line: &str, env: Option<&str>| {
            parse(&words(line), env.map(OsStr::new)).map(|(socket, _)| socket)
        };
        let line = "reserve --mem 1GiB -- true";
        let flagged = "reserve --socket /flag.sock --mem 1GiB -- true";
        assert_eq!(socket(line, None), Some(PathBuf::from(DEFAULT_SOCKET)));
        assert_eq!(
            socket(line, Some("/env.sock")),
            Some(PathBuf::from("/env.sock"))
        );
        // `GPUD_SOCKET=` in a script means the default, as with clap (`cli::socket_path`).
        assert_eq!(socket(line, Some("")), Some(PathBuf::from(DEFAULT_SOCKET)));
        assert_eq!(
            socket(flagged, Some("/env.sock")),
            Some(PathBuf::from("/flag.sock"))
        );
        // Not UTF-8: clap's error.
        let not_utf8 = std::os::unix::ffi::OsStrExt::from_bytes(b"/\xff.sock");
        assert_eq!(parse(&words(line), Some(not_utf8)), None);
    }

    #[test]
    fn leaves_every_other_line_and_every_mistake_to_clap() {
        for line in [
            "reserve --mem 1GiB",
            "reserve --mem 1GiB --",
            "reserve --mem 1GiB --wait -- true",
            "reserve --mem 1GiB --wait 5m -- true",
            "reserve --mem 1GiB -o json -- true",
            "reserve --mem 1GiB --holder-pid 1 -- true",
            "reserve --mem 1GiB --help -- true",
            "reserve --mem 1GiB --mem 2GiB -- true",
            "reserve --mem 16 -- true",
            "reserve --mem -1GiB -- true",
            "reserve --mem= -- true",
            "reserve --mem 1GiB --exclusive -- true",
            "reserve --gpus 2 -- true",
            "reserve --mem 1GiB --gpus 0 -- true",
            "reserve --mem 1GiB --gpus +1 -- true",
            "reserve --mem 1GiB --label nokey -- true",
            "reserve --mem 1GiB --policy Spread -- true",
            "reserve --mem 1GiB --ttl soon -- true",
            "reserve --exclusive=true -- true",
            "reserve --exclusive --exclusive -- true",
            "reserve --exclusive --compute 25 -- true",
            "reserve --mem 1GiB --compute 0 -- true",
            "reserve --mem 1GiB --compute 101 -- true",
            "reserve --mem 1GiB --compute 12.5 -- true",
            "reserve --mem 1GiB --compute 25 --compute 30 -- true",
            "reserve --mem 1GiB python",
            "--socket /tmp/g.sock reserve --mem 1GiB -- true",
            "ls",
        ] {
            assert_eq!(parse(&words(line), None), None, "{line}");
        }
        assert_eq!(parse(&[OsString::from("gpuctl")], None), None);
    }

    /// Pieces of reserve lines: mostly the flags read here with good values, and some bad
    /// values and flags that are clap's alone.
    fn flag() -> impl Strategy<Value = &'static str> {
        let good = prop::sample::select(vec![
            "--gpus 2",
            "--gpus=1",
            "--devices 0,1",
            "--devices=0,,1",
            "--label job=x",
            "--label=a=b",
            "--policy spread",
            "--policy=binpack",
            "--ttl 90",
            "--ttl 1h30m",
            "--socket /s",
            "--mem 1GiB",
            "--exclusive",
            "--compute 25",
            "--compute=50%",
        ]);
        let other = prop::sample::select(vec![
            "--mem=25%",
            "--mem 16",
            "--mem",
            "--gpus 0",
            "--label =x",
            "--policy Spread",
            "--ttl=-5",
            "--socket=",
            "--compute 0",
            "--compute=101%",
            "--compute 2.5",
            "--wait",
            "--wait 5m",
            "-o json",
            "true",
        ]);
        prop_oneof![4 => good, 1 => other]
    }

    /// A command line of `reserve`: flags, then perhaps `--` and a command.
    fn line() -> impl Strategy<Value = Vec<String>> {
        let command =
            prop::collection::vec(prop::sample::select(vec!["true", "-x", "--", ""]), 1..3);
        let size = prop::sample::select(vec!["--mem 6GiB", "--mem=25%", "--exclusive"]);
        let flags = prop::collection::vec(flag(), 0..5);
        (size, flags, prop::option::weighted(0.9, command)).prop_map(|(size, flags, command)| {
            let mut words: Vec<String> = std::iter::once(size)
                .chain(flags)
                .flat_map(|f| f.split(' '))
                .map(str::to_owned)
                .collect();
            if let Some(command) = command {
                words.push("--".to_owned());
                words.extend(command.iter().map(|w| (*w).to_owned()));
            }
            words
        })
    }

    proptest! {
        /// Whatever line this reads, clap reads the same way; and a line of the flags read
        /// here that clap takes is read here too (not sent to clap's slower path).
        #[test]
        fn agrees_with_clap(line in line()) {
            let mut args = words("reserve");
            args.extend(line.iter().map(OsString::from));
            let fast = parse(&args, None);
            let clap = clap_reading(&args);
            if fast.is_some() {
                prop_assert_eq!(&fast, &clap);
            }
            // Left to clap although clap takes them: an empty value (`--socket=`).
            let clap_only = ["--wait", "-o", "--socket="];
            let before_command = line.split(|w| w == "--").next().unwrap_or(&[]);
            let runs_a_command = clap.as_ref().is_some_and(|(_, r)| !r.command.is_empty());
            if runs_a_command && !before_command.iter().any(|w| clap_only.contains(&w.as_str())) {
                prop_assert_eq!(&fast, &clap, "clap reads it, this does not");
            }
        }
    }
}
