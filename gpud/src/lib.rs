//! gpud: the node-local GPU broker.
//!
//! Modules, dependencies pointing one way (DESIGN.md): `model` ← `placement`, `gpu`;
//! `main.rs` is a thin shell over [`cli`].

pub mod model;
pub mod placement;
