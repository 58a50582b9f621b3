//! `nvidia-cuda-mps-server`: see `fake_mps::server` and README.md.

fn main() -> std::process::ExitCode {
    fake_mps::server::main()
}
