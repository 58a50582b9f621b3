//! `fake-cuda-client`: see `fake_mps::client` and README.md.

fn main() -> std::process::ExitCode {
    fake_mps::client::main()
}
