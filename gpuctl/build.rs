//! Links GCC's unwinder into gpuctl statically instead of loading `libgcc_s.so.1`.
//!
//! gpuctl is started for every workload (`gpuctl reserve -- COMMAND`), so its start-up is on
//! every job's path. Each shared library costs a start about 0.1 ms on a small VM (open and
//! map it, relocate it, run its constructors: libgcc_s's probes the CPU with `cpuid`, a trap
//! to the hypervisor there); `benches/gpuctl_start.rs` in gpud-tests measures it. Rust's
//! standard library names libgcc_s only for the unwinder (`_Unwind_*`: panics, backtraces);
//! the same code comes in `libgcc_eh.a`, which GCC links statically for `-static-libgcc`.
//! Listed by this crate, it is searched before the standard library's `-lgcc_s`, so the
//! linker (`--as-needed`) no longer records libgcc_s as needed. Panics still unwind and
//! backtraces still print (gpuctl's tests run with it).
//!
//! Only gpuctl does this: gpud starts once, and loads the NVIDIA library besides.

fn main() {
    println!("cargo:rustc-link-lib=static=gcc_eh");
}
