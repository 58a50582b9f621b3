//! `nvidia-cuda-mps-control`: see `fake_mps::control` and README.md.

fn main() -> std::process::ExitCode {
    fake_mps::control::main()
}
