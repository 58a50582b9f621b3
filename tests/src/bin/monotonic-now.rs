//! Prints CLOCK_MONOTONIC in nanoseconds ([`gpud_tests::monotonic_ns`]) as its first action,
//! then exits: the workload of the `workload_start` benchmark, whose output says when a
//! workload started under `gpuctl reserve -- COMMAND` got to run its first instruction.

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    match gpud_tests::monotonic_ns() {
        Ok(now) => {
            if writeln!(std::io::stdout(), "{now}").is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("monotonic-now: clock_gettime(CLOCK_MONOTONIC): {e}");
            ExitCode::FAILURE
        }
    }
}
